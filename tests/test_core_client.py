"""EngineCoreClient with a real spawned core: handshake, liveness both ways, shutdown, failures."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import psutil
import pytest
from helpers import wait_gone

from vbatch.client.core_client import EngineCoreClient
from vbatch.config import EngineConfig
from vbatch.errors import EngineDeadError, EngineStartupError
from vbatch.protocol import AddRequest, FinishReason, pack_token_ids
from vbatch.sampling_params import SamplingParams


def tiny_config(model_dir: Path, **overrides: object) -> EngineConfig:
    values = dict(
        model=str(model_dir),
        device="cpu",
        num_threads=1,
        max_num_seqs=8,
        num_kv_blocks=64,
        attention_backend="torch",
    )
    values.update(overrides)
    return EngineConfig(**values).validate()


_EARLIER_CHILDREN: set[int] = set()


@pytest.fixture(autouse=True)
def earlier_children() -> None:
    """The children alive before the test (a session-wide engine's core), which it leaves be."""
    _EARLIER_CHILDREN.clear()
    _EARLIER_CHILDREN.update(proc.pid for proc in psutil.Process().children(recursive=True))


def live_children() -> list[psutil.Process]:
    """Our live child processes started by this test, minus multiprocessing's shared resource
    tracker."""
    children = []
    for proc in psutil.Process().children(recursive=True):
        if proc.pid in _EARLIER_CHILDREN:
            continue
        with contextlib.suppress(psutil.NoSuchProcess):
            if proc.status() != psutil.STATUS_ZOMBIE and "resource_tracker" not in " ".join(
                proc.cmdline()
            ):
                children.append(proc)
    return children


def test_handshake_serves_requests_and_shuts_down_cleanly(tiny_model_dir: Path) -> None:
    stages: list[str] = []
    client = EngineCoreClient(tiny_config(tiny_model_dir), on_progress=stages.append)
    try:
        info = client.info
        assert info.pid == client.pid != os.getpid()
        assert info.max_model_len == 512
        assert info.num_kv_blocks == 64
        assert info.block_size == 16
        assert info.device == "cpu"
        assert info.dtype == "float32"
        assert stages
        assert sorted(os.listdir(client.ipc_dir)) == ["input", "output"]

        params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
        client.add_requests([AddRequest("a", pack_token_ids([1, 2, 3]), params)])
        tokens: list[int] = []
        finish = None
        while finish is None:
            for out in client.get_outputs(timeout=30):
                assert not out.is_empty and set(out.request_ids) <= {"a"}
                tokens += out.token_ids
                if out.finished:
                    (finish,) = (f.finish_reason for f in out.finished)
        assert finish == FinishReason.LENGTH
        assert len(tokens) == 5
        stats = client.get_stats()
        assert stats.num_running == 0
        assert stats.num_generation_tokens >= 5
        assert stats.busy_time_s > 0
    finally:
        client.shutdown()
    assert not live_children()
    assert not os.path.exists(client.ipc_dir)
    with pytest.raises(EngineDeadError):
        client.get_outputs(timeout=0)


def test_sigkill_of_the_core_raises_engine_dead_within_seconds(tiny_model_dir: Path) -> None:
    client = EngineCoreClient(tiny_config(tiny_model_dir))
    try:
        os.kill(client.info.pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match="SIGKILL"):
            client.get_outputs(timeout=30)
        assert time.monotonic() - start < 5.0
        with pytest.raises(EngineDeadError):
            client.add_requests([])
    finally:
        client.shutdown()
    assert not live_children()
    assert not os.path.exists(client.ipc_dir)


def test_core_exits_when_its_parent_is_sigkilled(tiny_model_dir: Path, tmp_path: Path) -> None:
    script = tmp_path / "parent.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import time
            from vbatch.client.core_client import EngineCoreClient
            from vbatch.config import EngineConfig

            if __name__ == "__main__":
                config = EngineConfig(
                    model={str(tiny_model_dir)!r}, device="cpu", num_threads=1,
                    num_kv_blocks=64, attention_backend="torch",
                )
                client = EngineCoreClient(config)
                print(client.info.pid, client.ipc_dir, flush=True)
                time.sleep(600)
            """
        )
    )
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    ipc_dir = ""
    try:
        pid, ipc_dir = parent.stdout.readline().split()
        core_pid = int(pid)
        assert psutil.pid_exists(core_pid)
        assert os.path.isdir(ipc_dir)
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        assert wait_gone(core_pid, 5.0)
        # NOTE: the SIGKILLed client could not remove its socket directory; the core did.
        assert not os.path.exists(ipc_dir)
    finally:
        parent.kill()
        parent.wait()
        shutil.rmtree(ipc_dir, ignore_errors=True)


def test_stale_ipc_dirs_of_dead_owners_are_swept_at_client_start(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    tmp = tempfile.gettempdir()
    stale = Path(tempfile.mkdtemp(prefix=f"vbatch-{gone.pid}-", dir=tmp))
    (stale / "input").write_bytes(b"")
    live = Path(tempfile.mkdtemp(prefix=f"vbatch-{os.getppid()}-", dir=tmp))
    other = Path(tempfile.mkdtemp(prefix="vbatch-notapid-", dir=tmp))
    try:
        client = EngineCoreClient(tiny_config(tiny_model_dir))
        client.shutdown()
        assert not stale.exists()
        assert live.is_dir() and other.is_dir()
    finally:
        for path in (stale, live, other):
            shutil.rmtree(path, ignore_errors=True)


def test_sigterm_to_the_core_is_ignored(tiny_model_dir: Path) -> None:
    client = EngineCoreClient(tiny_config(tiny_model_dir))
    try:
        os.kill(client.info.pid, signal.SIGTERM)
        time.sleep(0.5)
        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        client.add_requests([AddRequest("a", pack_token_ids([1, 2, 3]), params)])
        finishes = []
        while not finishes:
            for out in client.get_outputs(timeout=30):
                finishes += out.finished
        assert finishes[0].finish_reason == FinishReason.LENGTH
    finally:
        client.shutdown()
    assert not live_children()


def test_startup_failure_carries_the_cores_own_message(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    start = time.monotonic()
    with pytest.raises(EngineStartupError, match="does not exist") as info:
        EngineCoreClient(EngineConfig(model=str(missing), device="cpu"))
    assert str(missing) in str(info.value)
    assert time.monotonic() - start < 60
    assert not live_children()


def test_core_killed_during_startup_names_the_signal(tiny_model_dir: Path) -> None:
    def kill_core(stage: str) -> None:
        for child in live_children():
            child.kill()

    with pytest.raises(EngineStartupError, match="SIGKILL"):
        EngineCoreClient(tiny_config(tiny_model_dir), on_progress=kill_core)
    assert not live_children()


def test_startup_timeout_kills_the_core(tiny_model_dir: Path) -> None:
    start = time.monotonic()
    with pytest.raises(EngineStartupError, match="did not report READY within"):
        EngineCoreClient(tiny_config(tiny_model_dir, startup_timeout_s=0.2))
    assert time.monotonic() - start < 15
    assert not live_children()


def test_a_client_that_does_not_wait_returns_while_the_core_starts(tiny_model_dir: Path) -> None:
    """`wait=False` hands back at once (the caller works while the core imports torch and loads
    the model); `wait_ready()` then gives the handshake."""
    client = EngineCoreClient(tiny_config(tiny_model_dir), wait=False)
    try:
        assert not hasattr(client, "info")
        client.wait_ready()
        assert client.info.num_kv_blocks == 64
        pid = client.info.pid
    finally:
        client.shutdown()
    assert wait_gone(pid, 10.0)
