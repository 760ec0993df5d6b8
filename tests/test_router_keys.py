"""The router's lazily computed prompt keys are the keys every replica computes."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvyard.kvcache.block_key import KeyNamespace, chain_block_keys
from kvyard.router.keys import PromptKeys

ROOT = KeyNamespace("m", "digest", "float32", 4).root_key()


@given(st.lists(st.integers(0, 2**32 - 1), max_size=70), st.integers(1, 9), st.integers(0, 20))
def test_prompt_keys_equal_chained_block_keys(tokens: list[int], block_size: int, probe: int) -> None:
    keys = PromptKeys.of(ROOT, block_size, tokens)
    expected = chain_block_keys(ROOT, tokens, block_size)
    if probe < len(expected):
        assert keys.key(probe) == expected[probe]  # a later key first: the ones before it are filled in
    assert list(keys) == expected and keys.all() == expected
