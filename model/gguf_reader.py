"""A GGUF file opened once: `open_gguf`, shared by the weight loader and the tokenizer.

`open_gguf(path)` parses a GGUF file (format versions 2 and 3, little-endian) into a `GGUFFile`:

  metadata  every key/value pair, in file order, as Python values: a scalar is an int, float,
            bool or str (bytes that are not UTF-8 become U+FFFD); an array of numbers or bools
            is one numpy array (read with one `np.frombuffer`); an array of strings is a list of
            str; an array of arrays is a list of those. `as_python` turns arrays into lists.
  tensors   name -> `GGUFTensor`: its ggml type, its shape (outermost first: the file's dims
            reversed, as numpy orders them) and its data, a read-only numpy view of the
            memory-mapped file. Float and integer types are views in their own dtype and shape;
            quantized types (and BF16) are bytes, `[*rows, row bytes]`, as `gguf.quants` reads them.

Nothing but the header is read when the file is opened: tensor data is paged in by the OS when a
view is read, so memory stays low. The string loop is the only per-element work: Gemma 3 270M's
header (262k tokens, their scores and types) parses in about 0.15 s, where `gguf.GGUFReader`,
which makes a numpy view of every array element, took 15 s (SmolLM2's: 0.1 s against 3.8 s).

The reader of the file last opened is kept while the file is unchanged (its size and
modification time), as loading a model opens it twice: for the weights
(`meshserve.model.loading.gguf_files`) and for the tokenizer (`meshserve.model.gguf_vocab`);
`release` forgets it once both are read.
A file that is not GGUF, truncated or corrupt raises one ValueError that says so; big-endian
files and unknown versions are refused by name. The `gguf` package gives only the ggml type
constants and their block sizes. This module imports neither jax nor flax.
"""

from __future__ import annotations

import functools
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
ALIGNMENT_KEY = "general.alignment"

# GGUF metadata value types: the numbers' and bool's numpy dtypes, and the two compound types.
NUMBER_TYPES = {
    0: np.dtype("<u1"), 1: np.dtype("<i1"), 2: np.dtype("<u2"), 3: np.dtype("<i2"),
    4: np.dtype("<u4"), 5: np.dtype("<i4"), 6: np.dtype("<f4"), 7: np.dtype("?"),
    10: np.dtype("<u8"), 11: np.dtype("<i8"), 12: np.dtype("<f8"),
}
STRING, ARRAY = 8, 9

# Tensor types read in their own dtype; every other ggml type is read as bytes.
_GGML = gguf.GGMLQuantizationType
PLAIN_TENSOR_TYPES = {
    _GGML.F32: np.dtype("<f4"), _GGML.F16: np.dtype("<f2"), _GGML.F64: np.dtype("<f8"),
    _GGML.I8: np.dtype("i1"), _GGML.I16: np.dtype("<i2"), _GGML.I32: np.dtype("<i4"),
    _GGML.I64: np.dtype("<i8"),
}

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


class CorruptGGUF(ValueError):
    """The bytes break the GGUF format (`open_gguf` says which file)."""


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    ggml_type: gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # outermost first: the file's dims reversed
    offset: int  # of its data, from the start of the file
    data: np.ndarray  # read-only view of the file (bytes [*rows, row bytes] unless plain)


@dataclass(frozen=True)
class GGUFFile:
    path: Path
    version: int
    alignment: int
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensor]


def open_gguf(path: str | os.PathLike) -> GGUFFile:
    """Opens a GGUF file, turning any breach of the format into one clear error."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such file: {path}")
    stat = path.stat()
    return _read_gguf(path.resolve(), stat.st_size, stat.st_mtime_ns)


def release() -> None:
    """Forgets the file last opened, so that its memory map (and the pages of it that were
    read, which count as this process's resident memory) goes once no view of it is left: for
    a loader that has copied every tensor out and read the tokenizer."""
    _read_gguf.cache_clear()


@functools.lru_cache(maxsize=1)
def _read_gguf(path: Path, size: int, mtime_ns: int) -> GGUFFile:
    del size, mtime_ns  # part of the cache key only: a rewritten file is read again
    try:
        return read_gguf(path)
    except CorruptGGUF as err:
        raise ValueError(
            f"{path} is not a readable GGUF file; it is corrupt or truncated ({err}). "
            "Download it again."
        ) from err


def read_gguf(path: Path) -> GGUFFile:
    with open(path, "rb") as file:
        if os.fstat(file.fileno()).st_size == 0:
            raise CorruptGGUF("the file is empty")
        buffer = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
    cursor = _Cursor(buffer)
    version, num_tensors, num_kv = read_header(cursor, path)
    metadata = read_metadata(cursor, num_kv)
    infos = [read_tensor_info(cursor) for _ in range(num_tensors)]
    alignment = data_alignment(metadata)
    data_start = -(-cursor.pos // alignment) * alignment  # the first aligned byte after infos
    tensors: dict[str, GGUFTensor] = {}
    for name, dims, ggml_type, offset in infos:
        if name in tensors:
            raise CorruptGGUF(f"tensor {name!r} appears twice")
        if offset % alignment:
            raise CorruptGGUF(f"tensor {name!r} starts at {offset}, not a multiple of "
                              f"the alignment {alignment}")
        tensors[name] = tensor_view(buffer, name, dims, ggml_type, data_start + offset)
    return GGUFFile(path=path, version=version, alignment=alignment, metadata=metadata,
                    tensors=tensors)


def read_header(cursor: _Cursor, path: Path) -> tuple[int, int, int]:
    """(version, tensor count, metadata count), refusing files this reader cannot read."""
    magic = cursor.take(4)
    if magic != MAGIC:
        raise CorruptGGUF(f"it starts with {magic!r}, not the GGUF magic {MAGIC!r}")
    version = cursor.u32()
    if version not in VERSIONS:
        swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
        if swapped in VERSIONS:
            raise ValueError(f"{path} is a big-endian GGUF file (version {swapped}); "
                             "meshserve reads little-endian GGUF files only")
        raise ValueError(f"{path} is GGUF version {version}; meshserve reads versions "
                         f"{', '.join(map(str, VERSIONS))}")
    return version, cursor.u64(), cursor.u64()


def read_metadata(cursor: _Cursor, num_kv: int) -> dict[str, Any]:
    metadata: dict[str, Any] = {}
    for _ in range(num_kv):
        key = cursor.string()
        if key in metadata:
            raise CorruptGGUF(f"metadata key {key!r} appears twice")
        metadata[key] = cursor.value(cursor.u32())
    return metadata


def data_alignment(metadata: dict[str, Any]) -> int:
    alignment = metadata.get(ALIGNMENT_KEY, DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise CorruptGGUF(f"{ALIGNMENT_KEY} is {alignment!r}, not a power of two")
    return alignment


def read_tensor_info(cursor: _Cursor) -> tuple[str, tuple[int, ...], _GGML, int]:
    """One tensor's name, dims (innermost first, as stored), ggml type and data offset."""
    name = cursor.string()
    num_dims = cursor.u32()
    if num_dims > MAX_DIMS:
        raise CorruptGGUF(f"tensor {name!r} has {num_dims} dims; GGUF allows {MAX_DIMS}")
    dims = tuple(cursor.u64() for _ in range(num_dims))
    raw_type = cursor.u32()
    try:
        ggml_type = _GGML(raw_type)
    except ValueError:
        raise CorruptGGUF(f"tensor {name!r} has unknown ggml type {raw_type}") from None
    return name, dims, ggml_type, cursor.u64()


def tensor_view(buffer: mmap.mmap, name: str, dims: tuple[int, ...], ggml_type: _GGML,
                start: int) -> GGUFTensor:
    """A tensor's data as a read-only view of the mapped file: its own dtype for plain types,
    bytes `[*rows, row bytes]` for block types."""
    shape = tuple(reversed(dims))
    dtype = PLAIN_TENSOR_TYPES.get(ggml_type)
    if dtype is not None:
        view_shape = shape
    else:
        block_size, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
        if not shape or shape[-1] % block_size:
            raise CorruptGGUF(f"tensor {name!r} of shape {shape} is not made of whole "
                              f"{ggml_type.name} blocks of {block_size}")
        view_shape = (*shape[:-1], shape[-1] // block_size * type_size)
        dtype = np.dtype(np.uint8)
    count = int(np.prod(view_shape, dtype=np.int64))
    if start + count * dtype.itemsize > len(buffer):
        raise CorruptGGUF(f"tensor {name!r} ends past the end of the file")
    data = np.frombuffer(buffer, dtype=dtype, count=count, offset=start).reshape(view_shape)
    return GGUFTensor(name=name, ggml_type=ggml_type, shape=shape, offset=start, data=data)


class _Cursor:
    """Reads GGUF values one after another from a buffer, never past its end."""

    def __init__(self, buffer: mmap.mmap):
        self.buffer, self.pos, self.size = buffer, 0, len(buffer)

    def skip(self, num_bytes: int) -> int:
        """Moves past `num_bytes`, returning where they start."""
        start, end = self.pos, self.pos + num_bytes
        if end > self.size:
            raise CorruptGGUF(f"it ends at byte {self.size}, inside a value that needs "
                              f"{num_bytes} bytes from byte {start}")
        self.pos = end
        return start

    def take(self, num_bytes: int) -> bytes:
        start = self.skip(num_bytes)
        return self.buffer[start:self.pos]

    def u32(self) -> int:
        return _U32.unpack(self.take(4))[0]

    def u64(self) -> int:
        return _U64.unpack(self.take(8))[0]

    def string(self) -> str:
        return self.take(self.u64()).decode("utf-8", errors="replace")

    def value(self, value_type: int) -> Any:
        dtype = NUMBER_TYPES.get(value_type)
        if dtype is not None:
            return np.frombuffer(self.take(dtype.itemsize), dtype)[0].item()
        if value_type == STRING:
            return self.string()
        if value_type == ARRAY:
            return self.array(self.u32(), self.u64())
        raise CorruptGGUF(f"unknown metadata value type {value_type} at byte {self.pos - 4}")

    def array(self, item_type: int, length: int) -> np.ndarray | list[Any]:
        dtype = NUMBER_TYPES.get(item_type)
        if dtype is not None:
            start = self.skip(length * dtype.itemsize)
            return np.frombuffer(self.buffer, dtype, length, start).copy()
        if item_type == STRING:
            return self.strings(length)
        if item_type == ARRAY:
            return [self.array(self.u32(), self.u64()) for _ in range(length)]
        raise CorruptGGUF(f"unknown array item type {item_type} at byte {self.pos - 12}")

    def strings(self, length: int) -> list[str]:
        """`length` strings: the one loop that runs once per token of a vocabulary, so kept to
        a slice, a length and a decode per string."""
        buffer, pos, size, unpack = self.buffer, self.pos, self.size, _U64.unpack_from
        strings = []
        for _ in range(length):
            if pos + 8 > size:
                break
            end = pos + 8 + unpack(buffer, pos)[0]
            if end > size:
                break
            strings.append(buffer[pos + 8:end].decode("utf-8", errors="replace"))
            pos = end
        self.pos = pos
        if len(strings) < length:
            raise CorruptGGUF(f"it ends at byte {size}, inside string {len(strings)} of an "
                              f"array of {length}")
        return strings


def as_python(value: Any) -> Any:
    """A metadata value with its numpy arrays as lists (of Python numbers), nested or not."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, list) and value and not isinstance(value[0], str):
        return [as_python(item) for item in value]  # an array of arrays
    return value
