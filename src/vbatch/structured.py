"""StructuredOutput: a request's output constraint (JSON schema, JSON, regex, choice, grammar)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import msgspec

from vbatch.errors import SamplingParamsError

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
EXTRA_HINT = "structured output needs xgrammar: pip install 'vbatch[structured]'"


class StructuredOutput(msgspec.Struct, omit_defaults=True, gc=False, frozen=True):
    """Exactly one constraint; also its wire form. The engine compiles it once per distinct
    value (see `key`).

    `json_schema` may be given as a dict or as JSON text and is kept as JSON text re-serialised
    (key order kept: it is the order the properties are generated in);
    `grammar` is EBNF text in xgrammar's dialect (GBNF-like, starting at rule `root`).
    """

    json_schema: str | dict[str, Any] | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        if self.json_schema is not None:
            schema = self.json_schema
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as e:
                    raise SamplingParamsError(f"json_schema is not valid JSON: {e}") from None
            if not isinstance(schema, dict):
                raise SamplingParamsError(
                    f"json_schema must be a JSON object, got {type(schema).__name__}"
                )
            msgspec.structs.force_setattr(self, "json_schema", json.dumps(schema))
        given = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise SamplingParamsError(
                f"structured output takes exactly one of {', '.join(KINDS)}; "
                f"got {', '.join(given) or 'none'}"
            )
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise SamplingParamsError(f"regex must be a non-empty string, got {self.regex!r}")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar):
            raise SamplingParamsError(f"grammar must be a non-empty string, got {self.grammar!r}")
        if self.choice is not None:
            choice = self.choice
            if not isinstance(choice, (list, tuple)) or not choice:
                raise SamplingParamsError(f"choice must be a non-empty list, got {choice!r}")
            if not all(isinstance(c, str) and c for c in choice):
                raise SamplingParamsError(f"choice must hold non-empty strings, got {choice!r}")
            msgspec.structs.force_setattr(self, "choice", list(choice))
        if not isinstance(self.json_object, bool):
            raise SamplingParamsError(
                f"json_object must be true or false, got {self.json_object!r}"
            )

    @property
    def kind(self) -> str:
        return next(kind for kind in KINDS if getattr(self, kind) not in (None, False))

    @property
    def is_json(self) -> bool:
        return self.json_schema is not None or self.json_object

    @property
    def key(self) -> bytes:
        """The cache key: equal for equal constraints, whatever the schema's whitespace."""
        return msgspec.msgpack.encode(self)


def coerce_structured(value: Any) -> StructuredOutput | None:
    """A StructuredOutput from itself, None, or a mapping of its fields (e.g. {"regex": ...})."""
    if value is None or isinstance(value, StructuredOutput):
        return value
    if not isinstance(value, Mapping):
        raise SamplingParamsError(f"structured must be an object, got {value!r:.80}")
    unknown = sorted(set(value) - set(KINDS))
    if unknown:
        raise SamplingParamsError(
            f"unknown structured output key(s) {', '.join(unknown)}; valid: {', '.join(KINDS)}"
        )
    return StructuredOutput(**value)


def check_compatible(
    structured: StructuredOutput | None, ignore_eos: bool, min_tokens: int
) -> None:
    """Reject settings a grammar cannot honour: it decides where EOS may come."""
    if structured is None:
        return
    if ignore_eos:
        raise SamplingParamsError("ignore_eos cannot be combined with structured output")
    if min_tokens:
        raise SamplingParamsError("min_tokens cannot be combined with structured output")


def from_response_format(value: Any) -> StructuredOutput | None:
    """OpenAI's `response_format`: {"type": "json_schema", "json_schema": {"schema": ...}},
    {"type": "json_object"} or {"type": "text"} (None); also accepted as JSON text."""
    value = _as_object(value, "response_format")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput(json_object=True)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, Mapping) or "schema" not in spec:
            raise SamplingParamsError(
                "response_format.json_schema must be an object with a 'schema' field"
            )
        return StructuredOutput(json_schema=spec["schema"])
    raise SamplingParamsError(
        f"response_format.type must be json_schema, json_object or text, got {kind!r}"
    )


def from_guided(value: Any) -> StructuredOutput:
    """A row's `guided`: {"regex": ...}, {"choice": [...]} or {"grammar": ...} (or JSON text)."""
    value = _as_object(value, "guided")
    unknown = sorted(set(value) - {"regex", "choice", "grammar"})
    if unknown or len(value) != 1:
        raise SamplingParamsError(
            f"guided must have exactly one of regex, choice, grammar; got {sorted(value)}"
        )
    return StructuredOutput(**value)


def _as_object(value: Any, name: str) -> Mapping[str, Any]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise SamplingParamsError(f"{name} is not valid JSON: {e}") from None
    if not isinstance(value, Mapping):
        raise SamplingParamsError(f"{name} must be an object, got {value!r:.80}")
    return value
