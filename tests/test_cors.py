"""Cross-origin calls from browsers: closed by default, open to the origins `--allowed-origins` names."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from threading import Thread

import httpx
import pytest

from kvyard.net.cors import CorsPolicy
from kvyard.net.http_server import HttpRequest, HttpServer, HttpServerConfig, Responder
from tests.router_utils import start_router

APP = "https://app.example.com"
PREFLIGHT = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization, content-type"}


@contextmanager
def serving(allowed_origins: str | None) -> Iterator[tuple[str, list[HttpRequest]]]:
    """A real HttpServer on loopback whose handler records what reaches it and answers 200."""
    seen: list[HttpRequest] = []
    loop = asyncio.new_event_loop()

    async def handle(request: HttpRequest, responder: Responder) -> None:
        seen.append(request)
        responder.send_json(200, {"ok": True}, {"X-Request-Id": "r-1"})

    server = HttpServer(handle, HttpServerConfig(allowed_origins=allowed_origins))
    loop.run_until_complete(server.start("127.0.0.1", 0))
    thread = Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.port}", seen
    finally:
        asyncio.run_coroutine_threadsafe(server.shutdown(1.0), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def test_without_allowed_origins_no_answer_carries_cors_headers() -> None:
    with serving(None) as (url, seen):
        answer = httpx.post(f"{url}/v1/completions", headers={"Origin": APP})
        preflight = httpx.options(f"{url}/v1/completions", headers={"Origin": APP, **PREFLIGHT})
    assert answer.status_code == 200
    assert not any(name.startswith("access-control-") for name in (*answer.headers, *preflight.headers))
    assert [request.method for request in seen] == ["POST", "OPTIONS"]  # the app answers OPTIONS as it would


def test_an_allowed_origins_preflight_is_answered_and_its_requests_carry_the_origin() -> None:
    with serving(f"{APP}, http://localhost:3000") as (url, seen):
        preflight = httpx.options(f"{url}/v1/completions", headers={"Origin": APP, **PREFLIGHT})
        answer = httpx.post(f"{url}/v1/completions", headers={"Origin": APP})
        plain = httpx.post(f"{url}/v1/completions")  # not from a browser page: answered as always
    assert preflight.status_code == 204
    assert preflight.headers["access-control-allow-origin"] == APP
    assert preflight.headers["access-control-allow-headers"] == "authorization, content-type"
    assert "POST" in preflight.headers["access-control-allow-methods"]
    assert "access-control-allow-credentials" not in preflight.headers
    assert answer.status_code == 200 and answer.json() == {"ok": True}
    assert answer.headers["access-control-allow-origin"] == APP
    assert answer.headers["vary"] == "Origin"
    assert answer.headers["x-request-id"] == "r-1"  # the handler's own headers are kept
    assert "access-control-allow-origin" not in plain.headers
    assert [request.method for request in seen] == ["POST", "POST"]  # the preflight never reached the app


def test_another_origin_gets_no_cors_headers_and_its_preflight_a_400() -> None:
    with serving(APP) as (url, _):
        answer = httpx.post(f"{url}/v1/completions", headers={"Origin": "https://evil.example"})
        preflight = httpx.options(f"{url}/v1/completions", headers={"Origin": "https://evil.example", **PREFLIGHT})
    assert "access-control-allow-origin" not in answer.headers  # the browser will not show the page the answer
    assert preflight.status_code == 400
    assert "https://evil.example" in preflight.json()["error"]["message"]
    assert "access-control-allow-origin" not in preflight.headers


def test_any_origin_is_allowed_with_a_star() -> None:
    with serving("*") as (url, _):
        answer = httpx.get(f"{url}/v1/models", headers={"Origin": "https://anywhere.example"})
    assert answer.headers["access-control-allow-origin"] == "*"


@pytest.mark.parametrize("text", ["app.example.com", "https://app.example.com/path", "ftp://x", "https://"])
def test_what_is_not_an_origin_is_refused_naming_it(text: str) -> None:
    with pytest.raises(ValueError, match="not an origin"):
        CorsPolicy.parse(text)


def test_the_router_takes_allowed_origins_from_its_command_line(tmp_path: Path) -> None:
    router = start_router(tmp_path, ["http://127.0.0.1:9"], "--allowed-origins", APP, wait_healthy=False)
    try:
        preflight = httpx.options(f"{router.url}/v1/chat/completions", headers={"Origin": APP, **PREFLIGHT})
        models = httpx.get(f"{router.url}/v1/models", headers={"Origin": APP})
    finally:
        router.stop()
    assert preflight.status_code == 204 and preflight.headers["access-control-allow-origin"] == APP
    assert models.headers["access-control-allow-origin"] == APP
