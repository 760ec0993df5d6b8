"""Limits that hold: body size, slow and idle clients, sequences per request, strict input (never a 500)."""

from __future__ import annotations

import json
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvyard.api.protocol import CompletionRequest
from kvyard.engine.scheduling.scheduler import SchedulerConfig
from kvyard.net.http_server import HttpServerConfig
from kvyard.sim.config import SimConfig
from kvyard.testing.sim_cluster import SimCluster, sim_server_options

MODEL = "sim-model"
LIMITS = HttpServerConfig(max_body_mb=1.0, request_read_timeout_s=1.0, idle_timeout_s=1.5)
CONFIG = SimConfig(
    model_name=MODEL, block_size=4, num_kv_blocks=512, time_scale=0.01, scheduler=SchedulerConfig(max_num_seqs=4)
)


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with SimCluster([CONFIG], sim_server_options(max_queued_seqs=4, http=LIMITS)) as sim:
        yield sim.urls[0]


def post_raw(url: str, body: bytes) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", content=body, headers={"content-type": "application/json"}, timeout=30)


BAD_BODIES = [
    (b'{"prompt": "\\ud800", "max_tokens": 1}', "body"),  # a lone surrogate
    (b'{"prompt": "x", "model": "\\udfff"}', "body"),
    (b'{"prompt": "x", "a": ' + b"[" * 1100 + b"]" * 1100 + b"}", "body"),  # nested past the parser's limit
    (b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", "body"),  # an integer of 5,000 digits
    (b'{"prompt": "x", "seed": 18446744073709551616}', "seed"),  # beyond 64 bits
    (b'{"prompt": "x", "seed": 9223372036854775807}', "seed"),  # seed + choice must stay in 64 bits
    (b'{"prompt": [0, 1, "2"]}', "prompt"),  # no silent coercion
    (b'{"prompt": [[false]]}', "prompt"),
    (b'{"prompt": "x", "n": true}', "n"),
    (b'{"prompt": "x", "max_tokens": 2.0}', "max_tokens"),
    (json.dumps({"prompt": ["x"] * 300}).encode(), "prompt"),  # a prompt list past the cap
    (json.dumps({"prompt": ["x"] * 8, "n": 2}).encode(), "n"),  # 16 sequences; the server takes 8 at once
    (json.dumps({"prompt": [1, 2], "n": 2, "resume": {"token_ids": [3], "sent_chars": 0}}).encode(), "resume"),
    (
        json.dumps({"prompt": [1, 2], "max_tokens": 2, "resume": {"token_ids": [3, 4], "sent_chars": 0}}).encode(),
        "resume.token_ids",
    ),  # nothing left to generate
    (json.dumps({"prompt": [1, 2], "resume": {"token_ids": [-1], "sent_chars": 0}}).encode(), "resume.token_ids"),
    (json.dumps({"prompt": [1] * 3000, "max_tokens": 1}).encode(), "prompt"),  # alone past the KV pool (2048)
    (json.dumps({"prompt": [1] * 1000, "max_tokens": 1500}).encode(), "max_tokens"),  # only with max_tokens
    (json.dumps({"prompt": [1] * 131072, "max_tokens": 4}).encode(), "prompt"),  # alone fills the context
]


@pytest.mark.parametrize(("body", "param"), BAD_BODIES)
def test_bad_input_is_a_400_naming_the_field_never_a_500(url: str, body: bytes, param: str) -> None:
    response = post_raw(url, body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert httpx.post(f"{url}/v1/completions", json={"prompt": [1, 2], "max_tokens": 1}).status_code == 200


def test_the_largest_seed_works(url: str) -> None:
    body = {"prompt": [1, 2], "max_tokens": 2, "n": 4, "seed": 2**63 - 1 - 16, "temperature": 1.0}
    assert httpx.post(f"{url}/v1/completions", json=body, timeout=30).status_code == 200


def test_a_body_over_the_limit_gets_413_and_the_server_stays_up(url: str) -> None:
    body = json.dumps({"prompt": "x" * (2 << 20)}).encode()
    try:
        response = post_raw(url, body)
        assert response.status_code == 413 and response.json()["error"]["code"] == "body_too_large"
    except httpx.TransportError:
        pass  # the server may close while the client still sends; either way nothing was read into memory
    assert httpx.get(f"{url}/health").status_code == 200


def test_a_slow_client_gets_408_and_its_connection_closed(url: str) -> None:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"prompt"')
        started = time.monotonic()
        answer = _read_until_closed(sock)
    assert answer.startswith(b"HTTP/1.1 408") and b"did not arrive within" in answer
    assert time.monotonic() - started < 10


def test_an_idle_connection_is_closed(url: str) -> None:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        assert _read_until_closed(sock) == b""  # closed without a word, well before the socket's timeout


def test_a_request_within_the_sequence_limit_is_queued_and_answered(url: str) -> None:
    body = {"prompt": [[1, 2, 3]] * 4, "n": 2, "max_tokens": 3}  # 8 sequences: exactly the limit
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
    assert response.status_code == 200 and len(response.json()["choices"]) == 8


def _read_until_closed(sock: socket.socket) -> bytes:
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def _self_signed(tmp_path: Path) -> tuple[Path, Path]:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    return cert, key


def test_kvyard_serve_with_tls_says_https_where_it_listens(llama_dir: Path, tmp_path: Path) -> None:
    cert, key = _self_signed(tmp_path)
    command = [
        sys.executable,
        "-m",
        "kvyard",
        "serve",
        str(llama_dir),
        "--port",
        "0",
        "--kv-tier",
        "memory",
        "--ssl-certfile",
        str(cert),
        "--ssl-keyfile",
        str(key),
    ]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as server:
        try:
            assert server.stdout is not None
            banner = next(line for line in server.stdout if "listening on" in line)
            assert "listening on https://" in banner, banner
        finally:
            server.terminate()


def test_tls_serves_https_with_the_given_certificate(tmp_path: Path) -> None:
    cert, key = _self_signed(tmp_path)
    tls = HttpServerConfig(ssl_certfile=str(cert), ssl_keyfile=str(key))
    with SimCluster([CONFIG], sim_server_options(http=tls)) as sim:
        https = sim.urls[0].replace("http://", "https://")
        trust = ssl.create_default_context(cafile=str(cert))
        assert httpx.get(f"{https}/health", verify=trust).status_code == 200
        response = httpx.post(f"{https}/v1/completions", json={"prompt": [1, 2], "max_tokens": 1}, verify=trust)
        assert response.status_code == 200
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{sim.urls[0]}/health", timeout=5)  # plain HTTP to a TLS port


def test_the_openapi_document_describes_the_request_bodies(url: str) -> None:
    document = httpx.get(f"{url}/openapi.json").json()
    body = document["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    schema = document["components"]["schemas"][body["$ref"].rsplit("/", 1)[1]]
    assert set(schema["properties"]) == set(CompletionRequest.model_fields) and schema["required"] == ["prompt"]
    assert schema["additionalProperties"] is True  # unknown fields are ignored (with a warning), as the server does
