"""A constraint's grammar as text, without a tokenizer: the EBNF the engine compiles (xgrammar's
print of the constraint, with vbatch's own refusals and repairs), and the check that makes a bad
job-wide constraint one error before the job starts (torch-free)."""

from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec

from vbatch.errors import SamplingParamsError
from vbatch.structured import (
    EXTRA_HINT,
    StructuredOutput,
    choice_ebnf,
    subschemas,
    xgrammar_message,
)

# NOTE: xgrammar 0.2.9 compiles a string's minLength/maxLength into a rule over this class, which
# admits raw control characters no strict JSON parser accepts (xgrammar issue #800); vbatch
# narrows it in the grammar's EBNF to what JSON lets a string hold unescaped. Only the rule is
# changed: the schema (and its const, enum and default values) is compiled as given.
_BOUNDED_CHARACTERS = re.compile(r'^(\S+_characters ::= \(\()\[\^\\"\\\\\\r\\n\](\)\))$', re.M)
_JSON_CHARACTERS = r'\1[^\\0-\\x1f"\\\\]\2'
_EMPTY_RULE = re.compile(r'^\S+ ::= \(""\)$', re.M)
_REGEX_ESCAPE = re.compile(r"\\(.)", re.S)
# NOTE: the letters xgrammar 0.2.9's regex parser reads as escapes, or refuses itself (\b, \p,
# \k, ...); any other letter it matches as that letter, with only a log line.
_KNOWN_ESCAPES = frozenset("abBcdDefknpPrsStuUvwWx")
_CONTROL_ESCAPES = frozenset("ntrfvae")
_LITERAL_MESSAGE = (
    "a schema pattern that writes a quote, a backslash or a control character as a literal "
    "cannot be written inside a JSON string by the grammar engine"
)


def cli_structured(
    json_schema_file: Path | None,
    regex: str | None,
    choice: str | None,
    grammar_file: Path | None,
) -> dict[str, Any] | None:
    """The job-wide constraint of `--json-schema FILE`, `--regex`, `--choice a,b,c` or
    `--grammar FILE`, as the manifest keeps it; None when none is given."""
    given = {
        "json_schema": json_schema_file,
        "regex": regex,
        "choice": choice,
        "grammar": grammar_file,
    }
    given = {kind: value for kind, value in given.items() if value is not None}
    if not given:
        return None
    if len(given) > 1:
        flags = ", ".join(f"--{kind.replace('_', '-')}" for kind in given)
        raise SamplingParamsError(
            f"give one of --json-schema, --regex, --choice, --grammar, not {flags}"
        )
    if importlib.util.find_spec("xgrammar") is None:
        raise SamplingParamsError(EXTRA_HINT)
    [(kind, value)] = given.items()
    flag = f"--{kind.replace('_', '-')}"
    if isinstance(value, Path):
        try:
            value = value.read_text(encoding="utf-8")
        except OSError as e:
            raise SamplingParamsError(f"cannot read the {flag} file: {e}") from None
        except UnicodeDecodeError as e:
            raise SamplingParamsError(f"the {flag} file is not UTF-8 text: {e}") from None
    elif kind == "choice":
        value = [c.strip() for c in value.split(",")]
        if not all(value):
            raise SamplingParamsError(f"--choice: {choice!r} has an empty label")
    try:
        structured = StructuredOutput(**{kind: value})
        _check_compiles(structured)
    except SamplingParamsError as e:
        raise SamplingParamsError(f"{flag}: {e}") from None
    return msgspec.to_builtins(structured)


def _check_compiles(structured: StructuredOutput) -> None:
    """Refuse what the engine would refuse, where no tokenizer is needed: vbatch's own refusals
    and xgrammar's reading of the EBNF the engine would compile."""
    from xgrammar import Grammar

    try:
        Grammar.from_ebnf(constraint_ebnf(structured))
    except Exception as e:
        raise SamplingParamsError(f"invalid {structured.kind}: {xgrammar_message(e)}") from None


def constraint_ebnf(spec: StructuredOutput) -> str:
    """The EBNF the engine compiles for `spec`; a ValueError (vbatch's refusals) or xgrammar's
    error where it cannot be written."""
    if spec.json_schema is not None:
        assert isinstance(spec.json_schema, str)
        return json_schema_ebnf(spec.json_schema, spec.strict)
    if spec.choice is not None:
        return choice_ebnf(spec.choice)
    return utf8_only(_grammar_of(spec))


def json_schema_ebnf(schema: str, strict: bool) -> str:
    """The EBNF of a JSON schema (compact JSON), its length-bounded strings over JSON's
    unescaped characters only (see _BOUNDED_CHARACTERS), every character valid UTF-8."""
    import xgrammar

    for pattern in _schema_patterns(json.loads(schema)):
        check_regex_escapes(pattern)
        _check_json_string_literals(pattern)
    grammar = str(
        xgrammar.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=strict)
    )
    if _EMPTY_RULE.search(grammar):
        # NOTE: xgrammar 0.2.9 writes a bounded number to 6 decimal places; a range with no
        # such number in it becomes a rule for the empty string, which no JSON value is.
        raise ValueError(
            "a number range in the schema holds no number of at most 6 decimal places, which "
            "is all the grammar engine writes; widen it"
        )
    return utf8_only(_BOUNDED_CHARACTERS.sub(_JSON_CHARACTERS, grammar))


def _schema_patterns(schema: Any) -> Iterator[str]:
    """Every regex a JSON schema holds: its schemas' `pattern` values and `patternProperties`
    keys (not data: a `const`, `enum` or `default` value with a "pattern" key)."""
    if not isinstance(schema, dict):
        return
    for node in subschemas(schema):
        if isinstance(node.get("pattern"), str):
            yield node["pattern"]
        if isinstance(node.get("patternProperties"), dict):
            yield from node["patternProperties"]


def _check_json_string_literals(pattern: str) -> None:
    """A ValueError for a schema pattern that writes a quote, a backslash or a control character
    as a literal: xgrammar 0.2.9 puts a pattern's literals between the string's quotes as they
    are, unescaped, so such an output would not be JSON (classes and `.` are narrowed)."""
    in_class = False
    i = 0
    while i < len(pattern):
        char = pattern[i]
        if char == "\\" and i + 1 < len(pattern):
            escaped, width = pattern[i + 1], _HEX_WIDTHS.get(pattern[i + 1], 0)
            code = (
                int(pattern[i + 2 : i + 2 + width], 16)
                if width and _is_hex(pattern[i + 2 : i + 2 + width], width)
                else None
            )
            if not in_class and (
                escaped in '"\\'
                or escaped in _CONTROL_ESCAPES
                or (code is not None and code < 0x20)
            ):
                raise ValueError(_LITERAL_MESSAGE)
            i += 2 + (width if code is not None else 0)
            continue
        if char == "[" and not in_class:
            in_class = True
        elif char == "]" and in_class:
            in_class = False
        elif not in_class and (char == '"' or ord(char) < 0x20):
            raise ValueError(_LITERAL_MESSAGE)
        i += 1


def _is_hex(text: str, width: int) -> bool:
    return len(text) == width and all(c in "0123456789abcdefABCDEF" for c in text)


def check_regex_escapes(regex: str) -> None:
    """A ValueError for an escape xgrammar would read as its letter (`\\A` as "A", with only a
    log line) or `\\0` as nothing; the escapes it knows, or refuses itself, pass."""
    for match in _REGEX_ESCAPE.finditer(regex):
        char = match.group(1)
        if char == "0" or (char.isascii() and char.isalpha() and char not in _KNOWN_ESCAPES):
            raise ValueError(
                f"the regex escape \\{char} is not supported by the grammar engine, which would "
                "not match what it means"
            )


def _grammar_of(spec: StructuredOutput) -> str:
    """The EBNF of a json_object, regex or grammar constraint, as xgrammar prints it."""
    import xgrammar

    if spec.json_object:
        return str(
            xgrammar.Grammar.from_json_schema(
                '{"type": "object"}', any_whitespace=False, strict_mode=False
            )
        )
    if spec.regex is not None:
        check_regex_escapes(spec.regex)
        return str(xgrammar.Grammar.from_regex(_caret_not_first(spec.regex, ebnf=False)))
    assert spec.grammar is not None
    return str(xgrammar.Grammar.from_ebnf(_caret_not_first(spec.grammar, ebnf=True)))


def _caret_not_first(text: str, ebnf: bool) -> str:
    """A regex or EBNF grammar whose classes that begin with an escaped caret (`[\\^a]`) begin
    with the surrogate range instead, which utf8_only then removes.

    xgrammar 0.2.9 parses such a class right but prints it as `[^a]`, a negated class, which
    the printed grammar's compile then reads; a `\\u005e` or `\\x5e` is printed the same way.
    Only classes are read: in EBNF, string literals (regexes among them) and comments are kept.
    """
    out: list[str] = []
    i = 0
    while i < len(text):
        char = text[i]
        if char == "\\":
            out.append(text[i : i + 2])
            i += 2
            continue
        if ebnf and char in '"#':
            end = _closing(text, i) if char == '"' else (text + "\n").index("\n", i)
            out.append(text[i : end + 1])
            i = end + 1
            continue
        if char != "[":
            out.append(char)
            i += 1
            continue
        end = _closing(text, i)
        if end >= len(text):
            # NOTE: an unterminated class stays as it is, for xgrammar to refuse.
            out.append(text[i:])
            break
        body = text[i + 1 : end]
        out.append("[" + "\\ud800-\\udfff" * body.startswith("\\^") + body + "]")
        i = end + 1
    return "".join(out)


def utf8_only(ebnf: str) -> str:
    """xgrammar's printed EBNF with no character class that admits a UTF-16 surrogate.

    xgrammar 0.2.9 matches U+D800-U+DFFF, encoded as three bytes, wherever a class admits them
    (`[^"]`, a regex's `.`). Those bytes are not UTF-8, so they decode to three U+FFFD and break
    the constraint's bounds. Negated classes gain the surrogate range; positive ones lose it,
    in EBNF and in the regexes of `Regex("...")` (a JSON schema's `pattern`), whose `.`, `\\S`,
    `\\W` and `\\D` become negated classes too.
    Every `\\xHH` escape is also written as `\\u00HH`, because xgrammar's parser reads as many
    hex digits after `\\x` as follow, while its printer writes two.
    """
    out: list[str] = []
    i = 0
    while i < len(ebnf):
        if ebnf[i] not in '"[':
            out.append(ebnf[i])
            i += 1
            continue
        end = _closing(ebnf, i)
        body = ebnf[i + 1 : end]
        if ebnf[i] == '"' and _opens_regex(ebnf, i):
            out.append('"' + _utf8_regex(body) + '"')
        elif ebnf[i] == '"':
            out.append('"' + _HEX_ESCAPE.sub(_as_u_escape, body) + '"')
        else:
            out.append(_utf8_class(body))
        i = end + 1
    return "".join(out)


_SURROGATES = (0xD800, 0xDFFF)
_HEX_ESCAPE = re.compile(r"\\(x[0-9a-fA-F]{2}|.)", re.S)
_EBNF_UNIT = re.compile(r"\\(?:x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8}|.)|.", re.S)
_NAMED_ESCAPES = {"0": 0, "a": 7, "b": 8, "t": 9, "n": 10, "v": 11, "f": 12, "r": 13, "e": 27}
_HEX_WIDTHS = {"x": 2, "u": 4, "U": 8}


# NOTE: xgrammar's regex parser reads as many hex digits after `\\u` or `\\x` as follow, so
# every code point vbatch writes into a regex is braced.
_REGEX_SURROGATES = "\\\\u{d800}-\\\\u{dfff}"
_IS_NAME = re.compile(r"[\w-]")
_NEGATED_SHORTHANDS = {"S": "\\\\s", "W": "\\\\w", "D": "\\\\d"}


def _opens_regex(ebnf: str, quote: int) -> bool:
    """Whether the literal at `quote` is the regex of a `Regex(...)` macro."""
    start = quote - len("Regex(")
    if start < 0 or not ebnf.startswith("Regex(", start):
        return False
    return start == 0 or not _IS_NAME.match(ebnf, start - 1)


def _utf8_regex(body: str) -> str:
    """The printed body of a `Regex("...")` literal with no class, `.` or negated shorthand that
    admits a surrogate. `body` is EBNF-escaped (a regex's backslash is `\\\\`): the regex is
    read through its escapes, its text kept, and only new EBNF-escaped text written."""
    units = [
        (_escaped_char(unit), _HEX_ESCAPE.sub(_as_u_escape, unit))
        for unit in _EBNF_UNIT.findall(body)
    ]
    out: list[str] = []
    i = 0
    while i < len(units):
        char, text = units[i]
        if char == "\\" and i + 1 < len(units):
            escaped = units[i + 1][0]
            if escaped in _NEGATED_SHORTHANDS:
                out.append(f"[^{_NEGATED_SHORTHANDS[escaped]}{_REGEX_SURROGATES}]")
            else:
                out.append(text + units[i + 1][1])
            i += 2
        elif char == ".":
            out.append(f"[^{_REGEX_SURROGATES}]")
            i += 1
        elif char == "[":
            end = i + 1
            while end < len(units) and units[end][0] != "]":
                end += 2 if units[end][0] == "\\" else 1
            out.append(_utf8_regex_class(units[i + 1 : end]))
            i = end + 1
        else:
            out.append(text)
            i += 1
    return "".join(out)


def _utf8_regex_class(units: list[tuple[str, str]]) -> str:
    """A regex class (its body's units, char and EBNF text) as EBNF text that admits no
    surrogate: a negated class gains the range; a positive one is kept unless it holds
    surrogates or a negated shorthand, then written anew (with an alternation for shorthands)."""
    text = "".join(t for _, t in units)
    if units and units[0][0] == "^":
        return f"[{text}{_REGEX_SURROGATES}]"
    try:
        return _utf8_positive_regex_class("".join(c for c, _ in units), text)
    except ValueError:
        # NOTE: a malformed escape (`\u{`, a code point past U+10FFFF): xgrammar rejects it.
        return f"[{text}]"


def _utf8_positive_regex_class(chars: str, text: str) -> str:
    """A positive regex class, its body's characters and EBNF text, as _utf8_regex_class."""
    ranges: list[tuple[int, int]] = []
    shorthands: list[str] = []
    negated: list[str] = []
    i = 0
    while i < len(chars):
        if chars[i] == "\\" and chars[i + 1 : i + 2] in ("d", "w", "s", "D", "W", "S"):
            (negated if chars[i + 1].isupper() else shorthands).append(chars[i + 1])
            i += 2
            continue
        low, i = _regex_class_char(chars, i)
        high = low
        if i + 1 < len(chars) and chars[i] == "-":
            high, i = _regex_class_char(chars, i + 1)
        ranges.append((low, high))
    first, last = _SURROGATES
    if not negated and all(high < first or low > last for low, high in ranges):
        return f"[{text}]"
    pieces = [
        piece
        for low, high in ranges
        for piece in ((low, min(high, first - 1)), (max(low, last + 1), high))
        if piece[0] <= piece[1]
    ]
    alternatives = [f"[^{_NEGATED_SHORTHANDS[s]}{_REGEX_SURROGATES}]" for s in negated]
    if pieces or shorthands:
        kept = "".join("\\\\" + s for s in shorthands)
        kept += "".join(_regex_range_text(r) for r in pieces)
        alternatives.insert(0, f"[{kept}]")
    if not alternatives:
        return "[^\\\\u{0}-\\\\u{10ffff}]"
    return alternatives[0] if len(alternatives) == 1 else f"(?:{'|'.join(alternatives)})"


def _regex_class_char(chars: str, i: int) -> tuple[int, int]:
    """The code point of the regex class element at `i` (xgrammar's reading), and the next
    index."""
    if chars[i] != "\\" or i + 1 == len(chars):
        return ord(chars[i]), i + 1
    kind = chars[i + 1]
    if kind in "xu" and chars[i + 2 : i + 3] == "{":
        end = chars.index("}", i + 2)
        return int(chars[i + 3 : end], 16), end + 1
    if kind in "xuU":
        digits = re.match(r"[0-9a-fA-F]{1,8}" if kind == "U" else r"[0-9a-fA-F]+", chars[i + 2 :])
        if digits:
            return int(digits.group(0), 16), i + 2 + digits.end()
    return _NAMED_ESCAPES.get(kind, ord(kind)), i + 2


def _regex_range_text(span: tuple[int, int]) -> str:
    low, high = (
        chr(c) if chr(c).isascii() and chr(c).isalnum() else f"\\\\u{{{c:x}}}" for c in span
    )
    return low if span[0] == span[1] else f"{low}-{high}"


def _escaped_char(unit: str) -> str:
    """The character an EBNF literal's escape unit (or plain character) stands for."""
    if len(unit) == 1:
        return unit
    if unit[1] in _HEX_WIDTHS:
        return chr(int(unit[2:], 16))
    return chr(_NAMED_ESCAPES.get(unit[1], ord(unit[1])))


def _as_u_escape(match: re.Match[str]) -> str:
    escape = match.group(1)
    return "\\u00" + escape[1:] if escape[0] == "x" and len(escape) == 3 else match.group(0)


def _closing(ebnf: str, start: int) -> int:
    """The index of the quote or bracket that closes the literal or class opened at `start` (at
    least the text's length where none does)."""
    close = '"' if ebnf[start] == '"' else "]"
    i = start + 1
    while i < len(ebnf) and ebnf[i] != close:
        i += 2 if ebnf[i] == "\\" else 1
    return i


def _utf8_class(body: str) -> str:
    """A printed class body (without brackets) as a class that admits no surrogate."""
    negated = body.startswith("^")
    ranges: list[tuple[int, int]] = []
    i = 1 if negated else 0
    while i < len(body):
        low, i = _class_char(body, i)
        high = low
        if i + 1 < len(body) and body[i] == "-":
            high, i = _class_char(body, i + 1)
        ranges.append((low, high))
    if negated:
        ranges.append(_SURROGATES)
    else:
        first, last = _SURROGATES
        ranges = [
            piece
            for low, high in ranges
            for piece in ((low, min(high, first - 1)), (max(low, last + 1), high))
            if piece[0] <= piece[1]
        ]
        if not ranges:
            return "[^\\0-\\U0010ffff]"
    return "[" + "^" * negated + "".join(_range_text(r) for r in ranges) + "]"


def _class_char(body: str, i: int) -> tuple[int, int]:
    """The code point of the class element at `i` as xgrammar prints it, and the next index."""
    if body[i] != "\\":
        return ord(body[i]), i + 1
    kind = body[i + 1]
    if kind in _HEX_WIDTHS:
        end = i + 2 + _HEX_WIDTHS[kind]
        return int(body[i + 2 : end], 16), end
    return _NAMED_ESCAPES.get(kind, ord(kind)), i + 2


def _range_text(span: tuple[int, int]) -> str:
    low, high = (_char_text(c) for c in span)
    return low if span[0] == span[1] else f"{low}-{high}"


def _char_text(code: int) -> str:
    if chr(code).isascii() and chr(code).isalnum():
        return chr(code)
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"
