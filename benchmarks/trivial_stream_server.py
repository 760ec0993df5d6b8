"""A trivial OpenAI-style streaming server for measuring the benchmark client's own overhead.

Raw asyncio, HTTP/1.1 keep-alive, no framework, so that it costs as little CPU as possible: every
POST /v1/completions answers at once with `max_tokens` one-character chunks, a usage chunk and
[DONE]. It stamps, on time.monotonic() (one clock for every process on Linux), when it had read
each request and when it wrote the first chunk, keyed by hash(tuple(prompt)); GET /stamps returns
them so the client's TTFT can be compared with the server's, request by request.

    python benchmarks/trivial_stream_server.py --port 18500
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import dataclass, field

_HEADERS = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
_TOKEN = b'data: {"object":"text_completion","choices":[{"index":0,"text":"x","finish_reason":null}]}\n\n'


def _chunk(payload: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(payload), payload)


@dataclass(slots=True)
class Stamps:
    by_prompt: dict[int, tuple[float, float]] = field(default_factory=dict)  # hash -> (read, first chunk written)


class StreamProtocol(asyncio.Protocol):
    def __init__(self, stamps: Stamps, strict: bool) -> None:
        self.stamps = stamps
        self.strict = strict  # reject fields outside the OpenAI API, as a strict server does
        self.buffer = bytearray()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while (request := self._take_request()) is not None:
            self._answer(*request)

    def _take_request(self) -> tuple[str, str, bytes] | None:
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0:
            return None
        head = bytes(self.buffer[:end]).decode("latin-1").split("\r\n")
        length = 0
        for line in head[1:]:
            name, _, value = line.partition(":")
            if name.strip().lower() == "content-length":
                length = int(value)
        if len(self.buffer) < end + 4 + length:
            return None
        body = bytes(self.buffer[end + 4 : end + 4 + length])
        del self.buffer[: end + 4 + length]
        method, path, _ = head[0].split(" ", 2)
        return method, path, body

    def _answer(self, method: str, path: str, body: bytes) -> None:
        assert self.transport is not None
        if method == "POST" and path == "/v1/completions":
            self._stream(body)
        elif path == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": "trivial", "object": "model"}]})
        elif path == "/stamps":
            self._json(200, {str(k): v for k, v in self.stamps.by_prompt.items()})
        else:
            self._json(404, {"error": {"message": f"no route {path}", "type": "not_found"}})

    def _stream(self, body: bytes) -> None:
        assert self.transport is not None
        read = time.monotonic()
        request = json.loads(body)
        if self.strict and "ignore_eos" in request:
            self._json(400, {"error": {"message": "unrecognized request argument: ignore_eos", "param": "ignore_eos"}})
            return
        tokens = int(request.get("max_tokens", 1))
        prompt = request.get("prompt", [])
        first = time.monotonic()
        self.transport.write(_HEADERS + _chunk(_TOKEN))
        self.stamps.by_prompt[hash(tuple(prompt))] = (read, first)
        usage = {
            "prompt_tokens": len(prompt),
            "completion_tokens": tokens,
            "total_tokens": len(prompt) + tokens,
            "prompt_tokens_details": {"cached_tokens": 0},
        }
        rest = [_chunk(_TOKEN) for _ in range(tokens - 1)]
        rest.append(_chunk(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n"))
        rest.append(_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        self.transport.write(b"".join(rest))

    def _json(self, status: int, payload: object) -> None:
        assert self.transport is not None
        data = json.dumps(payload).encode()
        reason = {200: b"OK", 400: b"Bad Request"}.get(status, b"Not Found")
        self.transport.write(
            b"HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
            % (status, reason, len(data), data)
        )


async def serve(port: int, strict: bool) -> None:
    stamps = Stamps()
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: StreamProtocol(stamps, strict), "127.0.0.1", port, backlog=4096)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--strict", action="store_true", help="answer 400 to ignore_eos, a field outside the API")
    args = parser.parse_args()
    asyncio.run(serve(args.port, args.strict))


if __name__ == "__main__":
    main()
