"""Output writers: append rows in completion order and make them durable through the journal."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vbatch.errors import OutputLostError, StorageError, storage_error
from vbatch.job.encoding import KeptJson, table_from_rows
from vbatch.job.journal import JobState, Journal, to_ranges, write_all
from vbatch.job.paths import fsync_dir, lost_file
from vbatch.job.results import jsonl_bytes, parquet_values

if TYPE_CHECKING:
    import pyarrow as pa

    from vbatch.job.manifest import Manifest

PARTS_DIR = "parts"
JSONL_BUFFER_BYTES = 1 << 16
RESUME_HINT = "then resume the job"


class OutputWriter:
    """Buffers finished rows and commits them. Invariant: a row is durable iff its index is in a
    journal commit record, which is appended only after the row's bytes are fsynced.

    A failed write (StorageError: disk full, read-only, ...) drops every uncommitted row, undoes
    what it can, and leaves the writer refusing further rows: what is committed stays committed,
    and the rest runs again on resume.
    """

    def __init__(self, journal: Journal) -> None:
        self.journal = journal
        self.pending_indices: list[int] = []
        self.pending_errors: list[int] = []
        self.failure: StorageError | None = None

    @property
    def num_pending(self) -> int:
        return len(self.pending_indices)

    def add(self, values: dict[str, Any], kept: dict[str, Any] | None, line: dict | None) -> None:
        """Queue one row; `line` replaces `values` as the JSONL line (OpenAI Batch shape)."""
        self._check()
        try:
            self._write(values, kept, line)
        except StorageError as e:
            self._fail(e)
        self.pending_indices.append(values["index"])
        if values["error"] is not None:
            self.pending_errors.append(values["index"])

    def commit(self) -> int:
        """Make every queued row durable; returns how many rows this commit covered."""
        self._check()
        num_rows = len(self.pending_indices)
        if num_rows == 0:
            return 0
        try:
            location = self._sync()
            self.journal.append(
                "commit",
                rows=num_rows,
                indices=to_ranges(self.pending_indices),
                errors=to_ranges(self.pending_errors),
                **location,
            )
        except StorageError as e:
            self._fail(e)
        self.pending_indices.clear()
        self.pending_errors.clear()
        return num_rows

    def _check(self) -> None:
        if self.failure is not None:
            raise self.failure

    def _fail(self, error: StorageError) -> None:
        self.failure = error
        self.pending_indices.clear()
        self.pending_errors.clear()
        self._discard()
        raise error

    def _discard(self) -> None:
        """Drop what was written since the last commit, as far as possible (it frees space)."""

    def _write(
        self, values: dict[str, Any], kept: dict[str, Any] | None, line: dict | None
    ) -> None:
        raise NotImplementedError

    def _sync(self) -> dict[str, Any]:
        raise NotImplementedError

    def close(self) -> None:
        """Drop anything uncommitted (it is rerun on resume) and release files."""


class JsonlWriter(OutputWriter):
    """Appends lines to the output file in place; a commit records the fsynced byte offset.

    `kept_json` formats kept Parquet columns that need their Arrow type to become JSON.
    """

    def __init__(self, journal: Journal, path: Path, kept_json: KeptJson | None = None) -> None:
        super().__init__(journal)
        self.path = path
        self.kept_json = kept_json or None
        committed = journal.state.offset
        size = check_jsonl_output(path, committed)
        # NOTE: unbuffered, with our own buffer: after a failed write nothing stays queued.
        self._buffer = bytearray()
        try:
            self._file = open(path, "ab", buffering=0)  # noqa: SIM115
            if size > committed:
                # NOTE: rows written after the last commit are not durable; they will be rerun.
                self._file.truncate(committed)
                os.fsync(self._file.fileno())
            if size == 0:
                fsync_dir(path.parent)
        except OSError as e:
            raise storage_error(e, path, RESUME_HINT) from e
        self._offset = committed

    def _write(
        self, values: dict[str, Any], kept: dict[str, Any] | None, line: dict | None
    ) -> None:
        if kept and self.kept_json is not None:
            kept = self.kept_json(kept)
        self._buffer += jsonl_bytes(line or values, kept)
        if len(self._buffer) >= JSONL_BUFFER_BYTES:
            self.flush()

    def flush(self) -> None:
        try:
            write_all(self._file.fileno(), self._buffer)
        except OSError as e:
            raise storage_error(e, self.path, RESUME_HINT) from e
        self._offset += len(self._buffer)
        self._buffer.clear()

    def _sync(self) -> dict[str, Any]:
        self.flush()
        try:
            os.fsync(self._file.fileno())
        except OSError as e:
            raise storage_error(e, self.path, RESUME_HINT) from e
        self._check_still_there()
        return {"offset": self._offset}

    def _check_still_there(self) -> None:
        """OutputLostError once the output path no longer names the file this writer appends
        to (deleted, or replaced), or that file is shorter than what was written to it (cut),
        rather than committing rows that nothing holds."""
        how = lost_file(self.path, self._file.fileno())
        if how is not None:
            raise OutputLostError(
                f"{self.path} was {how} outside vbatch while the job ran; {OUTPUT_LOST_FIX}"
            )
        size = os.fstat(self._file.fileno()).st_size
        if size < self._offset:
            raise OutputLostError(
                f"{self.path} was truncated outside vbatch while the job ran (to {size} "
                f"bytes of the {self._offset} written); {OUTPUT_LOST_FIX}"
            )

    def _discard(self) -> None:
        self._buffer.clear()
        self._offset = self.journal.state.offset
        if not self.journal.is_broken:
            with contextlib.suppress(OSError):
                self._file.truncate(self._offset)

    def close(self) -> None:
        self._file.close()


OUTPUT_LOST_FIX = (
    "the rows it held cannot be resumed: start the job again (`vbatch run` with --overwrite)"
)


def check_jsonl_output(path: Path, committed: int) -> int:
    """The size of a JSONL job's output, which holds its first `committed` bytes of rows;
    OutputLostError if it is gone or shorter (deleted, cut or replaced outside vbatch)."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        if committed == 0:
            return 0
        raise OutputLostError(
            f"{path} is gone, but {committed} bytes of rows were committed to it: it was deleted "
            f"or moved outside vbatch; {OUTPUT_LOST_FIX}"
        ) from None
    if size < committed:
        raise OutputLostError(
            f"{path} is {size} bytes but {committed} bytes were committed: the output was "
            f"truncated or replaced outside vbatch; {OUTPUT_LOST_FIX}"
        )
    return size


def check_parts(job_dir: Path, state: JobState, schema: pa.Schema) -> None:
    """Refuse a job whose committed Parquet parts are not all there with a readable footer, the
    rows their commits recorded and the job's columns (one deleted, cut, overwritten or
    rewritten outside vbatch): its rows would be lost at finalize."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    for _, name in state.parts:
        path = job_dir / name
        try:
            meta = pq.read_metadata(path)
        except FileNotFoundError:
            problem = "is missing"
        except (OSError, pa.ArrowException) as e:
            problem = f"cannot be read ({one_line(e)})"
        else:
            expected = state.part_rows.get(name, meta.num_rows)
            if meta.num_rows != expected:
                problem = f"holds {meta.num_rows} rows where its commit recorded {expected}"
            elif not meta.schema.to_arrow_schema().equals(schema):
                problem = "holds other columns than this job writes"
            else:
                continue
        raise damaged_part(path, problem)


def damaged_part(path: Path, problem: str) -> OutputLostError:
    return OutputLostError(
        f"{path}, a committed part of this job's output, {problem}: it was deleted or "
        "changed outside vbatch, and its rows are lost; the job cannot be resumed safely. "
        "Start again with `vbatch run ... --overwrite`"
    )


def one_line(error: BaseException) -> str:
    """An error's text on one line, without its closing period (pyarrow's span lines)."""
    return " ".join(str(error).split()).rstrip(".")


class ParquetWriter(OutputWriter):
    """Buffers rows in memory; each commit writes one part file (sorted by index if `ordered`)."""

    def __init__(
        self,
        journal: Journal,
        job_dir: Path,
        schema: pa.Schema,
        *,
        id_kind: str,
        json_kept: bool,
        ordered: bool,
    ) -> None:
        super().__init__(journal)
        self.parts_dir = job_dir / PARTS_DIR
        self._part: Path | None = None
        self.schema = schema
        self.id_kind = id_kind
        self.json_kept = json_kept
        self.ordered = ordered
        self._rows: list[dict[str, Any]] = []
        try:
            self.parts_dir.mkdir(exist_ok=True)
            # NOTE: the parts directory's own entry must be durable before a record names a part.
            fsync_dir(job_dir)
            remove_orphan_parts(self.parts_dir, {name for _, name in journal.state.parts})
        except OSError as e:
            raise storage_error(e, self.parts_dir, RESUME_HINT) from e
        check_parts(job_dir, journal.state, schema)

    def _write(
        self, values: dict[str, Any], kept: dict[str, Any] | None, line: dict | None
    ) -> None:
        self._rows.append(parquet_values(values, kept, self.id_kind, self.json_kept))

    def _sync(self) -> dict[str, Any]:
        import pyarrow.parquet as pq

        if self.ordered:
            self._rows.sort(key=lambda r: r["index"])
        table = table_from_rows(self._rows, self.schema)
        name = f"{PARTS_DIR}/part-{self.journal.state.next_seq:06d}.parquet"
        path = self.parts_dir.parent / name
        self._part = path
        try:
            with open(path, "wb") as f:
                pq.write_table(table, f)
                f.flush()
                os.fsync(f.fileno())
            fsync_dir(self.parts_dir)
        except OSError as e:
            raise storage_error(e, path, RESUME_HINT) from e
        self._rows.clear()
        return {"part": name}

    def _discard(self) -> None:
        self._rows.clear()
        part = self._part
        committed = {name for _, name in self.journal.state.parts}
        is_orphan = part is not None and f"{PARTS_DIR}/{part.name}" not in committed
        if part is not None and is_orphan and not self.journal.is_broken:
            with contextlib.suppress(OSError):
                part.unlink(missing_ok=True)


def open_writer(
    job_dir: Path, journal: Journal, manifest: Manifest, schema: pa.Schema | None
) -> OutputWriter:
    """The writer for the job's output format (`schema` is None for JSONL)."""
    if schema is None:
        return JsonlWriter(journal, Path(manifest.output_path), _kept_json(manifest))
    return ParquetWriter(
        journal,
        job_dir,
        schema,
        id_kind=manifest.id_kind,
        json_kept=manifest.input_format == "jsonl",
        ordered=manifest.options.ordered,
    )


def _kept_json(manifest: Manifest) -> KeptJson | None:
    """The JSON formatter for the kept columns of a Parquet input (None when none needs one)."""
    keep_columns = manifest.options.columns.keep_columns
    if manifest.input_format != "parquet" or not keep_columns:
        return None
    import pyarrow.parquet as pq

    return KeptJson(pq.read_schema(manifest.input_path), keep_columns) or None


def remove_orphan_parts(parts_dir: Path, committed: set[str]) -> None:
    """Delete part files no commit names (written by a run killed before its journal record)."""
    for path in parts_dir.iterdir():
        # NOTE: a directory is not a part vbatch wrote: it stays, and parts never go there.
        if f"{PARTS_DIR}/{path.name}" not in committed and not path.is_dir():
            path.unlink()
