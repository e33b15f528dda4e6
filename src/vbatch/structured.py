"""StructuredOutput: a request's output constraint (JSON schema, JSON, regex, choice, grammar);
vLLM's `StructuredOutputsParams` (and its older name) mapped onto it."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from vbatch.errors import SamplingParamsError

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
BACKENDS = (None, "auto", "xgrammar")
EXTRA_HINT = "structured output needs xgrammar: pip install 'vbatch[structured]'"
# NOTE: checked before any recursive code (json, msgpack, xgrammar) sees the schema, so a deep
# one is an error row rather than a RecursionError; real schemas nest a few dozen levels.
MAX_SCHEMA_DEPTH = 128
# NOTE: xgrammar's messages start with "[15:09:35] /project/cpp/regex_converter.cc:94: ".
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_BRACKET = re.compile(r"[\[\]{}]")
# NOTE: keywords xgrammar accepts but does not enforce (its grammar allows outputs that break
# them), and those it approximates; a schema using one is warned about, and outputs are checked.
# NOTE: the keywords beside which xgrammar 0.2.9 drops a schema's others (_ignored_siblings),
# and the keywords that describe rather than constrain, which it may drop harmlessly.
_RULING_KEYWORDS = ("$ref", "const", "enum", "anyOf", "oneOf", "allOf")
_ANNOTATIONS = frozenset(
    {
        "title",
        "description",
        "default",
        "examples",
        "$comment",
        "$schema",
        "$id",
        "$defs",
        "definitions",
        "deprecated",
        "readOnly",
        "writeOnly",
        "$anchor",
    }
)
# NOTE: a schema without "type" is any value to xgrammar 0.2.9 unless one of these makes it an
# object or array; then it drops every keyword below that constrains one type's values.
_TYPE_INFERRING = ("properties", "additionalProperties", "items", "prefixItems")
_TYPED_KEYWORDS = (
    "minLength",
    "maxLength",
    "pattern",
    "format",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "minItems",
    "maxItems",
    "required",
    "minProperties",
    "maxProperties",
    "patternProperties",
    "propertyNames",
)
_JSON_TYPES: dict[str, type | tuple[type, ...]] = {
    "string": str,
    "boolean": bool,
    "null": type(None),
    "object": dict,
    "array": list,
}
UNENFORCED = (
    "multipleOf",
    "uniqueItems",
    "not",
    "contains",
    "if",
    "dependentRequired",
    "dependentSchemas",
    "dependencies",
)
_SCHEMA_KEYS = (
    "additionalProperties",
    "additionalItems",
    "items",
    "contains",
    "propertyNames",
    "not",
    "if",
    "then",
    "else",
    "unevaluatedItems",
    "unevaluatedProperties",
    "contentSchema",
)
_SCHEMA_MAP_KEYS = (
    "properties",
    "patternProperties",
    "$defs",
    "definitions",
    "dependentSchemas",
    "dependencies",
)
_SCHEMA_LIST_KEYS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")


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
    strict: bool = True

    def __post_init__(self) -> None:
        if self.json_schema is not None:
            msgspec.structs.force_setattr(self, "json_schema", _schema_text(self.json_schema))
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
            if any(0xD800 <= ord(ch) <= 0xDFFF for c in choice for ch in c):
                raise SamplingParamsError("choice labels must not hold lone UTF-16 surrogates")
            msgspec.structs.force_setattr(self, "choice", list(choice))
        if not isinstance(self.json_object, bool):
            raise SamplingParamsError(
                f"json_object must be true or false, got {self.json_object!r}"
            )
        if not isinstance(self.strict, bool):
            raise SamplingParamsError(f"strict must be true or false, got {self.strict!r}")
        if not self.strict and self.json_schema is None:
            raise SamplingParamsError("strict: false applies to json_schema only")

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


@dataclass
class StructuredOutputsParams:
    """vLLM's structured-output settings: exactly one of `json` (a schema, as a dict or JSON
    text), `regex`, `choice`, `grammar` or `json_object`. `SamplingParams` folds it into its
    `structured` field.

    vLLM's switches are taken as far as they hold for vbatch's one grammar engine (xgrammar):
    its JSON never has free whitespace and its schemas admit no properties they do not name
    (vLLM's `disable_any_whitespace` and `disable_additional_properties` set, whatever they are
    given), and there is no other backend to fall back to (`disable_fallback`).
    `whitespace_pattern` and `structural_tag` raise SamplingParamsError."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        if self.whitespace_pattern is not None:
            raise SamplingParamsError(
                "whitespace_pattern is not supported: vbatch's JSON grammars allow no free "
                "whitespace (as vLLM's disable_any_whitespace=True)"
            )
        if self.structural_tag is not None:
            raise SamplingParamsError(
                "structural_tag is not supported; constrain the output with json, regex, "
                "choice or grammar"
            )
        self.to_structured()

    def to_structured(self) -> StructuredOutput:
        return StructuredOutput(
            json_schema=self.json,
            json_object=bool(self.json_object),
            regex=self.regex,
            choice=self.choice,
            grammar=self.grammar,
        )


@dataclass
class GuidedDecodingParams(StructuredOutputsParams):
    """vLLM's older name for `StructuredOutputsParams` (`SamplingParams(guided_decoding=...)`),
    with its `backend`: None, "auto" or "xgrammar", the one vbatch has."""

    backend: str | None = None

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise SamplingParamsError(
                f"structured output backend {self.backend!r:.40} is not available: vbatch "
                "constrains with xgrammar (backend None, 'auto' or 'xgrammar')"
            )
        super().__post_init__()


def coerce_structured(value: Any) -> StructuredOutput | None:
    """A StructuredOutput from itself, None, or a mapping of its fields (e.g. {"regex": ...})."""
    if value is None or isinstance(value, StructuredOutput):
        return value
    if not isinstance(value, Mapping):
        raise SamplingParamsError(f"structured must be an object, got {value!r:.80}")
    unknown = sorted(set(value) - {*KINDS, "strict"})
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
        if spec["schema"] is None:
            raise SamplingParamsError(
                "response_format.json_schema.schema is null; give a JSON schema object"
            )
        strict = spec.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise SamplingParamsError(
                f"response_format.json_schema.strict must be true or false, got {strict!r}"
            )
        return StructuredOutput(json_schema=spec["schema"], strict=strict is not False)
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


def row_structured(response_format: Any, guided: Any) -> StructuredOutput | None:
    """A job row's constraint from its `response_format` or `guided` field (None: neither)."""
    if response_format is not None and guided is not None:
        raise SamplingParamsError("a row may have response_format or guided, not both")
    if guided is not None:
        return from_guided(guided)
    if response_format is not None:
        return from_response_format(response_format)
    return None


def choice_ebnf(labels: list[str]) -> str:
    """A grammar of exactly these labels. Each is written as itself, not escaped to ASCII:
    xgrammar's EBNF reads a `\\ud83d\\ude00` surrogate pair as two code points."""
    return "root ::= " + " | ".join(json.dumps(label, ensure_ascii=False) for label in labels)


def xgrammar_message(error: Exception) -> str:
    """An xgrammar exception's message without its log prefix."""
    return _LOG_PREFIX.sub("", str(error).strip())


def _schema_text(schema: Any) -> str:
    """A json_schema (dict or JSON text) as compact JSON text, its depth checked first."""
    if isinstance(schema, str):
        _check_depth(_text_depth(schema))
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise SamplingParamsError(f"json_schema is not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise SamplingParamsError(f"json_schema must be a JSON object, got {type(schema).__name__}")
    _check_depth(_value_depth(schema))
    for node in subschemas(schema):
        ref = node.get("$ref")
        if isinstance(ref, str) and not ref.startswith("#"):
            raise SamplingParamsError(
                f"json_schema has a remote $ref {ref!r:.80}, which vbatch cannot resolve "
                "(it would act as any JSON); inline it, or use a local '#/...' reference"
            )
    return json.dumps(schema, ensure_ascii=False)


def _check_depth(depth: int) -> None:
    if depth > MAX_SCHEMA_DEPTH:
        raise SamplingParamsError(
            f"json_schema nests more than {MAX_SCHEMA_DEPTH} levels deep, vbatch's limit"
        )


def _text_depth(text: str) -> int:
    """How deep JSON text nests, without parsing it (strings skipped; no recursion)."""
    depth = deepest = 0
    for match in _BRACKET.finditer(_JSON_STRING.sub("", text)):
        depth += 1 if match.group() in "[{" else -1
        deepest = max(deepest, depth)
    return deepest


def _value_depth(value: Any) -> int:
    deepest = 0
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children: Any = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        deepest = max(deepest, depth)
        if depth <= MAX_SCHEMA_DEPTH:
            stack.extend((child, depth + 1) for child in children)
    return deepest


def subschemas(schema: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every schema within `schema`, itself included: only values of keys that hold schemas
    (never `const`, `enum`, `default` or `examples` values, which are data)."""
    stack = [schema]
    while stack:
        node = stack.pop()
        yield node
        for key in _SCHEMA_KEYS:
            if isinstance(node.get(key), dict):
                stack.append(node[key])
        for key in _SCHEMA_MAP_KEYS:
            if isinstance(node.get(key), dict):
                stack.extend(v for v in node[key].values() if isinstance(v, dict))
        for key in _SCHEMA_LIST_KEYS:
            if isinstance(node.get(key), list):
                stack.extend(v for v in node[key] if isinstance(v, dict))


def unenforced_keywords(structured: StructuredOutput) -> list[str]:
    """What the grammar of `structured` does not enforce exactly, by name (empty: all of it)."""
    if structured.json_object:
        return ["duplicate keys (json_object)"]
    if not isinstance(structured.json_schema, str):
        return []
    found: set[str] = set()
    for node in subschemas(json.loads(structured.json_schema)):
        found.update(key for key in UNENFORCED if key in node)
        if isinstance(node.get("format"), str):
            found.add("format (its pattern only: a date's day is not checked against its month)")
        required, declared = node.get("required"), node.get("properties")
        if isinstance(required, list) and any(
            not isinstance(declared, dict) or name not in declared for name in required
        ):
            found.add("required naming a property the schema does not declare")
        if "patternProperties" in node or isinstance(node.get("additionalProperties"), dict):
            found.add("duplicate keys (patternProperties/additionalProperties)")
        for key, approximation in (
            ("allOf", "allOf with multiple options"),
            ("oneOf", "oneOf (approximated as anyOf)"),
        ):
            if isinstance(node.get(key), list) and len(node[key]) > 1:
                found.add(approximation)
        found.update(_ignored_siblings(node))
    return sorted(found)


def _ignored_siblings(node: dict[str, Any]) -> Iterator[str]:
    """The keywords of `node` the grammar drops for another beside them (xgrammar 0.2.9 keeps
    only an enum, const, anyOf, oneOf, allOf or $ref of a schema, and a pattern or format
    alone of a string's), each as `keyword beside other`, and those it drops for want of a
    type, as `keyword without a type`."""
    ruler = next((key for key in _RULING_KEYWORDS if key in node), None)
    if ruler is not None:
        values = node["enum"] if ruler == "enum" else [node["const"]] if ruler == "const" else None
        for key in node:
            if key in _RULING_KEYWORDS or key in _ANNOTATIONS:
                continue
            # NOTE: a type every listed value has loses nothing; beside anyOf it is dropped.
            if key == "type" and isinstance(values, list) and values_of_type(values, node[key]):
                continue
            yield f"{key} beside {ruler}"
        return
    if "type" not in node and not any(key in node for key in _TYPE_INFERRING):
        yield from (f"{key} without a type" for key in _TYPED_KEYWORDS if key in node)
        return
    for ruler, dropped in (
        ("format", ("pattern", "minLength", "maxLength")),
        ("pattern", ("minLength", "maxLength")),
    ):
        if ruler in node:
            yield from (f"{key} beside {ruler}" for key in dropped if key in node)
            return


def values_of_type(values: list[Any], type_: Any) -> bool:
    """Whether every value is of the JSON schema `type_` (a name or a list of names)."""
    names = type_ if isinstance(type_, list) else [type_]
    return all(any(_is_of_type(value, name) for name in names) for value in values)


def _is_of_type(value: Any, name: Any) -> bool:
    if name == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if name == "number":
        return isinstance(value, int | float) and not isinstance(value, bool)
    return isinstance(value, _JSON_TYPES.get(name, ()))


def _as_object(value: Any, name: str) -> Mapping[str, Any]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise SamplingParamsError(f"{name} is not valid JSON: {e}") from None
    if not isinstance(value, Mapping):
        raise SamplingParamsError(f"{name} must be an object, got {value!r:.80}")
    return value
