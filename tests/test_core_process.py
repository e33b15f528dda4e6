"""The engine-core process over raw sockets: READY, deltas, stats, utility, abort, Shutdown."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import zmq

from vbatch.config import EngineConfig
from vbatch.engine.core_process import STATS_INTERVAL_S, run_engine_core, step_limit
from vbatch.protocol import (
    Abort,
    AddRequest,
    EngineOutputs,
    FinishReason,
    Heartbeat,
    Ready,
    SampleFinish,
    Shutdown,
    StartupFailed,
    StartupProgress,
    Utility,
    UtilityResult,
    client_decoder,
    encoder,
    pack_token_ids,
)
from vbatch.sampling_params import SamplingParams


class RawClient:
    """A bare client: binds the two sockets, spawns the core, and reads its messages."""

    def __init__(self, config: EngineConfig, ipc_dir: Path) -> None:
        self.ipc_dir = ipc_dir
        self.ctx = zmq.Context(1)
        self.push = self.ctx.socket(zmq.PUSH)
        self.pull = self.ctx.socket(zmq.PULL)
        for sock in (self.push, self.pull):
            sock.setsockopt(zmq.LINGER, 0)
        self.push.bind(f"ipc://{ipc_dir}/in")
        self.pull.bind(f"ipc://{ipc_dir}/out")
        self.proc = multiprocessing.get_context("spawn").Process(
            target=run_engine_core,
            args=(config, f"ipc://{ipc_dir}/in", f"ipc://{ipc_dir}/out", os.getpid(), str(ipc_dir)),
            daemon=True,
        )
        self.proc.start()

    def send(self, msg: object) -> None:
        self.push.send(encoder.encode(msg))

    def recv(self, timeout_s: float = 60.0) -> object:
        assert self.pull.poll(int(timeout_s * 1000)), "the core sent nothing"
        return client_decoder.decode(self.pull.recv())

    def close(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(10)
        self.push.close()
        self.pull.close()
        self.ctx.term()


@pytest.fixture(scope="module")
def core(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RawClient]:
    config = EngineConfig(
        model=str(tiny_model_dir),
        device="cpu",
        num_threads=1,
        max_num_seqs=4,
        num_kv_blocks=64,
        attention_backend="torch",
    )
    client = RawClient(config, tmp_path_factory.mktemp("ipc"))
    msg = client.recv()
    while isinstance(msg, StartupProgress):
        msg = client.recv()
    assert isinstance(msg, Ready), msg
    assert msg.pid == client.proc.pid
    yield client
    client.close()


def collect(
    core: RawClient, until: set[str]
) -> tuple[dict[str, list[int]], dict[str, SampleFinish]]:
    """Read outputs until every id in `until` has finished: tokens and finishes by request id."""
    tokens: dict[str, list[int]] = {}
    finished: dict[str, SampleFinish] = {}
    while not until <= finished.keys():
        msg = core.recv()
        if not isinstance(msg, EngineOutputs):
            continue
        for rid, token_id in zip(msg.request_ids, msg.token_ids, strict=True):
            assert rid not in finished, "a token after its sample finished"
            tokens.setdefault(rid, []).append(token_id)
        for finish in msg.finished:
            assert finish.request_id not in finished, "one finish per sample"
            finished[finish.request_id] = finish
    return tokens, finished


def test_requests_stream_compact_outputs(core: RawClient) -> None:
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    core.send(AddRequest("x", pack_token_ids([5, 6, 7]), params))
    tokens, finished = collect(core, {"x"})
    assert len(tokens["x"]) == 6
    assert finished["x"].finish_reason == FinishReason.LENGTH


def test_prompt_too_long_is_an_error_finish_not_a_crash(core: RawClient) -> None:
    params = SamplingParams(max_tokens=4)
    core.send(AddRequest("long", pack_token_ids([1] * 600), params))
    tokens, finished = collect(core, {"long"})
    assert "long" not in tokens
    assert finished["long"].finish_reason == FinishReason.ERROR
    assert finished["long"].error
    assert core.proc.is_alive()


def test_abort_lands_before_the_next_step(core: RawClient) -> None:
    params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    core.send(AddRequest("slow", pack_token_ids([1, 2]), params))
    core.send(Abort(["slow"]))
    tokens, finished = collect(core, {"slow"})
    assert finished["slow"].finish_reason == FinishReason.ABORT
    assert len(tokens.get("slow", [])) < 400


def test_stats_arrive_periodically_and_by_utility(core: RawClient) -> None:
    core.send(Utility(3, "stats"))
    reply = core.recv()
    while not isinstance(reply, UtilityResult):
        reply = core.recv()
    assert reply.call_id == 3
    assert reply.result is not None and reply.result.num_running == 0
    core.send(Utility(4, "no-such-method"))
    reply = core.recv()
    while not isinstance(reply, UtilityResult):
        reply = core.recv()
    assert "no-such-method" in reply.error
    # NOTE: an idle core still reports stats about every STATS_INTERVAL_S.
    start = time.monotonic()
    msg = core.recv()
    while not (isinstance(msg, EngineOutputs) and msg.stats is not None):
        msg = core.recv()
    assert time.monotonic() - start < 4 * STATS_INTERVAL_S + 1


def test_undecodable_messages_are_answered_not_dropped(core: RawClient) -> None:
    # NOTE: a field forced past validation (assignment re-validates): the core's strict typed
    # decode rejects it, by request id.
    wrong_type = SamplingParams(max_tokens=3)
    msgspec.structs.force_setattr(wrong_type, "logprobs", True)
    core.send(AddRequest("bad-type", pack_token_ids([5, 6]), wrong_type))
    core.push.send(msgspec.msgpack.encode([1, "bad-shape", 5, [], 0.0]))
    core.push.send(b"\xc1 not msgpack")
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    core.send(AddRequest("good", pack_token_ids([5, 6]), params))
    tokens, finished = collect(core, {"bad-type", "bad-shape", "good"})
    for rid in ("bad-type", "bad-shape"):
        assert rid not in tokens
        assert finished[rid].finish_reason == FinishReason.ERROR
        assert finished[rid].error.startswith("the engine core could not decode the request")
    assert "sampling_params.logprobs" in finished["bad-type"].error
    assert "prompt_token_ids" in finished["bad-shape"].error
    assert len(tokens["good"]) == 3
    core.push.send(msgspec.msgpack.encode([3, 41, 7]))
    core.send(Utility(42, "stats"))
    replies = {}
    deadline = time.monotonic() + 60
    while len(replies) < 2 and time.monotonic() < deadline:
        msg = core.recv()
        if isinstance(msg, UtilityResult):
            replies[msg.call_id] = msg
    assert "could not decode the utility call" in replies[41].error
    assert replies[42].result is not None
    assert core.proc.is_alive()


def test_a_step_that_raises_fails_its_requests_and_the_core_goes_on(core: RawClient) -> None:
    # NOTE: a stop token id past the vocabulary, with min_tokens, made the sampler index out of
    # bounds (should validation refuse it at add instead, this still holds).
    bad = SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=[10**6])
    core.send(AddRequest("oob", pack_token_ids([5, 6]), bad))
    tokens, finished = collect(core, {"oob"})
    assert finished["oob"].finish_reason == FinishReason.ERROR
    assert finished["oob"].error
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    core.send(AddRequest("after", pack_token_ids([5, 6]), params))
    tokens, finished = collect(core, {"after"})
    assert finished["after"].finish_reason == FinishReason.LENGTH
    assert len(tokens["after"]) == 4
    assert core.proc.is_alive()


def test_heartbeats_carry_the_busy_loops_age(core: RawClient) -> None:
    ages = []
    deadline = time.monotonic() + 60
    while len(ages) < 2 and time.monotonic() < deadline:
        msg = core.recv()
        if isinstance(msg, Heartbeat):
            ages.append(msg.loop_age_s)
    assert len(ages) == 2
    assert all(0.0 <= age < 5.0 for age in ages)


def test_sigterm_sigint_and_sighup_leave_the_core_running(core: RawClient) -> None:
    os.kill(core.proc.pid, signal.SIGTERM)
    os.kill(core.proc.pid, signal.SIGINT)
    os.kill(core.proc.pid, signal.SIGHUP)
    time.sleep(0.5)
    assert core.proc.is_alive(), f"the core died: exit code {core.proc.exitcode}"
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    core.send(AddRequest("still-here", pack_token_ids([5, 6]), params))
    tokens, _ = collect(core, {"still-here"})
    assert len(tokens["still-here"]) == 2
    assert core.proc.is_alive()


def test_shutdown_exits_cleanly(core: RawClient) -> None:
    """The core removes the client's socket directory as it exits: a client that died while
    waiting for that exit (a second Ctrl-C during the drain) left it behind."""
    assert core.ipc_dir.is_dir()
    core.send(Shutdown())
    core.proc.join(10)
    assert core.proc.exitcode == 0
    assert not core.ipc_dir.exists()


def test_startup_failure_is_reported_then_exits(tmp_path: Path) -> None:
    config = EngineConfig(model=str(tmp_path / "missing"), device="cpu")
    client = RawClient(config, tmp_path)
    try:
        msg = client.recv()
        while isinstance(msg, StartupProgress):
            msg = client.recv()
        assert isinstance(msg, StartupFailed)
        assert "does not exist" in msg.message
        assert "Traceback" in msg.traceback
        # NOTE: a model that cannot load fails again on a resume: the job drops its new job.
        assert msg.kind == "ModelLoadError"
        client.proc.join(10)
        assert client.proc.exitcode == 1
    finally:
        client.close()


def test_a_step_limit_is_sized_from_the_slowest_measured_rate() -> None:
    assert step_limit(0.001, 2048, floor_s=120.0) == 120.0
    assert step_limit(0.05, 2048, floor_s=120.0) == pytest.approx(8 * 0.05 * 2048)
