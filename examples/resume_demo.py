"""Interrupt a job with SIGTERM, show `vbatch status`, resume it: every row comes out once."""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

INPUT = Path(__file__).with_name("prompts.jsonl")


def vbatch(*args: str) -> list[str]:
    print(f"$ vbatch {shlex.join(args)}", flush=True)
    return [sys.executable, "-m", "vbatch", *args]


def wait_for_commit(job: subprocess.Popen[bytes], metrics: Path) -> None:
    """Until the job's metrics file shows durable rows (it is rewritten about once a second)."""
    while job.poll() is None:
        try:
            if json.loads(metrics.read_text())["rows_committed"] > 0:
                return
        except (FileNotFoundError, json.JSONDecodeError):
            pass
        time.sleep(0.2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", help="HF model directory or .gguf (default: SmolLM2-135M)")
    parser.add_argument("--workdir", type=Path, help="where the output goes (default: a temp dir)")
    args = parser.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="vbatch-resume-demo-"))
    output, metrics = workdir / "answers.jsonl", workdir / "metrics.json"
    model = ["--model", args.model] if args.model else []
    run = vbatch(
        "run", str(INPUT), "-o", str(output), "--max-tokens", "64", "--max-in-flight", "1",
        "--commit-every-rows", "2", "--metrics-file", str(metrics), *model,
    )  # fmt: skip
    job = subprocess.Popen(run)
    wait_for_commit(job, metrics)
    print("# rows are committed: sending SIGTERM (as a preemption or `kill` would)", flush=True)
    job.send_signal(signal.SIGTERM)
    code = job.wait()
    print(f"# exit status {code} (75: interrupted, resumable)", flush=True)
    if code != 75:
        sys.exit(f"expected the job to be interrupted, but it exited with {code}")
    subprocess.run(vbatch("status", str(output)), check=True)
    subprocess.run(vbatch("resume", str(output)), check=True)
    ids = [json.loads(line)["id"] for line in output.read_text().splitlines()]
    expected = [json.loads(line)["id"] for line in INPUT.read_text().splitlines()]
    print(f"# {output}: {len(ids)} rows, {len(set(ids))} distinct ids, {len(expected)} inputs")
    if sorted(ids) != sorted(expected):
        sys.exit("the resumed output does not hold every input row exactly once")


if __name__ == "__main__":
    main()
