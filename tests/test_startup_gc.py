"""The garbage collector during a core's start-up: paused until READY, then running with the
start-up's objects frozen out of it (engine/startup_gc.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

# NOTE: a fresh interpreter, so that freezing the collector touches no test process.
SERVE = """
import gc, json, os, queue, sys
from vbatch.config import EngineConfig
from vbatch.engine.core_process import _serve, _Watchdog
from vbatch.engine.startup_gc import pause_collection
from vbatch.protocol import Ready, Shutdown

runs = []
gc.callbacks.append(lambda phase, info: runs.append(phase) if phase == "start" else None)
at_ready = {}

class Outputs(queue.Queue):
    def put(self, item, block=True, timeout=None):
        if isinstance(item, Ready):
            at_ready.update(collections=len(runs), enabled=gc.isenabled())
        super().put(item, block, timeout)

pause_collection()
config = EngineConfig(model=sys.argv[1], num_threads=1, max_model_len=64)
in_q, out_q = queue.Queue(), Outputs()
in_q.put(Shutdown())
code = _serve(config, in_q, out_q, _Watchdog(config, os.getpid(), None, out_q))
gc.collect()
print(json.dumps(dict(
    code=code, at_ready=at_ready, enabled=gc.isenabled(), frozen=gc.get_freeze_count(),
    collections=len(runs),
)))
"""


def test_a_core_collects_nothing_until_ready_then_skips_what_it_built(
    tiny_model_dir: Path,
) -> None:
    done = subprocess.run(
        [sys.executable, "-c", SERVE, str(tiny_model_dir)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["code"] == 0
    assert result["at_ready"] == {"collections": 0, "enabled": False}
    assert result["enabled"]
    assert result["collections"] >= 1
    # NOTE: torch and the engine alone are well over 100k objects.
    assert result["frozen"] > 100_000
