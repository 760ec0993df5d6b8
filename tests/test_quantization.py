"""int8 weights: the quantizer's rounding, the native int8 kernel against a float64 reference, and a model loaded
with `quantization="int8"` equal to Hugging Face's model given the same dequantized weights (greedy tokens and
prompt logprobs), with its KV cached apart from the fp32 model's."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModelForCausalLM

from kvyard import LLM, SamplingParams
from kvyard.kernels.ops import NativeKernels
from kvyard.models.layers import GatedMLP, Linear, onednn_runs_bf16
from kvyard.models.package import convert
from kvyard.models.quantization import (
    BF16_MATMUL_FROM_ROWS,
    GROUP_SIZE,
    HalfLinear,
    Int8Linear,
    cpu_has_fast_bf16,
    dequantize_int8,
    quantize_int8,
    round_activations_int16,
    round_trip_linears,
)


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


# rows: one, a block of 4 or 8 and remainders of it; out_features: whole tiles of 8 weight rows and a partial one
@pytest.mark.parametrize(
    ("rows", "out_features", "in_features"),
    [(1, 64, 128), (3, 130, 256), (32, 77, 512), (7, 4, 32), (9, 19, 64), (17, 1000, 96), (64, 33, 128), (2, 24, 1024)],
)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("build", ["native", "avx2", "portable"])
def test_the_int8_kernel_matches_a_float64_reference(
    request: pytest.FixtureRequest, build: str, rows: int, out_features: int, in_features: int, bias: bool
) -> None:
    kernels: NativeKernels = request.getfixturevalue(f"{build}_kernels" if build != "portable" else build)
    generator = torch.Generator().manual_seed(rows * out_features)
    x = torch.randn(rows, in_features, generator=generator)
    x[0, :GROUP_SIZE] = 0.0  # an all-zero group of activations: scale 0
    q, scales = quantize_int8(torch.randn(out_features, in_features, generator=generator))
    b = torch.randn(out_features, generator=generator) if bias else None
    weight = dequantize_int8(q, scales).double()
    reference = round_activations_int16(x).double() @ weight.T + (b.double() if b is not None else 0.0)
    out = kernels.small_linear_int8(x, q, scales, b)
    # each group's sum is exact in integers; fp32 scaling and accumulation over `in_features` / 32 groups of size
    # ~|x|*|w|*sqrt(32): a relative error of a few 1e-7 a term
    assert torch.allclose(out.double(), reference, rtol=1e-5, atol=1e-5 * in_features**0.5)
    # what rounding activations to int16 costs against fp32 x: a step of 1/32767 of the group's max at most
    exact = x.double() @ weight.T + (b.double() if b is not None else 0.0)
    group_max = x.abs().reshape(rows, -1, GROUP_SIZE).amax(dim=-1).double()
    half_step = (group_max / 32767 / 2).repeat_interleave(GROUP_SIZE, 1)
    assert bool(((out.double() - exact).abs() <= half_step @ weight.abs().T + 1e-5 * in_features**0.5).all())


@pytest.mark.parametrize("out_features", [19, 130])  # a partial tile of weight rows: the kernel's row groups end early
def test_each_row_of_the_int8_kernel_is_the_same_bits_whatever_the_rows_beside_it(
    vector_kernels: NativeKernels, out_features: int
) -> None:
    """The kernel takes weight rows four, two or one at a time depending on how many rows x has; each row's sum
    must not change with that, or a verification pass (several rows) would not reproduce a decode step (one)."""
    generator = torch.Generator().manual_seed(out_features)
    x = torch.randn(17, 256, generator=generator)
    q, scales = quantize_int8(torch.randn(out_features, 256, generator=generator))
    alone = torch.cat([vector_kernels.small_linear_int8(x[i : i + 1], q, scales, None) for i in range(17)])
    for rows in (2, 3, 4, 5, 8, 16, 17):
        assert torch.equal(vector_kernels.small_linear_int8(x[:rows], q, scales, None), alone[:rows]), rows


def test_int8_linear_gives_the_same_rows_through_the_kernel_and_the_dequantized_matmul(
    native_kernels: NativeKernels,
) -> None:
    linear = nn.Linear(96, 40)
    layer = Int8Linear.from_linear(linear)
    x = torch.randn(8, 96)
    plain = layer(round_activations_int16(x))  # no kernel yet: dequantized weight, one matmul
    layer.use_native_kernel(native_kernels.small_linear_int8)  # rounds x to int16 per group of 32 itself
    assert torch.allclose(layer(x), plain, atol=1e-5)
    many = torch.randn(Int8Linear.max_small_rows + 8, 96)  # past the kernel's rows: the dequantized matmul
    expected = F.linear(many, dequantize_int8(layer.qweight, layer.scales), layer.bias)
    assert torch.allclose(layer(many), expected, atol=1e-6)
    if torch.backends.mkldnn.is_available():  # the same matmul through oneDNN, as CPU fast paths run it
        layer.use_native_kernel(native_kernels.small_linear_int8, onednn=True)
        assert torch.allclose(layer(many), expected, atol=1e-5)
        assert torch.allclose(layer(x), plain, atol=1e-5)


# in_features from 1024 on: two chains per sum (AVX2); 1032: and a last group of 8 weights
@pytest.mark.parametrize(
    ("rows", "out_features", "in_features"),
    [(1, 64, 128), (9, 19, 64), (17, 130, 40), (3, 5, 7), (7, 19, 1408), (13, 9, 1032)],
)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_half_kernel_matches_a_float64_reference(
    vector_kernels: NativeKernels, rows: int, out_features: int, in_features: int, dtype: torch.dtype
) -> None:
    generator = torch.Generator().manual_seed(rows + in_features)
    x = torch.randn(rows, in_features, generator=generator)
    weight = torch.randn(out_features, in_features, generator=generator).to(dtype)
    bias = torch.randn(out_features, generator=generator)
    reference = x.double() @ weight.double().T + bias.double()
    out = vector_kernels.small_linear_half(x, weight, bias)  # in_features 40 and 7: the portable path's tail
    assert torch.allclose(out.double(), reference, rtol=1e-5, atol=1e-5 * in_features**0.5)
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        vector_kernels.small_linear_half(x, weight.float(), bias)


@pytest.mark.parametrize("in_features", [512, 1408, 1032])  # one chain per sum; two (AVX2); two and a tail
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_each_row_of_the_half_kernel_is_the_same_bits_whatever_the_rows_beside_it(
    vector_kernels: NativeKernels, in_features: int, dtype: torch.dtype
) -> None:
    """The half kernel takes rows of x in blocks of 6 or 8; each row's sum must not change with how many rows x has
    (a verification pass must reproduce a decode step)."""
    generator = torch.Generator().manual_seed(in_features)
    x = torch.randn(17, in_features, generator=generator)
    weight = torch.randn(19, in_features, generator=generator).to(dtype)  # a partial tile of weight rows
    alone = torch.cat([vector_kernels.small_linear_half(x[i : i + 1], weight, None) for i in range(17)])
    for rows in (2, 3, 5, 6, 7, 8, 9, 13, 17):
        assert torch.equal(vector_kernels.small_linear_half(x[:rows], weight, None), alone[:rows]), rows


# the portable tail never runs (groups of 32); n * k from 4 * 65536 on: the threads split the rows
@pytest.mark.parametrize(("out_features", "in_features"), [(1, 32), (7, 96), (130, 512), (600, 512)])
def test_int8_widened_to_bf16_is_bit_identical_to_torch(
    vector_kernels: NativeKernels, out_features: int, in_features: int
) -> None:
    generator = torch.Generator().manual_seed(out_features)
    weight = torch.randn(out_features, in_features, generator=generator)
    weight[0, :32] = 0.0  # an all-zero group
    weight[-1, -32:] *= 1e30  # magnitudes near fp32's range
    q, scales = quantize_int8(weight)
    scales[0, -1] = 1 + 2**-8  # q * scale halfway between two bf16 values for odd q: ties go to even
    expected = dequantize_int8(q, scales).to(torch.bfloat16)
    widened = vector_kernels.int8_to_bf16(q, scales)
    assert widened.dtype == torch.bfloat16 and torch.equal(widened.view(torch.int16), expected.view(torch.int16))
    with pytest.raises(ValueError, match="scales"):
        vector_kernels.int8_to_bf16(q, scales[:, :-1])


def _bf16_model_reference(x: torch.Tensor, weight16: torch.Tensor) -> torch.Tensor:
    """What a bf16 model computes for x W^T: bf16 inputs, an exact sum, the result rounded to bf16."""
    return (x.to(torch.bfloat16).double() @ weight16.double().T).to(torch.bfloat16).double()


# int8 kept: a widened copy kept; bf16 packed: a copy in oneDNN's layout
@pytest.mark.parametrize("scheme", ["int8", "int8 kept", "bf16", "bf16 packed", "none"])
def test_a_layer_multiplying_in_bf16_rounds_as_a_bf16_model_from_its_row_threshold_on(
    native_kernels: NativeKernels, scheme: str
) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(256, 72, bias=False)
    onednn = torch.backends.mkldnn.is_available()
    if scheme == "none":  # an fp32 checkpoint's layer, with a bf16 copy of its weight
        layer: Int8Linear | HalfLinear | Linear = Linear(256, 72, bias=False)
        layer.weight.data.copy_(linear.weight.data)
        layer.use_cpu_fast_paths(native_kernels.small_linear, onednn, pack=True, bf16_matmul=True)
        assert layer.packed_weight is None  # the bf16 copy replaces the fp32 packed one
        exact_weight, weight16 = linear.weight.detach(), linear.weight.detach().to(torch.bfloat16)
    elif scheme.startswith("int8"):
        layer = Int8Linear.from_linear(linear)
        kept = scheme == "int8 kept"
        layer.use_native_kernel(native_kernels.small_linear_int8, onednn, native_kernels.int8_to_bf16, kept)
        assert (layer.bf16_weight is not None) == kept
        exact_weight = dequantize_int8(layer.qweight, layer.scales)
        weight16 = exact_weight.to(torch.bfloat16)
    else:
        layer = HalfLinear.from_linear(linear, torch.bfloat16)
        packed = scheme == "bf16 packed"
        layer.use_native_kernel(native_kernels.small_linear_half, onednn, True, pack=packed)
        assert (layer.packed_weight is not None) == (packed and layer.bf16_onednn)
        weight16 = layer.weight16
        exact_weight = weight16.float()
    first_rows = {
        "int8": BF16_MATMUL_FROM_ROWS["int8"],
        "int8 kept": BF16_MATMUL_FROM_ROWS["bf16"],
        "bf16": BF16_MATMUL_FROM_ROWS["bf16"],
        "bf16 packed": BF16_MATMUL_FROM_ROWS["bf16"],
        "none": Linear.max_small_rows + 1,
    }
    first = first_rows[scheme]
    few, many = torch.randn(first - 1, 256), torch.randn(first, 256)
    out = layer(many)
    # Every output is a bf16 value (the bf16 path ran, not fp32) within one bf16 rounding of the exact product:
    # fp32 accumulation can move a sum across a rounding boundary, not further.
    assert torch.equal(out.to(torch.bfloat16).float(), out)
    reference = _bf16_model_reference(many, weight16)
    assert bool(((out.double() - reference).abs() <= reference.abs() * 2**-7 + 1e-6).all())
    fp32_rows = layer(few)  # fewer rows: the fp32 kernel, on the (converted) weights
    assert torch.allclose(fp32_rows.double(), few.double() @ exact_weight.double().T, rtol=1e-5, atol=1e-5 * 16)
    with pytest.raises(ValueError, match="bf16 weights"):
        HalfLinear.from_linear(linear, torch.float16).use_native_kernel(None, False, True)


def test_a_bf16_layer_packed_for_onednn_gives_the_bits_of_its_unpacked_weight(native_kernels: NativeKernels) -> None:
    """The packed copy only changes the layout oneDNN reads (and saves the reorder it otherwise does every call)."""
    if not (torch.backends.mkldnn.is_available() and onednn_runs_bf16()):
        pytest.skip("oneDNN does not multiply bf16 on this CPU: nothing is packed")
    torch.manual_seed(0)
    linear = nn.Linear(512, 1408, bias=True)
    layers = [HalfLinear.from_linear(linear, torch.bfloat16) for _ in range(2)]
    for layer, pack in zip(layers, (False, True)):
        layer.use_native_kernel(native_kernels.small_linear_half, True, True, pack=pack)
    assert layers[0].packed_weight is None and layers[1].packed_weight is not None
    for rows in (BF16_MATMUL_FROM_ROWS["bf16"], 16, 300):
        x = torch.randn(rows, 512)
        assert torch.equal(layers[0](x), layers[1](x))


@pytest.mark.parametrize("scheme", ["none", "int8 kept", "bf16"])
def test_an_mlp_multiplying_in_bf16_keeps_bf16_between_its_matmuls_as_a_bf16_model(
    native_kernels: NativeKernels, scheme: str
) -> None:
    """From the bf16 row threshold on, gate/up, SiLU, the product and down are rounded to bf16 where a bf16 model
    rounds them; fewer rows take the fp32 kernels."""
    torch.manual_seed(0)
    mlp = GatedMLP(64, 96)
    onednn = torch.backends.mkldnn.is_available()
    for name in ("gate_up_proj", "down_proj"):
        linear = getattr(mlp, name)
        if scheme == "none":
            linear.use_cpu_fast_paths(native_kernels.small_linear, onednn, pack=True, bf16_matmul=True)
        elif scheme == "int8 kept":
            int8 = Int8Linear.from_linear(linear)
            int8.use_native_kernel(native_kernels.small_linear_int8, onednn, native_kernels.int8_to_bf16, True)
            setattr(mlp, name, int8)
        else:
            half = HalfLinear.from_linear(linear, torch.bfloat16)
            half.use_native_kernel(native_kernels.small_linear_half, onednn, True, pack=True)
            setattr(mlp, name, half)
    mlp.use_native_kernels(native_kernels.elementwise)
    weights = []
    for projection in (mlp.gate_up_proj, mlp.down_proj):
        if isinstance(projection, Int8Linear):
            weights.append(dequantize_int8(projection.qweight, projection.scales).to(torch.bfloat16).double())
        elif isinstance(projection, HalfLinear):
            weights.append(projection.weight16.double())
        else:
            weights.append(projection.weight.detach().to(torch.bfloat16).double())
    rows = 40
    assert all(p.bf16_weight_for(rows) is not None for p in (mlp.gate_up_proj, mlp.down_proj))
    x = torch.randn(rows, 64)

    def bf16(t: torch.Tensor) -> torch.Tensor:
        return t.to(torch.bfloat16).double()

    gate, up = bf16(bf16(x) @ weights[0].T).split(96, dim=-1)
    reference = bf16(bf16(bf16(F.silu(gate)) * up) @ weights[1].T)
    out = mlp(x)
    assert torch.equal(out.to(torch.bfloat16).float(), out)  # rounded to bf16: the bf16 chain ran
    # fp32 sums (and SiLU in fp32 before its rounding) may cross a rounding boundary: one bf16 step, no more.
    assert bool(((out.double() - reference).abs() <= reference.abs() * 2**-7 + 1e-3).all())


def test_bf16_matmul_is_opt_in_cached_apart_and_close_to_the_fp32_model(llama_dir: Path) -> None:
    prompt = torch.randint(3, 900, (100,), generator=torch.Generator().manual_seed(7)).tolist()
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, prompt_logprobs=0)
    results = {}
    for matmul_dtype in ("float32", "bfloat16"):
        with LLM(str(llama_dir), quantization="int8", matmul_dtype=matmul_dtype) as llm:
            results[matmul_dtype] = (llm.engine.namespace.model_digest, llm.generate([prompt], params)[0])
    assert results["float32"][0].endswith("+int8-g32") and results["bfloat16"][0].endswith("+int8-g32+mm-bf16")
    exact, in_bf16 = ([e.logprob for e in out.prompt_logprobs[1:] if e is not None] for _, out in results.values())
    differences = [abs(a - b) for a, b in zip(exact, in_bf16, strict=True)]
    # The 100-token prefill took the bf16 matmul: its log-probabilities moved, by bf16 roundings only (on the
    # tiny model: 0.013 on average, 0.048 at most, on a Xeon with AMX).
    assert 0 < sum(differences) / len(differences) < 0.05 and max(differences) < 0.25
    with LLM(str(llama_dir), quantization="fp16", matmul_dtype="auto") as fp16:  # fp16 weights never go to bf16
        assert fp16.engine.namespace.model_digest.endswith("+fp16")
    checkpoint = {}  # an fp32 checkpoint, with bf16 copies of its weights for bf16 matmuls
    for matmul_dtype in ("float32", "bfloat16"):
        with LLM(str(llama_dir), matmul_dtype=matmul_dtype) as llm:
            output = llm.generate([prompt], params)[0]
            checkpoint[matmul_dtype] = [e.logprob for e in output.prompt_logprobs[1:] if e is not None]
            assert llm.engine.namespace.model_digest.endswith("+mm-bf16") == (matmul_dtype == "bfloat16")
    differences = [abs(a - b) for a, b in zip(checkpoint["float32"], checkpoint["bfloat16"], strict=True)]
    assert 0 < sum(differences) / len(differences) < 0.05 and max(differences) < 0.25
    with LLM(str(llama_dir), quantization="bf16", matmul_dtype="auto") as bf16:
        assert bf16.engine.namespace.model_digest.endswith("+mm-bf16") == cpu_has_fast_bf16()
    with pytest.raises(ValueError, match="matmul_dtype"):
        LLM(str(llama_dir), quantization="int8", matmul_dtype="float16")


def _round_tripped_reference(model_dir: Path, scheme: str) -> nn.Module:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    round_trip_linears(model, scheme)
    return model


@pytest.mark.parametrize(
    ("arch", "scheme"), [("llama", "int8"), ("qwen3", "int8"), ("llama", "fp16"), ("qwen2", "bf16")]
)
def test_a_converted_model_equals_hugging_face_on_the_round_tripped_weights(
    model_dirs: dict[str, Path], arch: str, scheme: str
) -> None:
    reference = _round_tripped_reference(model_dirs[arch], scheme)
    # 100 tokens: past the native kernels' rows, the widened weights' matmul (oneDNN's where PyTorch has it)
    prompts = [torch.randint(3, 900, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 40, 100)]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, prompt_logprobs=0)
    with LLM(str(model_dirs[arch]), quantization=scheme) as llm:
        converted = HalfLinear if scheme != "int8" else Int8Linear
        assert any(isinstance(m, converted) and m.kernel is not None for m in llm.engine.runner.model.modules())
        outputs = llm.generate(prompts, params)
    for prompt, output in zip(prompts, outputs):
        with torch.no_grad():
            sequence = reference.generate(
                torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0
            )
            log_probs = reference(torch.tensor([prompt])).logits[0].log_softmax(-1)
        assert output.token_ids == sequence[0, len(prompt) :].tolist()
        assert output.prompt_logprobs is not None
        for position, entry in enumerate(output.prompt_logprobs[1:], start=1):
            assert entry is not None
            assert entry.logprob == pytest.approx(float(log_probs[position - 1, prompt[position]]), abs=1e-4)


def test_converted_weights_cache_their_kv_apart_and_an_unknown_scheme_is_refused(llama_dir: Path) -> None:
    with (
        LLM(str(llama_dir)) as plain,
        LLM(str(llama_dir), quantization="int8") as int8,
        LLM(str(llama_dir), quantization="fp16") as fp16,
    ):
        roots = {llm.engine.namespace.root_key() for llm in (plain, int8, fp16)}
        assert len(roots) == 3
        assert int8.engine.namespace.model_digest.endswith("+int8-g32")
        assert fp16.engine.namespace.model_digest.endswith("+fp16")
    with pytest.raises(ValueError, match="quantization"):
        LLM(str(llama_dir), quantization="int4")


# ---------------------------------------------------------------------------- weight packages


@pytest.fixture(scope="module")
def package_dir(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("package") / "llama-int8"
    convert(llama_dir, "int8", out)
    return out


@pytest.mark.parametrize("scheme", ["int8", "bf16"])
def test_a_package_loads_the_tensors_converting_at_load_time_gives(
    llama_dir: Path, package_dir: Path, tmp_path: Path, scheme: str
) -> None:
    if scheme != "int8":
        package_dir = tmp_path / f"llama-{scheme}"
        convert(llama_dir, scheme, package_dir)
    prompt = [[5, 9, 14, 3, 77, 41, 2, 8, 100, 7]]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    with (
        LLM(str(llama_dir), quantization=scheme, served_model_name="m") as converted,
        LLM(str(package_dir), served_model_name="m") as packaged,
    ):
        ours, theirs = converted.engine.runner.model.state_dict(), packaged.engine.runner.model.state_dict()
        assert set(ours) == set(theirs)
        for name, tensor in ours.items():
            assert tensor.dtype == theirs[name].dtype and torch.equal(tensor, theirs[name]), name
        assert converted.engine.namespace.root_key() == packaged.engine.namespace.root_key()
        assert converted.generate(prompt, params)[0].token_ids == packaged.generate(prompt, params)[0].token_ids
    assert sum(p.stat().st_size for p in package_dir.iterdir()) < sum(p.stat().st_size for p in llama_dir.iterdir())


def _broken_copy(package_dir: Path, tmp_path: Path, how: str) -> Path:
    broken = tmp_path / how
    shutil.copytree(package_dir, broken)
    tensors, info_path = broken / "model.safetensors", broken / "kvyard_package.json"
    info = json.loads(info_path.read_text())
    if how == "flipped-byte":
        data = bytearray(tensors.read_bytes())
        data[len(data) // 2] ^= 0xFF
        tensors.write_bytes(bytes(data))
    elif how == "truncated":
        tensors.write_bytes(tensors.read_bytes()[: tensors.stat().st_size // 2])
    elif how == "missing-tensors":
        tensors.unlink()
    else:
        info.update({"newer-version": {"format_version": 2}, "int4": {"weights": "int4"}, "not-json": {}}[how])
        info_path.write_text("{not json" if how == "not-json" else json.dumps(info))
    return broken


@pytest.mark.parametrize(
    ("how", "message"),
    [
        ("flipped-byte", "SHA-256"),
        ("truncated", "corrupt or truncated"),
        ("missing-tensors", "is missing"),
        ("newer-version", "format version 2"),
        ("int4", "'int4'"),
        ("not-json", "not a kvyard package"),
    ],
)
def test_a_broken_package_is_refused_with_the_reason(package_dir: Path, tmp_path: Path, how: str, message: str) -> None:
    broken = _broken_copy(package_dir, tmp_path, how)
    with pytest.raises(ValueError, match=re.escape(message)):
        LLM(str(broken))
    result = subprocess.run(
        [sys.executable, "-m", "kvyard", "generate", str(broken), "--prompt", "x"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0 and message in result.stderr


def test_convert_refuses_a_non_empty_output_directory(llama_dir: Path, package_dir: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvyard", "convert", str(llama_dir), "--out", str(package_dir)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1 and "not empty" in result.stderr
