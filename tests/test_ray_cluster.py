"""--ray under real cluster conditions: a stale cluster file, a dead address, a busy foreign
cluster, SIGTERM to the driver or its group, a lost GCS or raylet, a SIGKILLed driver."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import ray
from helpers import write_jsonl
from typer.testing import CliRunner

from vbatch.cli import app
from vbatch.engine_sets import ray_cluster
from vbatch.job.journal import JOURNAL_NAME, read_journal

TIMEOUT_S = 300
SRC_DIR = str(Path(__import__("vbatch").__file__).parents[1])


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A short TMPDIR: Ray puts its unix sockets under it (paths of at most 107 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="vr", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def stale_cluster_file(tmp: Path) -> Path:
    """What a SIGKILLed `ray start --head` leaves: a cluster file naming a dead GCS."""
    (tmp / "ray").mkdir(exist_ok=True)
    path = tmp / "ray" / "ray_current_cluster"
    path.write_text("127.0.0.1:1")
    return path


def env_for(tmp: Path) -> dict[str, str]:
    path = os.pathsep.join([SRC_DIR, os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "TMPDIR": str(tmp), "RAY_ADDRESS": "", "PYTHONPATH": path}


def start_cli(tmp: Path, model: Path, *extra: str, num_rows: int = 200) -> subprocess.Popen[str]:
    """A `vbatch run --ray` in its own process group, as `timeout` or Slurm would start it."""
    write_jsonl(
        tmp / "in.jsonl", [{"id": f"r{i}", "prompt": f"item {i} is"} for i in range(num_rows)]
    )
    args = [
        sys.executable, "-m", "vbatch", "run", "in.jsonl", "-o", "out.jsonl",
        "--model", str(model), "--max-tokens", "16", "--max-num-seqs", "4",
        "--commit-every-rows", "2", "--log-interval", "1", "--drain-timeout", "20",
        "--ray", *extra,
    ]  # fmt: skip
    return subprocess.Popen(
        args,
        cwd=tmp,
        env=env_for(tmp),
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )


def num_committed(tmp: Path) -> int:
    journal = tmp / "out.jsonl.vbatch" / JOURNAL_NAME
    return len(read_journal(journal)[0].committed) if journal.exists() else 0


def wait_running(proc: subprocess.Popen[str], tmp: Path) -> int:
    """Wait for the first commit; returns the keeper's pid (its process group's id)."""
    deadline = time.monotonic() + TIMEOUT_S
    while num_committed(tmp) == 0:
        assert proc.poll() is None, proc.communicate()[1]
        assert time.monotonic() < deadline, "the job made no progress"
        time.sleep(0.05)
    (pid_file,) = tmp.glob("vbatch-ray-*/keeper.pid")
    return int(pid_file.read_text())


def group(pgid: int) -> list[psutil.Process]:
    members = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            if os.getpgid(proc.pid) == pgid and proc.status() != psutil.STATUS_ZOMBIE:
                members.append(proc)
    return members


def wait_gone(pgid: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while group(pgid):
        assert time.monotonic() < deadline, [p.name() for p in group(pgid)]
        time.sleep(0.2)


def test_a_dead_address_fails_in_one_line_and_at_once(
    short_tmp: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stale cluster file (`--ray-address auto`) or a dead address used to hang for minutes
    at "loading model" with Ray retrying every 5 s."""
    monkeypatch.setattr(ray_cluster, "CONNECT_TIMEOUT_S", 1.0)
    monkeypatch.setenv("TMPDIR", str(short_tmp))
    stale = stale_cluster_file(short_tmp)
    write_jsonl(short_tmp / "in.jsonl", [{"id": "a", "prompt": "x"}])
    base = ["run", str(short_tmp / "in.jsonl"), "--model", str(tiny_model_dir), "-q", "--ray"]
    for output, address in (("a.jsonl", "auto"), ("b.jsonl", "127.0.0.1:1")):
        start = time.monotonic()
        result = CliRunner().invoke(
            app, [*base, "-o", str(short_tmp / output), "--ray-address", address]
        )
        assert result.exit_code == 1, result.output
        assert time.monotonic() - start < 30
        assert "no Ray cluster answers at 127.0.0.1:1" in result.output, result.output
        assert (f"named by {stale}" in result.output) == (address == "auto")
        assert "bug" not in result.output
    assert not ray.is_initialized()


def _kill_cluster_under(tmp: Path) -> None:
    """Kill the processes of the cluster whose session directory is under `tmp` (its GCS,
    raylet and workers name it), and no other cluster's."""
    for proc in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error, OSError):
            if str(tmp) in " ".join(proc.info["cmdline"] or ()):
                proc.kill()


@pytest.mark.slow
def test_a_ray_start_cluster_is_joined_by_auto_and_an_address_names_its_token(
    short_tmp: Path, tiny_model_dir: Path
) -> None:
    """`ray start --head` turns Ray's token authentication on. `--ray-address auto` takes the
    token it wrote down, as ray.init(address="auto") does; an explicit address does not (Ray
    sends none there unless RAY_AUTH_MODE=token), and its failure says so."""
    env = env_for(short_tmp)
    env.pop("RAY_AUTH_MODE", None)
    head = subprocess.run(
        ["ray", "start", "--head", "--num-cpus", "2", "--port", "0", "--disable-usage-stats"],
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        start_new_session=True,
    )
    try:
        assert head.returncode == 0, head.stderr
        assert "Token authentication is enabled" in head.stdout + head.stderr
        address = (short_tmp / "ray" / "ray_current_cluster").read_text().strip()
        write_jsonl(short_tmp / "in.jsonl", [{"id": "a", "prompt": "x"}])
        base = [sys.executable, "-m", "vbatch", "run", "in.jsonl", "--model", str(tiny_model_dir)]
        base += ["--max-tokens", "2", "--num-threads", "1", "-q", "--ray", "--replicas", "1"]
        auto = subprocess.run(
            [*base, "-o", "auto.jsonl", "--ray-address", "auto"],
            cwd=short_tmp, env=env, capture_output=True, text=True, timeout=TIMEOUT_S,
        )  # fmt: skip
        assert auto.returncode == 0, auto.stderr
        assert "Token authentication" not in auto.stderr
        given = subprocess.run(
            [*base, "-o", "given.jsonl", "--ray-address", address],
            cwd=short_tmp, env=env, capture_output=True, text=True, timeout=TIMEOUT_S,
        )  # fmt: skip
        assert given.returncode == 1
        assert f"cannot join the Ray cluster at {address}" in given.stderr
        assert "set RAY_AUTH_MODE=token" in given.stderr
    finally:
        _kill_cluster_under(short_tmp)


def test_dp_with_ray_is_refused(tmp_path: Path, tiny_model_dir: Path) -> None:
    """-dp N with --ray silently became N cores inside each replica."""
    write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": "x"}])
    result = CliRunner().invoke(
        app,
        ["run", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "o.jsonl"), "--ray", "-dp", "2"],
    )
    assert result.exit_code == 1 and "drop -dp" in result.output, result.output
    assert not (tmp_path / "o.jsonl.vbatch").exists()


@pytest.mark.slow
def test_a_stale_cluster_file_gets_a_cluster_of_its_own_that_leaves_nothing(
    short_tmp: Path, tiny_model_dir: Path
) -> None:
    stale_cluster_file(short_tmp)
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale_ipc = short_tmp / f"vbatch-{dead.pid}-leftover"
    stale_ipc.mkdir()
    proc = start_cli(short_tmp, tiny_model_dir, num_rows=20)
    _, stderr = proc.communicate(timeout=TIMEOUT_S)
    assert proc.returncode == 0, stderr
    assert "Ray: using a local Ray cluster started for this job" in stderr
    assert not stale_ipc.exists()
    assert not list(short_tmp.glob("vbatch-ray-*"))
    assert not [
        p
        for p in psutil.process_iter(["cmdline"])
        if str(short_tmp) in " ".join(p.info["cmdline"] or ())
    ]


@pytest.mark.slow
@pytest.mark.parametrize("to_group", [False, True], ids=["driver", "group"])
def test_sigterm_drains_exits_75_and_stops_the_cluster(
    short_tmp: Path, tiny_model_dir: Path, to_group: bool
) -> None:
    """SIGTERM to the driver gave "SystemError: <cyfunction CoreWorker.wait> ..." (exit 1); to
    its group (timeout, systemd, Slurm) it killed GCS and raylet at once. Now both drain."""
    proc = start_cli(short_tmp, tiny_model_dir)
    keeper = wait_running(proc, short_tmp)
    if to_group:
        os.killpg(proc.pid, signal.SIGTERM)
    else:
        proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=TIMEOUT_S)
    assert proc.returncode == 75, stderr
    assert "Resume with:\n  vbatch resume out.jsonl" in stderr
    assert "bug" not in stderr
    wait_gone(keeper)
    assert num_committed(short_tmp) > 0


@pytest.mark.slow
@pytest.mark.parametrize("victim", ["gcs_server", "raylet"])
def test_a_lost_gcs_or_raylet_is_named_and_the_job_commits_and_exits(
    short_tmp: Path, tiny_model_dir: Path, victim: str
) -> None:
    """GCS killed: Ray ended the driver after 60 s with its own C++ line, no resume command.
    Raylet killed: the message blamed "no restart is left" with --max-restarts unused."""
    proc = start_cli(short_tmp, tiny_model_dir, "--max-restarts", "1", num_rows=3000)
    keeper = wait_running(proc, short_tmp)
    (target,) = [p for p in group(keeper) if p.name() == victim]
    start = time.monotonic()
    target.kill()
    _, stderr = proc.communicate(timeout=TIMEOUT_S)
    assert proc.returncode == 1, stderr
    assert time.monotonic() - start < 55, stderr
    cause = "the Ray cluster is gone" if victim == "gcs_server" else "is gone (its raylet died"
    assert cause in stderr, stderr
    assert "no restart is left" not in stderr
    assert "Resume with: vbatch resume out.jsonl" in stderr
    wait_gone(keeper)


@pytest.mark.slow
def test_a_sigkilled_driver_takes_its_cluster_with_it(
    short_tmp: Path, tiny_model_dir: Path
) -> None:
    """ray::DashboardAgent and ray::RuntimeEnvAgent outlived a SIGKILLed driver for minutes."""
    proc = start_cli(short_tmp, tiny_model_dir)
    keeper = wait_running(proc, short_tmp)
    assert any("Agent" in " ".join(p.cmdline()) for p in group(keeper))
    proc.kill()
    proc.communicate(timeout=TIMEOUT_S)
    wait_gone(keeper, timeout=20)


def test_a_new_run_sweeps_what_a_dead_cluster_left(
    short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cluster whose driver and keeper were both SIGKILLed: what is left of its process group
    (here one process titled like a Ray agent) is killed and its directory removed."""
    monkeypatch.setenv("TMPDIR", str(short_tmp))
    monkeypatch.setattr(tempfile, "tempdir", None)
    leader = subprocess.Popen(
        ["bash", "-c", "(exec -a ray::DashboardAgent sleep 120) & echo $!"],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert leader.stdout is not None
    orphan = psutil.Process(int(leader.stdout.readline()))
    leader.wait()
    # NOTE: the sweep reads each process's command line; mid-exec it can read empty.
    deadline = time.monotonic() + 10
    while "ray::DashboardAgent" not in " ".join(orphan.cmdline()) and time.monotonic() < deadline:
        time.sleep(0.02)
    dead = subprocess.Popen(["true"])
    dead.wait()
    left = short_tmp / f"vbatch-ray-{dead.pid}-x"
    left.mkdir()
    (left / "keeper.pid").write_text(str(leader.pid))
    alive = short_tmp / f"vbatch-ray-{os.getpid()}-y"
    alive.mkdir()
    (alive / "keeper.pid").write_text(str(leader.pid))
    try:
        assert ray_cluster.sweep_dead_clusters() == [leader.pid]
        orphan.wait(timeout=10)
        assert not left.exists() and alive.exists()
    finally:
        with contextlib.suppress(psutil.Error):
            orphan.kill()


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["cluster", "replicas"])
def test_sigterm_during_start_up_exits_75_and_leaves_nothing(
    short_tmp: Path, tiny_model_dir: Path, stage: str
) -> None:
    """A stop during start-up also gave "SystemError: <cyfunction CoreWorker.wait> ...": the
    start-up (of the cluster, then of the replicas) now polls the stop flag."""
    proc = start_cli(short_tmp, tiny_model_dir)
    assert proc.stderr is not None
    deadline = time.monotonic() + TIMEOUT_S
    while not list(short_tmp.glob("vbatch-ray-*/keeper.pid")):
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    (pid_file,) = short_tmp.glob("vbatch-ray-*/keeper.pid")
    keeper = int(pid_file.read_text())
    seen = ""
    while stage == "replicas" and "starting Ray replicas" not in seen:
        assert proc.poll() is None and time.monotonic() < deadline, seen
        seen += proc.stderr.readline()
    os.killpg(proc.pid, signal.SIGTERM)
    _, stderr = proc.communicate(timeout=TIMEOUT_S)
    assert proc.returncode == 75, seen + stderr
    assert "Resume with:\n  vbatch resume out.jsonl" in stderr and "bug" not in stderr
    wait_gone(keeper)
