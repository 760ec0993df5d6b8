"""Incremental detokenization and stop-string matching for one request."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


class Decoder(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class Tokenizer(Decoder, Protocol):
    """What the engine reads text with: decoding its output, encoding a request's bad words."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


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
    skip_special_tokens: bool = True  # False: special tokens are part of the text
    token_ids: list[int] = field(default_factory=list)
    text: str = ""  # the output text so far (cut at a matched stop string)
    emitted: int = 0  # characters of `text` already handed out as deltas
    prefix_offset: int = 0
    read_offset: int = 0
    _holdback: int = field(init=False)  # characters kept back until they cannot start a stop string

    def __post_init__(self) -> None:
        self._holdback = max((len(s) for s in self.stop), default=1) - 1

    def push(self, token_id: int) -> tuple[str, str | None]:
        """Add a token. Returns (text safe to emit now, matched stop string or None)."""
        self.token_ids.append(token_id)
        before = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        after = self._decode(self.token_ids[self.prefix_offset :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return "", None
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        stop = self._append_checking_stop(after[len(before) :])
        return self._emit(final=stop is not None), stop

    def finish(self) -> str:
        """Flush everything held back (stop-string look-ahead, an incomplete last character)."""
        full = self._decode(self.token_ids[self.prefix_offset :])
        before = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        self.read_offset = len(self.token_ids)
        self._append_checking_stop(full[len(before) :])
        return self._emit(final=True)

    def _decode(self, token_ids: list[int]) -> str:
        return self.decoder.decode(token_ids, skip_special_tokens=self.skip_special_tokens)

    def _append_checking_stop(self, delta: str) -> str | None:
        """Append `delta`; if a stop string now appears, cut the text there and return it."""
        old_len = len(self.text)
        self.text += delta
        if not self.stop:
            return None
        search_from = max(0, old_len - self._holdback)
        matches = [(found, stop) for stop in self.stop if (found := self.text.find(stop, search_from)) >= 0]
        if not matches:
            return None
        found, stop = min(matches, key=lambda match: (match[0], -len(match[1])))
        self.text = self.text[: found + len(stop) if self.include_stop_str_in_output else found]
        return stop

    def _emit(self, final: bool) -> str:
        end = len(self.text) if final else max(self.emitted, len(self.text) - self._holdback)
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta
