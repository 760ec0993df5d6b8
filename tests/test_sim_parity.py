"""A simulated replica publishes the same block keys as a real kvyard replica for the same token ids."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvyard.kvcache.block_key import KeyNamespace, chain_block_keys
from kvyard.models.loader import model_digest
from kvyard.sim.replica import SimConfig
from kvyard.sim.serve import SimCluster
from tests.server_utils import ServerProcess, start_server

PROMPTS = [[(i * 37 + 11) % 500 + 3 for i in range(45)], [(i * 53 + 7) % 500 + 3 for i in range(33)]]


@pytest.fixture(scope="module")
def real_server(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = start_server(llama_dir, tmp_path_factory.mktemp("parity"), "--block-size", "16")
    yield server
    server.stop()


def stored_keys(url: str) -> list[str]:
    page: dict[str, Any] = httpx.get(f"{url}/kv/events", params={"since": 0, "stream": False}).json()
    return [key for event in page["events"] if event["type"] == "stored" for key in event["block_keys"]]


def test_sim_block_keys_equal_a_real_replicas(real_server: ServerProcess, llama_dir: Path) -> None:
    config = SimConfig(model_name=llama_dir.name, model_digest=model_digest(llama_dir), dtype="float32",
                       block_size=16, time_scale=0.01)  # fmt: skip
    with SimCluster([config]) as sim:
        for tokens in PROMPTS:
            for url in (real_server.url, sim.urls[0]):
                body = {"prompt": tokens, "max_tokens": 1, "cache_salt": "tenant-7"}
                assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
        real, simulated = stored_keys(real_server.url), stored_keys(sim.urls[0])
        real_snapshot = httpx.get(f"{real_server.url}/kv/snapshot").json()
        sim_snapshot = httpx.get(f"{sim.urls[0]}/kv/snapshot").json()
    assert simulated == real and len(real) == 2 + 2
    assert sim_snapshot["namespace"] == real_snapshot["namespace"]
    root = KeyNamespace(**real_snapshot["namespace"]).with_salt("tenant-7").root_key()
    expected = [key.hex() for tokens in PROMPTS for key in chain_block_keys(root, tokens, 16)]
    assert real == expected
