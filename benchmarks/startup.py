"""Start-up: the bundled GGUF's conversion against transformers' own GGUF loading, and a warm
one-row `vbatch run`, each in a fresh process; medians of wall and CPU seconds, with the load.

python -m benchmarks.startup [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONVERT = "from vbatch.models.loader import resolve_model; resolve_model(None)"
TRANSFORMERS_LOAD = (
    "import torch; from transformers import AutoModelForCausalLM, AutoTokenizer; "
    "from vbatch.models.loader import default_model_path; p = default_model_path(); "
    "AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name); "
    "AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name, dtype=torch.float32)"
)


def timed(command: list[str], env: dict[str, str]) -> tuple[float, float]:
    """Wall and CPU (user + sys, children included) seconds of one command."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(command, env={**os.environ, **env}, check=True, capture_output=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime


def report(name: str, runs: list[tuple[float, float]]) -> float:
    wall = statistics.median(w for w, _ in runs)
    cpu = statistics.median(c for _, c in runs)
    print(f"{name:<34} wall {wall:6.1f} s   cpu {cpu:6.1f} s   (runs: {len(runs)})")
    return wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(f"load average at start: {os.getloadavg()}")
    convert, reference, warm = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        row = Path(tmp) / "one.jsonl"
        row.write_text('{"prompt": "Say hi"}\n')
        # NOTE: the warm runs use the environment's cache, as a user's runs after install do.
        subprocess.run([sys.executable, "-m", "vbatch.prepare"], check=True)
        run = [
            sys.executable,
            "-m",
            "vbatch",
            "run",
            str(row),
            "-o",
            str(Path(tmp) / "o.jsonl"),
        ]
        run += ["--max-tokens", "16", "--overwrite", "-q"]
        for index in range(args.rounds):
            fresh = {"VBATCH_CACHE_DIR": str(Path(tmp) / f"fresh{index}")}
            convert.append(timed([sys.executable, "-c", CONVERT], fresh))
            reference.append(timed([sys.executable, "-c", TRANSFORMERS_LOAD], fresh))
            warm.append(timed(run, {}))
    ours = report("vbatch GGUF conversion (cold)", convert)
    theirs = report("transformers GGUF tokenizer+model", reference)
    report("warm one-row vbatch run", warm)
    print(f"transformers / vbatch conversion: {theirs / ours:.2f}x")
    print(f"load average at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
