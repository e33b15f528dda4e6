"""Where a job's files live, and the durable-write helpers every job module shares."""

from __future__ import annotations

import os
import shlex
import tempfile
from pathlib import Path

JOB_DIR_SUFFIX = ".vbatch"


def job_dir_for(output: Path) -> Path:
    return output.with_name(output.name + JOB_DIR_SUFFIX)


def tmp_output_path(output: Path) -> Path:
    return output.with_name(f".{output.name}.vbatch-tmp")


def resume_command(output: Path) -> str:
    return f"vbatch resume {shlex.quote(str(output))}"


def fsync_dir(path: Path) -> None:
    """Make a rename or a file creation inside `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes, *, sync_dir: bool = True) -> None:
    """Write to a temp file in the same directory, fsync, rename, then fsync the directory
    unless `sync_dir` is false (a reader then sees the old or the new file, whole)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if sync_dir:
        fsync_dir(path.parent)
