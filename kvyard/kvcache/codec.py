"""The byte format of one stored KV block (docs/contracts.md §2).

A block is a fixed header followed by the raw KV bytes. The header names the namespace root key
and the block key the bytes belong to, the KV layout version, dtype and shape, and the payload
length; a CRC-32 covers header and payload. `decode_block` checks all of it, so a torn write, a
flipped bit or a block written under another namespace (even on a key collision) is rejected
instead of served.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

# isal's CRC-32 is zlib's (same polynomial, same values), several times faster with SIMD.
from isal.isal_zlib import crc32

from kvyard.kvcache.block_key import KEY_BYTES, KV_LAYOUT_VERSION

MAGIC = b"KVYB"
FORMAT_VERSION = 1
MAX_DIMS = 8
_DTYPE_BYTES = 16
# magic, format, layout, root key, block key, dtype, ndim, shape[8], payload length, crc32
_HEADER = struct.Struct(f"<4sHH{KEY_BYTES}s{KEY_BYTES}s{_DTYPE_BYTES}sB3x{MAX_DIMS}IQI")
HEADER_BYTES = _HEADER.size
_CRC_OFFSET = HEADER_BYTES - 4

# A stored block as the tiers move it: bytes, or a frame the writer filled in place (`frame_block`).
Blob = bytes | memoryview


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
    view = memoryview(payload).cast("B")
    header = _header(root_key, key, fmt, view.nbytes)
    crc = crc32(view, crc32(header))
    return b"".join((header, crc.to_bytes(4, "little"), view))


def frame_block(frame: memoryview, root_key: bytes, key: bytes, fmt: BlockFormat) -> memoryview:
    """Write the header of a block whose payload a reader already copied into `frame[HEADER_BYTES:]` (sparing the
    copy `encode_block` makes); the same bytes as `encode_block` of that payload."""
    payload = frame[HEADER_BYTES:]
    header = _header(root_key, key, fmt, payload.nbytes)
    frame[:_CRC_OFFSET] = header
    frame[_CRC_OFFSET:HEADER_BYTES] = crc32(payload, crc32(header)).to_bytes(4, "little")
    return frame


def _header(root_key: bytes, key: bytes, fmt: BlockFormat, payload_bytes: int) -> bytes:
    """The header up to (not including) its CRC."""
    if len(fmt.shape) > MAX_DIMS:
        raise ValueError(f"at most {MAX_DIMS} dimensions, got shape {fmt.shape}")
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
        payload_bytes,
        0,
    )
    return header[:_CRC_OFFSET]


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
    if crc32(payload, crc32(view[:_CRC_OFFSET])) != crc:
        raise BlockCorruptError("checksum mismatch")
    if stored_root != root_key or stored_key != key or layout != KV_LAYOUT_VERSION:
        raise BlockMismatchError("block belongs to another namespace, key or layout version")
    stored_fmt = BlockFormat(dtype.rstrip(b"\x00").decode(errors="replace"), tuple(shape[:ndim]))
    if stored_fmt != fmt:
        raise BlockMismatchError(f"block holds {stored_fmt}, expected {fmt}")
    return DecodedBlock(key, blob, payload)
