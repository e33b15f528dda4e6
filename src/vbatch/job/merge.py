"""`vbatch merge` and per-shard status: check a job array's shards, merge them atomically."""

from __future__ import annotations

import contextlib
import glob
import itertools
import os
import shlex
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from vbatch.errors import JobStateError, is_storage_failure, storage_error
from vbatch.job.encoding import parquet_batches
from vbatch.job.finalize import BATCH_ROWS, RowGroupSink, write_sorted_lines, write_sorted_parquet
from vbatch.job.journal import JOURNAL_NAME, JobState, read_journal
from vbatch.job.manifest import MANIFEST_NAME, Manifest
from vbatch.job.paths import (
    JobLock,
    fsync_dir,
    is_locked,
    job_dir_for,
    new_temp_file,
    output_format,
    refuse_clashing_paths,
    resume_command,
)
from vbatch.job.results import line_index
from vbatch.job.shard import Shard, shards_on_disk

# NOTE: settings that change no output row; shards may differ in them. Threads, like -dp (a run
# option, never compared), spread the same arithmetic over CPUs: a row's tokens do not change.
_RUN_ONLY_ENGINE_ARGS = frozenset({"heartbeat_timeout_s", "num_threads"})
_RESULT_OPTIONS = (
    "columns",
    "include_token_ids",
    "parse_json",
    "require_valid_json",
    "openai_output",
    "openai_defaults",
    "task",
    "dimensions",
)
_RUN_ROWS = 65536


@dataclass
class ShardJob:
    """One shard of a job array as found on disk: its files, manifest and journal state."""

    shard: Shard
    output: Path
    manifest: Manifest | None
    state: JobState | None
    is_starting: bool = False  # no manifest yet, and a `vbatch run` holds the job's lock

    @property
    def job_dir(self) -> Path:
        return job_dir_for(self.output)

    @property
    def condition(self) -> str:
        if self.manifest is not None and self.state is not None:
            return "incomplete" if self.state.complete is None else "complete"
        if self.is_starting:
            return "starting"
        return "no manifest" if self.job_dir.is_dir() else "no job directory"

    def summary(self) -> dict[str, Any]:
        return {
            "shard": str(self.shard),
            "output": os.path.abspath(self.output),
            "state": self.condition,
            "rows": self.manifest.num_rows if self.manifest is not None else None,
            "done": len(self.state.committed) if self.state is not None else None,
            "errored": len(self.state.errors) if self.state is not None else None,
            "resume": resume_command(self.output) if self.condition == "incomplete" else None,
        }


@dataclass(frozen=True)
class NotStarted:
    """Shards `first` to `last` of `count` (an unbroken run), with neither file nor job dir."""

    first: int
    last: int
    count: int

    def __str__(self) -> str:
        if self.first == self.last:
            return f"{self.first}/{self.count}"
        return f"{self.first}-{self.last}/{self.count}"

    def summary(self) -> dict[str, Any]:
        return {"shard": str(self), "output": None, "state": "not started", "rows": None}


@dataclass(frozen=True)
class ShardArray:
    """A job array as found on disk: its shard count, the shards with a file or job directory
    (by index) and the runs of shards between them that were never started."""

    count: int
    jobs: list[ShardJob]
    not_started: list[NotStarted]

    def summaries(self) -> list[dict[str, Any]]:
        entries = [(job.shard.index, job.summary()) for job in self.jobs]
        entries += [(gap.first, gap.summary()) for gap in self.not_started]
        return [summary for _, summary in sorted(entries, key=lambda entry: entry[0])]


def find_shards(output: Path) -> ShardArray | None:
    """The shards of `output` on disk, or None when there are none. Only shards with a file
    or job directory are looked at: the others are runs of numbers, never enumerated."""
    found = shards_on_disk(output)
    counts = {shard.count for shard in found}
    if len(counts) > 1:
        names = ", ".join(f"{output.stem}.shard-*-of-{n}{output.suffix}" for n in sorted(counts))
        raise JobStateError(
            f"{output} has shards of {len(counts)} different arrays ({names}); remove the files "
            "and job directories of the arrays you do not want"
        )
    if not counts:
        return None
    count = counts.pop()
    jobs = []
    for shard in sorted(found, key=lambda shard: shard.index):
        path = shard.output_path(output)
        job_dir = job_dir_for(path)
        manifest = state = None
        if (job_dir / MANIFEST_NAME).is_file():
            manifest = Manifest.load(job_dir)
            state, _ = read_journal(job_dir / JOURNAL_NAME)
        is_starting = manifest is None and job_dir.is_dir() and is_locked(job_dir)
        jobs.append(ShardJob(shard, path, manifest, state, is_starting))
    bounds = [-1, *(job.shard.index for job in jobs), count]
    gaps = [NotStarted(a + 1, b - 1, count) for a, b in itertools.pairwise(bounds) if b - a > 1]
    return ShardArray(count, jobs, gaps)


def shard_statuses(output: Path) -> list[dict[str, Any]]:
    array = find_shards(output)
    return array.summaries() if array is not None else []


def merge_shards(
    output: Path, *, ordered: bool = False, overwrite: bool = False, remove_shards: bool = False
) -> str:
    """Check that every shard of `output` is complete and made alike, then write `output` with
    each input row once (in input order with `ordered`): a temp file, fsync, rename. The shard
    files stay unless `remove_shards`. Returns the message for the user."""
    fmt = output_format(output)
    array = find_shards(output)
    if array is None:
        raise JobStateError(
            f"there are no shards of {output} to merge (no {output.stem}.shard-I-of-N"
            f"{output.suffix}); run them with `vbatch run ... -o {shlex.quote(str(output))} "
            "--shard I/N`"
        )
    problems = _problems(output, array)
    jobs = array.jobs
    if problems:
        raise JobStateError(
            f"cannot merge {output}; every shard must be complete and made alike:\n"
            + "\n".join(f"  {p}" for p in problems)
        )
    if job_dir_for(output).exists():
        raise JobStateError(
            f"{output} has a job directory of its own ({job_dir_for(output)}); merging would "
            "replace that job's output. Merge into another path"
        )
    _refuse_clashes(output, jobs)
    if output.exists() and not overwrite:
        raise JobStateError(f"{output} already exists; pass --overwrite to replace it")
    with contextlib.ExitStack() as stack:
        for job in jobs:
            stack.callback(JobLock(job.job_dir).release)
        num_rows = _check_rows(jobs, fmt)
        _write_merged(output, jobs, fmt, ordered=ordered)
        if remove_shards:
            for job in jobs:
                job.output.unlink(missing_ok=True)
                shutil.rmtree(job.job_dir)
            fsync_dir(output.parent)
    num_errors = sum(job.summary()["errored"] for job in jobs)
    removed = "; removed the shard files" if remove_shards else ""
    return (
        f"merged {len(jobs)} shards into {output}: {num_rows} rows, {num_errors} errored{removed}"
    )


def _refuse_clashes(output: Path, jobs: list[ShardJob]) -> None:
    """Refuse a merged output that is a file the merge reads: a shard's output or input."""
    writes = {"the merged output": output}
    reads: dict[str, Path] = {}
    for job in jobs:
        writes[f"shard {job.shard}'s job directory"] = job.job_dir
        reads[f"shard {job.shard}'s output"] = job.output
        if job.manifest is not None:
            reads[f"shard {job.shard}'s input file"] = Path(job.manifest.input_path)
    refuse_clashing_paths(writes, reads)


def _problems(output: Path, array: ShardArray) -> list[str]:
    """Why the shards cannot be merged (each with the command that fixes it), or []."""
    made = [job for job in array.jobs if job.manifest is not None]
    reference = made[0].manifest if made else None
    problems = [_never_started(output, gap, reference is not None) for gap in array.not_started]
    for job in array.jobs:
        label = f"shard {job.shard}:"
        if job.manifest is None or job.state is None:
            problems.append(f"{label} {_not_started(job)}")
        elif job.manifest.shard_spec != job.shard:
            problems.append(
                f"{label} its job directory {job.job_dir} holds shard {job.manifest.shard_spec} "
                "(renamed?); run the shard again with --overwrite"
            )
        elif job.state.complete is None:
            problems.append(
                f"{label} incomplete ({len(job.state.committed)} of {job.manifest.num_rows} rows "
                f"done); resume it with: {resume_command(job.output)}"
            )
        elif not job.output.is_file():
            problems.append(
                f"{label} complete, but {job.output} is missing (moved or deleted?); put it back "
                "or run the shard again with --overwrite"
            )
    if reference is not None:
        expected = _signature(reference)
        for job in made[1:]:
            assert job.manifest is not None
            differences = _differences(expected, _signature(job.manifest))
            if differences:
                problems.append(
                    f"shard {job.shard}: made with other settings than shard {made[0].shard} "
                    f"({'; '.join(differences)}); run it again with the same settings and "
                    "--overwrite"
                )
    return problems


def _not_started(job: ShardJob) -> str:
    if job.is_starting:
        return (
            "a `vbatch run` is still creating its job (it checks its input first); merge once "
            "every shard is complete"
        )
    if job.job_dir.is_dir():
        return (
            f"its job directory {job.job_dir} has no manifest; run the shard again with --overwrite"
        )
    return (
        f"{job.output} has no job directory (removed?), so it cannot be checked; run the shard "
        "again with --overwrite"
    )


def _never_started(output: Path, gap: NotStarted, is_any_made: bool) -> str:
    """The problem line for a run of shards that were never started, with the command."""
    if gap.first == gap.last:
        label, index, each = f"shard {gap}:", str(gap.first), "it"
    else:
        label, index, each = f"shards {gap}:", "I", f"each (I = {gap.first} to {gap.last})"
    path = output.with_name(f"{output.stem}.shard-{index}-of-{gap.count}{output.suffix}")
    if not is_any_made:
        return (
            f"{label} not started; start {each} with: vbatch run INPUT -o "
            f"{shlex.quote(str(output))} --shard {index}/{gap.count} ..."
        )
    return f"{label} not started; start {each} with the other shards' settings: " + (
        resume_command(path)
    )


def _signature(manifest: Manifest) -> dict[str, Any]:
    """What must be equal across the shards of one array: all that decides the output rows."""
    return {
        "input": {k: getattr(manifest.input, k) for k in ("size", "sampled_sha256")},
        "input_rows": manifest.shard.input_rows if manifest.shard else None,
        "input_format": manifest.input_format,
        "id_kind": manifest.id_kind,
        "output_format": manifest.output_format,
        "model": {
            **{k: getattr(manifest.model, k) for k in ("weights_hash", "files", "commit")},
            "loras": [(lora.name, lora.files) for lora in manifest.model.loras or ()],
        },
        "lora_rows": msgspec.to_builtins(manifest.lora_rows),
        "engine": {k: v for k, v in manifest.engine.items() if k not in _RUN_ONLY_ENGINE_ARGS},
        "sampling": manifest.sampling,
        "options": {k: msgspec.to_builtins(getattr(manifest.options, k)) for k in _RESULT_OPTIONS},
        "vbatch_version": manifest.vbatch_version,
    }


def _differences(expected: dict[str, Any], got: dict[str, Any]) -> list[str]:
    found = []
    for key, value in expected.items():
        other = got[key]
        if value == other:
            continue
        if isinstance(value, dict) and isinstance(other, dict):
            for sub in sorted(value.keys() | other.keys()):
                a, b = value.get(sub), other.get(sub)
                if a != b:
                    found.append(f"{key}.{sub}: {_short(a)} vs {_short(b)}")
        else:
            found.append(f"{key}: {_short(value)} vs {_short(other)}")
    return found


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _check_rows(jobs: list[ShardJob], fmt: str) -> int:
    """Every input row exactly once across the shards: no index twice, as many as the input."""
    arrays = []
    for job in jobs:
        indices = _indices(job, fmt)
        assert job.state is not None and job.state.complete is not None
        if len(indices) != job.state.complete["rows"]:
            raise JobStateError(
                f"shard {job.shard}: {job.output} holds {len(indices)} rows but its job committed "
                f"{job.state.complete['rows']}; it was changed after it finished. Run the shard "
                "again with --overwrite"
            )
        arrays.append(indices)
    indices = np.concatenate(arrays) if arrays else np.empty(0, np.int64)
    unique = np.unique(indices)
    if len(unique) != len(indices):
        raise JobStateError(
            f"the shards overlap: {len(indices) - len(unique)} input rows appear in more than one "
            "shard file"
        )
    manifest = jobs[0].manifest
    assert manifest is not None and manifest.shard is not None
    if len(indices) != manifest.shard.input_rows:
        raise JobStateError(
            f"the shards hold {len(indices)} rows, but the input has {manifest.shard.input_rows}:"
            " the shards did not all run on this input; run every shard again with `vbatch run "
            "... --shard I/N --overwrite`"
        )
    return len(indices)


def _indices(job: ShardJob, fmt: str) -> np.ndarray:
    """The input indices of a shard file's rows; a damaged file is named with the command that
    makes it again (it is complete, so only a new run can)."""
    import pyarrow as pa

    try:
        if fmt == "parquet":
            import pyarrow.parquet as pq

            return pq.read_table(job.output, columns=["index"]).column("index").to_numpy()
        with open(job.output, "rb") as f:
            return np.fromiter((line_index(line) for line in f if line.strip()), dtype=np.int64)
    except (pa.ArrowException, ValueError, KeyError, TypeError, AttributeError) as e:
        detail = str(e).strip().splitlines()[0] if str(e).strip() else "unreadable"
        raise JobStateError(
            f"shard {job.shard}: {job.output} is damaged ({type(e).__name__}: {detail}): "
            "truncated or changed after its job finished. Run the shard again: remove "
            f"{shlex.quote(str(job.output))} and {shlex.quote(str(job.job_dir))}, then "
            f"`{resume_command(job.output)}` starts it with the other shards' settings"
        ) from None


def _write_merged(output: Path, jobs: list[ShardJob], fmt: str, *, ordered: bool) -> None:
    """Write the merged rows to a temp file next to `output`, fsync it, rename it into place.
    Called under every shard's lock, so the temp files of an earlier merge of `output` that was
    killed are stale, and go first."""
    prefix = f".{output.name}."
    for stale in output.parent.glob(f"{glob.escape(prefix)}*.merge*"):
        if stale.suffix == ".merge" and stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)
        elif stale.suffix == ".merge-tmp" and not stale.is_dir():
            stale.unlink(missing_ok=True)
    fd, tmp_name = new_temp_file(output.parent, prefix, ".merge-tmp")
    os.close(fd)
    tmp = Path(tmp_name)
    work_dir = Path(tempfile.mkdtemp(prefix=prefix, suffix=".merge", dir=output.parent))
    try:
        _write_merged_to(tmp, output, jobs, fmt, work_dir, ordered=ordered)
    except OSError as e:
        if not is_storage_failure(e):
            raise
        size = sum(job.output.stat().st_size for job in jobs)
        # NOTE: sorted rows need their sort runs beside the merged file until it is written.
        needed = 2 * size if ordered else size
        raise storage_error(
            e,
            e.filename or tmp,
            f"then run the same command again (the merge needs about {needed / 2**20:.1f} MiB "
            f"free in {output.parent})",
        ) from e
    finally:
        tmp.unlink(missing_ok=True)
        shutil.rmtree(work_dir, ignore_errors=True)


def _write_merged_to(
    tmp: Path, output: Path, jobs: list[ShardJob], fmt: str, work_dir: Path, *, ordered: bool
) -> None:
    """_write_merged's writing: the rows to `tmp` (sort runs in `work_dir`), then into place."""
    if fmt == "parquet":
        _write_parquet(tmp, jobs, work_dir, ordered=ordered)
    else:
        with open(tmp, "wb") as dst:
            if ordered:
                write_sorted_lines(_lines(jobs), work_dir, dst)
            else:
                for job in jobs:
                    with open(job.output, "rb") as src:
                        shutil.copyfileobj(src, dst)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, output)
    fsync_dir(output.parent)


def _lines(jobs: list[ShardJob]) -> Iterator[tuple[int, bytes]]:
    for job in jobs:
        with open(job.output, "rb") as f:
            for line in f:
                yield line_index(line), line


def _write_parquet(tmp: Path, jobs: list[ShardJob], work_dir: Path, *, ordered: bool) -> None:
    import pyarrow.parquet as pq

    schema = pq.read_schema(jobs[0].output)
    for job in jobs[1:]:
        if not pq.read_schema(job.output).equals(schema):
            raise JobStateError(
                f"shard {job.shard}: {job.output} has other columns than {jobs[0].output}"
            )
    with pq.ParquetWriter(tmp, schema) as writer:
        sink = RowGroupSink(writer)
        if ordered:
            sources: list[tuple[Path, int | None]] = []
            for job in jobs:
                assert job.manifest is not None
                if job.manifest.options.ordered:
                    sources.append((job.output, None))
                else:
                    sources += _sorted_runs(job, work_dir)
            write_sorted_parquet(sink, schema, sources, JobState(), work_dir)
        else:
            for job in jobs:
                for batch in parquet_batches(job.output, BATCH_ROWS):
                    sink.add(batch)
        sink.flush()


def _sorted_runs(job: ShardJob, work_dir: Path) -> list[tuple[Path, int | None]]:
    """A shard written in completion order, cut into index-sorted runs of _RUN_ROWS rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    runs: list[tuple[Path, int | None]] = []
    for number, batch in enumerate(parquet_batches(job.output, _RUN_ROWS)):
        table = pa.Table.from_batches([batch])
        path = work_dir / f"shard{job.shard.index}-run{number:06d}.parquet"
        pq.write_table(table.sort_by("index"), path)
        runs.append((path, None))
    return runs
