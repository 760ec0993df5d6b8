"""Keeps one replica's exact cache index current from its KV-event stream (docs/contracts.md §3).

Start: load `/kv/snapshot`, then follow `/kv/events?since=<its seq>`. Whenever continuity is lost (a `gap`
event, a sequence number that skips, a broken stream, a replica that restarted) the index is reloaded from
a fresh snapshot, which replaces every entry, so nothing stale survives. A replica answering 404 publishes
no events: its index stays the approximate one learned from routing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from kvyard.api.auth import bearer_token
from kvyard.api.kv_events import GapError, WireEvent, parse_event_line, parse_snapshot
from kvyard.router.replica import Replica
from kvyard.router.tier_index import SharedStores

_LOG = logging.getLogger(__name__)
RETRY_DELAY_S = 0.25


class _Resync(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(slots=True)
class KVSync:
    replica: Replica
    session: aiohttp.ClientSession
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
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError) as error:
                _LOG.debug("kv events of %s: %s", self.replica.url, error)
                self.replica.index.clear()  # it may be restarting: what we knew may be gone
                reason = "reconnect"
                await asyncio.sleep(RETRY_DELAY_S)

    async def _load_snapshot(self, reason: str) -> bool:
        index = self.replica.index
        timeout = aiohttp.ClientTimeout(total=30)
        headers = self.replica.admin_headers
        async with self.session.get(f"{self.replica.url}/kv/snapshot", timeout=timeout, headers=headers) as response:
            if response.status in (401, 403, 404):  # no events, or not for us: learn from routed prompts instead
                if response.status != 404:
                    _LOG.warning("KV events of %s refused (%d): give the router --replica-admin-key",
                                 self.replica.url, response.status)  # fmt: skip
                index.forget_events()
                return False
            response.raise_for_status()
            snapshot = parse_snapshot(await response.json())
        previous_seq = index.seq
        index.reset(snapshot.block_keys, snapshot.seq, snapshot.local_keys)
        self.replica.namespace = snapshot.namespace
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
        index = self.replica.index
        url = f"{self.replica.url}/kv/events"
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=5)
        params, headers = {"since": str(index.seq)}, self.replica.admin_headers
        async with self.session.get(url, params=params, timeout=timeout, headers=headers) as response:
            response.raise_for_status()
            async for line in response.content:
                event = parse_event_line(line)
                if event is None:
                    continue
                if event.seq != index.seq + 1:
                    raise _Resync("gap" if event.seq > index.seq + 1 else "restart")
                if event.medium == "shared":
                    self._apply_shared(event)
                index.apply(event.seq, event.kind, event.block_keys if event.medium != "shared" else (), event.medium)

    def _apply_shared(self, event: WireEvent) -> None:
        replica, stores = self.replica, self.shared_stores
        if event.kind == "cleared":
            assert event.store is not None
            stores.cleared(replica.shared_store_id, event.store)
            replica.shared_store_id = event.store
            return
        store = stores.get(replica.shared_store_id)
        if store is None:  # the replica wrote before it learned the store's id: nothing to file it under
            return
        if event.kind == "stored":
            store.stored(event.block_keys, time.monotonic())
        else:
            store.removed(event.block_keys)
