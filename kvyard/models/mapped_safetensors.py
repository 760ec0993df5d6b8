"""A safetensors file's tensors as numpy arrays over one read-only memory map: no copy and no PyTorch.

The fast-start path (kvyard.engine.fast_start.engine) serves from these arrays while PyTorch loads; the PyTorch model
then maps the same file, so the weights are resident once, in the page cache. The format is a little-endian
u64 header length, a JSON header (name -> dtype, shape, data_offsets relative to the end of the header), then
the data."""

from __future__ import annotations

import json
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# bfloat16 has no numpy dtype: its 16-bit patterns are read as uint16, as the native kernels take them.
_DTYPES = {
    "F32": np.float32,
    "F16": np.float16,
    "BF16": np.uint16,
    "I8": np.int8,
    "U8": np.uint8,
    "I32": np.int32,
    "I64": np.int64,
    "F64": np.float64,
}


class MappedTensorsError(ValueError):
    """The file is not a safetensors file this reader can map: the message says why."""


def map_tensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of the file by name, as read-only arrays that keep the file's map alive."""
    with path.open("rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    buffer = memoryview(mapped)
    header_len, header = _header(buffer, path)
    data_start = 8 + header_len
    tensors: dict[str, np.ndarray] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        tensors[name] = _tensor(buffer, data_start, name, entry, path)
    return tensors


@dataclass(frozen=True, slots=True)
class TensorExtent:
    """Where a tensor's bytes lie in its file: `offset` from the file's start, `nbytes` long."""

    dtype: str  # the file's name for it: F32, BF16, I8...
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def tensor_extents(path: Path) -> dict[str, TensorExtent]:
    """Every tensor of the file by name, as where its bytes lie (for reading them later, not mapping them)."""
    with path.open("rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    with mapped:
        buffer = memoryview(mapped)
        try:
            header_len, header = _header(buffer, path)
            extents = {
                name: _extent(8 + header_len, name, entry, len(buffer), path)
                for name, entry in header.items()
                if name != "__metadata__"
            }
        finally:
            buffer.release()
    return extents


def _extent(data_start: int, name: str, entry: object, file_size: int, path: Path) -> TensorExtent:
    try:
        assert isinstance(entry, dict)
        dtype = np.dtype(_DTYPES[str(entry["dtype"])])
        shape = tuple(int(size) for size in entry["shape"])
        begin, end = (int(offset) for offset in entry["data_offsets"])
    except (AssertionError, KeyError, TypeError, ValueError):
        raise MappedTensorsError(f"{path}: tensor {name!r} has an entry this reader does not know: {entry}") from None
    count = int(np.prod(shape, dtype=np.int64))
    if end - begin != count * dtype.itemsize or data_start + end > file_size or begin < 0:
        raise MappedTensorsError(f"{path}: tensor {name!r} ({dtype}, {shape}) does not fit bytes {begin}..{end}")
    return TensorExtent(str(entry["dtype"]), shape, data_start + begin, end - begin)


def _header(buffer: memoryview, path: Path) -> tuple[int, dict[str, dict[str, object]]]:
    if len(buffer) < 8:
        raise MappedTensorsError(f"{path} is too short to be a safetensors file")
    (header_len,) = struct.unpack("<Q", buffer[:8])
    if 8 + header_len > len(buffer):
        raise MappedTensorsError(f"{path}: its header claims {header_len} bytes, more than the file holds")
    try:
        header = json.loads(bytes(buffer[8 : 8 + header_len]))
    except ValueError as error:
        raise MappedTensorsError(f"{path}: the header is not JSON: {error}") from None
    if not isinstance(header, dict):
        raise MappedTensorsError(f"{path}: the header is not a JSON object")
    return header_len, header


def _tensor(buffer: memoryview, data_start: int, name: str, entry: object, path: Path) -> np.ndarray:
    extent = _extent(data_start, name, entry, len(buffer), path)
    dtype = np.dtype(_DTYPES[extent.dtype])
    return np.frombuffer(buffer, dtype=dtype, count=extent.nbytes // dtype.itemsize, offset=extent.offset).reshape(
        extent.shape
    )
