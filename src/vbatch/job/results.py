"""Output rows: one finished request (or one error) as a vbatch row or an OpenAI Batch line."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import orjson

from vbatch.job.rows import InputRow

if TYPE_CHECKING:
    import pyarrow as pa

    from vbatch.llm import CompletionOutput, RequestOutput

# NOTE: fixed key order; the optional ones (texts, finish_reasons, token_ids, logprobs,
# structured_complete, json) are omitted from JSONL lines when null and are null columns in
# Parquet, which has a `json` column only with --parse-json.
OUTPUT_COLUMNS = (
    "id",
    "index",
    "text",
    "texts",
    "finish_reason",
    "finish_reasons",
    "stop_reason",
    "prompt_tokens",
    "completion_tokens",
    "cached_tokens",
    "token_ids",
    "logprobs",
    "ttft_s",
    "latency_s",
    "error",
    "structured_complete",
    "json",
)
OPTIONAL_COLUMNS = frozenset(
    {"texts", "finish_reasons", "token_ids", "logprobs", "structured_complete", "json"}
)
OPENAI_ID_PREFIX = "vbatch_req_"


def _logprob_entries(output: CompletionOutput) -> list[dict[str, Any]] | None:
    if output.logprobs is None:
        return None
    return [
        {
            "token_id": token_id,
            "logprob": entry.logprob,
            "top_token_ids": list(entry.top_token_ids),
            "top_logprobs": list(entry.top_logprobs),
        }
        for token_id, entry in zip(output.token_ids, output.logprobs, strict=False)
    ]


def result_row(
    row: InputRow, result: RequestOutput, *, include_token_ids: bool, parse_json: bool = False
) -> dict[str, Any]:
    """The vbatch output row (DESIGN.md section 5) for a finished request; `parse_json` adds
    the parsed text (None where it is not JSON), a list of them for n > 1."""
    if result.error is not None:
        return error_row(row, f"{row.location}: {result.error}", len(result.prompt_token_ids))
    outputs = result.outputs
    first = outputs[0]
    is_multi = len(outputs) > 1
    has_logprobs = any(o.logprobs is not None for o in outputs)
    stop_reason = first.stop_reason
    return {
        "id": row.id,
        "index": row.index,
        "text": None if is_multi else first.text,
        "texts": [o.text for o in outputs] if is_multi else None,
        "finish_reason": first.finish_reason,
        "finish_reasons": [o.finish_reason for o in outputs] if is_multi else None,
        "stop_reason": stop_reason,
        "prompt_tokens": len(result.prompt_token_ids),
        "completion_tokens": sum(len(o.token_ids) for o in outputs),
        "cached_tokens": result.num_cached_tokens,
        "token_ids": [list(o.token_ids) for o in outputs] if include_token_ids else None,
        "logprobs": [_logprob_entries(o) for o in outputs] if has_logprobs else None,
        "ttft_s": _elapsed(result.arrival_time, result.first_token_time),
        "latency_s": _elapsed(result.arrival_time, result.finish_time),
        "error": None,
        "structured_complete": _structured_complete(outputs),
        "json": _parsed(outputs, is_multi) if parse_json else None,
    }


def _structured_complete(outputs: list[CompletionOutput]) -> bool | None:
    """With structured output, whether every sample completed its constraint; else None."""
    flags = [o.structured_complete for o in outputs]
    return None if flags[0] is None else all(flags)


def _parsed(outputs: list[CompletionOutput], is_multi: bool) -> Any:
    values = []
    for output in outputs:
        try:
            values.append(orjson.loads(output.text))
        except orjson.JSONDecodeError:
            values.append(None)
    return values if is_multi else values[0]


def error_row(row: InputRow, message: str, prompt_tokens: int = 0) -> dict[str, Any]:
    values: dict[str, Any] = dict.fromkeys(OUTPUT_COLUMNS)
    values.update(
        id=row.id,
        index=row.index,
        finish_reason="error",
        prompt_tokens=prompt_tokens,
        completion_tokens=0,
        cached_tokens=0,
        error=message,
    )
    return values


def _elapsed(start: float, end: float | None) -> float | None:
    return None if end is None else round(end - start, 6)


def openai_line(
    row: InputRow, values: dict[str, Any], model_name: str, token_text: Callable[[int], str]
) -> dict[str, Any]:
    """The OpenAI Batch output line for a vbatch row of an OpenAI Batch input row."""
    line_id = f"{OPENAI_ID_PREFIX}{row.index}"
    if values["error"] is not None:
        return {
            "id": line_id,
            "custom_id": row.id,
            "response": None,
            "error": {"code": "invalid_request", "message": values["error"]},
        }
    texts = values["texts"] or [values["text"]]
    reasons = values["finish_reasons"] or [values["finish_reason"]]
    logprobs = values["logprobs"] or [None] * len(texts)
    is_chat = row.openai_kind == "chat" or (row.openai_kind is None and row.messages is not None)
    choices = []
    for i, (text, reason, entries) in enumerate(zip(texts, reasons, logprobs, strict=False)):
        choice: dict[str, Any] = {"index": i}
        if is_chat:
            choice["message"] = {"role": "assistant", "content": text}
            choice["logprobs"] = _chat_logprobs(entries, token_text)
        else:
            choice["text"] = text
            choice["logprobs"] = _completion_logprobs(entries, token_text)
        choice["finish_reason"] = reason
        choices.append(choice)
    body = {
        "id": f"{'chatcmpl' if is_chat else 'cmpl'}-vbatch-{row.index}",
        "object": "chat.completion" if is_chat else "text_completion",
        "created": int(time.time()),
        "model": model_name,
        "choices": choices,
        "usage": {
            "prompt_tokens": values["prompt_tokens"],
            "completion_tokens": values["completion_tokens"],
            "total_tokens": values["prompt_tokens"] + values["completion_tokens"],
            "prompt_tokens_details": {"cached_tokens": values["cached_tokens"]},
        },
    }
    response = {"status_code": 200, "request_id": f"vbatch-{row.index}", "body": body}
    return {"id": line_id, "custom_id": row.id, "response": response, "error": None}


def _chat_logprobs(
    entries: list[dict[str, Any]] | None, token_text: Callable[[int], str]
) -> dict[str, Any] | None:
    if entries is None:
        return None
    content = []
    for entry in entries:
        top = [
            {"token": token_text(t), "logprob": lp}
            for t, lp in zip(entry["top_token_ids"], entry["top_logprobs"], strict=False)
        ]
        content.append(
            {
                "token": token_text(entry["token_id"]),
                "logprob": entry["logprob"],
                "top_logprobs": top,
            }
        )
    return {"content": content}


def _completion_logprobs(
    entries: list[dict[str, Any]] | None, token_text: Callable[[int], str]
) -> dict[str, Any] | None:
    if entries is None:
        return None
    return {
        "tokens": [token_text(e["token_id"]) for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [
            {
                token_text(t): lp
                for t, lp in zip(e["top_token_ids"], e["top_logprobs"], strict=False)
            }
            for e in entries
        ],
    }


def line_index(line: bytes) -> int:
    """The input index of one output JSONL line, in either output shape."""
    values = orjson.loads(line)
    if "index" in values:
        return values["index"]
    return int(values["id"].removeprefix(OPENAI_ID_PREFIX))


def jsonl_bytes(values: dict[str, Any], kept: dict[str, Any] | None) -> bytes:
    out = {k: v for k, v in values.items() if v is not None or k not in OPTIONAL_COLUMNS}
    if kept:
        out.update(kept)
    return orjson.dumps(out, option=orjson.OPT_APPEND_NEWLINE | orjson.OPT_SERIALIZE_NUMPY)


def parquet_schema(
    id_kind: str,
    kept_columns: Sequence[str] = (),
    input_schema: pa.Schema | None = None,
    parse_json: bool = False,
) -> pa.Schema:
    """The fixed Parquet schema of every part and of the final file. Kept columns keep their
    Parquet input type; kept JSONL values are stored as JSON text, as is `json` (parse_json)."""
    import pyarrow as pa

    if input_schema is not None:
        kept_fields = [input_schema.field(name) for name in kept_columns]
    else:
        kept_fields = [pa.field(name, pa.string()) for name in kept_columns]

    logprob = pa.struct(
        [
            ("token_id", pa.int32()),
            ("logprob", pa.float64()),
            ("top_token_ids", pa.list_(pa.int32())),
            ("top_logprobs", pa.list_(pa.float64())),
        ]
    )
    fields = [
        ("id", pa.int64() if id_kind == "int" else pa.string()),
        ("index", pa.int64()),
        ("text", pa.string()),
        ("texts", pa.list_(pa.string())),
        ("finish_reason", pa.string()),
        ("finish_reasons", pa.list_(pa.string())),
        ("stop_reason", pa.string()),
        ("prompt_tokens", pa.int64()),
        ("completion_tokens", pa.int64()),
        ("cached_tokens", pa.int64()),
        ("token_ids", pa.list_(pa.list_(pa.int32()))),
        ("logprobs", pa.list_(pa.list_(logprob))),
        ("ttft_s", pa.float64()),
        ("latency_s", pa.float64()),
        ("error", pa.string()),
        ("structured_complete", pa.bool_()),
    ]
    if parse_json:
        fields.append(("json", pa.string()))
    return pa.schema([pa.field(n, t) for n, t in fields] + list(kept_fields))


def parquet_values(
    values: dict[str, Any], kept: dict[str, Any] | None, id_kind: str, json_kept: bool
) -> dict[str, Any]:
    """A row as Parquet wants it: stop_reason and str ids as text, JSONL-input kept values JSON."""
    out = dict(values)
    if out["stop_reason"] is not None:
        out["stop_reason"] = str(out["stop_reason"])
    if id_kind == "str" and out["id"] is not None:
        out["id"] = str(out["id"])
    if out["json"] is not None:
        out["json"] = orjson.dumps(out["json"]).decode()
    if kept:
        for name, value in kept.items():
            out[name] = orjson.dumps(value).decode() if json_kept else value
    return out
