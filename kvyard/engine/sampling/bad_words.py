"""vLLM's `bad_words`: words a request never generates, as token sequences, and the tokens they ban next.

A word is tokenized without a leading space (a word that starts the text) and with one (a word inside it), the
latter kept only where it is another sequence of as many tokens, as vLLM tokenizes them. A sequence bans its last
token wherever the output so far ends with the tokens before it; a one-token sequence bans its token outright.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kvyard.api.errors import InputError

MAX_BAD_WORD_SEQUENCES = 128  # token sequences of one request's bad words, with and without the leading space
PARAM = "bad_words"


class Encoder(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


def bad_words_token_ids(words: Sequence[str], encoder: Encoder, vocab_size: int) -> list[tuple[int, ...]]:
    """The token sequences of `words`; a word without tokens, a token outside the vocabulary or too many
    sequences in all are an `InputError` naming bad_words."""
    sequences: list[tuple[int, ...]] = []
    for word in words:
        bare = tuple(encoder.encode(word.lstrip(), add_special_tokens=False))
        if not bare:
            raise InputError(f"bad word {word[:40]!r} has no tokens", PARAM)
        sequences.append(bare)
        spaced = tuple(encoder.encode(" " + word.lstrip(), add_special_tokens=False))
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            sequences.append(spaced)
    if len(sequences) > MAX_BAD_WORD_SEQUENCES:
        raise InputError(
            f"bad words make {len(sequences)} token sequences (with and without a leading space); "
            f"at most {MAX_BAD_WORD_SEQUENCES} are taken",
            PARAM,
        )
    outside = next((t for sequence in sequences for t in sequence if not 0 <= t < vocab_size), None)
    if outside is not None:
        raise InputError(f"bad words tokenize to id {outside}, outside the model's vocabulary [0, {vocab_size})", PARAM)
    return sequences


def banned_by_bad_words(
    sequences: Sequence[tuple[int, ...]], output_token_ids: Sequence[int], ahead: Sequence[int] = ()
) -> frozenset[int]:
    """The tokens `sequences` ban after the output (followed by `ahead`, proposed tokens being verified)."""
    longest_prefix = max(len(sequence) for sequence in sequences) - 1
    start = max(0, len(output_token_ids) - longest_prefix)
    tail = (*output_token_ids[start:], *ahead)
    banned = set()
    for sequence in sequences:
        prefix_length = len(sequence) - 1
        if prefix_length <= len(tail) and tail[len(tail) - prefix_length :] == sequence[:-1]:
            banned.add(sequence[-1])
    return frozenset(banned)
