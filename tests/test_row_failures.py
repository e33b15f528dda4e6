"""A row that raises at any stage (parse, render, output encoding) or whose step raises fails
alone: it becomes an error row, and the job, and every resume, goes on past it."""

from __future__ import annotations

import json
from pathlib import Path

from helpers import read_jsonl, with_chat_template

from vbatch.job.rows import ColumnOptions
from vbatch.job.runner import JobSpec, RunOptions, start_job

# NOTE: a template that trusts its inputs' types, as real ones do.
TEMPLATE = (
    "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}"
    "{% if m.tool_calls %}{% for call in m.tool_calls %}{{ call }}{% endfor %}{% endif %}"
    "{% endfor %}{{ (prefix if prefix is defined else '') + 'assistant:' }}"
)


def nested(depth: int) -> str:
    return '{"a": ' * depth + "{}" + "}" * depth


def deep_schema(depth: int) -> str:
    return '{"type": "array", "items": ' * depth + '{"type": "string"}' + "}" * depth


def test_rows_that_raise_at_each_stage_become_error_rows(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    model = with_chat_template(tiny_model_dir, tmp_path / "model", TEMPLATE)
    chat = [{"role": "user", "content": "hi"}]
    calls = [*chat, {"role": "assistant", "content": None, "tool_calls": 7}]
    rows = [
        {"id": "ok", "prompt": "hello", "extra": 1},
        {"id": "chat", "messages": chat},
        {"id": "kwargs", "messages": chat, "chat_template_kwargs": {"prefix": 5}},
        {"id": "calls", "messages": calls},
    ]
    lines = [json.dumps(row) for row in rows]
    # NOTE: deeper than json.dumps (schema) and orjson.dumps (kept value) recurse; as text.
    schema = (
        f'{{"type": "json_schema", "json_schema": {{"name": "x", "schema": {deep_schema(1000)}}}}}'
    )
    lines.append(f'{{"id": "schema", "prompt": "x", "response_format": {schema}}}')
    lines.append(f'{{"id": "kept", "prompt": "y", "extra": {nested(300)}}}')
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    spec = JobSpec(
        tmp_path / "in.jsonl",
        tmp_path / "out.jsonl",
        model=str(model),
        engine_args={"num_threads": 1},
        sampling={"max_tokens": 2, "temperature": 0.0},
        columns=ColumnOptions(keep_columns=("extra",)),
    )
    metrics = tmp_path / "metrics.json"
    outcome = start_job(spec, RunOptions(display="quiet", metrics_file=metrics))
    assert outcome.exit_code == 0, outcome.message
    # NOTE: every failure here is the row's, none the engine's.
    assert json.loads(metrics.read_text())["errors_by_kind"] == {"input": 4}
    results = {r["id"]: r for r in read_jsonl(tmp_path / "out.jsonl")}
    assert len(results) == len(lines)
    assert results["ok"]["error"] is None and results["ok"]["extra"] == 1
    assert results["chat"]["error"] is None
    for row_id, reason in (
        ("kwargs", "the chat template failed on these messages: TypeError"),
        ("calls", "the chat template failed on these messages: TypeError"),
        ("schema", "line 5: "),
        ("kept", "line 6: the output row could not be written: TypeError"),
    ):
        assert results[row_id]["finish_reason"] == "error", row_id
        assert reason in results[row_id]["error"], (row_id, results[row_id]["error"])
    assert "extra" not in results["kept"]
