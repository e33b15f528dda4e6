"""Every example in examples/README.md runs as its command says, on the tiny model, and works."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import pyarrow.parquet as pq
import pytest
import typer
from helpers import read_jsonl

from vbatch.cli import app, parsed_params, run_request
from vbatch.job.runner import start_job

EXAMPLES = Path(__file__).parents[1] / "examples"
FAST = ["--max-tokens", "8", "--num-threads", "1", "-q"]


def listed_examples() -> dict[str, str]:
    """Example file -> its command, from the table in examples/README.md."""
    rows = (EXAMPLES / "README.md").read_text().splitlines()
    cells = [row.strip("|").split(" | ") for row in rows if row.startswith("| `")]
    return {c[0].strip(" `"): c[-1].strip(" `") for c in cells}


def input_ids(name: str) -> list[Any]:
    rows = [json.loads(line) for line in (EXAMPLES / name).read_text().splitlines()]
    return [r.get("id", r.get("custom_id")) for r in rows]


def check_plain(out: Path) -> None:
    rows = read_jsonl(out / "plain.jsonl")
    assert [r["id"] for r in rows] != [] and sorted(r["id"] for r in rows) == sorted(
        input_ids("plain.jsonl")
    )
    assert all(r["error"] is None and 0 < r["completion_tokens"] <= 8 for r in rows)


def check_chat(out: Path) -> None:
    rows = pq.read_table(out / "chat.parquet").to_pylist()
    assert sorted(r["id"] for r in rows) == sorted(input_ids("prompts.jsonl"))
    assert all(r["error"] is None and r["prompt_tokens"] > 10 for r in rows)


def check_openai_batch(out: Path) -> None:
    lines = read_jsonl(out / "openai_batch.jsonl")
    assert sorted(line["custom_id"] for line in lines) == sorted(input_ids("openai_batch.jsonl"))
    bodies = {line["custom_id"]: line["response"]["body"] for line in lines}
    assert all(line["error"] is None for line in lines)
    assert bodies["chat-1"]["object"] == "chat.completion"
    assert isinstance(bodies["chat-1"]["choices"][0]["message"]["content"], str)
    assert bodies["text-1"]["object"] == "text_completion"
    assert bodies["chat-3"]["choices"][0]["logprobs"]["content"][0]["top_logprobs"]


def check_products(out: Path) -> None:
    table = pq.read_table(out / "products.parquet")
    assert table.column_names[-2:] == ["category", "price"]
    source = pq.read_table(EXAMPLES / "products.parquet").to_pylist()
    expected = {r["sku"]: (r["category"], r["price"]) for r in source}
    assert {r["id"]: (r["category"], r["price"]) for r in table.to_pylist()} == expected


def check_labels(out: Path) -> None:
    rows = read_jsonl(out / "labels.jsonl")
    assert len(rows) == 6
    assert all(r["text"] in ("positive", "negative", "neutral") for r in rows)


def check_people(out: Path) -> None:
    schema = json.loads((EXAMPLES / "extract_schema.json").read_text())
    rows = pq.read_table(out / "people.parquet").to_pylist()
    assert len(rows) == 4
    for row in rows:
        assert row["structured_complete"], row
        jsonschema.validate(json.loads(row["json"]), schema)


# NOTE: example -> (flags added to its command, the check of what it wrote).
JOBS: dict[str, tuple[list[str], Callable[[Path], None]]] = {
    "plain.jsonl": (FAST, check_plain),
    "prompts.jsonl": (FAST, check_chat),
    "openai_batch.jsonl": (FAST, check_openai_batch),
    "products.parquet": (FAST, check_products),
    "classify.jsonl": (FAST, check_labels),
    "extract.jsonl": (["--num-threads", "1", "-q"], check_people),
}
SCRIPTS = ("generate.py", "stream.py", "resume_demo.py")


def test_every_example_is_listed_with_a_command_and_checked() -> None:
    listed = listed_examples()
    files = {p.name for p in EXAMPLES.iterdir() if p.name != "README.md"}
    files -= {p.name for p in EXAMPLES.glob("out*")}
    text = (EXAMPLES / "README.md").read_text()
    assert all(name in text for name in files), "describe every file in examples/README.md"
    assert set(listed) == set(JOBS) | set(SCRIPTS)
    for name, command in listed.items():
        assert f"examples/{name}" in command, name


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of the repository's examples/, as the current directory (outputs land in it)."""
    shutil.copytree(EXAMPLES, tmp_path / "examples", ignore=shutil.ignore_patterns("out*"))
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("name", list(JOBS))
def test_job_example_runs_as_its_command_says(
    name: str, workdir: Path, tiny_model_dir: Path, shared_llm: Callable[..., Any]
) -> None:
    """The command goes through the real CLI parser and run_request; the job runs on the
    module's shared engine instead of starting one per example."""
    if name in ("classify.jsonl", "extract.jsonl"):
        pytest.importorskip("xgrammar")
    flags, check = JOBS[name]
    program, command, *args = shlex.split(listed_examples()[name])
    assert (program, command) == ("vbatch", "run")
    argv = [*args, "--model", str(tiny_model_dir), *flags]
    run = typer.main.get_command(app).commands["run"]  # type: ignore[attr-defined]
    request = run_request(parsed_params(run.make_context("run", argv)))
    outcome = start_job(request.spec, request.options, llm_factory=shared_llm)
    assert outcome.exit_code == 0, outcome.message
    check(workdir / "examples" / "out")


def run_script(name: str, workdir: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    program, script, *args = shlex.split(listed_examples()[name])
    assert (program, script) == ("python", f"examples/{name}")
    return subprocess.run(
        [sys.executable, script, *args, *flags],
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_generate_example_prints_an_answer_per_prompt(workdir: Path, tiny_model_dir: Path) -> None:
    proc = run_script("generate.py", workdir, "--model", str(tiny_model_dir), "--max-tokens", "6")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("### ") == 4
    assert "### What is the capital of France?\n" in proc.stdout


def test_stream_example_prints_and_saves_every_result(workdir: Path, tiny_model_dir: Path) -> None:
    proc = run_script("stream.py", workdir, "--model", str(tiny_model_dir), "--max-tokens", "6")
    assert proc.returncode == 0, proc.stderr
    printed = [line for line in proc.stdout.splitlines() if line.startswith("[")]
    saved = read_jsonl(workdir / "examples" / "out" / "stream.jsonl")
    assert len(printed) == len(saved) == 8
    assert sorted(r["index"] for r in saved) == list(range(8))
    assert all(r["prompt"].startswith("One interesting fact about") for r in saved)


# NOTE: four processes and two engine starts (38 s on a busy 2-core host); test_chaos covers
# the same interrupt, status and resume in the default run.
@pytest.mark.slow
def test_resume_demo_interrupts_shows_status_and_resumes(
    workdir: Path, tiny_model_dir: Path
) -> None:
    proc = run_script(
        "resume_demo.py", workdir, "--model", str(tiny_model_dir), "--workdir", str(workdir)
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "# exit status 75" in proc.stdout and "(incomplete)" in proc.stdout
    assert "$ vbatch resume" in proc.stdout
    assert "24 rows, 24 distinct ids, 24 inputs" in proc.stdout
    assert len(read_jsonl(workdir / "answers.jsonl")) == 24
