"""The Redis KV tier against a real redis-server that requires a password and speaks only TLS.

Certificates come from the `openssl` CLI: a CA that signs the server's certificate (for 127.0.0.1),
and a second CA the server never used. A wrong password or an untrusted certificate must cost a
miss, an error counted and a log line naming the cause, never a failed request or the password.
"""

from __future__ import annotations

import logging
import random
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import pytest
from redis_utils import RedisProcess, RedisTLS, start_redis

from kvyard import LLM, SamplingParams
from kvyard.kvcache import KVTierConfig
from kvyard.kvcache.redis_tier import redact_url
from kvyard.kvcache.stats import StoreSnapshot

BLOCK_SIZE = 16
PROMPT = [random.Random(7).randrange(3, 1000) for _ in range(100)]
FULL_PREFIX = (len(PROMPT) - 1) // BLOCK_SIZE * BLOCK_SIZE
PARAMS = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
PASSWORD = "kv p@ss/w:rd"
WRONG_PASSWORD = "not-the-password"


@dataclass(frozen=True)
class Read:
    token_ids: list[int]
    cached_tokens: int
    snapshot: StoreSnapshot


def openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


def make_ca(directory: Path, name: str) -> tuple[Path, Path]:
    cert, key = directory / f"{name}.pem", directory / f"{name}.key"
    openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "1",
        "-subj",
        f"/CN={name}",
        "-keyout",
        str(key),
        "-out",
        str(cert),
    )
    return cert, key


def make_server_tls(directory: Path) -> RedisTLS:
    ca_cert, ca_key = make_ca(directory, "kvyard-test-ca")
    cert, key, request = directory / "server.pem", directory / "server.key", directory / "server.csr"
    extensions = directory / "server.ext"
    extensions.write_text("subjectAltName=IP:127.0.0.1\n")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1", "-keyout", str(key), "-out", str(request))
    openssl(
        "x509",
        "-req",
        "-in",
        str(request),
        "-CA",
        str(ca_cert),
        "-CAkey",
        str(ca_key),
        "-CAcreateserial",
        "-days",
        "1",
        "-extfile",
        str(extensions),
        "-out",
        str(cert),
    )
    return RedisTLS(ca_cert, cert, key, PASSWORD)


@pytest.fixture(scope="module")
def secure_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisProcess]:
    directory = tmp_path_factory.mktemp("secure-redis")
    server = start_redis(directory, tls=make_server_tls(directory))
    yield server
    server.kill()


@pytest.fixture(scope="module")
def expected(llama_dir: Path, secure_redis: RedisProcess) -> list[int]:
    """Greedy token ids of PROMPT from a writer that stored its blocks in the secure Redis."""
    with LLM(str(llama_dir), kv_tier=KVTierConfig(tiers=("redis",), redis_url=secure_redis.url)) as writer:
        output = writer.generate([PROMPT], PARAMS)[0]
    assert output.num_cached_tokens == 0
    assert secure_redis.client().dbsize() > 0
    return output.token_ids


def read(llama_dir: Path, url: str) -> Read:
    with LLM(str(llama_dir), kv_tier=KVTierConfig(tiers=("redis",), redis_url=url)) as reader:
        output = reader.generate([PROMPT], PARAMS)[0]
        snapshot = reader.engine.kv_tier_snapshot()
    assert snapshot is not None
    return Read(output.token_ids, output.num_cached_tokens, snapshot)


def test_a_password_and_tls_share_blocks_between_replicas(
    llama_dir: Path, secure_redis: RedisProcess, expected: list[int]
) -> None:
    got = read(llama_dir, secure_redis.url)
    assert (got.token_ids, got.cached_tokens) == (expected, FULL_PREFIX)
    assert got.snapshot.tiers["redis"].errors == 0


def assert_a_logged_miss(got: Read, expected: list[int], log: str, cause: str, password: str) -> None:
    """The same tokens, nothing from Redis, an error counted and named in the log, never the password."""
    assert (got.token_ids, got.cached_tokens) == (expected, 0)
    assert got.snapshot.tiers["redis"].errors >= 1
    assert cause in log
    assert quote(password, safe="") not in log


def test_a_wrong_password_is_a_logged_miss(
    llama_dir: Path, secure_redis: RedisProcess, expected: list[int], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="kvyard.kvcache.redis_tier"):
        got = read(llama_dir, secure_redis.tls_url(password=WRONG_PASSWORD))
    assert_a_logged_miss(got, expected, caplog.text, "AuthenticationError", WRONG_PASSWORD)


def test_an_untrusted_certificate_is_a_logged_miss(
    llama_dir: Path,
    tmp_path: Path,
    secure_redis: RedisProcess,
    expected: list[int],
    caplog: pytest.LogCaptureFixture,
) -> None:
    other_ca, _ = make_ca(tmp_path, "other-ca")
    with caplog.at_level(logging.WARNING, logger="kvyard.kvcache.redis_tier"):
        got = read(llama_dir, secure_redis.tls_url(ca_file=other_ca))
    assert_a_logged_miss(got, expected, caplog.text, "CERTIFICATE_VERIFY_FAILED", PASSWORD)


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
        ("rediss://:se%40cret@kv:6380/0?ssl_ca_certs=/ca.pem", "rediss://:***@kv:6380/0?ssl_ca_certs=/ca.pem"),
        ("rediss://app:secret@kv:6380/0", "rediss://app:***@kv:6380/0"),
        ("redis://kv:6379/0?db=1&password=secret", "redis://kv:6379/0?db=1&password=***"),
    ],
)
def test_the_logged_url_masks_the_password(url: str, shown: str) -> None:
    assert redact_url(url) == shown
