"""The header of a GGUF file (metadata and tensor directory), read without the weights.

Our own parser: gguf.GGUFReader takes seconds on a 49k-token vocabulary; this takes ~0.1 s.
Torch-free. The weights themselves are dequantised by `radixkv.worker.loader`.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType


class GGUFFormatError(ValueError):
    """The bytes are not a GGUF file this reader understands; the message names the file."""


@dataclass(frozen=True)
class GGUFTensorInfo:
    """Where one tensor's bytes lie in a GGUF file. `shape` is outermost first (numpy order)."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int

    @property
    def type_name(self) -> str:
        return ggml_type_name(self.ggml_type)

    @property
    def nbytes(self) -> int:
        block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(self.ggml_type)]
        return math.prod(self.shape) // block_size * type_size


@dataclass(frozen=True)
class GGUFFile:
    """A GGUF file's metadata (key -> value, arrays as lists) and its tensors, in file order."""

    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensorInfo]

    def arch_value(self, key: str, default: Any = None) -> Any:
        """`{architecture}.{key}` from the metadata, e.g. arch_value("block_count")."""
        return self.metadata.get(f"{self.metadata.get('general.architecture')}.{key}", default)


def ggml_type_name(ggml_type: int) -> str:
    try:
        return GGMLQuantizationType(ggml_type).name
    except ValueError:
        return f"unknown type {ggml_type}"


def read_gguf_header(path: Path) -> GGUFFile:
    """Parse a GGUF header (version 2 or 3, little-endian): metadata and tensor directory."""
    with open(path, "rb") as file:
        if file.read(4) != b"GGUF":
            raise GGUFFormatError(f"{path} is not a GGUF file (bad magic bytes)")
        with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as buffer:
            try:
                return _parse_gguf(path, buffer)
            except (struct.error, ValueError, IndexError, UnicodeDecodeError) as error:
                raise GGUFFormatError(f"{path} is not a valid GGUF file: {error}") from error


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class _Cursor:
    def __init__(self, buffer: mmap.mmap, offset: int) -> None:
        self.buffer, self.offset = buffer, offset

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buffer, self.offset)
        self.offset += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.scalar("<Q")
        raw = self.buffer[self.offset : self.offset + length]
        self.offset += length
        return raw.decode("utf-8", errors="replace")

    def value(self, value_type: int) -> Any:
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY:
            item_type, count = self.scalar("<I"), self.scalar("<Q")
            if item_type in _SCALARS:
                dtype = np.dtype(_SCALARS[item_type])
                items = np.frombuffer(self.buffer, dtype, count, self.offset)
                self.offset += dtype.itemsize * count
                return items.tolist()
            return [self.value(item_type) for _ in range(count)]
        if value_type not in _SCALARS:
            raise ValueError(f"unknown metadata value type {value_type}")
        return self.scalar(_SCALARS[value_type])


def _parse_gguf(path: Path, buffer: mmap.mmap) -> GGUFFile:
    cursor = _Cursor(buffer, 4)
    version = cursor.scalar("<I")
    if version not in (2, 3):
        raise GGUFFormatError(
            f"{path}: GGUF version {version} is not supported (2 or 3, little-endian)"
        )
    num_tensors, num_keys = cursor.scalar("<Q"), cursor.scalar("<Q")
    metadata: dict[str, Any] = {}
    for _ in range(num_keys):
        key = cursor.string()
        metadata[key] = cursor.value(cursor.scalar("<I"))
    directory = []
    for _ in range(num_tensors):
        name = cursor.string()
        dims = [cursor.scalar("<Q") for _ in range(cursor.scalar("<I"))]
        directory.append((name, tuple(reversed(dims)), cursor.scalar("<I"), cursor.scalar("<Q")))
    alignment = int(metadata.get("general.alignment", 32))
    data_start = -(-cursor.offset // alignment) * alignment
    tensors = {
        name: GGUFTensorInfo(name, shape, ggml_type, data_start + offset)
        for name, shape, ggml_type, offset in directory
    }
    return GGUFFile(path, metadata, tensors)
