"""The VbatchError hierarchy: every error a user may see, printed without a traceback."""

import errno
from typing import TypeGuard


class VbatchError(Exception):
    """Base of every user-facing error; the CLI prints it and exits non-zero."""

    exit_code: int = 1


class ConfigError(VbatchError):
    """An engine or job setting is invalid."""


class SamplingParamsError(VbatchError, ValueError):
    """A sampling parameter is missing, of the wrong type or out of range (a ValueError too,
    as vLLM raises)."""


class ModelLoadError(VbatchError):
    """A model file or directory cannot be found, read or understood."""


class PromptTooLongError(VbatchError):
    """A prompt does not fit the model's maximum length."""


class EngineStartupError(VbatchError):
    """The engine-core process failed before it reported READY."""


class SettledStartupError(EngineStartupError):
    """The engine core refused to start for a reason that starting it again with the same
    settings would repeat: a model it cannot load, settings it refuses."""


class EngineDeadError(VbatchError):
    """The engine-core process died while the client still needed it."""


class InputError(VbatchError):
    """The input file or one of its columns cannot be used."""


class PromptTypeError(VbatchError, TypeError):
    """The Python API was given a prompt of a kind it does not take (a TypeError too)."""


class PromptValueError(VbatchError, ValueError):
    """The Python API was given a prompt it cannot use as it is (a ValueError too)."""


class JobStateError(VbatchError):
    """The job directory is missing, corrupt, or does not match this run."""


class OutputLostError(JobStateError):
    """The output that holds a job's committed rows was deleted, cut or replaced outside vbatch:
    a resume cannot bring those rows back, so the job can only start again."""


class StorageError(VbatchError):
    """A job file could not be written or created: the disk is full, read-only, or not ours."""


# NOTE: errno -> (what happened to PATH, what the user can do about it).
_STORAGE_CAUSES = {
    errno.ENOSPC: ("no space left on the device holding {path}", "free some space there"),
    errno.EDQUOT: ("disk quota exceeded for {path}", "free some space or raise the quota"),
    errno.EFBIG: (
        "{path} reached the largest file size allowed (`ulimit -f` or the file system's limit)",
        "raise the limit, or write the output to another file system",
    ),
    errno.EROFS: (
        "{path} is on a read-only file system",
        "write the output to a writable directory, or remount it read-write",
    ),
    errno.EACCES: (
        "permission denied for {path}",
        "make its directory writable for this user, or write the output elsewhere",
    ),
    errno.EPERM: (
        "operation not permitted on {path}",
        "make its directory writable for this user, or write the output elsewhere",
    ),
    errno.EIO: ("input/output error on {path}", "check the disk (see `dmesg`)"),
    errno.EISDIR: ("{path} is a directory where vbatch expects a file", "move or remove it"),
    errno.ENOTDIR: (
        "a part of {path} is a file where vbatch expects a directory",
        "move or remove that file",
    ),
}


def is_storage_failure(error: BaseException) -> TypeGuard[OSError]:
    """Whether an OSError is one the user fixes on their side (space, permissions, the disk)."""
    return isinstance(error, OSError) and error.errno in _STORAGE_CAUSES


def storage_error(error: OSError, path: object = None, then: str = "") -> StorageError:
    """One line naming the file, the cause and the fix for a failed write; `then` says what to
    do once it is fixed (for example "then resume the job")."""
    where = str(path if path is not None else error.filename or "a job file")
    known = _STORAGE_CAUSES.get(error.errno or 0)
    if known is None:
        message, fix = f"cannot write {where}: {error.strerror or error}", ""
    else:
        message = known[0].format(path=where) + f" ({errno.errorcode[error.errno]})"
        fix = known[1]
    steps = ", ".join(s for s in (fix, then) if s)
    return StorageError(f"{message}; {steps}" if steps else message)


def unexpected_error(error: BaseException) -> str:
    """One line for an exception vbatch did not expect (a bug): its type and text."""
    return (
        f"unexpected {type(error).__name__}: {error} (this is a bug in vbatch; rerun with "
        "VBATCH_DEBUG=1 to see the traceback)"
    )


class LoraError(VbatchError):
    """A LoRA adapter that cannot be used: unreadable, unsupported, or not made for this model."""
