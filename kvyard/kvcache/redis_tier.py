"""Redis/Valkey tier: shared by every replica on every machine.

Reads and writes are pipelined in batches (one round trip per batch); every value has a TTL. Works
against one server or a Redis Cluster (`cluster=True`: the cluster client splits a pipeline by
node). An unreachable, slow or failing server turns into misses: the error is counted and logged,
the tier stays quiet for a backoff period that doubles up to a limit, then tries again.

Every round trip also reads the store's epoch, a marker key holding a random id that the first replica to find
it missing sets (SET NX): a flushed or restarted store has lost it, so its id changes, and the replica's KV
events say so (`cleared`) without an extra round trip. Give the server a `volatile-*` eviction policy (or none):
an evicted marker reads as a flush.

A password and TLS come with the URL, as redis-py reads it:
`rediss://:PASSWORD@host:6380/0?ssl_ca_certs=/path/ca.pem`. A wrong password or an untrusted
certificate is a failure like any other (misses, an error counted, the cause in the log line); the
URL is logged with its password masked.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.retry import Retry

from kvyard.kvcache.codec import Blob
from kvyard.kvcache.stats import TierStats
from kvyard.kvcache.tier import LoadDeadline, PutResult

log = logging.getLogger(__name__)

KEY_PREFIX = "kvyard:kv:"
EPOCH_KEY = "kvyard:epoch"
MIN_BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0


class RedisTier:
    name = "redis"
    shared = True

    def __init__(
        self,
        url: str,
        ttl_s: int = 86400,
        cluster: bool = False,
        batch_blocks: int = 32,
        timeout_s: float = 1.0,
    ) -> None:
        if ttl_s < 1:
            raise ValueError(f"redis TTL must be at least 1 s, got {ttl_s}")
        self.log_url = redact_url(url)
        self.ttl_s: float | None = ttl_s
        self.batch_blocks = batch_blocks
        self.stats = TierStats()
        # No client-side retries: a stalled server must cost one timeout, then the tier backs off itself.
        options: dict[str, Any] = {
            "socket_timeout": timeout_s,
            "socket_connect_timeout": timeout_s,
            "retry": Retry(NoBackoff(), 0),
        }
        self._client: Any = RedisCluster.from_url(url, **options) if cluster else redis.Redis.from_url(url, **options)
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._backoff_s = MIN_BACKOFF_S
        self._epoch_candidate = uuid.uuid4().hex
        self._store_id: str | None = None
        self.probe()  # learn the store's epoch (a miss if it is down)

    @property
    def store_id(self) -> str | None:
        return self._store_id

    @staticmethod
    def redis_key(key: bytes) -> str:
        return KEY_PREFIX + key.hex()

    @property
    def available(self) -> bool:
        return time.monotonic() >= self._down_until

    def get_prefix(self, keys: Sequence[bytes], deadline: LoadDeadline | float) -> Sequence[Blob]:
        if not self.available:
            return []
        start = time.perf_counter()
        found: list[bytes] = []
        deadline = LoadDeadline.of(deadline)
        for offset in range(0, len(keys), self.batch_blocks):
            if deadline.passed():
                break
            batch = keys[offset : offset + self.batch_blocks]
            values = self._pipeline(lambda pipe, key: pipe.get(self.redis_key(key)), batch)
            if values is None:
                break
            hits = _leading_values(values)
            found.extend(hits)
            deadline.count(len(hits))
            if len(hits) < len(values):
                break
        self.stats.add(loads=1, load_seconds=time.perf_counter() - start, bytes_read=sum(map(len, found)))
        return found

    def leading_held(self, keys: Sequence[bytes]) -> int:
        """How many of the leading `keys` the store holds, asked without reading them (EXISTS, pipelined);
        0 while the tier backs off."""
        held = 0
        for offset in range(0, len(keys), self.batch_blocks):
            if not self.available:
                break
            batch = keys[offset : offset + self.batch_blocks]
            answers = self._pipeline(lambda pipe, key: pipe.exists(self.redis_key(key)), batch)
            if answers is None:
                break
            leading = next((index for index, answer in enumerate(answers) if not answer), len(answers))
            held += leading
            if leading < len(batch):
                break
        return held

    def keys(self) -> list[bytes]:
        return []

    def contains(self, key: bytes) -> bool:
        return False

    def put_many(self, items: Sequence[tuple[bytes, Blob]]) -> PutResult:
        result = PutResult()
        if not items or not self.available:
            return result
        start = time.perf_counter()
        for offset in range(0, len(items), self.batch_blocks):
            batch = items[offset : offset + self.batch_blocks]
            if self._pipeline(self._set_command, batch) is None:
                break
            self.stats.add(bytes_written=sum(len(blob) for _, blob in batch), blocks_written=len(batch))
            result.stored.extend(key for key, _ in batch)
        self.stats.add(stores=1, store_seconds=time.perf_counter() - start)
        return result

    def _set_command(self, pipe: Any, item: tuple[bytes, Blob]) -> None:
        pipe.set(self.redis_key(item[0]), item[1], ex=self.ttl_s)

    def probe(self) -> None:
        """One round trip that reads the store's epoch (and backs off if the store fails)."""
        if self.available:
            self._pipeline(lambda pipe, arg: None, [])

    def discard(self, key: bytes) -> None:
        if self.available:
            self._pipeline(lambda pipe, k: pipe.delete(self.redis_key(k)), [key])

    def _pipeline(self, command: Any, args: Sequence[Any]) -> list[Any] | None:
        """Run `command(pipe, arg)` for each arg in one round trip, with the epoch read; None (after backing off)
        on failure."""
        try:
            pipe = self._client.pipeline(transaction=False)
            pipe.set(EPOCH_KEY, self._epoch_candidate, nx=True)
            pipe.get(EPOCH_KEY)
            for arg in args:
                command(pipe, arg)
            results: list[Any] = pipe.execute()
        except (redis.RedisError, OSError) as error:
            self._mark_down(error)
            return None
        self._mark_up()
        if results[0]:  # this round trip set the marker: the store was new or emptied; the next one gets a new id
            self._epoch_candidate = uuid.uuid4().hex
        if results[1] is not None:
            self._store_id = bytes(results[1]).decode(errors="replace")
        return results[2:]

    def _mark_down(self, error: BaseException) -> None:
        with self._lock:
            self._down_until = time.monotonic() + self._backoff_s
            log.warning(
                "kv redis tier %s: %s: %s; treating as misses for %.0f s",
                self.log_url,
                type(error).__name__,
                error,
                self._backoff_s,
            )
            self._backoff_s = min(self._backoff_s * 2, MAX_BACKOFF_S)
        self.stats.add(errors=1)

    def _mark_up(self) -> None:
        if self._backoff_s != MIN_BACKOFF_S:
            with self._lock:
                log.warning("kv redis tier %s: reachable again", self.log_url)
                self._backoff_s = MIN_BACKOFF_S

    def close(self) -> None:
        with contextlib.suppress(redis.RedisError, OSError):
            self._client.close()


def redact_url(url: str) -> str:
    """`url` with its password, in the userinfo or a `password=` query argument, replaced by ***."""
    parts = urlsplit(url)
    userinfo, at, host = parts.netloc.rpartition("@")
    if ":" in userinfo:
        userinfo = userinfo.partition(":")[0] + ":***"
    query = "&".join(map(_redact_argument, parts.query.split("&"))) if parts.query else ""
    return urlunsplit(parts._replace(netloc=userinfo + at + host, query=query))


def _redact_argument(argument: str) -> str:
    name, _, value = argument.partition("=")
    return f"{name}=***" if name == "password" and value else argument


def _leading_values(values: list[Any]) -> list[bytes]:
    leading: list[bytes] = []
    for value in values:
        if value is None:
            break
        leading.append(bytes(value))
    return leading
