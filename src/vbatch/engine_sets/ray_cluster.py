"""The Ray cluster of a `--ray` job: one vbatch starts and owns, or one it joins once it answers.

Without an address (`--ray-address` or `RAY_ADDRESS`) vbatch never joins whatever cluster
`/tmp/ray/ray_current_cluster` names (it may be dead, or someone else's): it starts its own
through a keeper process (ray_keeper.py) in a session of its own, which stops the cluster when
the driver ends, however it ends. An address is checked to answer before `ray.init`, so a dead
one fails in seconds with one line. `ClusterWatch` tells the stream when the GCS stops answering.
"""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import psutil
import ray

from vbatch.engine_sets.base import RaySettings, StartupCancelled
from vbatch.errors import ConfigError, EngineStartupError

START_TIMEOUT_S = 180.0
CONNECT_TIMEOUT_S = 15.0
WATCH_PERIOD_S = 1.0
# NOTE: a GCS that refuses this many checks in a row is gone (a restart takes longer anyway).
WATCH_FAILURES = 3
_KEEPER_DIR = "vbatch-ray-"
_KEPT_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGALRM)


@dataclass
class RayCluster:
    """The cluster this driver is connected to; `keeper` is set when vbatch started it."""

    address: str
    description: str
    keeper: subprocess.Popen[bytes] | None = None
    keeper_dir: Path | None = None
    is_joined_here: bool = True

    @property
    def is_owned(self) -> bool:
        return self.keeper is not None

    def stop(self) -> None:
        """Leave the cluster (bounded: a lost GCS can make ray.shutdown hang); an owned one is
        stopped by its keeper, which ends once its stdin closes."""
        if self.is_joined_here:
            thread = threading.Thread(target=ray.shutdown, daemon=True)
            thread.start()
            thread.join(10.0)
        if self.keeper is not None:
            assert self.keeper.stdin is not None
            with contextlib.suppress(OSError):
                self.keeper.stdin.close()
            try:
                self.keeper.wait(30.0)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(OSError):
                    os.killpg(self.keeper.pid, signal.SIGKILL)
                self.keeper.wait()
        if self.keeper_dir is not None:
            shutil.rmtree(self.keeper_dir, ignore_errors=True)


def open_cluster(
    address: str | None,
    on_progress: Callable[[str], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> RayCluster:
    """Connect this process to the cluster at `address` (else `RAY_ADDRESS`), checked first;
    with neither, start one of its own. A process already connected keeps its cluster."""
    if ray.is_initialized():
        gcs = ray.get_runtime_context().gcs_address
        return RayCluster(gcs, f"the Ray cluster this process joined ({gcs})", None, None, False)
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address is None:
        sweep_dead_clusters()
        cluster = _start_own(on_progress, should_stop)
    else:
        gcs = _resolve(address)
        if on_progress is not None:
            on_progress(f"joining the Ray cluster at {gcs}")
        if not gcs.startswith("ray://"):
            _check_answers(gcs, address, should_stop)
        cluster = RayCluster(gcs, f"the Ray cluster at {gcs} (not started by vbatch)")
        if address == "auto":
            # NOTE: as ray.init(address="auto") does (vbatch passes the address it resolved):
            # the cluster `ray start` made here takes the token it wrote down, if any.
            _use_local_token()
    try:
        _init_ray(cluster.address)
    except BaseException:
        cluster.is_joined_here = False
        cluster.stop()
        raise
    return cluster


def _resolve(address: str) -> str:
    """`auto` is the cluster `ray start` last wrote down on this machine; a name that is not
    there, or that no longer answers, is refused rather than waited for."""
    if address != "auto":
        return address
    path = current_cluster_file()
    try:
        return path.read_text().strip()
    except OSError:
        raise ConfigError(
            f"--ray-address auto: no Ray cluster is running here ({path} is missing); leave "
            "the address out to let vbatch start one"
        ) from None


def current_cluster_file() -> Path:
    """Where `ray start` writes down its cluster's address (Ray reads it for address=auto)."""
    from ray._common.utils import get_ray_address_file

    return Path(get_ray_address_file(None))


def _check_answers(gcs: str, given: str, should_stop: Callable[[], bool] | None) -> None:
    timeout = CONNECT_TIMEOUT_S
    deadline = time.monotonic() + timeout
    while True:
        problem = gcs_problem(gcs)
        if problem is None:
            return
        if should_stop is not None and should_stop():
            raise StartupCancelled
        if time.monotonic() >= deadline:
            stale = (
                f" (named by {current_cluster_file()}: a cluster that died leaves it behind)"
                if given == "auto"
                else ""
            )
            raise EngineStartupError(
                f"no Ray cluster answers at {gcs}{stale}: {problem} for {timeout:g} s. Check "
                "--ray-address (or RAY_ADDRESS), or leave it out to let vbatch start a cluster "
                "of its own"
            )
        time.sleep(0.5)


def gcs_problem(gcs: str) -> str | None:
    """Why the GCS at `host:port` does not take a connection, or None if it does."""
    host, _, port = gcs.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"--ray-address must be HOST:PORT or auto, got {gcs!r}")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=2.0):
            return None
    except OSError as e:
        return e.strerror or type(e).__name__


def _start_own(
    on_progress: Callable[[str], None] | None, should_stop: Callable[[], bool] | None
) -> RayCluster:
    if on_progress is not None:
        on_progress("starting a local Ray cluster for this job")
    keeper_dir = Path(tempfile.mkdtemp(prefix=f"{_KEEPER_DIR}{os.getpid()}-"))
    log_path = keeper_dir / "keeper.log"
    with open(log_path, "wb") as log:
        keeper = subprocess.Popen(
            [sys.executable, "-m", "vbatch.engine_sets.ray_keeper"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            start_new_session=True,
        )
    (keeper_dir / "keeper.pid").write_text(str(keeper.pid))
    cluster = RayCluster("", "", keeper, keeper_dir, is_joined_here=False)
    try:
        assert keeper.stdout is not None
        gcs = _read_line(keeper, keeper.stdout, should_stop, log_path)
    except BaseException:
        cluster.stop()
        raise
    gcs, _, mode = gcs.partition(" ")
    if mode == "token":
        _use_token_auth()
    cluster.address = gcs
    cluster.description = f"a local Ray cluster started for this job ({gcs}; it stops with it)"
    cluster.is_joined_here = True
    return cluster


def _read_line(
    keeper: subprocess.Popen[bytes],
    stream: IO[bytes],
    should_stop: Callable[[], bool] | None,
    log_path: Path,
) -> str:
    deadline = time.monotonic() + START_TIMEOUT_S
    with selectors.DefaultSelector() as selector:
        selector.register(stream, selectors.EVENT_READ)
        while not selector.select(timeout=0.5):
            if should_stop is not None and should_stop():
                raise StartupCancelled
            if keeper.poll() is not None or time.monotonic() >= deadline:
                break
    line = stream.readline().decode(errors="replace").strip() if keeper.poll() is None else ""
    if not line:
        tail = log_path.read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
        why = "did not start" if keeper.poll() is None else "failed"
        raise EngineStartupError(
            f"the local Ray cluster {why} within {START_TIMEOUT_S:g} s: {tail[0]}"
        )
    return line


def _use_token_auth() -> None:
    """Join with Ray's token authentication, as the cluster the keeper started asks."""
    os.environ["RAY_AUTH_MODE"] = "token"
    with contextlib.suppress(ImportError):
        from ray._raylet import Config

        Config.initialize("")


def _use_local_token() -> None:
    """Turn Ray's token authentication on where RAY_AUTH_MODE is unset and this machine holds
    a token (`ray start` writes ~/.ray/auth_token)."""
    with contextlib.suppress(ImportError):
        from ray._private.authentication import authentication_token_setup as setup

        # NOTE: its notice that token auth is on would break up the dashboard.
        level = setup.logger.level
        setup.logger.setLevel(logging.ERROR)
        try:
            setup.maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
        finally:
            setup.logger.setLevel(level)


def _auth_hint() -> str:
    """Where a join failed: the likely cause when the cluster may want a token this process is
    not sending (Ray sends none to an explicit address unless RAY_AUTH_MODE=token)."""
    if os.environ.get("RAY_AUTH_MODE", "").lower() == "token":
        return ""
    return (
        ". If the cluster uses Ray's token authentication (`ray start` turns it on by default), "
        "set RAY_AUTH_MODE=token, with the cluster's token in ~/.ray/auth_token, "
        "RAY_AUTH_TOKEN_PATH or RAY_AUTH_TOKEN"
    )


def sweep_dead_clusters() -> list[int]:
    """Kill what is left of clusters whose vbatch driver and keeper both died by SIGKILL (the
    keeper's process group) and remove their directories; returns the groups killed."""
    killed = []
    for path in Path(tempfile.gettempdir()).glob(f"{_KEEPER_DIR}*"):
        try:
            driver = int(path.name.removeprefix(_KEEPER_DIR).split("-")[0])
            group = int((path / "keeper.pid").read_text())
        except (OSError, ValueError):
            continue
        if psutil.pid_exists(driver) or psutil.pid_exists(group):
            continue
        members = []
        for proc in psutil.process_iter(["cmdline"]):
            with contextlib.suppress(psutil.Error, OSError):
                if os.getpgid(proc.pid) == group and "ray" in " ".join(proc.info["cmdline"] or ()):
                    members.append(proc.pid)
        if members:
            with contextlib.suppress(OSError):
                os.killpg(group, signal.SIGKILL)
            killed.append(group)
        shutil.rmtree(path, ignore_errors=True)
    return killed


class ClusterWatch:
    """A thread that checks the GCS takes connections; `lost` says why once it stopped."""

    def __init__(self, gcs: str) -> None:
        self.gcs = gcs
        self.lost: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="vbatch-ray-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        failures = 0
        while not self._stop.wait(WATCH_PERIOD_S):
            problem = gcs_problem(self.gcs)
            failures = failures + 1 if problem is not None else 0
            if failures >= WATCH_FAILURES:
                self.lost = (
                    f"the Ray cluster is gone: its GCS at {self.gcs} stopped answering ({problem})"
                )
                return

    def close(self) -> None:
        self._stop.set()


def _init_ray(address: str) -> None:
    """Join the cluster, keeping this process's signal handlers.

    NOTE: ray.init installs its own SIGTERM (and SIGINT) handlers, which would exit at once
    instead of letting the job drain, commit and print the resume command."""
    main = threading.current_thread() is threading.main_thread()
    handlers: dict[int, Any] = (
        {signum: signal.getsignal(signum) for signum in _KEPT_SIGNALS} if main else {}
    )
    # NOTE: Ray's own log lines would break up the dashboard; its errors still raise.
    try:
        ray.init(
            address=address,
            include_dashboard=False,
            log_to_driver=False,
            logging_level=logging.ERROR,
        )
    except (ConnectionError, RuntimeError, ray.exceptions.RayError) as e:
        text = str(e).strip().splitlines()
        raise EngineStartupError(
            f"cannot join the Ray cluster at {address}: "
            f"{text[0] if text else type(e).__name__}{_auth_hint()}"
        ) from None
    for signum, handler in handlers.items():
        if handler is not None:
            signal.signal(signum, handler)


def free_resources() -> str:
    free, total = ray.available_resources(), ray.cluster_resources()
    return ", ".join(
        f"{free.get(name, 0):g} of {total.get(name, 0):g} {name}s free" for name in ("CPU", "GPU")
    )


def check_resources(settings: RaySettings) -> int:
    """Refuse a replica no node could ever hold; returns how many replicas the free resources
    hold now (on a shared cluster, more may fit later)."""
    total, free = ray.cluster_resources(), ray.available_resources()
    fits = settings.replicas
    for name, need in (("CPU", settings.cpus_per_replica), ("GPU", settings.gpus_per_replica)):
        if need > total.get(name, 0):
            raise EngineStartupError(
                f"a replica asks for {need:g} {name}s, and the Ray cluster has "
                f"{total.get(name, 0):g}; lower --{name.lower()}s-per-replica"
            )
        if need > 0:
            fits = min(fits, int(free.get(name, 0) // need))
    return fits


def pending_notice(settings: RaySettings, num_starting: int) -> str:
    """How many replicas still start, and why: when the free resources hold no replica, they
    are waiting for CPUs or GPUs."""
    free = ray.available_resources()
    is_short = any(
        need > free.get(name, 0)
        for name, need in (("CPU", settings.cpus_per_replica), ("GPU", settings.gpus_per_replica))
    )
    why = "waiting for CPUs or GPUs" if is_short else "still loading"
    return (
        f"Ray: {num_starting} of {settings.replicas} replicas are pending, {why} "
        f"({free_resources()}); they join the job once they are up"
    )


def alive_nodes() -> dict[str, str]:
    """The cluster's live nodes: id -> a name for messages (its address)."""
    try:
        nodes = ray.nodes()
    except ray.exceptions.RayError:
        return {}
    return {n["NodeID"]: n.get("NodeManagerAddress", n["NodeID"][:8]) for n in nodes if n["Alive"]}
