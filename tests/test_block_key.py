"""Block keys (content addresses of KV blocks) and the KV event log."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvyard.engine.sampling.params import SamplingParams
from kvyard.engine.scheduling.request import Request
from kvyard.kvcache import block_key as block_key_module
from kvyard.kvcache.block_key import KEY_BYTES, KeyNamespace, block_key, chain_block_keys
from kvyard.kvcache.events import KVEventLog

NAMESPACE = KeyNamespace(model_name="tiny", model_digest="abc123", dtype="float32", block_size=4)
TOKENS = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7]  # 3 full blocks of 4 + 2 tokens

# Loads block_key.py by path so the child does not pay for importing torch via kvyard/__init__.py.
_SUBPROCESS_SCRIPT = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("child_block_key", sys.argv[3])
module = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = module
spec.loader.exec_module(module)
KeyNamespace, block_key, chain_block_keys = module.KeyNamespace, module.block_key, module.chain_block_keys
ns = KeyNamespace(**json.loads(sys.argv[1]))
tokens = json.loads(sys.argv[2])
root = ns.root_key()
print(json.dumps({
    "root": root.hex(),
    "salted": ns.with_salt("tenant").root_key().hex(),
    "chain": [k.hex() for k in chain_block_keys(root, tokens, ns.block_size)],
    "single": block_key(root, tokens[:3], b"extra").hex(),
}))
"""


def test_keys_are_deterministic_across_processes() -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            _SUBPROCESS_SCRIPT,
            json.dumps(dataclasses.asdict(NAMESPACE)),
            json.dumps(TOKENS),
            block_key_module.__file__,
        ],
        capture_output=True,
        text=True,
        check=True,
        # A different hash seed would expose any use of Python's randomised hash().
        env={"PYTHONHASHSEED": "12345", "PATH": ""},
        timeout=60,
    )
    theirs = json.loads(result.stdout)
    root = NAMESPACE.root_key()
    assert theirs["root"] == root.hex()
    assert theirs["salted"] == NAMESPACE.with_salt("tenant").root_key().hex()
    assert theirs["chain"] == [k.hex() for k in chain_block_keys(root, TOKENS, 4)]
    assert theirs["single"] == block_key(root, TOKENS[:3], b"extra").hex()


def test_key_sizes_and_purity() -> None:
    root = NAMESPACE.root_key()
    assert len(root) == KEY_BYTES
    assert root == KeyNamespace("tiny", "abc123", "float32", 4).root_key()
    keys = chain_block_keys(root, TOKENS, 4)
    assert all(len(k) == KEY_BYTES for k in keys)
    assert keys == chain_block_keys(root, list(TOKENS), 4)
    assert keys == chain_block_keys(root, tuple(TOKENS), 4)
    assert len(set(keys)) == len(keys)


@pytest.mark.parametrize(
    "changes",
    [
        {"model_name": "other"},
        {"model_digest": "abc124"},
        {"dtype": "bfloat16"},
        {"block_size": 8},
        {"layout_version": NAMESPACE.layout_version + 1},
        {"cache_salt": "tenant-a"},
    ],
)
def test_every_namespace_field_changes_root_and_block_keys(changes: dict[str, Any]) -> None:
    other = dataclasses.replace(NAMESPACE, **changes)
    assert other.root_key() != NAMESPACE.root_key()
    tokens = TOKENS[:8]
    # Same tokens, same block size for the chain: only the namespace differs.
    mine = chain_block_keys(NAMESPACE.root_key(), tokens, 4)
    theirs = chain_block_keys(other.root_key(), tokens, 4)
    assert len(mine) == len(theirs) == 2
    assert not set(mine) & set(theirs)


def test_cache_salt_isolates_tenants() -> None:
    assert NAMESPACE.with_salt(None) == NAMESPACE
    assert NAMESPACE.with_salt("") == NAMESPACE
    a, b = NAMESPACE.with_salt("a"), NAMESPACE.with_salt("b")
    assert a.root_key() != b.root_key() != NAMESPACE.root_key()
    assert a.root_key() == NAMESPACE.with_salt("a").root_key()
    assert dataclasses.replace(a, cache_salt="") == NAMESPACE  # with_salt keeps every other field
    salted_twice = a.with_salt("b")
    assert salted_twice == b


def test_chain_property_block_key_depends_on_all_earlier_tokens() -> None:
    root = NAMESPACE.root_key()
    base = chain_block_keys(root, TOKENS, 4)
    changed_first = list(TOKENS)
    changed_first[0] += 1
    keys = chain_block_keys(root, changed_first, 4)
    assert all(k != b for k, b in zip(keys, base))  # block 2 and 3 change although their tokens didn't
    changed_second = list(TOKENS)
    changed_second[5] += 1
    keys = chain_block_keys(root, changed_second, 4)
    assert keys[0] == base[0] and keys[1] != base[1] and keys[2] != base[2]
    # Chaining is exactly key_i = block_key(key_{i-1}, block_i).
    assert base[1] == block_key(base[0], TOKENS[4:8])
    assert base == [
        block_key(root, TOKENS[0:4]),
        block_key(block_key(root, TOKENS[0:4]), TOKENS[4:8]),
        block_key(block_key(block_key(root, TOKENS[0:4]), TOKENS[4:8]), TOKENS[8:12]),
    ]


def test_block_key_distinguishes_length_extra_and_large_ids() -> None:
    root = NAMESPACE.root_key()
    assert block_key(root, [1, 2]) != block_key(root, [1, 2, 0])
    assert block_key(root, [1, 2]) != block_key(root, [1, 2], b"x")
    assert block_key(root, [2**32 - 1]) != block_key(root, [2**32 - 2])
    assert block_key(root, [256]) != block_key(root, [1, 0])


def test_partial_last_block_gets_no_key() -> None:
    root = NAMESPACE.root_key()
    assert chain_block_keys(root, TOKENS[:3], 4) == []
    assert len(chain_block_keys(root, TOKENS[:4], 4)) == 1
    assert len(chain_block_keys(root, TOKENS[:7], 4)) == 1
    assert chain_block_keys(root, TOKENS, 4) == chain_block_keys(root, TOKENS[:12], 4)
    assert chain_block_keys(root, [], 4) == []


@settings(max_examples=50, deadline=None)
@given(
    prompt=st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=20),
    outputs=st.lists(st.integers(0, 2**32 - 1), max_size=20),
    block_size=st.integers(1, 6),
)
def test_request_block_keys_track_full_blocks_as_tokens_arrive(
    prompt: list[int], outputs: list[int], block_size: int
) -> None:
    root = b"r" * 16
    request = Request("x", prompt, SamplingParams(), cache_root_key=root, block_size=block_size)
    assert request.block_keys == chain_block_keys(root, prompt, block_size)
    for token in outputs:
        request.append_token(token)
        assert len(request.block_keys) == request.num_tokens // block_size
        assert request.block_keys == chain_block_keys(root, request.all_token_ids, block_size)


# ------------------------------------------------------------------------------------- events


def test_event_log_sequence_numbers_are_gap_free() -> None:
    log = KVEventLog(capacity=100)
    assert log.last_seq == 0
    assert log.events_since(0) == ([], True)
    log.record("stored", [b"a"])
    log.record("stored", [])  # nothing to say: no event, no sequence number
    log.record("removed", [b"a", b"b"])
    events, complete = log.events_since(0)
    assert complete
    assert [(e.seq, e.kind, e.block_keys) for e in events] == [(1, "stored", (b"a",)), (2, "removed", (b"a", b"b"))]
    assert log.last_seq == 2
    assert log.events_since(1)[0] == events[1:]
    assert log.events_since(2) == ([], True)
    assert log.events_since(3) == ([], False)  # a reader ahead of the log knows another one (a restart): resync


def test_event_log_reports_gaps_when_a_reader_falls_behind() -> None:
    log = KVEventLog(capacity=4)
    for index in range(10):
        log.record("stored", [bytes([index])])
    assert log.last_seq == 10
    # Retained: seqs 7..10. A reader that saw up to 6 lost nothing; one that saw 5 lost seq 6.
    events, complete = log.events_since(6)
    assert complete and [e.seq for e in events] == [7, 8, 9, 10]
    for seen in (0, 3, 5):
        events, complete = log.events_since(seen)
        assert not complete, seen
        assert [e.seq for e in events] == [7, 8, 9, 10]
    events, complete = log.events_since(8)
    assert complete and [e.seq for e in events] == [9, 10]
    assert log.events_since(10) == ([], True)


def test_event_log_with_no_retained_events_still_detects_gaps() -> None:
    log = KVEventLog(capacity=0)
    log.record("stored", [b"a"])
    assert log.last_seq == 1
    events, complete = log.events_since(0)
    assert events == [] and not complete
    assert log.events_since(1) == ([], True)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), max_size=70), st.integers(1, 9))
def test_chained_keys_equal_block_by_block_keys(tokens: list[int], block_size: int) -> None:
    parent = NAMESPACE.root_key()
    expected = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = block_key(parent, tokens[start : start + block_size])
        expected.append(parent)
    assert chain_block_keys(NAMESPACE.root_key(), tokens, block_size) == expected
