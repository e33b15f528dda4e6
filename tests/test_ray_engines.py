"""--ray: jobs over Ray replicas on a real local Ray cluster; a killed replica, a killed driver."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
import psutil
import pyarrow.parquet as pq
import pytest
import ray
from helpers import write_jsonl
from typer.testing import CliRunner

from vbatch.cli import app
from vbatch.engine_sets.base import EngineState, RaySettings
from vbatch.engine_sets.ray import REPLICA_NAME_PREFIX, RayEngines
from vbatch.errors import ConfigError, EngineDeadError
from vbatch.job.journal import JOURNAL_NAME, read_journal
from vbatch.job.options import RunOptions
from vbatch.job.runner import JobSpec, job_dir_for, start_job
from vbatch.llm import LLM
from vbatch.sampling_params import SamplingParams

NUM_ROWS = 200
SAMPLING = {"max_tokens": 12, "temperature": 0.0}
ENGINE_ARGS = {"max_num_seqs": 8}
TIMEOUT_S = 300


@pytest.fixture(scope="module")
def ray_address() -> Iterator[str]:
    """A local Ray cluster for this module (2 CPUs: one per replica)."""
    # NOTE: a new cluster, whatever cluster `ray start` left running on this machine.
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


def make_rows() -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for i in range(NUM_ROWS):
        row: dict[str, Any] = {"id": f"r{i}", "prompt": f"item {i} is"}
        if i % 10 == 0:
            row["sampling_params"] = {"temperature": 0.9, "seed": i}
        rows.append(row)
    return rows


def texts(path: Path) -> dict[str, str]:
    if path.suffix == ".parquet":
        rows = pq.read_table(path).to_pylist()
    else:
        rows = [orjson.loads(line) for line in path.read_bytes().splitlines()]
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)), "an id appears twice"
    assert all(r["error"] is None for r in rows), rows
    return {r["id"]: r["text"] for r in rows}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> dict[str, str]:
    """The rows' texts from one engine, no Ray."""
    path = tmp_path_factory.mktemp("ray-reference")
    spec = JobSpec(
        write_jsonl(path / "in.jsonl", make_rows()),
        path / "out.jsonl",
        model=str(tiny_model_dir),
        engine_args={**ENGINE_ARGS, "num_threads": 1},
        sampling=SAMPLING,
    )
    assert start_job(spec, RunOptions(display="quiet")).exit_code == 0
    result = texts(path / "out.jsonl")
    assert len(result) == NUM_ROWS
    return result


def kill_replica_when_committed(job_dir: Path, no_restart: bool) -> Callable[[], str | None]:
    """Kill one replica of the running job once it has committed some rows; the returned call
    (made once the job ended) gives the killed actor's name, None if the job ended first."""
    killed: list[str] = []
    is_over = threading.Event()

    def watch() -> None:
        while not is_over.wait(0.05):
            try:
                num_done = len(read_journal(job_dir / JOURNAL_NAME)[0].committed)
            except FileNotFoundError:
                num_done = 0
            if num_done >= NUM_ROWS:
                return
            names = sorted(n for n in ray.util.list_named_actors() if REPLICA_NAME_PREFIX in n)
            if num_done > 0 and names:
                ray.kill(ray.get_actor(names[0]), no_restart=no_restart)
                killed.append(names[0])
                return

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()

    def join() -> str | None:
        is_over.set()
        thread.join(TIMEOUT_S)
        return killed[0] if killed else None

    return join


def test_two_replicas_equal_one_engine_and_a_killed_one_loses_nothing(
    tmp_path: Path, tiny_model_dir: Path, ray_address: str, reference: dict[str, str]
) -> None:
    """The default suite's Ray test: a job over 2 replicas whose first replica is killed (no
    restart) after the first commit; its rows go to the other, every id once, same texts."""
    output = tmp_path / "out.parquet"
    spec = JobSpec(
        write_jsonl(tmp_path / "in.jsonl", make_rows()),
        output,
        model=str(tiny_model_dir),
        engine_args=ENGINE_ARGS,
        sampling=SAMPLING,
    )
    ray_settings = RaySettings(address=ray_address, replicas=2, max_restarts=0)
    options = RunOptions(display="quiet", commit_every_rows=4, ray=ray_settings)
    join = kill_replica_when_committed(job_dir_for(output), no_restart=True)
    outcome = start_job(spec, options)
    assert join() is not None, "the job ended before a replica was killed"
    assert outcome.exit_code == 0, outcome.message
    assert outcome.status["options"]["ray"]["replicas"] == 2
    assert texts(output) == reference


def test_ray_without_the_extra_is_one_line(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_jsonl(tmp_path / "in.jsonl", [{"prompt": "hi"}])
    monkeypatch.setitem(sys.modules, "ray", None)
    output = tmp_path / "out.jsonl"
    args = ["run", str(tmp_path / "in.jsonl"), "-o", str(output), "--model", str(tiny_model_dir)]
    result = CliRunner().invoke(app, [*args, "--ray", "--replicas", "2"])
    assert result.exit_code == 1
    assert result.output.strip() == (
        "error: --ray needs Ray, which is not installed: pip install 'vbatch[ray]'"
    )
    assert not job_dir_for(output).exists()


def test_resume_restores_ray_settings_and_takes_a_new_address() -> None:
    saved = RunOptions(max_in_flight=7, ray=RaySettings("a:1", 3)).result_settings()
    options = RunOptions.restore(saved, {"ray_address": "b:2"})
    assert options.ray == RaySettings("b:2", 3)
    assert options.max_in_flight == 7
    assert RunOptions.restore({"ray": None}, {}).ray is None
    with pytest.raises(ConfigError, match="started with --ray"):
        RunOptions.restore({"ray": None}, {"ray_address": "b:2"})
    with pytest.raises(ConfigError, match="--replicas"):
        RaySettings(replicas=0)


@pytest.mark.slow
def test_killed_replicas_restart_and_finish_the_rows_then_none_left_fails_cleanly(
    tiny_model_dir: Path, ray_address: str
) -> None:
    """Both replicas killed mid-stream (Ray may restart each once): the stream waits for the
    restarts and their rows run again, every row once; killed for good, the next stream fails."""
    prompts = [f"item {i} is" for i in range(NUM_ROWS)]
    params = SamplingParams(max_tokens=12, temperature=0.0)
    with LLM(str(tiny_model_dir), num_threads=1, **ENGINE_ARGS) as llm:
        expected = [out.outputs[0].text for out in llm.generate(prompts, params)]
    settings = RaySettings(address=ray_address, replicas=2, max_restarts=1)
    engines = RayEngines(str(tiny_model_dir), settings, **ENGINE_ARGS)
    try:
        got: dict[int, str] = {}
        states = set()
        # NOTE: idle ticks (None) while no row finishes, so the restart is seen as it happens.
        for out in engines.stream(prompts, params, idle_s=0.2):
            states.update(report.state for report in engines.engine_reports())
            if out is None:
                continue
            assert out.index not in got
            got[out.index] = out.outputs[0].text
            if len(got) == 3:
                for rep in engines._replicas:
                    ray.kill(rep.handle, no_restart=False)
        assert [got[i] for i in range(NUM_ROWS)] == expected
        assert EngineState.RESTARTING in states
        # NOTE: the stream ends as soon as its rows are done, maybe before the later restart.
        now = {r.state for r in engines.engine_reports()}
        assert EngineState.LIVE in now and EngineState.DEAD not in now, engines._last_error
        for rep in engines._replicas:
            ray.kill(rep.handle)
        with pytest.raises(EngineDeadError, match="every Ray replica died"):
            list(engines.stream(prompts, params))
        assert [r.state for r in engines.engine_reports()] == [EngineState.DEAD] * 2
    finally:
        engines.shutdown()


def replica_engine_cores() -> list[psutil.Process]:
    """The engine-core processes of this machine's replica actors (Ray titles them)."""
    cores = []
    for proc in psutil.process_iter(["cmdline"]):
        if any("ray::ReplicaEngine" in part for part in proc.info["cmdline"] or ()):
            for child in proc.children():
                with contextlib.suppress(psutil.Error):
                    if any("spawn_main" in part for part in child.cmdline()):
                        cores.append(child)
    return cores


@pytest.mark.slow
def test_a_replica_whose_engine_core_dies_is_restarted_and_its_rows_run_again(
    tiny_model_dir: Path, ray_address: str
) -> None:
    prompts = [f"item {i} is" for i in range(NUM_ROWS)]
    params = SamplingParams(max_tokens=12, temperature=0.0)
    with LLM(str(tiny_model_dir), num_threads=1, **ENGINE_ARGS) as llm:
        expected = [out.outputs[0].text for out in llm.generate(prompts, params)]
    settings = RaySettings(address=ray_address, replicas=2, max_restarts=1)
    engines = RayEngines(str(tiny_model_dir), settings, **ENGINE_ARGS)
    try:
        cores = replica_engine_cores()
        assert len(cores) == 2, cores
        got: dict[int, str] = {}
        states = set()
        for out in engines.stream(prompts, params, idle_s=0.2):
            states.update(report.state for report in engines.engine_reports())
            if out is None:
                continue
            assert out.index not in got
            got[out.index] = out.outputs[0].text
            if len(got) == 3:
                cores[0].kill()
        assert [got[i] for i in range(NUM_ROWS)] == expected
        assert EngineState.RESTARTING in states, engines._last_error
        assert "engine core" in engines._last_error
    finally:
        engines.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("signum", "exit_code"), [(signal.SIGKILL, -signal.SIGKILL), (signal.SIGTERM, 75)]
)
def test_driver_killed_or_stopped_mid_job_then_resume_with_ray_is_exactly_once(
    tmp_path: Path,
    tiny_model_dir: Path,
    ray_address: str,
    reference: dict[str, str],
    signum: int,
    exit_code: int,
) -> None:
    """SIGKILL: Ray ends the driver's replicas, resume starts new ones. SIGTERM: the job drains
    and exits 75 (Ray's own SIGTERM handler must not take over)."""
    write_jsonl(tmp_path / "in.jsonl", make_rows())
    env = {**os.environ, "RAY_ADDRESS": ""}
    args = [
        sys.executable, "-m", "vbatch", "run", "in.jsonl", "-o", "out.parquet",
        "--model", str(tiny_model_dir), "--max-tokens", "12", "--max-num-seqs", "8",
        "--commit-every-rows", "4", "-q",
        "--ray", "--ray-address", ray_address, "--replicas", "2", "--cpus-per-replica", "1",
    ]  # fmt: skip
    proc = subprocess.Popen(args, cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True)
    job_dir = tmp_path / "out.parquet.vbatch"
    deadline = time.monotonic() + TIMEOUT_S
    while proc.poll() is None:
        assert time.monotonic() < deadline, "the job made no progress"
        if (job_dir / JOURNAL_NAME).exists() and read_journal(job_dir / JOURNAL_NAME)[0].committed:
            break
        time.sleep(0.02)
    proc.send_signal(signum)
    _, stderr = proc.communicate(timeout=TIMEOUT_S)
    assert proc.returncode == exit_code, f"the job did not end by the signal: {stderr}"
    resume = [sys.executable, "-m", "vbatch", "resume", "out.parquet", "-q"]
    done = subprocess.run(
        [*resume, "--ray-address", ray_address],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert done.returncode == 0, done.stderr
    assert texts(tmp_path / "out.parquet") == reference


@pytest.mark.slow
def test_the_look_ahead_is_one_engines_and_the_kv_cache_is_summed(
    tiny_model_dir: Path, ray_address: str
) -> None:
    """All of a job's rows went out up front, so a drain outlasted --drain-timeout; later each
    replica still took a tokenize batch past its share of max_in_flight, which a drain then
    finished too; the set reported the first replica's KV."""
    settings = RaySettings(address=ray_address, replicas=2, max_restarts=0)
    engines = RayEngines(str(tiny_model_dir), settings, max_in_flight=4, **ENGINE_ARGS)
    try:
        infos = [rep.info for rep in engines._replicas]
        assert all(info is not None for info in infos)
        assert engines.engine_info.num_kv_blocks == sum(i.num_kv_blocks for i in infos)  # type: ignore[union-attr]
        assert engines.engine_info.kv_cache_bytes == sum(i.kv_cache_bytes for i in infos)  # type: ignore[union-attr]
        params = SamplingParams(max_tokens=8, temperature=0.0)
        prompts = [f"item {i} is" for i in range(NUM_ROWS)]
        most = num_done = 0
        for out in engines.stream(prompts, params, idle_s=0.05):
            most = max(most, sum(len(rep.in_flight) for rep in engines._replicas))
            num_done += out is not None
        assert num_done == NUM_ROWS
        assert most <= 4, most
    finally:
        engines.shutdown()


@pytest.mark.slow
def test_a_busy_foreign_cluster_is_named_with_its_free_resources(
    tmp_path: Path, tiny_model_dir: Path, ray_address: str
) -> None:
    """Another cluster whose CPUs are all held: the job joined it silently and waited at
    "starting Ray replicas (0 of 1 live)"; the check compared against total, not free, CPUs."""

    @ray.remote(num_cpus=2)
    class Holder:
        def ping(self) -> bool:
            return True

    holder = Holder.remote()  # type: ignore[attr-defined]
    ray.get(holder.ping.remote())
    write_jsonl(tmp_path / "in.jsonl", make_rows()[:20])
    args = [
        sys.executable, "-m", "vbatch", "run", "in.jsonl", "-o", "out.jsonl",
        "--model", str(tiny_model_dir), "--max-tokens", "4", "--log-interval", "1",
        "--ray", "--ray-address", ray_address, "--replicas", "1",
    ]  # fmt: skip
    env = {**os.environ, "RAY_ADDRESS": ""}
    proc = subprocess.Popen(args, cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    seen: list[str] = []
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while not any("replicas are pending" in line for line in seen):
            assert time.monotonic() < deadline and proc.poll() is None, seen
            seen.append(proc.stderr.readline())
    finally:
        ray.kill(holder)
    _, rest = proc.communicate(timeout=TIMEOUT_S)
    text = "".join(seen) + rest
    assert proc.returncode == 0, text
    assert f"the Ray cluster at {ray_address} (not started by vbatch)" in text
    assert "0 of 1 replicas fit in the free resources now (0 of 2 CPUs free" in text
    assert "1 of 1 replicas are pending, waiting for CPUs or GPUs (0 of 2 CPUs free" in text
