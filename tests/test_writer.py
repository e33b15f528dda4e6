"""Tests for the output writers: commits, truncation of uncommitted tails, orphan parts."""

from __future__ import annotations

from pathlib import Path

import orjson
import pyarrow.parquet as pq
import pytest

from vbatch.errors import JobStateError, OutputLostError
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


def one_committed_row(tmp_path: Path) -> tuple[Path, Journal, JsonlWriter]:
    """(output, journal, writer) of a JSONL job that committed row 0."""
    output = tmp_path / "out.jsonl"
    journal = Journal(tmp_path)
    writer = JsonlWriter(journal, output)
    writer.add(row_values(0), None, None)
    writer.commit()
    return output, journal, writer


def test_jsonl_shorter_than_committed_is_refused(tmp_path: Path) -> None:
    output, journal, writer = one_committed_row(tmp_path)
    writer.close()
    output.write_bytes(b"")
    with pytest.raises(JobStateError, match="truncated or replaced outside vbatch"):
        JsonlWriter(journal, output)


@pytest.mark.parametrize("how", ["deleted", "replaced"])
def test_an_output_lost_mid_job_stops_at_the_next_commit_and_cannot_be_resumed(
    tmp_path: Path, how: str
) -> None:
    """An output deleted (or replaced) while the job ran was appended to, unlinked, until the
    job's end, which then failed as "a bug in vbatch" with a resume command that could not
    work (the resume said the missing file was "0 bytes")."""
    output, journal, writer = one_committed_row(tmp_path)
    output.unlink()
    if how == "replaced":
        output.write_bytes(b"someone else's file, long enough to pass a size check " * 100)
    writer.add(row_values(1), None, None)
    with pytest.raises(OutputLostError, match=f"{output} was {how} outside vbatch while the job"):
        writer.commit()
    assert journal.state.committed.ranges() == [[0, 1]]
    writer.close()
    output.unlink(missing_ok=True)
    with pytest.raises(OutputLostError, match=f"{output} is gone, but .* bytes of rows were"):
        JsonlWriter(journal, output)


def test_an_output_cut_in_place_mid_job_stops_at_the_next_commit(tmp_path: Path) -> None:
    """The same file, truncated: commits went on recording offsets past its end, and `status`
    counted rows the file did not hold, until finalize refused the job."""
    output, journal, writer = one_committed_row(tmp_path)
    with output.open("r+b") as f:
        f.truncate(0)
    writer.add(row_values(1), None, None)
    with pytest.raises(OutputLostError, match=f"{output} was truncated outside vbatch while"):
        writer.commit()
    assert journal.state.committed.ranges() == [[0, 1]]


@pytest.mark.parametrize("how", ["deleted", "replaced"])
def test_a_job_directory_lost_mid_job_stops_at_the_next_commit(tmp_path: Path, how: str) -> None:
    """Its journal's records went to an unlinked file: the job ran on (to exit 0, for a JSONL
    output), or failed with a resume command for a job that no longer existed."""
    job_dir = tmp_path / "out.jsonl.vbatch"
    job_dir.mkdir()
    journal = Journal(job_dir)
    writer = JsonlWriter(journal, tmp_path / "out.jsonl")
    writer.add(row_values(0), None, None)
    writer.commit()
    moved = tmp_path / "moved"
    job_dir.rename(moved)
    if how == "replaced":
        job_dir.mkdir()
        (job_dir / journal.path.name).write_bytes((moved / journal.path.name).read_bytes())
    writer.add(row_values(1), None, None)
    with pytest.raises(OutputLostError, match=f"{job_dir} was {how} outside vbatch while the job"):
        writer.commit()
    with pytest.raises(OutputLostError, match="cannot be resumed: start it again"):
        journal.check_still_there()


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


def test_a_failed_atomic_write_names_its_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ENOSPC from a flush names no file, so a full disk under the manifest's rewrite read "no
    space left on the device holding a job file"."""
    import errno
    import os

    from vbatch.errors import storage_error
    from vbatch.job.paths import write_atomic

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    target = tmp_path / "manifest.json"
    with pytest.raises(OSError) as info:
        write_atomic(target, b"{}")
    assert str(storage_error(info.value)).startswith(
        f"no space left on the device holding {target} (ENOSPC)"
    )
    assert list(tmp_path.iterdir()) == []
