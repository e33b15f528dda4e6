"""Output writers: append rows in completion order and make them durable through the journal."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vbatch.errors import JobStateError
from vbatch.job.encoding import KeptJson, table_from_rows
from vbatch.job.journal import Journal, fsync_dir, to_ranges
from vbatch.job.results import jsonl_bytes, parquet_values

if TYPE_CHECKING:
    import pyarrow as pa

    from vbatch.job.manifest import Manifest

PARTS_DIR = "parts"


class OutputWriter:
    """Buffers finished rows and commits them. Invariant: a row is durable iff its index is in a
    journal commit record, which is appended only after the row's bytes are fsynced."""

    def __init__(self, journal: Journal) -> None:
        self.journal = journal
        self.pending_indices: list[int] = []
        self.pending_errors: list[int] = []

    @property
    def num_pending(self) -> int:
        return len(self.pending_indices)

    def add(self, values: dict[str, Any], kept: dict[str, Any] | None, line: dict | None) -> None:
        """Queue one row; `line` replaces `values` as the JSONL line (OpenAI Batch shape)."""
        self._write(values, kept, line)
        self.pending_indices.append(values["index"])
        if values["error"] is not None:
            self.pending_errors.append(values["index"])

    def commit(self) -> int:
        """Make every queued row durable; returns how many rows this commit covered."""
        num_rows = len(self.pending_indices)
        if num_rows == 0:
            return 0
        location = self._sync()
        self.journal.append(
            "commit",
            rows=num_rows,
            indices=to_ranges(self.pending_indices),
            errors=to_ranges(self.pending_errors),
            **location,
        )
        self.pending_indices.clear()
        self.pending_errors.clear()
        return num_rows

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
        size = path.stat().st_size if path.exists() else 0
        if size < committed:
            raise JobStateError(
                f"{path} is {size} bytes but {committed} bytes were committed: the output was "
                "truncated or replaced outside vbatch; the job cannot be resumed safely"
            )
        self._file = open(path, "ab")  # noqa: SIM115
        if size > committed:
            # NOTE: rows written after the last commit are not durable; they will be rerun.
            self._file.truncate(committed)
            os.fsync(self._file.fileno())
        if size == 0:
            fsync_dir(path.parent)

    def _write(
        self, values: dict[str, Any], kept: dict[str, Any] | None, line: dict | None
    ) -> None:
        if kept and self.kept_json is not None:
            kept = self.kept_json(kept)
        self._file.write(jsonl_bytes(line or values, kept))

    def _sync(self) -> dict[str, Any]:
        self._file.flush()
        os.fsync(self._file.fileno())
        return {"offset": self._file.tell()}

    def close(self) -> None:
        self._file.close()


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
        self.parts_dir.mkdir(exist_ok=True)
        self.schema = schema
        self.id_kind = id_kind
        self.json_kept = json_kept
        self.ordered = ordered
        self._rows: list[dict[str, Any]] = []
        remove_orphan_parts(self.parts_dir, {name for _, name in journal.state.parts})

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
        with open(path, "wb") as f:
            pq.write_table(table, f)
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(self.parts_dir)
        self._rows.clear()
        return {"part": name}


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
        ordered=manifest.options["ordered"],
    )


def _kept_json(manifest: Manifest) -> KeptJson | None:
    """The JSON formatter for the kept columns of a Parquet input (None when none needs one)."""
    keep_columns = manifest.options["columns"]["keep_columns"]
    if manifest.input_format != "parquet" or not keep_columns:
        return None
    import pyarrow.parquet as pq

    return KeptJson(pq.read_schema(manifest.input_path), keep_columns) or None


def remove_orphan_parts(parts_dir: Path, committed: set[str]) -> None:
    """Delete part files no commit names (written by a run killed before its journal record)."""
    for path in parts_dir.iterdir():
        if f"{PARTS_DIR}/{path.name}" not in committed:
            path.unlink()
