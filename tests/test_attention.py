"""Both attention backends agree with a dense reference: native CPU kernels, PyTorch SDPA, chunked prefill."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvyard.models.attention import AttentionBackend, build_attention_metadata, paged_attention
from kvyard.models.attention_backends import CPUNativeBackend, TorchSDPABackend

BLOCK_SIZE = 4
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 6, 2, 8


def _dense_reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, first_pos: int) -> torch.Tensor:
    """Causal attention of queries at positions first_pos.. over all keys, GQA expanded."""
    group = NUM_HEADS // NUM_KV_HEADS
    k = keys.repeat_interleave(group, dim=1).transpose(0, 1)
    v = values.repeat_interleave(group, dim=1).transpose(0, 1)
    query_pos = torch.arange(first_pos, first_pos + q.shape[0])[:, None]
    mask = torch.arange(keys.shape[0])[None, :] <= query_pos
    return F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask).transpose(0, 1)


@pytest.fixture(params=["native", "torch", "native bf16 prefill"])
def backend(request: pytest.FixtureRequest) -> AttentionBackend:
    if request.param == "torch":
        return TorchSDPABackend()
    return CPUNativeBackend(request.getfixturevalue("native_kernels"), request.param == "native bf16 prefill")


def _bf16(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to(torch.bfloat16).float()


@pytest.mark.parametrize("keys_from_cache", [False, True])
def test_mixed_step_matches_dense_attention(backend: AttentionBackend, keys_from_cache: bool) -> None:
    generator = torch.Generator().manual_seed(0)
    # Two decodes, one fresh prefill, one prefill chunk continuing after 9 cached tokens.
    context_lens, query_lens = [7, 13, 5, 15], [1, 1, 5, 6]
    num_blocks = 64
    cache = torch.zeros(2, num_blocks * BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    order = torch.randperm(num_blocks, generator=generator).tolist()
    tables, histories = [], []
    for context_len in context_lens:
        tables.append([order.pop() for _ in range(-(-context_len // BLOCK_SIZE))])
        histories.append(
            (
                torch.randn(context_len, NUM_KV_HEADS, HEAD_DIM, generator=generator),
                torch.randn(context_len, NUM_KV_HEADS, HEAD_DIM, generator=generator),
            )
        )
    # Earlier tokens are already in the cache; this step's tokens arrive as k, v.
    meta_all = build_attention_metadata(
        backend, tables, context_lens, context_lens, BLOCK_SIZE, torch.float32, torch.device("cpu")
    )
    all_k = torch.cat([h[0] for h in histories])
    all_v = torch.cat([h[1] for h in histories])
    cache[0].index_copy_(0, meta_all.slot_mapping, all_k)
    cache[1].index_copy_(0, meta_all.slot_mapping, all_v)
    new_k = torch.cat([h[0][-q:] for h, q in zip(histories, query_lens)])
    new_v = torch.cat([h[1][-q:] for h, q in zip(histories, query_lens)])
    q = torch.randn(sum(query_lens), NUM_HEADS, HEAD_DIM, generator=generator)
    meta = build_attention_metadata(
        backend, tables, context_lens, query_lens, BLOCK_SIZE, torch.float32, torch.device("cpu"), keys_from_cache
    )
    out = paged_attention(q, new_k, new_v, cache, meta, scale=HEAD_DIM**-0.5)
    in_bf16 = isinstance(backend, CPUNativeBackend) and backend.bf16_prefill
    start = 0
    for (keys, values), context_len, query_len in zip(histories, context_lens, query_lens):
        rows = slice(start, start + query_len)
        if in_bf16 and query_len > 1:  # a prefill: bf16 queries, keys and values, fp32 sums
            expected = _dense_reference(_bf16(q[rows]), _bf16(keys), _bf16(values), context_len - query_len)
            torch.testing.assert_close(out[rows], expected, atol=2e-2, rtol=2e-2)
        else:
            expected = _dense_reference(q[rows], keys, values, context_len - query_len)
            torch.testing.assert_close(out[rows], expected, atol=1e-5, rtol=1e-5)
        start += query_len
