"""Incremental detokenization and stop-string matching for one request."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


class Decoder(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


@dataclass(slots=True)
class IncrementalDetokenizer:
    """Emits text as tokens arrive without re-decoding the whole output each step.

    Decodes a short window that starts a little before the new tokens, so merges across token
    boundaries (leading spaces, multi-byte characters) come out right; text that ends in an
    incomplete UTF-8 sequence is held back until the next token completes it.
    """

    decoder: Decoder
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    prefix_offset: int = 0
    read_offset: int = 0

    def push(self, token_id: int) -> tuple[str, str | None]:
        """Add a token. Returns (new text, matched stop string or None)."""
        self.token_ids.append(token_id)
        window_start = self.prefix_offset
        before = self.decoder.decode(self.token_ids[window_start : self.read_offset], skip_special_tokens=True)
        after = self.decoder.decode(self.token_ids[window_start:], skip_special_tokens=True)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return "", None
        delta = after[len(before) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        return self._append_checking_stop(delta)

    def _append_checking_stop(self, delta: str) -> tuple[str, str | None]:
        old_len = len(self.text)
        self.text += delta
        if not self.stop:
            return delta, None
        longest = max(len(s) for s in self.stop)
        search_from = max(0, old_len - longest + 1)
        for stop in self.stop:
            found = self.text.find(stop, search_from)
            if found >= 0:
                end = found + len(stop) if self.include_stop_str_in_output else found
                self.text = self.text[:end]
                return self.text[old_len:], stop
        return delta, None

    def finish(self) -> str:
        """Flush held-back text (an incomplete character at the very end) once generation ends."""
        full = self.decoder.decode(self.token_ids[self.prefix_offset :], skip_special_tokens=True)
        before = self.decoder.decode(self.token_ids[self.prefix_offset : self.read_offset], skip_special_tokens=True)
        tail = full[len(before) :]
        self.text += tail
        self.read_offset = len(self.token_ids)
        return tail
