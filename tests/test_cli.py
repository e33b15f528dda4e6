"""Tests for the `vbatch` CLI: fast light --help, docs in sync, clean errors, one real-model job."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
from typer.testing import CliRunner

from vbatch.cli import app

DOCS = Path(__file__).parents[1] / "docs" / "cli.md"
MARKER = "<!-- generated: python -m typer vbatch.cli utils docs --name vbatch -->\n"
HEAVY_MODULES = ("torch", "transformers", "zmq", "pyarrow", "tokenizers", "vbatch.llm")


def test_help_is_fast_and_imports_nothing_heavy() -> None:
    script = (
        "import sys, time\n"
        "t = time.perf_counter()\n"
        "from vbatch.cli import main\n"
        "sys.argv = ['vbatch', 'run', '--help']\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        f"heavy = [m for m in {HEAVY_MODULES!r} if m in sys.modules]\n"
        "print(repr((heavy, time.perf_counter() - t)), file=sys.stderr)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert "--max-tokens" in proc.stdout and "--commit-every-rows" in proc.stdout
    heavy, seconds = ast.literal_eval(proc.stderr.strip().splitlines()[-1])
    assert heavy == []
    assert seconds < 3.0


def test_docs_cli_md_matches_the_typer_app() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "typer", "vbatch.cli", "utils", "docs", "--name", "vbatch"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    documented = DOCS.read_text().split(MARKER, 1)[1]
    assert documented == proc.stdout, "docs/cli.md is stale; regenerate its reference section"


def test_user_errors_print_one_line_without_traceback(tmp_path: Path) -> None:
    runner = CliRunner()
    result = runner.invoke(
        app, ["run", str(tmp_path / "nope.jsonl"), "-o", str(tmp_path / "o.jsonl")]
    )
    assert result.exit_code == 1
    assert "error: input file" in result.output and "does not exist" in result.output
    assert "Traceback" not in result.output and result.exception is not None
    result = runner.invoke(app, ["status", str(tmp_path / "o.jsonl")])
    assert result.exit_code == 1 and "there is no job for" in result.output
    result = runner.invoke(app, ["resume", str(tmp_path / "o.jsonl")])
    assert result.exit_code == 1 and "no job to resume" in result.output


def test_real_model_chat_job_end_to_end(tmp_path: Path) -> None:
    rows = [
        {
            "id": "capital",
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
        },
        {"id": "color", "messages": [{"role": "user", "content": "Name a color."}]},
        {
            "id": "math",
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What is 2 + 2?"},
            ],
        },
    ]
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    started = time.perf_counter()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "vbatch.cli",
            "run",
            "chats.jsonl",
            "-o",
            "out.parquet",
            "--max-tokens",
            "12",
            "--num-threads",
            "1",
            "--keep-columns",
            "messages",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    assert "wrote out.parquet: 3 rows, 0 errored" in proc.stderr
    table = pq.read_table(tmp_path / "out.parquet")
    assert table.column_names[:16] == [
        "id",
        "index",
        "text",
        "texts",
        "finish_reason",
        "finish_reasons",
        "stop_reason",
        "prompt_tokens",
        "completion_tokens",
        "cached_tokens",
        "token_ids",
        "logprobs",
        "ttft_s",
        "latency_s",
        "error",
        "structured_complete",
    ]
    assert table.column_names[16:] == ["messages"]
    out = {r["id"]: r for r in table.to_pylist()}
    assert set(out) == {"capital", "color", "math"}
    assert all(r["text"] and r["finish_reason"] in ("stop", "length") for r in out.values())
    assert all(0 < r["completion_tokens"] <= 12 and r["prompt_tokens"] > 5 for r in out.values())
    assert "Paris" in out["capital"]["text"]
    status = subprocess.run(
        [sys.executable, "-m", "vbatch.cli", "status", "out.parquet", "--json"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    info = json.loads(status.stdout)
    assert (info["complete"], info["done"], info["remaining"]) == (True, 3, 0)
    print(f"real-model job took {time.perf_counter() - started:.1f} s")
