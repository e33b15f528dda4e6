"""Tests for the output encodings of ids and kept columns (docs/formats.md, "Encodings")."""

from __future__ import annotations

import datetime as dt
from decimal import Decimal

import orjson
import pyarrow as pa
import pytest

from vbatch.job.encoding import (
    KeptJson,
    batch_records,
    fits_int64,
    iso_duration,
    iso_time_nanos,
    iso_timestamp_nanos,
    json_default,
)
from vbatch.job.results import jsonl_bytes


def test_fits_int64() -> None:
    assert fits_int64(2**63 - 1) and fits_int64(-(2**63))
    assert not fits_int64(2**63) and not fits_int64(-(2**63) - 1)


def test_json_default_for_values_json_has_no_type_for() -> None:
    assert json_default(b"\x00\xff") == "AP8=" and json_default(bytearray(b"ab")) == "YWI="
    assert json_default(Decimal("-1E-7")) == "-0.0000001"
    assert json_default(Decimal("1.2E+3")) == "1200"
    assert json_default(dt.timedelta(days=-1)) == "-PT86400S"
    assert json_default(dt.timedelta(seconds=1, microseconds=500)) == "PT1.0005S"
    with pytest.raises(TypeError, match="object"):
        json_default(object())


def test_iso_text_of_nanosecond_values() -> None:
    assert iso_duration(0, 9) == "PT0S" and iso_duration(-1_500_000_000, 9) == "-PT1.5S"
    assert iso_timestamp_nanos(-1, None) == "1969-12-31T23:59:59.999999999"
    assert iso_timestamp_nanos(0, "+01:00") == "1970-01-01T01:00:00+01:00"
    assert iso_timestamp_nanos(5, "UTC") == "1970-01-01T00:00:00.000000005+00:00"
    assert iso_time_nanos(86_399_999_999_999) == "23:59:59.999999999"


def test_jsonl_line_writes_non_finite_floats_as_null_and_big_ints_exactly() -> None:
    line = orjson.loads(jsonl_bytes({"id": 2**64 - 1}, {"x": float("nan"), "y": b"a"}))
    assert line == {"id": 2**64 - 1, "x": None, "y": "YQ=="}


def test_batch_records_turn_kept_nanosecond_columns_into_integers() -> None:
    ns = pa.timestamp("ns", tz="UTC")
    batch = pa.record_batch(
        {
            "t": pa.array([7], ns),
            "nested": pa.array([{"a": [7]}], pa.struct([("a", pa.list_(ns))])),
            "d": pa.array([7], ns).dictionary_encode(),
            "us": pa.array([7], pa.timestamp("us")),
        }
    )
    (record,) = batch_records(batch, ["t", "nested", "d", "us"])
    micro = dt.datetime(1970, 1, 1, 0, 0, 0, 7)
    assert record == {"t": 7, "nested": {"a": [7]}, "d": 7, "us": micro}
    kept = KeptJson(batch.schema, ["t", "nested", "d", "us"])
    assert set(kept.types) == {"t", "nested", "d"}
    out = kept(record)
    stamp = "1970-01-01T00:00:00.000000007+00:00"
    assert out == {"t": stamp, "nested": {"a": [stamp]}, "d": stamp, "us": record["us"]}
    assert not KeptJson(batch.schema, ["us"])
