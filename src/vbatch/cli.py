"""The `vbatch` command line: Typer commands, and the pure mapping of parsed options to a job."""

from __future__ import annotations

import json
import os
import shlex
import signal
import sys
import traceback
from collections.abc import Callable, Mapping
from dataclasses import fields
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NamedTuple, TypeVar, get_args, get_type_hints

import typer

from vbatch import __version__
from vbatch import cli_options as o
from vbatch.config import AttentionBackend, Device, Dtype, EngineConfig, LinearBackend
from vbatch.engine_sets.base import RaySettings
from vbatch.errors import (
    ConfigError,
    VbatchError,
    is_storage_failure,
    storage_error,
    unexpected_error,
)
from vbatch.job.options import JOB_SAMPLING, OPENAI_LINE_DEFAULTS, RunOptions
from vbatch.sampling_params import SamplingParams

if TYPE_CHECKING:
    from vbatch.job.rows import LoraRows
    from vbatch.job.runner import JobSpec

app = typer.Typer(
    name="vbatch",
    help="Batch offline LLM inference with exactly-once checkpointed output.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

T = TypeVar("T")
ENGINE = EngineConfig()
RUN = RunOptions()
RAY = RaySettings()
RAY_OPTIONS = tuple(f.name for f in fields(RaySettings) if f.name != "address")
SAMPLING = JOB_SAMPLING
# NOTE: as a shell reports a command ended by SIGINT.
INTERRUPTED_EXIT = 130


class RunRequest(NamedTuple):
    """What `vbatch run` asks of the job layer."""

    spec: JobSpec
    options: RunOptions
    overwrite: bool


class ResumeRequest(NamedTuple):
    """What `vbatch resume` asks of the job layer; `overrides` are RunOptions fields."""

    output: Path
    overrides: dict[str, Any]
    force: bool
    retry_errors: bool


STRUCTURED_OPTIONS = ("json_schema", "regex", "choice", "grammar")
SAMPLING_FIELDS = tuple(SamplingParams.__struct_fields__)
ENGINE_FIELDS = tuple(f.name for f in fields(EngineConfig) if f.name not in ("model", "seed"))
RUN_OPTION_FIELDS = tuple(f.name for f in fields(RunOptions) if f.name != "display")


def parsed_params(ctx: typer.Context) -> dict[str, Any]:
    """The command's parsed options, each path option a Path. Typer converts the function's
    own arguments, but before 0.29 it left `ctx.params` as click parsed them, paths as str."""
    assert ctx.command.callback is not None
    hints = get_type_hints(ctx.command.callback)
    path_options = {name for name, hint in hints.items() if hint is Path or Path in get_args(hint)}
    return {
        name: Path(value) if name in path_options and isinstance(value, str) else value
        for name, value in ctx.params.items()
    }


def run_request(params: Mapping[str, Any], defaulted: frozenset[str] = frozenset()) -> RunRequest:
    """Map `vbatch run`'s parsed options (click's `ctx.params`) to the job, each to one place;
    `defaulted` names the options the user did not give (OpenAI lines then get OpenAI's own
    sampling defaults for them).

    Options are routed by name: a SamplingParams field goes to the sampling defaults, an
    EngineConfig field to the engine args (only when it differs from EngineConfig's default),
    a ColumnOptions, JobSpec or RunOptions field there. No option is left over (a TypeError
    says which). Pure, but for reading a --json-schema or --grammar file.
    """
    from vbatch.grammar_text import cli_structured
    from vbatch.job.rows import ColumnOptions
    from vbatch.job.runner import JobSpec
    from vbatch.job.shard import parse_shard
    from vbatch.lora.adapter import parse_lora_option

    values = {k: v.value if isinstance(v, Enum) else v for k, v in params.items()}

    def take(names: tuple[str, ...]) -> dict[str, Any]:
        return {name: values.pop(name) for name in names if name in values}

    sampling = take(SAMPLING_FIELDS)
    sampling["stop"] = list(sampling.get("stop") or ())
    structured = cli_structured(*(values.pop(name) for name in STRUCTURED_OPTIONS))
    if structured is not None:
        sampling["structured"] = structured
    keep = values.pop("keep_columns") or ""
    columns = ColumnOptions(
        **take(tuple(f.name for f in fields(ColumnOptions))),
        keep_columns=tuple(dict.fromkeys(c.strip() for c in keep.split(",") if c.strip())),
    )
    loras = tuple(parse_lora_option(value) for value in values.pop("lora") or ())
    lora_rows = _lora_rows(loras, values.pop("lora_column"), values.pop("lora_default"))
    display = "quiet" if values.pop("quiet") else "auto"
    overwrite = values.pop("overwrite")
    options = RunOptions(
        display=display, ray=_ray_settings(values), **_given(take(RUN_OPTION_FIELDS))
    )
    engine = {k: v for k, v in take(ENGINE_FIELDS).items() if v != getattr(ENGINE, k)}
    if loras:
        engine.update(enable_lora=True, loras=loras)
    shard = values.pop("shard")
    template_kwargs = _json_object(values.pop("chat_template_kwargs"), "--chat-template-kwargs")
    spec_fields = tuple(f.name for f in fields(JobSpec))
    served = tuple(values.pop("served_model_names") or ())
    spec = JobSpec(
        served_model_names=served,
        columns=columns,
        engine_args=engine,
        sampling=sampling,
        shard=None if shard is None else parse_shard(shard),
        chat_template_kwargs=template_kwargs,
        lora_rows=lora_rows,
        openai_defaults={k: v for k, v in OPENAI_LINE_DEFAULTS.items() if k in defaulted},
        **take(spec_fields),
    )
    if values:
        raise TypeError(f"options with no place in the job: {', '.join(sorted(values))}")
    return RunRequest(spec, options, overwrite)


def resume_request(params: Mapping[str, Any]) -> ResumeRequest:
    """Map `vbatch resume`'s parsed options to the job: options not given (None) keep the
    settings the job started with."""
    values = dict(params)
    overrides = {"display": "quiet" if values.pop("quiet") else "auto"}
    overrides.update(
        _given({name: values.pop(name) for name in RUN_OPTION_FIELDS if name != "ray"})
    )
    overrides.update(_given({"ray_address": values.pop("ray_address")}))
    request = ResumeRequest(
        values.pop("output"), overrides, values.pop("force"), values.pop("retry_errors")
    )
    if values:
        raise TypeError(f"options with no place in the job: {', '.join(sorted(values))}")
    return request


def _lora_rows(
    loras: tuple[tuple[str, str], ...], column: str | None, default: str | None
) -> LoraRows | None:
    """How rows pick among the --lora adapters; --lora-column and --lora-default need them."""
    from vbatch.job.rows import LoraRows

    if not loras:
        if column is not None or default is not None:
            raise ConfigError("--lora-column and --lora-default need adapters: add --lora")
        return None
    names = tuple(name for name, _ in loras)
    if default is not None and default not in names:
        raise ConfigError(f"--lora-default {default} is not one of the --lora names")
    return LoraRows(names, column, default)


def _ray_settings(values: dict[str, Any]) -> RaySettings | None:
    """`--ray` and its options (popped from `values`); a Ray option without `--ray` is refused."""
    use_ray, address = values.pop("use_ray"), values.pop("ray_address")
    given = {name: values.pop(name) for name in RAY_OPTIONS}
    if not use_ray:
        stray = [name for name, value in given.items() if value != getattr(RAY, name)]
        if address is not None or stray:
            flag = "ray_address" if address is not None else stray[0]
            raise ConfigError(f"--{flag.replace('_', '-')} is for --ray jobs; add --ray")
        return None
    return RaySettings(address=address, **given)


def _json_object(value: str | None, flag: str) -> dict[str, Any] | None:
    """A flag's JSON object value (None when not given)."""
    if value is None:
        return None
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{flag} is not valid JSON ({e}): {value!r:.80}") from None
    if not isinstance(parsed, dict):
        raise ConfigError(f"{flag} must be a JSON object, like '{{\"enable_thinking\": false}}'")
    return parsed


def _given(values: dict[str, Any]) -> dict[str, Any]:
    return {name: value for name, value in values.items() if value is not None}


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
    except (typer.Exit, typer.Abort):
        raise
    except Exception as e:
        _show_traceback()
        if is_storage_failure(e):
            _fail(str(storage_error(e, then="then run the same command again")))
        _fail(unexpected_error(e))
    raise AssertionError("unreachable")


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


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


@app.command()
def run(
    ctx: typer.Context,
    input_path: o.InputPath,
    output_path: o.OutputPath,
    input_format: o.InputFormat = None,
    prompt_column: o.PromptColumn = None,
    messages_column: o.MessagesColumn = None,
    id_column: o.IdColumn = None,
    keep_columns: o.KeepColumns = None,
    keep_all_columns: o.KeepAllColumns = False,
    chat_template_kwargs: o.ChatTemplateKwargs = None,
    model: o.Model = None,
    served_model_names: o.ServedModelNames = None,
    device: o.DeviceOption = Device(ENGINE.device),
    dtype: o.DtypeOption = Dtype(ENGINE.dtype),
    max_num_seqs: o.MaxNumSeqs = ENGINE.max_num_seqs,
    max_num_batched_tokens: o.MaxNumBatchedTokens = ENGINE.max_num_batched_tokens,
    max_model_len: o.MaxModelLen = ENGINE.max_model_len,
    kv_cache_memory_gb: o.KvCacheMemory = ENGINE.kv_cache_memory_gb,
    gpu_memory_utilization: o.GpuMemoryUtilization = ENGINE.gpu_memory_utilization,
    attention_backend: o.AttentionBackendOption = AttentionBackend(ENGINE.attention_backend),
    num_threads: o.NumThreads = ENGINE.num_threads,
    data_parallel_size: o.DataParallelSize = RUN.data_parallel_size,
    kv_cache_dtype: o.KvCacheDtype = Dtype(ENGINE.kv_cache_dtype),
    quantization: o.QuantizationOption = ENGINE.quantization,
    enforce_eager: o.EnforceEager = ENGINE.enforce_eager,
    max_graph_batch_size: o.MaxGraphBatchSize = ENGINE.max_graph_batch_size,
    async_scheduling: o.AsyncScheduling = ENGINE.async_scheduling,
    greedy_screen: o.GreedyScreen = ENGINE.greedy_screen,
    linear_backend: o.LinearBackendOption = LinearBackend(ENGINE.linear_backend),
    batch_invariant: o.BatchInvariant = ENGINE.batch_invariant,
    heartbeat_timeout_s: o.HeartbeatTimeout = ENGINE.heartbeat_timeout_s,
    lora: o.Lora = None,
    lora_default: o.LoraDefault = None,
    lora_column: o.LoraColumn = None,
    max_loras: o.MaxLoras = ENGINE.max_loras,
    max_lora_rank: o.MaxLoraRank = ENGINE.max_lora_rank,
    max_tokens: o.MaxTokens = SAMPLING.max_tokens,
    temperature: o.Temperature = SAMPLING.temperature,
    top_p: o.TopP = SAMPLING.top_p,
    top_k: o.TopK = SAMPLING.top_k,
    min_p: o.MinP = SAMPLING.min_p,
    seed: o.Seed = SAMPLING.seed,
    stop: o.Stop = None,
    n: o.N = SAMPLING.n,
    logprobs: o.Logprobs = SAMPLING.logprobs,
    include_token_ids: o.IncludeTokenIds = False,
    json_schema: o.JsonSchema = None,
    regex: o.Regex = None,
    choice: o.Choice = None,
    grammar: o.Grammar = None,
    parse_json: o.ParseJson = False,
    require_valid_json: o.RequireValidJson = False,
    reasoning_parser: o.ReasoningParserOption = None,
    task: o.TaskOption = o.Task.GENERATE,
    dimensions: o.Dimensions = None,
    ordered: o.Ordered = False,
    overwrite: o.Overwrite = False,
    clean: o.Clean = RUN.clean,
    commit_every_rows: o.CommitEveryRows = RUN.commit_every_rows,
    commit_every_seconds: o.CommitEverySeconds = RUN.commit_every_seconds,
    max_errors: o.MaxErrors = RUN.max_errors,
    drain_timeout_s: o.DrainTimeout = RUN.drain_timeout_s,
    max_in_flight: o.MaxInFlight = RUN.max_in_flight,
    shard: o.ShardOption = None,
    use_ray: o.UseRay = False,
    ray_address: o.RayAddress = None,
    replicas: o.Replicas = RAY.replicas,
    gpus_per_replica: o.GpusPerReplica = RAY.gpus_per_replica,
    cpus_per_replica: o.CpusPerReplica = RAY.cpus_per_replica,
    max_restarts: o.MaxRestarts = RAY.max_restarts,
    quiet: o.Quiet = False,
    log_interval_s: o.LogInterval = RUN.log_interval_s,
    metrics_file: o.MetricsFile = RUN.metrics_file,
) -> None:
    """Run a batch job: read INPUT, generate, and write OUTPUT incrementally."""
    from vbatch.job.runner import start_job

    defaulted = frozenset(
        name
        for name in ctx.params
        if (source := ctx.get_parameter_source(name)) is not None and source.name == "DEFAULT"
    )
    request = _guarded(lambda: run_request(parsed_params(ctx), defaulted))
    outcome = _guarded(
        lambda: start_job(request.spec, request.options, overwrite=request.overwrite)
    )
    _finish(outcome, quiet)


@app.command()
def resume(
    ctx: typer.Context,
    output: o.JobOutput,
    force: o.Force = False,
    retry_errors: o.RetryErrors = False,
    clean: o.Clean = RUN.clean,
    commit_every_rows: o.CommitEveryRows = None,
    commit_every_seconds: o.CommitEverySeconds = None,
    max_errors: o.MaxErrors = None,
    drain_timeout_s: o.DrainTimeout = None,
    max_in_flight: o.MaxInFlight = None,
    data_parallel_size: o.DataParallelSize = None,
    ray_address: o.RayAddress = None,
    quiet: o.Quiet = False,
    log_interval_s: o.LogInterval = RUN.log_interval_s,
    metrics_file: o.MetricsFile = RUN.metrics_file,
) -> None:
    """Continue an interrupted job; the result equals an uninterrupted run.

    The job's options left out here keep the values the job started with."""
    from vbatch.job.runner import resume_job

    request = resume_request(parsed_params(ctx))
    outcome = _guarded(
        lambda: resume_job(
            request.output,
            request.overrides,
            force=request.force,
            retry_errors=request.retry_errors,
        )
    )
    _finish(outcome, quiet)


@app.command()
def status(
    output: Annotated[Path, typer.Argument(help="The output path of the job.", parser=o.file_path)],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")] = False,
) -> None:
    """Show the progress of a job: done, errored, remaining, last commit, settings."""
    from vbatch.job.runner import job_status

    info = _guarded(lambda: job_status(output))
    if as_json:
        typer.echo(json.dumps(info, indent=2))
        return
    if "rows" not in info:
        typer.echo(_shard_lines(output, info["shards"], is_merged=info["merged"]))
        return
    state = "complete" if info["complete"] else "incomplete"
    lines = [
        f"job:         {info['job_dir']} ({state})",
        f"rows:        {info['done']} done ({info['errored']} errored), "
        f"{info['remaining']} remaining of {info['rows']}",
        f"last commit: {info['last_commit_time'] or 'never'}",
        f"input:       {info['input']}",
        f"model:       {info['model']['source']}",
        _task_line(info),
        f"engine:      {_settings(info['engine']) or 'defaults'}",
    ]
    if info["shard"] is not None:
        lines.insert(1, f"shard:       {info['shard']['index']}/{info['shard']['count']}")
    typer.echo("\n".join(lines))
    if "shards" in info:
        typer.echo(_shard_lines(output, info["shards"], is_merged=False))


def _task_line(info: dict[str, Any]) -> str:
    """A generation job's sampling settings; a pooling job's task (and --dimensions), whose
    rows no sampling setting reaches."""
    options = info["options"]
    task = options.get("task") or "generate"
    if task == "generate":
        return f"sampling:    {_settings(info['sampling'])}"
    dimensions = options.get("dimensions")
    return f"task:        {task}" + (f", dimensions={dimensions}" if dimensions else "")


def _shard_lines(output: Path, shards: list[dict[str, Any]], *, is_merged: bool) -> str:
    """The per-shard table of `vbatch status`."""
    num_complete = sum(s["state"] == "complete" for s in shards)
    count = int(shards[0]["shard"].rpartition("/")[2])
    lines = [f"shards of {output}: {num_complete} of {count} complete"]
    for s in shards:
        if s["state"] == "not started":
            lines.append(f"  {s['shard']:>7}  not started")
            continue
        if s["rows"] is None:
            lines.append(f"  {s['shard']:>7}  {s['state']:<10}  {s['output']}")
            continue
        progress = f"{s['done']} of {s['rows']} rows ({s['errored']} errored)"
        how = s["resume"] or s["output"]
        lines.append(f"  {s['shard']:>7}  {s['state']:<10}  {progress}  {how}")
    if is_merged:
        lines.append(f"merged:      {output} exists")
    elif num_complete == count:
        lines.append(f"merge with:  vbatch merge {shlex.quote(str(output))}")
    return "\n".join(lines)


@app.command()
def merge(
    output: Annotated[
        Path,
        typer.Argument(
            help="The output the shards were run with (`run -o OUTPUT`).", parser=o.file_path
        ),
    ],
    ordered: Annotated[
        bool, typer.Option("--ordered", help="Sort the merged rows by input index.")
    ] = False,
    overwrite: Annotated[
        bool, typer.Option("--overwrite", help="Replace OUTPUT if it exists.")
    ] = False,
    remove_shards: Annotated[
        bool,
        typer.Option(
            "--remove-shards",
            help="Delete the shard files and their job directories once OUTPUT is written.",
        ),
    ] = False,
    quiet: o.Quiet = False,
) -> None:
    """Merge the shards of a job array (`run --shard I/N`) into OUTPUT, once all are complete."""
    from vbatch.job.merge import merge_shards

    # NOTE: SIGTERM (Slurm, Kubernetes, timeout) stops a merge as Ctrl-C does: its temp files
    # go, and it says so.
    signal.signal(signal.SIGTERM, _interrupt)
    message = _guarded(
        lambda: merge_shards(
            output, ordered=ordered, overwrite=overwrite, remove_shards=remove_shards
        )
    )
    if not quiet:
        typer.echo(message, err=True)


# NOTE: vLLM run-batch options that change nothing in vbatch (a server's, its temp folder, its
# logging), with a value or as flags; and those that take 1 only (vbatch runs one process per
# replica: -dp for more).
_RUN_BATCH_IGNORED = (
    "--response-role",
    "--output-tmp-dir",
    "--port",
    "--url",
    "--max-log-len",
)
_RUN_BATCH_IGNORED_FLAGS = (
    "--enable-prefix-caching",
    "--enable-chunked-prefill",
    "--trust-remote-code",
    "--disable-log-requests",
    "--disable-log-stats",
    "--enable-metrics",
    "--enable-prompt-tokens-details",
)
_RUN_BATCH_ONLY_ONE = ("--tensor-parallel-size", "--pipeline-parallel-size", "-tp", "-pp")


@app.command(
    "run-batch",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
)
def run_batch(
    ctx: typer.Context,
    input_file: Annotated[
        Path, typer.Option("-i", "--input-file", help="The OpenAI Batch file (JSONL) to run.")
    ],
    output_file: Annotated[
        Path,
        typer.Option("-o", "--output-file", help="Where the output lines go.", parser=o.file_path),
    ],
    model: o.Model = None,
) -> None:
    """vLLM's `run-batch` command line, run as `vbatch run` (resumable with `vbatch resume`).

    Any `vbatch run` option may follow `-i IN -o OUT --model M`, and is passed on."""
    args = [str(input_file), "-o", str(output_file)]
    if model is not None:
        args += ["--model", model]
    extra = list(ctx.args)
    while extra:
        arg = extra.pop(0)
        name, has_value, value = arg.partition("=")
        if name in _RUN_BATCH_IGNORED_FLAGS:
            typer.echo(f"vbatch run-batch ignores {name} (vLLM option)", err=True)
            continue
        if name == "--served-model-name" and not has_value:
            # NOTE: vLLM's form takes every name that follows; vbatch run's repeats the option.
            while extra and not extra[0].startswith("-"):
                args += [name, extra.pop(0)]
            continue
        if name in _RUN_BATCH_IGNORED or name in _RUN_BATCH_ONLY_ONE:
            if not has_value and extra and not extra[0].startswith("-"):
                value = extra.pop(0)
            if name in _RUN_BATCH_ONLY_ONE and value != "1":
                typer.echo(
                    f"error: {name} {value} is not supported: vbatch runs the model in one "
                    "process; use -dp N for N replicas",
                    err=True,
                )
                raise typer.Exit(2)
            typer.echo(f"vbatch run-batch ignores {name} (vLLM option)", err=True)
            continue
        args.append(arg)
    command = typer.main.get_command(app)
    code = command.main(args=["run", *args], prog_name="vbatch", standalone_mode=False)
    raise typer.Exit(code or 0)


def _settings(values: dict[str, Any]) -> str:
    # NOTE: identity checks, because `0.0 in (False,)` is true and would hide temperature=0.
    shown = {k: v for k, v in values.items() if v is not None and v is not False and v != []}
    return ", ".join(f"{k}={v}" for k, v in shown.items())


def main() -> None:
    from vbatch.job.stopping import command_signals

    with command_signals():
        try:
            app(prog_name="vbatch")
        except SystemExit as e:
            # NOTE: Typer turns a KeyboardInterrupt, wherever it lands, into this exit, silently.
            if e.code == INTERRUPTED_EXIT:
                typer.echo("error: interrupted", err=True)
            raise


if __name__ == "__main__":
    sys.exit(main())
