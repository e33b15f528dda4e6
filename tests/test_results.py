"""Tests for output rows: vbatch rows, OpenAI Batch lines, JSONL bytes and Parquet values."""

from __future__ import annotations

import orjson
import pyarrow as pa

from vbatch.job.results import (
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
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "hi"}
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


def test_parquet_values_stringify_stop_reason_and_ids() -> None:
    values = error_row(InputRow(5, "row 6", 42), "row 6: bad")
    values["stop_reason"] = 2
    out = parquet_values(values, {"meta": {"k": 1}}, "str", True)
    assert out["id"] == "42" and out["stop_reason"] == "2" and out["meta"] == '{"k":1}'
    assert line_index(jsonl_bytes(values, None)) == 5
