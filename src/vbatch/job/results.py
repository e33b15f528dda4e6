"""Output rows: one finished request (or one error) as a vbatch row or an OpenAI Batch line."""

from __future__ import annotations

import codecs
import json
import math
import re
import time
from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import orjson

from vbatch.client.reasoning import sample_parser, split_reasoning
from vbatch.errors import JobStateError
from vbatch.job.encoding import fits_int64, json_default, parquet_kept_type
from vbatch.job.rows import InputRow
from vbatch.job.tasks import OPTIONAL_TASK_COLUMNS, openai_embeddings_body

if TYPE_CHECKING:
    import pyarrow as pa

    from vbatch.client.tokenizer import TextTokenizer
    from vbatch.llm import CompletionOutput, RequestOutput

# NOTE: fixed key order; the optional ones (reasoning, texts, reasonings, finish_reasons,
# token_ids, logprobs, structured_complete, structured_valid, json) are omitted from JSONL lines
# when null and are
# null columns in Parquet, which has a `json` column only with --parse-json and the reasoning
# columns only with --reasoning-parser.
OUTPUT_COLUMNS = (
    "id",
    "index",
    "lora",
    "text",
    "reasoning",
    "texts",
    "reasonings",
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
    "structured_valid",
    "json",
)
OPTIONAL_COLUMNS = frozenset(
    {
        "lora",
        "reasoning",
        "texts",
        "reasonings",
        "finish_reasons",
        "token_ids",
        "logprobs",
        "structured_complete",
        "structured_valid",
        "json",
    }
)
# NOTE: keys of result_row's values that are not output columns, for an OpenAI line's choices:
# each sample's (structured_complete, structured_valid), and each sample's stop_reason with n > 1;
# taken out before the row is written (job/execution.py).
SAMPLE_FLAGS = "structured_samples"
SAMPLE_STOP_REASONS = "sample_stop_reasons"
HIDDEN_KEYS = (SAMPLE_FLAGS, SAMPLE_STOP_REASONS)
OPENAI_ID_PREFIX = "vbatch_req_"
# NOTE: a run of digits that may not fit 64 bits, which orjson would parse as a float.
_LONG_DIGITS = re.compile(r"\d{19}")


def _logprob_entries(output: CompletionOutput) -> list[dict[str, Any]] | None:
    """Each token's logprob and its top alternatives. Alternatives a grammar forbade (-inf) are
    left out: they could not be chosen, and JSON has no -inf."""
    if output.token_logprobs is None:
        return None
    entries = []
    for token_id, entry in zip(output.token_ids, output.token_logprobs, strict=False):
        top = [
            (t, lp)
            for t, lp in zip(entry.top_token_ids, entry.top_logprobs, strict=False)
            if lp != -math.inf
        ]
        entries.append(
            {
                "token_id": token_id,
                "logprob": entry.logprob,
                "top_token_ids": [t for t, _ in top],
                "top_logprobs": [lp for _, lp in top],
            }
        )
    return entries


def _split(output: CompletionOutput, parser: str | None) -> tuple[str | None, str]:
    """(reasoning, answer) of one sample: as the LLM split it, else by `parser` (if any)."""
    if output.reasoning is not None or parser is None:
        return output.reasoning, output.text
    return split_reasoning(output.text, parser)


def result_row(
    row: InputRow,
    result: RequestOutput,
    *,
    include_token_ids: bool,
    parse_json: bool = False,
    reasoning_parser: str | None = None,
    check: Callable[[Sequence[str]], str | None] | None = None,
    require_valid: bool = False,
    end_token_text: Callable[[int], str] | None = None,
) -> dict[str, Any]:
    """The vbatch output row (DESIGN.md section 5) for a finished request; `parse_json` adds
    the parsed text (None where it is not JSON), a list of them for n > 1; `reasoning_parser`
    moves each sample's `<think>` part from its text to `reasoning`/`reasonings`; `row.echo`
    (an OpenAI completions line's `echo`) puts the prompt before each text.

    `check` (for a JSON constraint) says why complete outputs break it, or None: the row's
    `structured_valid`; with `require_valid` an invalid one is an error row. `end_token_text`
    (where the text keeps the text of the token it ended on: include_stop_str_in_output) gives
    that text, which the check and `json` leave out of a complete sample."""
    if result.error is not None:
        return error_row(row, f"{row.location}: {result.error}", len(result.prompt_token_ids))
    outputs = result.outputs
    first = outputs[0]
    is_multi = len(outputs) > 1
    has_logprobs = any(o.token_logprobs is not None for o in outputs)
    stop_reason = first.stop_reason
    complete = _structured_complete(outputs)
    reasoning_parser = sample_parser(reasoning_parser, complete is not None)
    if row.openai_kind == "completions":
        # NOTE: a completions line keeps its text whole, as vLLM's /v1/completions does.
        reasoning_parser = None
    reasonings, generated = zip(*(_split(o, reasoning_parser) for o in outputs), strict=True)
    texts = tuple(f"{row.prompt}{text}" for text in generated) if row.echo else generated
    has_reasoning = any(r is not None for r in reasonings)
    constrained = tuple(
        _without_end_text(o, text, end_token_text)
        for o, text in zip(outputs, generated, strict=True)
    )
    invalid = check(constrained) if check is not None and complete else None
    if invalid is not None and require_valid:
        values = error_row(row, f"{row.location}: {invalid}", len(result.prompt_token_ids))
        values["structured_valid"] = False
        return values
    values = {
        "id": row.id,
        "index": row.index,
        "lora": row.lora,
        "text": None if is_multi else texts[0],
        "reasoning": None if is_multi else reasonings[0],
        "texts": list(texts) if is_multi else None,
        "reasonings": list(reasonings) if is_multi and has_reasoning else None,
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
        "structured_complete": complete,
        "structured_valid": (invalid is None) if check is not None and complete else None,
        "json": _parsed(constrained, is_multi) if parse_json else None,
    }
    if is_multi:
        values[SAMPLE_STOP_REASONS] = [o.stop_reason for o in outputs]
    if complete is not None:
        values[SAMPLE_FLAGS] = [
            (
                o.structured_complete,
                None if check is None or not o.structured_complete else check([text]) is None,
            )
            for o, text in zip(outputs, constrained, strict=True)
        ]
    return values


def _without_end_text(
    output: CompletionOutput, text: str, end_token_text: Callable[[int], str] | None
) -> str:
    """A complete constrained sample's text without its EOS token's text, which the grammar
    did not produce (kept by include_stop_str_in_output with skip_special_tokens off)."""
    if end_token_text is None or not output.structured_complete or not output.token_ids:
        return text
    tail = end_token_text(output.token_ids[-1])
    return text[: -len(tail)] if tail and text.endswith(tail) else text


def _structured_complete(outputs: list[CompletionOutput]) -> bool | None:
    """With structured output, whether every sample completed its constraint; else None."""
    flags = [o.structured_complete for o in outputs]
    return None if flags[0] is None else all(flags)


def _parsed(texts: Sequence[str], is_multi: bool) -> Any:
    values = [_parsed_one(text) for text in texts]
    return values if is_multi else values[0]


def _parsed_one(text: str) -> Any:
    """The JSON value of `text`, None if it is not JSON. Integers beyond 64 bits stay exact: the
    value is then kept as compact JSON text (an orjson Fragment) rather than parsed to floats."""
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError:
        return None
    if _LONG_DIGITS.search(text) is None:
        return value
    try:
        exact = json.dumps(json.loads(text), ensure_ascii=False, separators=(",", ":"))
    except (ValueError, RecursionError):
        return value
    return orjson.Fragment(exact)


def error_row(row: InputRow, message: str, prompt_tokens: int = 0) -> dict[str, Any]:
    values: dict[str, Any] = dict.fromkeys(OUTPUT_COLUMNS)
    values.update(
        id=row.id,
        index=row.index,
        lora=row.lora,
        finish_reason="error",
        prompt_tokens=prompt_tokens,
        completion_tokens=0,
        cached_tokens=0,
        error=message,
    )
    return values


def _elapsed(start: float, end: float | None) -> float | None:
    return None if end is None else round(end - start, 6)


_BYTE_FALLBACK_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@lru_cache(maxsize=1)
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2 byte-level BPE: the printable character that stands for each byte in the vocab."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


class TokenStrings:
    """A token's text and its raw bytes, for OpenAI logprobs. A token that ends inside a UTF-8
    character decodes to U+FFFD; its bytes come from its vocab piece instead (byte-level BPE
    pieces, or `<0xNN>` byte-fallback pieces), so the bytes of consecutive tokens join up.

    `get_tokenizer` is called on first use only (a job without logprobs never needs it).
    """

    def __init__(self, get_tokenizer: Callable[[], TextTokenizer]) -> None:
        self.get_tokenizer = get_tokenizer
        self._texts: dict[int, str] = {}
        self._bytes: dict[int, list[int]] = {}

    def text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self.get_tokenizer().decode([token_id], skip_special_tokens=False)
            self._texts[token_id] = text
        return text

    def bytes(self, token_id: int) -> list[int]:
        raw = self._bytes.get(token_id)
        if raw is None:
            raw = self._raw_bytes(token_id)
            self._bytes[token_id] = raw
        return raw

    def _raw_bytes(self, token_id: int) -> list[int]:
        text = self.text(token_id)
        if "\ufffd" in text:
            piece = self.get_tokenizer().convert_ids_to_tokens([token_id])[0] or ""
            match = _BYTE_FALLBACK_TOKEN.fullmatch(piece)
            if match is not None:
                return [int(match.group(1), 16)]
            alphabet = _byte_level_alphabet()
            if piece and all(c in alphabet for c in piece):
                return [alphabet[c] for c in piece]
        return list(text.encode("utf-8"))


def _utf8_bytes(token_text: Callable[[int], str]) -> Callable[[int], list[int]]:
    return lambda token_id: list(token_text(token_id).encode("utf-8"))


def openai_custom_id(row: InputRow) -> str:
    """OpenAI's custom_id is a string: the row's id as text ("" when no id could be read)."""
    return "" if row.id is None else str(row.id)


def openai_line(
    row: InputRow,
    values: dict[str, Any],
    model_name: str,
    token_text: Callable[[int], str],
    token_bytes: Callable[[int], list[int]] | None = None,
) -> dict[str, Any]:
    """The OpenAI Batch output line for a vbatch row of an OpenAI Batch input row.

    `token_bytes` gives a token's raw bytes (default: `token_text` as UTF-8).
    """
    line_id = f"{OPENAI_ID_PREFIX}{row.index}"
    custom_id = openai_custom_id(row)
    if values["error"] is not None:
        return {
            "id": line_id,
            "custom_id": custom_id,
            "response": None,
            "error": {"code": "invalid_request", "message": values["error"]},
        }
    if row.openai_kind == "embeddings" or "embedding" in values:
        body = openai_embeddings_body(row, values, model_name)
    else:
        body = _completion_body(row, values, model_name, token_text, token_bytes)
    response = {"status_code": 200, "request_id": f"vbatch-{row.index}", "body": body}
    return {"id": line_id, "custom_id": custom_id, "response": response, "error": None}


def _completion_body(
    row: InputRow,
    values: dict[str, Any],
    model_name: str,
    token_text: Callable[[int], str],
    token_bytes: Callable[[int], list[int]] | None,
) -> dict[str, Any]:
    """The chat.completion or text_completion body of a finished generation row."""
    token_bytes = token_bytes or _utf8_bytes(token_text)
    texts = values["texts"] or [values["text"]]
    reasonings = values["reasonings"] or [values["reasoning"]] * len(texts)
    reasons = values["finish_reasons"] or [values["finish_reason"]]
    stop_reasons = values.get(SAMPLE_STOP_REASONS) or [values["stop_reason"]]
    logprobs = values["logprobs"] or [None] * len(texts)
    samples = values.get(SAMPLE_FLAGS)
    is_chat = row.openai_kind == "chat" or (row.openai_kind is None and row.messages is not None)
    choices = []
    for i, (text, reason, entries) in enumerate(zip(texts, reasons, logprobs, strict=False)):
        choice: dict[str, Any] = {"index": i}
        if is_chat:
            choice["message"] = {"role": "assistant", "content": text, "refusal": None}
            if reasonings[i] is not None:
                choice["message"]["reasoning_content"] = reasonings[i]
            choice["logprobs"] = _chat_logprobs(entries, token_text, token_bytes)
        else:
            choice["text"] = text
            choice["logprobs"] = _completion_logprobs(
                entries, token_text, token_bytes, len(row.prompt or "")
            )
        choice["finish_reason"] = reason
        # NOTE: not OpenAI's, but vLLM's responses have it: the stop string or token id, or null.
        choice["stop_reason"] = stop_reasons[i]
        if samples is not None:
            complete, valid = samples[i]
            choice["structured_complete"] = complete
            if valid is not None:
                choice["structured_valid"] = valid
        choices.append(choice)
    return {
        "id": f"{'chatcmpl' if is_chat else 'cmpl'}-vbatch-{row.index}",
        "object": "chat.completion" if is_chat else "text_completion",
        "created": int(time.time()),
        "model": row.lora or model_name,
        "choices": choices,
        "usage": {
            "prompt_tokens": values["prompt_tokens"],
            "completion_tokens": values["completion_tokens"],
            "total_tokens": values["prompt_tokens"] + values["completion_tokens"],
            "prompt_tokens_details": {"cached_tokens": values["cached_tokens"]},
        },
    }


def _chat_logprobs(
    entries: list[dict[str, Any]] | None,
    token_text: Callable[[int], str],
    token_bytes: Callable[[int], list[int]],
) -> dict[str, Any] | None:
    if entries is None:
        return None
    content = []
    for entry in entries:
        top = [
            {"token": token_text(t), "logprob": lp, "bytes": token_bytes(t)}
            for t, lp in zip(entry["top_token_ids"], entry["top_logprobs"], strict=False)
        ]
        token_id = entry["token_id"]
        content.append(
            {
                "token": token_text(token_id),
                "logprob": entry["logprob"],
                "bytes": token_bytes(token_id),
                "top_logprobs": top,
            }
        )
    return {"content": content, "refusal": None}


def _completion_logprobs(
    entries: list[dict[str, Any]] | None,
    token_text: Callable[[int], str],
    token_bytes: Callable[[int], list[int]],
    start: int,
) -> dict[str, Any] | None:
    """OpenAI's legacy shape; `text_offset` counts characters of prompt + completion, so the
    first token's offset is `start` (the prompt's length), as OpenAI gives it."""
    if entries is None:
        return None
    offsets = []
    # NOTE: characters as the text's own lossy decode has them (an invalid byte is one U+FFFD);
    # a character split over tokens is counted once, at the token holding its first byte.
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    settled = 0
    for e in entries:
        offsets.append(start + settled + (1 if decoder.getstate()[0] else 0))
        settled += len(decoder.decode(bytes(token_bytes(e["token_id"]))))
    return {
        "tokens": [token_text(e["token_id"]) for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [_completion_top(e, token_text) for e in entries],
        "text_offset": offsets,
    }


def _completion_top(entry: dict[str, Any], token_text: Callable[[int], str]) -> dict[str, float]:
    """One position's legacy `top_logprobs`: the sampled token, then the top ones (up to
    logprobs + 1 entries, as OpenAI and vLLM give them)."""
    top = {token_text(entry["token_id"]): entry["logprob"]}
    for t, lp in zip(entry["top_token_ids"], entry["top_logprobs"], strict=False):
        top.setdefault(token_text(t), lp)
    return top


def line_index(line: bytes) -> int:
    """The input index of one output JSONL line, in either output shape."""
    values = orjson.loads(line)
    if "index" in values:
        return values["index"]
    return int(values["id"].removeprefix(OPENAI_ID_PREFIX))


def jsonl_bytes(values: dict[str, Any], kept: dict[str, Any] | None) -> bytes:
    """One JSONL line; kept values JSON has no type for are encoded by `json_default`."""
    out = {
        k: v
        for k, v in values.items()
        if v is not None or (k not in OPTIONAL_COLUMNS and k not in OPTIONAL_TASK_COLUMNS)
    }
    if kept:
        out.update(kept)
    return orjson.dumps(
        out,
        default=json_default,
        option=orjson.OPT_APPEND_NEWLINE | orjson.OPT_SERIALIZE_NUMPY,
    )


def parquet_schema(
    id_kind: str,
    kept_columns: Sequence[str] = (),
    input_schema: pa.Schema | None = None,
    parse_json: bool = False,
    *,
    reasoning: bool = False,
    lora: bool = False,
) -> pa.Schema:
    """The fixed Parquet schema of every part and of the final file. Kept columns keep their
    Parquet input type (views as their plain types); kept JSONL values are stored as JSON text,
    as is `json` (parse_json); `reasoning` adds the reasoning columns."""
    import pyarrow as pa

    if input_schema is not None:
        kept_fields = [
            field.with_type(parquet_kept_type(field.type))
            for field in (input_schema.field(name) for name in kept_columns)
        ]
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
        *([("lora", pa.string())] if lora else []),
        ("text", pa.string()),
        *([("reasoning", pa.string())] if reasoning else []),
        ("texts", pa.list_(pa.string())),
        *([("reasonings", pa.list_(pa.string()))] if reasoning else []),
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
        ("structured_valid", pa.bool_()),
    ]
    if parse_json:
        fields.append(("json", pa.string()))
    return pa.schema([pa.field(n, t) for n, t in fields] + list(kept_fields))


def parquet_values(
    values: dict[str, Any], kept: dict[str, Any] | None, id_kind: str, json_kept: bool
) -> dict[str, Any]:
    """A row as Parquet wants it: stop_reason and str ids as text, JSONL-input kept values JSON.

    The id column's type was fixed when the job started (int64 only if every id fit it), so
    an id that does not fit it here means the input changed under the job.
    """
    out = dict(values)
    if out.get("stop_reason") is not None:
        out["stop_reason"] = str(out["stop_reason"])
    row_id = out["id"]
    if id_kind == "str" and row_id is not None:
        out["id"] = str(row_id)
    elif (
        id_kind == "int"
        and row_id is not None
        and not (isinstance(row_id, int) and fits_int64(row_id))
    ):
        raise JobStateError(
            f"row {values['index']} has id {row_id!r}, but this job's Parquet id column holds "
            "64-bit integers (fixed when the job started, from the ids in the input then). "
            "The input changed; start again with `vbatch run ... --overwrite`"
        )
    if out.get("json") is not None:
        out["json"] = orjson.dumps(out["json"]).decode()
    if kept:
        for name, value in kept.items():
            if json_kept and value is not None:
                value = orjson.dumps(value).decode()
            out[name] = value
    return out
