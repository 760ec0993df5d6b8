"""Settings of the HTTP side of a replica (a module of its own: the command line reads it without the server)."""

from __future__ import annotations

from dataclasses import dataclass

from kvyard.settings import setting


@dataclass(frozen=True, slots=True)
class ServerOptions:
    """Server: the HTTP side of a replica."""

    max_queued_requests: int = setting(512, help="requests accepted beyond --max-num-seqs before answering 429")
    cache_salt_per_api_key: bool = setting(False, help="isolate prefix caches by the request's bearer token")
    ignore_unknown_fields: bool = setting(False, help="ignore request fields kvyard does not know instead of "
                                          "answering 400 (for clients that send other engines' fields)")  # fmt: skip
    shutdown_grace_s: float = setting(60.0, help="on SIGTERM, how long requests in flight may take to finish")
    owned_by: str = "kvyard"

    def __post_init__(self) -> None:
        if self.max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be >= 0, got {self.max_queued_requests}")
