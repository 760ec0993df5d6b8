"""kvyard.net's HTTP/1.1 server on loopback, driven with raw bytes so every framing case is exact."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from kvyard.net.http_client import HttpClient
from kvyard.net.http_server import Handler, HttpRequest, HttpServer, HttpServerConfig, Responder

Scenario = Callable[[HttpServer, list[HttpRequest]], Awaitable[None]]


async def handler_for(seen: list[HttpRequest], events: list[str]) -> Handler:
    async def handle(request: HttpRequest, responder: Responder) -> None:
        seen.append(request)
        if request.path == "/echo":
            responder.send_json(200, {"method": request.method, "query": request.query, "body": request.body.decode()})
        elif request.path == "/stream":
            responder.start(200, [("Content-Type", "text/event-stream")])
            for piece in (b"data: 1\n\n", b"data: 2\n\n"):
                responder.write(piece)
                await asyncio.sleep(0.01)
            responder.end()
        elif request.path == "/slow":
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                events.append("cancelled")
                raise
        elif request.path == "/boom":
            raise RuntimeError("handler bug")

    return handle


def run(scenario: Scenario, max_body_mb: float = 1.0) -> list[str]:
    events: list[str] = []

    async def main() -> None:
        seen: list[HttpRequest] = []
        server = HttpServer(await handler_for(seen, events), HttpServerConfig(max_body_mb=max_body_mb))
        await server.start("127.0.0.1", 0)
        try:
            await scenario(server, seen)
        finally:
            await server.shutdown(1.0)

    asyncio.run(asyncio.wait_for(main(), 30))
    return events


async def exchange(port: int, raw: bytes, until_close: bool = True) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw)
    await writer.drain()
    data = await reader.read() if until_close else await reader.readuntil(b"\r\n\r\n")
    writer.close()
    return data


def test_pipelined_requests_are_answered_in_order_on_one_connection() -> None:
    async def scenario(server: HttpServer, seen: list[HttpRequest]) -> None:
        raw = (
            b"POST /echo?x=1 HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\n\r\none"
            b"POST /echo HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n3\r\ntwo\r\n0\r\n\r\n"
            b"GET /echo HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n"
        )
        data = await exchange(server.port, raw)
        bodies = [json.loads(part.split(b"\r\n\r\n", 1)[1]) for part in data.split(b"HTTP/1.1 ")[1:]]
        assert [b["body"] for b in bodies] == ["one", "two", ""]
        assert bodies[0]["query"] == "x=1" and bodies[2]["method"] == "GET"
        assert data.count(b"Connection: close") == 1

    run(scenario)


def test_head_gets_the_get_answers_headers_and_no_body_so_keep_alive_stays_in_step() -> None:
    async def scenario(server: HttpServer, seen: list[HttpRequest]) -> None:
        raw = (
            b"HEAD /echo HTTP/1.1\r\nHost: a\r\n\r\n"
            b"HEAD /stream HTTP/1.1\r\nHost: a\r\n\r\n"
            b"GET /echo?after=head HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n"
        )
        data = await exchange(server.port, raw)
        answers = data.split(b"HTTP/1.1 ")[1:]
        assert len(answers) == 3
        head_json, head_stream, get = answers
        assert head_json.startswith(b"200") and head_json.endswith(b"\r\n\r\n")  # headers, then nothing
        assert b"Content-Length: " in head_json and b"Content-Length: 0" not in head_json
        assert head_stream.startswith(b"200") and head_stream.endswith(b"\r\n\r\n")
        assert json.loads(get.split(b"\r\n\r\n", 1)[1])["query"] == "after=head"
        assert [r.method for r in seen] == ["HEAD", "HEAD", "GET"]

    run(scenario)


def test_streamed_response_is_chunked_and_readable_by_the_client() -> None:
    async def scenario(server: HttpServer, seen: list[HttpRequest]) -> None:
        client = HttpClient(f"http://127.0.0.1:{server.port}")
        pieces: list[bytes] = []
        response = await client.request("GET", "/stream", sink=lambda data, _at: pieces.append(data))
        assert response.status == 200 and response.headers["transfer-encoding"] == "chunked"
        assert b"".join(pieces) == b"data: 1\n\ndata: 2\n\n"
        again = await client.request("POST", "/echo", b"kept alive")
        assert json.loads(again.body)["body"] == "kept alive"
        client.close()

    run(scenario)


def test_expect_continue_gets_100_before_the_body_is_sent() -> None:
    async def scenario(server: HttpServer, seen: list[HttpRequest]) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"POST /echo HTTP/1.1\r\nHost: a\r\nContent-Length: 4\r\nExpect: 100-continue\r\n\r\n")
        assert await reader.readuntil(b"\r\n\r\n") == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(b"body")
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 OK")
        writer.close()

    run(scenario)


def test_a_client_still_sending_a_refused_body_reads_its_413() -> None:
    """As nginx's lingering close: the server reads and drops the rest of a too-large body after its 413, so the
    client gets the answer instead of a reset."""

    async def scenario(server: HttpServer, seen: list[HttpRequest]) -> None:
        size, chunk = 16 << 20, b"x" * (256 << 10)
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"POST /echo HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % size)
        for _ in range(size // len(chunk)):
            writer.write(chunk)
            await writer.drain()
        answer = await reader.read()
        writer.close()
        assert answer.startswith(b"HTTP/1.1 413 ") and b"body_too_large" in answer
        ok = await exchange(server.port, b"GET /echo HTTP/1.1\r\nConnection: close\r\n\r\n")
        assert ok.startswith(b"HTTP/1.1 200 OK")

    run(scenario)


@pytest.mark.parametrize(
    ("raw", "status"),
    [
        (b"NOT HTTP AT ALL\r\n\r\n", 400),
        (b"POST /echo HTTP/1.1\r\nContent-Length: 99999999\r\n\r\n", 413),
        (
            b"POST /echo HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n80000\r\n"
            + b"x" * 0x80000
            + b"\r\n80001\r\n"
            + b"x" * 0x80001,
            413,
        ),  # the limit is crossed by the last byte sent
        (b"GET /echo HTTP/1.1\r\nX-Big: " + b"y" * (70 << 10) + b"\r\n\r\n", 431),
    ],
)
def test_unreadable_requests_get_a_json_error_and_the_server_stays_up(raw: bytes, status: int) -> None:
    async def scenario(server: HttpServer, seen: list[HttpRequest]) -> None:
        data = await exchange(server.port, raw)
        assert data.startswith(b"HTTP/1.1 %d " % status)
        assert json.loads(data.split(b"\r\n\r\n", 1)[1])["error"]["message"]
        ok = await exchange(server.port, b"GET /echo HTTP/1.1\r\nConnection: close\r\n\r\n")
        assert ok.startswith(b"HTTP/1.1 200 OK")

    run(scenario)


def test_handler_exception_answers_500_and_the_connection_stays_usable() -> None:
    async def scenario(server: HttpServer, seen: list[HttpRequest]) -> None:
        raw = b"GET /boom HTTP/1.1\r\n\r\nGET /echo HTTP/1.1\r\nConnection: close\r\n\r\n"
        data = await exchange(server.port, raw)
        assert data.startswith(b"HTTP/1.1 500 ") and b"HTTP/1.1 200 OK" in data

    run(scenario)


def test_client_disconnect_cancels_its_handler() -> None:
    async def scenario(server: HttpServer, seen: list[HttpRequest]) -> None:
        _, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET /slow HTTP/1.1\r\n\r\n")
        await writer.drain()
        while not seen:
            await asyncio.sleep(0.01)
        writer.close()
        for _ in range(100):
            await asyncio.sleep(0.01)
            if not server.connections:
                break

    assert run(scenario) == ["cancelled"]


def connections_held_while_busy(config: HttpServerConfig, attempts: int) -> int:
    """Connections the kernel completes for a server whose event loop is blocked (as in a long pause), counted
    until the first that is not answered."""

    async def main() -> int:
        server = HttpServer(await handler_for([], []), config)
        await server.start("127.0.0.1", 0)
        held: list[socket.socket] = []
        try:
            for _ in range(attempts):  # blocking calls: the loop cannot accept meanwhile
                try:
                    held.append(socket.create_connection(("127.0.0.1", server.port), timeout=0.5))
                except OSError:
                    break
            return len(held)
        finally:
            for connection in held:
                connection.close()
            await server.shutdown(1.0)

    return asyncio.run(asyncio.wait_for(main(), 30))


def test_a_busy_server_keeps_a_burst_of_new_connections_waiting_instead_of_dropping_them() -> None:
    burst = min(300, int(Path("/proc/sys/net/core/somaxconn").read_text()))  # the kernel's cap on any backlog
    assert burst > 100  # asyncio's own default backlog, which a burst at a paused router overflowed
    assert connections_held_while_busy(HttpServerConfig(), burst) == burst
    assert connections_held_while_busy(HttpServerConfig(backlog=2), 300) < 10  # the setting reaches the socket
