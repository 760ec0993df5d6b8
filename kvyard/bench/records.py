"""What the client measured for one request, shared by the client, the metrics and the reports."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class RequestRecord:
    """One request. Times are seconds since the benchmark started, on the monotonic clock."""

    index: int
    session: int
    turn: int
    prompt_tokens: int  # tokens the client sent
    max_tokens: int
    scheduled: float | None = None  # intended start in open-loop and trace arrivals
    start: float = 0.0  # when the request was handed to the HTTP client
    end: float = 0.0  # when the response was fully read (or failed)
    token_times: list[float] = field(default_factory=list)  # arrival of every chunk that carried output
    output_tokens: int = 0  # usage.completion_tokens when the server reports it, else the chunk count
    server_prompt_tokens: int | None = None  # usage.prompt_tokens
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens
    ideal_cached_tokens: int = 0  # longest prefix, in whole blocks, already sent by an earlier request
    error: str | None = None  # error type: http_429, http_500, timeout, connection, stream_error, ...
    error_message: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.start if self.token_times else None

    @property
    def e2e(self) -> float:
        return self.end - self.start

    def to_json(self) -> dict[str, Any]:
        # Not dataclasses.asdict: it deep-copies every list, and results hold tens of thousands of records.
        return {name: getattr(self, name) for name in self.__dataclass_fields__}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RequestRecord:
        return cls(**data)
