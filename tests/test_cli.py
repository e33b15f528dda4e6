"""Tests for the `vbatch` CLI: fast light --help, docs in sync, clean errors, one real-model job."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import typer
from typer.testing import CliRunner

from vbatch import __version__
from vbatch.cli import app
from vbatch.job.runner import RunOptions

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


def test_version_and_short_help_on_the_app_and_every_command() -> None:
    runner = CliRunner()
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output == f"vbatch {__version__}\n"
    for args in ([], ["run"], ["resume"], ["status"]):
        short, long = runner.invoke(app, [*args, "-h"]), runner.invoke(app, [*args, "--help"])
        assert short.exit_code == 0 and "Usage: vbatch" in short.output, args
        assert short.output == long.output


def test_run_and_resume_take_their_defaults_from_run_options() -> None:
    defaults = RunOptions()
    commands = typer.main.get_command(app).commands  # type: ignore[attr-defined]
    run_params = {p.name: p.default for p in commands["run"].params}
    for name in ("commit_every_rows", "commit_every_seconds", "drain_timeout", "log_interval"):
        assert run_params[name] == getattr(defaults, name), name
    resume_params = {p.name: p.default for p in commands["resume"].params}
    assert resume_params["log_interval"] == defaults.log_interval


def test_quiet_job_prints_nothing(tmp_path: Path, tiny_model_dir: Path) -> None:
    rows = [{"id": f"r{i}", "prompt": f"item {i}:"} for i in range(3)]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    flags = ["--model", str(tiny_model_dir), "--max-tokens", "4", "--num-threads", "1"]
    for args in (
        ["run", "in.jsonl", "-o", "out.jsonl", *flags, "-q"],
        ["resume", "out.jsonl", "-q"],
    ):
        proc = subprocess.run(
            [sys.executable, "-m", "vbatch.cli", *args],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr
        assert (proc.stdout, proc.stderr) == ("", ""), args
    assert len((tmp_path / "out.jsonl").read_text().splitlines()) == 3


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


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--chat-template-kwargs", "{enable_thinking: false}"],
            "--chat-template-kwargs is not valid JSON",
        ),
        (["--chat-template-kwargs", "[1]"], "--chat-template-kwargs must be a JSON object"),
        (
            ["--chat-template-kwargs", '{"messages": []}'],
            "--chat-template-kwargs may not set 'messages'",
        ),
        (["--reasoning-parser", "r1"], "unknown reasoning parser 'r1'; choose one of think"),
    ],
)
def test_bad_chat_template_kwargs_and_reasoning_parser_are_one_line_errors(
    tmp_path: Path, flags: list[str], message: str
) -> None:
    source = tmp_path / "in.jsonl"
    source.write_text('{"prompt": "hi"}\n')
    output = tmp_path / "o.jsonl"
    result = CliRunner().invoke(app, ["run", str(source), "-o", str(output), *flags])
    assert result.exit_code == 1
    assert result.output.startswith(f"error: {message}") and result.output.count("\n") == 1
    assert not output.exists() and not (tmp_path / "o.jsonl.vbatch").exists()
