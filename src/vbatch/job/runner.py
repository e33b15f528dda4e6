"""The batch job's lifecycle: `run`, `resume` and `status` over a job directory."""

from __future__ import annotations

import fcntl
import os
import shlex
import shutil
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from vbatch.config import EngineConfig
from vbatch.errors import InputError, JobStateError, is_storage_failure, storage_error
from vbatch.job.finalize import finish_completion, tmp_output_path
from vbatch.job.journal import JOURNAL_NAME, JobState, Journal, read_journal
from vbatch.job.manifest import MANIFEST_NAME, Manifest, input_fingerprint, model_identity
from vbatch.job.options import RunOptions, require_ray
from vbatch.job.reader import InputReader, scan_input
from vbatch.job.results import OUTPUT_COLUMNS
from vbatch.job.rows import ColumnOptions, RowParser
from vbatch.sampling_params import SamplingParams

JOB_DIR_SUFFIX = ".vbatch"
OUTPUT_FORMATS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet", ".pq": "parquet"}
# NOTE: kept input columns may not shadow output fields (vbatch rows or OpenAI Batch lines).
RESERVED_COLUMNS = frozenset(OUTPUT_COLUMNS) | {"custom_id", "response"}
MAX_KEPT_COLUMNS = 1000
LOCK_NAME = "lock"
_LOCK_ATTEMPTS = 100


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


@dataclass(frozen=True)
class Outcome:
    """How a job invocation ended: `exit_code` 0 (complete) or 75 (interrupted, resumable)."""

    exit_code: int
    message: str
    status: dict[str, Any]


def job_dir_for(output: Path) -> Path:
    return output.with_name(output.name + JOB_DIR_SUFFIX)


def output_format(output: Path) -> str:
    fmt = OUTPUT_FORMATS.get(output.suffix.lower())
    if fmt is None:
        raise InputError(
            f"cannot tell the output format of {output}; use one of {', '.join(OUTPUT_FORMATS)}"
        )
    return fmt


def resume_command(output: Path) -> str:
    return f"vbatch resume {shlex.quote(str(output))}"


class JobLock:
    """An exclusive flock on the job directory, so two processes never append to one journal.

    Invariant: the lock file is never deleted while a job directory exists (`--overwrite` keeps
    it), so every process locks the same inode. With `create`, the directory is made first.
    """

    def __init__(self, job_dir: Path, *, create: bool = False) -> None:
        path = job_dir / LOCK_NAME
        for _ in range(_LOCK_ATTEMPTS):
            if create:
                try:
                    job_dir.mkdir(exist_ok=True)
                except OSError as e:
                    raise storage_error(e, job_dir.parent) from None
            try:
                self._file = open(path, "a")  # noqa: SIM115
            except FileNotFoundError:
                if create:
                    continue
                raise JobStateError(f"there is no job in {job_dir}") from None
            except OSError as e:
                raise JobStateError(
                    f"cannot open the job's lock file {path}: {e.strerror}"
                ) from None
            try:
                fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                self._file.close()
                raise JobStateError(
                    f"another vbatch process is running the job in {job_dir}; wait for it to "
                    "finish or stop it first"
                ) from None
            # NOTE: a run that failed before its job started removes the directory it made; a
            # lock on that removed file would guard nothing, so lock the file now there.
            try:
                if os.path.samestat(os.fstat(self._file.fileno()), os.stat(path)):
                    return
            except FileNotFoundError:
                pass
            self._file.close()
            if not create:
                raise JobStateError(f"there is no job in {job_dir}")
        raise JobStateError(f"cannot lock {path}: it keeps being removed")

    def release(self) -> None:
        self._file.close()


def _refuse_output_onto_input(input_path: Path, output: Path, job_dir: Path) -> None:
    """`run X -o X --overwrite` would delete the input before reading it: refuse, through
    symlinks, relative paths and hard links."""
    if output.is_dir():
        raise InputError(f"the output {output} is a directory; name a .jsonl or .parquet file")
    source = input_path.resolve()
    for path, what in ((output, "output"), (tmp_output_path(output), "output's temp file")):
        is_same = path.resolve() == source
        if not is_same and path.exists() and input_path.exists():
            is_same = os.path.samefile(path, input_path)
        if is_same:
            raise InputError(
                f"the {what} {path} is the input file {input_path}; write to another file"
            )
    if source.is_relative_to(job_dir.resolve()):
        raise InputError(f"the input {input_path} is inside the job directory {job_dir}")


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
    output.unlink(missing_ok=True)
    tmp_output_path(output).unlink(missing_ok=True)


def _resolve_columns(spec: JobSpec, reader: InputReader, keys: set[str] | None) -> ColumnOptions:
    """Turn --keep-all-columns into an explicit list and refuse kept names that shadow outputs."""
    columns = spec.columns
    if columns.keep_all_columns:
        names = reader.columns if reader.columns is not None else sorted(keys or ())
        kept = tuple(n for n in names if n not in RESERVED_COLUMNS)
        return ColumnOptions(
            columns.prompt_column, columns.messages_column, columns.id_column, kept
        )
    return columns


def start_job(
    spec: JobSpec,
    options: RunOptions,
    *,
    overwrite: bool = False,
    llm_factory: Callable[..., Any] | None = None,
) -> Outcome:
    """`vbatch run`: take the job's lock, validate everything, write the manifest, then execute
    the job. Nothing is deleted (--overwrite) before the new job has passed validation."""
    output = spec.output_path
    job_dir = job_dir_for(output)
    fmt = output_format(output)
    if options.ray is not None:
        require_ray()
    _refuse_output_onto_input(spec.input_path, output, job_dir)
    output.parent.mkdir(parents=True, exist_ok=True)
    lock = JobLock(job_dir, create=True)
    try:
        manifest = _prepare_job(spec, options, job_dir, fmt, overwrite=overwrite)
    except BaseException:
        # NOTE: a directory without a manifest holds no job: it is only the lock we made.
        if not (job_dir / MANIFEST_NAME).exists():
            shutil.rmtree(job_dir, ignore_errors=True)
        lock.release()
        raise
    return _execute(output, job_dir, manifest, options, llm_factory, retry_errors=False, lock=lock)


def _prepare_job(
    spec: JobSpec, options: RunOptions, job_dir: Path, fmt: str, *, overwrite: bool
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
    clashes = [n for n in spec.columns.keep_columns if n in RESERVED_COLUMNS]
    if clashes:
        raise InputError(f"--keep-columns {', '.join(clashes)} would overwrite output fields")
    defaults = SamplingParams.from_dict(spec.sampling)
    EngineConfig.from_dict({**spec.engine_args, "model": spec.model})
    reader = InputReader(spec.input_path, spec.input_format, spec.columns)
    scan = scan_input(
        reader, RowParser(spec.columns, defaults), collect_keys=spec.columns.keep_all_columns
    )
    if scan.duplicate is not None:
        raise InputError(f"{spec.input_path}: {scan.duplicate}; ids must be unique")
    columns = _resolve_columns(spec, reader, scan.keys)
    from vbatch import __version__

    manifest = Manifest(
        vbatch_version=__version__,
        input_path=str(spec.input_path.absolute()),
        input_format=reader.format,
        input=input_fingerprint(spec.input_path),
        num_rows=scan.num_rows,
        id_kind=scan.id_kind,
        output_path=str(output.absolute()),
        output_format=fmt,
        model=model_identity(spec.model),
        engine=dict(spec.engine_args),
        sampling=defaults.to_dict(),
        options={
            "columns": asdict(columns),
            "ordered": spec.ordered,
            "include_token_ids": spec.include_token_ids,
            "parse_json": spec.parse_json,
            "openai_output": scan.is_openai and fmt == "jsonl",
            **options.result_settings(),
        },
    )
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
    """`vbatch resume`: check the manifest against the world, then finish the job.

    Run options come from the manifest; `overrides` (RunOptions fields) replace some of them.
    """
    job_dir = job_dir_for(output)
    if not job_dir.is_dir():
        raise JobStateError(f"there is no job to resume for {output} (no {job_dir})")
    lock = JobLock(job_dir)
    try:
        return _resume_locked(output, job_dir, lock, overrides, force, retry_errors, llm_factory)
    except BaseException:
        lock.release()
        raise


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
    input_path = Path(manifest.input_path)
    if not input_path.is_file():
        raise InputError(f"the job's input file {input_path} no longer exists")
    fingerprint = input_fingerprint(input_path)
    identity = model_identity(manifest.model["source"])
    mismatches = manifest.mismatches(fingerprint, identity)
    if mismatches and not force:
        raise JobStateError(
            "cannot resume: " + "; ".join(mismatches) + ". The result would not match an "
            "uninterrupted run. Pass --force to resume anyway, or start again with "
            "`vbatch run ... --overwrite`"
        )
    if mismatches:
        old_input, old_rows = manifest.input, manifest.num_rows
        _accept_changes(job_dir, manifest, fingerprint, identity)
        if old_input["sampled_sha256"] != fingerprint["sampled_sha256"]:
            _warn_index_matching(job_dir, output, old_rows, manifest.num_rows)
    saved = {
        k: manifest.options[k] for k in RunOptions().result_settings() if k in manifest.options
    }
    options = RunOptions.restore(saved, overrides or {})
    return _execute(
        output, job_dir, manifest, options, llm_factory, retry_errors=retry_errors, lock=lock
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
    job_dir: Path, manifest: Manifest, fingerprint: dict[str, Any], identity: dict[str, Any]
) -> None:
    """--force: adopt the changed input and model, so later resumes check against them."""
    from vbatch import __version__

    columns = ColumnOptions(**{**manifest.options["columns"], "keep_all_columns": False})
    reader = InputReader(Path(manifest.input_path), manifest.input_format, columns)
    scan = scan_input(reader, RowParser(columns, SamplingParams.from_dict(manifest.sampling)))
    if scan.duplicate is not None:
        raise InputError(f"{manifest.input_path}: {scan.duplicate}; ids must be unique")
    manifest.id_kind = _adopted_id_kind(job_dir, manifest, scan.id_kind)
    manifest.input, manifest.model, manifest.num_rows = fingerprint, identity, scan.num_rows
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
) -> Outcome:
    """Run the job under its `lock` (released here); `output` is the path as the user wrote it
    (for messages)."""
    try:
        from vbatch.job.execution import JobExecution

        journal = Journal(job_dir)
        if journal.state.complete is None:
            if retry_errors and len(journal.state.errors):
                journal.append(
                    "retry", indices=journal.state.errors.ranges(), offset=journal.state.offset
                )
            execution = JobExecution(job_dir, manifest, journal, options, llm_factory)
            exit_code, message = execution.run(output)
        elif retry_errors and journal.state.complete["errors"]:
            raise JobStateError(
                f"{output} is already complete; --retry-errors only reruns rows of an unfinished "
                "job. Select the error rows from the output and run them as a new job"
            )
        else:
            _refuse_lost_output(output, Path(manifest.output_path), journal.state)
            exit_code, message = 0, f"{output} is already complete"
            finish_completion(job_dir, Path(manifest.output_path), journal.state)
        journal.close()
        status = _status(job_dir, manifest, journal.state)
        # NOTE: removed under the lock, so no other process can have locked the doomed file.
        if exit_code == 0 and options.clean:
            shutil.rmtree(job_dir)
    finally:
        lock.release()
    return Outcome(exit_code, message, status)


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


def job_status(output: Path) -> dict[str, Any]:
    """`vbatch status`: what the job directory says, without changing anything."""
    job_dir = job_dir_for(output)
    if not job_dir.is_dir():
        raise JobStateError(f"there is no job for {output} (no {job_dir})")
    state, _ = read_journal(job_dir / JOURNAL_NAME)
    return _status(job_dir, Manifest.load(job_dir), state)


def _status(job_dir: Path, manifest: Manifest, state: JobState) -> dict[str, Any]:
    last = state.last_commit_time
    return {
        "output": manifest.output_path,
        "job_dir": str(job_dir),
        "complete": state.complete is not None,
        "rows": manifest.num_rows,
        "done": len(state.committed),
        "errored": len(state.errors),
        "remaining": manifest.num_rows - len(state.committed),
        "last_commit": datetime.fromtimestamp(last).isoformat(timespec="seconds") if last else None,
        "created": datetime.fromtimestamp(manifest.created).isoformat(timespec="seconds"),
        "input": manifest.input_path,
        "model": manifest.model,
        "engine": manifest.engine,
        "sampling": manifest.sampling,
        "options": manifest.options,
        "vbatch_version": manifest.vbatch_version,
    }
