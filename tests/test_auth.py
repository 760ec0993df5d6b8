"""API keys, the admin plane and per-key caches, on real servers on loopback (docs/contracts.md §8)."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvyard.api.auth import AccessConfig, tenant_salt
from kvyard.kvcache import KVTierConfig
from kvyard.router.config import RouterConfig
from kvyard.sim.config import SimConfig
from kvyard.testing.sim_cluster import TEST_ADMIN_KEY, SimCluster, sim_server_options
from tests.router_utils import start_router, wait_for
from tests.server_utils import ADMIN

MODEL = "sim-model"
CONFIG = SimConfig(model_name=MODEL, block_size=4, num_kv_blocks=256, time_scale=0.01)
KEY_X, KEY_Y = "sk-tenant-x", "sk-tenant-y"


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def complete(url: str, key: str | None, **body: Any) -> httpx.Response:
    headers = bearer(key) if key else None
    return httpx.post(
        f"{url}/v1/completions", json={"model": MODEL, "max_tokens": 2, **body}, headers=headers, timeout=30
    )


@pytest.fixture(scope="module")
def keyed() -> Iterator[SimCluster]:
    options = sim_server_options(api_keys=[KEY_X, KEY_Y], cache_salt_per_api_key=True)
    with SimCluster([CONFIG], options) as sim:
        yield sim


def test_a_replica_with_keys_refuses_callers_without_one(keyed: SimCluster) -> None:
    url = keyed.urls[0]
    for headers, code in ((None, "missing_api_key"), (bearer("sk-wrong"), "invalid_api_key")):
        response = httpx.post(f"{url}/v1/completions", json={"prompt": [1, 2]}, headers=headers)
        assert response.status_code == 401
        assert response.json()["error"] == {
            "message": response.json()["error"]["message"],
            "code": code,
            "type": "authentication_error",
            "param": None,
        }
        assert httpx.post(f"{url}/tokenize", json={"prompt": "x"}, headers=headers).status_code == 401
    assert complete(url, KEY_X, prompt=[1, 2]).status_code == 200
    assert httpx.get(f"{url}/health").status_code == 200  # health and metrics stay open to probes
    assert httpx.get(f"{url}/metrics").status_code == 200


def test_the_admin_plane_needs_the_admin_key_and_not_an_api_key(keyed: SimCluster) -> None:
    url = keyed.urls[0]
    for path in ("/kv/snapshot", "/kv/events?stream=false"):
        assert httpx.get(f"{url}{path}").status_code == 401
        assert httpx.get(f"{url}{path}", headers=bearer(KEY_X)).status_code == 401
        assert httpx.get(f"{url}{path}", headers=ADMIN).status_code == 200
    assert httpx.post(f"{url}/sim/health", json={"healthy": False}, headers=bearer(KEY_X)).status_code == 401
    assert httpx.get(f"{url}/health").status_code == 200


def test_without_an_admin_key_the_admin_plane_is_off() -> None:
    with SimCluster([CONFIG], sim_server_options(admin_key=None)) as sim:
        url = sim.urls[0]
        for path in ("/kv/snapshot", "/kv/events"):
            response = httpx.get(f"{url}{path}", headers=ADMIN)
            assert response.status_code == 403 and response.json()["error"]["code"] == "admin_disabled"
        assert httpx.post(f"{url}/sim/restart", headers=ADMIN).status_code == 403
        assert complete(url, None, prompt=[1, 2]).status_code == 200  # no API keys: the API is open


def test_a_tenant_salt_splits_caches_and_cannot_be_overridden(keyed: SimCluster) -> None:
    url = keyed.urls[0]
    tokens = list(range(100, 140))
    assert (
        complete(url, KEY_X, prompt=tokens, cache_salt="shared").json()["usage"]["prompt_tokens_details"][
            "cached_tokens"
        ]
        == 0
    )

    def cached(key: str, salt: str | None) -> int:
        usage = complete(url, key, prompt=tokens, cache_salt=salt).json()["usage"]
        return int(usage["prompt_tokens_details"]["cached_tokens"])

    assert cached(KEY_X, "shared") == 36  # its own cache: all full blocks but the last token's
    assert cached(KEY_Y, "shared") == 0  # the same request salt does not reach another key's cache
    assert cached(KEY_X, None) == 0  # a request salt splits a key's cache further
    snapshot = httpx.get(f"{url}/kv/snapshot", headers=ADMIN).json()
    assert tenant_salt(KEY_X, "shared", per_key=True) != tenant_salt(KEY_Y, "shared", per_key=True)
    assert len(snapshot["block_keys"]) >= 3 * 10


def test_keys_file_is_read_again_on_sighup(tmp_path: Path) -> None:
    keys_file = tmp_path / "keys"
    keys_file.write_text("# one key per line\nsk-old\n")
    ports_file = tmp_path / "ports.json"
    command = [
        sys.executable,
        "-m",
        "kvyard",
        "sim",
        "--port",
        "0",
        "--ports-file",
        str(ports_file),
        "--api-keys-file",
        str(keys_file),
        "--model-name",
        MODEL,
    ]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_for(lambda: ports_file.exists() or process.poll() is not None, 60, "sim ports")
        url = json.loads(ports_file.read_text())["urls"][0]
        assert complete(url, "sk-old", prompt=[1, 2]).status_code == 200
        assert complete(url, "sk-new", prompt=[1, 2]).status_code == 401
        keys_file.write_text("sk-new\n")
        process.send_signal(signal.SIGHUP)
        wait_for(lambda: complete(url, "sk-new", prompt=[1, 2]).status_code == 200, 10, "new key accepted")
        assert complete(url, "sk-old", prompt=[1, 2]).status_code == 401
    finally:
        process.terminate()
        process.wait(timeout=30)


# ---------------------------------------------------------------------------- the router


class RecordingReplica(BaseHTTPRequestHandler):
    """An OpenAI-compatible upstream that answers every completion and records what it was sent."""

    seen: list[dict[str, str]] = []  # noqa: RUF012  # one list per test process is the point
    record_gets = False  # health checks and model lists too, not only completions

    def do_GET(self) -> None:
        if self.record_gets:
            type(self).seen.append({name.lower(): value for name, value in self.headers.items()})
        if self.path == "/v1/models":
            self._send(200, {"object": "list", "data": [{"id": MODEL, "object": "model"}]})
        elif self.path == "/health":
            self._send(200, {"status": "ok"})
        else:
            self._send(404, {"error": {"message": "not found"}})

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", 0)))
        type(self).seen.append({name.lower(): value for name, value in self.headers.items()})
        self._send(
            200,
            {
                "id": "cmpl-1",
                "object": "text_completion",
                "model": MODEL,
                "choices": [{"index": 0, "text": "upstream", "finish_reason": "length"}],
            },
        )

    def _send(self, status: int, payload: dict[str, Any]) -> None:
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        return


@pytest.fixture()
def recording_replica() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), RecordingReplica)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    RecordingReplica.seen.clear()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@contextlib.contextmanager
def stranger_upstream() -> Iterator[tuple[str, list[dict[str, str]]]]:
    """Another recording upstream, with headers of its own: (its URL, what it was sent)."""

    class Stranger(RecordingReplica):
        seen: list[dict[str, str]] = []  # noqa: RUF012
        record_gets = True

    server = ThreadingHTTPServer(("127.0.0.1", 0), Stranger)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", Stranger.seen
    finally:
        server.shutdown()


def test_the_routers_replica_keys_reach_only_the_replicas_it_was_started_with(
    tmp_path: Path, recording_replica: str
) -> None:
    """An upstream added through the admin API gets the keys given with it, never the router's configured ones
    (an admin key in the wrong hands must not collect the fleet's replica credentials)."""
    router = start_router(
        tmp_path,
        [recording_replica],
        "--policy",
        "round_robin",
        "--replica-api-key",
        "sk-fleet",
        replicas_publish_events=False,
    )
    try:
        with stranger_upstream() as (bare, bare_seen), stranger_upstream() as (keyed_url, keyed_seen):
            for url, keys in ((bare, {}), (keyed_url, {"api_key": "sk-own", "admin_key": "sk-own-admin"})):
                added = httpx.post(f"{router.url}/admin/replicas", json={"url": url, **keys}, headers=ADMIN)
                assert added.status_code == 200
            wait_for(lambda: bool(bare_seen and keyed_seen), 20, "both added upstreams checked")
            for _ in range(6):
                assert complete(router.url, None, prompt=[1, 2]).status_code == 200
            assert any(h.get("content-type") == "application/json" for h in bare_seen)  # completions reached it
            everything = [value for headers in bare_seen + keyed_seen for value in headers.values()]
            assert not any("sk-fleet" in value or TEST_ADMIN_KEY in value for value in everything)
            assert not any("authorization" in headers for headers in bare_seen)
            keyed = [headers["authorization"] for headers in keyed_seen if "authorization" in headers]
            assert keyed and set(keyed) == {"Bearer sk-own"}  # /health goes without a key
            assert RecordingReplica.seen and all(
                h.get("authorization") == "Bearer sk-fleet" for h in RecordingReplica.seen
            )
            refused = httpx.post(f"{router.url}/admin/replicas", json={"url": bare, "api_key": 5}, headers=ADMIN)
            assert refused.status_code == 400 and refused.json()["error"]["param"] == "api_key"
    finally:
        router.stop()


def test_the_router_hijack_fails_at_every_step_without_the_admin_key(keyed: SimCluster, tmp_path: Path) -> None:
    """Replays the attack: add a rogue upstream, drain the real ones, remove them: each step is refused."""
    router = start_router(tmp_path, keyed.urls, "--api-key", KEY_X, "--replica-api-key", KEY_Y)
    try:
        steps = [
            ("POST", "/admin/replicas", {"json": {"url": "http://127.0.0.1:9"}}),
            ("POST", "/admin/replicas/drain", {"json": {"url": keyed.urls[0]}}),
            ("DELETE", "/admin/replicas", {"params": {"url": keyed.urls[0]}}),
            ("GET", "/admin/replicas", {}),
        ]
        for method, path, options in steps:
            for headers in (None, bearer(KEY_X), bearer("sk-guess")):
                response = httpx.request(method, f"{router.url}{path}", headers=headers, timeout=10, **options)
                assert response.status_code == 401, (method, path, headers, response.text)
        listed = httpx.get(f"{router.url}/admin/replicas", headers=ADMIN, timeout=10).json()["replicas"]
        assert [r["url"] for r in listed] == keyed.urls and listed[0]["state"] == "healthy"
        assert complete(router.url, None, prompt=[1, 2]).status_code == 401
        assert complete(router.url, KEY_X, prompt=[1, 2]).status_code == 200
    finally:
        router.stop()


def test_a_router_without_an_admin_key_has_no_admin_plane(tmp_path: Path, recording_replica: str) -> None:
    router = start_router(tmp_path, [recording_replica], "--admin-key", "", "--policy", "round_robin")
    try:
        response = httpx.post(f"{router.url}/admin/replicas", json={"url": "http://127.0.0.1:9"}, headers=ADMIN)
        assert response.status_code == 403 and response.json()["error"]["code"] == "admin_disabled"
        said = router.log()  # the router says where it listens and what is open
        assert f"listening on http://127.0.0.1:{router.port}" in said and "admin plane off" in said
    finally:
        router.stop()


def test_a_clients_key_never_reaches_an_upstream(tmp_path: Path, recording_replica: str) -> None:
    router = start_router(
        tmp_path,
        [recording_replica],
        "--policy",
        "round_robin",
        "--api-key",
        "sk-victim",
        "--replica-api-key",
        "sk-router",
        replicas_publish_events=False,
    )
    try:
        response = complete(router.url, "sk-victim", prompt="a secret prompt")
        assert response.status_code == 200 and response.json()["choices"][0]["text"] == "upstream"
        seen = RecordingReplica.seen
        assert seen and all(headers.get("authorization") == "Bearer sk-router" for headers in seen)
        assert not any("sk-victim" in value for headers in seen for value in headers.values())
    finally:
        router.stop()


def test_router_and_replica_agree_on_tenant_salts(keyed: SimCluster, tmp_path: Path) -> None:
    """The router splits caches by its clients' keys; its predicted hits equal what the replica reports."""
    options = sim_server_options(admin_key=TEST_ADMIN_KEY)
    with SimCluster([CONFIG], options) as sim:
        router = start_router(tmp_path, sim.urls, "--api-key", KEY_X, "--api-key", KEY_Y, "--cache-salt-per-api-key")
        try:
            tokens = list(range(300, 340))
            for key, salt, expected in ((KEY_X, "s", 0), (KEY_X, "s", 36), (KEY_Y, "s", 0), (KEY_Y, "s", 36)):
                usage = complete(router.url, key, prompt=tokens, cache_salt=salt).json()["usage"]
                assert usage["prompt_tokens_details"]["cached_tokens"] == expected
            metrics = httpx.get(f"{router.url}/metrics", timeout=10).text
            predicted = _metric_sum(metrics, "kvyard_router_predicted_cached_tokens_total")
            reported = _metric_sum(metrics, "kvyard_router_reported_cached_tokens_total")
            assert predicted == reported == 72
            for depth in (300, 1000):  # orjson reads 1,024 levels but writes 254: the salted body is re-written
                nested = b'{"prompt": [1, 2], "max_tokens": 1, "x": ' + b"[" * depth + b"]" * depth + b"}"
                deep = httpx.post(
                    f"{router.url}/v1/completions",
                    content=nested,
                    timeout=10,
                    headers={"Authorization": f"Bearer {KEY_X}", "Content-Type": "application/json"},
                )
                assert deep.status_code == 400 and deep.json()["error"]["param"] == "body", deep.text
            assert complete(router.url, KEY_X, prompt=tokens, cache_salt="s").status_code == 200
        finally:
            router.stop()


def _metric_sum(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def test_keys_and_passwords_stay_out_of_reprs() -> None:
    shown = repr(
        (
            AccessConfig(api_keys=["sk-one"], admin_key="sk-admin"),
            KVTierConfig(redis_url="rediss://:hunter2@127.0.0.1:6380/0"),
            RouterConfig(replica_api_key="sk-up", replica_admin_key="sk-up-admin"),
        )
    )
    assert not any(secret in shown for secret in ("sk-one", "sk-admin", "hunter2", "sk-up"))
