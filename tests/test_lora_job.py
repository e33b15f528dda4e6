"""A `vbatch run` job whose rows name three LoRA adapters and the base model: the tokens PEFT
gives, each row exactly once after a SIGKILL and a resume, a changed or moved adapter refused
on resume;
and how rows pick their adapter."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
import torch
from test_lora import write_adapters

from vbatch.client.tokenizer import TextTokenizer
from vbatch.job.rows import ColumnOptions, LoraRows, RowParser
from vbatch.sampling_params import SamplingParams

NUM_ROWS = 48
ADAPTERS = ("a0", "a1", "a2", None)


@pytest.fixture(scope="module")
def job_dir(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Any, list]:
    from transformers import LlamaForCausalLM

    root = tmp_path_factory.mktemp("lora-job")
    reference = LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    peft_models = write_adapters(reference, root, fused=False)
    lines = []
    for i in range(NUM_ROWS):
        row: dict[str, Any] = {"id": f"r{i}", "prompt": f"Shared preamble for all. Item {i}:"}
        if ADAPTERS[i % 4] is not None:
            row["lora"] = ADAPTERS[i % 4]
        lines.append(orjson.dumps(row))
    (root / "in.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    return root, reference, peft_models


def vbatch(*args: str) -> list[str]:
    return [sys.executable, "-m", "vbatch", *args]


def test_job_with_three_adapters_matches_peft_and_resumes_once(
    job_dir: tuple, tiny_model_dir: Path, greedy_check: Callable
) -> None:
    root, reference, peft_models = job_dir
    output = root / "out.jsonl"
    args = [
        "run", "in.jsonl", "-o", str(output), "--model", str(tiny_model_dir),
        *(f"--lora={name}={name}" for name in ADAPTERS if name),
        "--max-loras", "2", "--max-tokens", "6", "--include-token-ids", "--max-num-seqs", "4",
        "--num-threads", "1", "--commit-every-rows", "4", "-q",
    ]  # fmt: skip
    proc = subprocess.Popen(vbatch(*args), cwd=root, stderr=subprocess.PIPE, text=True)
    journal = root / "out.jsonl.vbatch" / "journal.jsonl"
    deadline = time.monotonic() + 240
    while proc.poll() is None and (not journal.exists() or journal.read_bytes().count(b"\n") < 3):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    proc.kill()
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL, f"the job ended before it was killed: {stderr}"
    config = root / "a1" / "adapter_config.json"
    original = config.read_bytes()
    config.write_bytes(original + b"\n")
    refused = subprocess.run(vbatch("resume", str(output), "-q"), cwd=root, capture_output=True)
    assert refused.returncode != 0 and b"LoRA adapter 'a1' changed" in refused.stderr
    config.write_bytes(original)
    (root / "a1").rename(root / "a1-moved")
    gone = subprocess.run(
        vbatch("resume", str(output), "--force", "-q"), cwd=root, capture_output=True
    )
    assert gone.returncode != 0 and b"LoRA adapter 'a1' is missing from" in gone.stderr
    (root / "a1-moved").rename(root / "a1")
    done = subprocess.run(vbatch("resume", str(output), "-q"), cwd=root, capture_output=True)
    assert done.returncode == 0, done.stderr
    rows = [orjson.loads(line) for line in output.read_bytes().splitlines()]
    assert sorted(row["id"] for row in rows) == sorted(f"r{i}" for i in range(NUM_ROWS))
    tokenizer = TextTokenizer.from_dir(tiny_model_dir)
    models = dict(zip(ADAPTERS, [*peft_models, reference], strict=True))
    for row in rows:
        i = row["index"]
        assert row["error"] is None and row.get("lora") == ADAPTERS[i % 4]
        (prompt_ids,) = tokenizer.encode_batch([f"Shared preamble for all. Item {i}:"])
        greedy_check(models[ADAPTERS[i % 4]], [prompt_ids], row["token_ids"])


def test_rows_pick_their_adapter() -> None:
    loras = LoraRows(("a", "b"), column="adapter", default="b")
    parser = RowParser(ColumnOptions(), SamplingParams(), loras=loras)
    assert parser.parse({"prompt": "x", "adapter": "a"}, 0, "line 1").lora == "a"
    assert parser.parse({"prompt": "x"}, 1, "line 2").lora == "b"
    unknown = parser.parse({"prompt": "x", "adapter": "c"}, 2, "line 3")
    assert unknown.error is not None and "'c' is not a LoRA adapter" in unknown.error
    line = {"custom_id": "q", "url": "/v1/completions", "body": {"prompt": "x", "model": "a"}}
    assert parser.parse(line, 3, "line 4").lora == "a"
    line["body"]["model"] = "base-model"
    assert parser.parse(line, 4, "line 5").lora == "b"
    plain = RowParser(ColumnOptions(), SamplingParams())
    assert plain.parse({"prompt": "x", "lora": "zz"}, 5, "line 6").lora is None


def test_an_adapter_the_model_cannot_take_keeps_no_job(
    job_dir: tuple, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Like a bad setting, an adapter made for another base model fails the same way on every
    start: the new job is dropped, with no resume hint, and a fixed command runs."""
    from safetensors.torch import load_file, save_file

    root, _, _ = job_dir
    other = tmp_path / "other"
    other.mkdir()
    (other / "adapter_config.json").write_bytes((root / "a0" / "adapter_config.json").read_bytes())
    tensors = load_file(root / "a0" / "adapter_model.safetensors")
    wide = {k: torch.zeros(v.shape[0], 96) if "lora_A" in k else v for k, v in tensors.items()}
    save_file(wide, other / "adapter_model.safetensors")
    output = tmp_path / "out.jsonl"
    base = ["run", str(root / "in.jsonl"), "-o", str(output), "--model", str(tiny_model_dir)]
    run = [*base, "--max-tokens", "1", "--num-threads", "1", "-q"]
    failed = subprocess.run(
        vbatch(*run, f"--lora=a0={other}"), capture_output=True, text=True, timeout=300
    )
    assert failed.returncode == 1, failed.stderr
    assert "made for another base model" in failed.stderr and "Resume" not in failed.stderr
    assert "no job was kept" in failed.stderr
    assert not Path(f"{output}.vbatch").exists()
    fixed = subprocess.run(
        vbatch(*run, f"--lora=a0={root / 'a0'}"), capture_output=True, text=True, timeout=300
    )
    assert fixed.returncode == 0, fixed.stderr
