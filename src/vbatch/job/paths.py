"""Where a job's files live, the job directory's lock, and the durable-write helpers every job
module shares."""

from __future__ import annotations

import fcntl
import os
import secrets
import shlex
from pathlib import Path

from vbatch.errors import InputError, JobStateError, storage_error

JOB_DIR_SUFFIX = ".vbatch"
LOCK_NAME = "lock"
_LOCK_ATTEMPTS = 100
OUTPUT_FORMATS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet", ".pq": "parquet"}


def job_dir_for(output: Path) -> Path:
    return output.with_name(output.name + JOB_DIR_SUFFIX)


def through_link(output: Path) -> Path:
    """The output file a command means by `output`: where a symlink there points, so that a job
    writes through the link (as `open` would) instead of replacing it with its own file; the
    link itself where a job directory sits beside it (a job started there before the link)."""
    if output.is_symlink() and not job_dir_for(output).exists():
        return Path(os.path.realpath(output))
    return output


def tmp_output_path(output: Path) -> Path:
    return output.with_name(f".{output.name}.vbatch-tmp")


def remove_file(path: Path, then: str) -> None:
    """Remove the file vbatch keeps at `path`, if any; a directory there is not vbatch's, so it
    stays, and the error names it (`then`: what to do once it is gone)."""
    if path.is_dir() and not path.is_symlink():
        raise InputError(f"{path} is a directory, where vbatch keeps a file: remove it, {then}")
    path.unlink(missing_ok=True)


def resume_command(output: Path) -> str:
    return f"vbatch resume {shlex.quote(str(output))}"


def same_file(a: Path, b: Path) -> bool:
    """Whether `a` and `b` name one file: through symlinks, relative paths and hard links."""
    if a.resolve() == b.resolve():
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def refuse_clashing_paths(writes: dict[str, Path], reads: dict[str, Path]) -> None:
    """Refuse a command that would write a file it reads or another file it writes, or write
    or read a file inside a job directory it writes. `writes` and `reads` map what a path is
    ("the output", "the metrics file") to the path; a key ending in "directory" names a job
    directory, which may be read and written but holds none of the other paths."""
    dirs = {what: path.resolve() for what, path in writes.items() if what.endswith("directory")}
    files = {what: path for what, path in writes.items() if what not in dirs}
    named = list(files.items())
    for number, (what, path) in enumerate(named):
        for other_what, other in [*named[number + 1 :], *reads.items()]:
            if same_file(path, other):
                raise InputError(f"{what} {path} is {other_what} {other}; write to another file")
    for what, path in [*named, *reads.items()]:
        for dir_what, job_dir in dirs.items():
            if path.resolve().is_relative_to(job_dir):
                raise InputError(f"{what} {path} is inside {dir_what} {job_dir}")


def lost_file(path: Path, fd: int) -> str | None:
    """How `path` stopped naming the file open as `fd` outside vbatch ("deleted" or
    "replaced"); None while it still names it."""
    mine = os.fstat(fd)
    try:
        here = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return "deleted"
    return None if (here.st_dev, here.st_ino) == (mine.st_dev, mine.st_ino) else "replaced"


def fsync_dir(path: Path) -> None:
    """Make a rename or a file creation inside the directory `path` durable (or, given a file,
    its contents)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def new_temp_file(directory: Path, prefix: str, suffix: str) -> tuple[int, str]:
    """A new file's descriptor (open for writing) and path in `directory`, as tempfile.mkstemp
    makes them but with the mode open() gives a file (0o666 less the umask), not mkstemp's
    0600: a file renamed into place from it is readable wherever the user's own files are (a
    shared file system's group reading a merged output or a manifest)."""
    while True:
        name = os.path.join(directory, f"{prefix}{secrets.token_hex(6)}{suffix}")
        try:
            return os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666), name
        except FileExistsError:
            continue


def write_atomic(path: Path, data: bytes, *, sync_dir: bool = True) -> None:
    """Write to a temp file in the same directory, fsync, rename, then fsync the directory
    unless `sync_dir` is false (a reader then sees the old or the new file, whole)."""
    fd, tmp = new_temp_file(path.parent, f".{path.name}.", ".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError) and e.filename is None:
            # NOTE: a failed write or flush names no file; the message names this one.
            e.filename = str(path)
        raise
    if sync_dir:
        fsync_dir(path.parent)


def output_format(output: Path) -> str:
    fmt = OUTPUT_FORMATS.get(output.suffix.lower())
    if fmt is None:
        raise InputError(
            f"cannot tell the output format of {output}; use one of {', '.join(OUTPUT_FORMATS)}"
        )
    return fmt


def is_locked(job_dir: Path) -> bool:
    """Whether a process holds the job directory's lock now (taking it for a moment if not)."""
    try:
        with open(job_dir / LOCK_NAME, "a") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            return False
    except OSError:
        return False


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
                except FileExistsError:
                    raise JobStateError(
                        f"{job_dir}, where the job would live, is a file, not a job directory; "
                        "move or remove it"
                    ) from None
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
