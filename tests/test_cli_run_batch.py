"""`vbatch run-batch`: vLLM's run-batch command line mapped onto `vbatch run`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_run_batch_runs_an_openai_batch_file_as_vbatch_run(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    lines = [
        {
            "custom_id": f"request-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                # NOTE: as with vLLM, the line names the served model: --model as given, or a
                # --served-model-name.
                "model": str(tiny_model_dir) if i == 0 else "other-name",
                "messages": [{"role": "user", "content": f"Hello {i}"}],
                "max_completion_tokens": 3,
            },
        }
        for i in range(2)
    ]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    args = ["run-batch", "-i", "in.jsonl", "-o", "out.jsonl", "--model", str(tiny_model_dir)]
    args += ["--num-threads", "1", "--response-role", "assistant", "-q"]
    # NOTE: flags vLLM's run-batch is commonly given: a real setting, ignored ones, one of 1.
    # NOTE: vLLM's --served-model-name takes every name that follows it.
    args += ["--served-model-name", "my-model", "other-name", "--gpu-memory-utilization", "0.9"]
    args += ["--enable-prefix-caching", "--tensor-parallel-size", "1", "--disable-log-requests"]
    args += ["--enable-metrics", "--enable-prompt-tokens-details"]
    proc = subprocess.run(
        [sys.executable, "-m", "vbatch", *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "ignores --response-role" in proc.stderr
    out = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert sorted(row["custom_id"] for row in out) == ["request-0", "request-1"]
    assert all(row["response"]["status_code"] == 200 for row in out), out
    assert {row["response"]["body"]["model"] for row in out} == {"my-model"}
    assert "ignores --enable-prefix-caching" in proc.stderr
    assert "ignores --enable-metrics" in proc.stderr
    # NOTE: it is a vbatch job: its journal is there to resume from.
    assert (tmp_path / "out.jsonl.vbatch").is_dir()


def test_run_batch_refuses_more_than_one_tensor_parallel_rank(tmp_path: Path) -> None:
    args = ["run-batch", "-i", "in.jsonl", "-o", "out.jsonl", "--tensor-parallel-size", "2"]
    proc = subprocess.run(
        [sys.executable, "-m", "vbatch", *args], cwd=tmp_path, capture_output=True, text=True
    )
    assert proc.returncode == 2 and "use -dp N" in proc.stderr
    assert not list(tmp_path.iterdir())


def test_a_first_line_missing_its_body_is_an_openai_error_line(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """The first line decides the output's format: one with custom_id, method and url but no
    body is still an OpenAI line (an error one), so the rest stay OpenAI lines too."""
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    head = {"method": "POST", "url": "/v1/chat/completions"}
    lines = [{"custom_id": "bad", **head, "bdy": body}, {"custom_id": "good", **head, "body": body}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    args = ["run-batch", "-i", "in.jsonl", "-o", "out.jsonl", "--model", str(tiny_model_dir)]
    proc = subprocess.run(
        [sys.executable, "-m", "vbatch", *args, "--num-threads", "1", "-q"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert "Traceback" not in proc.stderr, proc.stderr
    out = {row["custom_id"]: row for row in map(json.loads, (tmp_path / "out.jsonl").open())}
    assert out["bad"]["response"] is None
    assert "needs a 'body' object" in out["bad"]["error"]["message"]
    assert out["good"]["error"] is None and out["good"]["response"]["status_code"] == 200
