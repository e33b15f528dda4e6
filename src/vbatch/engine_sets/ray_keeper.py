"""The keeper of a Ray cluster that vbatch starts: it lives and dies with the driver.

Run as `python -m vbatch.engine_sets.ray_keeper`, in a session of its own (so a signal to the
driver's process group never reaches the cluster), it starts a local Ray cluster, writes the
GCS address and Ray's authentication mode on stdout, then reads stdin until EOF: the driver
closed it (it is done) or died (any way, SIGKILL too). It then stops the cluster and kills its
whole process group, which holds every process Ray started (GCS, raylet, agents, workers), so
nothing outlives the job.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from typing import Any

_SHUTDOWN_S = 10.0


def _stop(*_: Any) -> None:
    import ray

    thread = threading.Thread(target=ray.shutdown, daemon=True)
    thread.start()
    thread.join(_SHUTDOWN_S)
    os.killpg(0, signal.SIGKILL)


def main() -> None:
    import ray

    ray.init(
        address="local",
        include_dashboard=False,
        log_to_driver=False,
        logging_level=logging.ERROR,
    )
    # NOTE: after ray.init, which installs handlers of its own.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _stop)
    # NOTE: a new local cluster turns Ray's token authentication on; the driver must know.
    mode = os.environ.get("RAY_AUTH_MODE", "disabled")
    sys.stdout.write(f"{ray.get_runtime_context().gcs_address} {mode}\n")
    sys.stdout.flush()
    try:
        sys.stdin.buffer.read()
    finally:
        _stop()


if __name__ == "__main__":
    main()
