"""benchmarks/step_times.py on a tiny model: every step is counted once, as decode-only or as
one with prompt tokens, and the profiled step's table is printed."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from benchmarks import step_times


def test_step_times_splits_the_steps_and_profiles_one(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--model", str(tiny_model_dir), "--num-prompts", "3", "--max-tokens", "4"]
    monkeypatch.setattr(sys, "argv", ["step_times.py", *args, "--profile-step", "1"])
    step_times.main()
    out = capsys.readouterr().out
    total = re.search(r"^12 tokens in [\d.]+ s \([\d.]+ tok/s\), (\d+) steps$", out, re.M)
    decode = re.search(r"^decode-only steps: (\d+),", out, re.M)
    prefill = re.search(r"^steps with prompt tokens: (\d+),", out, re.M)
    assert total and decode and prefill, out
    assert int(decode[1]) + int(prefill[1]) == int(total[1])
    assert int(decode[1]) >= 3 and int(prefill[1]) >= 1
    assert re.search(r"^step 1: \d+ tokens, \d+ sampled", out, re.M)
    assert "Self CPU" in out
