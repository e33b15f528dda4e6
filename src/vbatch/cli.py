"""The `vbatch` command line: thin Typer commands over vbatch.job.runner."""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer

from vbatch import __version__
from vbatch.errors import VbatchError, is_storage_failure, storage_error, unexpected_error
from vbatch.job.options import RunOptions

app = typer.Typer(
    name="vbatch",
    help="Batch offline LLM inference with exactly-once checkpointed output.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

T = TypeVar("T")
ENGINE = "Engine"
SAMPLING = "Sampling"
INPUT = "Input"
JOB = "Job"
DISPLAY = "Display"
STRUCTURED = "Structured output"
RAY = "Ray (many machines)"
SAVED = "As for `run` (default: the setting the job started with)."
DEFAULTS = RunOptions()
QUIET_HELP = "Print nothing but errors (and how to resume an interrupted job)."


def _fail(message: str, exit_code: int = 1) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(exit_code)


def _guarded(fn: Callable[[], T]) -> T:
    """Print a VbatchError as one clear message, without a traceback, and exit non-zero. Any
    other exception is shown the same way (as a storage failure, or as an unexpected error);
    VBATCH_DEBUG=1 adds the traceback."""
    try:
        return fn()
    except VbatchError as e:
        _show_traceback()
        _fail(str(e), e.exit_code)
    except KeyboardInterrupt:
        _fail("interrupted", 130)
    except (typer.Exit, typer.Abort):
        raise
    except Exception as e:
        _show_traceback()
        if is_storage_failure(e):
            _fail(str(storage_error(e, then="then run the same command again")))
        _fail(unexpected_error(e))
    raise AssertionError("unreachable")


def _show_traceback() -> None:
    if os.environ.get("VBATCH_DEBUG", "") not in ("", "0"):
        traceback.print_exc()


def _finish(outcome: Any, quiet: bool) -> None:
    if outcome.exit_code != 0 or not quiet:
        typer.echo(outcome.message, err=True)
    raise typer.Exit(outcome.exit_code)


def _show_version(value: bool) -> None:
    if value:
        typer.echo(f"vbatch {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_show_version, is_eager=True, help="Print the version and exit."
        ),
    ] = False,
) -> None:
    """The options that come before a command."""


def _run_overrides(**values: Any) -> dict[str, Any]:
    return {name: value for name, value in values.items() if value is not None}


@app.command()
def run(
    input_path: Annotated[Path, typer.Argument(help="Input file: .jsonl[.gz|.zst] or .parquet.")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Output: .jsonl or .parquet.")],
    input_format: Annotated[
        str | None,
        typer.Option(help="jsonl or parquet (default: by extension).", rich_help_panel=INPUT),
    ] = None,
    prompt_column: Annotated[
        str | None,
        typer.Option(help="Column holding the prompt (default: prompt).", rich_help_panel=INPUT),
    ] = None,
    messages_column: Annotated[
        str | None,
        typer.Option(
            help="Column holding chat messages (default: messages).", rich_help_panel=INPUT
        ),
    ] = None,
    id_column: Annotated[
        str | None,
        typer.Option(
            help="Id column (default: id, custom_id, else the row index).", rich_help_panel=INPUT
        ),
    ] = None,
    keep_columns: Annotated[
        str | None,
        typer.Option(help="Comma-separated input columns to copy.", rich_help_panel=INPUT),
    ] = None,
    keep_all_columns: Annotated[
        bool,
        typer.Option(
            "--keep-all-columns",
            help="Copy every input column to the output.",
            rich_help_panel=INPUT,
        ),
    ] = False,
    model: Annotated[
        str | None,
        typer.Option(
            help="HF model directory or .gguf file (default: the bundled SmolLM2-135M-Instruct).",
            rich_help_panel=ENGINE,
        ),
    ] = None,
    device: Annotated[
        str | None, typer.Option(help="auto, cpu or cuda.", rich_help_panel=ENGINE)
    ] = None,
    dtype: Annotated[
        str | None, typer.Option(help="auto, float32, bfloat16 or float16.", rich_help_panel=ENGINE)
    ] = None,
    max_num_seqs: Annotated[
        int | None, typer.Option(help="Most sequences in one batch.", rich_help_panel=ENGINE)
    ] = None,
    max_num_batched_tokens: Annotated[
        int | None, typer.Option(help="Token budget of one engine step.", rich_help_panel=ENGINE)
    ] = None,
    max_model_len: Annotated[
        int | None, typer.Option(help="Longest prompt + output (tokens).", rich_help_panel=ENGINE)
    ] = None,
    kv_cache_memory: Annotated[
        float | None, typer.Option(help="KV cache size in GB.", rich_help_panel=ENGINE)
    ] = None,
    attention_backend: Annotated[
        str | None, typer.Option(help="auto, torch or native.", rich_help_panel=ENGINE)
    ] = None,
    num_threads: Annotated[
        int | None, typer.Option(help="CPU threads for the engine.", rich_help_panel=ENGINE)
    ] = None,
    kv_cache_dtype: Annotated[
        str | None,
        typer.Option(
            help="auto (the model dtype), float32, bfloat16 or float16. A 16-bit cache under a "
            "float32 model (CPU) halves KV memory and traffic at a small accuracy cost.",
            rich_help_panel=ENGINE,
        ),
    ] = None,
    quantization: Annotated[
        str | None,
        typer.Option(
            help="int8: int8 weights and activations in the decoder's linears (CPU).",
            rich_help_panel=ENGINE,
        ),
    ] = None,
    enforce_eager: Annotated[
        bool,
        typer.Option(
            "--enforce-eager",
            help="On CUDA, run decode eagerly instead of replaying CUDA graphs.",
            rich_help_panel=ENGINE,
        ),
    ] = False,
    max_graph_batch_size: Annotated[
        int | None,
        typer.Option(help="Largest decode batch captured as a CUDA graph.", rich_help_panel=ENGINE),
    ] = None,
    async_scheduling: Annotated[
        bool,
        typer.Option(
            "--async-scheduling",
            help="Launch each decode step before the last one's tokens reach the host, so a "
            "GPU computes it while they are applied (same tokens; nothing to gain on CPU).",
            rich_help_panel=ENGINE,
        ),
    ] = False,
    no_greedy_screen: Annotated[
        bool,
        typer.Option(
            "--no-greedy-screen",
            help="On CPU, score the whole vocabulary in fp32 for greedy tokens instead of "
            "screening it in int8 first (the tokens are the same; the screen is faster).",
            rich_help_panel=ENGINE,
        ),
    ] = False,
    heartbeat_timeout: Annotated[
        float | None,
        typer.Option(
            help="Seconds without a heartbeat from the engine core, or in one engine step, "
            "before the core counts as hung: it is killed and the job commits and exits with "
            "the resume command (default 120; must exceed the slowest step).",
            rich_help_panel=ENGINE,
        ),
    ] = None,
    max_tokens: Annotated[
        int, typer.Option(help="Most generated tokens per row.", rich_help_panel=SAMPLING)
    ] = 256,
    temperature: Annotated[
        float, typer.Option(help="0 means greedy (reproducible).", rich_help_panel=SAMPLING)
    ] = 0.0,
    top_p: Annotated[float, typer.Option(rich_help_panel=SAMPLING)] = 1.0,
    top_k: Annotated[int, typer.Option(help="0 disables.", rich_help_panel=SAMPLING)] = 0,
    min_p: Annotated[float, typer.Option(rich_help_panel=SAMPLING)] = 0.0,
    seed: Annotated[
        int | None,
        typer.Option(help="Seed for sampled rows (reproducible).", rich_help_panel=SAMPLING),
    ] = None,
    stop: Annotated[
        list[str] | None, typer.Option(help="Stop string (repeatable).", rich_help_panel=SAMPLING)
    ] = None,
    n: Annotated[
        int, typer.Option(help="Samples per row (at most 256).", rich_help_panel=SAMPLING)
    ] = 1,
    logprobs: Annotated[
        int | None, typer.Option(help="Top logprobs per token (0-20).", rich_help_panel=SAMPLING)
    ] = None,
    include_token_ids: Annotated[
        bool,
        typer.Option("--include-token-ids", help="Add output token ids.", rich_help_panel=SAMPLING),
    ] = False,
    json_schema: Annotated[
        Path | None,
        typer.Option(
            "--json-schema",
            help="Every row's output is JSON valid against this JSON schema file.",
            rich_help_panel=STRUCTURED,
        ),
    ] = None,
    regex: Annotated[
        str | None,
        typer.Option(help="Every row's output matches this regex.", rich_help_panel=STRUCTURED),
    ] = None,
    choice: Annotated[
        str | None,
        typer.Option(
            help="Every row's output is one of these comma-separated labels.",
            rich_help_panel=STRUCTURED,
        ),
    ] = None,
    grammar: Annotated[
        Path | None,
        typer.Option(
            help="Every row's output follows this EBNF grammar file (rule `root`).",
            rich_help_panel=STRUCTURED,
        ),
    ] = None,
    parse_json: Annotated[
        bool,
        typer.Option(
            "--parse-json",
            help="Add a `json` column: the parsed output.",
            rich_help_panel=STRUCTURED,
        ),
    ] = False,
    ordered: Annotated[
        bool,
        typer.Option(
            "--ordered", help="Sort the final output by input index.", rich_help_panel=JOB
        ),
    ] = False,
    overwrite: Annotated[
        bool,
        typer.Option(
            "--overwrite", help="Replace an existing output and job.", rich_help_panel=JOB
        ),
    ] = False,
    clean: Annotated[
        bool,
        typer.Option("--clean", help="Remove the job directory on success.", rich_help_panel=JOB),
    ] = False,
    commit_every_rows: Annotated[
        int, typer.Option(help="Commit after this many finished rows.", rich_help_panel=JOB)
    ] = DEFAULTS.commit_every_rows,
    commit_every_seconds: Annotated[
        float, typer.Option(help="Commit at least this often.", rich_help_panel=JOB)
    ] = DEFAULTS.commit_every_seconds,
    max_errors: Annotated[
        float | None,
        typer.Option(help="Stop when more rows error (N, or a fraction < 1).", rich_help_panel=JOB),
    ] = None,
    drain_timeout: Annotated[
        float,
        typer.Option(help="Seconds in-flight rows get on SIGTERM/SIGINT.", rich_help_panel=JOB),
    ] = DEFAULTS.drain_timeout,
    max_in_flight: Annotated[
        int | None, typer.Option(help="Most rows admitted at once.", rich_help_panel=JOB)
    ] = None,
    use_ray: Annotated[
        bool,
        typer.Option(
            "--ray",
            help="Run the engines as Ray actors (needs `pip install 'vbatch[ray]'`).",
            rich_help_panel=RAY,
        ),
    ] = False,
    ray_address: Annotated[
        str | None,
        typer.Option(
            help="The Ray cluster to join (default: RAY_ADDRESS, a running local cluster, or a "
            "new local one).",
            rich_help_panel=RAY,
        ),
    ] = None,
    replicas: Annotated[
        int, typer.Option(help="Engine replicas (Ray actors).", rich_help_panel=RAY)
    ] = 1,
    gpus_per_replica: Annotated[
        float, typer.Option(help="GPUs Ray gives each replica.", rich_help_panel=RAY)
    ] = 0.0,
    cpus_per_replica: Annotated[
        float,
        typer.Option(
            help="CPUs Ray gives each replica; also its engine's threads.", rich_help_panel=RAY
        ),
    ] = 1.0,
    max_restarts: Annotated[
        int,
        typer.Option(help="Times Ray may restart each replica that died.", rich_help_panel=RAY),
    ] = 1,
    quiet: Annotated[
        bool, typer.Option("--quiet", "-q", help=QUIET_HELP, rich_help_panel=DISPLAY)
    ] = False,
    log_interval: Annotated[
        float, typer.Option(help="Seconds between plain progress lines.", rich_help_panel=DISPLAY)
    ] = DEFAULTS.log_interval,
    metrics_file: Annotated[
        Path | None,
        typer.Option(help="Keep live job metrics in this JSON file.", rich_help_panel=DISPLAY),
    ] = None,
) -> None:
    """Run a batch job: read INPUT, generate, and write OUTPUT incrementally."""
    from vbatch.job.options import RaySettings
    from vbatch.job.rows import ColumnOptions
    from vbatch.job.runner import JobSpec, start_job
    from vbatch.structured import cli_structured

    engine_args = _run_overrides(
        device=device,
        dtype=dtype,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        kv_cache_memory_gb=kv_cache_memory,
        attention_backend=attention_backend,
        num_threads=num_threads,
        kv_cache_dtype=kv_cache_dtype,
        quantization=quantization,
        enforce_eager=enforce_eager or None,
        max_graph_batch_size=max_graph_batch_size,
        greedy_screen=False if no_greedy_screen else None,
        async_scheduling=async_scheduling or None,
        heartbeat_timeout_s=heartbeat_timeout,
    )
    sampling = {
        "max_tokens": max_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "min_p": min_p,
        "seed": seed,
        "stop": stop or [],
        "n": n,
        "logprobs": logprobs,
    }
    structured = _guarded(lambda: cli_structured(json_schema, regex, choice, grammar))
    if structured is not None:
        sampling["structured"] = structured
    kept = tuple(c.strip() for c in keep_columns.split(",") if c.strip()) if keep_columns else ()
    spec = JobSpec(
        input_path=input_path,
        output_path=output,
        input_format=input_format,
        columns=ColumnOptions(prompt_column, messages_column, id_column, kept, keep_all_columns),
        model=model,
        engine_args=engine_args,
        sampling=sampling,
        ordered=ordered,
        include_token_ids=include_token_ids,
        parse_json=parse_json,
    )
    options = RunOptions(
        commit_every_rows=commit_every_rows,
        commit_every_seconds=commit_every_seconds,
        max_errors=max_errors,
        drain_timeout=drain_timeout,
        max_in_flight=max_in_flight,
        display="quiet" if quiet else "auto",
        log_interval=log_interval,
        metrics_file=metrics_file,
        clean=clean,
        ray=_guarded(
            lambda: RaySettings(
                ray_address, replicas, gpus_per_replica, cpus_per_replica, max_restarts
            )
        )
        if use_ray
        else None,
    )
    _finish(_guarded(lambda: start_job(spec, options, overwrite=overwrite)), quiet)


@app.command()
def resume(
    output: Annotated[Path, typer.Argument(help="The output path the job was started with.")],
    force: Annotated[
        bool,
        typer.Option("--force", help="Resume even if the input, model or vbatch version changed."),
    ] = False,
    retry_errors: Annotated[
        bool, typer.Option("--retry-errors", help="Run the rows that ended in error again.")
    ] = False,
    clean: Annotated[
        bool, typer.Option("--clean", help="Remove the job directory on success.")
    ] = False,
    commit_every_rows: Annotated[int | None, typer.Option(help=SAVED)] = None,
    commit_every_seconds: Annotated[float | None, typer.Option(help=SAVED)] = None,
    max_errors: Annotated[float | None, typer.Option(help=SAVED)] = None,
    drain_timeout: Annotated[float | None, typer.Option(help=SAVED)] = None,
    max_in_flight: Annotated[int | None, typer.Option(help=SAVED)] = None,
    ray_address: Annotated[
        str | None, typer.Option(help="For a --ray job: the Ray cluster to join this time.")
    ] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help=QUIET_HELP)] = False,
    log_interval: Annotated[
        float, typer.Option(help="Seconds between plain progress lines.")
    ] = DEFAULTS.log_interval,
    metrics_file: Annotated[
        Path | None, typer.Option(help="Keep live job metrics in this file.")
    ] = None,
) -> None:
    """Continue an interrupted job; the result equals an uninterrupted run."""
    from vbatch.job.runner import resume_job

    overrides = _run_overrides(
        commit_every_rows=commit_every_rows,
        commit_every_seconds=commit_every_seconds,
        max_errors=max_errors,
        drain_timeout=drain_timeout,
        max_in_flight=max_in_flight,
        metrics_file=metrics_file,
        ray_address=ray_address,
    )
    overrides.update(display="quiet" if quiet else "auto", log_interval=log_interval, clean=clean)
    _finish(
        _guarded(lambda: resume_job(output, overrides, force=force, retry_errors=retry_errors)),
        quiet,
    )


@app.command()
def status(
    output: Annotated[Path, typer.Argument(help="The output path of the job.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")] = False,
) -> None:
    """Show the progress of a job: done, errored, remaining, last commit, settings."""
    from vbatch.job.runner import job_status

    info = _guarded(lambda: job_status(output))
    if as_json:
        typer.echo(json.dumps(info, indent=2))
        return
    state = "complete" if info["complete"] else "incomplete"
    lines = [
        f"job:         {info['job_dir']} ({state})",
        f"rows:        {info['done']} done ({info['errored']} errored), "
        f"{info['remaining']} remaining of {info['rows']}",
        f"last commit: {info['last_commit'] or 'never'}",
        f"input:       {info['input']}",
        f"model:       {info['model']['source']}",
        f"sampling:    {_settings(info['sampling'])}",
        f"engine:      {_settings(info['engine']) or 'defaults'}",
    ]
    typer.echo("\n".join(lines))


def _settings(values: dict[str, Any]) -> str:
    # NOTE: identity checks, because `0.0 in (False,)` is true and would hide temperature=0.
    shown = {k: v for k, v in values.items() if v is not None and v is not False and v != []}
    return ", ".join(f"{k}={v}" for k, v in shown.items())


def main() -> None:
    from vbatch.job.stopping import command_signals

    with command_signals():
        app(prog_name="vbatch")


if __name__ == "__main__":
    sys.exit(main())
