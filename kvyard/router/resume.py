"""Following a streamed answer, so that another replica can finish it when its replica fails mid-stream.

The router asks the replica for each chunk's token ids (`return_token_ids`) and counts the characters
it relays. If the replica's connection breaks before the stream's end, the next replica gets the same
request plus `resume`: the tokens generated so far and how much of their text the client has. It
prefills prompt and those tokens, generates the rest (greedy output is then the one the first replica
would have produced) and streams only text the client does not have yet. Chunks go to the client
whole, with the stream's first `id` and `created`, and without `token_ids` unless the client asked.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

_EVENT_END = b"\n\n"
_DATA = b"data: "


@dataclass(slots=True)
class StreamFollower:
    """The state of one streamed choice as the client has received it."""

    kind: str  # "completion" | "chat"
    client_wants_token_ids: bool
    token_ids: list[int] = field(default_factory=list)
    sent_chars: int = 0
    relayed: bool = False  # some event reached the client
    answered: bool = False  # the choice's last chunk (with its finish_reason) reached the client
    ended: bool = False  # [DONE] or an error event reached the client
    stream_id: str | None = None
    created: int | None = None
    _partial: bytes = b""

    @classmethod
    def for_request(cls, kind: str, body: dict[str, Any]) -> StreamFollower | None:
        """A follower for a stream that can be resumed (one choice, one prompt), else None."""
        if body.get("stream") is not True or body.get("n", 1) != 1 or "resume" in body:
            return None
        prompt = body.get("prompt")
        if kind == "completion" and isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            return None  # a list of prompts is several choices
        return cls(kind, body.get("return_token_ids") is True)

    def upstream_body(self, body: dict[str, Any]) -> bytes:
        """What the next replica gets: the request, asking for token ids, and where to resume once the client
        has part of the answer."""
        upstream = {**body, "return_token_ids": True}
        if self.relayed:
            upstream["resume"] = {"token_ids": self.token_ids, "sent_chars": self.sent_chars}
        return orjson.dumps(upstream)

    def start_attempt(self) -> None:
        self._partial = b""  # the half event of a replica that failed never reaches the client

    @property
    def resumable(self) -> bool:
        return not (self.answered or self.ended)

    def feed(self, data: bytes) -> bytes:
        """The complete events in `data` (and what came before it), as the client gets them."""
        self._partial += data
        end = self._partial.rfind(_EVENT_END)
        if end < 0:
            return b""
        complete, self._partial = self._partial[: end + len(_EVENT_END)], self._partial[end + len(_EVENT_END) :]
        out = [self._event(event) for event in complete.split(_EVENT_END) if event.strip()]
        if out:
            self.relayed = True
        return b"".join(out)

    def _event(self, event: bytes) -> bytes:
        if not event.startswith(_DATA):
            return event + _EVENT_END
        data = event[len(_DATA) :]
        if data.strip() == b"[DONE]":
            self.ended = True
            return event + _EVENT_END
        payload = orjson.loads(data)
        if not isinstance(payload, dict) or "error" in payload:
            self.ended = True
            return event + _EVENT_END
        self._follow(payload)
        return _DATA + orjson.dumps(payload) + _EVENT_END

    def _follow(self, payload: dict[str, Any]) -> None:
        if self.stream_id is None:
            self.stream_id, self.created = payload.get("id"), payload.get("created")
        else:  # a continuation keeps the stream's identity
            payload["id"], payload["created"] = self.stream_id, self.created
        for choice in payload.get("choices") or ():
            token_ids = choice.get("token_ids") if self.client_wants_token_ids else choice.pop("token_ids", None)
            if isinstance(token_ids, list):
                self.token_ids.extend(token_ids)
            text = choice.get("delta", {}).get("content") if self.kind == "chat" else choice.get("text")
            if isinstance(text, str):
                self.sent_chars += len(text)
            if choice.get("finish_reason") is not None:
                self.answered = True
