"""JSON outputs checked against their constraint (jsonschema), and one warning per schema that
uses what the grammar does not enforce exactly."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Any

from vbatch.structured import StructuredOutput, unenforced_keywords


class DuplicateKeyError(ValueError):
    """An output object names one key twice (JSON allows it; no schema means it)."""


class OutputChecker:
    """Checks the finished JSON outputs of constrained rows; warns once per distinct schema
    that the grammar only approximates (`warn` takes the message; default: stderr)."""

    def __init__(self, warn: Callable[[str], None] | None = None) -> None:
        self._warn = warn or _print_warning
        self._seen: set[bytes] = set()
        self._last: StructuredOutput | None = None

    def note(self, structured: StructuredOutput | None) -> None:
        """Warn, the first time a constraint is seen, about each keyword it uses that the
        grammar does not enforce."""
        # NOTE: a job-wide constraint is one object for every row: no key to compute again.
        if structured is None or structured is self._last or not structured.is_json:
            return
        self._last = structured
        key = structured.key
        if key in self._seen:
            return
        self._seen.add(key)
        names = unenforced_keywords(structured)
        if names:
            self._warn(
                f"a {structured.kind} constraint uses what its grammar does not enforce "
                f"exactly: {', '.join(names)}. Outputs may break it; each finished output is "
                "checked against the schema (the row's structured_valid)"
            )

    def check(self, structured: StructuredOutput, texts: Sequence[str]) -> str | None:
        """Why one of `texts` is not valid for `structured` (a JSON constraint), or None."""
        for text in texts:
            try:
                value = json.loads(text, object_pairs_hook=_unique_keys)
            except DuplicateKeyError as e:
                return str(e)
            except (ValueError, RecursionError) as e:
                return f"the output is not JSON: {e}"
            if structured.json_object:
                if not isinstance(value, dict):
                    return f"the output is a JSON {type(value).__name__}, not an object"
                continue
            assert isinstance(structured.json_schema, str)
            error = _first_error(structured.json_schema, value)
            if error is not None:
                return error
        return None


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    value = dict(pairs)
    if len(value) != len(pairs):
        seen: set[str] = set()
        duplicate = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise DuplicateKeyError(f"the output repeats the key {duplicate!r}")
    return value


@lru_cache(maxsize=256)
def _validator(schema: str) -> Any:
    import jsonschema

    parsed = json.loads(schema)
    cls = jsonschema.validators.validator_for(parsed)
    return cls(parsed, format_checker=cls.FORMAT_CHECKER)


def _first_error(schema: str, value: Any) -> str | None:
    error = next(iter(_validator(schema).iter_errors(value)), None)
    if error is None:
        return None
    where = "".join(f"[{p!r}]" for p in error.absolute_path) or "the output"
    return f"{where} does not match its schema: {error.message:.300}"


def _print_warning(message: str) -> None:
    print(f"vbatch: warning: {message}", file=sys.stderr)
