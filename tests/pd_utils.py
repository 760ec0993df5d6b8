"""Prefill/decode disaggregation for tests: send a request through a prefill and a decode replica, as the router
does, and a byte-flipping TCP relay to damage a transfer on its way."""

from __future__ import annotations

import contextlib
import socket
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvyard.api.auth import ADMIN_KEY_HEADER
from kvyard.testing.sim_cluster import TEST_ADMIN_KEY

PD_HEADERS = {ADMIN_KEY_HEADER: TEST_ADMIN_KEY}


@dataclass
class PDResult:
    prefill: httpx.Response | httpx.HTTPError  # the prefill replica may be killed by a test
    decode: httpx.Response
    transfer_id: str

    def json(self) -> dict[str, Any]:
        assert isinstance(self.prefill, httpx.Response) and self.prefill.status_code == 200, self.prefill
        assert self.decode.status_code == 200, self.decode.text
        body: dict[str, Any] = self.decode.json()
        return body


def prefill_body(body: dict[str, Any], transfer_id: str, token: str | None = None) -> dict[str, Any]:
    leg = {key: value for key, value in body.items() if key not in ("n", "stream", "stream_options")}
    params = {"do_remote_decode": True, "transfer_id": transfer_id, **({"transfer_token": token} if token else {})}
    return {**leg, "max_tokens": 1, "kv_transfer_params": params}


def decode_body(body: dict[str, Any], transfer_id: str, source: str, token: str | None = None) -> dict[str, Any]:
    params = {"do_remote_prefill": True, "transfer_id": transfer_id, "source": source}
    return {**body, "kv_transfer_params": {**params, **({"transfer_token": token} if token else {})}}


def pd_request(
    prefill_url: str,
    decode_url: str,
    body: dict[str, Any],
    path: str = "/v1/completions",
    source: str | None = None,
    timeout: float = 120.0,
) -> PDResult:
    """Both legs at once, as the router sends them (one fresh transfer token for both); `source` overrides the URL
    the decode replica pulls from."""
    transfer_id, token = uuid.uuid4().hex, uuid.uuid4().hex
    with ThreadPoolExecutor(2) as pool:
        prefill = pool.submit(_post, prefill_url + path, prefill_body(body, transfer_id, token), timeout)
        decode = pool.submit(
            httpx.post,
            decode_url + path,
            headers=PD_HEADERS,
            timeout=timeout,
            json=decode_body(body, transfer_id, source or prefill_url, token),
        )
        return PDResult(prefill.result(), decode.result(), transfer_id)


def _post(url: str, body: dict[str, Any], timeout: float) -> httpx.Response | httpx.HTTPError:
    try:
        return httpx.post(url, json=body, headers=PD_HEADERS, timeout=timeout)
    except httpx.HTTPError as error:
        return error


@dataclass
class Relay:
    """A TCP relay to `target_port` between two replicas. `flip_at`: flip one byte that many bytes into each
    connection's answer (a damaged link, or a bad NIC). `hold_at`: forward that many bytes of each answer, then
    nothing more (`holding` is set): what is still on its way when the target dies is lost with it."""

    target_port: int
    flip_at: int | None = None
    hold_at: int | None = None
    port: int = 0
    flipped: int = 0
    holding: threading.Event = field(default_factory=threading.Event)
    _listener: socket.socket = field(init=False)

    def __post_init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self._listener.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:  # the target is gone: so is the connection
                client.close()
                continue
            threading.Thread(target=self._pipe, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, True), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket, is_answer: bool) -> None:
        offset = 0
        try:
            while data := source.recv(65536):
                if is_answer:
                    data = self._damaged(data, offset)
                    data = self._held(data, offset)
                offset += len(data)
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for end in (source, sink):
                with contextlib.suppress(OSError):
                    end.shutdown(socket.SHUT_RDWR)

    def _damaged(self, data: bytes, offset: int) -> bytes:
        if self.flip_at is None or not offset <= self.flip_at < offset + len(data):
            return data
        damaged = bytearray(data)
        damaged[self.flip_at - offset] ^= 0xFF
        self.flipped += 1
        return bytes(damaged)

    def _held(self, data: bytes, offset: int) -> bytes:
        if self.hold_at is None or offset + len(data) <= self.hold_at:
            return data
        self.holding.set()
        return data[: max(self.hold_at - offset, 0)]
