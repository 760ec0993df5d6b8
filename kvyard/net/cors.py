"""Cross-origin requests from browsers (CORS): which web pages may call the server, and the headers that say so.

Closed unless configured: without `--allowed-origins` the server sends no CORS headers, so a browser refuses
to let a page on another origin read its answers (a page a user happens to visit cannot use a server on their
machine or network). With it, a request whose `Origin` is allowed gets `Access-Control-Allow-Origin` on its
answer, and a preflight (`OPTIONS` with `Access-Control-Request-Method`) from an allowed origin is answered by
the server itself, allowing the method and the headers it asks for; one from another origin gets 400. No
credentials mode: API keys travel in the `Authorization` header, which a preflight allows, not in cookies.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

PREFLIGHT_MAX_AGE_S = 600
ALLOWED_METHODS = "GET, HEAD, POST, PUT, DELETE, OPTIONS"


@dataclass(frozen=True, slots=True)
class CorsPolicy:
    origins: frozenset[str]
    any_origin: bool = False

    @classmethod
    def parse(cls, text: str | None) -> CorsPolicy | None:
        """From `--allowed-origins`: a comma-separated list of origins (scheme://host[:port]) or `*`; None or an
        empty text: no CORS. ValueError names what is not an origin."""
        if text is None or not text.strip():
            return None
        items = [item.strip() for item in text.split(",") if item.strip()]
        if "*" in items:
            return cls(frozenset(), any_origin=True)
        for item in items:
            parts = urlsplit(item)
            if parts.scheme not in ("http", "https") or not parts.netloc or parts.path or parts.query:
                raise ValueError(f"allowed_origins: {item!r} is not an origin (scheme://host[:port], no path) or *")
        return cls(frozenset(item.rstrip("/").lower() for item in items))

    def allows(self, origin: str) -> bool:
        return self.any_origin or origin.lower() in self.origins

    def answer_headers(self, origin: str) -> list[tuple[str, str]]:
        """Headers for the answer to an allowed origin's request."""
        return [
            ("Access-Control-Allow-Origin", "*" if self.any_origin else origin),
            ("Vary", "Origin"),
            ("Access-Control-Expose-Headers", "*"),
        ]

    def preflight_headers(self, origin: str, requested_headers: str | None) -> list[tuple[str, str]]:
        """Headers for the answer to an allowed origin's preflight: the methods served, the headers it asked for."""
        headers = [
            ("Access-Control-Allow-Origin", "*" if self.any_origin else origin),
            ("Vary", "Origin"),
            ("Access-Control-Allow-Methods", ALLOWED_METHODS),
            ("Access-Control-Max-Age", str(PREFLIGHT_MAX_AGE_S)),
        ]
        if requested_headers:
            headers.append(("Access-Control-Allow-Headers", requested_headers))
        return headers
