"""Who may call a replica or the router, and whose cache a request may read (docs/contracts.md §8).

Clients send `Authorization: Bearer <key>`. A server with API keys answers requests without one of them
401; a server without keys serves anyone (a replica behind a router on a private network). The admin
plane (the router's `/admin/*`, a replica's `/kv/*` and fault injection) needs the admin key and is off
when none is set. Keys are compared by their SHA-256 digests, so the comparison reveals nothing about a
key's bytes.

The cache salt of a request is derived by the party that authenticates its key and *combined with* the
request's own `cache_salt`, never replaced by it: a tenant can split its own cache, never reach into
another's. Router and replica derive it with the same function, so the router's predicted cache hits
match what the replica reports.
"""

from __future__ import annotations

import enum
import hashlib
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from kvyard.api.errors import APIError
from kvyard.settings import setting

API_KEYS_ENV = "KVYARD_API_KEYS"  # comma-separated
ADMIN_KEY_ENV = "KVYARD_ADMIN_KEY"


ADMIN_KEY_HEADER = "x-kvyard-admin-key"  # the admin key beside an API key, on requests that need both
REPLICA_API_KEY_ENV = "KVYARD_REPLICA_API_KEY"
REPLICA_ADMIN_KEY_ENV = "KVYARD_REPLICA_ADMIN_KEY"


class Access(enum.Enum):
    """Who may call a route."""

    PUBLIC = "public"  # anyone (health, version)
    API = "api"  # a holder of an API key, when keys are set
    ADMIN = "admin"  # the holder of the admin key; nobody when none is set


@dataclass(frozen=True, slots=True)
class AccessConfig:
    """Access: API keys, the admin key, and prefix caches split by key."""

    api_keys: list[str] = setting(
        default_factory=list,
        flag="--api-key",
        help="a key clients must send as "
        "`Authorization: Bearer <key>` (repeatable; also $KVYARD_API_KEYS, "
        "comma-separated)",
        default_text="none: no key needed",
        secret=True,
    )
    api_keys_file: str | None = setting(None, help="a file of API keys, one per line, read again on SIGHUP")
    admin_key: str | None = setting(
        None,
        help="the key of the admin plane (also $KVYARD_ADMIN_KEY)",
        default_text="none: the admin plane is off",
        secret=True,
    )
    metrics_need_key: bool = setting(False, help="answer /metrics only to a caller with an API key")
    cache_salt_per_api_key: bool = setting(
        False,
        help="split the prefix cache by API key: a request's cache_salt then splits only its own key's cache further",
    )
    requests_per_min: float | None = setting(
        None,
        help="requests a client (its API key, else its address) may send per minute; more get 429",
        default_text="none: no limit",
    )
    tokens_per_min: float | None = setting(
        None,
        help="prompt plus max_tokens a client may ask for per minute (a "
        "router estimates text prompts at four characters a token)",
        default_text="none: no limit",
    )


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def bearer_token(headers: Mapping[str, str]) -> str | None:
    """The token of an `Authorization: Bearer ...` header (header names in lower case), else None."""
    value = headers.get("authorization", "")
    scheme, _, token = value.partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


@dataclass(slots=True)
class KeySet:
    """The API keys a server accepts: given on the command line, in an environment variable, or in a file of
    one key per line (re-read by `reload`, e.g. on SIGHUP, so keys rotate without a restart)."""

    given: tuple[str, ...] = ()
    keys_file: Path | None = None
    _digests: frozenset[bytes] = field(init=False, default=frozenset())

    def __post_init__(self) -> None:
        self.reload()

    @classmethod
    def from_settings(
        cls, keys: Iterable[str], keys_file: str | None, environ: Mapping[str, str] = os.environ
    ) -> KeySet:
        from_env = [key.strip() for key in environ.get(API_KEYS_ENV, "").split(",")]
        return cls(tuple(key for key in [*keys, *from_env] if key), Path(keys_file) if keys_file else None)

    def reload(self) -> None:
        """Read the keys file again; a file that cannot be read keeps the keys in force and raises OSError."""
        keys = list(self.given)
        if self.keys_file is not None:
            lines = self.keys_file.read_text().splitlines()
            keys += [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
        self._digests = frozenset(_digest(key) for key in keys)

    @property
    def enabled(self) -> bool:
        return bool(self._digests) or self.keys_file is not None

    def authenticate(self, headers: Mapping[str, str]) -> str | None:
        """The caller's key; None when no keys are configured. Raises 401 for a missing or unknown key."""
        if not self.enabled:
            return None
        token = bearer_token(headers)
        if token is None:
            raise APIError(401, "missing API key: send `Authorization: Bearer <key>`", code="missing_api_key")
        if _digest(token) not in self._digests:
            raise APIError(401, "invalid API key", code="invalid_api_key")
        return token


def admin_key_of(configured: str | None, environ: Mapping[str, str] = os.environ) -> str | None:
    """The admin key in force: the configured one, else $KVYARD_ADMIN_KEY, else None (the admin plane is off)."""
    return configured or environ.get(ADMIN_KEY_ENV) or None


@dataclass(frozen=True, slots=True)
class AdminKey:
    """The key of the admin plane; without one, the admin plane is off."""

    digest: bytes | None

    @classmethod
    def from_settings(cls, key: str | None, environ: Mapping[str, str] = os.environ) -> AdminKey:
        key = admin_key_of(key, environ)
        return cls(_digest(key) if key else None)

    def authorize(self, headers: Mapping[str, str], what: str) -> None:
        """Raise 403 when the admin plane is off, 401 when the caller does not hold the admin key."""
        if self.digest is None:
            raise APIError(
                403,
                f"{what} is part of the admin plane, which is off: start with --admin-key (or ${ADMIN_KEY_ENV})",
                code="admin_disabled",
            )
        token = bearer_token(headers)
        if token is None or _digest(token) != self.digest:
            raise APIError(401, f"{what} needs the admin key", code="invalid_admin_key")

    def authorize_extra(self, headers: Mapping[str, str], what: str) -> None:
        """Like `authorize`, for a request whose `Authorization` carries an API key: the admin key comes in the
        `X-KVyard-Admin-Key` header."""
        self.authorize({"authorization": f"Bearer {headers.get(ADMIN_KEY_HEADER, '')}"}, what)


def key_salt(api_key: str) -> str:
    """A tenant's cache salt, derived from its key (the key itself never enters a block key's namespace)."""
    return "key:" + hashlib.sha256(api_key.encode()).hexdigest()[:32]


def tenant_salt(api_key: str | None, request_salt: str | None, per_key: bool) -> str | None:
    """The cache salt a request runs under: its key's salt (when caches are split by key) combined with the
    request's own `cache_salt`."""
    if not per_key or api_key is None:
        return request_salt
    base = key_salt(api_key)
    return base if request_salt is None else f"{base}/{request_salt}"
