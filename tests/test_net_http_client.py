"""kvyard.net's HTTP/1.1 client (bench and router use it) against a loopback server answering in every framing."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from kvyard.bench.client import Arrivals, LoadClient, RequestOptions
from kvyard.bench.workloads import LengthRange, TokenSource, random_workload
from kvyard.net.http_client import HttpClient, HttpError

SSE = b'data: {"choices":[{"text":"a"}]}\r\n\r\ndata: {"choices":[{"text":"b"}]}\r\n\r\n'
ERROR = b'{"error":"too many"}'
USAGE = b'data: {"choices":[],"usage":{"prompt_tokens":4,"completion_tokens":2}}\n\ndata: [DONE]\n\n'


def chunked(*pieces: bytes) -> bytes:
    body = b"".join(b"%x;ext=1\r\n%s\r\n" % (len(p), p) for p in pieces)
    return body + b"0\r\nX-Trailer: yes\r\n\r\n"


RESPONSES: dict[str, bytes] = {
    "/chunked": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked(SSE, USAGE),
    "/sized": b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(SSE + USAGE), SSE + USAGE),
    "/close": b"HTTP/1.0 200 OK\r\n\r\n" + SSE + USAGE,
    "/error": b"HTTP/1.1 429 Too Many Requests\r\nContent-Length: %d\r\nRetry-After: 1\r\n\r\n%s" % (len(ERROR), ERROR),
    "/garbage": b"SPDY/9 what\r\n\r\n",
    "/cut": b"HTTP/1.1 200 OK\r\nContent-Length: 500\r\n\r\n" + SSE,
}


async def serve(handle: Callable[[str, asyncio.StreamWriter], Awaitable[bool]]) -> tuple[asyncio.Server, str]:
    """A loopback server: for every request head, `handle(path, writer)` answers; False closes the connection."""

    async def connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    (
                        int(line.split(b":")[1])
                        for line in head.split(b"\r\n")
                        if line.lower().startswith(b"content-length")
                    ),
                    0,
                )
                await reader.readexactly(length)
                if not await handle(head.split(b" ")[1].decode(), writer):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    server = await asyncio.start_server(connection, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}"


async def canned(path: str, writer: asyncio.StreamWriter) -> bool:
    writer.write(RESPONSES[path.split("?")[0]])
    await writer.drain()
    return path not in ("/close", "/garbage", "/cut")


def run(coroutine: Awaitable[None]) -> None:
    asyncio.run(asyncio.wait_for(coroutine, 30))  # type: ignore[arg-type]


@pytest.mark.parametrize("path", ["/chunked", "/sized", "/close"])
def test_bodies_in_every_framing_reach_the_sink_whole(path: str) -> None:
    async def check() -> None:
        server, url = await serve(canned)
        client = HttpClient(url)
        received: list[bytes] = []
        for _ in range(3):  # keep-alive connections are reused; a closed one is replaced
            received.clear()
            response = await client.request("POST", path, b"{}", lambda data, _: received.append(data), timeout=5)
            assert response.status == 200 and b"".join(received) == SSE + USAGE and not response.body
        client.close()
        server.close()

    run(check())


def test_error_status_keeps_its_body_and_headers() -> None:
    async def check() -> None:
        server, url = await serve(canned)
        client = HttpClient(url)
        response = await client.request("POST", "/error", b"{}", lambda data, _: None, timeout=5)
        assert response.status == 429 and response.headers["retry-after"] == "1"
        assert bytes(response.body) == ERROR
        client.close()
        server.close()

    run(check())


def test_broken_responses_raise_http_errors() -> None:
    async def check() -> None:
        server, url = await serve(canned)
        client = HttpClient(url)
        with pytest.raises(HttpError, match="malformed"):
            await client.request("GET", "/garbage", timeout=5)
        with pytest.raises(HttpError, match="closed mid-response"):
            await client.request("GET", "/cut", timeout=5)
        client.close()
        server.close()
        with pytest.raises(HttpError, match="cannot connect"):
            await HttpClient(url).request("GET", "/chunked", timeout=5)

    run(check())


def test_slow_answer_times_out_and_the_client_goes_on() -> None:
    async def slow_then_fast(path: str, writer: asyncio.StreamWriter) -> bool:
        if path == "/slow":
            await asyncio.sleep(2)
        return await canned("/sized", writer)

    async def check() -> None:
        server, url = await serve(slow_then_fast)
        client = HttpClient(url)
        with pytest.raises(TimeoutError):
            await client.request("GET", "/slow", timeout=0.2)
        assert (await client.request("GET", "/sized", timeout=5)).status == 200
        client.close()
        server.close()

    run(check())


def test_load_client_reads_crlf_events_and_usage() -> None:
    """The whole load client over this server: SSE with CRLF line ends, chunk extensions, a trailer, usage."""

    async def by_prompt(path: str, writer: asyncio.StreamWriter) -> bool:
        return await canned("/chunked", writer)

    async def check() -> None:
        server, url = await serve(by_prompt)
        workload = random_workload(5, LengthRange(4, 4), LengthRange(2, 2), TokenSource(100, 0))
        client = LoadClient(RequestOptions(url), Arrivals(concurrency=2))
        records = await client.run(workload)
        server.close()
        assert len(records) == 5 and all(r.ok for r in records)
        assert all(r.output_tokens == 2 and len(r.token_times) == 2 and r.server_prompt_tokens == 4 for r in records)
        assert all(r.start <= r.token_times[0] <= r.token_times[1] <= r.end for r in records)

    run(check())


def test_base_url_must_be_http() -> None:
    with pytest.raises(ValueError, match="http"):
        HttpClient("ftp://example")
    assert HttpClient("http://127.0.0.1:9/api/").prefix == "/api"
