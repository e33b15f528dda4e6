"""The job manifest: what a job was started with, and the check that a resume still matches it."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path
from typing import Any

import msgspec

from vbatch.engine_sets.base import RaySettings
from vbatch.errors import JobStateError
from vbatch.job.options import RunOptions
from vbatch.job.paths import LOCK_NAME, write_atomic
from vbatch.job.rows import ColumnOptions, LoraRows
from vbatch.job.shard import Shard

MANIFEST_NAME = "manifest.json"
# NOTE: version 2 added model["files"] (hashes of the tokenizer, template and config files).
MANIFEST_VERSION = 2
_SAMPLE_BYTES = 1 << 20
_NUM_MIDDLE_SAMPLES = 16
_MIDDLE_SAMPLE_BYTES = 1 << 16


class InputFingerprint(msgspec.Struct, frozen=True, kw_only=True):
    """The input file as `input_fingerprint` saw it; `mtime_ns` is for information only."""

    size: int
    mtime_ns: int
    sampled_sha256: str


class LoraRecord(msgspec.Struct, frozen=True, kw_only=True):
    """A LoRA adapter the job runs: its name, directory and each file's sha256."""

    name: str
    path: str
    files: dict[str, str]


def lora_records(loras: Any) -> list[LoraRecord] | None:
    """The records of a job's (name, path) adapters; None without any."""
    from vbatch.lora.adapter import CONFIG_FILE, WEIGHTS_FILE
    from vbatch.models.loader import hash_files

    records = []
    for name, path in loras or ():
        files = {}
        for file_name in (CONFIG_FILE, WEIGHTS_FILE):
            file = Path(path) / file_name
            files[file_name] = hash_files([file]) if file.is_file() else "missing"
        records.append(LoraRecord(name=name, path=os.path.abspath(path), files=files))
    return records or None


class ModelIdentity(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """The model as the user named it (`source`), the hash of its weights, and a hash of each
    other file that changes its output; `files` is None in a manifest of version 1. A hub id
    also records its repo id, the revision asked for and the snapshot commit it resolved to."""

    source: str
    name: str
    weights_hash: str
    files: dict[str, str] | None = None
    repo_id: str | None = None
    revision: str | None = None
    commit: str | None = None
    loras: list[LoraRecord] | None = None


class JobOptions(msgspec.Struct, frozen=True, kw_only=True):
    """How the job's rows are read and written, fixed for its life, then the run options a resume
    starts from (`RunOptions.result_settings`). A field added here needs a default, so that a
    manifest written before it still loads."""

    columns: ColumnOptions = ColumnOptions()
    ordered: bool = False
    include_token_ids: bool = False
    parse_json: bool = False
    require_valid_json: bool = False
    openai_output: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_parser: str | None = None
    # NOTE: the sampling defaults an OpenAI Batch line gets over `sampling` (OPENAI_LINE_DEFAULTS
    # less the options given on the command line); empty in a manifest written before them.
    openai_defaults: dict[str, Any] = msgspec.field(default_factory=dict)
    # NOTE: `--task` (job/tasks.py) and the embeddings' Matryoshka width (`--dimensions`).
    task: str = "generate"
    dimensions: int | None = None
    # NOTE: `--served-model-name`: more names an OpenAI line's body.model may give the model.
    served_model_names: tuple[str, ...] = ()
    commit_every_rows: int = RunOptions.commit_every_rows
    commit_every_seconds: float = RunOptions.commit_every_seconds
    max_errors: float | None = RunOptions.max_errors
    # NOTE: saved under its name before the `_s` suffix, so that every manifest reads alike.
    drain_timeout_s: float = msgspec.field(default=RunOptions.drain_timeout_s, name="drain_timeout")
    max_in_flight: int | None = RunOptions.max_in_flight
    data_parallel_size: int = RunOptions.data_parallel_size
    ray: RaySettings | None = None

    def run_options(self, overrides: dict[str, Any] | None = None) -> RunOptions:
        """The saved run options, with `overrides` (RunOptions fields) replacing some."""
        saved = {name: getattr(self, name) for name in RunOptions().result_settings()}
        return RunOptions.restore(saved, overrides or {})


def input_fingerprint(path: Path) -> InputFingerprint:
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
    return InputFingerprint(size=size, mtime_ns=stat.st_mtime_ns, sampled_sha256=digest.hexdigest())


def model_identity(model: str | None, loras: Any = ()) -> ModelIdentity:
    """The model as the user named it, a hash of its weights (memoized by size and mtime) and a
    hash of each other file that changes its output (tokenizer, chat template, configs). A hub
    id also records its repo id, the revision asked for and the snapshot commit it resolved to;
    `loras`, the job's (name, path) adapters, their files' hashes."""
    from vbatch.models.gguf_file import check_gguf_header
    from vbatch.models.loader import (
        check_model_path,
        hash_files,
        locate_model,
        model_file_hashes,
        weight_files,
    )

    location = locate_model(model)
    path = location.path
    check_model_path(path)
    if not path.is_dir():
        check_gguf_header(path)
    hub = location.hub
    return ModelIdentity(
        source=location.source,
        name=location.name,
        weights_hash=hash_files(weight_files(path) if path.is_dir() else [path]),
        files=model_file_hashes(path),
        repo_id=hub.repo_id if hub else None,
        revision=hub.revision if hub else None,
        commit=hub.commit if hub else None,
        loras=lora_records(loras),
    )


class ShardRecord(msgspec.Struct, frozen=True, kw_only=True):
    """A `--shard I/N` job's place in its array; `input_rows` counts the whole input's rows."""

    index: int
    count: int
    input_rows: int


class Manifest(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Everything that decides a job's result. Invariant: written atomically at job start (and
    again by `resume --force`, and when an engine reports different `kernels`); `resume`
    compares `input`, `model` and `vbatch_version` against the world as it is now. `engine`
    holds EngineConfig fields, `sampling` the default SamplingParams as a dict. A `--shard I/N`
    job records its `shard`, and `num_rows` counts only the shard's rows."""

    vbatch_version: str
    input_path: str
    input_format: str
    input: InputFingerprint
    num_rows: int
    id_kind: str
    output_path: str
    output_format: str
    model: ModelIdentity
    engine: dict[str, Any]
    sampling: dict[str, Any]
    options: JobOptions
    created: float = msgspec.field(default_factory=time.time)
    shard: ShardRecord | None = None
    lora_rows: LoraRows | None = None
    # NOTE: the kernels the engine chose at start-up (by measurement or forced), as it reported
    # them in its latest run; a record, never compared on resume.
    kernels: list[str] | None = None
    # NOTE: no default, so that it is always written (the struct omits default values).
    manifest_version: int
    # NOTE: BLAKE2b of the rest (`digest`), checked on load: a manifest edited or damaged into
    # other valid JSON (fewer rows, another output format) would otherwise be trusted. None in
    # the manifests of earlier vbatch versions.
    checksum: str | None = None

    @property
    def shard_spec(self) -> Shard | None:
        return None if self.shard is None else Shard(self.shard.index, self.shard.count)

    @property
    def input_rows(self) -> int:
        """The whole input's rows when the job was counted (a shard's job reads them all)."""
        return self.num_rows if self.shard is None else self.shard.input_rows

    def digest(self) -> str:
        unsigned = msgspec.json.encode(msgspec.structs.replace(self, checksum=None))
        # NOTE: hashed as it reads back (an int given for a float field reads back a float).
        canonical = msgspec.json.encode(msgspec.json.decode(unsigned, type=Manifest))
        return hashlib.blake2b(canonical, digest_size=16).hexdigest()

    def save(self, job_dir: Path) -> None:
        self.checksum = self.digest()
        write_atomic(job_dir / MANIFEST_NAME, msgspec.json.format(msgspec.json.encode(self)))

    @classmethod
    def load(cls, job_dir: Path) -> Manifest:
        path = job_dir / MANIFEST_NAME
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            if {p.name for p in job_dir.iterdir()} == {LOCK_NAME}:
                # NOTE: a run killed before its job existed leaves its lock alone.
                raise JobStateError(
                    f"{job_dir} holds no job: a `vbatch run` stopped before its job was created; "
                    "run that command again"
                ) from None
            raise JobStateError(
                f"{job_dir} has no {MANIFEST_NAME}; it is not a vbatch job"
            ) from None
        try:
            version = msgspec.json.decode(data, type=_Versioned).manifest_version
        except msgspec.DecodeError:
            version = None
        if version is not None and version > MANIFEST_VERSION:
            raise JobStateError(
                f"{path} was written by a newer vbatch (manifest version {version}; this one "
                f"reads up to {MANIFEST_VERSION}); resume the job with that vbatch"
            )
        try:
            manifest = msgspec.json.decode(data, type=cls)
        except msgspec.DecodeError as e:
            raise JobStateError(f"{path} is unreadable ({e})") from None
        if manifest.checksum is not None and manifest.checksum != manifest.digest():
            raise JobStateError(
                f"{path} was changed outside vbatch (its checksum does not match its content): "
                "the job it describes is not the one whose rows are committed. Restore it, or "
                "start again with `vbatch run ... --overwrite`"
            )
        return manifest

    def model_to_load(self) -> str:
        """The model as the job loads it: its source, or a hub id pinned to the recorded commit,
        so that a branch moving after the manifest was written changes nothing."""
        commit = self.model.commit
        return self.model.source if commit is None else f"{self.model.repo_id}@{commit}"

    def mismatches(
        self, current_input: InputFingerprint, current_model: ModelIdentity
    ) -> list[str]:
        """Human-readable reasons why resuming would not reproduce the original job."""
        from vbatch import __version__

        reasons = []
        if current_input.size != self.input.size:
            reasons.append(
                f"input {self.input_path} changed size "
                f"({self.input.size} -> {current_input.size} bytes)"
            )
        elif current_input.sampled_sha256 != self.input.sampled_sha256:
            reasons.append(f"input {self.input_path} changed content")
        model_changes = self._model_file_changes(current_model.files or {})
        if current_model.weights_hash != self.model.weights_hash:
            model_changes.insert(
                0,
                f"model weights changed ({self.model.source}: "
                f"{self.model.weights_hash} -> {current_model.weights_hash})",
            )
        commit = current_model.commit
        if commit != self.model.commit:
            same = "" if model_changes else ", with the same weight, config and tokenizer files"
            reasons.append(
                f"model {self.model.source} now resolves to snapshot {commit} of the Hugging "
                f"Face cache, not {self.model.commit}{same}"
            )
        reasons += model_changes
        for old, new in zip(self.model.loras or [], current_model.loras or [], strict=False):
            changed = [name for name, digest in old.files.items() if new.files.get(name) != digest]
            if changed:
                reasons.append(
                    f"LoRA adapter {old.name!r} changed ({old.path}: {', '.join(changed)})"
                )
        if __version__ != self.vbatch_version:
            reasons.append(f"vbatch version changed ({self.vbatch_version} -> {__version__})")
        return reasons

    def _model_file_changes(self, current: dict[str, str]) -> list[str]:
        """Which tokenizer, template and config files differ from those the job started with."""
        source = self.model.source
        recorded = self.model.files
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


class _Versioned(msgspec.Struct):
    manifest_version: int | None = None
