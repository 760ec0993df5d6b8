"""Keeps one replica's exact cache index current from its KV-event stream (docs/contracts.md §3).

Start: load `/kv/snapshot`, then follow `/kv/events?since=<its seq>`. Whenever continuity is lost (a `gap`
event, a sequence number that skips, a broken stream, a replica that restarted) the index is reloaded from
a fresh snapshot, which replaces every entry, so nothing stale survives. A replica answering 404 publishes
no events: its index stays the approximate one learned from routing.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

import orjson

from kvyard.api.auth import bearer_token
from kvyard.api.kv_events import GapError, WireEvent, parse_event_line, parse_snapshot
from kvyard.net.http_client import HttpError
from kvyard.router.replica import Replica
from kvyard.router.tier_index import SharedStores

_LOG = logging.getLogger(__name__)
RETRY_DELAY_S = 0.25
SNAPSHOT_TIMEOUT_S = 30.0


class _Resync(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(slots=True)
class KVSync:
    replica: Replica
    on_resync: Callable[[Replica, str], None]
    shared_stores: SharedStores

    async def run(self) -> None:
        reason = "start"
        while True:
            try:
                if not await self._load_snapshot(reason):
                    return
                await self._follow()
                reason = "reconnect"
            except _Resync as resync:
                reason = resync.reason
            except GapError:
                reason = "gap"
            except (HttpError, TimeoutError, ValueError, KeyError) as error:
                _LOG.debug("kv events of %s: %s", self.replica.url, error)
                self.replica.index.clear()  # it may be restarting: what we knew may be gone
                reason = "reconnect"
                await asyncio.sleep(RETRY_DELAY_S)

    async def _load_snapshot(self, reason: str) -> bool:
        index = self.replica.index
        headers = self.replica.admin_headers
        response = await self.replica.http.request("GET", "/kv/snapshot", timeout=SNAPSHOT_TIMEOUT_S, headers=headers)
        if response.status in (401, 403, 404):  # no events, or not for us: learn from routed prompts instead
            if response.status != 404:
                _LOG.warning(
                    "KV events of %s refused (%d): give the router --replica-admin-key",
                    self.replica.url,
                    response.status,
                )
            index.forget_events()
            return False
        if response.status != 200:
            raise HttpError(f"GET /kv/snapshot: HTTP {response.status}")
        snapshot = parse_snapshot(orjson.loads(response.body))
        previous_seq = index.seq
        index.reset(snapshot.block_keys, snapshot.seq, snapshot.local_keys, snapshot.segments)
        self.replica.namespace = snapshot.namespace
        self.replica.blend = snapshot.blend
        self.replica.shared_store_id = snapshot.shared_store_id
        headers = {name.lower(): value for name, value in self.replica.api_headers.items()}
        self.replica.salt_key = bearer_token(headers) if snapshot.salted_by_api_key else None
        if snapshot.shared_store_id is not None:
            self.shared_stores.joined(snapshot.shared_store_id, snapshot.shared_ttl_s)
        if reason == "reconnect" and index.seq < previous_seq:
            reason = "restart"
        self.on_resync(self.replica, reason)
        return True

    async def _follow(self) -> None:
        """Apply the replica's event stream, line by line, until it ends (a restart closes it) or breaks."""
        chunks: asyncio.Queue[bytes | None] = asyncio.Queue()
        path, headers = f"/kv/events?since={self.replica.index.seq}", self.replica.admin_headers
        request = self.replica.http.request("GET", path, sink=lambda data, _: chunks.put_nowait(data), headers=headers)
        stream = asyncio.create_task(request)
        stream.add_done_callback(lambda _: chunks.put_nowait(None))
        try:
            pending = b""
            while (chunk := await chunks.get()) is not None:
                *lines, pending = (pending + chunk).split(b"\n")
                for line in lines:
                    self._apply_line(line)
            response = await stream
            if response.status != 200:
                raise HttpError(f"GET /kv/events: HTTP {response.status}")
        finally:
            if not stream.done():
                stream.cancel()  # a resync leaves the stream: closing its connection tells the replica
            elif not stream.cancelled():
                stream.exception()  # retrieved: a broken stream is handled by the caller's retry, not logged

    def _apply_line(self, line: bytes) -> None:
        index = self.replica.index
        event = parse_event_line(line)
        if event is None:
            return
        if event.seq != index.seq + 1:
            raise _Resync("gap" if event.seq > index.seq + 1 else "restart")
        if event.medium == "shared":
            self._apply_shared(event)
        keys = event.block_keys if event.medium != "shared" else []
        index.apply(event.seq, event.kind, keys, event.medium, event.segments)

    def _apply_shared(self, event: WireEvent) -> None:
        replica, stores = self.replica, self.shared_stores
        if event.kind == "cleared":
            assert event.store is not None
            stores.cleared(replica.shared_store_id, event.store)
            replica.shared_store_id = event.store
            return
        stores.record(replica.shared_store_id, event.kind, event.block_keys)
