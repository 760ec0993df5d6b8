"""A small HTTP/1.1 server on asyncio protocols, for a proxy whose every request is on the hot path.

Requests are parsed by `httptools` (the llhttp parser that uvicorn uses): sized and chunked bodies,
keep-alive and pipelining, `Expect: 100-continue`. Each complete request runs one handler task; the
next request on the same connection waits for it (HTTP/1.1 answers in order). A request must arrive whole
within `request_read_timeout_s` of its first byte (else 408, connection closed: slow clients cannot hold
connections open), and a connection idle for `idle_timeout_s` between requests is closed. A handler answers
through a `Responder`: a whole body with `send`, or `start` + `write`… + `end` for a stream, which
goes out with chunked transfer encoding unless a length was given. A client that goes away cancels
its handler task, so work done on its behalf (an upstream request) is cancelled with it.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, TypeVar, cast

import httptools
import orjson

from kvyard.api.errors import error_body
from kvyard.net.cors import CorsPolicy
from kvyard.settings import setting

_LOG = logging.getLogger(__name__)
MAX_HEAD_BYTES = 64 << 10


@dataclass(slots=True)
class HttpRequest:
    method: str
    path: str
    query: str
    headers: dict[str, str]  # names in lower case
    body: bytes
    peer: str = ""  # the client's address


Handler = Callable[[HttpRequest, "Responder"], Awaitable[None]]
Headers = dict[str, str] | list[tuple[str, str]]


class HttpServerError(Exception):
    """A request that cannot be read as HTTP/1.1: answered with `status` and the connection closed."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _status_line(status: int) -> bytes:
    try:
        reason = HTTPStatus(status).phrase
    except ValueError:
        reason = "Status"
    return f"HTTP/1.1 {status} {reason}\r\n".encode("latin-1")


def _header_block(headers: Headers | None, keep_alive: bool, framing: str) -> bytes:
    items = headers.items() if isinstance(headers, dict) else (headers or ())
    lines = [f"{name}: {value}\r\n" for name, value in items]
    lines.append(framing)
    if not keep_alive:
        lines.append("Connection: close\r\n")
    lines.append("\r\n")
    return "".join(lines).encode("latin-1")


class Responder:
    """The answer to one request. `send` for a whole body; `start`, `write`, `end` to stream one.

    The head of a streamed response goes out with its first body bytes: one socket write, not two.
    """

    __slots__ = ("_chunked", "_connection", "_head", "extra_headers", "finished", "head_only", "keep_alive", "started")

    def __init__(self, connection: _Connection, keep_alive: bool, head_only: bool = False) -> None:
        """`head_only`: the answer to a HEAD request, whose status line and headers go out and body never does
        (a client reading a HEAD answer reads no body: bytes sent anyway would be taken for the next answer)."""
        self._connection = connection
        self.keep_alive = keep_alive
        self.head_only = head_only
        self.started = False
        self.finished = False
        self._chunked = False
        self._head = b""
        self.extra_headers: list[tuple[str, str]] = []  # added to whatever answer the handler gives (CORS)

    def send(
        self, status: int, body: bytes, headers: Headers | None = None, content_type: str = "application/json"
    ) -> None:
        framing = f"Content-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
        self._connection.write(self._make_head(status, headers, framing) + (b"" if self.head_only else body))
        self._finish()

    def send_json(self, status: int, payload: Any, headers: Headers | None = None) -> None:
        self.send(status, orjson.dumps(payload), headers)

    def start(self, status: int, headers: Headers | None = None, content_length: int | None = None) -> None:
        """Fix the status line and headers; the body follows with `write` and ends with `end`."""
        self._chunked = content_length is None
        framing = "Transfer-Encoding: chunked\r\n" if self._chunked else f"Content-Length: {content_length}\r\n"
        self._head = self._make_head(status, headers, framing)

    def flush_head(self) -> None:
        """Send the status line and headers now, before any body (a stream that may stay quiet a long time)."""
        head = self._take_head()
        if head:
            self._connection.write(head)

    def write(self, data: bytes) -> None:
        if not data or self.finished:
            return
        if self.head_only:
            self.flush_head()
            return
        if self._chunked:
            data = b"%x\r\n%b\r\n" % (len(data), data)
        self._connection.write(self._take_head() + data)

    def end(self) -> None:
        if self.finished:
            return
        self._connection.write(self._take_head() + (b"0\r\n\r\n" if self._chunked and not self.head_only else b""))
        self._finish()

    def abort(self) -> None:
        """End a response that cannot be completed: the client sees the connection close."""
        self.finished = True
        self.keep_alive = False
        self._connection.close()

    def _make_head(self, status: int, headers: Headers | None, framing: str) -> bytes:
        if self.started:
            raise RuntimeError("response already started")
        self.started = True
        if self.extra_headers:
            headers = [*(headers.items() if isinstance(headers, dict) else headers or ()), *self.extra_headers]
        return _status_line(status) + _header_block(headers, self.keep_alive, framing)

    def _take_head(self) -> bytes:
        head, self._head = self._head, b""
        return head

    def _finish(self) -> None:
        self.finished = True
        self._connection.response_finished(self)


@dataclass(slots=True)
class _Parsed:
    """Callbacks of httptools' parser, collecting one request at a time."""

    url: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    body: list[bytes] = field(default_factory=list)
    body_size: int = 0
    complete: list[HttpRequest] = field(default_factory=list)
    max_body_bytes: int = 64 << 20
    head_bytes: int = 0
    parser: Any = None
    keep_alive: list[bool] = field(default_factory=list)
    expect_continue: bool = False
    reading: bool = False  # between a request's first byte and its end
    peer: str = ""

    def on_message_begin(self) -> None:
        self.url, self.headers, self.body, self.body_size, self.head_bytes = b"", {}, [], 0, 0
        self.reading = True

    def on_url(self, url: bytes) -> None:
        self.url += url
        self._count_head(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_head(len(name) + len(value))
        key = name.decode("latin-1").lower()
        text = value.decode("latin-1")
        self.headers[key] = f"{self.headers[key]}, {text}" if key in self.headers else text

    def on_headers_complete(self) -> None:
        length = self.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            raise HttpServerError(413, f"request body is larger than {self.max_body_bytes} bytes")
        self.expect_continue = self.headers.get("expect", "").lower() == "100-continue"

    def on_body(self, data: bytes) -> None:
        self.body_size += len(data)
        if self.body_size > self.max_body_bytes:
            raise HttpServerError(413, f"request body is larger than {self.max_body_bytes} bytes")
        self.body.append(data)

    def on_message_complete(self) -> None:
        self.reading = False
        path, _, query = self.url.decode("latin-1").partition("?")
        method = self.parser.get_method().decode("latin-1")
        self.complete.append(HttpRequest(method, path, query, self.headers, b"".join(self.body), self.peer))
        self.keep_alive.append(self.parser.should_keep_alive())

    def _count_head(self, size: int) -> None:
        self.head_bytes += size
        if self.head_bytes > MAX_HEAD_BYTES:
            raise HttpServerError(431, "request head is too large")


class _Connection(asyncio.Protocol):
    """One client connection: parse requests, run their handlers one after another, write the answers."""

    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.parsed = _Parsed(max_body_bytes=server.config.max_body_bytes)
        self.parser = httptools.HttpRequestParser(self.parsed)
        self.parsed.parser = self.parser
        self.pending: list[tuple[HttpRequest, bool]] = []
        self.task: asyncio.Task[None] | None = None
        self.closing = False
        self.timer: asyncio.TimerHandle | None = None  # the idle, request-read or lingering deadline
        self.timer_kind = ""
        self.linger = False  # the next close reads and drops what the client still sends, for a while

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass asyncio's
        peer = transport.get_extra_info("peername")
        self.parsed.peer = str(peer[0]) if isinstance(peer, tuple) else str(peer or "")
        self.server.connections.add(self)
        self._watch()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closing = True
        self._set_timer(None)
        self.server.connections.discard(self)
        self.pending.clear()
        if self.task is not None and not self.task.done():
            self.task.cancel()

    def data_received(self, data: bytes) -> None:
        if self.closing:  # lingering after an error answer: the rest of a refused body is dropped
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as error:
            cause = error.__context__  # what a callback of ours raised, if it was one
            if isinstance(cause, HttpServerError):
                self._reject(cause.status, str(cause))
            else:
                self._reject(400, f"malformed HTTP request: {error}")
            return
        if self.parsed.expect_continue and self.transport is not None:
            self.parsed.expect_continue = False
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        for request in self.parsed.complete:
            self.pending.append((request, self.parsed.keep_alive.pop(0)))
        self.parsed.complete.clear()
        self._run_next()
        self._watch()

    def write(self, data: bytes) -> None:
        if self.transport is not None and not self.closing:
            self.transport.write(data)

    def close(self) -> None:
        self.closing = True
        if self.transport is None or self.timer_kind == "linger":
            return
        if self.linger:
            # As nginx's lingering close: a client still sending a refused body would get a reset (the unread bytes)
            # instead of the answer; its bytes are read and dropped until it stops or LINGER_S passes.
            self.linger = False
            if self.transport.can_write_eof():
                self.transport.write_eof()
            self._set_timer(LINGER_S, "linger")
            return
        self.transport.close()

    def close_now(self) -> None:
        """Close, lingering or not (the server is stopping)."""
        self.closing, self.linger = True, False
        self._set_timer(None)
        if self.transport is not None:
            self.transport.close()

    def response_finished(self, responder: Responder) -> None:
        if not responder.keep_alive:
            self.close()

    def _run_next(self) -> None:
        if self.task is not None or not self.pending or self.closing:
            return
        request, keep_alive = self.pending.pop(0)
        responder = Responder(self, keep_alive and not self.server.shutting_down, head_only=request.method == "HEAD")
        self.task = asyncio.get_running_loop().create_task(self._handle(request, responder))

    async def _handle(self, request: HttpRequest, responder: Responder) -> None:
        try:
            origin = request.headers.get("origin")
            cors = self.server.cors
            if cors is not None and origin is not None and not _cross_origin(cors, origin, request, responder):
                return
            await self.server.handler(request, responder)
        except asyncio.CancelledError:
            responder.abort()
        except Exception:
            _LOG.exception("handler failed on %s %s", request.method, request.path)
            if responder.started:
                responder.abort()
            else:
                responder.send_json(500, _error_payload(500, "internal error"))
        else:
            if not responder.finished:
                responder.end() if responder.started else responder.send(204, b"")
        finally:
            self.task = None
            self._run_next()
            self._watch()

    def _watch(self) -> None:
        """Arm the deadline that applies now: reading a request, idle between requests, or none while a handler
        runs (a long stream is not idle)."""
        if self.timer_kind == "linger":
            return
        if self.closing or self.task is not None:
            self._set_timer(None)
        elif self.parsed.reading:
            if self.timer is None or self.timer_kind != "read":
                self._set_timer(self.server.config.request_read_timeout_s, "read")
        else:
            self._set_timer(self.server.config.idle_timeout_s, "idle")

    def _set_timer(self, delay: float | None, kind: str = "") -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.timer, self.timer_kind = None, kind
        if delay is not None:
            self.timer = asyncio.get_running_loop().call_later(delay, self._expired, kind)

    def _expired(self, kind: str) -> None:
        self.timer = None
        if kind == "linger" and self.transport is not None:
            self.transport.close()
        elif kind == "read":
            self._reject(408, f"the request did not arrive within {self.server.config.request_read_timeout_s:g} s")
        else:
            self.close()

    def _reject(self, status: int, message: str) -> None:
        if self.task is None and self.transport is not None:
            self.linger = status == 413
            responder = Responder(self, keep_alive=False)
            responder.send_json(status, _error_payload(status, message))
        self.close()


def _cross_origin(cors: CorsPolicy, origin: str, request: HttpRequest, responder: Responder) -> bool:
    """Whether the handler still answers the request: a preflight is answered here; any other request from an
    allowed origin gets the CORS headers on its answer (one from another origin gets none: the browser refuses it)."""
    if request.method == "OPTIONS" and "access-control-request-method" in request.headers:
        if not cors.allows(origin):
            responder.send_json(400, _error_payload(400, f"CORS: origin {origin!r} is not allowed (--allowed-origins)"))
            return False
        preflight = cors.preflight_headers(origin, request.headers.get("access-control-request-headers"))
        responder.send(204, b"", preflight)
        return False
    if cors.allows(origin):
        responder.extra_headers = cors.answer_headers(origin)
    return True


LINGER_S = 2.0  # after a 413, how long the rest of the refused body is read and dropped at most
_CODES = {400: "malformed_request", 408: "request_timeout", 413: "body_too_large", 431: "headers_too_large"}


def _error_payload(status: int, message: str) -> dict[str, Any]:
    return error_body(status, message, code=_CODES.get(status))


Endpoint = Callable[[HttpRequest, Responder], Awaitable[None]]
Route = TypeVar("Route")


@dataclass(slots=True)
class RouteTable:
    """Endpoints by path and method."""

    routes: dict[str, dict[str, Endpoint]] = field(default_factory=dict)
    prefixes: dict[str, dict[str, Endpoint]] = field(default_factory=dict)  # "/v1/models/" serves /v1/models/{id}

    def add(self, method: str, path: str, endpoint: Endpoint) -> None:
        """Serve `path`; a path ending in "/" also serves every longer path below it (its last part a name)."""
        table = self.prefixes if path.endswith("/") else self.routes
        table.setdefault(path, {})[method] = endpoint

    def find(self, request: HttpRequest) -> Endpoint:
        """The endpoint for the request; HttpServerError 404 or 405 when there is none."""
        methods = self.routes.get(request.path) or under_prefix(self.prefixes, request.path)
        if methods is None:
            raise HttpServerError(404, f"{request.method} {request.path}: not found")
        endpoint = method_endpoint(methods, request.method)
        if endpoint is None:
            raise HttpServerError(405, f"{request.method} {request.path}: method not allowed")
        return endpoint


def under_prefix(prefixes: dict[str, dict[str, Route]], path: str) -> dict[str, Route] | None:
    """The methods of the prefix `path` continues (with a non-empty name), if any."""
    for prefix, methods in prefixes.items():
        if path.startswith(prefix) and len(path) > len(prefix):
            return methods
    return None


def method_endpoint(methods: dict[str, Route], method: str) -> Route | None:
    """The endpoint for `method`; HEAD is answered as GET (the responder leaves the body out)."""
    endpoint = methods.get(method)
    if endpoint is None and method == "HEAD":
        return methods.get("GET")
    return endpoint


@dataclass(frozen=True, slots=True)
class HttpServerConfig:
    """HTTP: TLS, and what one client may ask of the server."""

    max_body_mb: float = setting(4.0, help="the largest request body accepted; a larger one gets 413")
    request_read_timeout_s: float = setting(
        30.0,
        help="a request whose head and body have not arrived this long "
        "after its first byte gets 408 and its connection closed",
    )
    idle_timeout_s: float = setting(75.0, help="a keep-alive connection idle this long between requests is closed")
    backlog: int = setting(
        2048,
        help="connections the kernel holds for the server while it is busy (capped by "
        "net.core.somaxconn); past it, new clients wait on SYN retries or fail",
    )
    ssl_certfile: str | None = setting(
        None, help="serve HTTPS with this certificate chain (PEM)", default_text="none: plain HTTP"
    )
    ssl_keyfile: str | None = setting(
        None, help="the private key of --ssl-certfile (PEM; default: in the certificate file)", default_text="none"
    )
    allowed_origins: str | None = setting(
        None,
        help="web pages allowed to call this server from a browser on "
        "another origin (CORS): comma-separated origins such as "
        "https://app.example.com, or * for any",
        default_text="none: no CORS headers, browsers refuse cross-origin calls",
    )

    def __post_init__(self) -> None:
        for name in ("max_body_mb", "request_read_timeout_s", "idle_timeout_s", "backlog"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        CorsPolicy.parse(self.allowed_origins)  # refused here, before the server starts

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mb * (1 << 20))

    def ssl_context(self) -> ssl.SSLContext | None:
        """The server's TLS context, None for plain HTTP (an unreadable file raises OSError or SSLError)."""
        if self.ssl_certfile is None:
            return None
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self.ssl_certfile, self.ssl_keyfile)
        return context


@dataclass(slots=True)
class HttpServer:
    handler: Handler
    config: HttpServerConfig = field(default_factory=HttpServerConfig)
    connections: set[_Connection] = field(default_factory=set)
    shutting_down: bool = False
    cors: CorsPolicy | None = None
    _server: asyncio.Server | None = None

    def __post_init__(self) -> None:
        self.cors = CorsPolicy.parse(self.config.allowed_origins)

    async def start(self, host: str, port: int) -> None:
        loop = asyncio.get_running_loop()
        context = self.config.ssl_context()
        self._server = await loop.create_server(
            lambda: _Connection(self), host, port, reuse_address=True, ssl=context, backlog=self.config.backlog
        )

    @property
    def port(self) -> int:
        assert self._server is not None
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    async def shutdown(self, grace_s: float) -> None:
        """Stop accepting, let requests in progress finish for up to `grace_s`, then close every connection."""
        self.shutting_down = True
        if self._server is not None:
            self._server.close()
        deadline = asyncio.get_running_loop().time() + grace_s
        while any(c.task is not None for c in self.connections) and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        for connection in list(self.connections):
            connection.close_now()
        if self._server is not None:
            await self._server.wait_closed()
