"""The KV-event wire format (docs/contracts.md §3 and §7), for the replicas that send it and the router that
reads it.

`GET /kv/events?since=N` streams server-sent events, one `data: {"seq", "type", "medium", "block_keys",
"timestamp"}` per event (keys in hex; `medium` device, local or shared, see kvcache.events; a `cleared` event
carries `store` instead of keys) with sequence numbers > N; when events after N are no longer retained it sends
one `event: gap` and ends, and the reader reloads `GET /kv/snapshot` (`{"seq", "block_keys", "namespace",
"local_keys", "shared_store", "salted_by_api_key"}`; `shared_store` is `{"id", "ttl_s"}` or null, and
`salted_by_api_key` says the replica combines each caller's key salt with the request's cache_salt, so a router
keys blocks the same way) and resumes from its `seq`. A replica that blends moved text (kvyard.engine.blend) adds
`segments` to its device `stored` events (each block's segment fingerprint, kvcache.segment_key, in hex, one per
key) and to its snapshot (`"segments": {key: fingerprint}` and `"blend": {"default", "recompute_fraction",
"min_reused_fraction"}`).
`stream=false` answers one JSON page `{"events", "complete", "last_seq"}`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import orjson

from kvyard.kvcache.block_key import KeyNamespace
from kvyard.kvcache.events import MEDIA, EventKind, KVEvent, KVEventLog, Medium

POLL_INTERVAL_S = 0.02  # how often a stream looks for new events in the log


def event_json(event: KVEvent) -> dict[str, Any]:
    body: dict[str, Any] = {
        "seq": event.seq,
        "type": event.kind,
        "medium": event.medium,
        "block_keys": [key.hex() for key in event.block_keys],
        "timestamp": event.timestamp,
    }
    if event.store is not None:
        body["store"] = event.store
    if event.segments:
        body["segments"] = [f"{fingerprint:016x}" for fingerprint in event.segments]
    return body


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


def snapshot_json(
    seq: int,
    block_keys: list[bytes],
    namespace: KeyNamespace,
    local_keys: Sequence[bytes] = (),
    shared_store: tuple[str, float | None] | None = None,
    salted_by_api_key: bool = False,
    segments: dict[bytes, int] | None = None,
    blend: BlendAdvert | None = None,
) -> dict[str, Any]:
    body = {
        "seq": seq,
        "block_keys": [key.hex() for key in block_keys],
        "namespace": namespace_json(namespace),
        "local_keys": [key.hex() for key in local_keys],
        "shared_store": {"id": shared_store[0], "ttl_s": shared_store[1]} if shared_store is not None else None,
        "salted_by_api_key": salted_by_api_key,
    }
    if blend is not None:
        body["blend"] = {
            "default": blend.default,
            "recompute_fraction": blend.recompute_fraction,
            "min_reused_fraction": blend.min_reused_fraction,
        }
        body["segments"] = {key.hex(): f"{value:016x}" for key, value in (segments or {}).items()}
    return body


@dataclass(frozen=True, slots=True)
class BlendAdvert:
    """A replica that blends moved text (`--non-prefix-reuse`): whether requests do by default, and how much of
    the reused text it recomputes."""

    default: str
    recompute_fraction: float
    min_reused_fraction: float = 0.0  # it blends only when moved text is this share of what the prefix leaves


@dataclass(frozen=True, slots=True)
class WireEvent:
    """One event as a reader parses it off the stream."""

    seq: int
    kind: EventKind
    block_keys: list[bytes]
    medium: Medium = "device"
    store: str | None = None
    segments: list[int] | None = None  # device `stored`: each block's segment fingerprint


@dataclass(frozen=True, slots=True)
class WireSnapshot:
    seq: int
    block_keys: list[bytes]
    namespace: KeyNamespace
    local_keys: list[bytes]
    shared_store_id: str | None
    shared_ttl_s: float | None
    salted_by_api_key: bool = False
    segments: dict[bytes, int] | None = None  # block key -> segment fingerprint, from a replica that blends
    blend: BlendAdvert | None = None


def parse_event_line(line: bytes) -> WireEvent | None:
    """One line of the stream: an event, None for anything else (blank, comments). Raises `GapError` on a gap."""
    line = line.strip()
    if line.startswith(b"event: gap"):
        raise GapError("the replica no longer holds the events after the reader's sequence number")
    if not line.startswith(b"data:"):
        return None
    event = orjson.loads(line[5:])
    kind, medium = event["type"], event.get("medium", "device")
    if kind not in ("stored", "removed", "cleared"):
        raise ValueError(f"unknown KV event type {kind!r}")
    if medium not in MEDIA:
        raise ValueError(f"unknown KV event medium {medium!r}")
    store = event.get("store")
    if kind == "cleared" and not isinstance(store, str):
        raise ValueError("a cleared event without the store's id")
    keys = [bytes.fromhex(key) for key in event["block_keys"]]
    segments = [int(value, 16) for value in event["segments"]] if "segments" in event else None
    if segments is not None and len(segments) != len(keys):
        raise ValueError("a stored event with as many segment fingerprints as keys was expected")
    return WireEvent(int(event["seq"]), kind, keys, medium, store, segments)


def parse_snapshot(body: dict[str, Any]) -> WireSnapshot:
    shared = body.get("shared_store")
    blend = body.get("blend")
    return WireSnapshot(
        int(body["seq"]),
        [bytes.fromhex(key) for key in body["block_keys"]],
        KeyNamespace(**body["namespace"]),
        [bytes.fromhex(key) for key in body.get("local_keys", ())],
        str(shared["id"]) if shared else None,
        float(shared["ttl_s"]) if shared and shared.get("ttl_s") is not None else None,
        body.get("salted_by_api_key") is True,
        {bytes.fromhex(key): int(value, 16) for key, value in body.get("segments", {}).items()} if blend else None,
        _blend_advert(blend) if blend else None,
    )


def _blend_advert(blend: dict[str, Any]) -> BlendAdvert:
    minimum = float(blend.get("min_reused_fraction", 0.0))
    return BlendAdvert(str(blend["default"]), float(blend["recompute_fraction"]), minimum)


class GapError(Exception):
    """The stream said `gap`: resynchronise from a snapshot."""
