"""Job outputs through real runs on the tiny model: id and kept-column encodings for every Arrow
type (JSONL and Parquet output), the model identity a resume checks, and OpenAI Batch shapes."""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import shutil
from collections.abc import Callable
from decimal import Decimal
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import read_jsonl, write_jsonl

from vbatch.errors import ConfigError, JobStateError
from vbatch.job.paths import job_dir_for
from vbatch.job.rows import ColumnOptions
from vbatch.job.runner import JobSpec, RunOptions, resume_job, start_job

QUIET = RunOptions(display="quiet", commit_every_rows=2)
SAMPLING = {"max_tokens": 3, "temperature": 0.0}
CHAT = [{"role": "user", "content": "hi"}]


def run(
    tmp_path: Path, input_path: Path, output_name: str, model: Path, llm: Any, **kw: Any
) -> Path:
    job = JobSpec(
        input_path, tmp_path / output_name, model=str(model), sampling=SAMPLING, ordered=True, **kw
    )
    outcome = start_job(job, QUIET, llm_factory=llm)
    assert outcome.exit_code == 0, outcome.message
    return job.output_path


# --- ids ---------------------------------------------------------------------------------------

BIG_IDS = [2**63, 2**64 - 1, 5, -(2**63)]


@pytest.mark.parametrize("output_name", ["out.jsonl", "out.parquet"])
def test_jsonl_ids_beyond_int64(
    tmp_path: Path, tiny_model_dir: Path, shared_llm: Callable[..., Any], output_name: str
) -> None:
    records = [{"id": i, "prompt": f"row {n}"} for n, i in enumerate(BIG_IDS)]
    input_path = write_jsonl(tmp_path / "in.jsonl", records)
    output = run(tmp_path, input_path, output_name, tiny_model_dir, shared_llm)
    if output_name.endswith(".jsonl"):
        # NOTE: JSONL keeps each id's JSON type and value.
        assert [r["id"] for r in read_jsonl(output)] == BIG_IDS
    else:
        table = pq.read_table(output)
        assert table.schema.field("id").type == pa.string()
        assert table.column("id").to_pylist() == [str(i) for i in BIG_IDS]


@pytest.mark.parametrize(
    ("ids", "id_type"), [([2**64 - 1, 1, 0], pa.string()), ([3, 1, 0], pa.int64())]
)
@pytest.mark.parametrize("output_name", ["out.jsonl", "out.parquet"])
def test_parquet_uint64_id_column(
    tmp_path: Path,
    tiny_model_dir: Path,
    shared_llm: Callable[..., Any],
    output_name: str,
    ids: list[int],
    id_type: pa.DataType,
) -> None:
    input_path = tmp_path / "in.parquet"
    table = pa.table({"key": pa.array(ids, pa.uint64()), "prompt": ["a", "b", "c"]})
    pq.write_table(table, input_path)
    columns = ColumnOptions(id_column="key")
    output = run(tmp_path, input_path, output_name, tiny_model_dir, shared_llm, columns=columns)
    if output_name.endswith(".jsonl"):
        assert [r["id"] for r in read_jsonl(output)] == ids
    else:
        out = pq.read_table(output)
        assert out.schema.field("id").type == id_type
        expected = ids if id_type == pa.int64() else [str(i) for i in ids]
        assert out.column("id").to_pylist() == expected


# --- kept columns of every Arrow type ---------------------------------------------------------

NS = 1_700_000_000_123_456_789
# name: (Arrow array of 3 rows, the JSON values JSONL output must hold for them)
KEPT: dict[str, tuple[pa.Array, list[Any]]] = {
    "i8": (pa.array([-128, 127, None], pa.int8()), [-128, 127, None]),
    "i16": (pa.array([-(2**15), 2**15 - 1, None], pa.int16()), [-(2**15), 2**15 - 1, None]),
    "i32": (pa.array([-(2**31), 2**31 - 1, None], pa.int32()), [-(2**31), 2**31 - 1, None]),
    "i64": (pa.array([-(2**63), 2**63 - 1, None], pa.int64()), [-(2**63), 2**63 - 1, None]),
    "u8": (pa.array([0, 255, None], pa.uint8()), [0, 255, None]),
    "u16": (pa.array([0, 2**16 - 1, None], pa.uint16()), [0, 2**16 - 1, None]),
    "u32": (pa.array([0, 2**32 - 1, None], pa.uint32()), [0, 2**32 - 1, None]),
    "u64": (pa.array([0, 2**64 - 1, None], pa.uint64()), [0, 2**64 - 1, None]),
    "f16": (pa.array([1.5, -2.0, None], pa.float16()), [1.5, -2.0, None]),
    "f32": (pa.array([0.25, -1e30, None], pa.float32()), [0.25, -1.0000000150474662e30, None]),
    "f64": (pa.array([1e300, float("inf"), None], pa.float64()), [1e300, None, None]),
    "flag": (pa.array([True, False, None], pa.bool_()), [True, False, None]),
    "s": (pa.array(["héllo", "", None], pa.string()), ["héllo", "", None]),
    "ls": (pa.array(["x", "y", None], pa.large_string()), ["x", "y", None]),
    "b": (pa.array([b"\x00\xff", b"", None], pa.binary()), ["AP8=", "", None]),
    "lb": (pa.array([b"ab", b"\x01", None], pa.large_binary()), ["YWI=", "AQ==", None]),
    "fb": (pa.array([b"abc", b"\x01\x02\x03", None], pa.binary(3)), ["YWJj", "AQID", None]),
    "d128": (
        pa.array([Decimal("1.5"), Decimal("-0.0000001"), None], pa.decimal128(20, 7)),
        ["1.5000000", "-0.0000001", None],
    ),
    "d256": (
        pa.array([Decimal(10**45), Decimal(-7), None], pa.decimal256(50, 0)),
        ["1" + "0" * 45, "-7", None],
    ),
    "date32": (
        pa.array([dt.date(2024, 2, 29), dt.date(1, 1, 1), None], pa.date32()),
        ["2024-02-29", "0001-01-01", None],
    ),
    "date64": (
        pa.array([dt.date(1969, 12, 31), dt.date(2000, 1, 1), None], pa.date64()),
        ["1969-12-31", "2000-01-01", None],
    ),
    "ts_s": (
        pa.array(
            [dt.datetime(2024, 1, 2, 3, 4, 5), dt.datetime(1900, 1, 1), None], pa.timestamp("s")
        ),
        ["2024-01-02T03:04:05", "1900-01-01T00:00:00", None],
    ),
    "ts_ms_utc": (
        pa.array([1_500, 0, None], pa.timestamp("ms", tz="UTC")),
        ["1970-01-01T00:00:01.500000+00:00", "1970-01-01T00:00:00+00:00", None],
    ),
    "ts_us_tz": (
        pa.array([1, 0, None], pa.timestamp("us", tz="Asia/Kolkata")),
        ["1970-01-01T05:30:00.000001+05:30", "1970-01-01T05:30:00+05:30", None],
    ),
    "ts_ns": (
        pa.array([NS, -1, None], pa.timestamp("ns")),
        ["2023-11-14T22:13:20.123456789", "1969-12-31T23:59:59.999999999", None],
    ),
    "ts_ns_tz": (
        pa.array([NS, 0, None], pa.timestamp("ns", tz="America/New_York")),
        ["2023-11-14T17:13:20.123456789-05:00", "1969-12-31T19:00:00-05:00", None],
    ),
    "t32s": (pa.array([3661, 0, None], pa.time32("s")), ["01:01:01", "00:00:00", None]),
    "t32ms": (
        pa.array([1, 86_399_999, None], pa.time32("ms")),
        ["00:00:00.001000", "23:59:59.999000", None],
    ),
    "t64us": (pa.array([1, 0, None], pa.time64("us")), ["00:00:00.000001", "00:00:00", None]),
    "t64ns": (
        pa.array([3_661_000_000_001, 0, None], pa.time64("ns")),
        ["01:01:01.000000001", "00:00:00", None],
    ),
    "dur_s": (pa.array([90, -1, None], pa.duration("s")), ["PT90S", "-PT1S", None]),
    "dur_ms": (pa.array([1_500, 0, None], pa.duration("ms")), ["PT1.5S", "PT0S", None]),
    "dur_us": (
        pa.array([1, -86_400_000_001, None], pa.duration("us")),
        ["PT0.000001S", "-PT86400.000001S", None],
    ),
    "dur_ns": (
        pa.array([1, NS, None], pa.duration("ns")),
        ["PT0.000000001S", "PT1700000000.123456789S", None],
    ),
    "lst": (pa.array([[1, None, 3], [], None], pa.list_(pa.int32())), [[1, None, 3], [], None]),
    "llst": (
        pa.array([["a"], ["b", "c"], None], pa.large_list(pa.string())),
        [["a"], ["b", "c"], None],
    ),
    "fsl": (
        pa.array([[1.0, 2.0], [3.0, None], None], pa.list_(pa.float64(), 2)),
        [[1.0, 2.0], [3.0, None], None],
    ),
    "lst_bin": (pa.array([[b"\x00"], [], None], pa.list_(pa.binary())), [["AA=="], [], None]),
    "lst_ts_ns": (
        pa.array([[NS, None], [], None], pa.list_(pa.timestamp("ns", tz="UTC"))),
        [["2023-11-14T22:13:20.123456789+00:00", None], [], None],
    ),
    "st": (
        pa.array(
            [{"a": 1, "b": b"\x00", "c": 5, "d": Decimal("2.50")}, {"a": None}, None],
            pa.struct(
                [
                    ("a", pa.int64()),
                    ("b", pa.binary()),
                    ("c", pa.timestamp("ns")),
                    ("d", pa.decimal128(5, 2)),
                ]
            ),
        ),
        [
            {"a": 1, "b": "AA==", "c": "1970-01-01T00:00:00.000000005", "d": "2.50"},
            {"a": None, "b": None, "c": None, "d": None},
            None,
        ],
    ),
    "mp": (
        pa.array([[("k", 1), ("j", None)], [], None], pa.map_(pa.string(), pa.int64())),
        [[["k", 1], ["j", None]], [], None],
    ),
    "mp_ns": (
        pa.array([[(1, 5)], [], None], pa.map_(pa.int32(), pa.duration("ns"))),
        [[[1, "PT0.000000005S"]], [], None],
    ),
    "nul": (pa.array([None, None, None], pa.null()), [None, None, None]),
    "dct": (pa.array(["a", "b", None]).dictionary_encode(), ["a", "b", None]),
}

# NOTE: newer Arrow types (pyarrow 16-19), and the canonical extension types Parquet restores.
_UUID = b"\x12" * 16
_NEWER: dict[str, tuple[Callable[[], pa.Array], list[Any]]] = {
    "sv": (lambda: pa.array(["a", "", None], pa.string_view()), ["a", "", None]),
    "bv": (lambda: pa.array([b"\xff", b"", None], pa.binary_view()), ["/w==", "", None]),
    "d32": (
        lambda: pa.array([Decimal("1.50"), Decimal("-3"), None], pa.decimal32(5, 2)),
        ["1.50", "-3.00", None],
    ),
    "d64": (lambda: pa.array([Decimal("7"), None, None], pa.decimal64(12, 0)), ["7", None, None]),
    "lv_ns": (
        lambda: pa.array([[NS], [], None], pa.list_view(pa.timestamp("ns"))),
        [["2023-11-14T22:13:20.123456789"], [], None],
    ),
    "llv": (lambda: pa.array([[1], [], None], pa.large_list_view(pa.int8())), [[1], [], None]),
    "uuid": (
        lambda: pa.ExtensionArray.from_storage(
            pa.uuid(), pa.array([_UUID, None, _UUID], pa.binary(16))
        ),
        ["12121212-1212-1212-1212-121212121212", None, "12121212-1212-1212-1212-121212121212"],
    ),
    "lst_uuid": (
        lambda: pa.ListArray.from_arrays(
            pa.array([0, 1, 1, 1], pa.int32()),
            pa.ExtensionArray.from_storage(pa.uuid(), pa.array([_UUID], pa.binary(16))),
        ),
        [["12121212-1212-1212-1212-121212121212"], [], []],
    ),
    "bool8": (
        lambda: pa.ExtensionArray.from_storage(pa.bool8(), pa.array([1, 0, None], pa.int8())),
        [True, False, None],
    ),
    "json_ext": (
        lambda: pa.ExtensionArray.from_storage(pa.json_(), pa.array(['{"a": 1}', "[]", None])),
        ['{"a": 1}', "[]", None],
    ),
}
for _name, (_make, _expected) in _NEWER.items():
    with contextlib.suppress(AttributeError, NotImplementedError):
        KEPT[_name] = (_make(), _expected)


# NOTE: Parquet output writes view types as their plain types (docs/formats.md, "Encodings").
VIEWS_AS = {"sv": pa.string(), "bv": pa.binary()}


def _kept_input(tmp_path: Path) -> tuple[Path, pa.Table]:
    """The KEPT columns in a Parquet file, and the table as the Parquet reader gives it back:
    what a kept column can be (Parquet stores date64 as date32, and seconds as milliseconds)."""
    columns = {"id": ["r0", "r1", "r2"], "prompt": ["one", "two", "three"]}
    columns.update({name: array for name, (array, _) in KEPT.items()})
    path = tmp_path / "in.parquet"
    pq.write_table(pa.table(columns), path)
    return path, pq.read_table(path)


@pytest.mark.parametrize("output_name", ["out.jsonl", "out.parquet"])
def test_kept_columns_of_every_arrow_type(
    tmp_path: Path, tiny_model_dir: Path, shared_llm: Callable[..., Any], output_name: str
) -> None:
    input_path, table = _kept_input(tmp_path)
    columns = ColumnOptions(keep_columns=tuple(KEPT))
    output = run(tmp_path, input_path, output_name, tiny_model_dir, shared_llm, columns=columns)
    if output_name.endswith(".jsonl"):
        rows = read_jsonl(output)
        assert [r["error"] for r in rows] == [None] * 3
        for name, (_, expected) in KEPT.items():
            assert [r[name] for r in rows] == expected, name
    else:
        out = pq.read_table(output)
        for name in KEPT:
            expected = table.column(name)
            if name in VIEWS_AS:
                expected = expected.cast(VIEWS_AS[name])
            assert out.schema.field(name).type == expected.type, name
            assert out.column(name).equals(expected), name


def test_keep_all_columns_of_every_arrow_type_to_jsonl(
    tmp_path: Path, tiny_model_dir: Path, shared_llm: Callable[..., Any]
) -> None:
    input_path, _ = _kept_input(tmp_path)
    columns = ColumnOptions(keep_all_columns=True)
    output = run(tmp_path, input_path, "all.jsonl", tiny_model_dir, shared_llm, columns=columns)
    rows = read_jsonl(output)
    assert [r["prompt"] for r in rows] == ["one", "two", "three"]
    for name, (_, expected) in KEPT.items():
        assert [r[name] for r in rows] == expected, name


# --- model identity ---------------------------------------------------------------------------


def _copy_model(tiny_model_dir: Path, tmp_path: Path) -> Path:
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    return model


def _unfinish(output: Path) -> None:
    """Drop every journal record after the first, as if the run had been killed early."""
    journal = job_dir_for(output) / "journal.jsonl"
    journal.write_bytes(journal.read_bytes().splitlines(keepends=True)[0])


@pytest.mark.parametrize(
    ("name", "edit"),
    [
        ("chat_template.jinja", lambda text: text.replace("assistant", "helper")),
        (
            "generation_config.json",
            lambda text: text.replace('"eos_token_id": 2', '"eos_token_id": 1'),
        ),
        ("tokenizer_config.json", lambda text: text.replace("<|im_end|>", "<|endoftext|>", 1)),
    ],
)
def test_resume_refuses_a_changed_tokenizer_template_or_generation_config(
    tmp_path: Path,
    tiny_model_dir: Path,
    shared_llm: Callable[..., Any],
    name: str,
    edit: Callable[[str], str],
) -> None:
    model = _copy_model(tiny_model_dir, tmp_path)
    records = [
        {"id": f"r{i}", "messages": [{"role": "user", "content": f"hi {i}"}]} for i in range(4)
    ]
    input_path = write_jsonl(tmp_path / "in.jsonl", records)
    output = run(tmp_path, input_path, "out.jsonl", model, shared_llm)
    _unfinish(output)
    path = model / name
    before = path.read_text()
    assert edit(before) != before
    path.write_text(edit(before))
    with pytest.raises(
        JobStateError, match=rf"cannot resume: model files changed .*{name}.*--force"
    ):
        resume_job(output, {"display": "quiet"}, llm_factory=shared_llm)
    done = resume_job(output, {"display": "quiet"}, force=True, llm_factory=shared_llm)
    assert done.exit_code == 0
    manifest = json.loads((job_dir_for(output) / "manifest.json").read_text())
    assert name in manifest["model"]["files"]


def test_resume_of_a_job_whose_manifest_predates_model_files(
    tmp_path: Path, tiny_model_dir: Path, shared_llm: Callable[..., Any]
) -> None:
    model = _copy_model(tiny_model_dir, tmp_path)
    input_path = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": "x"}])
    output = run(tmp_path, input_path, "out.jsonl", model, shared_llm)
    _unfinish(output)
    manifest_path = job_dir_for(output) / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    del manifest["model"]["files"]
    del manifest["checksum"]  # NOTE: as an earlier vbatch wrote it.
    manifest["manifest_version"] = 1
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(JobStateError, match=r"did not record the model's tokenizer.*--force"):
        resume_job(output, {"display": "quiet"}, llm_factory=shared_llm)
    assert (
        resume_job(output, {"display": "quiet"}, force=True, llm_factory=shared_llm).exit_code == 0
    )


# --- OpenAI Batch output ----------------------------------------------------------------------

CHAT_ENTRY_KEYS = {"token", "logprob", "bytes", "top_logprobs"}
TOP_ENTRY_KEYS = {"token", "logprob", "bytes"}
COMPLETION_LOGPROB_KEYS = {"tokens", "token_logprobs", "top_logprobs", "text_offset"}


def test_openai_batch_output_shapes(
    tmp_path: Path, tiny_model_dir: Path, shared_llm: Callable[..., Any]
) -> None:
    chat = {
        "custom_id": "c1",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 6,
            "logprobs": True,
            "top_logprobs": 3,
        },
    }
    prompt = "Once upon a time 😀"
    text = {
        "custom_id": "t2",
        "method": "POST",
        "url": "/v1/completions",
        "body": {"prompt": prompt, "max_tokens": 6, "logprobs": 2},
    }
    input_path = write_jsonl(tmp_path / "batch.jsonl", [chat, text])
    with input_path.open("ab") as f:
        f.write(b'{"custom_id": "broken", \n')
    output = run(tmp_path, input_path, "results.jsonl", tiny_model_dir, shared_llm)
    lines = read_jsonl(output)
    assert all(isinstance(line["custom_id"], str) for line in lines)
    assert lines[2]["response"] is None and "invalid JSON" in lines[2]["error"]["message"]

    logprobs = lines[0]["response"]["body"]["choices"][0]["logprobs"]
    assert set(logprobs) == {"content", "refusal"} and logprobs["refusal"] is None
    usage = lines[0]["response"]["body"]["usage"]
    assert len(logprobs["content"]) == usage["completion_tokens"] > 0
    for entry in logprobs["content"]:
        assert set(entry) == CHAT_ENTRY_KEYS and len(entry["top_logprobs"]) == 3
        for item in [entry, *entry["top_logprobs"]]:
            assert set(item) - {"top_logprobs"} == TOP_ENTRY_KEYS
            assert all(isinstance(b, int) and 0 <= b < 256 for b in item["bytes"])
            if "\ufffd" not in item["token"]:
                assert bytes(item["bytes"]).decode() == item["token"]

    choice = lines[1]["response"]["body"]["choices"][0]
    logprobs = choice["logprobs"]
    assert set(logprobs) == COMPLETION_LOGPROB_KEYS
    tokens, offsets = logprobs["tokens"], logprobs["text_offset"]
    assert len(tokens) == len(offsets) == len(logprobs["token_logprobs"]) > 0
    # NOTE: as OpenAI: character offsets into prompt + completion, so the first is len(prompt).
    assert offsets[0] == len(prompt)
    full = prompt + choice["text"]
    for token, offset in zip(tokens, offsets):
        if "\ufffd" not in token:
            assert full[offset : offset + len(token)] == token
    assert offsets == sorted(offsets)


@pytest.mark.parametrize("flag", ["parse_json", "include_token_ids"])
def test_openai_jsonl_output_refuses_flags_it_has_no_field_for(
    tmp_path: Path, tiny_model_dir: Path, flag: str
) -> None:
    """--parse-json on OpenAI Batch lines once wrote them without any `json`, silently."""
    line = {"custom_id": "c1", "method": "POST", "url": "/v1/chat/completions"}
    input_path = tmp_path / "in.jsonl"
    write_jsonl(input_path, [{**line, "body": {"messages": CHAT, "max_tokens": 2}}])
    job = JobSpec(input_path, tmp_path / "out.jsonl", model=str(tiny_model_dir), **{flag: True})
    with pytest.raises(ConfigError, match=f"--{flag.replace('_', '-')}: an OpenAI Batch output"):
        start_job(job, QUIET)
    assert not (tmp_path / "out.jsonl").exists()
    assert not job_dir_for(tmp_path / "out.jsonl").exists()


def test_openai_lines_echo_parts_logit_bias_and_model_names_in_a_job(
    tmp_path: Path, tiny_model_dir: Path, shared_llm: Callable[..., Any], tokenizer: Any
) -> None:
    parts = [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]
    image = {"type": "image_url", "image_url": {"url": "http://x/y.png"}}
    lines = [
        {"custom_id": "echo", "url": "/v1/completions", "body": {"prompt": "Hello", "echo": True}},
        {"custom_id": "plain", "url": "/v1/completions", "body": {"prompt": "Hello"}},
        {
            "custom_id": "bias",
            "url": "/v1/completions",
            "body": {"prompt": "Hello", "logit_bias": {"1000": 100}},
        },
        {"custom_id": "parts", "body": {"messages": [{"role": "user", "content": parts}]}},
        {"custom_id": "joined", "body": {"messages": [{"role": "user", "content": "hi\nthere"}]}},
        {"custom_id": "image", "body": {"messages": [{"role": "user", "content": [image]}]}},
        {"custom_id": "other", "body": {"model": "gpt-4o", "messages": CHAT}},
        {"custom_id": "same", "body": {"model": tiny_model_dir.name, "messages": CHAT}},
    ]
    output = run(
        tmp_path, write_jsonl(tmp_path / "b.jsonl", lines), "o.jsonl", tiny_model_dir, shared_llm
    )
    got = {line["custom_id"]: line for line in read_jsonl(output)}

    def text(custom_id: str) -> str:
        choice = got[custom_id]["response"]["body"]["choices"][0]
        return choice["text"] if "text" in choice else choice["message"]["content"]

    assert text("echo") == "Hello" + text("plain")
    assert text("bias") == tokenizer.decode([1000] * 3)
    assert text("parts") == text("joined") and got["same"]["error"] is None
    assert "the model is text-only" in got["image"]["error"]["message"]
    assert "body.model 'gpt-4o' is not this job's model" in got["other"]["error"]["message"]
