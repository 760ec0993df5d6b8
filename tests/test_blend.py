"""Segment reuse and blending (kvyard.engine.blend) on the trained demo model: moved text is found at any
offset, reused keys land rotated to their new positions, and recomputing every token gives the full prefill."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from server_utils import ServerProcess, start_server
from tokenizers import Tokenizer

from kvyard.engine.blend.segments import SegmentIndex, SegmentMatch, runs_of
from kvyard.engine.blend.settings import BlendSettings
from kvyard.engine.llm import LLM
from kvyard.engine.runners import blend_prefill as blend_prefill_module
from kvyard.engine.runners.blend_prefill import blend_prefill, install_segments
from kvyard.engine.runners.model_runner import PagedModel
from kvyard.engine.sampling.params import SamplingParams
from kvyard.models.kv_format import from_storage
from kvyard.models.loader import load_model
from kvyard.testing.model_presets import DEMO_MODEL_DIR
from kvyard.testing.tokenizer_build import corpus_texts

BLOCK = 16
ROOT = b"namespace-root"


@pytest.fixture(scope="module")
def paged() -> PagedModel:
    model = load_model(DEMO_MODEL_DIR, torch.float32, torch.device("cpu"), 4096)
    return PagedModel(model, 512, BLOCK, torch.float32, torch.device("cpu"))


@pytest.fixture(scope="module")
def text_tokens() -> list[int]:
    tokenizer = Tokenizer.from_file(str(DEMO_MODEL_DIR / "tokenizer.json"))
    return tokenizer.encode("".join(corpus_texts(20_000))).ids[:1_600]


def _index(tokens: list[int], blocks: list[int], root: bytes = ROOT) -> SegmentIndex:
    index = SegmentIndex(BLOCK)
    for number in range(len(tokens) // BLOCK):
        index.add(blocks[number], number * BLOCK, tokens[number * BLOCK : (number + 1) * BLOCK], root)
    return index


@pytest.mark.parametrize("shift", [0, 5, 16, -3])
def test_moved_text_is_found_at_any_offset(shift: int) -> None:
    old = list(range(1000, 1160))  # ten blocks
    index = _index(old, list(range(50, 60)))
    moved = old[32:]  # blocks 2..9
    prompt = [1] * (10 + shift) + moved + [2] * 7 if shift >= 0 else moved[-shift:] + [2] * 7
    start = 10 + shift if shift >= 0 else 0
    matches = index.find(prompt, 0, ROOT)
    first_whole = 32 if shift >= 0 else 48  # a block cut by the negative shift cannot match
    expected = [
        SegmentMatch(start + block * BLOCK - (32 if shift >= 0 else 32 - shift), 50 + block, block * BLOCK)
        for block in range(first_whole // BLOCK, 10)
    ]
    assert matches == expected
    assert runs_of(matches, BLOCK) == [(expected[0].new_start, BLOCK * len(expected))]


def test_segments_never_cross_namespaces_and_leave_with_their_block() -> None:
    old = list(range(500, 564))
    index = _index(old, [7, 8, 9, 10])
    assert index.find(old, 0, b"another tenant") == []
    index.discard(8)
    assert [m.block_id for m in index.find(old, 0, ROOT)] == [7, 9, 10]
    index.add(9, 0, [1] * BLOCK, ROOT)  # the block now holds other tokens
    assert [m.block_id for m in index.find(old, 0, ROOT)] == [7, 10]
    assert len(index) == 3


def test_shifted_keys_equal_keys_computed_at_the_new_positions(paged: PagedModel, text_tokens: list[int]) -> None:
    """The first layer's keys depend on a token and its position only: after moving, they must be what a prefill
    of the moved text computes, to float rounding (negative shifts too)."""
    old = text_tokens[:256]
    with torch.inference_mode():
        paged.run(old, list(range(256)), [list(range(16))], [256], [256])
        for shift, first_block in ((40, 100), (-17, 130)):
            new = [3] * (64 + shift) + old[64:]
            table = list(range(first_block, first_block + len(new) // BLOCK + 1))
            matches = [SegmentMatch(64 + shift + b * BLOCK, 4 + b, 64 + b * BLOCK) for b in range(12)]
            install_segments(paged, matches, table, range(0, 1))
            moved = _layer0_keys(paged, table, range(64 + shift, 64 + shift + 192))
            reference_table = list(range(300, 300 + len(new) // BLOCK + 1))
            paged.run(new, list(range(len(new))), [reference_table], [len(new)], [len(new)])
            computed = _layer0_keys(paged, reference_table, range(64 + shift, 64 + shift + 192))
            torch.testing.assert_close(moved, computed, rtol=1e-5, atol=2e-5)


def _layer0_keys(paged: PagedModel, table: list[int], positions: range) -> torch.Tensor:
    slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in positions])
    return from_storage(paged.kv_caches[0][0].index_select(0, slots), torch.float32)


def _rewritten(text_tokens: list[int]) -> tuple[list[int], list[int], int]:
    """A 1,000-token history and the prompt that replaces its tokens 200-640 by 90 other ones."""
    history = text_tokens[:1_000]
    prompt = history[:200] + text_tokens[1_100:1_190] + history[640:] + text_tokens[1_190:1_200]
    return history, prompt, 192  # the cached prefix: whole blocks before the first change


@pytest.mark.parametrize(
    ("selection", "chunk"), [("deviation", 512), ("leading", 512), ("deviation", 48), ("leading", 48)]
)
def test_recomputing_every_token_gives_the_full_prefill(
    paged: PagedModel, text_tokens: list[int], selection: str, chunk: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In one pass, and in chunks of recomputed tokens (each attending to the chunks before it)."""
    monkeypatch.setattr(blend_prefill_module, "SCATTERED_CHUNK_TOKENS", chunk)
    monkeypatch.setattr(blend_prefill_module, "FIRST_LAYER_CHUNK_TOKENS", 2 * chunk + 5)
    history, prompt, cached = _rewritten(text_tokens)
    with torch.inference_mode():
        full = _full_last_hidden(paged, prompt)
        matches = _cache_history(paged, history, prompt, cached)
        table = list(range(12)) + list(range(200, 200 + len(prompt) // BLOCK + 1))[12:]
        result = blend_prefill(paged, prompt, table, cached, matches, BlendSettings(1.0, selection))
    assert result.reused_tokens == len(matches) * BLOCK >= 320
    assert result.recomputed_tokens == result.reused_tokens
    torch.testing.assert_close(result.hidden, full, rtol=0, atol=1e-4)


def test_blending_recomputes_what_is_asked_and_beats_plain_reuse(paged: PagedModel, text_tokens: list[int]) -> None:
    """Plain reuse (nothing recomputed but the new tokens) is further from the full prefill's next-token
    distribution than blending with a third of the reused tokens recomputed, chosen by deviation."""
    history, prompt, cached = _rewritten(text_tokens)
    with torch.inference_mode():
        reference = paged.model.compute_logits(_full_last_hidden(paged, prompt)).log_softmax(-1)
        divergence = {}
        for settings in (BlendSettings(0.0, "leading", 0), BlendSettings(0.33, "deviation")):
            matches = _cache_history(paged, history, prompt, cached)
            table = list(range(12)) + list(range(200, 200 + len(prompt) // BLOCK + 1))[12:]
            result = blend_prefill(paged, prompt, table, cached, matches, settings)
            forced = len(prompt) - cached - result.reused_tokens + 1  # new tokens, and the last one
            if settings.recompute_fraction == 0:
                assert result.recomputed_tokens == 0 and forced > 1
            else:
                assert result.recomputed_tokens >= 0.33 * result.reused_tokens
            logits = paged.model.compute_logits(result.hidden).log_softmax(-1)
            divergence[settings.selection] = torch.sum(reference.exp() * (reference - logits)).item()
    assert 0 < divergence["deviation"] < divergence["leading"]


def _cache_history(paged: PagedModel, history: list[int], prompt: list[int], cached: int) -> list[SegmentMatch]:
    """Prefill the history into blocks 0.. and index them; the prompt's segments after its cached prefix."""
    paged.run(
        history, list(range(len(history))), [list(range(len(history) // BLOCK + 1))], [len(history)], [len(history)]
    )
    return _index(history, list(range(len(history) // BLOCK))).find(prompt, cached, ROOT)


def _full_last_hidden(paged: PagedModel, prompt: list[int]) -> torch.Tensor:
    table = list(range(400, 400 + len(prompt) // BLOCK + 1))
    return paged.run(prompt, list(range(len(prompt))), [table], [len(prompt)], [len(prompt)])[-1:]


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="recompute_fraction"):
        BlendSettings(1.5)
    with pytest.raises(ValueError, match="selection"):
        BlendSettings(0.1, "random")
    with pytest.raises(ValueError, match="leading_tokens"):
        BlendSettings(0.1, "leading", -1)


def test_an_engine_blends_a_rewritten_prompt_and_caches_none_of_it(text_tokens: list[int]) -> None:
    """Served through the engine: the rewritten prompt reuses the history's moved blocks (reported apart from
    cached tokens); recomputing every token gives the exact engine's greedy answer; the blended blocks never enter
    the prefix cache, so the same prompt asked again without blending gets only the exact prefix; and a prompt
    whose prefix is fully cached is served exactly as without blending."""
    history, prompt, cached = _rewritten(text_tokens)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    options = {"dtype": "float32", "num_kv_blocks": 256, "max_model_len": 2048}
    with LLM(str(DEMO_MODEL_DIR), **options) as exact:
        expected = exact.generate([prompt], greedy)[0].token_ids
        repeated = exact.generate([history], greedy)[0].token_ids
    blend = {"non_prefix_reuse": "blend", "blend_recompute_fraction": 1.0}
    with LLM(str(DEMO_MODEL_DIR), **options, **blend) as llm:
        llm.generate([history], greedy)
        first = llm.generate([prompt], greedy)[0]
        assert first.num_cached_tokens == cached
        assert first.num_blended_tokens >= 320
        assert first.token_ids == expected
        off = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, non_prefix_reuse="off")
        again = llm.generate([prompt], off)[0]
        assert (again.num_cached_tokens, again.num_blended_tokens) == (cached, 0)
        assert again.token_ids == expected
        whole = llm.generate([history], greedy)[0]
        assert whole.num_blended_tokens == 0 and whole.token_ids == repeated
        aligned = history[:640]  # whole blocks: its last block is computed, not blended in from the cache
        assert [out.num_blended_tokens for out in llm.generate([aligned, aligned], greedy)] == [0, 0]
        pasted = text_tokens[1_300:1_450] + history[300:340] + text_tokens[1_450:1_600]  # a paste of 40 tokens
        segments = llm.engine.kv_manager.segments
        assert segments is not None and segments.find(pasted, 0, llm.engine.root_key(None))  # found, yet
        assert llm.generate([pasted], greedy)[0].num_blended_tokens == 0  # too little moved text to blend
        llm.engine.block_pool.check_invariants()


def test_a_server_blends_when_asked_and_reports_it(text_tokens: list[int], tmp_path: Path) -> None:
    """`kvyard serve --non-prefix-reuse blend` on loopback: the rewritten prompt's usage reports the blended
    tokens apart from the cached ones; a request that says off gets none; a bad value is a 400 naming the field."""
    history, prompt, cached = _rewritten(text_tokens)
    server = start_server(DEMO_MODEL_DIR, tmp_path, "--non-prefix-reuse", "blend", "--max-model-len", "2048")
    try:
        body = {"max_tokens": 4, "temperature": 0}
        first = _complete(server, {**body, "prompt": history})
        assert "blended_tokens" not in first["usage"]["prompt_tokens_details"]
        blended = _complete(server, {**body, "prompt": prompt})["usage"]["prompt_tokens_details"]
        assert blended["cached_tokens"] == cached and blended["blended_tokens"] >= 320
        plain = _complete(server, {**body, "prompt": prompt, "non_prefix_reuse": "off"})
        assert "blended_tokens" not in plain["usage"]["prompt_tokens_details"]
        refused = httpx.post(f"{server.url}/v1/completions", json={**body, "prompt": prompt, "non_prefix_reuse": "yes"})
        assert refused.status_code == 400 and "non_prefix_reuse" in refused.text
        assert _complete(server, {**body, "prompt": history[:40]})["choices"][0]["text"] is not None
    finally:
        server.stop()


def _complete(server: ServerProcess, body: dict[str, object]) -> dict[str, Any]:
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result
