"""Mixture-of-experts models (Mixtral, Qwen3-MoE): what their configs say, a model mixing dense and expert layers
against transformers, and the paths that run them. Greedy parity for batches, prefix hits, 7-token chunks and
preemption is in test_hf_parity.py, which runs every architecture."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from server_utils import start_server
from transformers import AutoModelForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from kvyard import LLM, SamplingParams
from kvyard.engine.config import EngineConfig
from kvyard.engine.fast_start.engine import fast_start_blocker
from kvyard.engine.speculative.policy import SpeculativeConfig
from kvyard.models.config import MoeConfig, UnsupportedModelError, load_model_config, parse_model_config
from kvyard.models.experts import SparseMoE
from kvyard.models.package import convert
from kvyard.models.quantization import (
    HALF_DTYPES,
    HalfLinear,
    Int8Linear,
    dequantize_int8,
    quantize_int8,
    round_trip_linears,
)

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def test_configs_name_their_experts_and_which_layers_have_them(moe_model_dirs: dict[str, Path]) -> None:
    qwen = load_model_config(moe_model_dirs["qwen3_moe"])
    assert qwen.moe is not None and qwen.family == "qwen3"
    assert (qwen.moe.num_experts, qwen.moe.experts_per_token, qwen.moe.expert_intermediate_size) == (8, 2, 32)
    assert qwen.moe.normalize_top_k and qwen.moe.sparse_layers == {0, 1}
    mixtral = load_model_config(moe_model_dirs["mixtral"])
    assert mixtral.moe is not None and mixtral.family == "llama" and mixtral.moe.normalize_top_k
    assert mixtral.moe.expert_intermediate_size == mixtral.intermediate_size == 32
    qwen2 = load_model_config(moe_model_dirs["qwen2_moe"])
    assert qwen2.moe is not None and qwen2.family == "qwen2" and qwen2.attention_bias
    assert qwen2.moe.shared_expert_intermediate_size == 64 and qwen.moe.shared_expert_intermediate_size == 0
    raw = json.loads((moe_model_dirs["qwen3_moe"] / "config.json").read_text())
    every_other = parse_model_config({**raw, "num_hidden_layers": 6, "decoder_sparse_step": 2, "mlp_only_layers": [3]})
    assert every_other.moe is not None and every_other.moe.sparse_layers == {1, 5}
    with pytest.raises(UnsupportedModelError, match="shared experts"):
        parse_model_config({**raw, "shared_expert_intermediate_size": 64})


def test_dense_and_expert_layers_in_one_model_match_transformers(
    moe_model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    """Qwen3-MoE's mlp_only_layers: layer 1 keeps a dense MLP of intermediate_size, layers 0 and 2 have experts."""
    source = moe_model_dirs["qwen3_moe"]
    config = Qwen3MoeConfig.from_pretrained(source)
    config.num_hidden_layers, config.mlp_only_layers = 3, [1]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        reference = Qwen3MoeForCausalLM(config).eval()
    reference.save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (source / name).exists():
            shutil.copy(source / name, tmp_path / name)
    loaded = load_model_config(tmp_path)
    assert loaded.moe is not None and loaded.moe.sparse_layers == {0, 2}
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=generator).tolist() for n in (3, 20, 45)]
    outputs = LLM(str(tmp_path)).generate(prompts, GREEDY)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    for prompt, output in zip(prompts, outputs):
        assert output.token_ids == _greedy(hf, prompt)


def _greedy(model: Any, prompt: list[int]) -> list[int]:
    """transformers' greedy continuation (GREEDY's 16 tokens). The mask is given: generate would take the prompt's
    token 0 for padding."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        sequence = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=16,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return list(sequence[0, len(prompt) :].tolist())


def test_each_token_gets_its_top_experts_weighted_by_the_router() -> None:
    """The grouped computation equals each token's own sum over its chosen experts."""
    torch.manual_seed(0)
    moe = SparseMoE(16, _moe_config(num_experts=4, top_k=2))
    for parameter in moe.parameters():
        parameter.data.normal_(0, 0.3)
    x = torch.randn(9, 16)
    weights, experts = moe.route(x)
    assert torch.allclose(weights.sum(-1), torch.ones(9))
    expected = torch.zeros_like(x)
    for token in range(9):
        for weight, expert in zip(weights[token], experts[token].tolist()):
            expected[token] += weight * moe.experts[expert](x[token : token + 1])[0]
    assert torch.allclose(moe(x), expected, atol=1e-5)
    for row in range(9):  # one token (a single stream's decode step) skips the grouping, with the same bits
        one = x[row : row + 1]
        assert torch.equal(moe(one), moe._grouped(one, *moe.route(one)))


def test_a_shared_expert_adds_its_gated_output_to_every_token() -> None:
    torch.manual_seed(1)
    moe = SparseMoE(16, MoeConfig(4, 2, 8, False, frozenset({0}), shared_expert_intermediate_size=12))
    for parameter in moe.parameters():
        parameter.data.normal_(0, 0.3)
    assert moe.shared_expert is not None and moe.shared_expert_gate is not None
    x = torch.randn(5, 16)
    routed = moe._grouped(x, *moe.route(x))
    shared = torch.sigmoid(moe.shared_expert_gate(x)) * moe.shared_expert(x)
    assert torch.equal(moe(x), routed + shared)
    one = x[:1]  # one token: its experts in turn, then the shared expert, as for many
    weights, experts = moe.route(one)
    shared_one = torch.sigmoid(moe.shared_expert_gate(one)) * moe.shared_expert(one)
    assert torch.equal(moe(one), moe._one_token(one, weights[0], experts[0]) + shared_one)


def test_deepseek_v3_routing_matches_transformers() -> None:
    """Sigmoid scores, a selection bias, group-limited top-k, normalized and scaled weights and an ungated shared
    expert: DeepSeek-V3's expert layer, against transformers' own module on the same weights."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    config = DeepseekV3Config(
        hidden_size=32,
        moe_intermediate_size=16,
        n_routed_experts=8,
        n_shared_experts=2,
        num_experts_per_tok=3,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        experts_implementation="eager",
    )
    torch.manual_seed(3)
    reference = DeepseekV3MoE(config).eval()
    for tensor in [*reference.parameters(), *reference.buffers()]:
        tensor.data.normal_(0, 0.3)
    ours = SparseMoE(
        32,
        MoeConfig(8, 3, 16, True, frozenset({0}), 32, False, "sigmoid", True, num_groups=4, top_groups=2,
                  routed_scaling=2.5),
    )  # fmt: skip
    ours.gate.weight.data.copy_(reference.gate.weight)
    assert ours.e_score_correction_bias is not None and ours.shared_expert is not None
    ours.e_score_correction_bias.data.copy_(reference.gate.e_score_correction_bias)
    for index, expert in enumerate(ours.experts):
        expert.gate_up_proj.weight.data.copy_(reference.experts.gate_up_proj[index])
        expert.down_proj.weight.data.copy_(reference.experts.down_proj[index])
    shared = reference.shared_experts
    ours.shared_expert.gate_up_proj.weight.data.copy_(torch.cat([shared.gate_proj.weight, shared.up_proj.weight]))
    ours.shared_expert.down_proj.weight.data.copy_(shared.down_proj.weight)
    x = torch.randn(11, 32)
    with torch.no_grad():
        _, expected_weights, expected_experts = reference.gate(x)
        weights, experts = ours.route(x)
        order, expected_order = experts.argsort(-1), expected_experts.argsort(-1)
        assert torch.equal(experts.gather(1, order), expected_experts.gather(1, expected_order))
        torch.testing.assert_close(weights.gather(1, order), expected_weights.gather(1, expected_order))
        torch.testing.assert_close(ours(x), reference(x), rtol=0, atol=1e-5)
        torch.testing.assert_close(ours(x[:1]), reference(x[:1]), rtol=0, atol=1e-5)  # one token's own path
    with pytest.raises(UnsupportedModelError, match="groups"):
        MoeConfig(8, 2, 16, True, frozenset({0}), scoring="sigmoid", num_groups=3)


def test_the_fast_start_leaves_expert_models_to_pytorch(moe_model_dirs: dict[str, Path]) -> None:
    reason = fast_start_blocker(EngineConfig.create(str(moe_model_dirs["mixtral"])))
    assert reason is not None and "mixture-of-experts" in reason


def _moe_config(num_experts: int, top_k: int) -> MoeConfig:
    return MoeConfig(num_experts, top_k, 8, True, frozenset({0}))


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3"])
@pytest.mark.parametrize("method", ["self-int8", "self-fp16"])
def test_self_speculation_on_expert_models_gives_the_output_without_it(
    moe_model_dirs: dict[str, Path], arch: str, method: str
) -> None:
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, 1024, (n,), generator=generator).tolist() for n in (4, 18, 33, 60)]
    reference = [output.token_ids for output in LLM(str(moe_model_dirs[arch])).generate(prompts, GREEDY)]
    speculative = SpeculativeConfig(method=method, num_speculative_tokens=4, adaptive=False)
    with LLM(str(moe_model_dirs[arch]), speculative=speculative) as llm:
        assert [output.token_ids for output in llm.generate(prompts, GREEDY)] == reference
        stats = llm.engine.stats()
        assert stats.spec_accepted_tokens > 0.5 * stats.spec_proposed_tokens > 0


def _round_tripped_moe_reference(model_dir: Path, scheme: str) -> torch.nn.Module:
    """transformers' model with every weight kvyard converts replaced by what it computes with: its linear layers
    (round_trip_linears), and its routers and stacked experts, which are not linear layers there."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    # Latent attention's kv_b_proj is read as matrices, never converted (kvyard.models.latent_attention)
    kept = {name: p.data.clone() for name, p in model.named_parameters() if name.endswith("kv_b_proj.weight")}
    round_trip_linears(model, scheme)
    for name, parameter in model.named_parameters():
        if name in kept:
            parameter.data = kept[name]
    for name, parameter in model.named_parameters():
        if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.gate.weight")):
            rows = parameter.data if parameter.dim() == 3 else parameter.data[None]
            for matrix in rows:
                if scheme == "int8":
                    matrix.copy_(dequantize_int8(*quantize_int8(matrix)))
                else:
                    matrix.copy_(matrix.to(HALF_DTYPES[scheme]).float())
    return model


# The int8 kernel rounds each row's groups of 32 inputs to int16 (quantization.round_activations_int16), which
# transformers' round-tripped model does not: as for dense models, but over two more int8 matmuls a layer (the
# router and the experts), the log-probabilities drift a little further.
LOGPROB_TOLERANCE = {"int8": 5e-4, "bf16": 1e-4}


@pytest.mark.parametrize(
    ("arch", "scheme"),
    [("qwen3_moe", "int8"), ("qwen2_moe", "int8"), ("mixtral", "int8"), ("mixtral", "bf16"), ("deepseek_v3", "int8")],
)
def test_converted_experts_equal_transformers_on_the_round_tripped_weights(
    moe_model_dirs: dict[str, Path], arch: str, scheme: str
) -> None:
    reference = _round_tripped_moe_reference(moe_model_dirs[arch], scheme)
    prompts = [torch.randint(3, 900, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 40, 100)]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, prompt_logprobs=0)
    with LLM(str(moe_model_dirs[arch]), quantization=scheme) as llm:
        converted = Int8Linear if scheme == "int8" else HalfLinear
        experts = [m for m in llm.engine.runner.model.modules() if isinstance(m, SparseMoE)]
        assert experts and all(isinstance(e.experts[0].gate_up_proj, converted) for e in experts)
        outputs = llm.generate(prompts, params)
    for prompt, output in zip(prompts, outputs):
        with torch.no_grad():
            log_probs = reference(torch.tensor([prompt])).logits[0].log_softmax(-1)
        assert output.token_ids == _greedy(reference, prompt)
        assert output.prompt_logprobs is not None
        for position, entry in enumerate(output.prompt_logprobs[1:], start=1):
            assert entry is not None
            expected = float(log_probs[position - 1, prompt[position]])
            assert entry.logprob == pytest.approx(expected, abs=LOGPROB_TOLERANCE[scheme])


def test_an_int8_package_of_an_expert_model_loads_what_converting_at_load_time_gives(
    moe_model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    package = tmp_path / "qwen3-moe-int8"
    convert(moe_model_dirs["qwen3_moe"], "int8", package)
    prompt = [[5, 9, 14, 3, 77, 41, 2, 8, 100, 7]]
    with (
        LLM(str(moe_model_dirs["qwen3_moe"]), quantization="int8", served_model_name="m") as converted,
        LLM(str(package), served_model_name="m") as packaged,
    ):
        ours, theirs = converted.engine.runner.model.state_dict(), packaged.engine.runner.model.state_dict()
        assert set(ours) == set(theirs) and any(".experts.7.down_proj.qweight" in name for name in ours)
        for name, tensor in ours.items():
            assert tensor.dtype == theirs[name].dtype and torch.equal(tensor, theirs[name]), name
        assert converted.generate(prompt, GREEDY)[0].token_ids == packaged.generate(prompt, GREEDY)[0].token_ids


def test_a_served_expert_model_answers_streams_and_hits_its_prefix_cache(
    moe_model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    """`kvyard serve` on a Qwen2-MoE directory says why it does not start fast, then answers the official client,
    streamed and not, with the offline engine's greedy text, and a second request reuses the first's blocks."""
    model_dir = moe_model_dirs["qwen2_moe"]
    prompt = list(range(40, 140))
    offline = LLM(str(model_dir)).generate([prompt], GREEDY)[0].text
    server = start_server(model_dir, tmp_path)
    try:
        body = {"model": model_dir.name, "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
        deadline = time.monotonic() + 120
        while (answer := httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)).status_code == 503:
            assert time.monotonic() < deadline, answer.text  # PyTorch still loading
            time.sleep(0.5)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["text"] == offline
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
        stream = client.completions.create(
            model=model_dir.name,
            prompt=prompt,
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        chunks = list(stream)
        assert "".join(chunk.choices[0].text for chunk in chunks if chunk.choices) == offline
        usage = chunks[-1].usage
        assert usage is not None and usage.prompt_tokens_details is not None
        assert usage.prompt_tokens_details.cached_tokens >= 96
        assert "no fast start: a mixture-of-experts model" in server.log()
    finally:
        server.stop()
