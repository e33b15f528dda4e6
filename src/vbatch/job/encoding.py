"""Output encodings (docs/formats.md, "Encodings"): ids that fit the output's id column, and kept
input columns of any Arrow type as JSON values.

Kept Parquet values reach the writers as Python values from `batch_records`: what
`to_pylist()` gives, except nanosecond timestamps, times and durations (which Python's datetime
cannot hold) as integer nanoseconds and extension values as their storage values, so that
pyarrow takes every value back exactly for Parquet output. For JSONL output `KeptJson` formats
those from the column's Arrow type, and `json_default` what else JSON has no type for.
"""

from __future__ import annotations

import base64
import datetime as dt
import uuid
from collections.abc import Callable, Iterator, Sequence
from decimal import Decimal
from functools import lru_cache
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pyarrow as pa

INT64_MIN = -(1 << 63)
INT64_MAX = (1 << 63) - 1
_EPOCH = dt.datetime(1970, 1, 1)
_NANOS = 10**9


def parquet_batches(
    path: Any, batch_size: int, columns: list[str] | None = None
) -> Iterator[pa.RecordBatch]:
    """The record batches of Parquet file `path` (a path or an open pq.ParquetFile), one row
    group at a time: across row groups, Arrow cannot build some nested columns (a list of
    dictionary strings, as Polars writes List(Categorical)) as one batch."""
    import pyarrow.parquet as pq

    file = path if isinstance(path, pq.ParquetFile) else pq.ParquetFile(path)
    for group in range(file.num_row_groups):
        yield from file.iter_batches(batch_size=batch_size, row_groups=[group], columns=columns)


def fits_int64(value: int) -> bool:
    return INT64_MIN <= value <= INT64_MAX


def batch_records(batch: pa.RecordBatch, columns: Sequence[str]) -> list[dict[str, Any]]:
    """`batch.to_pylist()`, except that in `columns` nanosecond temporal values come out as
    integer nanoseconds (pyarrow cannot give them as `datetime`, and with pandas installed gives
    pandas types) and extension values as their storage values. Either way pyarrow takes them
    back for the same Arrow type, so a kept column keeps its exact values in Parquet output."""
    special = [
        name
        for name in columns
        if name in batch.schema.names and _needs_type(batch.schema.field(name).type)
    ]
    if not special:
        return batch.to_pylist()
    records = batch.select([n for n in batch.schema.names if n not in special]).to_pylist()
    for name in special:
        for record, value in zip(records, _pylist(batch.column(name)), strict=True):
            record[name] = value
    return records


def _is_nanos(t: pa.DataType) -> bool:
    import pyarrow.types as pt

    return (pt.is_timestamp(t) or pt.is_time64(t) or pt.is_duration(t)) and t.unit == "ns"


def _children(t: pa.DataType) -> list[pa.DataType]:
    import pyarrow as pa

    if isinstance(t, pa.BaseExtensionType):
        return [t.storage_type]
    if isinstance(t, pa.DictionaryType):
        return [t.value_type]
    return [t.field(i).type for i in range(t.num_fields)]


@lru_cache(maxsize=1024)
def _needs_type(t: pa.DataType) -> bool:
    """Whether `t` holds, at any depth, a nanosecond temporal or an extension type: values whose
    Python form needs the Arrow type to be written (see `batch_records`)."""
    import pyarrow as pa

    if _is_nanos(t) or isinstance(t, pa.BaseExtensionType):
        return True
    return any(_needs_type(child) for child in _children(t))


def _pylist(array: pa.Array) -> list[Any]:
    """`array.to_pylist()` with nanosecond temporal values as integers and extension values as
    their storage values, at any depth."""
    import pyarrow as pa
    import pyarrow.types as pt

    t = array.type
    if not _needs_type(t):
        return array.to_pylist()
    if isinstance(array, pa.ExtensionArray):
        return _pylist(array.storage)
    if pt.is_dictionary(t):
        return _pylist(array.dictionary_decode())
    if _is_nanos(t):
        return array.cast(pa.int64()).to_pylist()
    valid = array.is_valid().to_pylist()
    if pt.is_struct(t):
        names = [t.field(i).name for i in range(t.num_fields)]
        fields = [_pylist(child) for child in array.flatten()]
        rows = [dict(zip(names, values, strict=True)) for values in zip(*fields, strict=True)]
    elif pt.is_fixed_size_list(t):
        n = t.list_size
        values = _pylist(array.values)
        rows = [
            values[(array.offset + i) * n : (array.offset + i + 1) * n] for i in range(len(array))
        ]
    else:
        # NOTE: list, large_list, map, list_view: offsets (and sizes) index the unsliced values.
        values = _pylist(array.values)
        starts = array.offsets.to_pylist()
        if hasattr(array, "sizes"):
            ends = [
                start + size for start, size in zip(starts, array.sizes.to_pylist(), strict=True)
            ]
        else:
            starts, ends = starts[:-1], starts[1:]
        rows = [values[start:end] for start, end in zip(starts, ends, strict=True)]
        if pt.is_map(t):
            rows = [[tuple(entry.values()) for entry in row] for row in rows]
    return [row if is_valid else None for row, is_valid in zip(rows, valid, strict=True)]


def _map_type(t: pa.DataType, swap: Callable[[pa.DataType], pa.DataType | None]) -> pa.DataType:
    """`t` rebuilt with `swap` (a replacement type, or None to keep) applied at every depth."""
    import pyarrow as pa
    import pyarrow.types as pt

    replaced = swap(t)
    if replaced is not None:
        return _map_type(replaced, swap)
    if isinstance(t, pa.BaseExtensionType) or (t.num_fields == 0 and not pt.is_dictionary(t)):
        return t
    if pt.is_dictionary(t):
        return pa.dictionary(t.index_type, _map_type(t.value_type, swap), t.ordered)
    if pt.is_struct(t):
        return pa.struct([f.with_type(_map_type(f.type, swap)) for f in t])
    if pt.is_map(t):
        key = t.key_field.with_type(_map_type(t.key_type, swap))
        return pa.map_(key, t.item_field.with_type(_map_type(t.item_type, swap)), t.keys_sorted)
    value = t.value_field.with_type(_map_type(t.value_type, swap))
    if pt.is_fixed_size_list(t):
        return pa.list_(value, t.list_size)
    makers = [
        (pt.is_large_list, pa.large_list),
        (pt.is_list, pa.list_),
        (getattr(pt, "is_list_view", None), getattr(pa, "list_view", None)),
        (getattr(pt, "is_large_list_view", None), getattr(pa, "large_list_view", None)),
    ]
    for is_kind, make in makers:
        if is_kind is not None and is_kind(t):
            return make(value)
    return t


def _storage_type(t: pa.DataType) -> pa.DataType:
    """`t` with every extension type (at any depth) replaced by its storage type."""
    import pyarrow as pa

    if not _needs_type(t):
        return t
    return _map_type(t, lambda x: x.storage_type if isinstance(x, pa.BaseExtensionType) else None)


def parquet_kept_type(t: pa.DataType) -> pa.DataType:
    """The Parquet output type of a column kept from a Parquet input: its own type, except that
    string_view and binary_view (at any depth) become string and binary. Parquet stores them
    alike, and pyarrow has no take or filter kernels for views, which the ordered merge needs."""
    import pyarrow as pa

    views = {}
    for view, plain in (("string_view", pa.string), ("binary_view", pa.binary)):
        if hasattr(pa, view):
            views[getattr(pa, view)()] = plain()
    if not views:
        return t
    return _map_type(t, views.get)


def table_from_rows(rows: list[dict[str, Any]], schema: pa.Schema) -> pa.Table:
    """`pa.Table.from_pylist(rows, schema=schema)`, also for extension types inside other types
    (which pyarrow cannot build from Python values): built as storage, then viewed as the type."""
    import pyarrow as pa

    storage = pa.schema([f.with_type(_storage_type(f.type)) for f in schema], schema.metadata)
    table = pa.Table.from_pylist(rows, schema=storage)
    if storage == schema:
        return table
    columns = [
        column if field.type == column.type else column.combine_chunks().view(field.type)
        for field, column in zip(schema, table.columns, strict=True)
    ]
    return pa.Table.from_arrays(columns, schema=schema)


def json_default(value: Any) -> Any:
    """orjson's fallback: bytes as base64, decimals as plain decimal text, durations as ISO 8601."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return base64.b64encode(value).decode("ascii")
    if isinstance(value, Decimal):
        return format(value, "f")
    if isinstance(value, dt.timedelta):
        return iso_duration(value // dt.timedelta(microseconds=1), 6)
    raise TypeError(f"cannot write a {type(value).__name__} value as JSON")


def iso_duration(count: int, digits: int) -> str:
    """`count` units of 10**-digits seconds as an ISO 8601 duration: `PT1.5S`, `-PT90S`."""
    sign = "-" if count < 0 else ""
    seconds, fraction = divmod(abs(count), 10**digits)
    text = f"{sign}PT{seconds}"
    if fraction:
        text += "." + f"{fraction:0{digits}d}".rstrip("0")
    return text + "S"


@lru_cache(maxsize=64)
def _tzinfo(tz: str) -> dt.tzinfo | None:
    import pyarrow as pa

    return pa.scalar(0, pa.timestamp("s", tz)).as_py().tzinfo


def iso_timestamp_nanos(nanos: int, tz: str | None) -> str:
    """ISO 8601 text of a nanosecond timestamp: naive without `tz`, else with its UTC offset."""
    micros, rest = divmod(nanos, 1000)
    when = _EPOCH + dt.timedelta(microseconds=micros)
    if tz is not None:
        when = when.replace(tzinfo=dt.timezone.utc).astimezone(_tzinfo(tz))
    text = when.replace(microsecond=0).isoformat()
    fraction = when.microsecond * 1000 + rest
    # NOTE: "YYYY-MM-DDTHH:MM:SS" is 19 characters; the offset, if any, follows it.
    return text[:19] + (f".{fraction:09d}" if fraction else "") + text[19:]


def iso_time_nanos(nanos: int) -> str:
    seconds, fraction = divmod(nanos, _NANOS)
    minutes, second = divmod(seconds, 60)
    hour, minute = divmod(minutes, 60)
    return f"{hour:02d}:{minute:02d}:{second:02d}" + (f".{fraction:09d}" if fraction else "")


class KeptJson:
    """Formats the kept Parquet columns whose values need their Arrow type to become JSON
    (nanosecond temporal values arrive as integers, extension values as storage values); the
    values of other columns pass through."""

    def __init__(self, schema: pa.Schema, columns: Sequence[str]) -> None:
        self.types = {
            name: schema.field(name).type
            for name in columns
            if name in schema.names and _needs_type(schema.field(name).type)
        }

    def __bool__(self) -> bool:
        return bool(self.types)

    def __call__(self, kept: dict[str, Any]) -> dict[str, Any]:
        out = dict(kept)
        for name, t in self.types.items():
            if name in out:
                out[name] = _json_value(out[name], t)
        return out


def _json_value(value: Any, t: pa.DataType) -> Any:
    import pyarrow as pa
    import pyarrow.types as pt

    if value is None or not _needs_type(t):
        return value
    if isinstance(t, pa.BaseExtensionType):
        if t.extension_name == "arrow.uuid":
            return str(uuid.UUID(bytes=value))
        if t.extension_name == "arrow.bool8":
            return bool(value)
        return _json_value(value, t.storage_type)
    if pt.is_dictionary(t):
        return _json_value(value, t.value_type)
    if _is_nanos(t):
        if pt.is_timestamp(t):
            return iso_timestamp_nanos(value, t.tz)
        if pt.is_time64(t):
            return iso_time_nanos(value)
        return iso_duration(value, 9)
    if pt.is_map(t):
        return [[_json_value(k, t.key_type), _json_value(v, t.item_type)] for k, v in value]
    if pt.is_struct(t):
        fields = {t.field(i).name: t.field(i).type for i in range(t.num_fields)}
        return {k: _json_value(v, fields[k]) if k in fields else v for k, v in value.items()}
    # NOTE: the list types: list, large_list, fixed_size_list, list_view, large_list_view.
    return [_json_value(v, t.value_type) for v in value]
