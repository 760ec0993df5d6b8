"""The simulated replica's tokenizer and its deterministic output.

Text is tokenized trivially: one token per UTF-8 byte (ids 0-255). Chat messages render as
`<|role|>\\ncontent\\n` per message plus `<|assistant|>\\n`. Generated tokens are lowercase letters
and spaces (byte ids), chosen deterministically from the request, so a client that sends the
answer text back as part of its next prompt tokenizes it to exactly the generated ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

BYTE_VOCAB = 256
_SPACE = 0x20
_LETTER_A = 0x61
_WORD_LENGTH = 6


def encode(text: str) -> list[int]:
    return list(text.encode())


def decode(token_ids: Sequence[int]) -> str:
    try:
        data = bytes(token_ids)
    except ValueError:  # ids beyond one byte decode to nothing
        data = bytes(t for t in token_ids if 0 <= t < BYTE_VOCAB)
    return data.decode(errors="replace")


def render_chat(messages: Sequence[tuple[str, str]], add_generation_prompt: bool = True) -> str:
    text = "".join(f"<|{role}|>\n{content}\n" for role, content in messages)
    return text + "<|assistant|>\n" if add_generation_prompt else text


def output_seed(prompt: Sequence[int], seed: int | None) -> int:
    """A per-request number that fixes its output: equal prompts (and seeds) give equal answers."""
    # Hashes of ints and tuples of ints are the same in every process (no hash randomisation).
    return hash((len(prompt), tuple(prompt[-16:]), -1 if seed is None else seed)) & 0x7FFFFFFF


def output_token(request_seed: int, index: int) -> int:
    if index % _WORD_LENGTH == _WORD_LENGTH - 1:
        return _SPACE
    return _LETTER_A + (request_seed + index * 7) % 26


class ByteTokenizer:
    """The functions above as a tokenizer object, for the engine's detokenizer and the replica API."""

    cheap = True  # one token per byte: no need to leave the event loop
    chat_template: str | None = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return encode(text)

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        template_kwargs: dict[str, Any] | None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """The simulator's fixed chat format; tool definitions and calls are left out of it."""
        return encode(render_chat([(str(m["role"]), str(m["content"])) for m in messages], add_generation_prompt))

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return decode(token_ids)
