"""Tests for the reasoning parsers: the `<think>` part split from the answer."""

from __future__ import annotations

import pytest

from vbatch.client.reasoning import REASONING_PARSERS, check_reasoning_parser, split_reasoning
from vbatch.errors import InputError


@pytest.mark.parametrize("parser", REASONING_PARSERS)
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("<think>\nLet me add.\n</think>\n\nThe sum is 4.", ("Let me add.", "The sum is 4.")),
        ("  <think>a</think>b", ("a", "b")),
        ("<think>\n\n</think>\n\nHi", ("", "Hi")),
        ("Let me add.\n</think>\n\n4", ("Let me add.", "4")),
        ("<think>\nstill thinking when max_tokens hit", ("still thinking when max_tokens hit", "")),
        ("<think>a</think>b</think>c", ("a", "b</think>c")),
        # NOTE: as vLLM's parsers: text before <think> is dropped, not reasoning with the tag.
        ("Sure. <think>plan</think> Answer", ("plan", "Answer")),
    ],
)
def test_tags_split_reasoning_from_the_answer(
    parser: str, text: str, expected: tuple[str, str]
) -> None:
    assert split_reasoning(text, parser) == expected


def test_an_output_without_tags_is_the_answer_except_for_deepseek_r1() -> None:
    text = "  The answer is 4."
    assert split_reasoning(text, "think") == (None, text)
    assert split_reasoning(text, "qwen3") == (None, text)
    # NOTE: R1's template opens <think> itself, so an output that never closes it is truncated.
    assert split_reasoning(text, "deepseek_r1") == ("The answer is 4.", "")


def test_unknown_parser_is_a_clear_error() -> None:
    assert check_reasoning_parser(None) is None
    assert check_reasoning_parser("qwen3") == "qwen3"
    with pytest.raises(InputError, match="unknown reasoning parser 'r1'; choose one of think"):
        check_reasoning_parser("r1")
