"""A minimal HTTP/1.1 client on asyncio protocols: keep-alive pool, chunked and sized bodies, TLS.

Why not aiohttp or httpx: the load client must drive thousands of streamed requests per second
from one Python process on a small machine without its own queueing showing up in TTFT, and the
router proxies every request through one. Both general-purpose clients spend several hundred
microseconds of Python per request (header multidicts, cookie jars, tracing hooks, a coroutine hop
per body chunk); here the response body is handed straight from `data_received` to a callback,
which costs a fraction of that. Only what an OpenAI-compatible endpoint needs is implemented: no
redirects, no proxies, no cookies.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast
from urllib.parse import urlsplit

BodySink = Callable[[bytes, float], None]  # (bytes of the body, time.monotonic() when they arrived)
HeadCallback = Callable[["Response"], None]  # status and headers are known, no body byte has been handed over


class HttpError(Exception):
    """The connection failed or the response was not valid HTTP/1.1."""


class ConnectError(HttpError):
    """No connection could be opened: nothing was sent."""


@dataclass(slots=True)
class Response:
    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    body: bytearray = field(default_factory=bytearray)  # only when no sink took the body


@dataclass(slots=True)
class _Exchange:
    response: Response
    sink: BodySink | None
    done: asyncio.Future[Response]
    on_head: HeadCallback | None = None


_HEAD, _CHUNK_SIZE, _CHUNK_DATA, _TRAILER, _SIZED, _UNTIL_CLOSE = range(6)


class _Connection(asyncio.Protocol):
    """One keep-alive connection; parses one response at a time."""

    def __init__(self, pool: HttpClient) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.exchange: _Exchange | None = None
        self.state = _HEAD
        self.remaining = 0
        self.keep_alive = True
        self.closed = False
        self.pieces: list[bytes] = []  # body bytes parsed from this read, handed over together
        self.arrived = 0.0

    # asyncio callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass asyncio's

    def data_received(self, data: bytes) -> None:
        if self.exchange is None:
            self.close()  # bytes nobody asked for: the connection is out of step
            return
        self.buffer += data
        self.arrived = time.monotonic()
        try:
            self._parse()
        except (ValueError, IndexError) as error:
            self._fail(HttpError(f"malformed HTTP response: {error}"))
        else:
            self._flush()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.exchange is not None:
            if self.state == _UNTIL_CLOSE:
                self.arrived = time.monotonic()
                self.pieces.append(bytes(self.buffer))
                self._complete()
            else:
                self._fail(HttpError(f"connection closed mid-response{f': {exc}' if exc else ''}"))

    # requests

    def send(self, request: bytes, exchange: _Exchange) -> None:
        assert self.transport is not None
        self.exchange, self.state, self.keep_alive = exchange, _HEAD, True
        self.buffer.clear()
        self.transport.write(request)

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    # parsing

    def _parse(self) -> None:
        while self.exchange is not None:
            if self.state == _HEAD:
                if not self._parse_head():
                    return
            elif self.state in (_CHUNK_SIZE, _CHUNK_DATA):
                if not self._parse_chunks():
                    return
            elif self.state == _TRAILER:
                end = self.buffer.find(b"\r\n")
                if end < 0:
                    return
                del self.buffer[: end + 2]
                if end == 0:  # the empty line that ends the trailer
                    self._complete()
            elif self.state == _SIZED:
                take = min(self.remaining, len(self.buffer))
                if take:
                    self.pieces.append(bytes(self.buffer[:take]))
                    del self.buffer[:take]
                    self.remaining -= take
                if self.remaining == 0:
                    self._complete()
                return
            else:  # _UNTIL_CLOSE
                if self.buffer:
                    self.pieces.append(bytes(self.buffer))
                    self.buffer.clear()
                return

    def _parse_chunks(self) -> bool:
        """Take every complete chunk in the buffer (trimming it once); False when more bytes are needed."""
        buffer, position = self.buffer, 0
        try:
            while True:
                if self.state == _CHUNK_SIZE:
                    end = buffer.find(b"\r\n", position)
                    if end < 0:
                        return False
                    size = int(buffer[position:end].split(b";", 1)[0], 16)
                    position = end + 2
                    if size == 0:
                        self.state = _TRAILER
                        return True
                    self.state, self.remaining = _CHUNK_DATA, size
                else:
                    if len(buffer) < position + self.remaining + 2:
                        return False
                    self.pieces.append(bytes(buffer[position : position + self.remaining]))
                    position += self.remaining + 2
                    self.state = _CHUNK_SIZE
        finally:
            del buffer[:position]

    def _parse_head(self) -> bool:
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0:
            return False
        lines = bytes(self.buffer[:end]).decode("latin-1").split("\r\n")
        del self.buffer[: end + 4]
        version, status, *_ = lines[0].split(" ", 2)
        if not version.startswith("HTTP/1."):
            raise ValueError(f"status line {lines[0]!r}")
        assert self.exchange is not None
        response = self.exchange.response
        response.status = int(status)
        for line in lines[1:]:
            name, _, value = line.partition(":")
            response.headers[name.strip().lower()] = value.strip()
        headers = response.headers
        self.keep_alive = headers.get("connection", "").lower() != "close" and version == "HTTP/1.1"
        if "chunked" in headers.get("transfer-encoding", "").lower():
            self.state = _CHUNK_SIZE
        elif "content-length" in headers:
            self.state, self.remaining = _SIZED, int(headers["content-length"])
        elif response.status in (204, 304) or 100 <= response.status < 200:
            self.state, self.remaining = _SIZED, 0
        else:
            self.state, self.keep_alive = _UNTIL_CLOSE, False
        if self.exchange.on_head is not None:
            self.exchange.on_head(response)
        return True

    def _flush(self) -> None:
        """Hand the body bytes of this read over in one piece: they arrived at the same moment."""
        if not self.pieces or self.exchange is None:
            self.pieces.clear()
            return
        data = b"".join(self.pieces)
        self.pieces.clear()
        if self.exchange.sink is not None and self.exchange.response.status == 200:
            self.exchange.sink(data, self.arrived)
        else:
            self.exchange.response.body += data

    def _complete(self) -> None:
        self._flush()
        exchange, self.exchange = self.exchange, None
        if exchange is None:
            return
        if not exchange.done.done():
            exchange.done.set_result(exchange.response)
        if self.keep_alive and not self.closed and not self.buffer:
            self.pool.release(self)
        else:
            self.close()

    def _fail(self, error: Exception) -> None:
        exchange, self.exchange = self.exchange, None
        self.close()
        if exchange is not None and not exchange.done.done():
            exchange.done.set_exception(error)


@dataclass(slots=True)
class HttpClient:
    """Requests to one base URL (`http://host:port[/prefix]` or https) over a pool of kept-alive connections."""

    base_url: str
    headers: dict[str, str] = field(default_factory=dict)
    connect_timeout: float | None = None
    idle: list[_Connection] = field(default_factory=list)
    host: str = field(init=False)
    port: int = field(init=False)
    prefix: str = field(init=False)
    tls: ssl.SSLContext | None = field(init=False)

    def __post_init__(self) -> None:
        parts = urlsplit(self.base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"base URL must be http(s)://host[:port], got {self.base_url!r}")
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.prefix = parts.path.rstrip("/")
        self.tls = ssl.create_default_context() if parts.scheme == "https" else None
        default_port = 443 if self.tls else 80
        host_header = self.host if self.port == default_port else f"{self.host}:{self.port}"
        self.headers = {"Host": host_header, "User-Agent": "kvyard", **self.headers}

    async def request(
        self,
        method: str,
        path: str,
        body: bytes = b"",
        sink: BodySink | None = None,
        timeout: float | None = None,
        headers: dict[str, str] | None = None,
        on_head: HeadCallback | None = None,
    ) -> Response:
        """Send one request and wait for the whole response. With a `sink`, a 200 body goes to the sink as
        it arrives instead of into `Response.body`; `on_head` runs once the status line and headers are in.
        Raises HttpError, or TimeoutError after `timeout` s. Cancelling the caller closes the connection,
        which is how the server learns that nobody waits for the rest."""
        loop = asyncio.get_running_loop()
        connection = await self._connection(loop)
        exchange = _Exchange(Response(), sink, loop.create_future(), on_head)
        connection.send(self._encode(method, path, body, headers), exchange)
        timer = loop.call_later(timeout, self._expire, connection, exchange) if timeout else None
        try:
            return await exchange.done
        except asyncio.CancelledError:
            if connection.exchange is exchange:
                connection.exchange = None
                connection.close()
            raise
        finally:
            if timer is not None:
                timer.cancel()

    async def get(self, path: str, timeout: float | None = 30.0) -> Response:
        return await self.request("GET", path, timeout=timeout)

    async def warm_up(self, count: int) -> None:
        """Open `count` idle connections now, so that requests need not wait for a TCP (and TLS) handshake."""
        if count <= 0:
            return
        loop = asyncio.get_running_loop()
        opened = await asyncio.gather(*(self._open(loop) for _ in range(count)), return_exceptions=True)
        self.idle.extend(c for c in opened if isinstance(c, _Connection))

    def release(self, connection: _Connection) -> None:
        self.idle.append(connection)

    def close(self) -> None:
        while self.idle:
            self.idle.pop().close()

    async def _connection(self, loop: asyncio.AbstractEventLoop) -> _Connection:
        while self.idle:
            connection = self.idle.pop()
            if not connection.closed:
                return connection
        return await self._open(loop)

    async def _open(self, loop: asyncio.AbstractEventLoop) -> _Connection:
        connecting = loop.create_connection(lambda: _Connection(self), self.host, self.port, ssl=self.tls)
        try:
            _, protocol = await asyncio.wait_for(connecting, self.connect_timeout)
        except (OSError, asyncio.TimeoutError) as error:
            raise ConnectError(f"cannot connect to {self.host}:{self.port}: {error or 'timed out'}") from error
        return protocol

    def _encode(self, method: str, path: str, body: bytes, headers: dict[str, str] | None = None) -> bytes:
        lines = [f"{method} {self.prefix}{path} HTTP/1.1"]
        lines += [f"{name}: {value}" for name, value in self.headers.items()]
        if headers:
            lines += [f"{name}: {value}" for name, value in headers.items()]
        if body or method == "POST":
            lines.append(f"Content-Length: {len(body)}")
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body

    @staticmethod
    def _expire(connection: _Connection, exchange: _Exchange) -> None:
        if not exchange.done.done():
            exchange.done.set_exception(TimeoutError("no complete response in time"))
        if connection.exchange is exchange:
            connection.exchange = None
            connection.close()
