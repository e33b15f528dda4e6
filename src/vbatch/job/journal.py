"""The commit journal: append-only, checksummed records that say which output rows are durable."""

from __future__ import annotations

import os
import time
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from vbatch.errors import JobStateError, OutputLostError, StorageError, storage_error
from vbatch.job.paths import fsync_dir, lost_file

JOURNAL_NAME = "journal.jsonl"


class IndexSet:
    """A set of input row indices stored as a byte-per-row mask: bounded by the input's row count.

    Invariant: `len(self)` equals the number of set entries; entries past the mask are unset.
    """

    def __init__(self, capacity: int = 0) -> None:
        self._mask = np.zeros(max(capacity, 1024), dtype=np.bool_)
        self._count = 0

    def _grow(self, end: int) -> None:
        if end > len(self._mask):
            mask = np.zeros(max(end, 2 * len(self._mask)), dtype=np.bool_)
            mask[: len(self._mask)] = self._mask
            self._mask = mask

    def add_range(self, start: int, stop: int) -> None:
        self._grow(stop)
        view = self._mask[start:stop]
        self._count += int(stop - start - np.count_nonzero(view))
        view[:] = True

    def discard_range(self, start: int, stop: int) -> None:
        view = self._mask[start : min(stop, len(self._mask))]
        self._count -= int(np.count_nonzero(view))
        view[:] = False

    def add_ranges(self, ranges: Iterable[list[int]]) -> None:
        for start, stop in ranges:
            self.add_range(start, stop)

    def discard_ranges(self, ranges: Iterable[list[int]]) -> None:
        for start, stop in ranges:
            self.discard_range(start, stop)

    def __contains__(self, index: int) -> bool:
        return index < len(self._mask) and bool(self._mask[index])

    def __len__(self) -> int:
        return self._count

    def ranges(self) -> list[list[int]]:
        """The set as sorted half-open `[start, stop)` ranges."""
        padded = np.concatenate(([False], self._mask, [False])).astype(np.int8)
        edges = np.flatnonzero(np.diff(padded))
        return edges.reshape(-1, 2).tolist()

    def contains_array(self, indices: np.ndarray) -> np.ndarray:
        inside = indices < len(self._mask)
        result = np.zeros(len(indices), dtype=np.bool_)
        result[inside] = self._mask[indices[inside]]
        return result


def to_ranges(indices: Iterable[int]) -> list[list[int]]:
    """Compress indices (any order, no duplicates) into sorted half-open ranges."""
    ordered = np.sort(np.fromiter(indices, dtype=np.int64))
    if len(ordered) == 0:
        return []
    breaks = np.flatnonzero(np.diff(ordered) != 1) + 1
    starts = np.concatenate(([0], breaks))
    stops = np.concatenate((breaks, [len(ordered)]))
    return [[int(ordered[a]), int(ordered[b - 1]) + 1] for a, b in zip(starts, stops, strict=False)]


@dataclass
class Retry:
    """Rows whose earlier (error) output is superseded: everything committed before `seq`."""

    seq: int
    offset: int
    indices: IndexSet


@dataclass
class JobState:
    """What the journal says is durable. Replaying the same journal always gives the same state."""

    committed: IndexSet = field(default_factory=IndexSet)
    errors: IndexSet = field(default_factory=IndexSet)
    parts: list[tuple[int, str]] = field(default_factory=list)
    # NOTE: each part's row count as its commit record gives it.
    part_rows: dict[str, int] = field(default_factory=dict)
    retries: list[Retry] = field(default_factory=list)
    offset: int = 0
    num_records: int = 0
    last_commit_time: float | None = None
    complete: dict[str, Any] | None = None

    @property
    def next_seq(self) -> int:
        return self.num_records

    def apply(self, record: dict[str, Any]) -> None:
        kind = record.get("kind")
        if record.get("seq") != self.num_records:
            raise JobStateError(
                f"its records are out of sequence (seq {record.get('seq')!r} where "
                f"{self.num_records} was due: a record was removed or repeated)"
            )
        if kind == "commit":
            self.committed.add_ranges(record["indices"])
            self.errors.add_ranges(record["errors"])
            if "part" in record:
                self.parts.append((record["seq"], record["part"]))
                self.part_rows[record["part"]] = record["rows"]
            self.offset = record.get("offset", self.offset)
            self.last_commit_time = record["time"]
        elif kind == "retry":
            retried = IndexSet()
            retried.add_ranges(record["indices"])
            self.committed.discard_ranges(record["indices"])
            self.errors.discard_ranges(record["indices"])
            self.retries.append(Retry(record["seq"], record["offset"], retried))
        elif kind == "complete":
            self.complete = record
        else:
            raise JobStateError(f"unknown journal record kind {kind!r}")
        self.num_records += 1


def _encode(record: dict[str, Any]) -> bytes:
    body = orjson.dumps(record)
    return b"%08x %s\n" % (zlib.crc32(body), body)


def _decode(line: bytes) -> dict[str, Any] | None:
    """The record on one complete journal line, or None when it is torn or corrupt."""
    if not line.endswith(b"\n") or len(line) < 10 or line[8:9] != b" ":
        return None
    body = line[9:-1]
    try:
        if int(line[:8], 16) != zlib.crc32(body):
            return None
        record = orjson.loads(body)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def read_journal(path: Path) -> tuple[JobState, int]:
    """Replay the journal; returns the state and the byte length of its valid prefix.

    A bad record is accepted only as the very last line (a torn append); anything else is
    corruption and raises JobStateError.
    """
    state = JobState()
    valid_length = 0
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return state, 0
    lines = data.splitlines(keepends=True)
    for number, line in enumerate(lines, start=1):
        record = _decode(line)
        if record is None:
            if number != len(lines):
                raise JobStateError(
                    f"journal {path} is corrupt at record {number} (not at its end, so this is "
                    "not an interrupted write); the job cannot be resumed safely"
                )
            break
        try:
            state.apply(record)
        except (JobStateError, KeyError, TypeError) as e:
            raise JobStateError(
                f"journal {path} is corrupt at record {number}: "
                f"{e if isinstance(e, JobStateError) else f'a malformed record ({e!r})'}; the "
                "job cannot be resumed safely"
            ) from None
        valid_length += len(line)
    return state, valid_length


class Journal:
    """Appends records durably. Invariant: the file holds only complete, checksummed records,
    each fsynced before `append` returns (a torn tail left by a crash is cut on open, and one
    left by a failed write is cut at once). `is_broken`: such a cut failed too, so whether the
    last record is in the file is unknown until the journal is read again."""

    def __init__(self, job_dir: Path) -> None:
        self.path = job_dir / JOURNAL_NAME
        self.state, valid_length = read_journal(self.path)
        self._size = valid_length
        self.is_broken = False
        try:
            # NOTE: unbuffered, so a failed append leaves nothing queued to be written later.
            self._file = open(self.path, "ab", buffering=0)  # noqa: SIM115
            self._fd = self._file.fileno()
            if os.fstat(self._fd).st_size != valid_length:
                os.ftruncate(self._fd, valid_length)
                os.fsync(self._fd)
            # NOTE: the journal's entry in the job directory, and the job directory's in its
            # parent, must be durable before any record that depends on them.
            fsync_dir(job_dir)
            fsync_dir(job_dir.parent)
        except OSError as e:
            raise storage_error(e, self.path, "then resume the job") from e

    def check_still_there(self) -> None:
        """OutputLostError once the job directory no longer holds this journal (deleted, or
        replaced, outside vbatch): no resume could read what it records."""
        how = lost_file(self.path, self._fd)
        if how is not None:
            raise OutputLostError(
                f"{self.path.parent} was {how} outside vbatch while the job ran, with the "
                "journal of its committed rows; the job cannot be resumed: start it again "
                "(`vbatch run` with --overwrite)"
            )

    def append(self, kind: str, **fields: Any) -> dict[str, Any]:
        """Append one record, or raise StorageError and leave the file as it was
        (OutputLostError where the job directory no longer holds the journal)."""
        self.check_still_there()
        if self.is_broken:
            raise StorageError(
                f"an earlier write to {self.path} failed and could not be undone; resume the job"
            )
        record = {"kind": kind, "seq": self.state.next_seq, "time": time.time(), **fields}
        data = _encode(record)
        try:
            write_all(self._fd, data)
            os.fsync(self._fd)
        except OSError as e:
            self._roll_back()
            raise storage_error(e, self.path, "then resume the job") from e
        self._size += len(data)
        self.state.apply(record)
        return record

    def _roll_back(self) -> None:
        """Cut a record whose write or fsync failed, so that the next append cannot follow a
        torn line (which replay would call corruption); if even that fails, refuse to append."""
        try:
            os.ftruncate(self._fd, self._size)
            os.fsync(self._fd)
        except OSError:
            self.is_broken = True

    def close(self) -> None:
        self._file.close()


def write_all(fd: int, data: bytes) -> None:
    """os.write until every byte is written (a short write is retried, an error raised)."""
    # NOTE: the views are released even on error, so a bytearray passed in can still be resized.
    with memoryview(data) as whole:
        written = 0
        while written < len(whole):
            with whole[written:] as rest:
                written += os.write(fd, rest)
