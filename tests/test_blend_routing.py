"""The router scores moved text (kvyard.router.segment_holds) for requests that blend: real kvyard replicas of the
demo model announce their blocks' segment fingerprints in their KV events, and a rewritten prompt goes where its
moved text is rather than where a slightly longer prefix is; asked not to blend, it goes to the longer prefix."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from router_utils import replica_state, start_router, wait_for
from server_utils import start_server
from tokenizers import Tokenizer

from kvyard.api.kv_events import BlendAdvert, event_json, parse_event_line, parse_snapshot, snapshot_json
from kvyard.kvcache.block_key import KeyNamespace
from kvyard.kvcache.events import KVEvent
from kvyard.kvcache.segment_key import prompt_fingerprints, segment_fingerprint
from kvyard.router.segment_holds import PromptWindows, SegmentHolds
from kvyard.testing.model_presets import DEMO_MODEL_DIR
from kvyard.testing.tokenizer_build import corpus_texts

BLOCK = 16
ROOT = b"0123456789abcdef"


def test_segments_travel_in_events_and_snapshots() -> None:
    event = KVEvent(7, "stored", (b"k" * 16, b"m" * 16), 1.0, "device", None, (5, 2**64 - 1))
    parsed = parse_event_line(b"data: " + httpx.Response(200, json=event_json(event)).content)
    assert parsed is not None and parsed.segments == [5, 2**64 - 1]
    namespace = KeyNamespace("m", "digest", "float32", BLOCK)
    body = snapshot_json(3, [b"k" * 16], namespace, segments={b"k" * 16: 9}, blend=BlendAdvert("off", 0.1, 0.5))
    snapshot = parse_snapshot(body)
    assert snapshot.segments == {b"k" * 16: 9} and snapshot.blend == BlendAdvert("off", 0.1, 0.5)
    assert parse_snapshot(snapshot_json(3, [], namespace)).blend is None


def test_moved_text_is_counted_after_the_prefix_and_forgotten_with_its_block() -> None:
    old = list(range(100, 260))  # ten blocks, cached at positions 0..159
    holds = SegmentHolds()
    keys = [bytes([n]) * 16 for n in range(10)]
    holds.stored(keys, [segment_fingerprint(old[n * BLOCK : (n + 1) * BLOCK], ROOT) for n in range(10)])
    prompt = old[:32] + [7] * 21 + old[64:]  # blocks 4..9 moved by -11 tokens
    windows = PromptWindows.of(prompt_fingerprints(prompt, ROOT, BLOCK), BLOCK)
    assert holds.matched_tokens(windows, 32) == 6 * BLOCK
    assert holds.matched_tokens(windows, 0) == 8 * BLOCK  # the first two blocks, unmoved, count too
    other_tenant = PromptWindows.of(prompt_fingerprints(prompt, b"another-tenant!!", BLOCK), BLOCK)
    assert holds.matched_tokens(other_tenant, 32) == 0
    holds.removed(keys[4:6])
    assert holds.matched_tokens(windows, 32) == 4 * BLOCK


@pytest.fixture(scope="module")
def text_tokens() -> list[int]:
    tokenizer = Tokenizer.from_file(str(DEMO_MODEL_DIR / "tokenizer.json"))
    return tokenizer.encode("".join(corpus_texts(20_000))).ids[:1_400]


def test_a_rewritten_prompt_is_routed_to_its_moved_text(text_tokens: list[int], tmp_path: Path) -> None:
    history = text_tokens[:1_000]
    summary = text_tokens[1_100:1_190]
    prompt = history[:200] + summary + history[640:] + text_tokens[1_190:1_200]
    options = ("--non-prefix-reuse", "blend", "--max-model-len", "2048")
    servers = [start_server(DEMO_MODEL_DIR, tmp_path, *options) for _ in range(2)]
    router = None
    try:
        holder, other = servers
        _complete(holder.url, {"prompt": history})  # the served history: the moved text is here
        _complete(other.url, {"prompt": history[:200] + summary + text_tokens[1_200:1_300]})  # a longer prefix
        router = start_router(tmp_path, [server.url for server in servers])
        wait_for(lambda: replica_state(router, holder.url)["segment_blocks"] >= 60, 30, "the holder's segments")
        wait_for(lambda: replica_state(router, other.url)["segment_blocks"] >= 20, 30, "the other's segments")
        blended = httpx.post(f"{router.url}/v1/completions", json={"prompt": prompt, "max_tokens": 2}, timeout=60)
        assert blended.status_code == 200, blended.text
        assert blended.headers["x-kvyard-replica"] == holder.url
        assert blended.json()["usage"]["prompt_tokens_details"]["blended_tokens"] >= 320
        body = {"prompt": prompt, "max_tokens": 2, "non_prefix_reuse": "off"}
        exact = httpx.post(f"{router.url}/v1/completions", json=body, timeout=60)
        assert exact.status_code == 200, exact.text
        assert exact.headers["x-kvyard-replica"] == other.url
    finally:
        for process in [*servers, *([router] if router is not None else [])]:
            process.stop()


def _complete(url: str, body: dict[str, Any]) -> dict[str, Any]:
    response = httpx.post(f"{url}/v1/completions", json={**body, "max_tokens": 2, "temperature": 0}, timeout=60)
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result
