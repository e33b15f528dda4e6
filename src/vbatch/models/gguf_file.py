"""A GGUF file's metadata and tensors, parsed from a memory map in one pass (no per-item views)."""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from vbatch.errors import ModelLoadError

_MAGIC = b"GGUF"
_STRING, _ARRAY = 8, 9
_SCALARS = {
    0: struct.Struct("<B"),
    1: struct.Struct("<b"),
    2: struct.Struct("<H"),
    3: struct.Struct("<h"),
    4: struct.Struct("<I"),
    5: struct.Struct("<i"),
    6: struct.Struct("<f"),
    7: struct.Struct("<?"),
    10: struct.Struct("<Q"),
    11: struct.Struct("<q"),
    12: struct.Struct("<d"),
}
_ARRAY_DTYPES = {
    0: "<u1",
    1: "<i1",
    2: "<u2",
    3: "<i2",
    4: "<u4",
    5: "<i4",
    6: "<f4",
    7: "?",
    10: "<u8",
    11: "<i8",
    12: "<f8",
}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor: `shape` in row-major (Hugging Face) order, `data` its raw bytes as
    [rows, bytes per row], which `gguf.quants.dequantize` turns into [rows, row length]."""

    name: str
    shape: tuple[int, ...]
    tensor_type: int
    data: np.ndarray


@dataclass(frozen=True)
class GGUFFile:
    """The key-value metadata (arrays as lists) and the tensors, in file order."""

    metadata: dict[str, Any]
    tensors: list[GGUFTensor]


class _Cursor:
    def __init__(self, buffer: mmap.mmap) -> None:
        self.buffer = buffer
        self.offset = 0

    def unpack(self, fmt: struct.Struct) -> Any:
        (value,) = fmt.unpack_from(self.buffer, self.offset)
        self.offset += fmt.size
        return value

    def string(self) -> str:
        length = self.unpack(_U64)
        end = self.offset + length
        if end > len(self.buffer):
            raise ValueError("a string runs past the end of the file")
        text = self.buffer[self.offset : end].decode("utf-8", errors="replace")
        self.offset = end
        return text

    def value(self, value_type: int) -> Any:
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY:
            return self.array()
        if value_type not in _SCALARS:
            raise ValueError(f"unknown value type {value_type}")
        return self.unpack(_SCALARS[value_type])

    def array(self) -> list[Any]:
        item_type = self.unpack(_U32)
        count = self.unpack(_U64)
        if item_type in _ARRAY_DTYPES:
            dtype = np.dtype(_ARRAY_DTYPES[item_type])
            items = np.frombuffer(self.buffer, dtype=dtype, count=count, offset=self.offset)
            self.offset += count * dtype.itemsize
            return items.tolist()
        if item_type == _STRING:
            return [self.string() for _ in range(count)]
        return [self.value(item_type) for _ in range(count)]


def check_gguf_header(path: Path) -> None:
    """Refuse a file that does not start as a GGUF file of a supported version (8 bytes read:
    a job checks its model this way before it exists)."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
    except OSError as e:
        raise ModelLoadError(f"cannot read GGUF file {path}: {e}") from e
    if head[:4] != _MAGIC:
        raise ModelLoadError(f"{path} is not a GGUF file: it does not start with the GGUF magic")
    (version,) = struct.unpack("<I", head[4:8].ljust(4, b"\0"))
    if version not in (2, 3):
        raise ModelLoadError(f"{path}: GGUF version {version} is not supported (2 or 3)")


def read_gguf(path: Path) -> GGUFFile:
    """Parse the GGUF file at `path`; the tensors' data stays memory-mapped."""
    import gguf

    try:
        with open(path, "rb") as f:
            buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        cursor = _Cursor(buffer)
        if buffer[:4] != _MAGIC:
            raise ValueError("it does not start with the GGUF magic")
        cursor.offset = 4
        version = cursor.unpack(_U32)
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported (2 or 3, little-endian)")
        tensor_count = cursor.unpack(_U64)
        kv_count = cursor.unpack(_U64)
        metadata: dict[str, Any] = {}
        for _ in range(kv_count):
            key = cursor.string()
            metadata[key] = cursor.value(cursor.unpack(_U32))
        infos = []
        for _ in range(tensor_count):
            name = cursor.string()
            dims = [cursor.unpack(_U64) for _ in range(cursor.unpack(_U32))]
            infos.append((name, tuple(reversed(dims)), cursor.unpack(_U32), cursor.unpack(_U64)))
        alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
        data_start = -(-cursor.offset // alignment) * alignment
        whole = np.frombuffer(buffer, dtype=np.uint8)
        tensors = []
        for name, shape, tensor_type, offset in infos:
            if not shape:
                raise ValueError(f"tensor {name} has no dimensions")
            qtype = gguf.GGMLQuantizationType(tensor_type)
            block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
            row_bytes = shape[-1] // block_size * type_size
            rows = int(np.prod(shape[:-1], dtype=np.int64))
            start = data_start + offset
            if start + rows * row_bytes > len(buffer):
                raise ValueError(f"tensor {name} runs past the end of the file")
            data = whole[start : start + rows * row_bytes].reshape(rows, row_bytes)
            tensors.append(GGUFTensor(name, shape, qtype, data))
    except (
        OSError,
        ValueError,
        KeyError,
        struct.error,
        UnicodeDecodeError,
        ZeroDivisionError,
    ) as e:
        raise ModelLoadError(f"cannot read GGUF file {path}: {e}") from e
    return GGUFFile(metadata, tensors)


def dequantize(tensor: GGUFTensor) -> np.ndarray:
    """The tensor as float32 in its row-major shape; the common block types in whole-tensor numpy
    passes, the rest through `gguf.quants` (slower, bit-identical results)."""
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize as gguf_dequantize

    if tensor.tensor_type == Q.Q4_0:
        array = _dequantize_q4(tensor.data, with_min=False)
    elif tensor.tensor_type == Q.Q4_1:
        array = _dequantize_q4(tensor.data, with_min=True)
    elif tensor.tensor_type == Q.Q8_0:
        blocks = tensor.data.reshape(-1, 34)
        array = blocks[:, 2:].view(np.int8) * _half(blocks, 0)
    else:
        array = gguf_dequantize(tensor.data, tensor.tensor_type)
    return array.astype(np.float32, copy=False).reshape(tensor.shape)


def _half(blocks: np.ndarray, column: int) -> np.ndarray:
    """The float16 at byte `column` of each block, as a float32 column."""
    return blocks[:, column : column + 2].copy().view(np.float16).astype(np.float32)


def _dequantize_q4(data: np.ndarray, with_min: bool) -> np.ndarray:
    """Q4_0 (q - 8) * d, or Q4_1 q * d + m, over blocks of 32: low nibbles, then high nibbles."""
    header = 4 if with_min else 2
    blocks = data.reshape(-1, header + 16)
    nibbles = np.empty((blocks.shape[0], 2, 16), dtype=np.uint8)
    np.bitwise_and(blocks[:, header:], 0x0F, out=nibbles[:, 0])
    np.right_shift(blocks[:, header:], 4, out=nibbles[:, 1])
    values = nibbles.reshape(-1, 32)
    if not with_min:
        values = values.view(np.int8) - np.int8(8)
    out = np.empty(values.shape, dtype=np.float32)
    np.multiply(values, _half(blocks, 0), out=out)
    if with_min:
        out += _half(blocks, 2)
    return out
