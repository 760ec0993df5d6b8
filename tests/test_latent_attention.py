"""Multi-head latent attention (kvyard.models.latent_attention) against transformers' DeepseekV3Attention on the same
weights: the absorbed form over the cached latent rows gives the expanded attention's output, with and without a
low-rank query, interleaved or rotate-half rotary rows, plain and yarn-scaled rotary embeddings; and a query whose
context comes from rows cached earlier (a decode step) gives the same as in one pass."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

from kvyard.models.attention import build_attention_metadata
from kvyard.models.attention_backends import TorchSDPABackend
from kvyard.models.config import LatentConfig, _parse_rope
from kvyard.models.latent_attention import LatentAttention, deinterleave_rows
from kvyard.models.layers import RotaryEmbedding

YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 32,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "beta_fast": 32,
    "beta_slow": 1,
}
CASES: dict[str, dict[str, Any]] = {
    "low-rank q, interleaved": {"q_lora_rank": 24, "rope_interleave": True},
    "plain q, rotate-half": {"q_lora_rank": None, "rope_interleave": False},
    "yarn": {"q_lora_rank": 24, "rope_interleave": True, "rope_parameters": YARN},
}


def _pair(case: dict[str, Any]) -> tuple[DeepseekV3Attention, DeepseekV3RotaryEmbedding, LatentAttention]:
    config = DeepseekV3Config(
        hidden_size=48, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=12,
        qk_rope_head_dim=8, v_head_dim=10, max_position_embeddings=128, attn_implementation="eager",
        **{"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, **case},
    )  # fmt: skip
    torch.manual_seed(5)
    reference = DeepseekV3Attention(config, 0).eval()
    for parameter in reference.parameters():
        parameter.data.normal_(0, 0.2)
    rope = _parse_rope({"rope_parameters": config.rope_parameters, "max_position_embeddings": 128})
    qk_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
    scale = LatentConfig.scale_of(qk_head_dim, rope.rope_type, rope.factor, rope.mscale_all_dim)
    latent = LatentConfig(config.q_lora_rank or 0, 16, 12, 8, 10, scale)
    rotary = RotaryEmbedding(rope, 8, 128)
    rotary.build(torch.device("cpu"))
    ours = LatentAttention(48, 4, latent, rotary)
    _copy_weights(reference, ours, interleaved=config.rope_interleave)
    return reference, DeepseekV3RotaryEmbedding(config), ours


def _copy_weights(reference: DeepseekV3Attention, ours: LatentAttention, interleaved: bool) -> None:
    def rope_rows(weight: torch.Tensor, width: int, offset: int) -> torch.Tensor:
        return deinterleave_rows(weight, width, offset, 8) if interleaved else weight

    ours.kv_a_proj_with_mqa.weight.data.copy_(rope_rows(reference.kv_a_proj_with_mqa.weight.data, 24, 16))
    ours.kv_a_layernorm.weight.data.copy_(reference.kv_a_layernorm.weight)
    ours.kv_b_proj.weight.data.copy_(reference.kv_b_proj.weight)
    ours.o_proj.weight.data.copy_(reference.o_proj.weight)
    if reference.q_proj is not None:
        assert ours.q_proj is not None
        ours.q_proj.weight.data.copy_(rope_rows(reference.q_proj.weight.data, 20, 12))
        return
    assert reference.q_a_proj is not None and reference.q_a_layernorm is not None and reference.q_b_proj is not None
    assert ours.q_a_proj is not None and ours.q_a_layernorm is not None and ours.q_b_proj is not None
    ours.q_a_proj.weight.data.copy_(reference.q_a_proj.weight)
    ours.q_a_layernorm.weight.data.copy_(reference.q_a_layernorm.weight)
    ours.q_b_proj.weight.data.copy_(rope_rows(reference.q_b_proj.weight.data, 20, 12))


@pytest.mark.parametrize("name", sorted(CASES))
def test_absorbed_latent_attention_matches_transformers(name: str) -> None:
    reference, rotary, ours = _pair(CASES[name])
    length = 50  # past the yarn case's 32 pretrained positions
    x = torch.randn(1, length, 48)
    positions = torch.arange(length)
    causal = torch.full((length, length), float("-inf")).triu(1)
    with torch.no_grad():
        expected, _ = reference(x, rotary(x, positions[None]), causal[None, None])
        q_nope, q_pe, rows = ours.project(positions, x[0])
        torch.testing.assert_close(ours.attend(q_nope, q_pe, rows, causal), expected[0], rtol=0, atol=2e-5)
        last = ours.attend(q_nope[-1:], q_pe[-1:], rows, None)  # a decode step over every row cached so far
        torch.testing.assert_close(last, expected[0, -1:], rtol=0, atol=2e-5)


def test_a_paged_step_of_decodes_and_prefill_chunks_gives_each_sequence_its_own_attention() -> None:
    """Rows cached in a paged cache of one plane and one head, read back through block tables: two decodes over 7
    and 20 cached tokens, a 5-token chunk after 9 cached ones, and a whole 6-token prompt, in one step, each equal
    to its sequence computed alone in one pass."""
    _, _, ours = _pair(CASES["low-rank q, interleaved"])
    block = 4
    lengths = {"decode-a": 8, "decode-b": 21, "chunk": 14, "whole": 6}
    torch.manual_seed(9)
    hidden = {name: torch.randn(length, 48) for name, length in lengths.items()}
    tables = {"decode-a": [3, 0], "decode-b": [7, 1, 8, 2, 9, 4], "chunk": [5, 11, 6, 10], "whole": [12, 13]}
    cache = torch.zeros(1, 16 * block, 1, ours.latent.row_width)
    with torch.no_grad():
        expected = {}
        for name, x in hidden.items():
            positions = torch.arange(len(x))
            q_nope, q_pe, rows = ours.project(positions, x)
            expected[name] = ours.attend(q_nope, q_pe, rows, torch.full((len(x), len(x)), -torch.inf).triu(1))
        earlier = {"decode-a": 7, "decode-b": 20, "chunk": 9}  # cached by an earlier step
        _step(ours, cache, block, [(tables[n], hidden[n][:k], 0) for n, k in earlier.items()])
        out = _step(
            ours,
            cache,
            block,
            [
                (tables["decode-a"], hidden["decode-a"][7:], 7),
                (tables["decode-b"], hidden["decode-b"][20:], 20),
                (tables["chunk"], hidden["chunk"][9:], 9),
                (tables["whole"], hidden["whole"], 0),
            ],
        )
    torch.testing.assert_close(out[0:1], expected["decode-a"][7:], rtol=0, atol=2e-5)
    torch.testing.assert_close(out[1:2], expected["decode-b"][20:], rtol=0, atol=2e-5)
    torch.testing.assert_close(out[2:7], expected["chunk"][9:], rtol=0, atol=2e-5)
    torch.testing.assert_close(out[7:13], expected["whole"], rtol=0, atol=2e-5)


def _step(
    ours: LatentAttention, cache: torch.Tensor, block: int, sequences: list[tuple[list[int], torch.Tensor, int]]
) -> torch.Tensor:
    """One step over (block table, new tokens' hidden states, first new position) per sequence, decodes first."""
    meta = build_attention_metadata(
        TorchSDPABackend(),
        [table for table, _, _ in sequences],
        [start + len(x) for _, x, start in sequences],
        [len(x) for _, x, _ in sequences],
        block,
        torch.float32,
        torch.device("cpu"),
    )
    positions = torch.cat([torch.arange(start, start + len(x)) for _, x, start in sequences])
    result: torch.Tensor = ours(positions, torch.cat([x for _, x, _ in sequences]), cache, meta)
    return result
