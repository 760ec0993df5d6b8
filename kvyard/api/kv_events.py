"""The KV-event wire format (DESIGN.md, contract 3), for the replicas that send it and the router that reads it.

`GET /kv/events?since=N` streams server-sent events, one `data: {"seq", "type", "block_keys", "timestamp"}`
per event (keys in hex) with sequence numbers > N; when events after N are no longer retained it sends one
`event: gap` and ends, and the reader reloads `GET /kv/snapshot` (`{"seq", "block_keys", "namespace"}`)
and resumes from its `seq`. `stream=false` answers one JSON page `{"events", "complete", "last_seq"}`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import orjson

from kvyard.kvcache.block_key import KeyNamespace
from kvyard.kvcache.events import EventKind, KVEvent, KVEventLog

POLL_INTERVAL_S = 0.02  # how often a stream looks for new events in the log


def event_json(event: KVEvent) -> dict[str, Any]:
    return {
        "seq": event.seq,
        "type": event.kind,
        "block_keys": [key.hex() for key in event.block_keys],
        "timestamp": event.timestamp,
    }


def events_page(log: KVEventLog, since: int) -> dict[str, Any]:
    events, complete = log.events_since(since)
    return {"events": [event_json(e) for e in events], "complete": complete, "last_seq": log.last_seq}


def sse_events(events: list[KVEvent]) -> bytes:
    return b"".join(b"data: " + orjson.dumps(event_json(event)) + b"\n\n" for event in events)


def sse_gap(log: KVEventLog, since: int, events: list[KVEvent]) -> bytes:
    """The event that ends a stream whose reader fell behind the retained window."""
    payload = {"since": since, "first_available": events[0].seq if events else log.last_seq + 1}
    return b"event: gap\ndata: " + orjson.dumps(payload) + b"\n\n"


def namespace_json(namespace: KeyNamespace) -> dict[str, Any]:
    """The namespace without the tenant's salt: a reader derives each tenant's root from it."""
    fields = asdict(namespace)
    fields.pop("cache_salt")
    return fields


def snapshot_json(seq: int, block_keys: list[bytes], namespace: KeyNamespace) -> dict[str, Any]:
    return {"seq": seq, "block_keys": [key.hex() for key in block_keys], "namespace": namespace_json(namespace)}


@dataclass(frozen=True, slots=True)
class WireEvent:
    """One event as a reader parses it off the stream."""

    seq: int
    kind: EventKind
    block_keys: list[bytes]


def parse_event_line(line: bytes) -> WireEvent | None:
    """One line of the stream: an event, None for anything else (blank, comments). Raises `GapError` on a gap."""
    line = line.strip()
    if line.startswith(b"event: gap"):
        raise GapError("the replica no longer holds the events after the reader's sequence number")
    if not line.startswith(b"data:"):
        return None
    event = orjson.loads(line[5:])
    kind = event["type"]
    if kind not in ("stored", "removed"):
        raise ValueError(f"unknown KV event type {kind!r}")
    return WireEvent(int(event["seq"]), kind, [bytes.fromhex(key) for key in event["block_keys"]])


def parse_snapshot(body: dict[str, Any]) -> tuple[int, list[bytes], KeyNamespace]:
    return int(body["seq"]), [bytes.fromhex(key) for key in body["block_keys"]], KeyNamespace(**body["namespace"])


class GapError(Exception):
    """The stream said `gap`: resynchronise from a snapshot."""
