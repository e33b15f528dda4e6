"""Tests for output rows: vbatch rows, OpenAI Batch lines, JSONL bytes and Parquet values."""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING

import orjson
import pyarrow as pa
import pytest

from vbatch.errors import JobStateError
from vbatch.job.results import (
    TokenStrings,
    error_row,
    jsonl_bytes,
    line_index,
    openai_line,
    parquet_schema,
    parquet_values,
    result_row,
)
from vbatch.job.rows import InputRow
from vbatch.llm import CompletionOutput, RequestOutput
from vbatch.protocol import TokenLogprobs

if TYPE_CHECKING:
    from vbatch.client.tokenizer import TextTokenizer


def make_result(outputs: list[CompletionOutput], error: str | None = None) -> RequestOutput:
    return RequestOutput(
        request_id="a",
        index=3,
        prompt="p",
        prompt_token_ids=[1, 2, 3, 4],
        outputs=outputs,
        num_cached_tokens=2,
        arrival_time=100.0,
        first_token_time=100.25,
        finish_time=101.5,
        error=error,
    )


def test_single_sample_row() -> None:
    row = InputRow(3, "line 4", "a", prompt="p")
    values = result_row(
        row, make_result([CompletionOutput(0, "hi", [7, 8], "stop", "\n")]), include_token_ids=True
    )
    assert values["id"] == "a" and values["index"] == 3 and values["text"] == "hi"
    assert values["texts"] is None and values["finish_reason"] == "stop"
    assert (values["prompt_tokens"], values["completion_tokens"], values["cached_tokens"]) == (
        4,
        2,
        2,
    )
    assert values["token_ids"] == [[7, 8]] and values["logprobs"] is None
    assert (values["ttft_s"], values["latency_s"], values["error"]) == (0.25, 1.5, None)
    line = orjson.loads(jsonl_bytes(values, {"topic": "x"}))
    assert "texts" not in line and line["topic"] == "x" and line["error"] is None


def test_multi_sample_row_with_logprobs() -> None:
    lp = TokenLogprobs(-0.5, [7, 9], [-0.5, -1.0])
    outputs = [
        CompletionOutput(0, "a", [7], "length", None, [lp]),
        CompletionOutput(1, "b", [7], "stop", 2, [lp]),
    ]
    values = result_row(InputRow(3, "line 4", "a"), make_result(outputs), include_token_ids=False)
    assert values["text"] is None and values["texts"] == ["a", "b"]
    assert values["finish_reasons"] == ["length", "stop"] and values["completion_tokens"] == 2
    assert values["logprobs"][1] == [
        {"token_id": 7, "logprob": -0.5, "top_token_ids": [7, 9], "top_logprobs": [-0.5, -1.0]}
    ]
    table = pa.Table.from_pylist(
        [parquet_values(values, None, "str", False)], schema=parquet_schema("str", [])
    )
    assert table.column("texts").to_pylist() == [["a", "b"]]


def test_reasoning_parser_moves_the_think_part_to_its_columns() -> None:
    row = InputRow(3, "line 4", "a", messages=[{"role": "user", "content": "q"}])
    single = make_result([CompletionOutput(0, "<think>hm</think>\n\n42", [7], "stop")])
    values = result_row(row, single, include_token_ids=False, reasoning_parser="qwen3")
    assert (values["text"], values["reasoning"], values["reasonings"]) == ("42", "hm", None)
    plain = result_row(row, single, include_token_ids=False)
    assert plain["text"] == "<think>hm</think>\n\n42" and plain["reasoning"] is None
    assert "reasoning" not in orjson.loads(jsonl_bytes(plain, None))
    outputs = [
        CompletionOutput(0, "<think>a</think>x", [7], "stop"),
        CompletionOutput(1, "<think>cut sho", [7], "length"),
        # NOTE: an LLM made with a reasoning parser split it already; that split is kept.
        CompletionOutput(2, "y", [7], "stop", reasoning="b"),
    ]
    values = result_row(
        row, make_result(outputs), include_token_ids=False, reasoning_parser="think"
    )
    assert values["texts"] == ["x", "", "y"] and values["reasonings"] == ["a", "cut sho", "b"]
    assert values["text"] is None and values["reasoning"] is None
    line = openai_line(row, values, "m", str)
    messages = [c["message"] for c in line["response"]["body"]["choices"]]
    assert messages[1] == {
        "role": "assistant",
        "content": "",
        "refusal": None,
        "reasoning_content": "cut sho",
    }
    schema = parquet_schema("str", [], reasoning=True)
    table = pa.Table.from_pylist([parquet_values(values, None, "str", False)], schema=schema)
    assert table.column("reasonings").to_pylist() == [["a", "cut sho", "b"]]
    assert "reasoning" not in parquet_schema("str", []).names


def test_engine_error_becomes_error_row_with_location() -> None:
    row = InputRow(3, "line 4", "a", prompt="p")
    values = result_row(
        row,
        make_result([CompletionOutput(0, "", [], "error")], "prompt too long"),
        include_token_ids=False,
    )
    assert values["finish_reason"] == "error" and values["error"] == "line 4: prompt too long"
    assert values["prompt_tokens"] == 4 and values["text"] is None


def test_openai_chat_and_completion_lines() -> None:
    lp = TokenLogprobs(-0.5, [7], [-0.5])
    result = make_result([CompletionOutput(0, "hi", [7], "stop", None, [lp])])
    chat_row = InputRow(3, "line 4", "req-3", openai_kind="chat")
    values = result_row(chat_row, result, include_token_ids=False)
    line = openai_line(chat_row, values, "smol", lambda t: f"<{t}>")
    assert line["id"] == "vbatch_req_3" and line["custom_id"] == "req-3" and line["error"] is None
    body = line["response"]["body"]
    assert line["response"]["status_code"] == 200 and body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "hi", "refusal": None}
    assert body["choices"][0]["logprobs"]["content"][0]["token"] == "<7>"
    assert body["usage"]["total_tokens"] == 5 and body["model"] == "smol"
    assert line_index(jsonl_bytes(line, None)) == 3
    text_row = InputRow(3, "line 4", "req-3", openai_kind="completions")
    text_line = openai_line(
        text_row, result_row(text_row, result, include_token_ids=False), "smol", str
    )
    choice = text_line["response"]["body"]["choices"][0]
    assert choice["text"] == "hi" and choice["logprobs"]["tokens"] == ["7"]
    error = openai_line(text_row, error_row(text_row, "line 4: bad"), "smol", str)
    assert error["response"] is None and error["error"]["message"] == "line 4: bad"


def test_each_openai_choice_has_its_stop_reason_as_vllm_writes_it() -> None:
    result = make_result(
        [
            CompletionOutput(0, "a", [5], "stop", "\n\n"),
            CompletionOutput(1, "b", [6], "stop", 7),
            CompletionOutput(2, "c", [8], "length", None),
        ]
    )
    row = InputRow(0, "line 1", "r", openai_kind="chat")
    values = result_row(row, result, include_token_ids=False)
    choices = openai_line(row, values, "smol", str)["response"]["body"]["choices"]
    assert [c["stop_reason"] for c in choices] == ["\n\n", 7, None]
    single = make_result([CompletionOutput(0, "a", [5], "stop", "x")])
    values = result_row(row, single, include_token_ids=False)
    (choice,) = openai_line(row, values, "smol", str)["response"]["body"]["choices"]
    assert choice["stop_reason"] == "x"


def test_parquet_values_stringify_stop_reason_and_ids() -> None:
    values = error_row(InputRow(5, "row 6", 42), "row 6: bad")
    values["stop_reason"] = 2
    out = parquet_values(values, {"meta": {"k": 1}}, "str", True)
    assert out["id"] == "42" and out["stop_reason"] == "2" and out["meta"] == '{"k":1}'
    assert line_index(jsonl_bytes(values, None)) == 5
    # NOTE: a JSONL null (or a missing key, read as None) is a Parquet null, not the text "null".
    nothing = parquet_values(values, {"meta": None, "flag": False}, "str", True)
    assert nothing["meta"] is None and nothing["flag"] == "false"


def test_openai_custom_id_is_always_a_string() -> None:
    # NOTE: a malformed line's id is not a string (today its index); OpenAI's custom_id is.
    malformed = InputRow(8, "line 9", 8, error="line 9: invalid JSON")
    line = openai_line(malformed, error_row(malformed, malformed.error), "smol", str)
    assert line["custom_id"] == "8" and line["id"] == "vbatch_req_8"
    unreadable = InputRow(2, "line 3", None, error="line 3: bad id")
    assert openai_line(unreadable, error_row(unreadable, "x"), "smol", str)["custom_id"] == ""
    result = make_result([CompletionOutput(0, "hi", [7], "stop", None)])
    int_id = InputRow(3, "line 4", 7, openai_kind="chat")
    values = result_row(int_id, result, include_token_ids=False)
    assert openai_line(int_id, values, "smol", str)["custom_id"] == "7"


def test_openai_logprobs_carry_bytes_and_text_offset(tokenizer: TextTokenizer) -> None:
    tokens = TokenStrings(lambda: tokenizer)
    emoji = tokenizer.encode_batch(["😀"], add_special_tokens=False)[0]
    # NOTE: SmolLM2 splits the emoji's 4 bytes over 3 tokens; each decodes alone to U+FFFD.
    assert len(emoji) > 1 and all(tokens.text(t) == "\ufffd" for t in emoji)
    assert b"".join(bytes(tokens.bytes(t)) for t in emoji) == "😀".encode()
    assert tokens.bytes(tokenizer.eos_token_id) == list(b"<|im_end|>")

    ids = tokenizer.encode_batch([" héllo 😀 wörld"], add_special_tokens=False)[0]
    text = tokenizer.decode(ids)
    entries = [TokenLogprobs(-0.1, [t, 0], [-0.1, -2.0]) for t in ids]
    result = make_result([CompletionOutput(0, text, ids, "length", None, entries)])

    chat_row = InputRow(3, "line 4", "c", openai_kind="chat")
    chat_values = result_row(chat_row, result, include_token_ids=False)
    line = openai_line(chat_row, chat_values, "smol", tokens.text, tokens.bytes)
    logprobs = line["response"]["body"]["choices"][0]["logprobs"]
    assert logprobs["refusal"] is None
    content = logprobs["content"]
    assert [set(e) for e in content] == [{"token", "logprob", "bytes", "top_logprobs"}] * len(ids)
    assert b"".join(bytes(e["bytes"]) for e in content) == text.encode()
    top = content[0]["top_logprobs"]
    assert top[1] == {"token": tokens.text(0), "logprob": -2.0, "bytes": tokens.bytes(0)}

    prompt = "Say: ø"
    text_row = InputRow(3, "line 4", "t", prompt=prompt, openai_kind="completions")
    text_values = result_row(text_row, result, include_token_ids=False)
    choice = openai_line(text_row, text_values, "smol", tokens.text, tokens.bytes)["response"][
        "body"
    ]["choices"][0]
    logprobs = choice["logprobs"]
    assert set(logprobs) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    offsets = logprobs["text_offset"]
    # NOTE: as OpenAI: character offsets into prompt + completion, the first at len(prompt).
    full = prompt + choice["text"]
    assert offsets[0] == len(prompt) and len(offsets) == len(ids)
    # NOTE: the tokens after the emoji (split over two tokens) still line up with the text.
    assert "\ufffd" in logprobs["tokens"][-4]
    for token, offset in zip(logprobs["tokens"], offsets):
        if "\ufffd" not in token:
            assert full[offset : offset + len(token)] == token
    assert offsets[-1] + len(logprobs["tokens"][-1]) == len(full)


def test_parquet_values_refuse_an_id_the_int64_column_cannot_hold() -> None:
    values = error_row(InputRow(5, "line 6", 2**63), "line 6: bad")
    assert parquet_values(values, None, "str", False)["id"] == str(2**63)
    with pytest.raises(JobStateError, match=r"64-bit integers.*--overwrite"):
        parquet_values(values, None, "int", False)
    values["id"] = 2**63 - 1
    assert parquet_values(values, None, "int", False)["id"] == 2**63 - 1


def test_masked_alternatives_are_left_out_of_top_logprobs() -> None:
    """A grammar's forbidden tokens (-inf) are never written, as null or otherwise."""
    lp = TokenLogprobs(-0.1, [7, 9, 11], [-0.1, -2.5, -math.inf])
    result = make_result([CompletionOutput(0, "a", [7], "stop", None, [lp], True)])
    chat_row = InputRow(3, "line 4", "r", openai_kind="chat")
    values = result_row(chat_row, result, include_token_ids=False)
    assert values["logprobs"][0][0]["top_token_ids"] == [7, 9]
    assert values["logprobs"][0][0]["top_logprobs"] == [-0.1, -2.5]
    line = openai_line(chat_row, values, "smol", str)
    top = line["response"]["body"]["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
    assert [t["logprob"] for t in top] == [-0.1, -2.5]
    written = orjson.loads(jsonl_bytes(values, None))["logprobs"][0][0]
    assert written["top_logprobs"] == [-0.1, -2.5] and None not in written["top_logprobs"]


def test_structured_flags_reach_openai_lines_and_an_invalid_output_can_be_an_error() -> None:
    def check(texts: list[str]) -> str | None:
        return None if list(texts) == ['{"a": 1}'] else "bad"

    chat_row = InputRow(3, "line 4", "r", openai_kind="chat")
    cut = make_result([CompletionOutput(0, '{"a": ', [7], "length", None, None, False)])
    values = result_row(chat_row, cut, include_token_ids=False, check=check)
    assert (values["structured_complete"], values["structured_valid"]) == (False, None)
    choice = openai_line(chat_row, values, "smol", str)["response"]["body"]["choices"][0]
    assert choice["structured_complete"] is False and "structured_valid" not in choice
    good = make_result([CompletionOutput(0, '{"a": 1}', [7], "stop", None, None, True)])
    values = result_row(chat_row, good, include_token_ids=False, check=check)
    choice = openai_line(chat_row, values, "smol", str)["response"]["body"]["choices"][0]
    assert choice["structured_complete"] is True and choice["structured_valid"] is True
    bad = make_result([CompletionOutput(0, '{"a": 2}', [7], "stop", None, None, True)])
    assert (
        result_row(chat_row, bad, include_token_ids=False, check=check)["structured_valid"] is False
    )
    refused = result_row(chat_row, bad, include_token_ids=False, check=check, require_valid=True)
    assert refused["error"] == "line 4: bad" and refused["structured_valid"] is False


def test_each_openai_choice_has_its_own_sample_s_structured_flags() -> None:
    """n = 3: a sample cut at the length limit, one complete and valid, one complete and
    invalid; the row's flags are over all three, each choice's its own."""

    def check(texts: list[str]) -> str | None:
        return None if all(text == '{"a": 1}' for text in texts) else "bad"

    outputs = [
        CompletionOutput(0, '{"a": ', [7], "length", None, None, False),
        CompletionOutput(1, '{"a": 1}', [7], "stop", None, None, True),
        CompletionOutput(2, '{"a": 2}', [7], "stop", None, None, True),
    ]
    chat_row = InputRow(3, "line 4", "r", openai_kind="chat")
    values = result_row(chat_row, make_result(outputs), include_token_ids=False, check=check)
    assert (values["structured_complete"], values["structured_valid"]) == (False, None)
    choices = openai_line(chat_row, values, "smol", str)["response"]["body"]["choices"]
    flags = [(c["structured_complete"], c.get("structured_valid")) for c in choices]
    assert flags == [(False, None), (True, True), (True, False)]


def test_completions_top_logprobs_hold_the_sampled_token_first() -> None:
    """As OpenAI's legacy completions and vLLM: up to logprobs + 1 entries, the sampled token
    first, whatever its rank; logprobs 0 gives the sampled token's alone."""
    entries = [
        TokenLogprobs(-2.0, [5], [-0.5], 3),
        TokenLogprobs(-0.5, [6], [-0.5], 1),
        TokenLogprobs(-1.0, [], [], 2),
    ]
    result = make_result([CompletionOutput(0, "abc", [7, 6, 8], "length", None, entries)])
    row = InputRow(3, "line 4", "t", prompt="p", openai_kind="completions")
    values = result_row(row, result, include_token_ids=False)
    choice = openai_line(row, values, "smol", str)["response"]["body"]["choices"][0]
    top = choice["logprobs"]["top_logprobs"]
    assert top == [{"7": -2.0, "5": -0.5}, {"6": -0.5}, {"8": -1.0}]
    assert [next(iter(t)) for t in top] == ["7", "6", "8"]


def test_parse_json_keeps_integers_beyond_64_bits_exact() -> None:
    text = '{"big": 1234567890123456789012345, "neg": -98765432109876543210, "f": 1.5}'
    result = make_result([CompletionOutput(0, text, [7], "stop", None, None, True)])
    row = InputRow(3, "line 4", "a", prompt="p")
    values = result_row(row, result, include_token_ids=False, parse_json=True)
    assert json.loads(jsonl_bytes(values, None))["json"] == json.loads(text)
    stored = parquet_values(values, None, "str", False)["json"]
    assert json.loads(stored) == json.loads(text)
    small = make_result([CompletionOutput(0, '{"n": 5}', [7], "stop", None, None, True)])
    assert result_row(row, small, include_token_ids=False, parse_json=True)["json"] == {"n": 5}


def test_echo_and_reasoning_leave_a_constrained_completion_whole_for_its_checks() -> None:
    """An echoed prompt is not part of what the JSON check and --parse-json read; a constrained
    sample's untagged text is its answer even for deepseek_r1 (its grammar held from the first
    token), and a completions line's text is not split (as vLLM's /v1/completions)."""

    def check(texts: list[str]) -> str | None:
        return None if list(texts) == ['{"a": 1}'] else f"bad {list(texts)}"

    done = make_result([CompletionOutput(0, '{"a": 1}', [7], "stop", None, None, True)])
    echoed = InputRow(3, "line 4", "r", prompt="Q:", openai_kind="completions", echo=True)
    values = result_row(echoed, done, include_token_ids=False, check=check, parse_json=True)
    assert values["text"] == 'Q:{"a": 1}' and values["structured_valid"] is True
    assert values["json"] == {"a": 1}
    chat = InputRow(3, "line 4", "r", openai_kind="chat")
    values = result_row(
        chat, done, include_token_ids=False, check=check, reasoning_parser="deepseek_r1"
    )
    assert values["text"] == '{"a": 1}' and values["reasoning"] is None
    assert values["structured_valid"] is True
    thought = make_result([CompletionOutput(0, "<think>x</think>y", [7], "stop", None)])
    completion = InputRow(3, "line 4", "r", prompt="Q", openai_kind="completions")
    values = result_row(completion, thought, include_token_ids=False, reasoning_parser="qwen3")
    assert values["text"] == "<think>x</think>y" and values["reasoning"] is None
    values = result_row(chat, thought, include_token_ids=False, reasoning_parser="qwen3")
    assert (values["reasoning"], values["text"]) == ("x", "y")


def test_text_offsets_count_an_invalid_byte_as_its_one_replacement_character(
    tokenizer: TextTokenizer,
) -> None:
    """A lone continuation byte decodes to one U+FFFD in the text; offsets counted lead bytes
    only, so every token after it was one character early (`[0, 5, 5]` for ' plas', 0x83,
    ' exploratory')."""
    tokens = TokenStrings(lambda: tokenizer)
    stray = next(t for t in range(tokenizer.vocab_size) if tokens.bytes(t) == [0x83])
    ids = [
        *tokenizer.encode_batch([" plas"], add_special_tokens=False)[0],
        stray,
        *tokenizer.encode_batch([" exploratory 😀 ok"], add_special_tokens=False)[0],
    ]
    text = tokenizer.decode(ids)
    entries = [TokenLogprobs(-0.1, [t], [-0.1]) for t in ids]
    result = make_result([CompletionOutput(0, text, ids, "length", None, entries)])
    row = InputRow(0, "line 1", "t", prompt="", openai_kind="completions")
    values = result_row(row, result, include_token_ids=False)
    choice = openai_line(row, values, "smol", tokens.text, tokens.bytes)["response"]["body"][
        "choices"
    ][0]
    logprobs = choice["logprobs"]
    for token, offset in zip(logprobs["tokens"], logprobs["text_offset"], strict=True):
        if "\ufffd" not in token:
            assert choice["text"][offset : offset + len(token)] == token, (token, offset)
    assert logprobs["text_offset"][:3] == [0, 5, 6]
