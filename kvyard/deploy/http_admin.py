"""What the controller asks of routers (their admin plane: the replica list) and replicas (their load), over HTTP.

The discovery adapter between Ray and the router is this: the controller learns each replica actor's URL from
Ray and sets every router's list through `/admin/replicas`, as an operator would by hand.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode


class AdminError(RuntimeError):
    """A router or replica could not be reached, or refused."""


@dataclass(frozen=True, slots=True)
class AdminClient:
    bearer_key: str
    timeout_s: float = 5.0

    def replicas(self, router_url: str) -> dict[str, dict[str, Any]]:
        """The router's replicas by URL, as it describes them (state, in_flight, load, ...)."""
        body = self._call("GET", f"{router_url}/admin/replicas")
        return {entry["url"]: entry for entry in body["replicas"]}

    def add(
        self,
        router_url: str,
        replica_url: str,
        events: str | None = None,
        api_key: str | None = None,
        admin_key: str | None = None,
    ) -> None:
        """Route to `replica_url`, sent `api_key` and `admin_key` (the router sends an added replica no other keys)."""
        body = {"url": replica_url, "events": events, "api_key": api_key, "admin_key": admin_key}
        self._call("POST", f"{router_url}/admin/replicas", {k: v for k, v in body.items() if v is not None})

    def drain(self, router_url: str, replica_url: str) -> None:
        self._call("POST", f"{router_url}/admin/replicas/drain", {"url": replica_url})

    def remove(self, router_url: str, replica_url: str) -> None:
        self._call("DELETE", f"{router_url}/admin/replicas?{urlencode({'url': replica_url})}")

    def load(self, replica_url: str) -> dict[str, Any]:
        """The replica's load report (GET /load)."""
        return self._call("GET", f"{replica_url}/load")

    def _call(self, method: str, url: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(url, data=data, method=method)
        request.add_header("Authorization", f"Bearer {self.bearer_key}")
        if data is not None:
            request.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                answer: dict[str, Any] = json.loads(response.read() or b"{}")
                return answer
        except urllib.error.HTTPError as error:
            raise AdminError(f"{method} {url}: {error.code} {error.read()[:200]!r}") from None
        except (urllib.error.URLError, OSError, ValueError) as error:
            raise AdminError(f"{method} {url}: {error}") from None
