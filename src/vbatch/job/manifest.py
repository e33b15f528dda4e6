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
    hash of each other file that changes its output (tokenizer, chat template, configs). A hub
    id also records its repo id, the revision asked for and the snapshot commit it resolved to."""
    from vbatch.models.loader import hash_files, locate_model, model_file_hashes, weight_files

    location = locate_model(model)
    path = location.path
    if path.is_dir() and not (path / "config.json").is_file():
        raise ModelLoadError(
            f"{path} is not a model: give a GGUF file or a Hugging Face directory with "
            "config.json and *.safetensors"
        )
    identity = {
        "source": location.source,
        "name": location.name,
        "weights_hash": hash_files(weight_files(path) if path.is_dir() else [path]),
        "files": model_file_hashes(path),
    }
    if location.hub is not None:
        hub = location.hub
        identity |= {"repo_id": hub.repo_id, "revision": hub.revision, "commit": hub.commit}
    return identity


@dataclass
class Manifest:
    """Everything that decides a job's result. Invariant: written once, atomically, at job start;
    `resume` compares `input`, `model` and `vbatch_version` against the world as it is now."""

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
    manifest_version: int = MANIFEST_VERSION

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

    def model_to_load(self) -> str:
        """The model as the job loads it: its source, or a hub id pinned to the recorded commit,
        so that a branch moving after the manifest was written changes nothing."""
        commit = self.model.get("commit")
        return self.model["source"] if commit is None else f"{self.model['repo_id']}@{commit}"

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
        model_changes = self._model_file_changes(current_model.get("files", {}))
        if current_model["weights_hash"] != self.model["weights_hash"]:
            model_changes.insert(
                0,
                f"model weights changed ({self.model['source']}: "
                f"{self.model['weights_hash']} -> {current_model['weights_hash']})",
            )
        commit = current_model.get("commit")
        if commit != self.model.get("commit"):
            same = "" if model_changes else ", with the same weight, config and tokenizer files"
            reasons.append(
                f"model {self.model['source']} now resolves to snapshot {commit} of the Hugging "
                f"Face cache, not {self.model.get('commit')}{same}"
            )
        reasons += model_changes
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
