"""PackedStore: the native kernel's packed weight copies of one model (and the int8 greedy
screen's head, and the float32 projections the decoder fuses from several checkpoint tensors),
kept on disk and mapped.

Packing a 135M model's linears into the native kernel's panels costs ~0.3 s of a job's first
step (most of it page faults on 425 MB of fresh memory). The store keeps those copies in one
safetensors file per model under the cache directory, keyed by the weights, the loaded native
library (its layout depends on the CPU's vector width) and the model code that loads them. A later
core maps the file (read-only, shared with every core on the machine through the page cache)
instead of packing, and checks each mapped copy before it uses it: against the CRC-32 the file
records for it (damage anywhere in its bytes; computed in a thread while the model loads, as zlib
releases the GIL), and against its weight (a linear's by a one-row product, the int8 head by
quantizing a few rows again, a fused projection by rows of each checkpoint part: a stale or
foreign file). Copies made in a core are written back by a background thread (a temporary file,
then a rename), so the job never waits on the disk.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import secrets
import struct
import threading
import zlib
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors import safe_open

from vbatch.layers import native

logger = logging.getLogger(__name__)

STORE_VERSION = 2
CHECKSUMS_KEY = "crc32"
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
    build = {"dtype": str(dtype), "library": library}
    build_digest = hashlib.sha256(json.dumps(build, sort_keys=True).encode()).hexdigest()[:8]
    return store_root() / f"{weights_hash[:16]}-{build_digest}-{digest}.safetensors"


def is_superseded(path: Path, current: Path) -> bool:
    """Whether the store file `path` is one that `current` replaces: the same model's under the
    same library and dtype (older model code or store version), or in the old two-part naming.
    A file of another library (another CPU class sharing the cache) or dtype is kept."""
    weights, build, _ = current.stem.split("-")
    parts = path.stem.split("-")
    if path == current or parts[0] != weights:
        return False
    return len(parts) == 2 or (len(parts) == 3 and parts[1] == build)


class PackedStore:
    """Packed copies by name: mapped from the file where it has them (and they check out),
    packed here otherwise; `flush` writes the file again once this core has made new ones (no
    more after a write fails: the cache directory is then read-only or full).

    Invariants: `_made` holds the copies packed here that the file on disk lacks; `_checks`
    holds, for each mapped copy, whether its bytes match the file's checksum."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._mapped: dict[str, torch.Tensor] = {}
        self._made: dict[str, torch.Tensor] = {}
        self._checks: dict[str, Future[bool]] = {}
        self._sums: dict[str, int] = {}
        self._checker: ThreadPoolExecutor | None = None
        self._damage_reported = False
        self._writer: threading.Thread | None = None
        self._lock = threading.Lock()
        self.mapped_names: set[str] = set()
        if path is not None and path.is_file():
            self._map(path)

    def _map(self, path: Path) -> None:
        try:
            with safe_open(str(path), framework="pt") as f:
                mapped = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
                sums = json.loads((f.metadata() or {})[CHECKSUMS_KEY])
            if not isinstance(sums, dict) or sums.keys() != mapped.keys():
                raise ValueError("its checksums do not list its tensors")
        except Exception as e:
            logger.warning("ignoring the packed-weight cache %s (%s); packing afresh", path, e)
            return
        self._mapped = mapped
        self._sums = sums
        self._checker = ThreadPoolExecutor(1, thread_name_prefix="vbatch-packed-check")
        self._checks = {
            name: self._checker.submit(lambda t=tensor, want=sums[name]: checksum(t) == want)
            for name, tensor in mapped.items()
        }

    def tensors(
        self,
        names: tuple[str, ...],
        make: Callable[[], tuple[torch.Tensor, ...]],
        matches: Callable[[tuple[torch.Tensor, ...]], bool],
    ) -> tuple[torch.Tensor, ...]:
        """The prepared tensors `names`: the file's if it has them all and `matches` accepts
        them, else make(), kept to be written back."""
        mapped = tuple(t for t in (self._mapped.get(name) for name in names) if t is not None)
        if len(mapped) == len(names) and self._intact(names, mapped) and matches(mapped):
            self.mapped_names.update(names)
            return mapped
        made = tuple(t.contiguous() for t in make())
        with self._lock:
            for name, tensor in zip(names, made, strict=True):
                self._mapped.pop(name, None)
                self._checks.pop(name, None)
                self._made[name] = tensor
        return made

    def _intact(self, names: tuple[str, ...], tensors: tuple[torch.Tensor, ...]) -> bool:
        """Whether the mapped copies `names` (`tensors`) match their checksums (waiting for
        their checks); the first damaged one is reported."""
        damaged = [
            name
            for name, tensor in zip(names, tensors, strict=True)
            if not self._is_intact(name, tensor)
        ]
        if damaged and not self._damage_reported:
            self._damage_reported = True
            logger.warning(
                "the packed-weight cache %s is damaged (%s does not match its checksum); "
                "packing the damaged copies afresh",
                self.path,
                damaged[0],
            )
        return not damaged

    def _is_intact(self, name: str, tensor: torch.Tensor) -> bool:
        check = self._checks.get(name)
        if check is None:
            return True
        if check.cancel():
            # NOTE: a check not yet started runs here, rather than after the whole queue ahead
            # of it (the int8 head, asked for at start-up, was checked after every linear); its
            # result is kept for the write-back.
            check = Future()
            check.set_result(checksum(tensor) == self._sums[name])
            self._checks[name] = check
        return check.result()

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
        """Wait for a write under way (which waits for the checks of what it writes), then drop
        the checks not yet run."""
        if self._writer is not None:
            self._writer.join()
        if self._checker is not None:
            self._checker.shutdown(cancel_futures=True)

    def _write(self) -> None:
        assert self.path is not None
        with self._lock:
            made = dict(self._made)
            mapped = dict(self._mapped)
        # NOTE: a damaged copy no core asked for is left out, not written with a new checksum.
        intact = {name: t for name, t in mapped.items() if self._is_intact(name, t)}
        tensors = {**intact, **made}
        # NOTE: the pid alone is not unique where cores in containers share a cache.
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
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
            if is_superseded(stale, self.path):
                with contextlib.suppress(OSError):
                    stale.unlink()
        with self._lock:
            self._mapped.update(made)
            for name in made:
                del self._made[name]


def checksum(tensor: torch.Tensor) -> int:
    """The CRC-32 of a contiguous tensor's bytes."""
    return zlib.crc32(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """float32 and int8 `tensors` as a safetensors file, written straight from their memory,
    with each one's checksum in the header's metadata."""
    sums = {name: checksum(tensor) for name, tensor in tensors.items()}
    header: dict[str, object] = {"__metadata__": {CHECKSUMS_KEY: json.dumps(sums)}}
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
