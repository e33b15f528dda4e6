"""Job completion: turn committed output into the final file atomically (merge, sort, compact)."""

from __future__ import annotations

import errno
import heapq
import os
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import numpy as np

from vbatch.errors import StorageError, is_storage_failure, storage_error
from vbatch.job.encoding import parquet_batches
from vbatch.job.journal import JobState, Journal
from vbatch.job.paths import fsync_dir, remove_file, resume_command, tmp_output_path
from vbatch.job.results import line_index
from vbatch.job.writer import PARTS_DIR, check_jsonl_output, check_parts, damaged_part, one_line

if TYPE_CHECKING:
    import pyarrow as pa

WORK_DIR = "merge"
MAX_FAN_IN = 64
RUN_BYTES = 64 << 20
BATCH_ROWS = 4096
ROW_GROUP_ROWS = 65536


def finalize(
    job_dir: Path, output: Path, journal: Journal, schema: pa.Schema | None, *, ordered: bool
) -> None:
    """Write the final output. A crash at any point leaves either the old state (the job is not
    complete, and finalize runs again) or a `complete` record that `finish_completion` honours.
    A failed write (StorageError) removes the temp file and the merge files it wrote."""
    state = journal.state
    tmp = tmp_output_path(output)
    counts = {"rows": len(state.committed), "errors": len(state.errors)}
    if schema is None:
        size = check_jsonl_output(output, state.offset)
    if schema is None and not ordered and not state.retries:
        journal.append("complete", tmp=None, size=size, **counts)
        finish_completion(job_dir, output, journal.state)
        return
    if schema is not None:
        check_parts(job_dir, state, schema)
    work_dir = job_dir / WORK_DIR
    remove_file(tmp, f"then run `{resume_command(output)}`")
    try:
        shutil.rmtree(work_dir, ignore_errors=True)
        work_dir.mkdir()
        if schema is None:
            _write_jsonl(output, tmp, state, work_dir, ordered=ordered)
        else:
            _write_parquet_parts(job_dir, tmp, schema, state, work_dir, ordered=ordered)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        # NOTE: the temp file's directory entry must be durable before the record that names it:
        # after that record, the parts it replaces may be deleted.
        fsync_dir(tmp.parent)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        shutil.rmtree(work_dir, ignore_errors=True)
        if not is_storage_failure(e):
            raise
        then = "then resume the job"
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            # NOTE: a sorted JSONL output needs its sort runs and the temp file at once.
            needed = 2 * state.offset if schema is None and ordered else state.offset
            if schema is not None:
                needed = _parts_size(job_dir, state)
            then += (
                f" (finishing it needs about {needed / 2**20:.1f} MiB free for a new copy of "
                "the output)"
            )
        raise storage_error(e, e.filename or tmp, then) from e
    try:
        journal.append("complete", tmp=tmp.name, size=tmp.stat().st_size, **counts)
    except StorageError:
        if not journal.is_broken:
            # NOTE: the record was cut off, so nothing names the temp file: give its space back.
            tmp.unlink(missing_ok=True)
            shutil.rmtree(work_dir, ignore_errors=True)
        raise
    finish_completion(job_dir, output, journal.state)


def _parts_size(job_dir: Path, state: JobState) -> int:
    try:
        return sum((job_dir / name).stat().st_size for _, name in state.parts)
    except OSError:
        return 0


def finish_completion(job_dir: Path, output: Path, state: JobState) -> None:
    """Idempotent: move the finished temp file into place and drop what is no longer needed."""
    assert state.complete is not None
    tmp_name = state.complete.get("tmp")
    if tmp_name is not None and (output.parent / tmp_name).exists():
        os.replace(output.parent / tmp_name, output)
        fsync_dir(output.parent)
    shutil.rmtree(job_dir / PARTS_DIR, ignore_errors=True)
    shutil.rmtree(job_dir / WORK_DIR, ignore_errors=True)


def _stale(state: JobState, indices: np.ndarray, seq: int | None, offset: int | None) -> np.ndarray:
    """Which rows were superseded by a later `--retry-errors` rerun of the same index."""
    mask = np.zeros(len(indices), dtype=np.bool_)
    for retry in state.retries:
        if (seq is not None and seq < retry.seq) or (offset is not None and offset < retry.offset):
            mask |= retry.indices.contains_array(indices)
    return mask


def _write_jsonl(
    output: Path, tmp: Path, state: JobState, work_dir: Path, *, ordered: bool
) -> None:
    with open(output, "rb") as src, open(tmp, "wb") as dst:
        lines = _committed_lines(src, state)
        if ordered:
            write_sorted_lines(lines, work_dir, dst)
        else:
            dst.writelines(line for _, line in lines)


def _committed_lines(src: IO[bytes], state: JobState) -> Iterator[tuple[int, bytes]]:
    """(input index, line) of each committed line not superseded by a --retry-errors rerun."""
    offset = 0
    for line in src:
        if offset >= state.offset:
            break
        index = line_index(line)
        is_stale = bool(state.retries) and _stale(state, np.array([index]), None, offset)[0]
        offset += len(line)
        if not is_stale:
            yield index, line


def write_sorted_lines(lines: Iterable[tuple[int, bytes]], work_dir: Path, dst: IO[bytes]) -> None:
    """Write `lines` to `dst` sorted by index: sorted runs of RUN_BYTES in `work_dir`, merged at
    most MAX_FAN_IN at a time."""
    runs: list[Path] = []
    batch: list[tuple[int, bytes]] = []
    num_bytes = 0
    for index, line in lines:
        batch.append((index, line))
        num_bytes += len(line)
        if num_bytes >= RUN_BYTES:
            runs.append(_write_run(work_dir, len(runs), batch))
            batch, num_bytes = [], 0
    runs.append(_write_run(work_dir, len(runs), batch))
    level = 0
    while len(runs) > MAX_FAN_IN:
        groups = [runs[i : i + MAX_FAN_IN] for i in range(0, len(runs), MAX_FAN_IN)]
        runs = [
            _merge_runs(group, work_dir / f"level{level}-{n:06d}.run")
            for n, group in enumerate(groups)
        ]
        level += 1
    for _, line in heapq.merge(*(_read_run(r) for r in runs)):
        dst.write(line)


def _write_run(work_dir: Path, number: int, batch: list[tuple[int, bytes]]) -> Path:
    path = work_dir / f"run-{number:06d}.run"
    batch.sort(key=lambda item: item[0])
    with open(path, "wb") as f:
        for index, line in batch:
            f.write(b"%d\t%s" % (index, line))
    return path


def _read_run(path: Path) -> Iterator[tuple[int, bytes]]:
    with open(path, "rb") as f:
        for record in f:
            index, _, line = record.partition(b"\t")
            yield int(index), line


def _merge_runs(runs: list[Path], path: Path) -> Path:
    with open(path, "wb") as f:
        for index, line in heapq.merge(*(_read_run(r) for r in runs)):
            f.write(b"%d\t%s" % (index, line))
    for run in runs:
        run.unlink()
    return path


def _write_parquet_parts(
    job_dir: Path, tmp: Path, schema: pa.Schema, state: JobState, work_dir: Path, *, ordered: bool
) -> None:
    """_write_parquet; a committed part whose data (past the footer check_parts reads) is
    damaged is named as check_parts names one."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        _write_parquet(job_dir, tmp, schema, state, work_dir, ordered=ordered)
    except (OSError, pa.ArrowException) as e:
        if is_storage_failure(e):
            raise
        for _, name in state.parts:
            try:
                pq.read_table(job_dir / name)
            except (OSError, pa.ArrowException) as part_error:
                tmp.unlink(missing_ok=True)
                shutil.rmtree(work_dir, ignore_errors=True)
                problem = f"cannot be read ({one_line(part_error)})"
                raise damaged_part(job_dir / name, problem) from e
        raise


def _write_parquet(
    job_dir: Path, tmp: Path, schema: pa.Schema, state: JobState, work_dir: Path, *, ordered: bool
) -> None:
    import pyarrow.parquet as pq

    sources: list[tuple[Path, int | None]] = [(job_dir / name, seq) for seq, name in state.parts]
    with pq.ParquetWriter(tmp, schema) as writer:
        sink = RowGroupSink(writer)
        if not ordered:
            for path, seq in sources:
                for batch in _batches(path, state, seq):
                    sink.add(batch)
        else:
            write_sorted_parquet(sink, schema, sources, state, work_dir)
        sink.flush()


def write_sorted_parquet(
    sink: RowGroupSink,
    schema: pa.Schema,
    sources: list[tuple[Path, int | None]],
    state: JobState,
    work_dir: Path,
) -> None:
    """K-way merge of index-sorted Parquet files (a journal seq each, or None) into `sink`, at
    most MAX_FAN_IN at a time, through intermediate files in `work_dir`."""
    import pyarrow.parquet as pq

    level = 0
    while len(sources) > MAX_FAN_IN:
        groups = [sources[i : i + MAX_FAN_IN] for i in range(0, len(sources), MAX_FAN_IN)]
        sources = []
        for n, group in enumerate(groups):
            path = work_dir / f"level{level}-{n:06d}.parquet"
            with pq.ParquetWriter(path, schema) as run_writer:
                run_sink = RowGroupSink(run_writer)
                for batch in _merge_sorted(group, state):
                    run_sink.add(batch)
                run_sink.flush()
            sources.append((path, None))
        level += 1
    for batch in _merge_sorted(sources, state):
        sink.add(batch)


class RowGroupSink:
    """Collects small batches into row groups of about ROW_GROUP_ROWS rows."""

    def __init__(self, writer: Any) -> None:
        self.writer = writer
        self.tables: list[pa.Table] = []
        self.num_rows = 0

    def add(self, data: pa.Table | pa.RecordBatch) -> None:
        import pyarrow as pa

        table = pa.Table.from_batches([data]) if isinstance(data, pa.RecordBatch) else data
        self.tables.append(table)
        self.num_rows += table.num_rows
        if self.num_rows >= ROW_GROUP_ROWS:
            self.flush()

    def flush(self) -> None:
        import pyarrow as pa

        if self.tables:
            self.writer.write_table(pa.concat_tables(self.tables))
        self.tables, self.num_rows = [], 0


def _batches(path: Path, state: JobState, seq: int | None) -> Iterator[pa.RecordBatch]:
    for batch in parquet_batches(path, BATCH_ROWS):
        if seq is not None and state.retries:
            indices = batch.column("index").to_numpy()
            batch = batch.filter(~_stale(state, indices, seq, None))
        yield batch


def _merge_sorted(sources: list[tuple[Path, int | None]], state: JobState) -> Iterator[pa.Table]:
    """K-way merge of index-sorted Parquet files, a block at a time: every buffered row with an
    index at most the smallest buffered tail can be emitted, since each source is sorted."""
    import pyarrow as pa
    import pyarrow.compute as pc

    streams = [_batches(path, state, seq) for path, seq in sources]
    buffers: list[pa.Table | None] = [None] * len(streams)

    def refill(k: int) -> None:
        for batch in streams[k]:
            if batch.num_rows:
                buffers[k] = pa.Table.from_batches([batch])
                return
        buffers[k] = None

    for k in range(len(streams)):
        refill(k)
    while any(b is not None for b in buffers):
        live = [k for k, b in enumerate(buffers) if b is not None]
        bound = min(buffers[k].column("index")[-1].as_py() for k in live)
        taken = []
        for k in live:
            table = buffers[k]
            mask = pc.less_equal(table.column("index"), bound)
            taken.append(table.filter(mask))
            rest = table.filter(pc.invert(mask))
            buffers[k] = rest if rest.num_rows else None
            if buffers[k] is None:
                refill(k)
        merged = pa.concat_tables(taken)
        yield merged.take(pc.sort_indices(merged, [("index", "ascending")]))
