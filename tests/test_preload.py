"""The engine core spawned before its job is known (engine/preload.py) and the CLI entry that
starts it (vbatch/__main__.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vbatch.__main__ import runs_one_core
from vbatch.client.core_client import EngineCoreClient
from vbatch.config import EngineConfig
from vbatch.engine import preload
from vbatch.engine.preload import discard_preloaded, preload_core
from vbatch.engine_sets.factory import open_engine_set
from vbatch.protocol import AddRequest, pack_token_ids
from vbatch.sampling_params import SamplingParams


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["run", "in.jsonl", "-o", "out.jsonl"], True),
        (["resume", "out.jsonl"], True),
        (["run", "in.jsonl", "-o", "out.jsonl", "--shard", "0/2"], True),
        (["run", "--help"], False),
        (["run", "in.jsonl", "-o", "o.jsonl", "-dp", "2"], False),
        (["run", "in.jsonl", "-o", "o.jsonl", "--data-parallel-size=2"], False),
        (["run", "in.jsonl", "-o", "o.jsonl", "--ray", "--replicas", "2"], False),
        (["run", "in.jsonl", "-o", "o.jsonl", "--ray-address", "auto"], False),
        (["status", "out.jsonl"], False),
        ([], False),
    ],
)
def test_only_commands_that_run_one_local_core_preload_it(args: list[str], expected: bool) -> None:
    assert runs_one_core(args) is expected


def test_a_client_adopts_the_preloaded_core_and_runs_on_it(tiny_model_dir: Path) -> None:
    preload_core()
    preloaded_pid = preload._preloaded[0].pid  # type: ignore[index]
    client = EngineCoreClient(EngineConfig(model=str(tiny_model_dir), device="cpu", num_threads=1))
    try:
        assert client.pid == preloaded_pid
        assert preload._preloaded is None
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        client.add_requests([AddRequest("r", pack_token_ids([1, 2, 3]), params)])
        tokens: list[int] = []
        finished = False
        while not finished:
            for out in client.get_outputs(timeout=60):
                tokens += out.token_ids
                finished = finished or bool(out.finished)
        assert len(tokens) == 4
    finally:
        client.shutdown()
    other = EngineCoreClient(EngineConfig(model=str(tiny_model_dir), device="cpu", num_threads=1))
    try:
        assert other.pid != preloaded_pid, "a preloaded core is adopted once"
    finally:
        other.shutdown()


def test_an_unadopted_core_is_killed_at_once_even_while_it_imports_torch() -> None:
    preload_core()
    proc = preload._preloaded[0]  # type: ignore[index]
    started = time.perf_counter()
    discard_preloaded()
    assert time.perf_counter() - started < 5.0
    assert not proc.is_alive() and preload._preloaded is None
    discard_preloaded()


def test_vbatch_run_through_the_entry_adopts_the_preloaded_core(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    (tmp_path / "in.jsonl").write_text('{"prompt": "a b c"}\n{"prompt": "d e"}\n')
    env = {**os.environ, "VBATCH_DEBUG": "1"}
    args = ["run", "in.jsonl", "-o", "out.jsonl", "--model", str(tiny_model_dir), "-q"]
    proc = subprocess.run(
        [sys.executable, "-m", "vbatch", *args, "--max-tokens", "3", "--num-threads", "1"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert sorted(row["index"] for row in rows) == [0, 1]
    assert all(row["error"] is None and row["completion_tokens"] == 3 for row in rows)


def test_a_failing_command_reports_its_error_through_the_preloading_entry(
    tmp_path: Path,
) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "vbatch", "run", "missing.jsonl", "-o", "out.jsonl"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0 and "missing.jsonl" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_data_parallel_set_frees_the_preloaded_core_at_once(tiny_model_dir: Path) -> None:
    preload_core()
    proc = preload._preloaded[0]  # type: ignore[index]
    engines = open_engine_set(
        str(tiny_model_dir), data_parallel_size=2, device="cpu", num_threads=2
    )
    try:
        assert preload._preloaded is None and not proc.is_alive()
    finally:
        engines.shutdown()


def test_hiding_the_main_module_from_a_core_s_spawn_changes_nothing_other_threads_see(
    tmp_path: Path,
) -> None:
    """A core starts on the client's thread while the user's code runs: before, its spawn
    removed __main__'s __file__ and __spec__ for the whole process meanwhile, and the user's
    own spawn pool failed to find its functions in __main__ (and hung)."""
    script = tmp_path / "user.py"
    script.write_text(
        "import multiprocessing, threading\n"
        "from vbatch.engine.preload import main_module_hidden, spawn_context\n"
        "def square(x):\n"
        "    return x * x\n"
        "if __name__ == '__main__':\n"
        "    entered, release = threading.Event(), threading.Event()\n"
        "    def start_core():\n"
        "        with main_module_hidden():\n"
        "            entered.set()\n"
        "            release.wait()\n"
        "    thread = threading.Thread(target=start_core)\n"
        "    thread.start()\n"
        "    entered.wait()\n"
        "    print('file', __file__ == globals().get('__file__'))\n"
        "    with spawn_context().Pool(1) as pool:\n"
        "        print('pool', pool.map(square, [3]))\n"
        "    release.set()\n"
        "    thread.join()\n"
    )
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["file True", "pool [9]"]
