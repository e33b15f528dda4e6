"""The batch job's lifecycle: `run`, `resume` and `status` over a job directory."""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from vbatch.client.reasoning import check_reasoning_parser
from vbatch.client.tokenizer import check_template_kwargs
from vbatch.config import EngineConfig
from vbatch.engine_sets.base import require_ray
from vbatch.engine_sets.factory import open_engine_set
from vbatch.errors import (
    ConfigError,
    InputError,
    JobStateError,
    VbatchError,
    is_storage_failure,
    storage_error,
)
from vbatch.job.execution import EngineNeverReady, JobExecution
from vbatch.job.finalize import finish_completion
from vbatch.job.journal import JOURNAL_NAME, JobState, Journal, read_journal
from vbatch.job.manifest import (
    MANIFEST_NAME,
    MANIFEST_VERSION,
    InputFingerprint,
    JobOptions,
    Manifest,
    ModelIdentity,
    ShardRecord,
    input_fingerprint,
    model_identity,
)
from vbatch.job.options import JOB_SAMPLING, RunOptions
from vbatch.job.paths import (
    LOCK_NAME,
    JobLock,
    is_locked,
    job_dir_for,
    output_format,
    refuse_clashing_paths,
    remove_file,
    resume_command,
    same_file,
    tmp_output_path,
)
from vbatch.job.reader import InputReader, InputScan, scan_input
from vbatch.job.results import OUTPUT_COLUMNS
from vbatch.job.rows import ColumnOptions, LoraRows, RowParser
from vbatch.job.shard import Shard, shard_of_output, shards_on_disk
from vbatch.job.stopping import sigterm_interrupts
from vbatch.job.tasks import embedding_dimension, head_problem, task_columns
from vbatch.lora.adapter import read_adapter_config
from vbatch.models.config import declared_head
from vbatch.models.loader import locate_model
from vbatch.sampling_params import SamplingParams

if TYPE_CHECKING:
    from vbatch.client.core_client import EngineCoreClient

# NOTE: kept input columns may not shadow output fields (vbatch rows or OpenAI Batch lines).
RESERVED_COLUMNS = frozenset(OUTPUT_COLUMNS) | {"custom_id", "response"}


def reserved_columns(task: str) -> frozenset[str]:
    """The output fields a kept input column may not take, in a job of `task`."""
    if task == "generate":
        return RESERVED_COLUMNS
    return RESERVED_COLUMNS | set(task_columns(task))


MAX_KEPT_COLUMNS = 1000
# NOTE: more than a metrics file holds (a few KiB).
_METRICS_PROBE_BYTES = 16 << 10


@dataclass(frozen=True)
class JobSpec:
    """What decides a job's result; recorded in the manifest and fixed for the job's life."""

    input_path: Path
    output_path: Path
    input_format: str | None = None
    columns: ColumnOptions = field(default_factory=ColumnOptions)
    model: str | None = None
    engine_args: dict[str, Any] = field(default_factory=dict)
    sampling: dict[str, Any] = field(default_factory=dict)
    ordered: bool = False
    include_token_ids: bool = False
    parse_json: bool = False
    require_valid_json: bool = False
    shard: Shard | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_parser: str | None = None
    openai_defaults: dict[str, Any] = field(default_factory=dict)
    task: str = "generate"
    dimensions: int | None = None
    lora_rows: LoraRows | None = None
    served_model_names: tuple[str, ...] = ()


@dataclass(frozen=True)
class Outcome:
    """How a job invocation ended: `exit_code` 0 (complete) or 75 (interrupted, resumable)."""

    exit_code: int
    message: str
    status: dict[str, Any]


def _refuse_clashes(
    input_path: Path, output: Path, job_dir: Path, metrics_file: Path | None
) -> None:
    """`run X -o X --overwrite` would delete the input before reading it, and a metrics file
    naming the input or the output would replace it: refuse every written path that is a read
    one (or another written one), through symlinks, relative paths and hard links."""
    if output.is_dir():
        raise InputError(f"the output {output} is a directory; name a .jsonl or .parquet file")
    writes = {
        "the output": output,
        "the output's temp file": tmp_output_path(output),
        "the job directory": job_dir,
    }
    if metrics_file is not None:
        writes["the metrics file"] = metrics_file
    refuse_clashing_paths(writes, {"the input file": input_path})
    if metrics_file is not None:
        _make_metrics_dir(metrics_file)


def _make_metrics_dir(path: Path) -> None:
    """Before a job exists, as for the output: create the metrics file's directory, refusing a
    path it could not be written at (a directory, below a file, an unwritable directory)."""
    if path.is_dir():
        raise InputError(f"cannot write metrics file {path}: it is a directory")
    if path.exists() and not path.is_file():
        raise InputError(
            f"cannot write metrics file {path}: it is not a regular file (a pipe, a device or a "
            "socket), and vbatch replaces the file at each update"
        )
    _make_dir_for(path, "metrics file")
    # NOTE: a file is made there, written as much as an update writes, and removed: permissions
    # alone do not say (root on a read-only file system, /proc), nor does an empty file that
    # the disk is full.
    try:
        with tempfile.NamedTemporaryFile(
            dir=path.parent, prefix=f".{path.name}.", suffix=".probe"
        ) as probe:
            probe.write(bytes(_METRICS_PROBE_BYTES))
            probe.flush()
            os.fsync(probe.fileno())
    except OSError as e:
        where = (
            f"no space left on the device holding {path.parent}"
            if e.errno in (errno.ENOSPC, errno.EDQUOT)
            else f"{path.parent} is not writable ({e.strerror})"
        )
        raise InputError(f"cannot write metrics file {path}: {where}") from None


def _remove_job(job_dir: Path, output: Path) -> None:
    """Delete an old job's files and output, but not the lock file we hold. The manifest goes
    first: a crash part way leaves no job, never a job without its journal."""
    (job_dir / MANIFEST_NAME).unlink(missing_ok=True)
    for entry in job_dir.iterdir():
        if entry.name == LOCK_NAME:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    remove_file(output, "then run the same command again")
    remove_file(tmp_output_path(output), "then run the same command again")


def _check_openai_output(spec: JobSpec) -> None:
    """An OpenAI Batch output line is OpenAI's response and has no place for what these flags
    add: refused before the job exists, rather than left out of every line."""
    flags = [
        name
        for name, given in (
            ("--parse-json", spec.parse_json),
            ("--include-token-ids", spec.include_token_ids),
        )
        if given
    ]
    if flags:
        raise ConfigError(
            f"{' and '.join(flags)}: an OpenAI Batch output line is OpenAI's response, with no "
            "field for it; write Parquet output (-o OUT.parquet), where each line is a vbatch "
            "row with that column, or leave the flag out"
        )


def _resolve_columns(spec: JobSpec, reader: InputReader, scan: InputScan) -> ColumnOptions:
    """Turn --keep-all-columns into an explicit list and refuse kept names that shadow outputs;
    fix the id column where some rows have ids and others none (those are error rows then: an
    index taken for an id could equal another row's integer id)."""
    columns = spec.columns
    if scan.mixed_id_key is not None:
        columns = replace(columns, id_column=scan.mixed_id_key)
    keys = scan.keys
    if columns.keep_all_columns:
        names = reader.columns if reader.columns is not None else sorted(keys or ())
        reserved = reserved_columns(spec.task)
        kept = tuple(n for n in names if n not in reserved)
        return replace(columns, keep_columns=kept, keep_all_columns=False)
    return columns


def start_job(
    spec: JobSpec,
    options: RunOptions,
    *,
    overwrite: bool = False,
    llm_factory: Callable[..., Any] | None = None,
) -> Outcome:
    """`vbatch run`: take the job's lock, validate everything, write the manifest, then execute
    the job. Nothing is deleted (--overwrite) before the new job has passed validation.

    With `spec.shard`, the job is that shard's, writing `spec.shard.output_path(output)`."""
    if spec.shard is not None:
        _refuse_clean_shard(options)
        spec = replace(spec, output_path=spec.shard.output_path(spec.output_path))
    output = spec.output_path
    job_dir = job_dir_for(output)
    fmt = output_format(output)
    if options.ray is not None:
        require_ray()
    _refuse_clashes(spec.input_path, output, job_dir, options.metrics_file)
    _make_dir_for(output)
    # NOTE: until the job exists, SIGTERM interrupts as SIGINT does (the lock's directory goes).
    pre_job = contextlib.ExitStack()
    pre_job.enter_context(sigterm_interrupts())
    core = None
    try:
        lock = JobLock(job_dir, create=True)
        try:
            if llm_factory is None and options.ray is None and options.data_parallel_size == 1:
                core = _start_core_early(spec)
                if core is not None:
                    llm_factory = functools.partial(open_engine_set, started_core=core)
        except BaseException:
            _drop_unmade_job(job_dir, lock)
            raise
        return _create_and_execute(
            output,
            job_dir,
            lock,
            lambda: _prepare_job(
                spec,
                options,
                job_dir,
                fmt,
                overwrite=overwrite,
                engine_ready=None if core is None else core.wait_ready,
            ),
            options,
            llm_factory,
            pre_job,
        )
    finally:
        pre_job.close()
        if core is not None:
            # NOTE: a no-op once the job's LLM has shut it down; else a start nothing waits for.
            core.shutdown(timeout=0.0)


def _refuse_generation_options(spec: JobSpec, config: EngineConfig) -> None:
    """A pooling job's options that only generation reads (perplexity's --include-token-ids
    aside) are refused, not silently dropped."""
    sampling = spec.sampling
    # NOTE: sampling settings away from the job's defaults (--temperature, --max-tokens, --stop,
    # ...); n, logprobs and the constraint are named on their own below.
    own = ("n", "logprobs", "structured")
    sampled = [
        f"--{name.replace('_', '-')}"
        for name, value in sampling.items()
        if name not in own
        and value not in (None, [])
        and value != getattr(JOB_SAMPLING, name, None)
    ]
    given = {
        **dict.fromkeys(sampled, True),
        "--lora": bool(config.loras),
        "--n": (sampling.get("n") or 1) > 1,
        "--logprobs": sampling.get("logprobs") is not None,
        "--json-schema/--regex/--choice/--grammar": sampling.get("structured") is not None,
        "--reasoning-parser": spec.reasoning_parser is not None,
        "--parse-json": spec.parse_json,
        "--require-valid-json": spec.require_valid_json,
        "--include-token-ids": spec.include_token_ids and spec.task != "perplexity",
    }
    names = [name for name, is_given in given.items() if is_given]
    if names:
        what = "generation only"
        if names == ["--include-token-ids"]:
            what = "generation and --task perplexity only"
        raise InputError(f"{', '.join(names)}: {what}, not for a --task {spec.task} job")


def _check_dimensions(spec: JobSpec, dimensions: int) -> None:
    """--dimensions cuts embeddings: refused for another task, or past the model's width."""
    if spec.task != "embed":
        raise InputError(f"--dimensions: --task embed only, not for a --task {spec.task} job")
    width = embedding_dimension(locate_model(spec.model).path, None)
    if width is not None and dimensions > width:
        raise InputError(f"--dimensions {dimensions} exceeds the model's embedding size {width}")


def _refuse_missing_adapters(identity: ModelIdentity) -> None:
    """A job's LoRA adapters load from the paths it started with: one whose files are gone from
    there stops a resume, which --force cannot help."""
    for record in identity.loras or ():
        gone = [name for name, digest in record.files.items() if digest == "missing"]
        if gone:
            raise JobStateError(
                f"cannot resume: LoRA adapter {record.name!r} is missing from {record.path} "
                f"({', '.join(gone)}); put it back there, as the job loads its adapters from "
                "the paths it started with"
            )


def _start_core_early(spec: JobSpec) -> EngineCoreClient | None:
    """The engine core, spawned before the input is scanned, so its torch import and model load
    overlap the scan, the manifest and the tokenizer; None where the model or engine args are
    wrong, which the job's own checks then report in their usual order."""
    from vbatch.llm import start_core

    try:
        return start_core(spec.model, **spec.engine_args)
    except VbatchError:
        return None


def _drop_unmade_job(job_dir: Path, lock: JobLock) -> None:
    """Release `lock`, removing its directory unless a manifest made it a job: without one it
    holds only the lock we made."""
    if not (job_dir / MANIFEST_NAME).exists():
        shutil.rmtree(job_dir, ignore_errors=True)
    lock.release()


def _create_and_execute(
    output: Path,
    job_dir: Path,
    lock: JobLock,
    write_manifest: Callable[[], Manifest],
    options: RunOptions,
    llm_factory: Callable[..., Any] | None,
    pre_job: contextlib.ExitStack | None = None,
) -> Outcome:
    """Under `lock`, write a new job's manifest, then execute the job. If writing fails, the
    lock is released, and the directory removed unless a manifest made it a job. `pre_job`
    (what holds until the job exists) is closed once the job's own signal handling starts."""
    try:
        manifest = write_manifest()
    except BaseException:
        _drop_unmade_job(job_dir, lock)
        raise
    return _execute(
        output,
        job_dir,
        manifest,
        options,
        llm_factory,
        retry_errors=False,
        lock=lock,
        fresh=True,
        pre_job=pre_job,
    )


def _prepare_job(
    spec: JobSpec,
    options: RunOptions,
    job_dir: Path,
    fmt: str,
    *,
    overwrite: bool,
    engine_ready: Callable[[], None] | None = None,
) -> Manifest:
    """Validate a new job under its lock and write its manifest (replacing an old job when
    `overwrite`)."""
    output = spec.output_path
    if not overwrite and (job_dir / MANIFEST_NAME).exists():
        raise JobStateError(
            f"{output} already has a job directory ({job_dir}); continue it with "
            f"`{resume_command(output)}`, or pass --overwrite to start again"
        )
    if not overwrite and output.exists():
        raise JobStateError(f"{output} already exists; pass --overwrite to replace it")
    clashes = [n for n in spec.columns.keep_columns if n in reserved_columns(spec.task)]
    if clashes:
        raise InputError(f"--keep-columns {', '.join(clashes)} would overwrite output fields")
    defaults = SamplingParams.from_dict(spec.sampling)
    defaults.updated(spec.openai_defaults)
    config = EngineConfig.from_dict({**spec.engine_args, "model": spec.model})
    if spec.task != "generate":
        _refuse_generation_options(spec, config)
    if spec.dimensions is not None:
        _check_dimensions(spec, spec.dimensions)
    problem = head_problem(spec.task, declared_head(locate_model(spec.model).path))
    if problem is not None:
        raise InputError(problem)
    for name, path in config.loras:
        read_adapter_config(name, path, config.max_lora_rank)
    if options.data_parallel_size > 1:
        from vbatch.client.placement import core_placements

        core_placements(config, options.data_parallel_size)
    template_kwargs = spec.chat_template_kwargs
    if template_kwargs is not None:
        template_kwargs = check_template_kwargs(template_kwargs, "--chat-template-kwargs")
    check_reasoning_parser(spec.reasoning_parser)
    reader = InputReader(spec.input_path, spec.input_format, spec.columns)
    scan = scan_input(
        reader,
        RowParser(spec.columns, defaults, template_kwargs, loras=spec.lora_rows),
        collect_keys=spec.columns.keep_all_columns,
        shard=spec.shard,
    )
    if scan.duplicate is not None:
        raise InputError(f"{spec.input_path}: {scan.duplicate}; ids must be unique")
    columns = _resolve_columns(spec, reader, scan)
    if scan.is_openai and fmt == "jsonl":
        _check_openai_output(spec)
    from vbatch import __version__

    manifest = Manifest(
        vbatch_version=__version__,
        input_path=os.path.abspath(spec.input_path),
        input_format=reader.format,
        input=input_fingerprint(spec.input_path),
        num_rows=scan.num_rows,
        id_kind=scan.id_kind,
        output_path=os.path.abspath(output),
        output_format=fmt,
        model=model_identity(spec.model, spec.engine_args.get("loras")),
        engine=dict(spec.engine_args),
        sampling=defaults.to_dict(),
        options=JobOptions(
            columns=columns,
            ordered=spec.ordered,
            include_token_ids=spec.include_token_ids,
            parse_json=spec.parse_json,
            require_valid_json=spec.require_valid_json,
            openai_output=scan.is_openai and fmt == "jsonl",
            chat_template_kwargs=template_kwargs,
            reasoning_parser=spec.reasoning_parser,
            openai_defaults=dict(spec.openai_defaults),
            task=spec.task,
            dimensions=spec.dimensions,
            served_model_names=spec.served_model_names,
            **options.result_settings(),
        ),
        shard=None if spec.shard is None else _shard_record(spec.shard, scan.input_rows),
        lora_rows=spec.lora_rows,
        manifest_version=MANIFEST_VERSION,
    )
    if engine_ready is not None and ((job_dir / MANIFEST_NAME).exists() or output.exists()):
        # NOTE: --overwrite replaces the old job only once the new one's engine is up: a start
        # that fails (a length past the model's, no room for the KV cache) leaves it as it was.
        try:
            engine_ready()
        except VbatchError as e:
            raise type(e)(f"{e}\n{output} and its job are kept as they were") from e
    _remove_job(job_dir, output)
    try:
        manifest.save(job_dir)
    except BaseException as e:
        if is_storage_failure(e):
            raise storage_error(
                e, job_dir / MANIFEST_NAME, "then run the same command again"
            ) from e
        raise
    return manifest


def resume_job(
    output: Path,
    overrides: dict[str, Any] | None = None,
    *,
    force: bool = False,
    retry_errors: bool = False,
    llm_factory: Callable[..., Any] | None = None,
) -> Outcome:
    """`vbatch resume`: check the manifest against the world, then finish the job. A shard's
    output with no job yet (`out.shard-I-of-N.parquet`) starts with another shard's settings.

    Run options come from the manifest; `overrides` (RunOptions fields) replace some of them.
    """
    job_dir = job_dir_for(output)
    if not job_dir.is_dir():
        sibling = _sibling_manifest(output)
        if sibling is None:
            raise _no_job("there is no job to resume", output, job_dir)
        return _start_shard_like(output, sibling, overrides, llm_factory)
    lock = JobLock(job_dir)
    try:
        return _resume_locked(output, job_dir, lock, overrides, force, retry_errors, llm_factory)
    except BaseException:
        lock.release()
        raise


def _sibling_manifest(output: Path) -> Manifest | None:
    """For a shard's output with no job, the manifest of another shard of its array, if any."""
    shard = shard_of_output(output)
    if shard is None:
        return None
    base = base_output(output, shard)
    siblings = [s for s in shards_on_disk(base) if s.count == shard.count and s != shard]
    for sibling in sorted(siblings, key=lambda s: s.index):
        job_dir = job_dir_for(sibling.output_path(base))
        if (job_dir / MANIFEST_NAME).is_file():
            manifest = Manifest.load(job_dir)
            if manifest.shard_spec == sibling:
                return manifest
    return None


def _start_shard_like(
    output: Path,
    sibling: Manifest,
    overrides: dict[str, Any] | None,
    llm_factory: Callable[..., Any] | None,
) -> Outcome:
    """Start the shard that `output` names with `sibling`'s input, model and settings, so that
    `vbatch merge` accepts it; refused when the input or model changed since `sibling` started."""
    shard = shard_of_output(output)
    assert shard is not None and sibling.shard_spec is not None
    input_path = Path(sibling.input_path)
    if not input_path.is_file():
        raise InputError(f"the input file {input_path} of shard {sibling.shard_spec} is gone")
    identity = model_identity(sibling.model_to_load(), sibling.engine.get("loras"))
    _refuse_missing_adapters(identity)
    mismatches = sibling.mismatches(input_fingerprint(input_path), identity)
    if mismatches:
        raise JobStateError(
            f"cannot start shard {shard} like shard {sibling.shard_spec}: "
            + "; ".join(mismatches)
            + ". Run every shard again with `vbatch run ... --shard I/N --overwrite`"
        )
    if output.exists():
        raise JobStateError(f"{output} exists but has no job directory; move it away first")
    options = sibling.options.run_options(overrides)
    _refuse_clean_shard(options)
    job_dir = job_dir_for(output)
    _refuse_clashes(input_path, output, job_dir, options.metrics_file)
    lock = JobLock(job_dir, create=True)
    if (job_dir / MANIFEST_NAME).exists():
        try:
            return _resume_locked(output, job_dir, lock, overrides, False, False, llm_factory)
        except BaseException:
            lock.release()
            raise

    def write_manifest() -> Manifest:
        scan = _rescan_input(sibling, shard)
        manifest = msgspec.structs.replace(
            sibling,
            output_path=os.path.abspath(output),
            num_rows=scan.num_rows,
            shard=_shard_record(shard, scan.input_rows),
            created=time.time(),
        )
        manifest.save(job_dir)
        return manifest

    return _create_and_execute(output, job_dir, lock, write_manifest, options, llm_factory)


def _rescan_input(manifest: Manifest, shard: Shard | None) -> InputScan:
    """The id pre-pass over a job's input again, with the job's own columns and row settings."""
    columns = replace(manifest.options.columns, keep_all_columns=False)
    reader = InputReader(
        Path(manifest.input_path), manifest.input_format, columns, check_columns=False
    )
    parser = RowParser(
        columns,
        SamplingParams.from_dict(manifest.sampling),
        manifest.options.chat_template_kwargs,
        loras=manifest.lora_rows,
    )
    return scan_input(reader, parser, shard=shard)


def _resume_locked(
    output: Path,
    job_dir: Path,
    lock: JobLock,
    overrides: dict[str, Any] | None,
    force: bool,
    retry_errors: bool,
    llm_factory: Callable[..., Any] | None,
) -> Outcome:
    """resume_job's checks, under the job's lock (--force rewrites the manifest)."""
    manifest = Manifest.load(job_dir)
    quiet = (overrides or {}).get("display") == "quiet"
    _adopt_moved_output(output, job_dir, manifest, quiet=quiet)
    input_path = Path(manifest.input_path)
    if not input_path.is_file():
        what = "is now a directory" if input_path.is_dir() else "no longer exists"
        raise InputError(f"the job's input file {input_path} {what}")
    fingerprint = input_fingerprint(input_path)
    identity = model_identity(manifest.model.source, manifest.engine.get("loras"))
    _refuse_missing_adapters(identity)
    mismatches = manifest.mismatches(fingerprint, identity)
    if mismatches and not force:
        raise JobStateError(
            "cannot resume: " + "; ".join(mismatches) + ". The result would not match an "
            "uninterrupted run. Pass --force to resume anyway, or start again with "
            "`vbatch run ... --overwrite`"
        )
    if mismatches:
        _refuse_forcing_complete(job_dir, output, mismatches)
        old_input, old_rows = manifest.input, manifest.num_rows
        scan = _rescan_input(manifest, manifest.shard_spec)
        _refuse_lost_rows(job_dir, manifest, output, scan.input_rows)
        _accept_changes(job_dir, manifest, fingerprint, identity, scan)
        if old_input.sampled_sha256 != fingerprint.sampled_sha256:
            _warn_index_matching(job_dir, output, old_rows, manifest.num_rows)
    options = manifest.options.run_options(overrides)
    _refuse_clashes(input_path, output, job_dir, options.metrics_file)
    if manifest.shard is not None:
        _refuse_clean_shard(options)
    return _execute(
        output, job_dir, manifest, options, llm_factory, retry_errors=retry_errors, lock=lock
    )


def _adopt_moved_output(
    output: Path, job_dir: Path, manifest: Manifest, *, quiet: bool = False
) -> None:
    """The job directory beside `output` belongs to `output`: where its manifest names another
    path, the output and its job directory were moved or copied together, and the job goes on
    here (its rows are never written to the old path)."""
    here = os.path.abspath(output)
    if manifest.output_path == here:
        return
    if same_file(job_dir_for(Path(manifest.output_path)), job_dir):
        # NOTE: the same job directory by another spelling (`..`, a symlinked folder).
        return
    if not quiet:
        print(
            f"note: this job was started as {manifest.output_path}; it goes on at {here}, "
            "beside its job directory",
            file=sys.stderr,
        )
    manifest.output_path = here
    manifest.save(job_dir)


def _make_dir_for(path: Path, what: str = "") -> None:
    """Create `path`'s directory, refusing a path below a file (`out.jsonl/x.jsonl`)."""
    blocking = next((p for p in path.parents if p.exists() and not p.is_dir()), None)
    if blocking is not None:
        name = f"{what} {path}" if what else str(path)
        raise InputError(f"cannot write {name}: {blocking} is a file, not a directory")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise storage_error(e, path.parent, "then run the job again") from e


def _refuse_forcing_complete(job_dir: Path, output: Path, mismatches: list[str]) -> None:
    """resume --force on a complete job: its output is final, so it takes no new input rows or
    settings (the manifest is left as it is)."""
    state, _ = read_journal(job_dir / JOURNAL_NAME)
    if state.complete is None:
        return
    raise JobStateError(
        f"cannot resume: {output} is already complete, and " + "; ".join(mismatches) + ". A "
        "complete job takes no new rows or settings: run the new rows as a new job, or start "
        f"again with `vbatch run ... -o {shlex.quote(str(output))} --overwrite`"
    )


def _refuse_lost_rows(job_dir: Path, manifest: Manifest, output: Path, num_rows: int) -> None:
    """resume --force on an input that now ends before rows already committed (`num_rows`, all
    of its rows: indices are positions in the whole input, a shard's included): those rows would
    stay in the output with no input row behind them."""
    state, _ = read_journal(job_dir / JOURNAL_NAME)
    ranges = state.committed.ranges()
    last = ranges[-1][1] if ranges else 0
    if last > num_rows:
        raise JobStateError(
            f"cannot resume: {manifest.input_path} now has {num_rows} rows, but rows up to "
            f"index {last - 1} are already in the output, and a job cannot take finished rows "
            f"back out. Start again with `vbatch run ... -o {shlex.quote(str(output))} "
            "--overwrite`"
        )


def _warn_index_matching(job_dir: Path, output: Path, old_rows: int, new_rows: int) -> None:
    """resume --force on a changed input: committed rows are identified by row position."""
    state, _ = read_journal(job_dir / JOURNAL_NAME)
    if not len(state.committed) or state.complete is not None:
        return
    print(
        f"warning: the input changed ({old_rows} -> {new_rows} rows). The "
        f"{len(state.committed)} committed rows are matched to the new input by position (row "
        "index), not by id: the rows now at those positions are skipped, and the rest run. If "
        "rows were inserted, removed or reordered anywhere but after the end, the output will "
        "miss some rows and repeat others; start again with "
        f"`vbatch run ... -o {shlex.quote(str(output))} --overwrite` instead.",
        file=sys.stderr,
    )


def _accept_changes(
    job_dir: Path,
    manifest: Manifest,
    fingerprint: InputFingerprint,
    identity: ModelIdentity,
    scan: InputScan,
) -> None:
    """--force: adopt the changed input (`scan`: its id pre-pass) and model, so later resumes
    check against them."""
    from vbatch import __version__

    if scan.duplicate is not None:
        raise InputError(f"{manifest.input_path}: {scan.duplicate}; ids must be unique")
    manifest.id_kind = _adopted_id_kind(job_dir, manifest, scan.id_kind)
    manifest.input, manifest.model, manifest.num_rows = fingerprint, identity, scan.num_rows
    if manifest.shard_spec is not None:
        manifest.shard = _shard_record(manifest.shard_spec, scan.input_rows)
    manifest.vbatch_version = __version__
    manifest.save(job_dir)


def _adopted_id_kind(job_dir: Path, manifest: Manifest, id_kind: str) -> str:
    """The id kind a forced resume goes on with. Integer ids that became strings cannot share
    the int64 id column of Parquet parts already committed, so that change is refused."""
    if id_kind == manifest.id_kind or manifest.id_kind == "str":
        # NOTE: string ids that became integers are written as strings, as for mixed input.
        return manifest.id_kind
    state, _ = read_journal(job_dir / JOURNAL_NAME)
    if manifest.output_format == "parquet" and len(state.committed):
        raise JobStateError(
            f"cannot resume: the ids of {manifest.input_path} were all integers and now some are "
            f"strings, but {len(state.committed)} committed rows hold integer ids in the Parquet "
            "id column. Restore integer ids, or start again with `vbatch run ... --overwrite`"
        )
    return id_kind


def _execute(
    output: Path,
    job_dir: Path,
    manifest: Manifest,
    options: RunOptions,
    llm_factory: Callable[..., Any] | None,
    *,
    retry_errors: bool,
    lock: JobLock,
    fresh: bool = False,
    pre_job: contextlib.ExitStack | None = None,
) -> Outcome:
    """Run the job under its `lock` (released here); `output` is the path as the user wrote it
    (for messages). A `fresh` job whose engine never started is removed (dropped_job), as is
    one interrupted before its signal handling took over (with nothing committed)."""
    journal = None
    try:
        journal = Journal(job_dir)
        if journal.state.complete is None:
            if retry_errors and len(journal.state.errors):
                journal.append(
                    "retry", indices=journal.state.errors.ranges(), offset=journal.state.offset
                )
            execution = JobExecution(job_dir, manifest, journal, options, llm_factory)
            if pre_job is not None:
                execution.before_signals = pre_job.close
            try:
                exit_code, message = execution.run(output)
            except EngineNeverReady as e:
                journal.close()
                if not fresh:
                    hint = f"0 rows are committed. Resume with: {resume_command(output)}"
                    raise type(e.cause)(f"{e}\n{hint}") from e.cause
                raise dropped_job(e, job_dir, Path(manifest.output_path)) from e.cause
            shard = manifest.shard_spec
            if exit_code == 0 and shard is not None:
                merged = shlex.quote(str(base_output(output, shard)))
                message += f". Once all {shard.count} shards are done: vbatch merge {merged}"
        elif retry_errors and journal.state.complete["errors"]:
            raise JobStateError(
                f"{output} is already complete; --retry-errors only reruns rows of an unfinished "
                "job. Select the error rows from the output and run them as a new job"
            )
        else:
            _refuse_lost_output(output, Path(manifest.output_path), journal.state)
            exit_code, message = 0, f"{output} is already complete"
            finish_completion(job_dir, Path(manifest.output_path), journal.state)
            if options.metrics_file is not None:
                _write_complete_metrics(options.metrics_file, manifest, journal.state, output)
        journal.close()
        status = _status(job_dir, manifest, journal.state)
        # NOTE: removed under the lock, so no other process can have locked the doomed file.
        if exit_code == 0 and options.clean:
            shutil.rmtree(job_dir)
    except KeyboardInterrupt:
        if fresh and (journal is None or journal.state.num_records == 0):
            if journal is not None:
                journal.close()
            _remove_new_job(job_dir, Path(manifest.output_path))
        raise
    finally:
        lock.release()
    return Outcome(exit_code, message, status)


def _write_complete_metrics(path: Path, manifest: Manifest, state: JobState, output: Path) -> None:
    """The metrics file of a resume that found its job complete: the job's final counts, so a
    pipeline that reads it after every `vbatch resume` finds it whether or not rows ran."""
    from vbatch.job.metrics import JobMetrics
    from vbatch.job.progress import snapshot_to_json, write_json_atomic

    metrics = JobMetrics(
        total_rows=manifest.num_rows,
        rows_done_before=len(state.committed),
        rows_errored_before=len(state.errors),
        model=manifest.model.name,
        input_path=manifest.input_path,
        output_path=str(output),
        task=manifest.options.task,
    )
    metrics.set_state("done")
    try:
        write_json_atomic(path, snapshot_to_json(metrics.snapshot()))
    except OSError as e:
        raise ConfigError(f"cannot write metrics file {path}: {e}") from e


def _remove_new_job(job_dir: Path, output: Path) -> None:
    """Remove a new job that ran nothing: its directory, and its output while still empty."""
    shutil.rmtree(job_dir, ignore_errors=True)
    with contextlib.suppress(OSError):
        if output.stat().st_size == 0:
            output.unlink()


def dropped_job(error: EngineNeverReady, job_dir: Path, output: Path) -> VbatchError:
    """Remove a new job whose engine never started, so that the same command, fixed, runs
    again; the error to show."""
    _remove_new_job(job_dir, output)
    return type(error.cause)(
        f"{error}\nno row ran, so no job was kept: fix the cause and run the same command again"
    )


def _shard_record(shard: Shard, input_rows: int) -> ShardRecord:
    return ShardRecord(index=shard.index, count=shard.count, input_rows=input_rows)


def _refuse_clean_shard(options: RunOptions) -> None:
    if options.clean:
        raise ConfigError(
            "--clean would remove the shard's job directory, whose manifest `vbatch merge` "
            "checks; pass --remove-shards to `vbatch merge` instead"
        )


def base_output(shard_output: Path, shard: Shard) -> Path:
    """`out.shard-I-of-N.parquet` -> `out.parquet`."""
    stem = shard_output.stem.removesuffix(f".shard-{shard.index}-of-{shard.count}")
    return shard_output.with_name(stem + shard_output.suffix)


def _refuse_lost_output(output: Path, final: Path, state: JobState) -> None:
    """A complete job whose output file is gone: the job directory keeps no copy of the rows."""
    assert state.complete is not None
    tmp_name = state.complete.get("tmp")
    if final.exists() or (tmp_name is not None and (final.parent / tmp_name).exists()):
        return
    raise JobStateError(
        f"the job for {output} finished, but its output file no longer exists (deleted or "
        "moved?), and the job directory keeps no copy of the rows. Put the file back, or run "
        f"the job again with `vbatch run ... -o {shlex.quote(str(output))} --overwrite`"
    )


def _no_job(what: str, output: Path, job_dir: Path) -> JobStateError:
    """`what` for `output`, saying why: no job directory, or a file in its place."""
    if job_dir.exists():
        return JobStateError(f"{what} for {output}: {job_dir} is not a directory")
    return JobStateError(f"{what} for {output} (no {job_dir})")


def job_status(output: Path) -> dict[str, Any]:
    """`vbatch status`: what the job directory says, without changing anything; with a list of
    `shards` (see job/merge.py) when `output` has shards (`--shard I/N`)."""
    from vbatch.job.merge import shard_statuses

    job_dir = job_dir_for(output)
    shards = shard_statuses(output)
    if not job_dir.is_dir():
        if shards:
            return {"output": str(output.absolute()), "merged": output.exists(), "shards": shards}
        raise _no_job("there is no job", output, job_dir)
    if not (job_dir / MANIFEST_NAME).exists() and is_locked(job_dir):
        raise JobStateError(
            f"a `vbatch run` is still creating the job in {job_dir} (it checks its input "
            "first); ask again once it runs"
        )
    state, _ = read_journal(job_dir / JOURNAL_NAME)
    manifest = Manifest.load(job_dir)
    # NOTE: a moved or copied job reports where it is now (resume adopts that path).
    manifest.output_path = os.path.abspath(output)
    status = _status(job_dir, manifest, state)
    return {**status, "shards": shards} if shards else status


def _status(job_dir: Path, manifest: Manifest, state: JobState) -> dict[str, Any]:
    last = state.last_commit_time
    return {
        "output": manifest.output_path,
        "job_dir": os.path.abspath(job_dir),
        "complete": state.complete is not None,
        "rows": manifest.num_rows,
        "done": len(state.committed),
        "errored": len(state.errors),
        "remaining": manifest.num_rows - len(state.committed),
        "last_commit_time": datetime.fromtimestamp(last).isoformat(timespec="seconds")
        if last
        else None,
        "created": datetime.fromtimestamp(manifest.created).isoformat(timespec="seconds"),
        "input": manifest.input_path,
        "model": msgspec.to_builtins(manifest.model),
        "engine": manifest.engine,
        "sampling": manifest.sampling,
        "options": msgspec.to_builtins(manifest.options),
        "vbatch_version": manifest.vbatch_version,
        "shard": msgspec.to_builtins(manifest.shard),
    }
