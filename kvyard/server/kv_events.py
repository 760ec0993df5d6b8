"""KV-event stream and cache snapshot (DESIGN.md, contract 3).

`GET /kv/events?since=N` streams `stored` / `removed` events with sequence numbers > N as server-sent
events (`stream=false` answers one JSON page instead). If events after N are no longer retained, the
stream sends one `gap` event and ends: the consumer then loads `GET /kv/snapshot` (the cached block
keys and the sequence number they are current at) and resumes from that number.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from kvyard.api.errors import APIError
from kvyard.engine.core import KVSnapshot
from kvyard.kvcache.events import KVEventLog, event_json
from kvyard.server.async_engine import AsyncEngine

POLL_INTERVAL_S = 0.02


def kv_event_routes(app: FastAPI, ready_engine: Callable[[], AsyncEngine], shutting_down: Callable[[], bool]) -> None:
    def event_log() -> KVEventLog:
        log = ready_engine().engine.kv_event_log()
        if log is None:
            raise APIError(404, "this replica does not record KV events", code="kv_events_disabled")
        return log

    @app.get("/kv/events", response_model=None)
    async def kv_events(request: Request, since: int = 0, stream: bool = True) -> Any:
        log = event_log()
        if not stream:
            events, complete = log.events_since(since)
            return {"events": [event_json(e) for e in events], "complete": complete, "last_seq": log.last_seq}
        return StreamingResponse(_event_stream(request, log, since, shutting_down), media_type="text/event-stream")

    @app.get("/kv/snapshot")
    async def kv_snapshot() -> dict[str, Any]:
        engine = ready_engine()
        event_log()
        snapshot: KVSnapshot = await engine.call(lambda core: core.kv_snapshot())
        namespace = asdict(snapshot.namespace)
        namespace.pop("cache_salt")
        return {"seq": snapshot.seq, "block_keys": [k.hex() for k in snapshot.block_keys], "namespace": namespace}


async def _event_stream(
    request: Request, log: KVEventLog, since: int, shutting_down: Callable[[], bool]
) -> AsyncIterator[str]:
    seq = since
    while not shutting_down() and not await request.is_disconnected():
        events, complete = log.events_since(seq)
        if not complete:
            payload = {"since": seq, "first_available": events[0].seq if events else log.last_seq + 1}
            yield f"event: gap\ndata: {json.dumps(payload)}\n\n"
            return
        for event in events:
            yield f"data: {json.dumps(event_json(event), separators=(',', ':'))}\n\n"
            seq = event.seq
        if not events:
            await asyncio.sleep(POLL_INTERVAL_S)
