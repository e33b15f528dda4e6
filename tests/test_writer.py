"""Tests for the output writers: commits, truncation of uncommitted tails, orphan parts."""

from __future__ import annotations

from pathlib import Path

import orjson
import pyarrow.parquet as pq
import pytest

from vbatch.errors import JobStateError
from vbatch.job.journal import Journal
from vbatch.job.results import error_row, parquet_schema
from vbatch.job.rows import InputRow
from vbatch.job.writer import JsonlWriter, ParquetWriter


def row_values(index: int, is_error: bool = False) -> dict:
    values = error_row(InputRow(index, f"line {index + 1}", f"r{index}"), "bad")
    if not is_error:
        values.update(text=f"text {index}", finish_reason="length", error=None)
    return values


def test_jsonl_commit_records_offset_and_resume_truncates_the_tail(tmp_path: Path) -> None:
    output = tmp_path / "out.jsonl"
    journal = Journal(tmp_path)
    writer = JsonlWriter(journal, output)
    for i in (2, 0, 1):
        writer.add(row_values(i, is_error=i == 1), None, None)
    assert writer.commit() == 3 and writer.commit() == 0
    committed_size = output.stat().st_size
    writer.add(row_values(3), None, None)
    writer.flush()
    assert output.stat().st_size > committed_size
    writer.close()
    journal.close()
    state = Journal(tmp_path).state
    assert state.offset == committed_size and state.committed.ranges() == [[0, 3]]
    assert state.errors.ranges() == [[1, 2]]
    JsonlWriter(Journal(tmp_path), output).close()
    lines = output.read_bytes().splitlines()
    assert [orjson.loads(line)["index"] for line in lines] == [2, 0, 1]


def test_jsonl_shorter_than_committed_is_refused(tmp_path: Path) -> None:
    output = tmp_path / "out.jsonl"
    journal = Journal(tmp_path)
    writer = JsonlWriter(journal, output)
    writer.add(row_values(0), None, None)
    writer.commit()
    writer.close()
    output.write_bytes(b"")
    with pytest.raises(JobStateError, match="truncated or replaced outside vbatch"):
        JsonlWriter(journal, output)


def test_parquet_parts_are_sorted_when_ordered_and_orphans_removed(tmp_path: Path) -> None:
    journal = Journal(tmp_path)
    schema = parquet_schema("str", [])
    writer = ParquetWriter(journal, tmp_path, schema, id_kind="str", json_kept=False, ordered=True)
    for i in (5, 3, 4):
        writer.add(row_values(i), None, None)
    writer.commit()
    (name,) = [n for _, n in journal.state.parts]
    table = pq.read_table(tmp_path / name)
    assert table.column("index").to_pylist() == [3, 4, 5]
    assert table.column("id").to_pylist() == ["r3", "r4", "r5"]
    orphan = tmp_path / "parts" / "part-000009.parquet"
    orphan.write_bytes(b"half written")
    ParquetWriter(journal, tmp_path, schema, id_kind="str", json_kept=False, ordered=True)
    assert not orphan.exists() and (tmp_path / name).exists()
