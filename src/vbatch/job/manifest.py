"""The job manifest: what a job was started with, and the check that a resume still matches it."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from vbatch.errors import JobStateError, ModelLoadError
from vbatch.job.shard import Shard

MANIFEST_NAME = "manifest.json"
# NOTE: version 2 added model["files"] (hashes of the tokenizer, template and config files).
MANIFEST_VERSION = 2
_SAMPLE_BYTES = 1 << 20
_NUM_MIDDLE_SAMPLES = 16
_MIDDLE_SAMPLE_BYTES = 1 << 16


def input_fingerprint(path: Path) -> dict[str, Any]:
    """Size plus a sha256 over the first and last MiB and 16 evenly spaced 64 KiB samples.

    NOTE: a sampled hash keeps `vbatch resume` on a 100 GB input instant; it catches any
    append, truncation or rewrite, but not an in-place edit that keeps the size and misses every
    sampled block. The mtime is recorded for information only, so a copy or `touch` still resumes.
    """
    stat = path.stat()
    size = stat.st_size
    digest = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        offsets = [0, max(0, size - _SAMPLE_BYTES)]
        lengths = [_SAMPLE_BYTES, _SAMPLE_BYTES]
        if size > 2 * _SAMPLE_BYTES:
            step = (size - 2 * _SAMPLE_BYTES) // (_NUM_MIDDLE_SAMPLES + 1)
            for k in range(1, _NUM_MIDDLE_SAMPLES + 1):
                offsets.append(_SAMPLE_BYTES + k * step)
                lengths.append(_MIDDLE_SAMPLE_BYTES)
        for offset, length in zip(offsets, lengths, strict=False):
            f.seek(offset)
            digest.update(f.read(length))
    return {"size": size, "mtime_ns": stat.st_mtime_ns, "sampled_sha256": digest.hexdigest()}


def model_identity(model: str | None) -> dict[str, Any]:
    """The model as the user named it, a hash of its weights (memoized by size and mtime) and a
    hash of each other file that changes its output (tokenizer, chat template, configs)."""
    from vbatch.models.loader import default_model_path, hash_files, model_file_hashes

    path = default_model_path() if model is None else Path(model).expanduser().absolute()
    if not path.exists():
        raise ModelLoadError(f"model path {path} does not exist")
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files or (path.is_dir() and not (path / "config.json").is_file()):
        raise ModelLoadError(
            f"{path} is not a model: give a GGUF file or a Hugging Face directory with "
            "config.json and *.safetensors"
        )
    return {
        "source": str(path),
        "name": path.stem if path.is_file() else path.name,
        "weights_hash": hash_files(files),
        "files": model_file_hashes(path),
    }


@dataclass
class Manifest:
    """Everything that decides a job's result. Invariant: written once, atomically, at job start;
    `resume` compares `input`, `model` and `vbatch_version` against the world as it is now.

    A `--shard I/N` job records `shard` = {index, count, input_rows}: `num_rows` counts only the
    shard's rows, `input_rows` the whole input's."""

    vbatch_version: str
    input_path: str
    input_format: str
    input: dict[str, Any]
    num_rows: int
    id_kind: str
    output_path: str
    output_format: str
    model: dict[str, Any]
    engine: dict[str, Any]
    sampling: dict[str, Any]
    options: dict[str, Any]
    created: float = field(default_factory=time.time)
    shard: dict[str, int] | None = None
    manifest_version: int = MANIFEST_VERSION

    @property
    def shard_spec(self) -> Shard | None:
        return None if self.shard is None else Shard(self.shard["index"], self.shard["count"])

    def save(self, job_dir: Path) -> None:
        write_atomic(job_dir / MANIFEST_NAME, json.dumps(asdict(self), indent=2).encode())

    @classmethod
    def load(cls, job_dir: Path) -> Manifest:
        path = job_dir / MANIFEST_NAME
        try:
            values = json.loads(path.read_text())
            return cls(**values)
        except FileNotFoundError:
            raise JobStateError(
                f"{job_dir} has no {MANIFEST_NAME}; it is not a vbatch job"
            ) from None
        except (ValueError, TypeError) as e:
            raise JobStateError(f"{path} is unreadable ({e})") from None

    def mismatches(self, current_input: dict[str, Any], current_model: dict[str, Any]) -> list[str]:
        """Human-readable reasons why resuming would not reproduce the original job."""
        from vbatch import __version__

        reasons = []
        if current_input["size"] != self.input["size"]:
            reasons.append(
                f"input {self.input_path} changed size "
                f"({self.input['size']} -> {current_input['size']} bytes)"
            )
        elif current_input["sampled_sha256"] != self.input["sampled_sha256"]:
            reasons.append(f"input {self.input_path} changed content")
        if current_model["weights_hash"] != self.model["weights_hash"]:
            reasons.append(
                f"model weights changed ({self.model['source']}: "
                f"{self.model['weights_hash']} -> {current_model['weights_hash']})"
            )
        reasons += self._model_file_changes(current_model.get("files", {}))
        if __version__ != self.vbatch_version:
            reasons.append(f"vbatch version changed ({self.vbatch_version} -> {__version__})")
        return reasons

    def _model_file_changes(self, current: dict[str, str]) -> list[str]:
        """Which tokenizer, template and config files differ from those the job started with."""
        source = self.model["source"]
        recorded = self.model.get("files")
        if recorded is None:
            return [
                f"this job was started by an older vbatch that did not record the model's "
                f"tokenizer, chat template and generation config ({source}), so they cannot be "
                "checked"
            ]
        changes = []
        for name in sorted(recorded.keys() | current.keys()):
            if recorded.get(name) != current.get(name):
                how = "added" if name not in recorded else "removed" if name not in current else ""
                changes.append(f"{name} {how or 'changed'}")
        if not changes:
            return []
        return [f"model files changed ({source}: {', '.join(changes)})"]


def write_atomic(path: Path, data: bytes, *, sync_dir: bool = True) -> None:
    """Write to a temp file in the same directory, fsync, rename, then fsync the directory
    unless `sync_dir` is false (a reader then sees the old or the new file, whole)."""
    from vbatch.job.journal import fsync_dir

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
