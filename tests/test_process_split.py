"""The client/core split under failure: bad requests and failing steps, hung cores, dropped LLMs,
worker threads outliving main. Every test runs a real engine-core process on the tiny model."""

from __future__ import annotations

import contextlib
import gc
import itertools
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import weakref
from collections.abc import Iterator
from pathlib import Path

import msgspec
import orjson
import pytest
from helpers import wait_gone

from vbatch import LLM, SamplingParams
from vbatch.client.tokenizer import TextTokenizer
from vbatch.engine.core import FAULTS_ENV, MAX_CONSECUTIVE_STEP_FAILURES
from vbatch.errors import EngineDeadError
from vbatch.job.runner import JobSpec, RunOptions, start_job
from vbatch.llm import Request

ENGINE = dict(device="cpu", num_threads=1, max_num_seqs=8, num_kv_blocks=64)
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
# NOTE: token ids that no other prompt here contains; a prompt holding one triggers the fault
# that FAULTS_ENV assigns it in the core.
RAISE, FATAL, BUSY, HANG, SPIN, SPIN_FOREVER = 40001, 40002, 40003, 40004, 40005, 40006
SPIN_STEP_S = 4.0
BUSY_STEP_S = 6.0
HEARTBEAT_TIMEOUT_S = 12.0
# NOTE: for a core that runs nothing else before its hung step, so no busy step can outlast it.
HUNG_HEARTBEAT_TIMEOUT_S = 5.0


def faulty(token_id: int, max_tokens: int = 4) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return Request(prompt_token_ids=[token_id, 5, 6], sampling_params=params)


def faulty_llm(model_dir: Path, heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S) -> LLM:
    """An LLM whose core has the test-only faults armed (read from its environment at start)."""
    faults = f"raise:{RAISE},fatal:{FATAL},sleep:{BUSY}:{BUSY_STEP_S},sleep:{HANG}:3600"
    os.environ[FAULTS_ENV] = faults
    try:
        return LLM(str(model_dir), heartbeat_timeout_s=heartbeat_timeout_s, **ENGINE)
    finally:
        del os.environ[FAULTS_ENV]


@pytest.fixture(scope="module")
def shared(tiny_model_dir: Path) -> Iterator[LLM]:
    """A faulty LLM for the tests that leave its core running."""
    with faulty_llm(tiny_model_dir) as llm:
        yield llm


@pytest.fixture
def own(tiny_model_dir: Path) -> Iterator[LLM]:
    """A faulty LLM for one test that ends its core."""
    with faulty_llm(tiny_model_dir) as llm:
        yield llm


def test_undecodable_and_unencodable_requests_come_back_as_error_outputs(shared: LLM) -> None:
    # NOTE: fields forced past validation (an assignment re-validates): the core's strict
    # decode refuses a wrong type and msgpack an int past 64 bits. None may hang generate().
    wrong_type = SamplingParams(max_tokens=3)
    msgspec.structs.force_setattr(wrong_type, "ignore_eos", "yes")
    unpackable = SamplingParams(max_tokens=3, seed=1)
    msgspec.structs.force_setattr(unpackable, "seed", 2**64)
    inputs = [
        Request(id="type", prompt="a", sampling_params=wrong_type),
        Request(id="pack", prompt="c", sampling_params=unpackable),
    ]
    outs = {o.request_id: o for o in shared.generate(inputs)}
    for rid, expected in (
        ("type", "sampling_params.ignore_eos"),
        ("pack", "64"),
    ):
        assert outs[rid].error is not None and expected in outs[rid].error, outs[rid].error
        assert outs[rid].outputs[0].finish_reason == "error"
    (ok,) = shared.generate(["still serving"], GREEDY)
    assert ok.error is None and len(ok.outputs[0].token_ids) == 4


def test_a_failing_step_fails_its_requests_with_the_cores_message(shared: LLM) -> None:
    (bad,) = shared.generate([faulty(RAISE)])
    assert bad.outputs[0].finish_reason == "error"
    assert bad.error.startswith("the engine failed a step: RuntimeError: injected fault")
    assert "core.py" in bad.error
    # NOTE: failures with successful steps between them never add up to a broken engine.
    for _ in range(MAX_CONSECUTIVE_STEP_FAILURES + 1):
        (bad,) = shared.generate([faulty(RAISE)])
        assert bad.error is not None
        (ok,) = shared.generate(["fine"], GREEDY)
        assert ok.error is None and len(ok.outputs[0].token_ids) == 4
    stats = shared.get_stats()
    assert (stats.num_running, stats.num_waiting) == (0, 0)


def test_a_failing_step_of_many_requests_fails_only_the_one_that_raises(shared: LLM) -> None:
    prompts = [f"row number {i}" for i in range(7)]
    clean = [o.outputs[0].token_ids for o in shared.generate(prompts, GREEDY)]
    outs = shared.generate([*prompts[:3], faulty(RAISE), *prompts[3:]], GREEDY)
    bad = outs.pop(3)
    assert bad.error is not None and "injected fault" in bad.error
    assert [o.error for o in outs] == [None] * 7
    assert [o.outputs[0].token_ids for o in outs] == clean
    (ok,) = shared.generate(["after"], GREEDY)
    assert ok.error is None and shared.get_stats().num_running == 0


def test_get_stats_waits_for_a_busy_core_instead_of_calling_it_dead(shared: LLM) -> None:
    worker = threading.Thread(target=shared.generate, args=([faulty(BUSY, max_tokens=1)],))
    worker.start()
    try:
        # NOTE: the core sleeps BUSY_STEP_S inside that request's step, and answers stats calls
        # between steps: a live but busy core, not a dead one.
        time.sleep(0.5)
        with pytest.raises(TimeoutError, match="alive but busy"):
            shared._client.get_stats(timeout=1.0)
        start = time.monotonic()
        stats = shared.get_stats()
        assert time.monotonic() - start > 3.0
        assert stats.num_steps >= 1
    finally:
        worker.join(60)


def test_consecutive_failing_steps_mean_a_broken_engine(own: LLM) -> None:
    pid = own.engine_info.pid
    inputs = [faulty(RAISE, max_tokens=1) for _ in range(MAX_CONSECUTIVE_STEP_FAILURES)]
    # NOTE: one request at a time, so each failing step is the next step the engine runs.
    own.max_in_flight = 1
    with pytest.raises(EngineDeadError, match=r"3 engine steps in a row failed.*injected fault"):
        own.generate(inputs)
    assert wait_gone(pid, 10)


def test_a_cuda_error_is_fatal_to_the_engine(own: LLM) -> None:
    with pytest.raises(EngineDeadError, match=r"CUDA error.*cannot go on"):
        own.generate([faulty(FATAL)])
    assert wait_gone(own.engine_info.pid, 10)


def test_a_core_stuck_in_a_step_is_killed_as_hung(tiny_model_dir: Path) -> None:
    with faulty_llm(tiny_model_dir, HUNG_HEARTBEAT_TIMEOUT_S) as llm:
        pid = llm.engine_info.pid
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match="alive but its loop made no progress"):
            llm.generate([faulty(HANG)])
        waited = time.monotonic() - start
        assert HUNG_HEARTBEAT_TIMEOUT_S <= waited < HUNG_HEARTBEAT_TIMEOUT_S + 15, waited
        assert wait_gone(pid, 10)


def spinning_llm(model_dir: Path) -> LLM:
    """An LLM whose core computes, busy, for SPIN_STEP_S (or for ever) in a step of a prompt
    holding SPIN (SPIN_FOREVER), under a 2 s heartbeat timeout."""
    os.environ[FAULTS_ENV] = f"spin:{SPIN}:{SPIN_STEP_S},spin:{SPIN_FOREVER}:3600"
    try:
        return LLM(str(model_dir), heartbeat_timeout_s=2, max_num_batched_tokens=32, **ENGINE)
    finally:
        del os.environ[FAULTS_ENV]


def test_a_slow_step_that_computes_is_not_killed_as_hung(tiny_model_dir: Path) -> None:
    with spinning_llm(tiny_model_dir) as llm:
        start = time.monotonic()
        (out,) = llm.generate([faulty(SPIN, max_tokens=2)])
        assert time.monotonic() - start >= SPIN_STEP_S
        assert out.error is None and len(out.outputs[0].token_ids) == 2


def test_a_computing_step_past_its_measured_limit_is_killed(tiny_model_dir: Path) -> None:
    with spinning_llm(tiny_model_dir) as llm:
        pid = llm.engine_info.pid
        (warm,) = llm.generate(["measure some steps"], GREEDY)
        assert warm.error is None
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match="sized from the step times measured so far"):
            llm.generate([faulty(SPIN_FOREVER)])
        assert 2.0 <= time.monotonic() - start < 90.0
        assert wait_gone(pid, 10)


def test_a_stopped_core_is_detected_and_killed(tiny_model_dir: Path) -> None:
    with LLM(str(tiny_model_dir), heartbeat_timeout_s=3, **ENGINE) as llm:
        pid = llm.engine_info.pid
        params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
        quick = Request(prompt="quick", sampling_params=SamplingParams(max_tokens=1))
        stream = llm.stream(itertools.chain([quick], itertools.repeat("slow", 20)), params)
        with contextlib.closing(stream):
            next(stream)
            os.kill(pid, signal.SIGSTOP)
            stopped_at = time.monotonic()
            try:
                with pytest.raises(EngineDeadError, match="sent no heartbeat"):
                    next(stream)
                waited = time.monotonic() - stopped_at
                assert 2.5 <= waited < 15.0, waited
                assert wait_gone(pid, 10)
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def client_threads() -> set[threading.Thread]:
    return {thread for thread in threading.enumerate() if thread.name == "vbatch-client"}


def test_dropped_llms_free_their_cores(tiny_model_dir: Path) -> None:
    before = client_threads()
    llm = LLM(str(tiny_model_dir), **ENGINE)
    ipc_dirs = []
    for attempt in range(3):
        pid = llm.engine_info.pid
        ipc_dirs.append(llm._client.ipc_dir)
        client = weakref.ref(llm._client)
        # NOTE: rebinding drops the last reference to the previous LLM (the last time, del).
        if attempt < 2:
            llm = LLM(str(tiny_model_dir), **ENGINE)
        else:
            del llm
        gc.collect()
        assert wait_gone(pid, 15), "the dropped LLM's core is still running"
        assert client() is None, "something still holds the dropped LLM's client"
    assert client_threads() <= before
    assert not any(os.path.exists(path) for path in ipc_dirs)


def test_a_worker_thread_outliving_main_keeps_its_engine(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    script = tmp_path / "worker.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import threading, time
            from vbatch import LLM, SamplingParams

            def work(llm):
                while main.is_alive():
                    time.sleep(0.05)
                time.sleep(1.0)
                params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
                (out,) = llm.generate(["from the worker"], params)
                print("worker", out.error, len(out.outputs[0].token_ids), flush=True)

            if __name__ == "__main__":
                main = threading.main_thread()
                llm = LLM({str(tiny_model_dir)!r}, device="cpu", num_threads=1, num_kv_blocks=64)
                print("core", llm.engine_info.pid, flush=True)
                threading.Thread(target=work, args=(llm,)).start()
            """
        )
    )
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines())
    assert lines.get("worker") == "None 3", proc.stderr
    assert wait_gone(int(lines["core"]), 10), "the interpreter exited and left its core running"


def test_a_job_turns_bad_requests_and_failing_steps_into_error_rows(
    tiny_model_dir: Path, tmp_path: Path, tokenizer: TextTokenizer
) -> None:
    rows = [
        {"id": "a", "prompt": "hello there"},
        {"id": "boom", "prompt": "a zebra"},
        # NOTE: a value of the wrong type that SamplingParams let through would hang the job.
        {"id": "bad", "prompt": "x", "sampling_params": {"ignore_eos": "yes"}},
        {"id": "b", "prompt": "good night"},
    ]
    boom, *others = tokenizer.encode_batch([rows[1]["prompt"], "hello there", "x", "good night"])
    trigger = max(set(boom) - {t for ids in others for t in ids})
    input_path = tmp_path / "in.jsonl"
    input_path.write_bytes(b"".join(orjson.dumps(row) + b"\n" for row in rows))
    output = tmp_path / "out.jsonl"
    spec = JobSpec(
        input_path,
        output,
        model=str(tiny_model_dir),
        engine_args=dict(ENGINE),
        sampling={"max_tokens": 3, "temperature": 0.0},
    )
    os.environ[FAULTS_ENV] = f"raise:{trigger}"
    try:
        # NOTE: all rows at once: the failing step holds the other rows too, and they finish.
        outcome = start_job(spec, RunOptions(display="quiet"))
    finally:
        del os.environ[FAULTS_ENV]
    assert outcome.exit_code == 0, outcome.message
    results = {r["id"]: r for r in map(orjson.loads, output.read_bytes().splitlines())}
    assert results["a"]["error"] is None and results["b"]["error"] is None
    assert results["boom"]["finish_reason"] == "error"
    assert "injected fault" in results["boom"]["error"]
    assert results["bad"]["finish_reason"] == "error"
    assert "ignore_eos" in results["bad"]["error"]
