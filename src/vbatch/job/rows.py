"""Input rows: turn one raw record (prompt, messages or OpenAI Batch line) into an InputRow."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vbatch.client.tokenizer import check_template_kwargs, validate_messages
from vbatch.errors import InputError, SamplingParamsError
from vbatch.job.tasks import embeddings_request
from vbatch.pooling_params import PoolingParams
from vbatch.sampling_params import MAX_LOGPROBS, SamplingParams
from vbatch.structured import from_response_format, row_structured

OPENAI_URLS = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/embeddings": "embeddings",
}
# NOTE: body keys read elsewhere or that do not change the result pass here; any other unknown key
# is an error row, so that e.g. a `tools` list the engine cannot honour is never dropped.
OPENAI_IGNORED_KEYS = frozenset(
    {
        "model",
        "user",
        "metadata",
        "store",
        "stream",
        "stream_options",
        "service_tier",
        "parallel_tool_calls",
        "messages",
        "prompt",
        "echo",
        "chat_template_kwargs",
    }
)
LOGIT_BIAS_LIMIT = 100.0
SAMPLING_FIELDS = frozenset(SamplingParams.__struct_fields__)
OPENAI_SAMPLING_KEYS = {
    "max_tokens": "max_tokens",
    "max_completion_tokens": "max_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "seed": "seed",
    "stop": "stop",
    "n": "n",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "repetition_penalty": "repetition_penalty",
}


@dataclass(frozen=True)
class ColumnOptions:
    """Which input columns hold the prompt, the chat messages, the id, and what is copied out."""

    prompt_column: str | None = None
    messages_column: str | None = None
    id_column: str | None = None
    keep_columns: tuple[str, ...] = ()
    keep_all_columns: bool = False


@dataclass(frozen=True)
class LoraRows:
    """With LoRA adapters (--lora): their names, the column naming a row's adapter (default:
    lora; an OpenAI Batch line's body.model) and the adapter of rows naming none."""

    names: tuple[str, ...]
    column: str | None = None
    default: str | None = None


@dataclass
class InputRow:
    """One input row. Invariant: exactly one of `error`, `prompt`, `messages` is set."""

    index: int
    location: str
    id: str | int | None
    prompt: str | list[str] | None = None
    messages: list[dict[str, Any]] | None = None
    sampling_params: SamplingParams | None = None
    openai_kind: str | None = None
    kept: dict[str, Any] | None = None
    error: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    echo: bool = False
    # NOTE: an OpenAI embeddings line's (its `input` may be a list of strings, then `prompt`).
    pooling_params: PoolingParams | None = None
    encoding_format: str | None = None
    lora: str | None = None


class RowError(ValueError):
    """A problem with one row: it becomes an error row, the job goes on."""


def is_openai_record(record: dict[str, Any]) -> bool:
    """An OpenAI Batch line: a body with a url or custom_id, or (a line missing its body) all
    three of custom_id, method and url, which no plain row has together."""
    if "body" in record:
        return "url" in record or "custom_id" in record
    return {"custom_id", "method", "url"} <= record.keys()


def bad_id_message(column: str, value: Any) -> str:
    """Why a row's id cannot be used, with the fix where the cause is a common one."""
    message = f"id column {column!r} must hold a string or an integer, got {value!r}"
    if isinstance(value, float) and value.is_integer():
        message += (
            " (a float: pandas stores integer ids as float64 once one is missing; "
            "write them as int64 or as strings)"
        )
    return message


class RowParser:
    """Parses raw records with fixed column options, default sampling params and the run's
    chat-template variables (a row's own `chat_template_kwargs` are merged over them).

    OpenAI Batch lines take their sampling defaults from `openai_defaults` (default: `defaults`),
    and a line whose body names a model outside `model_names` is an error row (None: any).
    `warn`, when set, is told once of a plain row holding sampling settings at its top level,
    which are not read there."""

    def __init__(
        self,
        options: ColumnOptions,
        defaults: SamplingParams,
        template_kwargs: dict[str, Any] | None = None,
        *,
        model_names: frozenset[str] | None = None,
        openai_defaults: SamplingParams | None = None,
        loras: LoraRows | None = None,
    ) -> None:
        self.options = options
        self.loras = loras
        self.defaults = defaults
        self.template_kwargs = template_kwargs
        self.model_names = model_names
        self.openai_defaults = openai_defaults or defaults
        self.warn: Callable[[str], None] | None = None

    def id_column(self, record: dict[str, Any]) -> str | None:
        """The column a row's id is read from: the id column, else `id`, else `custom_id`, else
        none (the id is the input index); an OpenAI Batch line's `custom_id` comes first, as
        its response must carry it whatever other keys the line has."""
        if self.options.id_column is not None:
            return self.options.id_column
        order = ("custom_id", "id") if is_openai_record(record) else ("id", "custom_id")
        return next((c for c in order if c in record), None)

    def row_id(self, record: dict[str, Any], index: int) -> str | int | None:
        """The row's id (see id_column), None where its value is not a string or an integer."""
        column = self.id_column(record)
        if column is None:
            return index
        value = record.get(column)
        if isinstance(value, str):
            return value
        if isinstance(value, int) and not isinstance(value, bool) and -(1 << 63) <= value < 1 << 64:
            return value
        return None

    def parse(self, record: Any, index: int, location: str) -> InputRow:
        if not isinstance(record, dict):
            # NOTE: a row that is not an object has no id (an index could clash with a real id).
            return InputRow(
                index,
                location,
                None,
                error=f"{location}: expected a JSON object, got {type(record).__name__}",
            )
        row = InputRow(index, location, self.row_id(record, index))
        try:
            if row.id is None:
                column = self.id_column(record)
                assert column is not None  # NOTE: without an id column the id is the index.
                if column not in record:
                    raise RowError(
                        f"the row has no {column!r}, which the input's other rows have (or "
                        "--id-column names): give every row an id, or none"
                    )
                raise RowError(bad_id_message(column, record.get(column)))
            if is_openai_record(record):
                self._parse_openai(record, row)
            else:
                self._parse_plain(record, row)
            if self.loras is not None:
                row.lora = self._lora(record, self.loras)
            else:
                self._refuse_unloaded_lora(record)
        except (RowError, SamplingParamsError, InputError) as e:
            _fail(row, f"{location}: {e}")
        except Exception as e:
            # NOTE: any other failure (a RecursionError on a deeply nested value, say) is still
            # this row's: it becomes an error row, so the job and every resume get past it.
            _fail(row, f"{location}: the row could not be read: {type(e).__name__}: {e}")
        row.kept = self._kept(record)
        return row

    def _lora(self, record: dict[str, Any], loras: LoraRows) -> str | None:
        """The adapter a row names (its lora column, or an OpenAI body's `model` when that
        names an adapter), else the default one; a name no --lora gave is a RowError."""
        if is_openai_record(record):
            body = record.get("body")
            model = body.get("model") if isinstance(body, dict) else None
            return model if model in loras.names else loras.default
        column = loras.column or "lora"
        name = record.get(column)
        if name is None:
            return loras.default
        if not isinstance(name, str) or name not in loras.names:
            raise RowError(
                f"{column} {name!r} is not a LoRA adapter of this job "
                f"(--lora gave {', '.join(loras.names)})"
            )
        return name

    def _refuse_unloaded_lora(self, record: dict[str, Any]) -> None:
        """A row of a job without --lora that names an adapter in its `lora` field would run on
        the base model under that name: it is a RowError (`lora` is an output field, so the
        input column cannot be kept as data either)."""
        name = None if is_openai_record(record) else record.get("lora")
        if name is not None:
            raise RowError(
                f"lora {name!r:.60}: this job has no LoRA adapters; give --lora NAME=PATH "
                "(generation jobs only), or rename the input column"
            )

    def _kept(self, record: dict[str, Any]) -> dict[str, Any] | None:
        if self.options.keep_all_columns:
            return dict(record)
        if self.options.keep_columns:
            return {name: record.get(name) for name in self.options.keep_columns}
        return None

    def _warn_of_stray_settings(self, record: dict[str, Any], location: str) -> None:
        """The first row with a sampling setting as a column (`max_tokens`, `temperature` beside
        the prompt), which a job reads only under `sampling_params`, is told to `warn`; a column
        the column options name is data."""
        if self.warn is None:
            return
        named = (
            self.options.prompt_column,
            self.options.messages_column,
            self.options.id_column,
            *self.options.keep_columns,
        )
        stray = [key for key in record if key in SAMPLING_FIELDS and key not in named]
        if stray:
            self.warn(
                f"warning: {location} holds {', '.join(stray)} beside its "
                "prompt, where a row's sampling settings are not read: give them under "
                f'"sampling_params" ({{"sampling_params": {{"{stray[0]}": ...}}}}) or as the '
                "run's flags"
            )
            self.warn = None

    def _parse_plain(self, record: dict[str, Any], row: InputRow) -> None:
        prompt_column = self.options.prompt_column or "prompt"
        messages_column = self.options.messages_column or "messages"
        prompt = record.get(prompt_column)
        messages = record.get(messages_column)
        if prompt is not None and messages is not None:
            raise RowError(f"row has both {prompt_column!r} and {messages_column!r}; give one")
        if messages is not None:
            row.messages = validate_messages(messages, messages_column)
        elif prompt is not None:
            row.prompt = check_prompt(prompt, prompt_column)
        else:
            raise RowError(
                f"missing prompt: expected a {prompt_column!r} string or a {messages_column!r} list"
            )
        self._warn_of_stray_settings(record, row.location)
        overrides = record.get("sampling_params")
        if overrides is not None:
            if not isinstance(overrides, dict):
                raise RowError(f"sampling_params must be an object, got {overrides!r}")
            given = _struct_fields(overrides)
            if "prompt_logprobs" in given:
                raise RowError(
                    "sampling_params.prompt_logprobs is not written by jobs; a --task "
                    "perplexity job scores every prompt (--include-token-ids for each token's "
                    "logprob)"
                )
            if given:
                row.sampling_params = self.defaults.updated(given)
        response_format = _struct_fields(record.get("response_format"))
        guided = _struct_fields(record.get("guided"))
        if isinstance(response_format, dict) and "json_schema" in response_format:
            spec = _struct_fields(response_format["json_schema"])
            response_format = {**response_format, "json_schema": spec}
        if response_format is not None or guided is not None:
            given_there = [
                name
                for name in ("structured", "structured_outputs", "guided_decoding")
                if (overrides or {}).get(name) is not None
            ]
            if given_there:
                field = "response_format" if response_format is not None else "guided"
                raise RowError(
                    f"a row may constrain its output once: {field} and "
                    f"sampling_params.{given_there[0]} both do; give one"
                )
            # NOTE: {"type": "text"} (None) also overrides a job-wide constraint.
            structured = row_structured(response_format, guided)
            params = row.sampling_params or self.defaults
            row.sampling_params = params.updated({"structured": structured})
        self._template_kwargs(row, record.get("chat_template_kwargs"), "chat_template_kwargs")

    def _template_kwargs(self, row: InputRow, value: Any, name: str) -> None:
        """The row's chat-template variables (an object or JSON text; null fields, as a Parquet
        struct has them, left out): its own over the run's, for messages rows only."""
        if value is not None and row.messages is None:
            raise RowError(f"{name} applies to chat messages, and this row has a prompt")
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise RowError(f"{name} is not valid JSON: {e}") from None
        value = _struct_fields(value)
        own = check_template_kwargs(value, name) if value is not None else {}
        if row.messages is not None and (self.template_kwargs or own):
            row.chat_template_kwargs = {**(self.template_kwargs or {}), **own}

    def _parse_openai(self, record: dict[str, Any], row: InputRow) -> None:
        url = record.get("url", "/v1/chat/completions")
        if url not in OPENAI_URLS:
            raise RowError(f"url must be one of {', '.join(OPENAI_URLS)}, got {url!r}")
        method = record.get("method", "POST")
        if method != "POST":
            raise RowError(f"method must be POST, got {method!r}")
        if "body" not in record:
            raise RowError("an OpenAI Batch line needs a 'body' object, the request")
        body = record["body"]
        if not isinstance(body, dict):
            raise RowError(f"body must be an object, got {type(body).__name__}")
        row.openai_kind = OPENAI_URLS[url]
        model = body.get("model")
        if model is not None and self.model_names is not None and model not in self.model_names:
            # NOTE: as vLLM's run-batch: a line naming a model that is not served fails.
            names = ", ".join(repr(name) for name in sorted(self.model_names))
            raise RowError(
                f"body.model {model!r} is not this job's model; give one of {names}, or no model"
            )
        if row.openai_kind == "embeddings":
            try:
                row.prompt, row.pooling_params, row.encoding_format = embeddings_request(body)
            except ValueError as e:
                raise RowError(str(e)) from None
            return
        if row.openai_kind == "chat":
            if "url" not in record and "messages" not in body:
                raise RowError(
                    "the line has no url, so it is read as /v1/chat/completions, whose body needs "
                    "messages; give the url (/v1/completions for a body.prompt)"
                )
            row.messages = validate_messages(body.get("messages"), "body.messages")
        else:
            row.prompt = check_prompt(body.get("prompt"), "body.prompt")
            row.echo = _echo(body)
        row.sampling_params = self.openai_defaults.updated(openai_overrides(body, row.openai_kind))
        self._template_kwargs(row, body.get("chat_template_kwargs"), "body.chat_template_kwargs")


def _struct_fields(value: Any) -> Any:
    """An object's fields without the null ones, which a Parquet struct has for each field
    another row set: {"regex": "a+", "choice": None} is {"regex": "a+"}."""
    if isinstance(value, dict):
        return {key: field for key, field in value.items() if field is not None}
    return value


def _fail(row: InputRow, message: str) -> None:
    row.prompt = row.messages = row.sampling_params = None
    row.chat_template_kwargs = None
    row.error = message


def openai_overrides(body: dict[str, Any], kind: str) -> dict[str, Any]:
    """Map OpenAI request body fields onto SamplingParams fields."""
    overrides: dict[str, Any] = {}
    for key, value in body.items():
        if value is None:
            continue
        if key == "max_tokens" and body.get("max_completion_tokens") is not None:
            # NOTE: as vLLM, the newer max_completion_tokens wins over the deprecated max_tokens.
            continue
        if key in OPENAI_SAMPLING_KEYS:
            overrides[OPENAI_SAMPLING_KEYS[key]] = value
        elif key == "logit_bias":
            overrides["logit_bias"] = logit_bias(value)
        elif key == "echo" and kind == "chat":
            raise RowError("echo is a /v1/completions field")
        elif key == "logprobs" and kind == "completions":
            overrides["logprobs"] = value
        elif key == "logprobs":
            if not isinstance(value, bool):
                raise RowError(f"logprobs must be true or false, got {value!r:.40}")
            if value:
                overrides.setdefault("logprobs", 0)
        elif key == "top_logprobs" and kind == "chat":
            overrides["logprobs"] = _top_logprobs(body, value)
        elif key == "top_logprobs":
            raise RowError("top_logprobs is a /v1/chat/completions field; here logprobs: N")
        elif key == "response_format":
            overrides["structured"] = from_response_format(value)
        elif key not in OPENAI_IGNORED_KEYS:
            raise RowError(f"unsupported body field {key!r}")
    return overrides


def _top_logprobs(body: dict[str, Any], value: Any) -> int:
    """A chat body's `top_logprobs`: an integer in [0, 20], with `logprobs: true` (as OpenAI
    requires)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS:
        raise RowError(f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {value!r:.40}")
    if body.get("logprobs") is not True:
        raise RowError("top_logprobs needs logprobs: true")
    return value


def logit_bias(value: Any) -> dict[int, float]:
    """OpenAI's `logit_bias` (token id, as a string or an integer, to a bias) as the
    `logit_bias` sampling parameter, each bias clamped to [-100, 100] as vLLM's server does."""
    if not isinstance(value, dict):
        raise RowError(f"logit_bias must be an object of token id to bias, got {value!r:.80}")
    biases = {}
    for key, bias in value.items():
        is_id = isinstance(key, int) or (isinstance(key, str) and key.isascii() and key.isdigit())
        is_number = isinstance(bias, (int, float)) and not isinstance(bias, bool)
        if not is_id or not is_number or bias != bias:
            raise RowError(f"logit_bias maps token ids to numbers, got {key!r}: {bias!r:.40}")
        biases[int(key)] = float(min(LOGIT_BIAS_LIMIT, max(-LOGIT_BIAS_LIMIT, bias)))
    return biases


def _echo(body: dict[str, Any]) -> bool:
    echo = body.get("echo")
    if echo is None:
        return False
    if not isinstance(echo, bool):
        raise RowError(f"echo must be true or false, got {echo!r:.40}")
    if echo and body.get("logprobs") is not None:
        raise RowError("echo with logprobs needs prompt logprobs, which vbatch does not give")
    return echo


def check_prompt(prompt: Any, column: str) -> str:
    if not isinstance(prompt, str):
        raise RowError(f"{column} must be a string, got {type(prompt).__name__}")
    if not prompt:
        raise RowError(f"{column} is empty")
    return prompt
