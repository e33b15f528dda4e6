"""Chaos tests: real `vbatch` processes killed at random moments, then resumed to completion."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import psutil
import pyarrow.parquet as pq
import pytest

NUM_ROWS = 200
ENGINE_FLAGS = ["--max-tokens", "12", "--max-num-seqs", "4", "--num-threads", "1"]
JOB_FLAGS = ["--commit-every-rows", "8", "--drain-timeout", "20", "-q"]
TIMEOUT_S = 240


def make_input(path: Path) -> Path:
    lines = []
    for i in range(NUM_ROWS):
        row: dict[str, Any] = {"id": f"r{i}"}
        if i % 4 == 0:
            row["messages"] = [{"role": "user", "content": f"tell me about {i}"}]
        else:
            row["prompt"] = f"item {i}:"
        if i % 10 == 0:
            row["sampling_params"] = {"temperature": 0.9, "seed": i}
        lines.append(orjson.dumps(row))
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def vbatch(*args: str) -> list[str]:
    return [sys.executable, "-m", "vbatch", *args]


def start(args: list[str], cwd: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        vbatch(*args), cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


@contextlib.contextmanager
def in_own_group(
    args: list[str], cwd: Path, sighup: Any = signal.SIG_DFL, stderr: Any = subprocess.PIPE
) -> Iterator[subprocess.Popen[str]]:
    """A job in a process group of its own (as a terminal or a scheduler signals it), SIGHUP at
    `sighup` (its default, as in a terminal, whatever CI runs under); the group killed after."""
    proc = subprocess.Popen(
        vbatch(*args),
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGHUP, sighup),
    )
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def run_args(model: Path, output: str) -> list[str]:
    return ["run", "in.jsonl", "-o", output, "--model", str(model), *ENGINE_FLAGS, *JOB_FLAGS]


def num_records(job_dir: Path) -> int:
    try:
        return (job_dir / "journal.jsonl").read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def wait_for_records(proc: subprocess.Popen[str], job_dir: Path, count: int) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while num_records(job_dir) < count and proc.poll() is None:
        assert time.monotonic() < deadline, "the job made no progress"
        time.sleep(0.02)


def finish(proc: subprocess.Popen[str]) -> tuple[int, str]:
    _, stderr = proc.communicate(timeout=TIMEOUT_S)
    return proc.returncode, stderr


def texts(path: Path) -> dict[str, str]:
    if path.suffix == ".parquet":
        rows = pq.read_table(path).to_pylist()
    else:
        rows = [orjson.loads(line) for line in path.read_bytes().splitlines()]
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)), "an id appears twice"
    assert all(r["error"] is None for r in rows)
    return {r["id"]: r["text"] for r in rows}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("chaos")
    make_input(path / "in.jsonl")
    return path


@pytest.fixture(scope="module")
def reference(workdir: Path, tiny_model_dir: Path) -> dict[str, str]:
    proc = start(run_args(tiny_model_dir, "reference.jsonl"), workdir)
    code, stderr = finish(proc)
    assert code == 0, stderr
    result = texts(workdir / "reference.jsonl")
    assert len(result) == NUM_ROWS
    return result


def resume_to_completion(workdir: Path, output: str) -> None:
    code, stderr = finish(start(["resume", output, "-q"], workdir))
    assert code == 0, stderr


def test_sigkill_three_times_with_torn_tails(
    workdir: Path, tiny_model_dir: Path, reference: dict[str, str]
) -> None:
    rng = random.Random(1234)
    output = "killed.parquet"
    job_dir = workdir / f"{output}.vbatch"
    args = run_args(tiny_model_dir, output)
    for attempt in range(3):
        proc = start(args, workdir)
        target = num_records(job_dir) + rng.randint(1, 6)
        wait_for_records(proc, job_dir, target)
        time.sleep(rng.uniform(0.0, 0.3))
        proc.kill()
        code, stderr = finish(proc)
        assert code == -signal.SIGKILL, f"the job ended before it was killed: {stderr}"
        # NOTE: what a crash mid-write leaves behind: an orphan part and a torn journal record.
        (job_dir / "parts" / f"part-{999 - attempt:06d}.parquet").write_bytes(b"PAR1 torn")
        with (job_dir / "journal.jsonl").open("ab") as f:
            f.write(b'1a2b3c4d {"kind":"commit","seq":')
        args = ["resume", output, "-q"]
    resume_to_completion(workdir, output)
    assert texts(workdir / output) == reference
    assert not (job_dir / "parts").exists()


def test_sigterm_drains_and_exits_75_then_resume(
    workdir: Path, tiny_model_dir: Path, reference: dict[str, str]
) -> None:
    output = "termed.jsonl"
    job_dir = workdir / f"{output}.vbatch"
    proc = start(run_args(tiny_model_dir, output), workdir)
    wait_for_records(proc, job_dir, 3)
    proc.send_signal(signal.SIGTERM)
    code, stderr = finish(proc)
    assert code == 75, stderr
    assert f"vbatch resume {output}" in stderr and "summary" not in stderr
    status = subprocess.run(vbatch("status", output, "--json"), cwd=workdir, capture_output=True)
    assert orjson.loads(status.stdout)["remaining"] > 0
    with (workdir / output).open("ab") as f:
        f.write(b'{"id": "r0", "text": "torn')
    resume_to_completion(workdir, output)
    assert texts(workdir / output) == reference


def test_sigterm_to_the_whole_process_group_drains_and_exits_75(
    workdir: Path, tiny_model_dir: Path, reference: dict[str, str]
) -> None:
    # NOTE: what `timeout`, systemd, Slurm and Kubernetes do: signal every process of the group,
    # the engine core included, which must leave the drain to its parent.
    output = "groupterm.jsonl"
    job_dir = workdir / f"{output}.vbatch"
    with in_own_group(run_args(tiny_model_dir, output), workdir) as proc:
        wait_for_records(proc, job_dir, 3)
        core = engine_core(proc)
        os.killpg(proc.pid, signal.SIGTERM)
        code, stderr = finish(proc)
    assert code == 75, stderr
    assert "engine core" not in stderr and "Traceback" not in stderr
    assert f"vbatch resume {output}" in stderr
    assert not core.is_running() or core.status() == psutil.STATUS_ZOMBIE
    status = subprocess.run(vbatch("status", output, "--json"), cwd=workdir, capture_output=True)
    info = orjson.loads(status.stdout)
    assert info["done"] >= 3 and info["remaining"] > 0
    resume_to_completion(workdir, output)
    assert texts(workdir / output) == reference


def test_a_hangup_with_the_terminal_gone_drains_and_exits_75(
    workdir: Path, tiny_model_dir: Path, reference: dict[str, str]
) -> None:
    """The terminal closed (SIGHUP to the group, stderr unwritable): the job drains and commits
    as under SIGTERM; before, SIGHUP killed it and every row since the last commit was lost."""
    output = "hungup.jsonl"
    job_dir = workdir / f"{output}.vbatch"
    read_end, write_end = os.pipe()
    with in_own_group(run_args(tiny_model_dir, output), workdir, stderr=write_end) as proc:
        os.close(write_end)
        wait_for_records(proc, job_dir, 2)
        os.close(read_end)
        os.killpg(proc.pid, signal.SIGHUP)
        code, _ = finish(proc)
    assert code == 75
    status = subprocess.run(vbatch("status", output, "--json"), cwd=workdir, capture_output=True)
    info = orjson.loads(status.stdout)
    assert info["done"] > 0 and info["remaining"] > 0
    resume_to_completion(workdir, output)
    assert texts(workdir / output) == reference


def test_a_hangup_under_nohup_is_ignored(workdir: Path, tiny_model_dir: Path) -> None:
    output = "nohup.jsonl"
    job_dir = workdir / f"{output}.vbatch"
    args = run_args(tiny_model_dir, output)
    with in_own_group(args, workdir, sighup=signal.SIG_IGN) as proc:
        wait_for_records(proc, job_dir, 2)
        os.killpg(proc.pid, signal.SIGHUP)
        code, stderr = finish(proc)
    assert code == 0, stderr
    assert len(texts(workdir / output)) == NUM_ROWS


def test_double_sigint_exits_at_once(
    workdir: Path, tiny_model_dir: Path, reference: dict[str, str]
) -> None:
    output = "interrupted.jsonl"
    job_dir = workdir / f"{output}.vbatch"
    proc = start([*run_args(tiny_model_dir, output), "--drain-timeout", "600"], workdir)
    wait_for_records(proc, job_dir, 2)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    code, stderr = finish(proc)
    assert code == 75, stderr
    assert f"vbatch resume {output}" in stderr
    resume_to_completion(workdir, output)
    assert texts(workdir / output) == reference


def engine_core(proc: subprocess.Popen[str]) -> psutil.Process:
    for child in psutil.Process(proc.pid).children(recursive=True):
        cmdline = " ".join(child.cmdline())
        if "multiprocessing" in cmdline and "resource_tracker" not in cmdline:
            return child
    raise AssertionError("no engine-core process found")


def test_engine_core_death_commits_and_points_to_resume(
    workdir: Path, tiny_model_dir: Path, reference: dict[str, str]
) -> None:
    output = "coredeath.jsonl"
    job_dir = workdir / f"{output}.vbatch"
    proc = start(run_args(tiny_model_dir, output), workdir)
    wait_for_records(proc, job_dir, 3)
    engine_core(proc).kill()
    code, stderr = finish(proc)
    assert code == 1, stderr
    assert "engine core" in stderr and f"vbatch resume {output}" in stderr
    assert "Traceback" not in stderr
    resume_to_completion(workdir, output)
    assert texts(workdir / output) == reference


def test_a_stopped_engine_core_is_killed_as_hung_then_resume(
    workdir: Path, tiny_model_dir: Path, reference: dict[str, str]
) -> None:
    output = "hung.jsonl"
    job_dir = workdir / f"{output}.vbatch"
    proc = start([*run_args(tiny_model_dir, output), "--heartbeat-timeout", "5"], workdir)
    wait_for_records(proc, job_dir, 3)
    core = engine_core(proc)
    core.suspend()
    stopped_at = time.monotonic()
    try:
        code, stderr = finish(proc)
    finally:
        with contextlib.suppress(psutil.NoSuchProcess):
            core.kill()
    assert time.monotonic() - stopped_at < 60
    assert code == 1, stderr
    assert "sent no heartbeat" in stderr and f"vbatch resume {output}" in stderr
    assert "Traceback" not in stderr
    resume_to_completion(workdir, output)
    assert texts(workdir / output) == reference
