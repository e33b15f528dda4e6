"""`vbatch merge` and per-shard status: shards run with the tiny model, merged, refused, killed."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from helpers import read_jsonl, write_jsonl
from typer.testing import CliRunner

from vbatch.cli import app
from vbatch.job.journal import JOURNAL_NAME
from vbatch.job.manifest import Manifest, ShardRecord
from vbatch.job.paths import JobLock
from vbatch.job.runner import JobSpec, RunOptions, job_dir_for, resume_job, start_job
from vbatch.job.shard import Shard

TIMEOUT_S = 240
NOT_STARTED = "not started; start it with the other shards' settings:"
QUIET = RunOptions(display="quiet", commit_every_rows=4)
SRC_DIR = str(Path(__import__("vbatch").__file__).parents[1])
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC_DIR, os.environ.get("PYTHONPATH", "")])}


def make_input(path: Path, num_rows: int) -> Path:
    rows = [{"id": f"r{i}", "prompt": f"item {i}:"} for i in range(num_rows)]
    return write_jsonl(path, rows)


def spec(
    tmp_path: Path,
    model: Path,
    output: str,
    shard: Shard | None,
    max_tokens: int = 4,
    engine_args: dict[str, Any] | None = None,
    ordered: bool = False,
) -> JobSpec:
    return JobSpec(
        input_path=tmp_path / "in.jsonl",
        output_path=tmp_path / output,
        model=str(model),
        engine_args=engine_args or {"num_threads": 1},
        sampling={"max_tokens": max_tokens, "temperature": 0.0},
        ordered=ordered,
        shard=shard,
    )


def rows_of(path: Path) -> list[dict[str, Any]]:
    return pq.read_table(path).to_pylist() if path.suffix == ".parquet" else read_jsonl(path)


def merge(*args: str) -> Any:
    return CliRunner().invoke(app, ["merge", *args])


def test_rows_without_the_id_key_of_the_others_land_in_one_shard_each(
    tmp_path: Path, tiny_model_dir: Path, shared_llm: Callable[..., Any]
) -> None:
    """Id-less rows beside rows with ids are error rows; the pre-pass, not yet knowing the id
    key, once put them in other shards than the run did: one shard then never completed."""
    rows: list[dict[str, Any]] = [
        {"id": f"r{i}", "prompt": f"item {i}:"} if i % 2 == 0 else {"prompt": f"item {i}:"}
        for i in range(20)
    ]
    # NOTE: a row with only the other id key has none once the job reads ids from `id`.
    for i in range(3, 20, 4):
        rows[i]["custom_id"] = f"c{i}"
    write_jsonl(tmp_path / "in.jsonl", rows)
    output = tmp_path / "out.jsonl"
    counted = 0
    for index in range(2):
        outcome = start_job(
            spec(tmp_path, tiny_model_dir, output.name, Shard(index, 2)),
            QUIET,
            llm_factory=shared_llm,
        )
        assert outcome.exit_code == 0, outcome.message
        shard_output = tmp_path / f"out.shard-{index}-of-2.jsonl"
        assert len(rows_of(shard_output)) == outcome.status["rows"]
        counted += outcome.status["rows"]
    assert counted == 20
    result = merge(str(output), "--ordered")
    assert result.exit_code == 0, result.output
    merged = rows_of(output)
    assert [r["index"] for r in merged] == list(range(20))
    assert [r["error"] is not None for r in merged] == [i % 2 == 1 for i in range(20)]


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_three_shards_merged_equal_an_unsharded_run(
    tmp_path: Path, tiny_model_dir: Path, shared_llm: Callable[..., Any], suffix: str
) -> None:
    make_input(tmp_path / "in.jsonl", 24)
    job = spec(tmp_path, tiny_model_dir, "reference" + suffix, None)
    assert start_job(job, QUIET, llm_factory=shared_llm).exit_code == 0
    reference = rows_of(tmp_path / f"reference{suffix}")
    output = tmp_path / f"out{suffix}"
    # NOTE: shard 0 is sorted already; merge --ordered sorts the other two itself.
    for index in range(3):
        outcome = start_job(
            spec(tmp_path, tiny_model_dir, output.name, Shard(index, 3), ordered=index == 0),
            QUIET,
            llm_factory=shared_llm,
        )
        assert outcome.exit_code == 0, outcome.message
        assert f"vbatch merge {output}" in outcome.message
        shard_output = tmp_path / f"out.shard-{index}-of-3{suffix}"
        manifest = Manifest.load(job_dir_for(shard_output))
        assert manifest.shard == ShardRecord(index=index, count=3, input_rows=24)
        assert len(rows_of(shard_output)) == manifest.num_rows == outcome.status["rows"]
    assert not output.exists()
    status = CliRunner().invoke(app, ["status", str(output)])
    assert status.exit_code == 0 and "3 of 3 complete" in status.output, status.output
    assert f"merge with:  vbatch merge {output}" in status.output
    info = json.loads(CliRunner().invoke(app, ["status", str(output), "--json"]).output)
    assert info["merged"] is False
    assert [(s["shard"], s["state"]) for s in info["shards"]] == [
        (f"{i}/3", "complete") for i in range(3)
    ]
    assert sum(s["done"] for s in info["shards"]) == 24

    result = merge(str(output), "--ordered")
    assert result.exit_code == 0, result.output
    merged = rows_of(output)
    assert [r["id"] for r in merged] == [f"r{i}" for i in range(24)]
    assert [r["index"] for r in merged] == list(range(24))
    assert {r["id"]: r["text"] for r in merged} == {r["id"]: r["text"] for r in reference}
    assert not list(tmp_path.glob(".out*"))
    assert merge(str(output)).exit_code == 1
    result = merge(str(output), "--overwrite", "--remove-shards")
    assert result.exit_code == 0, result.output
    assert sorted(r["id"] for r in rows_of(output)) == sorted(r["id"] for r in merged)
    assert not list(tmp_path.glob("out.shard-*"))


def test_merge_refuses_missing_incomplete_and_mismatched_shards(
    tmp_path: Path, tiny_model_dir: Path, shared_llm: Callable[..., Any]
) -> None:
    make_input(tmp_path / "in.jsonl", 12)
    output = tmp_path / "out.jsonl"
    result = merge(str(output))
    assert result.exit_code == 1 and "there are no shards of" in result.output
    for index in (0, 2):
        job = spec(tmp_path, tiny_model_dir, output.name, Shard(index, 3))
        assert start_job(job, QUIET, llm_factory=shared_llm).exit_code == 0
    result = merge(str(output))
    assert result.exit_code == 1
    missing = tmp_path / "out.shard-1-of-3.jsonl"
    assert f"shard 1/3: {NOT_STARTED} vbatch resume {missing}" in result.output
    assert "shard 0/3" not in result.output and "Traceback" not in result.output

    mismatched = spec(tmp_path, tiny_model_dir, output.name, Shard(1, 3), max_tokens=3)
    assert start_job(mismatched, QUIET, llm_factory=shared_llm).exit_code == 0
    result = merge(str(output))
    assert result.exit_code == 1
    assert "shard 1/3: made with other settings than shard 0/3" in result.output
    assert "sampling.max_tokens: 4 vs 3" in result.output
    assert not output.exists()

    (job_dir_for(tmp_path / "out.shard-2-of-3.jsonl") / JOURNAL_NAME).write_bytes(b"")
    result = merge(str(output))
    assert "shard 2/3: incomplete (0 of" in result.output
    assert "resume it with: vbatch resume " + str(tmp_path / "out.shard-2-of-3.jsonl") in (
        result.output
    )
    assert not output.exists()


def test_a_shard_being_created_or_damaged_is_named_as_such_and_outputs_keep_the_umask(
    tmp_path: Path,
    tiny_model_dir: Path,
    shared_llm: Callable[..., Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    make_input(tmp_path / "in.jsonl", 6)
    output = tmp_path / "out.jsonl"
    old_umask = os.umask(0o022)
    try:
        job = spec(tmp_path, tiny_model_dir, output.name, Shard(0, 2))
        assert start_job(job, QUIET, llm_factory=shared_llm).exit_code == 0
        second = tmp_path / "out.shard-1-of-2.jsonl"
        job_dir_for(second).mkdir()
        lock = JobLock(job_dir_for(second))
        status = CliRunner().invoke(app, ["status", str(output)])
        assert f"1/2  starting    {second}" in status.output, status.output
        result = merge(str(output))
        assert "shard 1/2: a `vbatch run` is still creating its job" in result.output
        lock.release()
        assert (
            f"1/2  no manifest  {second}" in CliRunner().invoke(app, ["status", str(output)]).output
        )
        assert f"shard 1/2: its job directory {job_dir_for(second)} has no manifest" in (
            merge(str(output)).output
        )
        shutil.rmtree(job_dir_for(second))
        second.write_text("")
        assert f"shard 1/2: {second} has no job directory (removed?)" in merge(str(output)).output
        second.unlink()
        job = spec(tmp_path, tiny_model_dir, output.name, Shard(1, 2))
        assert start_job(job, QUIET, llm_factory=shared_llm).exit_code == 0
        assert merge(str(output)).exit_code == 0
        for path in (output, job_dir_for(second) / "manifest.json"):
            assert path.stat().st_mode & 0o777 == 0o644, path
        monkeypatch.chdir(tmp_path)
        info = json.loads(CliRunner().invoke(app, ["status", "out.jsonl", "--json"]).output)
        assert [shard["output"] for shard in info["shards"]] == [
            str(tmp_path / f"out.shard-{i}-of-2.jsonl") for i in range(2)
        ]
    finally:
        os.umask(old_umask)


def test_a_killed_shard_resumes_exactly_once_and_merges(
    tmp_path: Path, tiny_model_dir: Path, shared_llm: Callable[..., Any]
) -> None:
    num_rows = 160
    make_input(tmp_path / "in.jsonl", num_rows)
    slurm = {"SLURM_ARRAY_TASK_ID": "2", "SLURM_ARRAY_TASK_MIN": "1", "SLURM_ARRAY_TASK_COUNT": "2"}
    args = [
        sys.executable, "-m", "vbatch", "run", "in.jsonl", "-o", "out.jsonl",
        "--model", str(tiny_model_dir), "--max-tokens", "4", "--num-threads", "1",
        "--max-num-seqs", "2", "--commit-every-rows", "2", "--shard", "auto", "-q",
    ]  # fmt: skip
    proc = subprocess.Popen(
        args, cwd=tmp_path, env={**ENV, **slurm}, stderr=subprocess.PIPE, text=True
    )
    shard_output = tmp_path / "out.shard-1-of-2.jsonl"
    journal = job_dir_for(shard_output) / JOURNAL_NAME
    deadline = time.monotonic() + TIMEOUT_S
    while proc.poll() is None and (not journal.exists() or journal.read_bytes().count(b"\n") < 3):
        assert time.monotonic() < deadline, "the shard made no progress"
        time.sleep(0.01)
    proc.kill()
    _, stderr = proc.communicate(timeout=TIMEOUT_S)
    assert proc.returncode == -signal.SIGKILL, f"the shard ended before it was killed: {stderr}"

    result = merge(str(tmp_path / "out.jsonl"))
    assert result.exit_code == 1
    assert "shard 1/2: incomplete" in result.output
    assert f"vbatch resume {shard_output}" in result.output
    other = tmp_path / "out.shard-0-of-2.jsonl"
    assert f"shard 0/2: {NOT_STARTED} vbatch resume {other}" in result.output
    # NOTE: resuming a shard that never started starts it like the killed one.
    started = resume_job(other, {"display": "quiet"}, llm_factory=shared_llm)
    assert started.exit_code == 0, started.message
    assert Manifest.load(job_dir_for(other)).engine == {"num_threads": 1, "max_num_seqs": 2}

    resumed = resume_job(shard_output, {"display": "quiet"}, llm_factory=shared_llm)
    assert resumed.exit_code == 0, resumed.message
    manifest = Manifest.load(job_dir_for(shard_output))
    shard_ids = [r["id"] for r in read_jsonl(shard_output)]
    assert len(shard_ids) == len(set(shard_ids)) == manifest.num_rows
    result = merge(str(tmp_path / "out.jsonl"))
    assert result.exit_code == 0, result.output
    merged = [r["id"] for r in read_jsonl(tmp_path / "out.jsonl")]
    assert sorted(merged) == sorted(f"r{i}" for i in range(num_rows))


def test_merge_refuses_an_output_that_is_a_file_it_reads(
    tmp_path: Path, tiny_model_dir: Path, shared_llm: Callable[..., Any]
) -> None:
    data = make_input(tmp_path / "in.jsonl", 4).read_bytes()
    for index in range(2):
        job = spec(tmp_path, tiny_model_dir, "in.jsonl", Shard(index, 2))
        assert start_job(job, QUIET, llm_factory=shared_llm).exit_code == 0
    result = merge(str(tmp_path / "in.jsonl"), "--overwrite")
    assert result.exit_code == 1
    assert "the merged output" in result.output and "is shard 0/2's input file" in result.output
    assert (tmp_path / "in.jsonl").read_bytes() == data


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_a_damaged_shard_file_is_named_with_how_to_run_it_again(
    tmp_path: Path, tiny_model_dir: Path, shared_llm: Callable[..., Any], suffix: str
) -> None:
    """A truncated Parquet shard ("magic bytes not found") or a JSONL one cut mid-line used to
    fail the merge with "unexpected ... this is a bug", naming no file."""
    make_input(tmp_path / "in.jsonl", 8)
    output = tmp_path / f"out{suffix}"
    for index in range(2):
        job = spec(tmp_path, tiny_model_dir, output.name, Shard(index, 2))
        assert start_job(job, QUIET, llm_factory=shared_llm).exit_code == 0
    damaged = tmp_path / f"out.shard-1-of-2{suffix}"
    data = damaged.read_bytes()
    damaged.write_bytes(data[: len(data) - 7])
    result = merge(str(output))
    assert result.exit_code == 1, result.output
    assert f"shard 1/2: {damaged} is damaged" in result.output
    assert f"vbatch resume {damaged}" in result.output
    assert "bug" not in result.output and "Traceback" not in result.output
    assert not output.exists()


def test_shards_may_differ_in_threads_and_cores_as_the_docs_say(
    tmp_path: Path, tiny_model_dir: Path, shared_llm: Callable[..., Any]
) -> None:
    """docs/scaling.md: a shard's CPU spread (--num-threads, -dp) decides speed, not rows. merge
    refused --num-threads 1 against 2 while it took -dp 2 against 1."""
    make_input(tmp_path / "in.jsonl", 8)
    output = tmp_path / "out.jsonl"
    runs = [({"num_threads": 1}, QUIET), ({"num_threads": 2}, replace(QUIET, data_parallel_size=2))]
    for index, (engine_args, options) in enumerate(runs):
        job = spec(tmp_path, tiny_model_dir, output.name, Shard(index, 2), engine_args=engine_args)
        assert start_job(job, options, llm_factory=shared_llm).exit_code == 0
    result = merge(str(output))
    assert result.exit_code == 0, result.output
    assert len(rows_of(output)) == 8


def test_a_merge_removes_what_a_killed_merge_left_and_names_a_full_disk(
    tmp_path: Path,
    tiny_model_dir: Path,
    shared_llm: Callable[..., Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SIGKILL leaves a merge's sort runs and temp file; the next merge (holding every shard's
    lock) removes them. A full disk names the file and the room the merge needs."""
    import errno

    from vbatch.job import merge as merge_module

    make_input(tmp_path / "in.jsonl", 6)
    output = tmp_path / "out.jsonl"
    for index in range(2):
        job = spec(tmp_path, tiny_model_dir, output.name, Shard(index, 2))
        assert start_job(job, QUIET, llm_factory=shared_llm).exit_code == 0
    (tmp_path / ".out.jsonl.abc123.merge").mkdir()
    (tmp_path / ".out.jsonl.abc123.merge" / "run-0").write_bytes(b"x" * 100)
    (tmp_path / ".out.jsonl.def456.merge-tmp").write_bytes(b"y" * 100)
    (tmp_path / ".other.jsonl.abc.merge-tmp").write_bytes(b"not ours")

    def full_disk(tmp: Path, *args: Any, **kwargs: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp))

    with monkeypatch.context() as patch:
        patch.setattr(merge_module, "_write_merged_to", full_disk)
        result = merge(str(output), "--ordered")
    assert result.exit_code == 1, result.output
    assert ".merge-tmp" in result.output and "MiB free in" in result.output, result.output
    leftovers = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("."))
    assert leftovers == [".other.jsonl.abc.merge-tmp"], leftovers
    (tmp_path / ".out.jsonl.abc123.merge").mkdir()
    (tmp_path / ".out.jsonl.def456.merge-tmp").write_bytes(b"y")
    assert merge(str(output)).exit_code == 0
    assert sorted(r["index"] for r in rows_of(output)) == list(range(6))
    leftovers = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("."))
    assert leftovers == [".other.jsonl.abc.merge-tmp"], leftovers


@pytest.mark.parametrize("change", ["adapter files", "lora rows"])
def test_merge_refuses_shards_with_other_adapters_or_adapter_rows(
    change: str, tmp_path: Path, tiny_model_dir: Path, shared_llm: Callable[..., Any]
) -> None:
    """Before, shards whose adapter files were replaced between them, or whose rows picked
    adapters otherwise (--lora-default, --lora-column), merged into one file."""
    import msgspec

    from vbatch.job.manifest import LoraRecord
    from vbatch.job.rows import LoraRows

    make_input(tmp_path / "in.jsonl", 6)
    output = tmp_path / "out.jsonl"
    for index in (0, 1):
        job = spec(tmp_path, tiny_model_dir, output.name, Shard(index, 2))
        assert start_job(job, QUIET, llm_factory=shared_llm).exit_code == 0
    job_dir = job_dir_for(tmp_path / "out.shard-1-of-2.jsonl")
    manifest = Manifest.load(job_dir)
    if change == "adapter files":
        lora = LoraRecord(name="a0", path="/adapters/a0", files={"adapter.safetensors": "f2"})
        model = msgspec.structs.replace(manifest.model, loras=[lora])
        msgspec.structs.replace(manifest, model=model).save(job_dir)
        named = "model.loras"
    else:
        rows = LoraRows(("a0",), default="a0")
        msgspec.structs.replace(manifest, lora_rows=rows).save(job_dir)
        named = "lora_rows"
    result = merge(str(output))
    assert result.exit_code == 1
    assert "shard 1/2: made with other settings than shard 0/2" in result.output
    assert named in result.output
    assert not output.exists()
