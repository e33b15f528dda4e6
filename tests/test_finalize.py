"""Tests for job completion: Parquet merges, external sorts, retried rows, crash recovery."""

from __future__ import annotations

import random
from pathlib import Path

import orjson
import pyarrow.parquet as pq
import pytest

from vbatch.job import finalize as finalize_module
from vbatch.job.finalize import finalize, finish_completion
from vbatch.job.journal import Journal
from vbatch.job.paths import tmp_output_path
from vbatch.job.results import error_row, parquet_schema
from vbatch.job.rows import InputRow
from vbatch.job.writer import JsonlWriter, OutputWriter, ParquetWriter

NUM_ROWS = 200


def row_values(index: int, text: str) -> dict:
    values = error_row(InputRow(index, f"line {index + 1}", index), "bad")
    if text != "error":
        values.update(text=text, finish_reason="length", error=None)
    return values


def write_job(writer: OutputWriter, order: list[int], text: str, commit_every: int = 7) -> None:
    for n, index in enumerate(order, start=1):
        writer.add(row_values(index, text if index % 10 else "error"), None, None)
        if n % commit_every == 0:
            writer.commit()
    writer.commit()


def shuffled(count: int, seed: int = 0) -> list[int]:
    order = list(range(count))
    random.Random(seed).shuffle(order)
    return order


@pytest.mark.parametrize("ordered", [False, True])
def test_parquet_merge_with_many_parts(
    tmp_path: Path, ordered: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(finalize_module, "MAX_FAN_IN", 4)
    monkeypatch.setattr(finalize_module, "BATCH_ROWS", 3)
    output = tmp_path / "out.parquet"
    journal = Journal(tmp_path)
    schema = parquet_schema("int", [])
    writer = ParquetWriter(
        journal, tmp_path, schema, id_kind="int", json_kept=False, ordered=ordered
    )
    order = shuffled(NUM_ROWS)
    write_job(writer, order, "ok")
    finalize(tmp_path, output, journal, schema, ordered=ordered)
    indices = pq.read_table(output).column("index").to_pylist()
    assert indices == (list(range(NUM_ROWS)) if ordered else order)
    assert not (tmp_path / "parts").exists() and journal.state.complete["rows"] == NUM_ROWS
    assert journal.state.complete["errors"] == NUM_ROWS // 10


@pytest.mark.parametrize("output_name", ["out.jsonl", "out.parquet"])
def test_retried_error_rows_replace_their_first_attempt(tmp_path: Path, output_name: str) -> None:
    output = tmp_path / output_name
    journal = Journal(tmp_path)
    schema = parquet_schema("int", []) if output_name.endswith("parquet") else None
    if schema is None:
        writer: OutputWriter = JsonlWriter(journal, output)
    else:
        writer = ParquetWriter(
            journal, tmp_path, schema, id_kind="int", json_kept=False, ordered=False
        )
    write_job(writer, shuffled(NUM_ROWS), "first")
    errors = journal.state.errors.ranges()
    journal.append("retry", indices=errors, offset=journal.state.offset)
    for start, stop in errors:
        for index in range(start, stop):
            writer.add(row_values(index, "retried"), None, None)
    writer.commit()
    if schema is None:
        writer.close()
    finalize(tmp_path, output, journal, schema, ordered=True)
    if schema is None:
        rows = [orjson.loads(line) for line in output.read_bytes().splitlines()]
    else:
        rows = pq.read_table(output).to_pylist()
    assert [r["index"] for r in rows] == list(range(NUM_ROWS))
    assert {r["text"] for r in rows if r["index"] % 10 == 0} == {"retried"}
    assert journal.state.complete["errors"] == 0


def test_jsonl_external_sort_uses_bounded_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(finalize_module, "RUN_BYTES", 2000)
    monkeypatch.setattr(finalize_module, "MAX_FAN_IN", 3)
    output = tmp_path / "out.jsonl"
    journal = Journal(tmp_path)
    writer = JsonlWriter(journal, output)
    write_job(writer, shuffled(NUM_ROWS, seed=1), "ok")
    writer.close()
    finalize(tmp_path, output, journal, None, ordered=True)
    indices = [orjson.loads(line)["index"] for line in output.read_bytes().splitlines()]
    assert indices == list(range(NUM_ROWS))
    assert not (tmp_path / "merge").exists() and not tmp_output_path(output).exists()


def test_unordered_jsonl_completes_in_place(tmp_path: Path) -> None:
    output = tmp_path / "out.jsonl"
    journal = Journal(tmp_path)
    writer = JsonlWriter(journal, output)
    write_job(writer, [2, 0, 1], "ok")
    writer.close()
    before = output.read_bytes()
    finalize(tmp_path, output, journal, None, ordered=False)
    assert output.read_bytes() == before
    assert journal.state.complete["tmp"] is None


def test_crash_between_complete_record_and_rename_is_finished_later(tmp_path: Path) -> None:
    output = tmp_path / "out.jsonl"
    journal = Journal(tmp_path)
    writer = JsonlWriter(journal, output)
    write_job(writer, [1, 0], "ok")
    writer.close()
    tmp = tmp_output_path(output)
    tmp.write_bytes(b"sorted\n")
    journal.append("complete", tmp=tmp.name, size=7, rows=2, errors=1)
    journal.close()
    state = Journal(tmp_path).state
    finish_completion(tmp_path, output, state)
    assert output.read_bytes() == b"sorted\n" and not tmp.exists()
    finish_completion(tmp_path, output, state)
    assert output.read_bytes() == b"sorted\n"
