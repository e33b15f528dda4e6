"""Job-array shards: `--shard I/N` and `auto`, the stable split of rows by id, shard file names."""

from __future__ import annotations

import glob
import hashlib
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vbatch.errors import ConfigError

if TYPE_CHECKING:
    from vbatch.job.rows import RowParser

COUNT_ENV = "VBATCH_SHARD_COUNT"
# NOTE: far more tasks than any job array runs; a larger N is a typo, refused at parse time.
MAX_SHARDS = 100_000
_SHARD_NAME = re.compile(r"\.shard-([0-9]+)-of-([0-9]+)$")
_DIGITS = re.compile(r"[0-9]+")


def shard_of(key: str, count: int) -> int:
    """The shard (0..count-1) of a row key: the first 8 bytes of its BLAKE2b digest, modulo
    `count`. The same on every machine and Python version (unlike `hash`, which is salted)."""
    digest = hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big") % count


def row_key(record: Any, index: int, parser: RowParser) -> str:
    """What decides a row's shard: its id as a string (an integer id as its decimal digits), or,
    for a row without a usable id (invalid JSON, not an object, a bad id value), its position.
    A row without the id key is keyed by its index whether or not the parser has fixed the id
    column (the run does where other rows have ids, the pre-pass that finds them did not)."""
    if not isinstance(record, dict):
        return f"#{index}"
    column = parser.id_column(record)
    if column is None or column not in record:
        return str(index)
    row_id = parser.row_id(record, index)
    return f"#{index}" if row_id is None else str(row_id)


@dataclass(frozen=True)
class Shard:
    """Shard `index` of `count` (0 <= index < count): the rows whose key hashes to `index`."""

    index: int
    count: int

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"

    def owns(self, record: Any, index: int, parser: RowParser) -> bool:
        return shard_of(row_key(record, index, parser), self.count) == self.index

    def output_path(self, output: Path) -> Path:
        """`out.parquet` -> `out.shard-I-of-N.parquet` (next to it)."""
        return output.with_name(f"{output.stem}.shard-{self.index}-of-{self.count}{output.suffix}")

    def to_dict(self) -> dict[str, int]:
        return {"index": self.index, "count": self.count}


def parse_shard(text: str, environ: Mapping[str, str] | None = None) -> Shard:
    """`I/N`, `auto` or `auto/N` (the task index from Slurm or Kubernetes, see `shard_from_env`)."""
    environ = os.environ if environ is None else environ
    head, slash, tail = text.strip().partition("/")
    count = _count(tail, text) if slash else None
    if head == "auto":
        return shard_from_env(environ, count)
    if count is None or not _DIGITS.fullmatch(head):
        raise ConfigError(f"--shard must be I/N (0 <= I < N), auto or auto/N, got {text!r}")
    return _checked(int(head), count, f"--shard {text}")


def shard_from_env(environ: Mapping[str, str], count: int | None = None) -> Shard:
    """This task's shard from a Slurm job array (SLURM_ARRAY_TASK_ID, _MIN, _STEP, _COUNT), else a
    Kubernetes indexed job (JOB_COMPLETION_INDEX, with `count` or VBATCH_SHARD_COUNT)."""
    if "SLURM_ARRAY_TASK_ID" in environ:
        task_id = _env_int(environ, "SLURM_ARRAY_TASK_ID")
        first = _env_int(environ, "SLURM_ARRAY_TASK_MIN", 0)
        step = _env_int(environ, "SLURM_ARRAY_TASK_STEP", 1)
        env_count = _env_int(environ, "SLURM_ARRAY_TASK_COUNT", -1)
        source = f"SLURM_ARRAY_TASK_ID={task_id}"
        if step < 1 or (task_id - first) % step:
            raise ConfigError(
                f"--shard auto: {source} is not on the array's range (min {first}, step "
                f"{step}); give the shard as --shard I/N"
            )
        last = _env_int(environ, "SLURM_ARRAY_TASK_MAX", -1)
        num_tasks = _env_int(environ, "SLURM_ARRAY_TASK_COUNT", -1)
        if last != -1 and num_tasks != -1 and last - first != (num_tasks - 1) * step:
            raise ConfigError(
                f"--shard auto: this Slurm array is a list (tasks {first} to {last}, {num_tasks} "
                f"of them, not one step apart), e.g. --array=1,5,9; list arrays need "
                "--shard I/N, given per task"
            )
        index = (task_id - first) // step
    elif "JOB_COMPLETION_INDEX" in environ:
        index = _env_int(environ, "JOB_COMPLETION_INDEX")
        env_count = _env_int(environ, COUNT_ENV, -1)
        source = f"JOB_COMPLETION_INDEX={index}"
    else:
        raise ConfigError(
            "--shard auto needs SLURM_ARRAY_TASK_ID and SLURM_ARRAY_TASK_COUNT (a Slurm job "
            f"array) or JOB_COMPLETION_INDEX and {COUNT_ENV} (a Kubernetes indexed job); neither "
            "is set, so give the shard as --shard I/N"
        )
    if count is not None and env_count not in (-1, count):
        raise ConfigError(f"--shard auto/{count}, but the environment says {env_count} tasks")
    if count is None:
        if env_count == -1:
            missing = "SLURM_ARRAY_TASK_COUNT" if source.startswith("SLURM") else COUNT_ENV
            raise ConfigError(f"--shard auto: {source} is set but {missing} is not; pass auto/N")
        count = env_count
    return _checked(index, count, f"--shard auto ({source})")


def _count(text: str, whole: str) -> int:
    if not _DIGITS.fullmatch(text):
        raise ConfigError(f"--shard must be I/N (0 <= I < N), auto or auto/N, got {whole!r}")
    return int(text)


def _env_int(environ: Mapping[str, str], name: str, default: int | None = None) -> int:
    value = environ.get(name)
    if value is None and default is not None:
        return default
    try:
        return int(value or "")
    except ValueError:
        raise ConfigError(f"--shard auto: {name}={value!r} is not an integer") from None


def _checked(index: int, count: int, what: str) -> Shard:
    if count > MAX_SHARDS:
        raise ConfigError(f"{what}: {count} shards is more than the {MAX_SHARDS:,} vbatch allows")
    if count < 1 or not 0 <= index < count:
        raise ConfigError(
            f"{what}: shard {index} of {count} is out of range (shards are numbered 0 to N-1)"
        )
    return Shard(index, count)


def shard_of_output(output: Path) -> Shard | None:
    """The shard an output file name stands for (`out.shard-1-of-3.parquet`), else None (also
    for a name no `--shard` makes: N over MAX_SHARDS, or I not below N)."""
    match = _SHARD_NAME.search(Path(output.name).stem)
    if match is None or len(match[2]) > len(str(MAX_SHARDS)):
        return None
    index, count = int(match[1]), int(match[2])
    return Shard(index, count) if 0 <= index < count <= MAX_SHARDS else None


def shards_on_disk(output: Path) -> set[Shard]:
    """The shards of `output` with a shard file or job directory on disk."""
    pattern = f"{glob.escape(output.stem)}.shard-*-of-*{glob.escape(output.suffix)}"
    found = set()
    for path in [*output.parent.glob(pattern), *output.parent.glob(pattern + ".vbatch")]:
        name = path.with_name(path.name.removesuffix(".vbatch"))
        shard = shard_of_output(name)
        if shard is not None and shard.output_path(output) == name:
            found.add(shard)
    return found
