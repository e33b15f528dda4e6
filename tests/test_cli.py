"""Tests for the `vbatch` CLI: fast light --help, docs in sync, clean errors, one real-model job."""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import click
import pyarrow.parquet as pq
import pytest
import typer
from typer.testing import CliRunner

from vbatch import __version__
from vbatch.cli import app, parsed_params, resume_request, run_request
from vbatch.engine_sets.base import RaySettings
from vbatch.job.options import JOB_SAMPLING, RunOptions
from vbatch.job.rows import ColumnOptions
from vbatch.job.shard import Shard
from vbatch.sampling_params import SamplingParams

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
    for args in ([], ["run"], ["resume"], ["status"], ["merge"]):
        short, long = runner.invoke(app, [*args, "-h"]), runner.invoke(app, [*args, "--help"])
        assert short.exit_code == 0 and "Usage: vbatch" in short.output, args
        assert short.output == long.output


RUN_BASE = ["in.jsonl", "-o", "out.jsonl"]
# NOTE: every `run` option, a non-default value for it, and where that value must arrive.
RUN_OPTIONS: dict[str, tuple[list[str], str, Any]] = {
    "input_path": ([], "spec.input_path", Path("in.jsonl")),
    "output_path": ([], "spec.output_path", Path("out.jsonl")),
    "input_format": (["--input-format", "parquet"], "spec.input_format", "parquet"),
    "prompt_column": (["--prompt-column", "q"], "spec.columns.prompt_column", "q"),
    "messages_column": (["--messages-column", "m"], "spec.columns.messages_column", "m"),
    "id_column": (["--id-column", "key"], "spec.columns.id_column", "key"),
    # NOTE: a name given twice is one column (twice, a Parquet output had it twice, unreadable).
    "keep_columns": (["--keep-columns", "a, b,a"], "spec.columns.keep_columns", ("a", "b")),
    "keep_all_columns": (["--keep-all-columns"], "spec.columns.keep_all_columns", True),
    "model": (["--model", "m.gguf"], "spec.model", "m.gguf"),
    "served_model_names": (
        ["--served-model-name", "a", "--served-model-name", "b"],
        "spec.served_model_names",
        ("a", "b"),
    ),
    "gpu_memory_utilization": (
        ["--gpu-memory-utilization", "0.5"],
        "spec.engine_args.gpu_memory_utilization",
        0.5,
    ),
    "chat_template_kwargs": (
        ["--chat-template-kwargs", '{"enable_thinking": false}'],
        "spec.chat_template_kwargs",
        {"enable_thinking": False},
    ),
    "reasoning_parser": (["--reasoning-parser", "qwen3"], "spec.reasoning_parser", "qwen3"),
    "task": (["--task", "embed"], "spec.task", "embed"),
    "dimensions": (["--dimensions", "32"], "spec.dimensions", 32),
    "shard": (["--shard", "1/3"], "spec.shard", Shard(1, 3)),
    "use_ray": (["--ray"], "options.ray", RaySettings()),
    "ray_address": (["--ray", "--ray-address", "h:1"], "options.ray.address", "h:1"),
    "replicas": (["--ray", "--replicas", "3"], "options.ray.replicas", 3),
    "gpus_per_replica": (["--ray", "--gpus-per-replica", "1"], "options.ray.gpus_per_replica", 1.0),
    "cpus_per_replica": (["--ray", "--cpus-per-replica", "2"], "options.ray.cpus_per_replica", 2.0),
    "max_restarts": (["--ray", "--max-restarts", "4"], "options.ray.max_restarts", 4),
    "device": (["--device", "cpu"], "spec.engine_args.device", "cpu"),
    "dtype": (["--dtype", "bfloat16"], "spec.engine_args.dtype", "bfloat16"),
    "max_num_seqs": (["--max-num-seqs", "7"], "spec.engine_args.max_num_seqs", 7),
    "lora": (["--lora", "a=/x"], "spec.engine_args.loras", (("a", "/x"),)),
    "lora_column": (["--lora", "a=/x", "--lora-column", "ad"], "spec.lora_rows.column", "ad"),
    "lora_default": (["--lora", "a=/x", "--lora-default", "a"], "spec.lora_rows.default", "a"),
    "max_loras": (["--max-loras", "2"], "spec.engine_args.max_loras", 2),
    "max_lora_rank": (["--max-lora-rank", "8"], "spec.engine_args.max_lora_rank", 8),
    "max_num_batched_tokens": (
        ["--max-num-batched-tokens", "64"],
        "spec.engine_args.max_num_batched_tokens",
        64,
    ),
    "max_model_len": (["--max-model-len", "99"], "spec.engine_args.max_model_len", 99),
    "kv_cache_memory_gb": (
        ["--kv-cache-memory", "0.5"],
        "spec.engine_args.kv_cache_memory_gb",
        0.5,
    ),
    "attention_backend": (
        ["--attention-backend", "torch"],
        "spec.engine_args.attention_backend",
        "torch",
    ),
    "num_threads": (["--num-threads", "3"], "spec.engine_args.num_threads", 3),
    "data_parallel_size": (["--data-parallel-size", "2"], "options.data_parallel_size", 2),
    "kv_cache_dtype": (
        ["--kv-cache-dtype", "float16"],
        "spec.engine_args.kv_cache_dtype",
        "float16",
    ),
    "quantization": (["--quantization", "int8"], "spec.engine_args.quantization", "int8"),
    "enforce_eager": (["--enforce-eager"], "spec.engine_args.enforce_eager", True),
    "max_graph_batch_size": (
        ["--max-graph-batch-size", "8"],
        "spec.engine_args.max_graph_batch_size",
        8,
    ),
    "async_scheduling": (["--async-scheduling"], "spec.engine_args.async_scheduling", True),
    "greedy_screen": (["--no-greedy-screen"], "spec.engine_args.greedy_screen", False),
    "batch_invariant": (["--batch-invariant"], "spec.engine_args.batch_invariant", True),
    "linear_backend": (["--linear-backend", "onednn"], "spec.engine_args.linear_backend", "onednn"),
    "heartbeat_timeout_s": (
        ["--heartbeat-timeout", "9"],
        "spec.engine_args.heartbeat_timeout_s",
        9.0,
    ),
    "max_tokens": (["--max-tokens", "5"], "spec.sampling.max_tokens", 5),
    "temperature": (["--temperature", "0.7"], "spec.sampling.temperature", 0.7),
    "top_p": (["--top-p", "0.9"], "spec.sampling.top_p", 0.9),
    "top_k": (["--top-k", "4"], "spec.sampling.top_k", 4),
    "min_p": (["--min-p", "0.1"], "spec.sampling.min_p", 0.1),
    "seed": (["--seed", "11"], "spec.sampling.seed", 11),
    "stop": (["--stop", "x", "--stop", "y"], "spec.sampling.stop", ["x", "y"]),
    "n": (["--n", "2"], "spec.sampling.n", 2),
    "logprobs": (["--logprobs", "3"], "spec.sampling.logprobs", 3),
    "include_token_ids": (["--include-token-ids"], "spec.include_token_ids", True),
    "json_schema": (
        ["--json-schema", "schema.json"],
        "spec.sampling.structured",
        {"json_schema": '{"type": "integer"}'},
    ),
    "regex": (["--regex", "[ab]+"], "spec.sampling.structured", {"regex": "[ab]+"}),
    "choice": (["--choice", "yes, no"], "spec.sampling.structured", {"choice": ["yes", "no"]}),
    "grammar": (
        ["--grammar", "g.ebnf"],
        "spec.sampling.structured",
        {"grammar": 'root ::= "a"'},
    ),
    "parse_json": (["--parse-json"], "spec.parse_json", True),
    "require_valid_json": (["--require-valid-json"], "spec.require_valid_json", True),
    "ordered": (["--ordered"], "spec.ordered", True),
    "overwrite": (["--overwrite"], "overwrite", True),
    "clean": (["--clean"], "options.clean", True),
    "commit_every_rows": (["--commit-every-rows", "3"], "options.commit_every_rows", 3),
    "commit_every_seconds": (
        ["--commit-every-seconds", "0.5"],
        "options.commit_every_seconds",
        0.5,
    ),
    "max_errors": (["--max-errors", "0.25"], "options.max_errors", 0.25),
    "drain_timeout_s": (["--drain-timeout", "2"], "options.drain_timeout_s", 2.0),
    "max_in_flight": (["--max-in-flight", "6"], "options.max_in_flight", 6),
    "quiet": (["-q"], "options.display", "quiet"),
    "log_interval_s": (["--log-interval", "1.5"], "options.log_interval_s", 1.5),
    "metrics_file": (["--metrics-file", "m.json"], "options.metrics_file", Path("m.json")),
}
RESUME_OPTIONS: dict[str, tuple[list[str], str, Any]] = {
    "output": ([], "output", Path("out.jsonl")),
    "force": (["--force"], "force", True),
    "retry_errors": (["--retry-errors"], "retry_errors", True),
    "clean": (["--clean"], "overrides.clean", True),
    "commit_every_rows": (["--commit-every-rows", "3"], "overrides.commit_every_rows", 3),
    "commit_every_seconds": (
        ["--commit-every-seconds", "0.5"],
        "overrides.commit_every_seconds",
        0.5,
    ),
    "max_errors": (["--max-errors", "4"], "overrides.max_errors", 4.0),
    "drain_timeout_s": (["--drain-timeout", "2"], "overrides.drain_timeout_s", 2.0),
    "max_in_flight": (["--max-in-flight", "6"], "overrides.max_in_flight", 6),
    "data_parallel_size": (["-dp", "2"], "overrides.data_parallel_size", 2),
    "ray_address": (["--ray-address", "head:6379"], "overrides.ray_address", "head:6379"),
    "quiet": (["-q"], "overrides.display", "quiet"),
    "log_interval_s": (["--log-interval", "1.5"], "overrides.log_interval_s", 1.5),
    "metrics_file": (["--metrics-file", "m.json"], "overrides.metrics_file", Path("m.json")),
}
MISSING = object()


def _command(name: str) -> click.Command:
    return typer.main.get_command(app).commands[name]  # type: ignore[attr-defined]


def _parsed(name: str, args: list[str]) -> dict[str, Any]:
    """The options as the real parser hands them to the command."""
    return parsed_params(_command(name).make_context(name, list(args)))


def _at(request: Any, path: str) -> Any:
    value = request
    for part in path.split("."):
        if value is None:
            return MISSING
        value = value.get(part, MISSING) if isinstance(value, dict) else getattr(value, part)
    return value


def test_every_run_option_arrives_where_it_belongs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "schema.json").write_text('{"type": "integer"}')
    (tmp_path / "g.ebnf").write_text('root ::= "a"')
    declared = {p.name for p in _command("run").params if p.name != "help"}
    assert declared == set(RUN_OPTIONS), "give each new option a row in RUN_OPTIONS"
    default = run_request(_parsed("run", RUN_BASE))
    for name, (args, path, expected) in RUN_OPTIONS.items():
        got = _at(run_request(_parsed("run", [*RUN_BASE, *args])), path)
        assert got == expected, name
        if args:
            assert _at(default, path) != expected, f"{name}: the test value is the default"


@pytest.mark.parametrize(
    ("name", "args", "paths"),
    [
        (
            "run",
            [*RUN_BASE, "--json-schema", "s.json", "--grammar", "g.ebnf", "--metrics-file", "m"],
            {"input_path", "output_path", "json_schema", "grammar", "metrics_file"},
        ),
        ("resume", ["out.jsonl", "--metrics-file", "m"], {"output", "metrics_file"}),
    ],
)
def test_path_options_arrive_as_paths_when_typer_leaves_them_as_str(
    name: str, args: list[str], paths: set[str]
) -> None:
    """Typer before 0.29 hands click's str to `ctx.params` for a Path option (a job then
    failed with "'str' object has no attribute 'with_name'")."""
    ctx = _command(name).make_context(name, args)
    assert {option for option, v in parsed_params(ctx).items() if isinstance(v, Path)} == paths
    ctx.params.update({option: str(ctx.params[option]) for option in paths})
    got = parsed_params(ctx)
    assert all(isinstance(got[option], Path) for option in paths)
    assert got == {**ctx.params, **{option: Path(ctx.params[option]) for option in paths}}


def test_every_resume_option_arrives_where_it_belongs() -> None:
    declared = {p.name for p in _command("resume").params if p.name != "help"}
    assert declared == set(RESUME_OPTIONS), "give each new option a row in RESUME_OPTIONS"
    default = resume_request(_parsed("resume", ["out.jsonl"]))
    assert default.overrides == {"display": "auto", "clean": False, "log_interval_s": 10.0}
    for name, (args, path, expected) in RESUME_OPTIONS.items():
        got = _at(resume_request(_parsed("resume", ["out.jsonl", *args])), path)
        assert got == expected, name
        if args:
            assert _at(default, path) != expected, f"{name}: the test value is the default"


def test_run_defaults_come_from_run_options_engine_config_and_job_sampling() -> None:
    request = run_request(_parsed("run", RUN_BASE))
    assert request.options == RunOptions()
    assert request.spec.engine_args == {}
    assert SamplingParams.from_dict(request.spec.sampling) == JOB_SAMPLING
    assert (request.spec.columns, request.overwrite) == (ColumnOptions(), False)


def test_run_and_resume_declare_their_shared_options_once() -> None:
    run_params = {p.name: p for p in _command("run").params}
    shared = [p for p in _command("resume").params if p.name in run_params and p.name != "help"]
    assert len(shared) == 11
    for param in shared:
        twin = run_params[param.name]
        assert (param.opts, param.help, param.rich_help_panel) == (  # type: ignore[attr-defined]
            twin.opts,
            twin.help,  # type: ignore[attr-defined]
            twin.rich_help_panel,  # type: ignore[attr-defined]
        ), param.name
        panel = twin.rich_help_panel  # type: ignore[attr-defined]
        assert panel in ("Engine", "Job", "Display", "Ray (many machines)"), param.name


def test_a_mistyped_choice_fails_at_parse_time_and_names_the_choices(tmp_path: Path) -> None:
    runner = CliRunner()
    for flag, bad, listed in (
        ("--device", "cdua", "'auto', 'cpu', 'cuda'"),
        ("--dtype", "fp16", "'auto', 'float32', 'bfloat16', 'float16'"),
        ("--attention-backend", "flash", "'auto', 'torch', 'native'"),
        ("--kv-cache-dtype", "int8", "'auto', 'float32', 'bfloat16', 'float16'"),
        ("--quantization", "int4", "'int8'"),
        ("--reasoning-parser", "r1", "'think', 'qwen3', 'deepseek_r1'"),
    ):
        result = runner.invoke(
            app, ["run", str(tmp_path / "missing.jsonl"), "-o", "o.jsonl", flag, bad]
        )
        assert result.exit_code == 2, flag
        words = " ".join(result.output.replace("│", " ").split())
        assert f"'{bad}' is not one of {listed}" in words, result.output


def test_quiet_job_prints_nothing(tmp_path: Path, tiny_model_dir: Path) -> None:
    rows = [{"id": f"r{i}", "prompt": f"item {i}:"} for i in range(3)]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    flags = ["--model", str(tiny_model_dir), "--max-tokens", "4", "--num-threads", "1"]
    for args in (
        ["run", "in.jsonl", "-o", "out.jsonl", *flags, "-q"],
        ["resume", "out.jsonl", "-q"],
    ):
        proc = subprocess.run(
            [sys.executable, "-m", "vbatch", *args],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr
        assert (proc.stdout, proc.stderr) == ("", ""), args
    assert len((tmp_path / "out.jsonl").read_text().splitlines()) == 3


def test_unreadable_weights_leave_no_job_and_the_fixed_model_runs_the_same_command(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """A truncated safetensors file (an interrupted download) once failed the core's start-up
    as a bug would, unsettled: the job was kept, and once the file was fixed, the same command
    found a job directory and its resume a changed model."""
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    weights = model_dir / "model.safetensors"
    intact = weights.read_bytes()
    weights.write_bytes(intact[: len(intact) // 2])
    (tmp_path / "in.jsonl").write_text('{"prompt": "one"}\n{"prompt": "two"}\n')
    args = ["run", "in.jsonl", "-o", "out.jsonl", "--model", str(model_dir), "-q"]
    command = [sys.executable, "-m", "vbatch", *args, "--max-tokens", "2", "--num-threads", "1"]
    failed = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert failed.returncode == 1
    assert f"cannot read weights {weights}" in failed.stderr
    assert "no row ran, so no job was kept" in failed.stderr and "Traceback" not in failed.stderr
    assert not (tmp_path / "out.jsonl").exists()
    assert not (tmp_path / "out.jsonl.vbatch").exists()
    weights.write_bytes(intact)
    fixed = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert fixed.returncode == 0, fixed.stderr
    assert len((tmp_path / "out.jsonl").read_text().splitlines()) == 2


def test_a_kv_cache_past_the_machine_s_memory_leaves_no_job(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """--kv-cache-memory beyond the RAM once failed in torch's allocator, unsettled: the job
    was kept, with a resume command that failed the same way."""
    (tmp_path / "in.jsonl").write_text('{"prompt": "one"}\n')
    command = [sys.executable, "-m", "vbatch", "run", "in.jsonl", "-o", "out.jsonl", "-q"]
    command += ["--model", str(tiny_model_dir), "--num-threads", "1", "--kv-cache-memory", "1e9"]
    failed = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert failed.returncode == 1
    assert "exceeds this machine's memory" in failed.stderr
    assert "lower --kv-cache-memory" in failed.stderr and "--num-kv-blocks" not in failed.stderr
    assert "no row ran, so no job was kept" in failed.stderr and "Traceback" not in failed.stderr
    assert not (tmp_path / "out.jsonl").exists()
    assert not (tmp_path / "out.jsonl.vbatch").exists()


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


def test_a_file_where_the_job_directory_goes_is_named(tmp_path: Path) -> None:
    """Before, run said `cannot write .: File exists` and status said there was no such path."""
    (tmp_path / "in.jsonl").write_text('{"prompt": "a"}\n')
    (tmp_path / "o.jsonl.vbatch").write_text("not a job")
    runner = CliRunner()
    output = str(tmp_path / "o.jsonl")
    result = runner.invoke(app, ["run", str(tmp_path / "in.jsonl"), "-o", output])
    assert result.exit_code == 1
    assert "o.jsonl.vbatch, where the job would live, is a file" in result.output
    for command in ("status", "resume"):
        result = runner.invoke(app, [command, output])
        assert result.exit_code == 1 and "o.jsonl.vbatch is not a directory" in result.output
    assert (tmp_path / "o.jsonl.vbatch").read_text() == "not a job"


@pytest.mark.parametrize("name", ["manifest.json", "journal.jsonl"])
def test_a_directory_in_place_of_a_job_file_is_one_clear_line(
    name: str, tmp_path: Path, tiny_model_dir: Path
) -> None:
    """Before: `unexpected IsADirectoryError ... (this is a bug in vbatch ...)`."""
    (tmp_path / "in.jsonl").write_text('{"prompt": "a"}\n')
    runner = CliRunner()
    args = ["run", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "o.jsonl"), "-q"]
    result = runner.invoke(app, [*args, "--model", str(tiny_model_dir), "--max-tokens", "2"])
    assert result.exit_code == 0, result.output
    job_file = tmp_path / "o.jsonl.vbatch" / name
    job_file.unlink()
    job_file.mkdir()
    for command in ("status", "resume"):
        result = runner.invoke(app, [command, str(tmp_path / "o.jsonl")])
        assert result.exit_code == 1
        assert f"{name} is a directory where vbatch expects a file" in result.output
        assert "bug" not in result.output


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
            "vbatch",
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
    assert table.column_names[:17] == [
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
        "structured_valid",
    ]
    assert table.column_names[17:] == ["messages"]
    out = {r["id"]: r for r in table.to_pylist()}
    assert set(out) == {"capital", "color", "math"}
    assert all(r["text"] and r["finish_reason"] in ("stop", "length") for r in out.values())
    assert all(0 < r["completion_tokens"] <= 12 and r["prompt_tokens"] > 5 for r in out.values())
    assert "Paris" in out["capital"]["text"]
    status = subprocess.run(
        [sys.executable, "-m", "vbatch", "status", "out.parquet", "--json"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    info = json.loads(status.stdout)
    assert (info["complete"], info["done"], info["remaining"]) == (True, 3, 0)
    assert (info["output"], info["job_dir"]) == (
        str(tmp_path / "out.parquet"),
        str(tmp_path / "out.parquet.vbatch"),
    )
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


@pytest.mark.parametrize(
    ("flag", "bad"),
    [
        ("--max-errors", "nan"),
        ("--max-errors", "inf"),
        ("--max-errors", "-1"),
        ("--max-errors", "1.5"),
        ("--max-loras", "-3"),
        ("--max-lora-rank", "0"),
        ("--gpu-memory-utilization", "7"),
        ("--commit-every-seconds", "nan"),
        ("--commit-every-rows", "-1"),
        ("--max-in-flight", "0"),
        ("--num-threads", "0"),
        ("--num-threads", "-1"),
        ("--kv-cache-memory", "nan"),
        ("--kv-cache-memory", "0"),
        ("--log-interval", "0"),
        ("--drain-timeout", "inf"),
        ("--heartbeat-timeout", "nan"),
        ("--max-num-seqs", "0"),
        ("--max-num-batched-tokens", "15"),
        ("--max-tokens", "0"),
        ("--temperature", "nan"),
        ("--top-p", "0"),
        ("--min-p", "2"),
        ("--n", "257"),
        ("--logprobs", "21"),
        ("--seed", str(2**64)),
        ("--cpus-per-replica", "0"),
        ("-dp", "0"),
    ],
)
def test_a_numeric_flag_out_of_range_exits_2_at_parse_time_and_leaves_nothing(
    tmp_path: Path, flag: str, bad: str
) -> None:
    (tmp_path / "in.jsonl").write_text('{"prompt": "hi"}\n')
    output = tmp_path / "out.jsonl"
    runner = CliRunner()
    result = runner.invoke(app, ["run", str(tmp_path / "in.jsonl"), "-o", str(output), flag, bad])
    assert result.exit_code == 2, (flag, bad, result.output)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]
    if flag in ("--max-errors", "--commit-every-rows", "--max-in-flight", "--log-interval"):
        result = runner.invoke(app, ["resume", str(output), flag, bad])
        assert result.exit_code == 2, (flag, bad, result.output)


@pytest.mark.parametrize(
    ("flag", "bad", "says"),
    [
        ("--input-format", "csv", "'csv' is not one of jsonl, parquet"),
        ("--shard", "3/2", "out of range"),
        ("--stop", "", "a stop string must not be empty"),
    ],
)
def test_a_bad_format_shard_or_stop_string_is_a_usage_error(
    tmp_path: Path, flag: str, bad: str, says: str
) -> None:
    (tmp_path / "in.jsonl").write_text('{"prompt": "hi"}\n')
    runner = CliRunner()
    args = ["run", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"), flag, bad]
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert says in " ".join(result.output.replace("│", " ").split())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]


@pytest.mark.parametrize(
    "args",
    [
        ["status", "/"],
        ["status", "."],
        ["resume", "/"],
        ["merge", "."],
        ["run", "in.jsonl", "-o", "."],
        ["run", "in.jsonl", "-o", "sub/.."],
        ["run-batch", "-i", "in.jsonl", "-o", "/"],
    ],
)
def test_an_output_path_that_names_no_file_is_a_usage_error(args: list[str]) -> None:
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert "names no file" in result.output


def test_openai_lines_default_to_openais_sampling_unless_the_flag_is_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import vbatch.job.runner

    specs: list[Any] = []
    monkeypatch.setattr(vbatch.job.runner, "start_job", lambda spec, *a, **k: specs.append(spec))
    for extra, expected in (
        ([], {"temperature": 1.0, "top_p": 1.0}),
        (["--temperature", "0"], {"top_p": 1.0}),
        (["--temperature", "0.5", "--top-p", "0.9"], {}),
    ):
        CliRunner().invoke(app, ["run", "in.jsonl", "-o", str(tmp_path / "o.jsonl"), *extra])
        assert specs.pop().openai_defaults == expected, extra


def test_the_ray_extra_survives_rich_markup_in_help_and_docs() -> None:
    """rich took `[ray]` for a style tag: the help said "pip install 'vbatch'"."""
    result = CliRunner().invoke(app, ["run", "--help"], env={"COLUMNS": "200"})
    assert "pip install 'vbatch[ray]'" in result.output, result.output
    assert "vbatch[ray]" in DOCS.read_text().split(MARKER, 1)[1]
