"""The router's lazily computed prompt keys are the keys every replica computes."""

from __future__ import annotations

from array import array

from hypothesis import given
from hypothesis import strategies as st

from kvyard.kvcache.block_key import KeyNamespace, block_key, chain_block_keys
from kvyard.router.keys import PromptKeys

ROOT = KeyNamespace("m", "digest", "float32", 4).root_key()


def chained_one_by_one(tokens: list[int], block_size: int) -> list[bytes]:
    """The contract's formula applied block by block (docs/contracts.md section 1)."""
    keys, parent = [], ROOT
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = block_key(parent, tokens[start : start + block_size])
        keys.append(parent)
    return keys


@given(st.lists(st.integers(0, 2**32 - 1), max_size=70), st.integers(1, 9), st.integers(0, 20))
def test_prompt_keys_equal_chained_block_keys(tokens: list[int], block_size: int, probe: int) -> None:
    expected = chained_one_by_one(tokens, block_size)
    assert chain_block_keys(ROOT, tokens, block_size) == expected
    for given_as in (tokens, array("I", tokens)):  # the router keeps tokenized prompts as uint32 arrays
        keys = PromptKeys.of(ROOT, block_size, given_as)
        if probe < len(expected):
            assert keys.key(probe) == expected[probe]  # a later key first: the ones before it are filled in
        assert list(keys) == expected and keys.all() == expected
