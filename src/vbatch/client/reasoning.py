"""Reasoning parsers: a thinking model's `<think>…</think>` part split from its answer."""

from __future__ import annotations

from enum import Enum

from vbatch.errors import InputError

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


# NOTE: `think` and `qwen3` read an output without tags as all answer (Qwen3 with thinking
# off); `deepseek_r1` reads it as all reasoning, since R1's template opens `<think>` itself.
class ReasoningParser(str, Enum):
    THINK = "think"
    QWEN3 = "qwen3"
    DEEPSEEK_R1 = "deepseek_r1"


REASONING_PARSERS = tuple(p.value for p in ReasoningParser)


def check_reasoning_parser(name: str | None) -> str | None:
    if name is not None and name not in REASONING_PARSERS:
        raise InputError(
            f"unknown reasoning parser {name!r}; choose one of {', '.join(REASONING_PARSERS)}"
        )
    return name


def sample_parser(parser: str | None, constrained: bool) -> str | None:
    """The parser for one sample. Under a grammar, which holds from its first token, a sample
    cannot start inside a `<think>` its template opened (deepseek_r1's reading of an untagged
    output), so only the tags the grammar let it write mark reasoning."""
    if constrained and parser == ReasoningParser.DEEPSEEK_R1:
        return ReasoningParser.THINK.value
    return parser


def split_reasoning(text: str, parser: str) -> tuple[str | None, str]:
    """(reasoning, answer) of one output; reasoning is None when the output has none.

    The reasoning runs from an opening `<think>` (or from the start, when the template opened
    it and only `</think>` appears) to `</think>`, or to the end when the output stopped
    before closing it (the answer is then empty). Whitespace around the reasoning and before
    the answer is dropped, and so, as vLLM's parsers do, is any text before `<think>`."""
    opening = text.find(THINK_OPEN)
    closing = text.find(THINK_CLOSE)
    is_open = opening >= 0 and (closing < 0 or opening < closing)
    body = text[opening + len(THINK_OPEN) :] if is_open else text.lstrip()
    end = body.find(THINK_CLOSE)
    if end >= 0:
        return body[:end].strip(), body[end + len(THINK_CLOSE) :].lstrip()
    if is_open or parser == "deepseek_r1":
        return body.strip(), ""
    return None, text
