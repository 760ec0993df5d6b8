"""Local-disk tier: one file per block, persistent across restarts.

Files live under `<dir>/<first two hex digits of the key>/<key hex>.kvb`. A block is written to a
temporary file in the same directory and renamed into place, so readers never see a partial
block; a torn file left by a crash is caught by the block checksum. On start the index is rebuilt
by scanning the directory (least recently used first, by modification time, which reads refresh)
and stray temporary files are removed. When a write fails (disk full, permissions) the tier stops
writing for a while and keeps serving reads.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

from kvyard.kvcache.codec import Blob
from kvyard.kvcache.stats import TierStats
from kvyard.kvcache.tier import LoadDeadline, PutResult

log = logging.getLogger(__name__)

SUFFIX = ".kvb"
TEMP_SUFFIX = ".tmp"
WRITE_RETRY_S = 60.0


class DiskTier:
    name = "disk"
    shared = False
    store_id: str | None = None
    ttl_s: float | None = None

    def __init__(self, directory: str | Path, capacity_bytes: int, fsync: bool = False) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"disk tier capacity must be >= 0 bytes, got {capacity_bytes}")
        self.directory = Path(directory)
        self.capacity_bytes = capacity_bytes
        self.fsync = fsync
        self.stats = TierStats()
        self._index: OrderedDict[bytes, int] = OrderedDict()  # key -> file size, LRU first
        self._bytes = 0
        self._lock = threading.Lock()
        self._writes_paused_until = 0.0
        self._folders: set[str] = set()  # the key-prefix directories made so far
        self.directory.mkdir(parents=True, exist_ok=True)
        self._rebuild_index()

    @property
    def used_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._index)

    def path_of(self, key: bytes) -> Path:
        return block_path(self.directory, key)

    def _rebuild_index(self) -> None:
        entries: list[tuple[float, bytes, int]] = []
        for path in self.directory.glob("*/*"):
            if path.name.endswith(TEMP_SUFFIX):
                _remove(path)
                continue
            key = _key_of(path)
            if key is None:
                continue
            try:
                info = path.stat()
            except OSError:
                continue
            entries.append((info.st_mtime, key, info.st_size))
        for _, key, size in sorted(entries):
            self._index[key] = size
            self._bytes += size
        self._evict_over_budget()

    def get_prefix(self, keys: Sequence[bytes], deadline: LoadDeadline | float) -> Sequence[Blob]:
        start = time.perf_counter()
        found: list[bytes] = []
        deadline = LoadDeadline.of(deadline)
        for key in keys:
            if deadline.passed():
                break
            blob = self._read(key)
            if blob is None:
                break
            found.append(blob)
            deadline.count(1)
        self.stats.add(loads=1, load_seconds=time.perf_counter() - start, bytes_read=sum(map(len, found)))
        return found

    def _read(self, key: bytes) -> bytes | None:
        with self._lock:
            if key not in self._index:
                return None
            self._index.move_to_end(key)
        path = self.path_of(key)
        try:
            blob = path.read_bytes()
            os.utime(path)
        except FileNotFoundError:
            self._forget(key)
            return None
        except OSError as error:
            self.stats.add(errors=1)
            log.warning("kv disk tier: cannot read %s: %s", path, error)
            return None
        return blob

    def keys(self) -> list[bytes]:
        with self._lock:
            return list(self._index)

    def contains(self, key: bytes) -> bool:
        with self._lock:
            return key in self._index

    def put_many(self, items: Sequence[tuple[bytes, Blob]]) -> PutResult:
        result = PutResult()
        if time.monotonic() < self._writes_paused_until:
            return result
        start = time.perf_counter()
        written = 0
        for key, blob in items:
            if len(blob) > self.capacity_bytes:
                continue
            if not self._write(key, blob):
                break
            written += len(blob)
            result.stored.append(key)
            result.evicted.extend(self._evict_over_budget())
        self.stats.add(
            stores=1,
            store_seconds=time.perf_counter() - start,
            bytes_written=written,
            blocks_written=len(result.stored),
        )
        if result.evicted:
            gone = set(result.evicted)
            result.stored = [key for key in result.stored if key not in gone]
        return result

    def _write(self, key: bytes, blob: Blob) -> bool:
        # os calls on strings, not pathlib: the writer thread holds the interpreter lock for its Python work, which
        # the engine's thread waits for (a few hundred files a second).
        folder, path = block_location(self.directory, key)
        temp = f"{path}.{uuid.uuid4().hex}{TEMP_SUFFIX}"
        try:
            if folder not in self._folders:
                os.makedirs(folder, exist_ok=True)
                self._folders.add(folder)
            descriptor = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                _write_all(descriptor, blob)
                if self.fsync:
                    os.fsync(descriptor)
            finally:
                os.close(descriptor)
            os.replace(temp, path)
        except OSError as error:
            self._folders.discard(folder)  # the directory may have gone
            _remove(Path(temp))
            self._writes_paused_until = time.monotonic() + WRITE_RETRY_S
            self.stats.add(errors=1)
            log.warning("kv disk tier: write failed (%s); pausing writes for %.0f s, reads go on", error, WRITE_RETRY_S)
            return False
        with self._lock:
            old = self._index.pop(key, None)
            self._bytes += len(blob) - (old or 0)
            self._index[key] = len(blob)
        return True

    def _evict_over_budget(self) -> list[bytes]:
        evicted: list[bytes] = []
        with self._lock:
            while self._bytes > self.capacity_bytes and self._index:
                key, size = self._index.popitem(last=False)
                self._bytes -= size
                evicted.append(key)
        for key in evicted:
            _remove(self.path_of(key))
        if evicted:
            self.stats.add(evictions=len(evicted))
        return evicted

    def probe(self) -> None:
        pass

    def discard(self, key: bytes) -> None:
        self._forget(key)
        _remove(self.path_of(key))

    def _forget(self, key: bytes) -> None:
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self._bytes -= size

    def close(self) -> None:
        pass


def block_path(directory: Path, key: bytes) -> Path:
    """Where a disk tier under `directory` keeps the block `key` (another process may look without the index)."""
    return Path(block_location(directory, key)[1])


def block_location(directory: str | os.PathLike[str], key: bytes) -> tuple[str, str]:
    """(its key-prefix folder, its file) of block `key` under `directory`, as strings for os calls."""
    name = key.hex()
    folder = os.path.join(directory, name[:2])
    return folder, os.path.join(folder, name + SUFFIX)


def _write_all(descriptor: int, blob: Blob) -> None:
    view = memoryview(blob)
    while view:
        view = view[os.write(descriptor, view) :]


def _remove(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink(missing_ok=True)


def _key_of(path: Path) -> bytes | None:
    if not path.name.endswith(SUFFIX):
        return None
    try:
        key = bytes.fromhex(path.name.removesuffix(SUFFIX))
    except ValueError:
        return None
    return key if path.parent.name == path.name[:2] else None
