"""Tests for -dp N: pinned cores, one job layer over them, a dead core, resume after it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import orjson
import psutil
import pytest
from helpers import read_jsonl, wait_gone, write_jsonl
from typer.testing import CliRunner

from vbatch.cli import app
from vbatch.engine_sets.base import EngineState
from vbatch.errors import ConfigError
from vbatch.llm import LLM
from vbatch.sampling_params import SamplingParams

TIMEOUT_S = 240
NUM_ROWS = 300
# NOTE: the tiny random model's greedy tokens do not depend on the batch at these settings
# (as in test_chaos), so runs with different batches must agree.
FLAGS = ["--max-tokens", "12", "--max-num-seqs", "4", "--commit-every-rows", "8", "-q"]


@pytest.fixture(scope="module")
def dp_llm(tiny_model_dir: Path) -> Iterator[LLM]:
    llm = LLM(str(tiny_model_dir), data_parallel_size=2, max_num_seqs=4, device="cpu")
    yield llm
    llm.shutdown()


def test_each_core_is_pinned_to_its_own_cpus(dp_llm: LLM) -> None:
    allowed = os.sched_getaffinity(0)
    if len(allowed) < 2:
        pytest.skip("needs 2 CPUs")
    pids = dp_llm._client.pids  # type: ignore[union-attr]
    sets = [os.sched_getaffinity(pid) for pid in pids]
    assert len(set(pids)) == 2 and not sets[0] & sets[1]
    assert sets[0] | sets[1] == allowed
    if len(allowed) == 2:
        assert sets == [{min(allowed)}, {max(allowed)}]


def test_requests_spread_over_the_cores_and_come_back_once(dp_llm: LLM) -> None:
    prompts = [f"item {i}:" for i in range(24)]
    params = SamplingParams(max_tokens=6, ignore_eos=True, stop=["\x00never"])
    outputs = dp_llm.generate(prompts, params)
    assert [o.prompt for o in outputs] == prompts
    assert all(len(o.outputs[0].token_ids) == 6 for o in outputs)
    stats = dp_llm.get_stats()
    reports = dp_llm.engine_reports()
    assert [r.name for r in reports] == ["core 0", "core 1"]
    assert all(r.state is EngineState.LIVE and r.num_in_flight == 0 for r in reports)
    # NOTE: both cores generated (placement by load), and the sum is every token once.
    per_core = [dp_llm._client._clients[i].get_stats() for i in range(2)]  # type: ignore[union-attr]
    assert all(s.num_generation_tokens > 0 for s in per_core)
    assert stats.num_generation_tokens == sum(s.num_generation_tokens for s in per_core)


def test_a_stop_string_aborts_the_request_on_its_own_core(dp_llm: LLM) -> None:
    prompts = [f"item {i}:" for i in range(8)]
    before = dp_llm.get_stats().num_generation_tokens
    # NOTE: random tokens soon spell one of these; the request then ends on the client.
    params = SamplingParams(max_tokens=40, ignore_eos=True, stop=[" ", "e", "a", "t"])
    results = dp_llm.generate(prompts, params)
    assert sum(o.outputs[0].finish_reason == "stop" for o in results) >= len(prompts) // 2
    deadline = time.monotonic() + 30
    while any(r.num_in_flight for r in dp_llm.engine_reports()):
        assert time.monotonic() < deadline, "aborted requests never left their core"
        dp_llm._client.get_outputs(timeout=0.2)  # type: ignore[union-attr]
    # NOTE: an abort sent to the wrong core is ignored there, and with ignore_eos the request
    # would run on to all 40 tokens.
    generated = dp_llm.get_stats().num_generation_tokens - before
    assert generated < len(prompts) * 40 // 2


def test_a_core_count_that_cannot_be_placed_is_refused_before_the_job_starts(
    tmp_path: Path,
) -> None:
    write_jsonl(tmp_path / "in.jsonl", [{"prompt": "hi"}])
    args = ["run", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl")]
    result = CliRunner().invoke(app, [*args, "--device", "cpu", "--num-threads", "1", "-dp", "2"])
    assert result.exit_code == 1
    assert result.output.startswith("error: --num-threads 1 cannot be split between 2")
    assert "give --num-threads 2 or more, or -dp 1 or fewer" in result.output
    assert "Traceback" not in result.output
    assert not (tmp_path / "out.jsonl.vbatch").exists()


@pytest.mark.parametrize("size", [0, 1.5, True])
def test_a_bad_data_parallel_size_is_a_config_error(size: object) -> None:
    with pytest.raises(ConfigError, match="data_parallel_size must be"):
        LLM(None, data_parallel_size=size)  # type: ignore[arg-type]


def vbatch(cwd: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "vbatch", *args],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(proc: subprocess.Popen[str]) -> tuple[int, str]:
    _, stderr = proc.communicate(timeout=TIMEOUT_S)
    return proc.returncode, stderr


def texts(path: Path) -> dict[str, str]:
    rows = read_jsonl(path)
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)), "an id appears twice"
    assert all(r["error"] is None for r in rows)
    return {r["id"]: r["text"] for r in rows}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    path = tmp_path_factory.mktemp("dp")
    write_jsonl(
        path / "in.jsonl", [{"id": f"r{i}", "prompt": f"item {i}:"} for i in range(NUM_ROWS)]
    )
    return path


@pytest.fixture(scope="module")
def reference(workdir: Path, tiny_model_dir: Path) -> dict[str, str]:
    args = ["run", "in.jsonl", "-o", "dp1.jsonl", "--model", str(tiny_model_dir), *FLAGS]
    code, stderr = finish(vbatch(workdir, *args, "--num-threads", "1", "-dp", "1"))
    assert code == 0, stderr
    return texts(workdir / "dp1.jsonl")


def num_commits(journal: Path) -> int:
    try:
        return journal.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def core_pids(proc: subprocess.Popen[str]) -> list[int]:
    children = psutil.Process(proc.pid).children()
    return [c.pid for c in children if "spawn_main" in " ".join(c.cmdline())]


def test_two_cores_match_one_and_a_killed_core_fails_cleanly_then_resume_finishes_once(
    workdir: Path, tiny_model_dir: Path, reference: dict[str, str]
) -> None:
    """One -dp 2 job, a core SIGKILLed mid-way, resumed: every id once, the -dp 1 texts."""
    journal = workdir / "killed.jsonl.vbatch" / "journal.jsonl"
    args = ["run", "in.jsonl", "-o", "killed.jsonl", "--model", str(tiny_model_dir), *FLAGS]
    proc = vbatch(workdir, *args, "-dp", "2")
    deadline = time.monotonic() + TIMEOUT_S
    # NOTE: a commit every 8 rows; the journal is polled far more often than rows finish.
    while proc.poll() is None and num_commits(journal) < 2:
        assert time.monotonic() < deadline, "the job made no progress"
        time.sleep(0.01)
    pids = core_pids(proc)
    assert len(pids) == 2, f"the job ended before a core was killed: {proc.communicate()[1]}"
    os.kill(pids[1], signal.SIGKILL)
    code, stderr = finish(proc)
    assert code not in (0, -signal.SIGKILL), stderr
    assert "Traceback" not in stderr
    last = stderr.strip().splitlines()[-2:]
    assert last[0].startswith("error: data-parallel core") and "SIGKILL" in last[0], stderr
    assert last[1].endswith("Resume with: vbatch resume killed.jsonl"), stderr
    assert wait_gone(pids[0], 10), "the other core was left running"
    num_done = len(read_jsonl(workdir / "killed.jsonl"))
    assert 8 <= num_done < NUM_ROWS
    resumed = workdir / "resumed.json"
    code, stderr = finish(vbatch(workdir, "resume", "killed.jsonl", "--metrics-file", str(resumed)))
    assert code == 0, stderr
    assert len(reference) == NUM_ROWS
    assert texts(workdir / "killed.jsonl") == reference
    # NOTE: the resume ran on two cores again: the job stored -dp 2.
    assert [e["name"] for e in orjson.loads(resumed.read_bytes())["engines"]] == [
        "core 0",
        "core 1",
    ]


def test_a_job_interrupted_while_a_core_is_stuck_starting_stops_that_core_and_exits(
    workdir: Path, tiny_model_dir: Path
) -> None:
    """SIGTERM while one of two cores hangs before READY (here SIGSTOPped, as a core stuck in a
    driver call): the job once printed its resume command and then waited for that core's
    start-up limit (600 s), deaf to a second signal; the stuck core is now stopped with it, at
    the first signal."""
    args = ["run", "in.jsonl", "-o", "stuck.jsonl", "--model", str(tiny_model_dir), *FLAGS]
    proc = vbatch(workdir, *args, "-dp", "2", "--num-threads", "2")
    stuck = None
    try:
        deadline = time.monotonic() + 60
        while stuck is None and time.monotonic() < deadline:
            stuck = next(iter(core_pids(proc)), None)
            time.sleep(0.02)
        assert stuck is not None, "no core was spawned"
        os.kill(stuck, signal.SIGSTOP)
        time.sleep(2.0)
        proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        code, stderr = finish(proc)
        assert code == 75, stderr
        # NOTE: not the drain's 30 s: no row runs yet, so the first signal stops the start-up.
        assert time.monotonic() - sent < 25.0
        assert "Resume with" in stderr
        assert wait_gone(stuck, 10.0)
    finally:
        if stuck is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(stuck, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
