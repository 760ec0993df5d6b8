"""Following a streamed answer, so that another replica can finish it when its replica fails mid-stream.

The router asks the replica for progress lines (`stream_progress`): before each chunk an SSE comment
`: progress <characters sent> <new token ids> [end]`, which clients would skip anyway. The router keeps
those lines' bytes, drops them from what it relays, and passes every chunk through untouched: no JSON is
parsed on the way. Only when the replica's connection breaks before the stream's end are the lines (and
the first chunk, for the stream's id) parsed: the next replica gets the same request plus `resume`, the
tokens generated so far, how much of their text the client has and the stream's id. It prefills prompt
and those tokens, generates the rest (a greedy or seeded stream then continues exactly) and streams only
text the client does not have yet. Chunks reach the client whole: a half event of a failed replica never
does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson

_EVENT_END = b"\n\n"
_PROGRESS = b": progress "
_DONE = b"data: [DONE]"
_ERROR = b'data: {"error"'


class Follower(Protocol):
    """Follows one streamed choice as the client receives it, so that another replica can finish it."""

    relayed: bool  # some event reached the client

    @property
    def answered(self) -> bool: ...  # the choice's last chunk reached the client (only usage may be missing)

    @property
    def resumable(self) -> bool: ...

    @property
    def kinds(self) -> frozenset[str]: ...  # the kinds of replica that can resume it

    def upstream_path(self, path: str) -> str: ...

    def upstream_body(self, body: dict[str, Any]) -> bytes: ...

    def start_attempt(self) -> None: ...

    def feed(self, data: bytes) -> bytes: ...  # what of the replica's bytes the client gets


@dataclass(slots=True)
class StreamFollower:
    """The state of one streamed choice as the client has received it."""

    _progress: list[bytes] = field(default_factory=list)  # the progress lines relayed, unparsed
    _first_chunk: bytes | None = None
    _partial: bytes = b""
    relayed: bool = False  # some event reached the client
    ended: bool = False  # [DONE] or an error event reached the client

    @classmethod
    def for_request(cls, kind: str, body: dict[str, Any]) -> StreamFollower | None:
        """A follower for a stream that can be resumed (one choice, one prompt), else None."""
        if body.get("stream") is not True or body.get("n", 1) != 1 or "resume" in body:
            return None
        prompt = body.get("prompt")
        if kind == "completion" and isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            return None  # a list of prompts is several choices
        return cls()

    @property
    def kinds(self) -> frozenset[str]:
        """The replicas that can resume it: kvyard's (and its simulator's), which take `resume`."""
        return frozenset({"kvyard"})

    def upstream_path(self, path: str) -> str:
        return path

    def upstream_body(self, body: dict[str, Any]) -> bytes:
        """What the next replica gets: the request, asking for progress lines, and where to resume once the
        client has part of the answer."""
        upstream = {**body, "stream_progress": True}
        if self.relayed:
            upstream["resume"] = self._resume_state()
        return orjson.dumps(upstream)

    def start_attempt(self) -> None:
        self._partial = b""  # the half event of a replica that failed never reaches the client

    @property
    def answered(self) -> bool:
        """The choice's last chunk (with its finish_reason) reached the client."""
        return bool(self._progress) and self._progress[-1].endswith(b" end")

    @property
    def resumable(self) -> bool:
        return not (self.answered or self.ended)

    def feed(self, data: bytes) -> bytes:
        """The complete events in `data` (and what came before it), as the client gets them."""
        if self._partial:
            data = self._partial + data
        end = data.rfind(_EVENT_END)
        if end < 0:
            self._partial = data
            return b""
        cut = end + len(_EVENT_END)
        self._partial = data[cut:]
        out = [self._event(event) for event in data[:cut].split(_EVENT_END) if event]
        self.relayed = self.relayed or bool(out)
        return b"".join(out)

    def _event(self, event: bytes) -> bytes:
        if event.startswith(_PROGRESS):
            line_end = event.find(b"\n")
            self._progress.append(event[len(_PROGRESS) : line_end])
            event = event[line_end + 1 :]
            if self._first_chunk is None:
                self._first_chunk = event
        elif event.startswith(_DONE) or event.startswith(_ERROR):
            self.ended = True
        elif self._first_chunk is None and event.startswith(b"data: {"):
            self._first_chunk = event  # a chat stream's role chunk
        return event + _EVENT_END

    def _resume_state(self) -> dict[str, Any]:
        token_ids: list[int] = []
        sent_chars = 0
        for line in self._progress:
            chars, _, rest = line.partition(b" ")
            sent_chars = int(chars)
            ids = rest.removesuffix(b" end").strip()
            if ids:
                token_ids.extend(map(int, ids.split(b",")))
        first = orjson.loads(self._first_chunk.removeprefix(b"data: ")) if self._first_chunk else {}
        return {
            "token_ids": token_ids,
            "sent_chars": sent_chars,
            "id": first.get("id"),
            "created": first.get("created"),
        }
