"""int8 weights: the quantizer's rounding, the native int8 kernel against a float64 reference, and a model loaded
with `quantization="int8"` equal to Hugging Face's model given the same dequantized weights (greedy tokens and
prompt logprobs), with its KV cached apart from the fp32 model's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModelForCausalLM

from kvyard import LLM, SamplingParams
from kvyard.kernels.ops import NativeKernels
from kvyard.models.quantization import GROUP_SIZE, Int8Linear, dequantize_int8, quantize_int8


def test_quantized_weights_round_to_the_nearest_step_of_their_group() -> None:
    weight = torch.randn(48, 96, generator=torch.Generator().manual_seed(0)) * 0.05
    weight[3, :32] = 0.0  # an all-zero group
    weight[5, 40] = 4.0  # an outlier costs precision to its own group only
    q, scales = quantize_int8(weight)
    assert q.dtype == torch.int8 and q.shape == (48, 96) and scales.shape == (48, 96 // GROUP_SIZE)
    error = (dequantize_int8(q, scales) - weight).abs().reshape(48, 3, GROUP_SIZE)
    assert bool((error <= scales[..., None] / 2 + 1e-7).all())
    assert bool((dequantize_int8(q, scales)[3, :32] == 0).all())
    assert scales[5, 1] > 10 * max(scales[5, 0], scales[5, 2])
    assert int(q.abs().max()) == 127
    with pytest.raises(ValueError, match="divisible by 32"):
        quantize_int8(torch.randn(4, 40))


@pytest.mark.parametrize(("rows", "out_features", "in_features"), [(1, 64, 128), (3, 130, 256), (32, 77, 512),
                                                                   (7, 4, 32)])  # fmt: skip
@pytest.mark.parametrize("bias", [True, False])
def test_the_int8_kernel_matches_a_float64_reference(
    native_kernels: NativeKernels, rows: int, out_features: int, in_features: int, bias: bool
) -> None:
    generator = torch.Generator().manual_seed(rows * out_features)
    x = torch.randn(rows, in_features, generator=generator)
    q, scales = quantize_int8(torch.randn(out_features, in_features, generator=generator))
    b = torch.randn(out_features, generator=generator) if bias else None
    reference = x.double() @ dequantize_int8(q, scales).double().T + (b.double() if b is not None else 0.0)
    out = native_kernels.small_linear_int8(x, q, scales, b)
    # fp32 accumulation over `in_features` terms of size ~|x|*|w|: a relative error of a few 1e-7 per term
    assert torch.allclose(out.double(), reference, rtol=1e-5, atol=1e-5 * in_features**0.5)


def test_int8_linear_gives_the_same_rows_through_the_kernel_and_the_dequantized_matmul(
    native_kernels: NativeKernels,
) -> None:
    linear = nn.Linear(96, 40)
    layer = Int8Linear.from_linear(linear)
    x = torch.randn(8, 96)
    plain = layer(x)  # no kernel yet: dequantized weight, one matmul
    layer.use_native_kernel(native_kernels.small_linear_int8)
    assert torch.allclose(layer(x), plain, atol=1e-5)
    many = torch.randn(Int8Linear.max_small_rows + 8, 96)  # past the kernel's rows: the dequantized matmul
    expected = F.linear(many, dequantize_int8(layer.qweight, layer.scales), layer.bias)
    assert torch.allclose(layer(many), expected, atol=1e-6)


def _dequantized_reference(model_dir: Path) -> nn.Module:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for module in model.modules():
        if isinstance(module, nn.Linear) and module.in_features % GROUP_SIZE == 0:
            module.weight.data = dequantize_int8(*quantize_int8(module.weight.data))
    return model


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_an_int8_model_equals_hugging_face_on_the_dequantized_weights(model_dirs: dict[str, Path], arch: str) -> None:
    reference = _dequantized_reference(model_dirs[arch])
    prompts = [torch.randint(3, 900, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 40)]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, prompt_logprobs=0)
    with LLM(str(model_dirs[arch]), quantization="int8") as llm:
        assert any(isinstance(m, Int8Linear) for m in llm.engine.runner.model.modules())
        outputs = llm.generate(prompts, params)
    for prompt, output in zip(prompts, outputs):
        with torch.no_grad():
            sequence = reference.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False,
                                          eos_token_id=None, pad_token_id=0)  # fmt: skip
            log_probs = reference(torch.tensor([prompt])).logits[0].log_softmax(-1)
        assert output.token_ids == sequence[0, len(prompt) :].tolist()
        assert output.prompt_logprobs is not None
        for position, entry in enumerate(output.prompt_logprobs[1:], start=1):
            assert entry is not None
            assert entry.logprob == pytest.approx(float(log_probs[position - 1, prompt[position]]), abs=1e-4)


def test_int8_kv_is_cached_apart_and_an_unknown_scheme_is_refused(llama_dir: Path) -> None:
    with LLM(str(llama_dir)) as plain, LLM(str(llama_dir), quantization="int8") as int8:
        assert plain.engine.namespace.root_key() != int8.engine.namespace.root_key()
        assert int8.engine.namespace.model_digest.endswith("+int8-g32")
    with pytest.raises(ValueError, match="quantization"):
        LLM(str(llama_dir), quantization="int4")
