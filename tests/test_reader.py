"""Tests for the streaming readers and the id pre-pass."""

from __future__ import annotations

import gzip
import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from vbatch.errors import InputError
from vbatch.job.journal import IndexSet
from vbatch.job.reader import InputReader, detect_format, scan_input
from vbatch.job.rows import ColumnOptions, RowParser
from vbatch.sampling_params import SamplingParams

PARSER = RowParser(ColumnOptions(), SamplingParams())


def write_jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_jsonl_rows_skip_blank_lines_and_keep_line_numbers(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "in.jsonl",
        ['{"prompt": "a"}', "", '{"prompt": "b"', "   ", '{"prompt": "c"}'],
    )
    rows = list(InputReader(path, None, ColumnOptions()).rows(PARSER))
    assert [(r.index, r.location) for r in rows] == [(0, "line 1"), (1, "line 3"), (2, "line 5")]
    assert rows[0].prompt == "a" and rows[2].prompt == "c"
    assert rows[1].error is not None and rows[1].error.startswith("line 3: invalid JSON")


def test_a_byte_order_mark_and_crlf_line_ends_are_read_as_windows_tools_write_them(
    tmp_path: Path,
) -> None:
    path = tmp_path / "in.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"prompt": "a"}\r\n\r\n{"prompt": "b"}\r\n')
    rows = list(InputReader(path, None, ColumnOptions()).rows(PARSER))
    assert [(r.prompt, r.location, r.error) for r in rows] == [
        ("a", "line 1", None),
        ("b", "line 3", None),
    ]
    gz = tmp_path / "in.jsonl.gz"
    gz.write_bytes(gzip.compress(b'\xef\xbb\xbf{"prompt": "c"}\n'))
    assert [r.prompt for r in InputReader(gz, None, ColumnOptions()).rows(PARSER)] == ["c"]


def test_a_byte_order_mark_before_a_json_array_still_gets_the_hint(tmp_path: Path) -> None:
    path = tmp_path / "in.json"
    path.write_bytes(b'\xef\xbb\xbf[{"prompt": "a"}, {"prompt": "b"}]\n')
    with pytest.raises(InputError, match="looks like a JSON array"):
        InputReader(path, None, ColumnOptions())


@pytest.mark.parametrize(
    ("codec", "named"),
    [
        ("utf-16", "UTF-16"),
        ("utf-16-le", "UTF-16LE"),
        ("utf-16-be", "UTF-16BE"),
        ("utf-32", "UTF-32"),
        ("utf-32-le", "UTF-32LE"),
    ],
)
@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz"])
def test_utf16_or_utf32_input_is_refused_with_the_command_that_converts_it(
    tmp_path: Path, codec: str, named: str, suffix: str
) -> None:
    """Windows PowerShell 5.1's `>` writes UTF-16: before, each line became a garbage error row
    (and one more for the NUL after the last newline), and the job exited 0."""
    text = '{"prompt": "a"}\n{"prompt": "b"}\n'
    path = tmp_path / f"in{suffix}"
    data = text.encode(codec)
    path.write_bytes(gzip.compress(data) if suffix.endswith(".gz") else data)
    with pytest.raises(InputError, match=f"is {named} text; vbatch reads UTF-8") as info:
        InputReader(path, None, ColumnOptions())
    command = str(info.value).split("Convert it with: ")[1]
    if shutil.which("iconv") is not None:
        subprocess.run(command, shell=True, check=True, cwd=tmp_path)
        rows = InputReader(tmp_path / "in.utf8.jsonl", None, ColumnOptions()).rows(PARSER)
        assert [r.prompt for r in rows] == ["a", "b"]


def test_skip_set_is_not_decoded(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "in.jsonl", [f'{{"prompt": "p{i}"}}' for i in range(10)])
    skip = IndexSet()
    skip.add_ranges([[0, 3], [5, 9]])
    rows = list(InputReader(path, None, ColumnOptions()).rows(PARSER, skip))
    assert [r.index for r in rows] == [3, 4, 9]


def test_gzip_jsonl(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.write('{"prompt": "x"}\n{"prompt": "y"}\n')
    reader = InputReader(path, None, ColumnOptions())
    assert reader.format == "jsonl"
    assert [r.prompt for r in reader.rows(PARSER)] == ["x", "y"]


def test_parquet_streams_by_batches_with_skip(tmp_path: Path) -> None:
    path = tmp_path / "in.parquet"
    table = pa.table({"id": [f"r{i}" for i in range(3000)], "prompt": ["p"] * 3000})
    pq.write_table(table, path, row_group_size=700)
    skip = IndexSet()
    skip.add_range(0, 2990)
    reader = InputReader(path, None, ColumnOptions())
    rows = list(reader.rows(PARSER, skip))
    assert [(r.index, r.id, r.location) for r in rows][:2] == [
        (2990, "r2990", "row 2991"),
        (2991, "r2991", "row 2992"),
    ]
    assert len(rows) == 10


def test_parquet_view_columns_are_read_past_a_skip_set(tmp_path: Path) -> None:
    """pyarrow has no filter for string_view / binary_view: once rows were committed, every
    later batch failed as a 'corrupt' file, in the run and in each resume."""
    path = tmp_path / "in.parquet"
    n = 3000
    table = pa.table(
        {
            "id": pa.array([f"r{i}" for i in range(n)], pa.string_view()),
            "prompt": pa.array([f"p{i}" for i in range(n)], pa.string_view()),
            "blob": pa.array([b"x"] * n, pa.binary_view()),
        }
    )
    pq.write_table(table, path, row_group_size=700)
    skip = IndexSet()
    skip.add_range(0, 1000)
    skip.add_range(2000, 2995)
    reader = InputReader(path, None, ColumnOptions(keep_columns=("blob",)))
    rows = list(reader.rows(PARSER, skip))
    assert [r.index for r in rows] == [*range(1000, 2000), *range(2995, n)]
    assert all(r.id == f"r{r.index}" and r.prompt == f"p{r.index}" for r in rows)


def test_a_value_python_cannot_hold_fails_its_row_alone(tmp_path: Path) -> None:
    """A date past year 9999 in a kept column: the batch's conversion raised and the job died
    with 'unexpected OverflowError', in every resume too."""
    path = tmp_path / "in.parquet"
    days = [0, 3_000_000, 1]
    table = pa.table({"prompt": ["a", "b", "c"], "day": pa.array(days, pa.date32())})
    pq.write_table(table, path)
    reader = InputReader(path, None, ColumnOptions(keep_columns=("day",)))
    rows = list(reader.rows(PARSER))
    assert [r.index for r in rows] == [0, 1, 2]
    assert rows[0].error is None and rows[2].error is None and rows[2].prompt == "c"
    assert rows[1].error is not None
    assert rows[1].error.startswith("row 2: a value cannot be read in Python: ")


def test_a_kept_settings_struct_keeps_its_null_fields(tmp_path: Path) -> None:
    """The row reads its sampling_params without their null fields; the kept column is the
    file's value, nulls and all, as any other struct column is."""
    path = tmp_path / "in.parquet"
    kind = pa.struct([("max_tokens", pa.int64()), ("temperature", pa.float64())])
    value = [{"max_tokens": 2, "temperature": None}]
    table = pa.table(
        {"prompt": ["a"], "sampling_params": pa.array(value, kind), "other": pa.array(value, kind)}
    )
    pq.write_table(table, path)
    options = ColumnOptions(keep_columns=("sampling_params", "other"))
    (row,) = InputReader(path, None, options).rows(RowParser(options, SamplingParams()))
    assert row.error is None and row.sampling_params is not None
    assert row.sampling_params.max_tokens == 2
    assert row.kept == {"sampling_params": value[0], "other": value[0]}


def test_missing_input_and_unreadable_parquet(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="does not exist"):
        InputReader(tmp_path / "nope.jsonl", None, ColumnOptions())
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"not parquet at all")
    with pytest.raises(InputError, match="cannot read Parquet"):
        InputReader(bad, None, ColumnOptions())
    with pytest.raises(
        InputError, match=r"cannot tell the format .* --input-format jsonl\|parquet"
    ):
        detect_format(tmp_path / "x.txt", None)
    assert detect_format(tmp_path / "x.csv", "jsonl") == "jsonl"


@pytest.mark.parametrize(
    ("name", "text"), [("in.csv", "id,prompt\n7,a b\n"), ("in.tsv", "id\tprompt\n7\ta b\n")]
)
def test_a_table_gets_a_conversion_command_that_works(tmp_path: Path, name: str, text: str) -> None:
    table = tmp_path / name
    table.write_text(text)
    with pytest.raises(InputError, match="delimited text table") as raised:
        detect_format(table, None)
    command = str(raised.value).split("Convert it with pyarrow (installed with vbatch): ")[1]
    command = command.replace("python -c", f"{shlex.quote(sys.executable)} -c", 1)
    subprocess.run(command, shell=True, cwd=tmp_path, check=True)
    rows = list(InputReader(tmp_path / "in.parquet", None, ColumnOptions()).rows(PARSER))
    assert [(r.id, r.prompt) for r in rows] == [(7, "a b")]


def test_unknown_columns_are_refused_before_any_work(tmp_path: Path) -> None:
    path = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": ["p"]}), path)
    with pytest.raises(InputError, match="'question' not in"):
        InputReader(path, None, ColumnOptions(prompt_column="question"))
    jsonl = write_jsonl(tmp_path / "in.jsonl", ['{"prompt": "x"}'])
    with pytest.raises(InputError, match="'text' not found"):
        InputReader(jsonl, None, ColumnOptions(keep_columns=("text",)))


def test_a_repeated_parquet_column_the_job_reads_is_refused_before_any_work(
    tmp_path: Path,
) -> None:
    path = tmp_path / "in.parquet"
    names = ["prompt", "dup", "dup", "prompt2", "prompt2"]
    pq.write_table(pa.Table.from_arrays([pa.array(["a", "b"])] * 5, names=names), path)
    for options in (ColumnOptions(keep_all_columns=True), ColumnOptions(keep_columns=("dup",))):
        with pytest.raises(InputError, match="more than one column named 'dup'"):
            InputReader(path, None, options)
    with pytest.raises(InputError, match="more than one column named 'prompt2'"):
        InputReader(path, None, ColumnOptions(prompt_column="prompt2"))
    rows = list(InputReader(path, None, ColumnOptions()).rows(PARSER))
    assert [r.prompt for r in rows] == ["a", "b"]


def test_a_last_line_without_its_newline_counts_for_the_column_check(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_bytes(b'{"id": 1, "prompt": "a"}\n{"id": 2, "prompt": "b", "x": 1}')
    reader = InputReader(path, None, ColumnOptions(keep_columns=("x",)))
    assert [r.id for r in reader.rows(PARSER)] == [1, 2]


def test_scan_counts_rows_and_names_the_first_duplicate(tmp_path: Path) -> None:
    ids = [f"id-{i}" for i in range(2000)] + ["id-17", "id-5"]
    path = write_jsonl(
        tmp_path / "in.jsonl", [orjson.dumps({"id": i, "prompt": "x"}).decode() for i in ids]
    )
    scan = scan_input(InputReader(path, None, ColumnOptions()), PARSER)
    assert scan.num_rows == 2002 and scan.id_kind == "str" and not scan.is_openai
    assert scan.duplicate == "duplicate id 'id-17' at line 2001 (first at line 18)"


def test_scan_int_ids_openai_shape_and_keys(tmp_path: Path) -> None:
    lines = [
        orjson.dumps({"custom_id": i, "url": "/v1/completions", "body": {"prompt": "x"}}).decode()
        for i in range(5)
    ]
    path = write_jsonl(tmp_path / "in.jsonl", [*lines, "{broken"])
    scan = scan_input(InputReader(path, None, ColumnOptions()), PARSER, collect_keys=True)
    assert (scan.num_rows, scan.id_kind, scan.is_openai, scan.duplicate) == (6, "int", True, None)
    assert scan.keys == {"custom_id", "url", "body"}


def test_scan_parquet_reads_ids_without_duplicates(tmp_path: Path) -> None:
    path = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": list(range(5000)), "prompt": ["p"] * 5000}), path)
    scan = scan_input(InputReader(path, None, ColumnOptions()), PARSER)
    assert (scan.num_rows, scan.id_kind, scan.duplicate) == (5000, "int", None)


def _jsonl_bytes(num_rows: int) -> bytes:
    return b"".join(orjson.dumps({"id": i, "prompt": f"p {i}"}) + b"\n" for i in range(num_rows))


def _gzip_with_bad_deflate_data(data: bytes) -> bytes:
    """The gzip of `data` with one byte flipped where zlib itself rejects the stream."""
    import zlib

    good = gzip.compress(data)
    for position in range(10, len(good) - 8):
        bad = bytearray(good)
        bad[position] ^= 0xFF
        try:
            gzip.decompress(bytes(bad))
        except zlib.error:
            return bytes(bad)
        except (OSError, EOFError):
            continue
    raise AssertionError("no single-byte corruption that zlib rejects")


def _corrupt_input(kind: str, data: bytes) -> tuple[str, bytes]:
    if kind == "gzip-deflate":
        return ".jsonl.gz", _gzip_with_bad_deflate_data(data)
    if kind == "gzip-truncated":
        return ".jsonl.gz", gzip.compress(data)[:-100]
    if kind == "gzip-not-gzip":
        return ".jsonl.gz", data
    zstandard = pytest.importorskip("zstandard")
    # NOTE: with a checksum, as the zstd command writes by default.
    compressed = zstandard.ZstdCompressor(write_checksum=True).compress(data)
    if kind == "zstd-truncated":
        return ".jsonl.zst", compressed[: len(compressed) // 2]
    bad = bytearray(compressed)
    for position in range(len(bad) // 2, len(bad) // 2 + 64):
        bad[position] ^= 0x55
    return ".jsonl.zst", bytes(bad)


@pytest.mark.parametrize(
    "kind", ["gzip-deflate", "gzip-truncated", "gzip-not-gzip", "zstd-corrupt", "zstd-truncated"]
)
def test_corrupt_or_truncated_compressed_input_is_one_clear_error(
    tmp_path: Path, kind: str
) -> None:
    suffix, data = _corrupt_input(kind, _jsonl_bytes(3000))
    path = tmp_path / f"in{suffix}"
    path.write_bytes(data)
    codec = suffix.rsplit(".", 1)[1].replace("gz", "gzip").replace("zst", "zstd")
    with pytest.raises(InputError) as caught:
        scan_input(InputReader(path, None, ColumnOptions()), PARSER)
    message = str(caught.value)
    assert f"cannot read {path}: its {codec} data is corrupt or truncated" in message
    assert f"Check it with `{codec} -t`, and compress it again" in message
    assert "\n" not in message


def test_zstd_input_with_several_frames_is_read_whole(tmp_path: Path) -> None:
    zstandard = pytest.importorskip("zstandard")
    data = _jsonl_bytes(3000)
    cut = data.index(b"\n", len(data) // 3) + 1
    compressor = zstandard.ZstdCompressor()
    path = tmp_path / "in.jsonl.zst"
    path.write_bytes(compressor.compress(data[:cut]) + compressor.compress(data[cut:]))
    stream = compressor.compressobj()
    streamed = tmp_path / "streamed.jsonl.zst"
    streamed.write_bytes(stream.compress(data) + stream.flush())
    for source in (path, streamed):
        rows = list(InputReader(source, None, ColumnOptions()).rows(PARSER))
        assert [r.id for r in rows] == list(range(3000))


def test_a_malformed_line_has_no_id_so_it_cannot_clash(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "in.jsonl",
        [
            '{"id": 1, "prompt": "a"}',
            '{"id": 0, "prompt": "b"',
            "[1, 2]",
            '{"id": 2, "prompt": "c"}',
        ],
    )
    rows = list(InputReader(path, None, ColumnOptions()).rows(PARSER))
    # NOTE: the malformed lines are rows 1 and 2, the very ids of two real rows.
    assert [(r.index, r.id) for r in rows] == [(0, 1), (1, None), (2, None), (3, 2)]
    assert rows[1].error is not None and "line 2: invalid JSON" in rows[1].error
    assert rows[2].error == "line 3: expected a JSON object, got list"
    assert scan_input(InputReader(path, None, ColumnOptions()), PARSER).duplicate is None


def test_an_integer_beyond_64_bits_is_an_error_row_not_a_float(tmp_path: Path) -> None:
    """orjson would read these as floats (a kept column losing digits, an id reported as a
    pandas float); 64-bit integers and long fractions still read exactly."""
    path = write_jsonl(
        tmp_path / "in.jsonl",
        [
            '{"id": 18446744073709551615, "prompt": "a", "x": -9223372036854775808}',
            '{"id": "b", "prompt": "b", "big": 123456789012345678901234567890}',
            '{"id": 18446744073709551616, "prompt": "c"}',
            '{"id": "d", "prompt": "d", "f": 0.12345678901234567890123}',
        ],
    )
    rows = list(InputReader(path, None, ColumnOptions(keep_all_columns=True)).rows(PARSER))
    assert rows[0].error is None and rows[0].id == 2**64 - 1
    digits = ("123456789012345678901234567890", str(2**64))
    for row, number, row_id in zip(rows[1:3], digits, ("b", None), strict=True):
        assert row.id == row_id and row.error is not None
        assert row.error.startswith(f"line {row.index + 1}: the integer {number} does not fit")
        assert "write it as a string" in row.error
    assert rows[3].error is None and rows[3].id == "d"
    scan = scan_input(InputReader(path, None, ColumnOptions()), PARSER)
    assert scan.num_rows == 4 and scan.duplicate is None


def test_a_line_that_is_not_utf8_is_named_so(tmp_path: Path) -> None:
    """orjson calls such bytes "surrogates not allowed"."""
    path = tmp_path / "in.jsonl"
    path.write_bytes(b'{"id": 1, "prompt": "a\xff\xfeb"}\n{"id": 2, "prompt": "caf\xc3\xa9"}\n')
    bad, good = InputReader(path, None, ColumnOptions()).rows(PARSER)
    assert bad.error == (
        "line 1: invalid JSON (byte 0xff at byte 23 is not UTF-8; JSON Lines are UTF-8: convert "
        "the file, e.g. with iconv)"
    )
    assert good.error is None and good.prompt == "café"


def test_a_number_beyond_a_doubles_range_is_an_error_row_that_keeps_its_id(
    tmp_path: Path,
) -> None:
    """Valid JSON that orjson refuses: the row was "invalid JSON" without its id. NaN and
    Infinity literals, which are not JSON, stay invalid JSON."""
    path = write_jsonl(
        tmp_path / "in.jsonl",
        [
            '{"id": 1, "prompt": "a", "x": 1e400}',
            '{"id": "b", "prompt": "b", "sampling_params": {"temperature": -1E+309}}',
            '{"id": 3, "prompt": "c", "x": NaN}',
            '{"id": 4, "prompt": "d", "x": 1e400, "y": Infinity}',
            '{"id": 5, "prompt": "e", "x": 1e300}',
        ],
    )
    rows = list(InputReader(path, None, ColumnOptions()).rows(PARSER))
    assert [row.id for row in rows] == [1, "b", None, None, 5]
    assert rows[0].error == (
        "line 1: the number 1e400 does not fit a 64-bit float; write it as a string"
    )
    assert rows[1].error is not None and "the number -1E+309 does not fit" in rows[1].error
    for row in rows[2:4]:
        assert row.error is not None and f"line {row.index + 1}: invalid JSON" in row.error
    assert rows[4].error is None
    scan = scan_input(InputReader(path, None, ColumnOptions()), PARSER)
    assert scan.num_rows == 5 and scan.duplicate is None


def test_corrupt_parquet_page_is_one_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "in.parquet"
    prompts = [f"prompt number {i} " * 5 for i in range(5000)]
    table = pa.table({"id": range(5000), "prompt": prompts})
    pq.write_table(table, path, row_group_size=1000, use_dictionary=False)
    chunk = pq.ParquetFile(path).metadata.row_group(2).column(1)
    middle = chunk.data_page_offset + chunk.total_compressed_size // 2
    data = bytearray(path.read_bytes())
    for position in range(middle, middle + 200):
        data[position] ^= 0x5A
    path.write_bytes(bytes(data))
    reader = InputReader(path, None, ColumnOptions())
    # NOTE: the id pre-pass reads only the id column, so the damage shows only when rows are read.
    assert scan_input(reader, PARSER).num_rows == 5000
    with pytest.raises(InputError, match=r"The Parquet file is corrupt or truncated; write it"):
        list(reader.rows(PARSER))


def test_a_parquet_struct_field_left_null_is_absent(tmp_path: Path) -> None:
    rows = [
        {"prompt": "a", "sampling_params": {"max_tokens": 4, "temperature": None}},
        {"prompt": "b", "sampling_params": {"max_tokens": None, "temperature": 0.5}},
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "in.parquet")
    reader = InputReader(tmp_path / "in.parquet", None, ColumnOptions())
    defaults = SamplingParams(max_tokens=8, temperature=0.0)
    first, second = reader.rows(RowParser(ColumnOptions(), defaults))
    assert (first.error, second.error) == (None, None)
    assert (first.sampling_params.max_tokens, first.sampling_params.temperature) == (4, 0.0)
    assert (second.sampling_params.max_tokens, second.sampling_params.temperature) == (8, 0.5)


def test_a_nested_dictionary_column_over_row_groups_is_read_not_called_corrupt(
    tmp_path: Path,
) -> None:
    """A list of dictionary strings (Polars' List(Categorical)) in two row groups: Arrow cannot
    make one batch across them, which once read as a corrupt file."""
    path = tmp_path / "in.parquet"
    tags = pa.list_(pa.dictionary(pa.int32(), pa.string()))
    with pq.ParquetWriter(path, pa.schema([("id", pa.int64()), ("prompt", pa.string()),
                                           ("tags", tags)])) as writer:  # fmt: skip
        for group in range(2):
            writer.write_table(
                pa.table(
                    {
                        "id": [2 * group, 2 * group + 1],
                        "prompt": ["a", "b"],
                        "tags": pa.array([[f"t{group}"], [f"u{group}"]], tags),
                    }
                )
            )
    columns = ColumnOptions(keep_columns=("tags",))
    rows = list(InputReader(path, None, columns).rows(RowParser(columns, SamplingParams())))
    assert [r.id for r in rows] == [0, 1, 2, 3] and all(r.error is None for r in rows)
    assert [r.kept["tags"] for r in rows] == [["t0"], ["u0"], ["t1"], ["u1"]]


def test_a_limit_reads_only_the_rows_a_job_counted(tmp_path: Path) -> None:
    """Rows past the job's count (appended while it runs) are not its rows, in either format."""
    table = pa.table({"id": list(range(10)), "prompt": [f"p{i}" for i in range(10)]})
    parquet = tmp_path / "in.parquet"
    pq.write_table(table, parquet, row_group_size=3)
    jsonl = write_jsonl(
        tmp_path / "in.jsonl", [orjson.dumps(r).decode() for r in table.to_pylist()]
    )
    for path in (parquet, jsonl):
        reader = InputReader(path, None, ColumnOptions())
        assert [r.id for r in reader.rows(PARSER, limit=4)] == [0, 1, 2, 3]
        done = IndexSet()
        done.add_ranges([[1, 3]])
        assert [r.id for r in reader.rows(PARSER, done, limit=5)] == [0, 3, 4]


def test_parquet_struct_schemas_read_each_row_s_own_fields_at_every_depth(
    tmp_path: Path,
) -> None:
    """Arrow merges the rows' struct types, so each row's schema came with the fields of every
    other row's, null: `maxLength: null` (refused as not an integer), a property of another
    row's schema as a null schema, and so for OpenAI Batch bodies in Parquet."""
    schemas = [
        {"type": "object", "properties": {"name": {"type": "string", "maxLength": 5}}},
        {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]},
        {"type": "object", "properties": {"n": {"type": "integer", "enum": [1, None]}}},
    ]
    formats = [{"type": "json_schema", "json_schema": {"name": "s", "schema": s}} for s in schemas]
    path = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b", "c"], "response_format": formats}), path)
    rows = list(
        InputReader(path, None, ColumnOptions()).rows(RowParser(ColumnOptions(), SamplingParams()))
    )
    assert [row.error for row in rows] == [None, None, None]
    assert [json.loads(row.sampling_params.structured.json_schema) for row in rows] == schemas
    bodies = [
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "response_format": f}
        for f in formats
    ]
    lines = pa.table(
        {
            "custom_id": ["x", "y", "z"],
            "method": ["POST"] * 3,
            "url": ["/v1/chat/completions"] * 3,
            "body": bodies,
        }
    )
    pq.write_table(lines, path)
    rows = list(
        InputReader(path, None, ColumnOptions()).rows(RowParser(ColumnOptions(), SamplingParams()))
    )
    assert [row.error for row in rows] == [None, None, None]
    assert [json.loads(row.sampling_params.structured.json_schema) for row in rows] == schemas


def test_parquet_rows_read_their_constraint_template_and_adapter_columns(tmp_path: Path) -> None:
    """response_format, guided (JSON text or structs, whose unset fields are null) and
    chat_template_kwargs are read from a Parquet input as from JSONL."""
    messages = [[{"role": "user", "content": "hi"}]] * 4
    table = pa.table(
        {
            "messages": messages,
            "guided": [{"regex": "[0-9]+", "choice": None}, None, None, None],
            "response_format": [None, '{"type": "json_object"}', None, None],
            "chat_template_kwargs": [None, None, '{"enable_thinking": false}', None],
            "lora": [None, None, None, "sql"],
        }
    )
    path = tmp_path / "in.parquet"
    pq.write_table(table, path)
    reader = InputReader(path, None, ColumnOptions())
    parser = RowParser(ColumnOptions(), SamplingParams())
    regex, json_object, kwargs, lora = reader.rows(parser)
    assert regex.error is None and regex.sampling_params is not None
    assert regex.sampling_params.structured is not None
    assert regex.sampling_params.structured.regex == "[0-9]+"
    assert json_object.sampling_params is not None
    assert json_object.sampling_params.structured is not None
    assert json_object.sampling_params.structured.json_object
    assert kwargs.chat_template_kwargs == {"enable_thinking": False}
    assert lora.error is not None and "this job has no LoRA adapters" in lora.error


@pytest.mark.parametrize(
    ("name", "target"), [("in.json", "in.jsonl"), ("in.jsonl", "in.lines.jsonl")]
)
def test_the_json_array_hint_converts_into_another_file_than_the_input(
    tmp_path: Path, name: str, target: str
) -> None:
    """For an array in `in.jsonl` the hint once read `jq -c '.[]' in.jsonl > in.jsonl`, which
    empties the input before jq reads it."""
    path = tmp_path / name
    path.write_text('[{"prompt": "a"}, {"prompt": "b"}]\n')
    with pytest.raises(InputError, match="looks like a JSON array") as info:
        InputReader(path, None, ColumnOptions())
    command = str(info.value).split("Convert it with: ")[1]
    assert command == f"jq -c '.[]' {path} > {tmp_path / target}"
    if shutil.which("jq") is not None:
        subprocess.run(command, shell=True, check=True, cwd=tmp_path)
        rows = InputReader(tmp_path / target, None, ColumnOptions()).rows(PARSER)
        assert [r.prompt for r in rows] == ["a", "b"]
