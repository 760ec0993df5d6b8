"""The byte format of one stored KV block (docs/contracts.md §2).

A block is a fixed header followed by the raw KV bytes. The header names the namespace root key
and the block key the bytes belong to, the KV layout version, dtype and shape, and the payload
length; a CRC-32 covers header and payload. `decode_block` checks all of it, so a torn write, a
flipped bit or a block written under another namespace (even on a key collision) is rejected
instead of served.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

from kvyard.kvcache.block_key import KEY_BYTES, KV_LAYOUT_VERSION

MAGIC = b"KVYB"
FORMAT_VERSION = 1
MAX_DIMS = 8
_DTYPE_BYTES = 16
# magic, format, layout, root key, block key, dtype, ndim, shape[8], payload length, crc32
_HEADER = struct.Struct(f"<4sHH{KEY_BYTES}s{KEY_BYTES}s{_DTYPE_BYTES}sB3x{MAX_DIMS}IQI")
HEADER_BYTES = _HEADER.size
_CRC_OFFSET = HEADER_BYTES - 4


class BlockRejectedError(ValueError):
    """A stored block that must not be used."""


class BlockCorruptError(BlockRejectedError):
    """The bytes are damaged: wrong magic or length, or the checksum does not match."""


class BlockMismatchError(BlockRejectedError):
    """The bytes are intact but belong to another namespace, key, layout, dtype or shape."""


@dataclass(frozen=True, slots=True)
class BlockFormat:
    """What a reader expects a block's payload to be."""

    dtype: str
    shape: tuple[int, ...]

    @property
    def num_elements(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count


@dataclass(frozen=True, slots=True)
class DecodedBlock:
    key: bytes
    blob: bytes | bytearray | memoryview  # the whole verified block, header included
    payload: memoryview


def encode_block(root_key: bytes, key: bytes, fmt: BlockFormat, payload: memoryview | bytes) -> bytes:
    if len(fmt.shape) > MAX_DIMS:
        raise ValueError(f"at most {MAX_DIMS} dimensions, got shape {fmt.shape}")
    view = memoryview(payload).cast("B")
    shape = tuple(fmt.shape) + (0,) * (MAX_DIMS - len(fmt.shape))
    header = _HEADER.pack(
        MAGIC,
        FORMAT_VERSION,
        KV_LAYOUT_VERSION,
        root_key,
        key,
        fmt.dtype.encode(),
        len(fmt.shape),
        *shape,
        view.nbytes,
        0,
    )
    crc = zlib.crc32(view, zlib.crc32(header[:_CRC_OFFSET]))
    return b"".join((header[:_CRC_OFFSET], crc.to_bytes(4, "little"), view))


def decode_block(blob: bytes | bytearray | memoryview, root_key: bytes, key: bytes, fmt: BlockFormat) -> DecodedBlock:
    """Verify `blob` and return its payload; raises BlockCorruptError or BlockMismatchError."""
    view = memoryview(blob).cast("B")
    if view.nbytes < HEADER_BYTES:
        raise BlockCorruptError(f"{view.nbytes} bytes is shorter than the {HEADER_BYTES}-byte header")
    fields = _HEADER.unpack(view[:HEADER_BYTES])
    magic, _, layout, stored_root, stored_key, dtype, ndim = fields[:7]
    shape, payload_len, crc = fields[7 : 7 + MAX_DIMS], fields[-2], fields[-1]
    if magic != MAGIC:
        raise BlockCorruptError(f"bad magic {magic!r}")
    if view.nbytes != HEADER_BYTES + payload_len:
        raise BlockCorruptError(f"length {view.nbytes} does not match header ({HEADER_BYTES} + {payload_len})")
    payload = view[HEADER_BYTES:]
    if zlib.crc32(payload, zlib.crc32(view[:_CRC_OFFSET])) != crc:
        raise BlockCorruptError("checksum mismatch")
    if stored_root != root_key or stored_key != key or layout != KV_LAYOUT_VERSION:
        raise BlockMismatchError("block belongs to another namespace, key or layout version")
    stored_fmt = BlockFormat(dtype.rstrip(b"\x00").decode(errors="replace"), tuple(shape[:ndim]))
    if stored_fmt != fmt:
        raise BlockMismatchError(f"block holds {stored_fmt}, expected {fmt}")
    return DecodedBlock(key, blob, payload)
