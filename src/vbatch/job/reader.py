"""Streaming input readers (JSONL, gzip/zstd JSONL, Parquet) and the pre-pass over row ids."""

from __future__ import annotations

import collections
import copy
import gzip
import io
import itertools
import json
import math
import re
import shlex
import zlib
from array import array
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import numpy as np
import orjson

from vbatch.errors import InputError
from vbatch.job.encoding import batch_records, fits_int64, parquet_batches
from vbatch.job.journal import IndexSet
from vbatch.job.rows import ColumnOptions, InputRow, RowParser, is_openai_record
from vbatch.job.shard import Shard

if TYPE_CHECKING:
    import pyarrow as pa

INPUT_FORMATS = ("jsonl", "parquet")
_JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
_PARQUET_SUFFIXES = (".parquet", ".pq")
_TABLE_SUFFIXES = (".csv", ".tsv")
_PARQUET_BATCH_ROWS = 1024
# NOTE: the Parquet columns a row's parsing reads (besides those the job's options name).
_ROW_COLUMNS = (
    "prompt",
    "messages",
    "id",
    "custom_id",
    "sampling_params",
    "response_format",
    "guided",
    "chat_template_kwargs",
    "lora",
    "url",
    "method",
    "body",
)
# NOTE: the columns a row reads as objects. Arrow gives each value of a struct column every
# field any row's value has, null where the row had none (at every depth: a schema's
# `maxLength` from another row's schema), so a null field is read as an absent one.
_OBJECT_COLUMNS = ("sampling_params", "response_format", "guided", "chat_template_kwargs", "body")
_COLUMN_CHECK_ROWS = 100
_READ_BYTES = 1 << 16
MAX_KEYS = 1000
_PEEK_BYTES = 1 << 20
# NOTE: Windows tools begin a UTF-8 text file with it (Windows PowerShell's `Out-File -Encoding
# utf8`, Notepad's "UTF-8 with BOM").
_UTF8_BOM = b"\xef\xbb\xbf"
_UTF32_LE_BOM, _UTF32_BE_BOM = b"\xff\xfe\x00\x00", b"\x00\x00\xfe\xff"
_UTF16_LE_BOM, _UTF16_BE_BOM = b"\xff\xfe", b"\xfe\xff"
# NOTE: orjson reads an integer beyond 64 bits as a float, silently; a line with a run of this
# many digits is parsed again exactly, and such an integer makes the row an error row.
_LONG_DIGITS = re.compile(rb"\d{19}")
_INT_RANGE = (-(1 << 63), 1 << 64)


class _WideInteger(ValueError):
    pass


def _exact_int(text: str) -> int:
    value = int(text)
    if not _INT_RANGE[0] <= value < _INT_RANGE[1]:
        raise _WideInteger(text)
    return value


def _no_constant(text: str) -> Any:
    raise ValueError(f"{text} is not JSON")


def _loads_overflowing(line: bytes, error: orjson.JSONDecodeError) -> tuple[Any, str]:
    """A line whose number overflows a double (valid JSON that orjson refuses): its values as
    Python's json reads them (the number as inf), and the row an error that keeps its id."""
    overflowing: list[str] = []

    def read_float(text: str) -> float:
        value = float(text)
        if math.isinf(value):
            overflowing.append(text)
        return value

    try:
        value = json.loads(line, parse_float=read_float, parse_constant=_no_constant)
    except ValueError:
        raise error from None
    if not overflowing:
        raise error
    shown = overflowing[0] if len(overflowing[0]) <= 40 else f"{overflowing[0][:37]}..."
    return value, f"the number {shown} does not fit a 64-bit float; write it as a string"


def _why_invalid(line: bytes, error: orjson.JSONDecodeError) -> str:
    """Why a line is no JSON; bytes that are not UTF-8 named as such (orjson calls them
    "surrogates")."""
    try:
        line.decode("utf-8")
    except UnicodeDecodeError as e:
        return (
            f"invalid JSON (byte 0x{line[e.start]:02x} at byte {e.start + 1} is not UTF-8; "
            "JSON Lines are UTF-8: convert the file, e.g. with iconv)"
        )
    return f"invalid JSON ({error})"


def loads_line(line: bytes) -> tuple[Any, str | None]:
    """One JSONL line's value, and why the row cannot run (None: it can); raises
    orjson.JSONDecodeError for invalid JSON. An integer that does not fit 64 bits, which orjson
    would turn into a float, or a number beyond a double's range, which orjson refuses, makes
    the row an error that keeps the line's other values."""
    try:
        value = orjson.loads(line)
    except orjson.JSONDecodeError as e:
        if "infinity" not in str(e):
            raise
        return _loads_overflowing(line, e)
    if not _LONG_DIGITS.search(line):
        return value, None
    try:
        return json.loads(line, parse_int=_exact_int), None
    except _WideInteger as e:
        shown = str(e) if len(str(e)) <= 40 else f"{str(e)[:37]}..."
        problem = (
            f"the integer {shown} does not fit 64 bits and would lose digits; write it as a string"
        )
        return json.loads(line), problem


def detect_format(path: Path, input_format: str | None) -> str:
    if input_format is not None:
        if input_format not in INPUT_FORMATS:
            raise InputError(f"--input-format must be one of {', '.join(INPUT_FORMATS)}")
        return input_format
    name = path.name.lower().removesuffix(".gz").removesuffix(".zst")
    if name.endswith(_JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(_PARQUET_SUFFIXES):
        return "parquet"
    if name.endswith(_TABLE_SUFFIXES):
        options = ", parse_options=c.ParseOptions(delimiter='\\t')" if name.endswith(".tsv") else ""
        raise InputError(
            f"{path} is a delimited text table; vbatch reads JSON Lines or Parquet. Convert it "
            f'with pyarrow (installed with vbatch): python -c "import pyarrow.csv as c, '
            f"pyarrow.parquet as p, sys; p.write_table(c.read_csv(sys.argv[1]{options}), "
            f'sys.argv[2])" {shlex.quote(str(path))} {shlex.quote(Path(name).stem + ".parquet")}'
        )
    raise InputError(
        f"cannot tell the format of {path} from its name (.jsonl, .ndjson, .json, .parquet or "
        f".pq, optionally .gz or .zst); pass --input-format {'|'.join(INPUT_FORMATS)}"
    )


class CorruptInput(Exception):
    """Compressed input data that cannot be decoded."""


class _ZstdFrames(io.RawIOBase):
    """The decompressed bytes of every frame of a .zst file. Invariant: the stream ends only
    after a complete frame; a file cut inside a frame raises EOFError, bad data CorruptInput.

    NOTE: zstandard's stream_reader ends a truncated frame as if the file ended there, which
    would silently drop the rows after the cut.
    """

    def __init__(self, path: Path, zstandard: Any) -> None:
        self._file = open(path, "rb")  # noqa: SIM115
        self._zstandard = zstandard
        self._decompressor = zstandard.ZstdDecompressor()
        self._frame: Any = None
        self._pending = b""
        self._position = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while self._position == len(self._pending):
            chunk = self._file.read(_READ_BYTES)
            if not chunk:
                if self._frame is not None:
                    raise EOFError("the file ends inside a zstd frame")
                return 0
            self._pending, self._position = self._decompress(chunk), 0
        count = min(len(buffer), len(self._pending) - self._position)
        buffer[:count] = self._pending[self._position : self._position + count]
        self._position += count
        return count

    def _decompress(self, data: bytes) -> bytes:
        out = []
        while data:
            if self._frame is None:
                self._frame = self._decompressor.decompressobj()
            try:
                out.append(self._frame.decompress(data))
            except self._zstandard.ZstdError as e:
                raise CorruptInput(str(e)) from None
            if not self._frame.eof:
                break
            data, self._frame = self._frame.unused_data, None
        return b"".join(out)

    def close(self) -> None:
        self._file.close()
        super().close()


@dataclass(frozen=True)
class RawRecord:
    """One undecoded input row: `record` is the decoded object (None if it cannot be decoded),
    and `error` says why the row cannot run."""

    index: int
    location: str
    record: Any = None
    error: str | None = None
    # NOTE: kept struct columns as the file holds them, where `record` has them without their
    # null fields (for the row's own settings).
    kept_structs: dict[str, Any] | None = None


class InputReader:
    """Streams one input file. Invariant: row `index` is the position among non-blank rows, the
    same on every pass, so a journal of indices identifies rows across runs. With
    `check_columns`, JSONL columns the options name must appear in the first rows (a user's
    typo); a job's columns resolved from the whole input skip that."""

    def __init__(
        self,
        path: Path,
        input_format: str | None,
        options: ColumnOptions,
        *,
        check_columns: bool = True,
        extra_columns: tuple[str, ...] = (),
    ) -> None:
        """`extra_columns`: more columns a row's parsing reads (a --lora-column)."""
        self.path = path
        self.extra_columns = extra_columns
        if path.is_dir():
            raise InputError(
                f"the input {path} is a directory; give one .jsonl[.gz|.zst] or .parquet file"
            )
        if path.exists() and not path.is_file():
            raise InputError(
                f"the input {path} is not a regular file (a pipe or a device): a job reads its "
                "input more than once (to count and check it, and again on resume); write it "
                "to a file first"
            )
        if not path.is_file():
            raise InputError(f"input file {path} does not exist")
        self.format = detect_format(path, input_format)
        self.options = options
        self.columns: list[str] | None = None
        if self.format == "parquet":
            self._open_parquet()
        else:
            self._refuse_wide_encodings()
            self._refuse_json_array()
            if check_columns:
                self._check_jsonl_columns()

    @property
    def arrow_schema(self) -> Any:
        """The Parquet input's Arrow schema (None for JSONL)."""
        return self._parquet.schema_arrow if self.format == "parquet" else None

    def _named_columns(self) -> list[str]:
        o = self.options
        named = [o.prompt_column, o.messages_column, o.id_column, *o.keep_columns]
        named += self.extra_columns
        return [c for c in named if c is not None]

    def _open_parquet(self) -> None:
        import pyarrow.parquet as pq

        try:
            self._parquet = pq.ParquetFile(self.path)
        except Exception as e:
            raise InputError(f"cannot read Parquet file {self.path}: {e}") from None
        self.columns = list(self._parquet.schema_arrow.names)
        missing = [c for c in self._named_columns() if c not in self.columns]
        if missing:
            raise InputError(
                f"column(s) {', '.join(map(repr, missing))} not in {self.path} "
                f"(it has {', '.join(self.columns)})"
            )
        read = self._read_columns()
        counts = collections.Counter(self.columns)
        repeated = sorted(c for c, n in counts.items() if n > 1 and (read is None or c in read))
        if repeated:
            raise InputError(
                f"{self.path} has more than one column named {', '.join(map(repr, repeated))}, "
                "so a job cannot tell which to read: rename them"
            )

    def _refuse_wide_encodings(self) -> None:
        """UTF-16 or UTF-32 text (Windows PowerShell 5.1's `>` writes UTF-16) gets a hint, not a
        row of garbage per line: detected by its byte order mark, or by a NUL byte in its first
        four, which UTF-8 JSON text never has."""
        try:
            with self._open_text() as f:
                head = f.read(4)
        except (OSError, EOFError, zlib.error, CorruptInput, InputError):
            return  # NOTE: the full read reports an unreadable file.
        if head.startswith((_UTF32_LE_BOM, _UTF32_BE_BOM)):
            encoding = "UTF-32"
        elif head.startswith((_UTF16_LE_BOM, _UTF16_BE_BOM)):
            encoding = "UTF-16"
        elif 0 in head[:2]:
            # NOTE: without a byte order mark iconv needs the byte order, which the NULs give.
            width = "32" if len(head) == 4 and head.count(0) == 3 else "16"
            encoding = f"UTF-{width}{'BE' if head[0] == 0 else 'LE'}"
        else:
            return
        name = self.path.name.lower()
        path = shlex.quote(str(self.path))
        convert = f"iconv -f {encoding} -t UTF-8"
        if name.endswith((".gz", ".zst")):
            convert = f"{'zcat' if name.endswith('.gz') else 'zstdcat'} {path} | {convert}"
        else:
            convert = f"{convert} {path}"
        stem = self.path.name.split(".")[0]
        target = shlex.quote(str(self.path.with_name(f"{stem}.utf8.jsonl")))
        raise InputError(
            f"{self.path} is {encoding} text; vbatch reads UTF-8. Convert it with: "
            f"{convert} > {target}"
        )

    def _refuse_json_array(self) -> None:
        """A JSON array (one document, not one object per line) gets a hint, not error rows.

        Refused: a `.json` file, a first line that is not a whole JSON value (a pretty-printed
        array), or a first line that is an array of objects. A JSONL row that is some other
        array stays an error row."""
        try:
            with self._open_text() as f:
                first = f.readline(_PEEK_BYTES).removeprefix(_UTF8_BOM)
                while first and first.isspace():
                    first = f.readline(_PEEK_BYTES)
        except (OSError, EOFError, zlib.error, CorruptInput, InputError):
            return  # NOTE: the full read reports an unreadable file.
        if not first.lstrip().startswith(b"["):
            return
        name = self.path.name
        for suffix in (".gz", ".zst"):
            name = name[: -len(suffix)] if name.lower().endswith(suffix) else name
        try:
            value = orjson.loads(first)
            is_array = name.lower().endswith(".json") or any(isinstance(v, dict) for v in value)
        except orjson.JSONDecodeError:
            is_array = True
        if is_array:
            # NOTE: never the input's own name, which the shell would empty before jq reads it.
            target = self.path.with_name(Path(name).stem + ".jsonl")
            if target.name == self.path.name:
                target = self.path.with_name(Path(name).stem + ".lines.jsonl")
            raise InputError(
                f"{self.path} looks like a JSON array; vbatch reads JSONL, one JSON object per "
                f"line. Convert it with: jq -c '.[]' {shlex.quote(str(self.path))} > "
                f"{shlex.quote(str(target))}"
            )

    def _check_jsonl_columns(self) -> None:
        named = self._named_columns()
        if not named:
            return
        seen: set[str] = set()
        # NOTE: not limit=, which ends at a last line without its newline (a cut input) unless
        # the rows before it are all the job counted.
        for raw in itertools.islice(self._jsonl_records(None), _COLUMN_CHECK_ROWS):
            if isinstance(raw.record, dict):
                seen.update(raw.record)
        missing = [c for c in named if c not in seen]
        if seen and missing:
            raise InputError(
                f"column(s) {', '.join(map(repr, missing))} not found in the first "
                f"{_COLUMN_CHECK_ROWS} rows of {self.path}"
            )

    def _open_text(self) -> IO[bytes]:
        name = self.path.name.lower()
        if name.endswith(".gz"):
            return gzip.open(self.path, "rb")
        if name.endswith(".zst"):
            try:
                import zstandard
            except ImportError:
                raise InputError(f"reading {self.path} needs `pip install zstandard`") from None
            return io.BufferedReader(_ZstdFrames(self.path, zstandard), _READ_BYTES)
        return open(self.path, "rb")

    def _read_failure(self, error: BaseException) -> InputError:
        """One line for an input that cannot be read: what is wrong and what to do."""
        name = self.path.name.lower()
        codec = "gzip" if name.endswith(".gz") else "zstd" if name.endswith(".zst") else None
        is_corrupt = isinstance(error, (EOFError, zlib.error, CorruptInput, gzip.BadGzipFile))
        if codec is not None and is_corrupt:
            return InputError(
                f"cannot read {self.path}: its {codec} data is corrupt or truncated ({error}). "
                f"Check it with `{codec} -t`, and compress it again from the original"
            )
        return InputError(f"cannot read {self.path}: {error}")

    def records(
        self, skip: IndexSet | None = None, limit: int | None = None
    ) -> Iterator[RawRecord]:
        """Every row in order, the first `limit` when given; rows whose index is in `skip` are
        not decoded or yielded."""
        if self.format == "parquet":
            yield from self._parquet_records(skip, self._read_columns(), limit)
        else:
            yield from self._jsonl_records(skip, limit)

    def _jsonl_records(
        self, skip: IndexSet | None, limit: int | None = None
    ) -> Iterator[RawRecord]:
        index = 0
        try:
            with self._open_text() as f:
                for line_number, line in enumerate(f, start=1):
                    if line_number == 1:
                        line = line.removeprefix(_UTF8_BOM)
                    if not line or line.isspace():
                        continue
                    if limit is not None and index >= limit:
                        return
                    if limit is not None and index < limit - 1 and not line.endswith(b"\n"):
                        # NOTE: a last line without its newline, before the rows the job
                        # counted: the input was cut inside it, which the job reports (it ended
                        # before its rows); it is not a row to commit as an error.
                        return
                    if skip is None or index not in skip:
                        location = f"line {line_number}"
                        try:
                            record, problem = loads_line(line)
                        except orjson.JSONDecodeError as e:
                            why = _why_invalid(line, e)
                            yield RawRecord(index, location, error=f"{location}: {why}")
                        else:
                            error = None if problem is None else f"{location}: {problem}"
                            yield RawRecord(index, location, record, error)
                    index += 1
        except (OSError, EOFError, zlib.error, CorruptInput) as e:
            raise self._read_failure(e) from None

    def _read_columns(self, columns: tuple[str, ...] = _ROW_COLUMNS) -> list[str] | None:
        assert self.columns is not None
        if self.options.keep_all_columns:
            return None
        wanted = {*columns, *self._named_columns()}
        return [c for c in self.columns if c in wanted]

    def _parquet_records(
        self, skip: IndexSet | None, columns: list[str] | None, limit: int | None = None
    ) -> Iterator[RawRecord]:
        import pyarrow as pa

        start = 0
        batches = parquet_batches(self._parquet, _PARQUET_BATCH_ROWS, columns)
        try:
            for batch in batches:
                if limit is not None and start >= limit:
                    break
                if limit is not None and start + batch.num_rows > limit:
                    batch = batch.slice(0, limit - start)
                indices = np.arange(start, start + batch.num_rows)
                start += batch.num_rows
                records = None
                if skip is not None and len(skip):
                    keep = ~skip.contains_array(indices)
                    if not keep.any():
                        continue
                    if not keep.all():
                        try:
                            batch = batch.filter(keep)
                        except pa.ArrowNotImplementedError:
                            # NOTE: view types (string_view, binary_view) have no filter kernel.
                            every = self._batch_records(batch)
                            records = [r for r, kept in zip(every, keep, strict=True) if kept]
                        indices = indices[keep]
                if records is None:
                    records = self._batch_records(batch)
                objects = [name for name in _OBJECT_COLUMNS if name in batch.schema.names]
                for index, record in zip(indices.tolist(), records, strict=False):
                    location = f"row {index + 1}"
                    if isinstance(record, Exception):
                        error = f"{location}: a value cannot be read in Python: {record}"
                        yield RawRecord(index, location, None, error)
                        continue
                    structs = {name: record[name] for name in objects if self._keeps(name)}
                    for name in objects:
                        record[name] = without_null_fields(record[name])
                    yield RawRecord(index, location, record, kept_structs=structs or None)
        except (OSError, pa.ArrowException) as e:
            # NOTE: the id pre-pass reads only the id columns; other pages are first read here.
            raise InputError(
                f"cannot read {self.path} near row {start}: {str(e).rstrip('.')}. The Parquet "
                "file is corrupt or truncated; write it again from its source"
            ) from None

    def _keeps(self, name: str) -> bool:
        return self.options.keep_all_columns or name in self.options.keep_columns

    def _batch_records(self, batch: pa.RecordBatch) -> list[dict[str, Any] | Exception]:
        """The batch's rows as records; where a value has no Python form (a date past year
        9999), row by row, each such row its exception."""
        columns = self.options.keep_columns
        try:
            return batch_records(batch, columns)
        except (OverflowError, ValueError):
            records: list[dict[str, Any] | Exception] = []
            for i in range(batch.num_rows):
                try:
                    records.extend(batch_records(batch.slice(i, 1), columns))
                except (OverflowError, ValueError) as e:
                    records.append(e)
            return records

    def rows(
        self,
        parser: RowParser,
        skip: IndexSet | None = None,
        shard: Shard | None = None,
        limit: int | None = None,
    ) -> Iterator[InputRow]:
        """The rows not in `skip` of the first `limit` (all when None), only those of `shard`
        when one is given."""
        for raw in self.records(skip, limit):
            if shard is not None and not shard.owns(raw.record, raw.index, parser):
                continue
            if raw.error is not None:
                # NOTE: no id, not the index: an index could equal another row's integer id. A
                # decoded row that cannot run keeps its own id.
                row_id = (
                    parser.row_id(raw.record, raw.index) if isinstance(raw.record, dict) else None
                )
                yield InputRow(raw.index, raw.location, row_id, error=raw.error)
            else:
                row = parser.parse(raw.record, raw.index, raw.location)
                if raw.kept_structs is not None and row.kept is not None:
                    kept = row.kept
                    kept.update((k, v) for k, v in raw.kept_structs.items() if k in kept)
                yield row

    def id_records(self) -> Iterator[RawRecord]:
        """Rows decoded only as far as the id needs (for Parquet: only the id columns)."""
        if self.format == "parquet":
            assert self.columns is not None
            wanted = (self.options.id_column or "id", "custom_id", "body")
            return self._parquet_records(None, [c for c in self.columns if c in wanted])
        return self._jsonl_records(None)


@dataclass(frozen=True)
class InputScan:
    """What one pass over the input learned: its size, id type, shape and first duplicate id.
    `num_rows` counts the shard's rows when the scan was given one, `input_rows` all rows."""

    num_rows: int
    input_rows: int
    id_kind: str
    is_openai: bool
    duplicate: str | None
    keys: set[str]
    # NOTE: the id key ("id" or "custom_id") of the first row that has one, when other rows have
    # neither (their ids would be their indices): the job then reads ids from that key only.
    mixed_id_key: str | None = None


def scan_input(
    reader: InputReader,
    parser: RowParser,
    *,
    collect_keys: bool = False,
    shard: Shard | None = None,
) -> InputScan:
    """Count rows (and those of `shard`), decide whether ids are all integers that fit int64 (the
    Parquet output's id column is int64 then, else string), and find the first duplicate id.

    The id kind and the duplicates are the whole input's, so that every shard's output has the
    same id column and every shard refuses an input with a duplicate id.

    With `collect_keys`, also gather the JSONL field names (for --keep-all-columns; at most
    MAX_KEYS of them).

    NOTE: ids are checked with 8 bytes a row (a 64-bit hash of each id in an array, sorted once),
    about 80 MB for 10 million rows; only ids whose hash repeats are compared for real, in a
    second pass, so a hash collision can never be reported as a duplicate.
    """
    hashes = array("q")
    num_rows = 0
    num_shard_rows = 0
    is_all_int = True
    is_openai: bool | None = None
    keys: set[str] = set()
    id_key: str | None = None
    has_keyless = False
    for raw in reader.id_records():
        num_rows += 1
        if shard is None or shard.owns(raw.record, raw.index, parser):
            num_shard_rows += 1
        if not isinstance(raw.record, dict):
            continue
        if is_openai is None:
            is_openai = is_openai_record(raw.record)
        if collect_keys and len(keys) < MAX_KEYS:
            keys.update(raw.record)
        column = parser.id_column(raw.record)
        if column is None:
            # NOTE: its id is its index, unique among such rows; next to rows with ids it is an
            # error row (mixed_id_key), so it takes no part in the duplicate check.
            has_keyless = True
            continue
        id_key = id_key or column
        row_id = parser.row_id(raw.record, raw.index)
        if row_id is None:
            continue
        is_all_int = is_all_int and isinstance(row_id, int) and fits_int64(row_id)
        hashes.append(hash(str(row_id)))
    id_kind = "int" if is_all_int else "str"
    ordered = np.sort(np.frombuffer(hashes, dtype=np.int64))
    repeated = set(ordered[1:][ordered[1:] == ordered[:-1]].tolist())
    del hashes, ordered
    duplicate = _first_duplicate(reader, parser, repeated)
    mixed = id_key if has_keyless else None
    if shard is not None and mixed is not None and parser.options.id_column is None:
        # NOTE: the run reads ids from the mixed key only (a row with only the other one then
        # has none): count the shard's rows as it will take them.
        fixed = copy.copy(parser)
        fixed.options = replace(parser.options, id_column=mixed)
        num_shard_rows = sum(
            shard.owns(raw.record, raw.index, fixed) for raw in reader.id_records()
        )
    return InputScan(num_shard_rows, num_rows, id_kind, bool(is_openai), duplicate, keys, mixed)


def _first_duplicate(reader: InputReader, parser: RowParser, repeated: set[int]) -> str | None:
    if not repeated:
        return None
    first_seen: dict[str, str] = {}
    for raw in reader.id_records():
        if not isinstance(raw.record, dict) or parser.id_column(raw.record) is None:
            continue
        row_id = parser.row_id(raw.record, raw.index)
        if row_id is None or hash(str(row_id)) not in repeated:
            continue
        key = str(row_id)
        if key in first_seen:
            return f"duplicate id {row_id!r} at {raw.location} (first at {first_seen[key]})"
        first_seen[key] = raw.location
    return None


def without_null_fields(value: Any) -> Any:
    """A Parquet struct value as its row wrote it: the null fields of every object in it left
    out, at any depth (a list's null items stay). A schema that needs a null `const` or
    `default` is given as JSON text instead."""
    if isinstance(value, dict):
        return {
            key: without_null_fields(field) for key, field in value.items() if field is not None
        }
    if isinstance(value, list):
        return [without_null_fields(item) for item in value]
    return value
