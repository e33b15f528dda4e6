"""PackedStore: the native kernel's packed weight copies of one model (and the int8 greedy
screen's head, and the float32 projections the decoder fuses from several checkpoint tensors),
kept on disk and mapped.

Packing a 135M model's linears into the native kernel's panels costs ~0.3 s of a job's first
step (most of it page faults on 425 MB of fresh memory). The store keeps those copies in one
safetensors file per model under the cache directory, keyed by the weights, the loaded native
library (its layout depends on the CPU's vector width) and the model code that loads them. A later
core maps the file (read-only, shared with every core on the machine through the page cache)
instead of packing, and checks each mapped copy against its weight before it uses it (a linear's
by a one-row product, the int8 head by quantizing a few rows again, a fused projection by rows
of each checkpoint part). Copies made in a core are
written back by a background thread (a temporary file, then a rename), so the job never waits on
the disk.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import struct
import threading
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open

from vbatch.layers import native

logger = logging.getLogger(__name__)

STORE_VERSION = 1
STORE_DIR = "packed"
HEADER_ALIGN = 8
SAFETENSORS_DTYPES = {torch.float32: "F32", torch.int8: "I8"}


def models_source_digest() -> str:
    """A hash of vbatch's model code (what turns a checkpoint into the weights that get packed)."""
    digest = hashlib.sha256()
    package = Path(__file__).resolve().parent.parent / "models"
    for path in sorted(package.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def store_root() -> Path:
    return native.cache_dir() / STORE_DIR


def store_path(weights_hash: str, dtype: torch.dtype) -> Path | None:
    """Where the packed copies of the model with `weights_hash` live, None without the native
    library (nothing to pack for)."""
    library = native.library_key()
    if library is None:
        return None
    key = {
        "weights": weights_hash,
        "dtype": str(dtype),
        "library": library,
        "models": models_source_digest(),
        "version": STORE_VERSION,
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return store_root() / f"{weights_hash[:16]}-{digest}.safetensors"


class PackedStore:
    """Packed copies by name: mapped from the file where it has them (and they check out),
    packed here otherwise; `flush` writes the file again once this core has made new ones (no
    more after a write fails: the cache directory is then read-only or full).

    Invariant: `_made` holds the copies packed here that the file on disk lacks."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._mapped: dict[str, torch.Tensor] = {}
        self._made: dict[str, torch.Tensor] = {}
        self._writer: threading.Thread | None = None
        self._lock = threading.Lock()
        self.mapped_names: set[str] = set()
        if path is not None and path.is_file():
            self._map(path)

    def _map(self, path: Path) -> None:
        try:
            with safe_open(str(path), framework="pt") as f:
                self._mapped = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
        except Exception as e:
            logger.warning("ignoring the packed-weight cache %s (%s); packing afresh", path, e)
            self._mapped = {}

    def tensors(
        self,
        names: tuple[str, ...],
        make: Callable[[], tuple[torch.Tensor, ...]],
        matches: Callable[[tuple[torch.Tensor, ...]], bool],
    ) -> tuple[torch.Tensor, ...]:
        """The prepared tensors `names`: the file's if it has them all and `matches` accepts
        them, else make(), kept to be written back."""
        mapped = tuple(self._mapped.get(name) for name in names)
        if all(t is not None for t in mapped) and matches(mapped):  # type: ignore[arg-type]
            self.mapped_names.update(names)
            return mapped  # type: ignore[return-value]
        made = tuple(t.contiguous() for t in make())
        with self._lock:
            for name, tensor in zip(names, made, strict=True):
                self._mapped.pop(name, None)
                self._made[name] = tensor
        return made

    def flush(self) -> None:
        """Write the file again in the background if copies were made here since the last
        write (and no write is under way)."""
        if self.path is None or not self._made:
            return
        if self._writer is not None and self._writer.is_alive():
            return
        self._writer = threading.Thread(target=self._write, name="vbatch-packed-store", daemon=True)
        self._writer.start()

    def close(self) -> None:
        """Wait for a write under way."""
        if self._writer is not None:
            self._writer.join()

    def _write(self) -> None:
        assert self.path is not None
        with self._lock:
            made = dict(self._made)
            tensors = {**self._mapped, **made}
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_safetensors(tmp, tensors)
            os.replace(tmp, self.path)
        except OSError as e:
            logger.warning("could not write the packed-weight cache %s: %s", self.path, e)
            with contextlib.suppress(OSError):
                tmp.unlink()
            self.path = None
            return
        for stale in self.path.parent.glob(f"{self.path.name[:16]}-*.safetensors"):
            if stale != self.path:
                with contextlib.suppress(OSError):
                    stale.unlink()
        with self._lock:
            self._mapped.update(made)
            for name in made:
                del self._made[name]


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """float32 and int8 `tensors` as a safetensors file, written straight from their memory."""
    header: dict[str, object] = {}
    offset = 0
    for name, tensor in tensors.items():
        assert tensor.dtype in SAFETENSORS_DTYPES and tensor.is_contiguous()
        size = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": SAFETENSORS_DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % HEADER_ALIGN)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for tensor in tensors.values():
            f.write(memoryview(tensor.numpy()).cast("B"))
