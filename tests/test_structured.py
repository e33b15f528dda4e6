"""Structured output from the user's side: the constraint's forms and checks, job rows and the
output columns (the examples in examples/ run in test_examples.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import orjson
import pyarrow.parquet as pq
import pytest

from vbatch.errors import SamplingParamsError
from vbatch.grammar_text import cli_structured
from vbatch.job.rows import ColumnOptions, RowParser
from vbatch.job.runner import JobSpec, RunOptions, start_job
from vbatch.job.validation import OutputChecker
from vbatch.sampling_params import SamplingParams
from vbatch.structured import (
    EXTRA_HINT,
    MAX_SCHEMA_DEPTH,
    StructuredOutput,
    from_guided,
    from_response_format,
    unenforced_keywords,
)

SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["n"],
    "additionalProperties": False,
}


def test_constraint_forms_and_their_wire_form() -> None:
    spec = StructuredOutput(json_schema=SCHEMA)
    assert spec.kind == "json_schema" and spec.is_json
    assert StructuredOutput(json_schema=json.dumps(SCHEMA, indent=4)).key == spec.key
    params = SamplingParams(structured={"choice": ["a", "b"]})
    assert params.structured == StructuredOutput(choice=["a", "b"])
    assert SamplingParams.from_dict(json.loads(json.dumps(params.to_dict()))) == params
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "n", "schema": SCHEMA, "strict": True},
    }
    assert from_response_format(response_format) == spec
    assert from_response_format(json.dumps(response_format)) == spec
    assert from_response_format({"type": "json_object"}) == StructuredOutput(json_object=True)
    assert from_response_format({"type": "text"}) is None
    assert from_guided({"regex": "[0-9]+"}) == StructuredOutput(regex="[0-9]+")


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: StructuredOutput(), "exactly one of"),
        (lambda: StructuredOutput(regex="a", choice=["b"]), "got regex, choice"),
        (lambda: StructuredOutput(json_schema="{oops"), "json_schema is not valid JSON"),
        (lambda: StructuredOutput(json_schema="[1]"), "must be a JSON object"),
        (lambda: StructuredOutput(choice=["a", ""]), "non-empty strings"),
        (lambda: StructuredOutput(regex=""), "non-empty string"),
        (lambda: SamplingParams(structured={"regx": "a"}), "unknown structured output key"),
        (lambda: SamplingParams(structured={"regex": "a"}, ignore_eos=True), "ignore_eos"),
        (lambda: SamplingParams(structured={"regex": "a"}, min_tokens=2), "min_tokens"),
        (lambda: from_response_format({"type": "xml"}), "json_schema, json_object or text"),
        (lambda: from_response_format({"type": "json_schema"}), "a 'schema' field"),
        (lambda: from_guided({"regex": "a", "choice": ["b"]}), "exactly one of regex"),
    ],
)
def test_bad_constraints_are_sampling_params_errors(make: Any, message: str) -> None:
    with pytest.raises(SamplingParamsError, match=message):
        make()


def test_cli_flags_make_one_constraint(tmp_path: Path) -> None:
    pytest.importorskip("xgrammar")
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(SCHEMA))
    assert cli_structured(path, None, None, None) == {"json_schema": json.dumps(SCHEMA)}
    assert cli_structured(None, None, " a, b ,c", None) == {"choice": ["a", "b", "c"]}
    assert cli_structured(None, None, None, None) is None
    with pytest.raises(SamplingParamsError, match="not --regex, --choice"):
        cli_structured(None, "x", "a,b", None)
    for typo in ("a,,b", "a,b,", ","):
        with pytest.raises(SamplingParamsError, match="has an empty label"):
            cli_structured(None, None, typo, None)
    with pytest.raises(SamplingParamsError, match="cannot read the --grammar file"):
        cli_structured(None, None, None, tmp_path / "missing.ebnf")


def test_missing_xgrammar_is_one_line_naming_the_extra(tmp_path: Path) -> None:
    script = (
        "import sys; sys.modules['xgrammar'] = None\n"
        "from vbatch.grammar_text import cli_structured\n"
        "cli_structured(None, 'x', None, None)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode != 0 and EXTRA_HINT in proc.stderr
    assert "pip install 'vbatch[structured]'" in EXTRA_HINT


def test_rows_take_response_format_guided_and_openai_body() -> None:
    parser = RowParser(ColumnOptions(), SamplingParams())
    response_format = {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}
    rows = [
        {"prompt": "p", "response_format": response_format},
        {"prompt": "p", "guided": {"choice": ["x", "y"]}, "sampling_params": {"max_tokens": 3}},
        {
            "custom_id": "c",
            "url": "/v1/completions",
            "body": {"prompt": "p", "response_format": {"type": "json_object"}},
        },
        {"prompt": "p", "guided": {"regex": "a"}, "response_format": {"type": "json_object"}},
        {"prompt": "p", "guided": {"choice": []}},
        {"prompt": "p"},
        {
            "prompt": "p",
            "guided": {"regex": "a"},
            "sampling_params": {"structured_outputs": {"regex": "b"}},
        },
        {
            "prompt": "p",
            "response_format": {"type": "text"},
            "sampling_params": {"structured_outputs": {"regex": "[0-9]{3}"}},
        },
    ]
    parsed = [parser.parse(record, i, f"line {i + 1}") for i, record in enumerate(rows)]
    structured = [row.sampling_params and row.sampling_params.structured for row in parsed]
    assert structured[0] == StructuredOutput(json_schema=SCHEMA)
    assert structured[1] == StructuredOutput(choice=["x", "y"])
    assert parsed[1].sampling_params is not None and parsed[1].sampling_params.max_tokens == 3
    assert structured[2] == StructuredOutput(json_object=True)
    assert parsed[3].error is not None and "not both" in parsed[3].error
    assert parsed[4].error is not None and "non-empty list" in parsed[4].error
    assert parsed[5].sampling_params is None and parsed[5].error is None
    for row, field in zip(parsed[6:], ("guided", "response_format"), strict=True):
        assert row.error is not None, field
        assert f"{field} and sampling_params.structured_outputs both do" in row.error


@pytest.mark.parametrize("output_name", ["out.jsonl", "out.parquet"])
def test_job_rows_with_constraints_flags_and_parsed_json(
    tmp_path: Path, tiny_model_dir: Path, shared_llm: Callable[..., Any], output_name: str
) -> None:
    pytest.importorskip("xgrammar")
    response_format = {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}
    records = [
        {"id": "schema", "prompt": "a", "response_format": response_format},
        {"id": "choice", "prompt": "b", "guided": {"choice": ["yes", "no"]}},
        {"id": "short", "prompt": "c", "response_format": response_format,
         "sampling_params": {"max_tokens": 2}},
        {"id": "bad", "prompt": "d", "guided": {"regex": "(("}},
        {"id": "badschema", "prompt": "e",
         "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "x"}}}},
        {"id": "free", "prompt": "f"},
        {"id": "stopped", "prompt": "g", "guided": {"choice": ["yes"]},
         "sampling_params": {"stop": ["e"]}},
        {"id": "kept_eos", "prompt": "a", "response_format": response_format,
         "sampling_params": {"skip_special_tokens": False, "include_stop_str_in_output": True}},
    ]  # fmt: skip
    input_path = tmp_path / "in.jsonl"
    input_path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in records))
    spec = JobSpec(
        input_path,
        tmp_path / output_name,
        model=str(tiny_model_dir),
        engine_args={"num_threads": 1},
        sampling={"max_tokens": 32, "temperature": 0.0},
        parse_json=True,
    )
    outcome = start_job(spec, RunOptions(display="quiet"), llm_factory=shared_llm)
    assert outcome.exit_code == 0, outcome.message
    path = tmp_path / output_name
    if path.suffix == ".parquet":
        rows = pq.read_table(path).to_pylist()
        for row in rows:
            row["json"] = None if row["json"] is None else json.loads(row["json"])
    else:
        rows = [orjson.loads(line) for line in path.read_bytes().splitlines()]
    out = {row["id"]: row for row in rows}
    assert out["schema"]["structured_complete"] is True
    jsonschema.validate(out["schema"]["json"], SCHEMA)
    assert out["schema"]["json"] == json.loads(out["schema"]["text"])
    assert out["choice"]["text"] in ("yes", "no") and out["choice"]["structured_complete"]
    assert out["short"]["finish_reason"] == "length"
    assert out["short"]["structured_complete"] is False and out["short"].get("json") is None
    assert out["bad"]["finish_reason"] == "error" and "invalid regex" in out["bad"]["error"]
    assert 'Unsupported type "x"' in out["badschema"]["error"]
    assert out["free"].get("structured_complete") is None and out["free"]["error"] is None
    assert (out["stopped"]["text"], out["stopped"]["stop_reason"]) == ("y", "e")
    assert out["stopped"]["structured_complete"] is False
    # NOTE: the EOS text the row keeps is not JSON the grammar made: the check leaves it out.
    assert out["kept_eos"]["text"] == out["schema"]["text"] + "<|im_end|>"
    assert out["kept_eos"]["structured_valid"] is True
    assert out["kept_eos"]["json"] == out["schema"]["json"]


def nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(depth - 1):
        schema = {"type": "array", "items": schema}
    return schema


def deep_schema_line(row_id: str, depth: int) -> bytes:
    """A JSONL row whose schema nests `depth` levels (beyond what orjson.dumps writes)."""
    schema = '{"type": "array", "items": ' * (depth - 1) + '{"type": "integer"}' + "}" * (depth - 1)
    return (
        f'{{"id": "{row_id}", "prompt": "p", "response_format": {{"type": "json_schema", '
        f'"json_schema": {{"schema": {schema}}}}}}}\n'
    ).encode()


def test_a_deep_schema_is_refused_before_any_recursive_code(tmp_path: Path) -> None:
    assert StructuredOutput(json_schema=nested(MAX_SCHEMA_DEPTH)).json_schema
    with pytest.raises(
        SamplingParamsError, match=f"nests more than {MAX_SCHEMA_DEPTH} levels deep"
    ):
        StructuredOutput(json_schema=nested(1000))
    deep_text = '{"items": ' * 3000 + "{}" + "}" * 3000
    with pytest.raises(SamplingParamsError, match="nests more than"):
        StructuredOutput(json_schema=deep_text)
    path = tmp_path / "deep.json"
    path.write_text(deep_text)
    with pytest.raises(SamplingParamsError, match="--json-schema: json_schema nests"):
        cli_structured(path, None, None, None)
    parser = RowParser(ColumnOptions(), SamplingParams())
    row = parser.parse(orjson.loads(deep_schema_line("deep", 1000)), 0, "line 1")
    assert row.error is not None and "nests more than 128 levels" in row.error


def test_schema_messages_remote_refs_and_strict() -> None:
    with pytest.raises(SamplingParamsError, match=r"json_schema\.schema is null"):
        from_response_format({"type": "json_schema", "json_schema": {"schema": None}})
    with pytest.raises(SamplingParamsError, match="remote \\$ref"):
        StructuredOutput(json_schema={"properties": {"a": {"$ref": "https://x.org/s.json"}}})
    # NOTE: a $ref inside a const value is data, not a reference.
    assert StructuredOutput(json_schema={"const": {"$ref": "https://x.org/s.json"}}).json_schema
    spec = {"schema": SCHEMA, "strict": False}
    assert from_response_format({"type": "json_schema", "json_schema": spec}).strict is False
    spec = {"schema": SCHEMA, "strict": True}
    assert from_response_format({"type": "json_schema", "json_schema": spec}).strict is True
    # NOTE: "false" and 0 once ran as strict, to fail with a hint to give strict: false.
    for strict in ("false", 0):
        spec = {"schema": SCHEMA, "strict": strict}
        with pytest.raises(SamplingParamsError, match="strict must be true or false, got"):
            from_response_format({"type": "json_schema", "json_schema": spec})
    with pytest.raises(SamplingParamsError, match="strict: false applies to json_schema only"):
        StructuredOutput(regex="a", strict=False)


def test_a_bad_job_wide_constraint_is_one_error_before_the_job() -> None:
    pytest.importorskip("xgrammar")
    with pytest.raises(SamplingParamsError, match=r"--regex: invalid regex: .*parenthesis"):
        cli_structured(None, "(", None, None)
    with pytest.raises(SamplingParamsError, match=r"--choice: ',' has an empty label"):
        cli_structured(None, None, ",", None)


def test_what_the_engine_refuses_is_refused_before_the_job(tmp_path: Path) -> None:
    pytest.importorskip("xgrammar")
    with pytest.raises(SamplingParamsError, match=r"--regex: invalid regex: the regex escape \\A"):
        cli_structured(None, r"\A", None, None)
    narrow = {"type": "number", "minimum": 0.12345678, "maximum": 0.12345679}
    quoted = {"type": "string", "pattern": 'a"b'}
    for schema, message in (
        (narrow, "a number range in the schema"),
        (quoted, "a schema pattern that writes a quote"),
    ):
        path = tmp_path / "schema.json"
        path.write_text(json.dumps(schema))
        with pytest.raises(
            SamplingParamsError, match=f"--json-schema: invalid json_schema: {message}"
        ):
            cli_structured(path, None, None, None)
    assert cli_structured(None, r"\d+", None, None) == {"regex": r"\d+"}


def test_a_constraint_file_that_is_not_utf8_is_one_error(tmp_path: Path) -> None:
    path = tmp_path / "grammar.gbnf"
    path.write_bytes(b'root ::= "\xff"\n')
    with pytest.raises(SamplingParamsError, match="the --grammar file is not UTF-8 text"):
        cli_structured(None, None, None, path)


def test_a_text_response_format_overrides_a_job_wide_constraint() -> None:
    defaults = SamplingParams(structured={"choice": ["a", "b"]})
    parser = RowParser(ColumnOptions(), defaults)
    records = [
        {"prompt": "p", "response_format": {"type": "text"}},
        {"custom_id": "c", "body": {"messages": [{"role": "user", "content": "x"}],
                                    "response_format": {"type": "text"}}},
        {"prompt": "p"},
    ]  # fmt: skip
    rows = [parser.parse(record, i, f"line {i + 1}") for i, record in enumerate(records)]
    assert rows[0].sampling_params is not None and rows[0].sampling_params.structured is None
    assert rows[1].sampling_params is not None and rows[1].sampling_params.structured is None
    assert rows[2].sampling_params is None


def test_unenforced_keywords_are_named_once_per_schema_and_outputs_checked() -> None:
    warnings: list[str] = []
    checker = OutputChecker(warnings.append)
    schema = {
        "type": "object",
        "properties": {
            "x": {"type": "number", "multipleOf": 0.25},
            "tags": {"type": "array", "uniqueItems": True, "items": {"type": "string"}},
            "c": {"const": {"not": 1}},
            "o": {"oneOf": [{"type": "integer"}, {"type": "number"}]},
        },
    }
    structured = StructuredOutput(json_schema=schema)
    checker.note(structured)
    checker.note(StructuredOutput(json_schema=json.dumps(schema, indent=2)))
    checker.note(StructuredOutput(json_schema=SCHEMA))
    [message] = warnings
    assert "multipleOf, oneOf (approximated as anyOf), uniqueItems." in message
    assert "'not'" not in message and " not," not in message
    assert checker.check(structured, ['{"x": 0.5, "tags": ["a", "b"]}']) is None
    assert "multiple of 0.25" in (checker.check(structured, ['{"x": 1.1}']) or "")
    assert "non-unique" in (checker.check(structured, ['{"tags": ["a", "a"]}']) or "")
    assert "repeats the key 'x'" in (checker.check(structured, ['{"x": 1, "x": 2}']) or "")
    anything = StructuredOutput(json_object=True)
    checker.note(anything)
    assert "duplicate keys (json_object)" in warnings[-1]
    assert checker.check(anything, ['{"a": 1}']) is None
    assert "not an object" in (checker.check(anything, ["[1]"]) or "")


@pytest.mark.parametrize(
    ("schema", "named"),
    [
        ({"enum": ["a", "bbb"], "maxLength": 2}, "maxLength beside enum"),
        ({"const": 5, "type": "string"}, "type beside const"),
        ({"type": "string", "pattern": "a+", "maxLength": 3}, "maxLength beside pattern"),
        ({"type": "string", "format": "date", "pattern": "^1"}, "pattern beside format"),
        ({"anyOf": [{"type": "object"}], "required": ["k"]}, "required beside anyOf"),
        ({"type": "object", "anyOf": [{"required": ["a"]}]}, "type beside anyOf"),
        ({"$defs": {"s": {"type": "string"}}, "$ref": "#/$defs/s", "maxLength": 3}, "beside $ref"),
        ({"maxLength": 3}, "maxLength without a type"),
        ({"type": "object", "properties": {"n": {"minimum": 2}}}, "minimum without a type"),
        ({"required": ["a"], "pattern": "^x"}, "required without a type"),
    ],
)
def test_keywords_the_grammar_drops_beside_another_are_named(
    schema: dict[str, Any], named: str
) -> None:
    """xgrammar keeps only an enum, const, anyOf, oneOf, allOf or $ref of a schema, and a string's
    pattern or format alone: before, what it dropped beside them went unnamed."""
    assert any(named in name for name in unenforced_keywords(StructuredOutput(json_schema=schema)))


def test_keywords_the_grammar_keeps_without_a_type_are_not_named() -> None:
    """Without "type", properties or items make the grammar an object's or an array's, and it
    keeps that type's keywords."""
    for schema in (
        {"properties": {"a": {"type": "integer"}}, "required": ["a"], "minProperties": 1},
        {"items": {"type": "integer"}, "minItems": 2, "maxItems": 3},
    ):
        assert unenforced_keywords(StructuredOutput(json_schema=schema)) == []


def test_a_typeless_string_keyword_is_named_and_its_breach_checked() -> None:
    warnings: list[str] = []
    checker = OutputChecker(warnings.append)
    short = StructuredOutput(json_schema={"maxLength": 3})
    checker.note(short)
    assert "maxLength without a type" in warnings[-1]
    assert checker.check(short, ['"abc"']) is None
    assert checker.check(short, ["12345"]) is None
    assert checker.check(short, ['"abcdef"']) is not None


def test_an_enum_of_its_own_type_and_annotations_beside_it_are_not_named() -> None:
    schema = {"type": "string", "enum": ["a", "b"], "description": "d", "title": "t"}
    assert unenforced_keywords(StructuredOutput(json_schema=schema)) == []


def test_formats_and_undeclared_required_properties_are_named() -> None:
    """The grammar writes a `format` by its pattern only, and never writes a property that
    `properties` does not declare, so outputs can break either: warned, and checked."""
    warnings: list[str] = []
    checker = OutputChecker(warnings.append)
    dates = StructuredOutput(json_schema={"type": "string", "format": "date"})
    checker.note(dates)
    assert "format (its pattern only" in warnings[-1]
    undeclared = StructuredOutput(
        json_schema={
            "type": "object",
            "properties": {"a": {"type": "integer"}},
            "required": ["a", "x"],
        }
    )
    checker.note(undeclared)
    assert "required naming a property the schema does not declare" in warnings[-1]
    checker.note(StructuredOutput(json_schema={"type": "object", "required": ["x"]}))
    assert len(warnings) == 3
    checker.note(StructuredOutput(json_schema=SCHEMA))
    assert len(warnings) == 3
    assert "'x' is a required property" in (checker.check(undeclared, ['{"a": 7}']) or "")


def test_a_job_with_deep_emoji_const_and_unenforceable_rows_finishes(
    tmp_path: Path, tiny_model_dir: Path, shared_llm: Callable[..., Any]
) -> None:
    pytest.importorskip("xgrammar")
    never_valid = {"type": "array", "items": {"enum": [1, 2]}, "minItems": 3, "maxItems": 3,
                   "uniqueItems": True}  # fmt: skip
    const = {"type": "object", "properties": {"c": {"const": {"type": "string", "maxLength": 3}}},
             "required": ["c"]}  # fmt: skip

    def schema_row(row_id: str, schema: dict[str, Any]) -> dict[str, Any]:
        response_format = {"type": "json_schema", "json_schema": {"schema": schema}}
        return {"id": row_id, "prompt": "a", "response_format": response_format}

    records = [
        {
            "id": "emoji",
            "prompt": "b",
            "guided": {"choice": ["\U0001f600 happy", "\U0001f622 sad"]},
        },
        schema_row("const", const),
        schema_row("unique", never_valid),
    ]
    input_path = tmp_path / "in.jsonl"
    lines = [deep_schema_line("deep", 1000), *(orjson.dumps(r) + b"\n" for r in records)]
    input_path.write_bytes(b"".join(lines))
    for require_valid in (False, True):
        output = tmp_path / f"out-{require_valid}.jsonl"
        spec = JobSpec(input_path, output, model=str(tiny_model_dir),
                       engine_args={"num_threads": 1},
                       sampling={"max_tokens": 64, "temperature": 0.0},
                       require_valid_json=require_valid)  # fmt: skip
        outcome = start_job(spec, RunOptions(display="quiet"), llm_factory=shared_llm)
        assert outcome.exit_code == 0, outcome.message
        out = {r["id"]: r for r in map(orjson.loads, output.read_bytes().splitlines())}
        assert "nests more than 128 levels" in out["deep"]["error"]
        assert out["emoji"]["text"] in ("\U0001f600 happy", "\U0001f622 sad")
        assert json.loads(out["const"]["text"]) == {"c": {"type": "string", "maxLength": 3}}
        assert out["const"]["structured_valid"] is True
        if require_valid:
            assert "non-unique" in out["unique"]["error"]
            assert "2 errored, 1 with JSON invalid" in outcome.message
        else:
            assert out["unique"]["structured_complete"] is True
            assert out["unique"]["structured_valid"] is False and out["unique"]["error"] is None
            assert "1 errored, 1 with JSON invalid" in outcome.message
