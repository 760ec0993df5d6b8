"""A mixture-of-experts model larger than its weights budget (`--weights-memory-gb`): routed experts stay in the
package's file and are read as tokens pick them; the output is the unlimited run's, token for token."""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import save_file
from server_utils import start_server
from torch import nn
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from kvyard import LLM, SamplingParams
from kvyard.api.metrics import sample_sum
from kvyard.models import expert_residency
from kvyard.models.expert_residency import ExpertResidency, PagedTensor
from kvyard.models.mapped_safetensors import tensor_extents
from kvyard.models.package import convert
from kvyard.models.paged_experts import WeightsBudgetError

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def expert_heavy_dir(moe_model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Qwen3-MoE whose 2 x 32 experts are most of its weights (as in real MoE models; the tiny preset's are not)."""
    source = moe_model_dirs["qwen3_moe"]
    config = Qwen3MoeConfig.from_pretrained(source)
    config.num_experts, config.moe_intermediate_size, config.num_experts_per_tok = 32, 256, 4
    out = tmp_path_factory.mktemp("expert-heavy")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(11)
        Qwen3MoeForCausalLM(config).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (source / name).exists():
            shutil.copy(source / name, out / name)
    return out


@pytest.fixture(scope="module")
def int8_package(expert_heavy_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("expert-heavy-int8") / "package"
    convert(expert_heavy_dir, "int8", out)
    return out


def _prompts(count: int = 6) -> list[list[int]]:
    generator = torch.Generator().manual_seed(5)
    lengths = (1, 3, 20, 45, 70, 9)[:count]
    return [torch.randint(0, 1000, (n,), generator=generator).tolist() for n in lengths]


def _weights_gb(package: Path) -> float:
    return (package / "model.safetensors").stat().st_size / 1024**3


def test_a_quarter_of_the_model_in_memory_gives_the_unlimited_greedy_tokens(int8_package: Path) -> None:
    prompts = _prompts()
    unlimited = [out.token_ids for out in LLM(str(int8_package)).generate(prompts, GREEDY)]
    budget_gb = _weights_gb(int8_package) / 4
    for options in ({}, {"max_num_batched_tokens": 7}):
        llm = LLM(str(int8_package), weights_memory_gb=budget_gb, **options)
        try:
            paged = [out.token_ids for out in llm.generate(prompts, GREEDY)]
            snap = llm.engine.expert_residency_snapshot()
        finally:
            llm.close()
        assert paged == unlimited, options
        assert snap is not None and snap.experts == 64
        # Under a quarter of the experts fit beside the resident layers: experts were read, dropped and read again
        assert snap.resident_experts < 16 and snap.evictions > 0 and snap.misses > 0
        assert snap.read_bytes > snap.budget_bytes and snap.resident_bytes <= snap.budget_bytes
        assert 0 < snap.prefetch_hits <= snap.prefetches and snap.late_prefetches <= snap.prefetch_hits


def test_half_precision_and_deepseek_packages_page_their_experts(
    moe_model_dirs: dict[str, Path], expert_heavy_dir: Path, tmp_path: Path
) -> None:
    """bf16 experts, and DeepSeek-V3's layout (a dense first layer, a shared expert that stays resident)."""
    prompts = _prompts(4)
    for source, scheme in ((expert_heavy_dir, "bf16"), (moe_model_dirs["deepseek_v3"], "int8")):
        package = tmp_path / f"{source.name}-{scheme}"
        convert(source, scheme, package)
        unlimited = [out.token_ids for out in LLM(str(package)).generate(prompts, GREEDY)]
        experts_bytes = sum(
            e.nbytes for name, e in tensor_extents(package / "model.safetensors").items() if ".experts." in name
        )
        # everything but three quarters of the routed experts
        budget_gb = (_weights_gb(package) * 1024**3 - 0.75 * experts_bytes) / 1024**3
        llm = LLM(str(package), weights_memory_gb=budget_gb)
        try:
            assert [out.token_ids for out in llm.generate(prompts, GREEDY)] == unlimited, scheme
            snap = llm.engine.expert_residency_snapshot()
            assert snap is not None and snap.evictions > 0
        finally:
            llm.close()


def test_budgets_that_cannot_work_are_refused_with_the_reason(
    int8_package: Path, expert_heavy_dir: Path, model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    with pytest.raises(WeightsBudgetError, match="too small"):
        LLM(str(int8_package), weights_memory_gb=0.0001)
    dense = tmp_path / "dense-int8"
    convert(model_dirs["llama"], "int8", dense)
    with pytest.raises(WeightsBudgetError, match="has none"):
        LLM(str(dense), weights_memory_gb=0.0001)
    with pytest.raises(ValueError, match="convert it first"):
        LLM(str(expert_heavy_dir), weights_memory_gb=0.001)
    with pytest.raises(WeightsBudgetError, match="positive number"):
        LLM(str(int8_package), weights_memory_gb=float("inf"))
    with pytest.raises(ValueError, match="float32 only"):
        LLM(str(int8_package), weights_memory_gb=_weights_gb(int8_package) / 4, matmul_dtype="bfloat16")
    # A budget the whole model fits in pages nothing
    llm = LLM(str(int8_package), weights_memory_gb=1.0)
    assert llm.engine.expert_residency_snapshot() is None
    llm.close()
    command = [sys.executable, "-m", "kvyard.cli", "serve", str(int8_package), "--weights-memory-gb", "0"]
    refused = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "--weights-memory-gb" in refused.stderr


class _Holder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("weight", torch.empty(0, dtype=torch.float32))


def _residency(
    tmp_path: Path, count: int, fits: int
) -> tuple[ExpertResidency, dict[int, _Holder], dict[int, torch.Tensor]]:
    """`count` one-tensor experts of layer 0 in a file (expert i filled with i), `fits` of them within budget."""
    values = {i: torch.full((8, 16), float(i)) + torch.arange(16.0) for i in range(count)}
    path = tmp_path / "experts.safetensors"
    save_file({f"e{i}": tensor for i, tensor in values.items()}, str(path))
    extents = tensor_extents(path)
    holders = {i: _Holder() for i in range(count)}
    experts = {(0, i): (PagedTensor(holders[i], "weight", extents[f"e{i}"]),) for i in range(count)}
    return ExpertResidency(path, experts, fits * 8 * 16 * 4, half_life_uses=100), holders, values


def test_the_most_used_experts_stay_and_reads_are_byte_exact(tmp_path: Path) -> None:
    residency, holders, values = _residency(tmp_path, count=5, fits=3)
    try:
        for _ in range(5):
            residency.use(0, 0)
        residency.use(0, 1)
        residency.use(0, 2)
        residency.use(0, 3)  # drops the least used: 1 (as used as 2, less recently)
        assert holders[1].weight.numel() == 0
        for kept in (0, 2, 3):
            assert torch.equal(holders[kept].weight, values[kept])
        residency.use(0, 4)  # drops 2, never the five-times-used 0
        assert holders[2].weight.numel() == 0 and torch.equal(holders[0].weight, values[0])
        snap = residency.snapshot()
        assert (snap.misses, snap.hits, snap.evictions, snap.resident_experts) == (5, 4, 2, 3)
        assert snap.read_bytes == 5 * 8 * 16 * 4
    finally:
        residency.close()


def test_reading_ahead_never_drops_what_the_running_layer_wants(tmp_path: Path) -> None:
    residency, holders, values = _residency(tmp_path, count=6, fits=3)
    try:
        residency.want(0, [0, 1, 2])  # 1 and 2 read ahead; 0 is read by its use
        residency.use(0, 0)
        residency.prefetch(0, [3, 4, 5])  # the budget is full of wanted experts: nothing is read
        for number in (1, 2):
            residency.use(0, number)
            assert torch.equal(holders[number].weight, values[number])
        snap = residency.snapshot()
        assert (snap.prefetches, snap.prefetch_hits, snap.misses, snap.evictions) == (2, 2, 1, 0)
        residency.want(0, [5])
        residency.prefetch(0, [3])  # now 0-2 may go: one is dropped for the read ahead
        residency.use(0, 5)
        residency.use(0, 3)
        snap = residency.snapshot()
        assert snap.prefetch_hits == 3 and snap.resident_experts == 3 and snap.evictions == 2
        assert torch.equal(holders[3].weight, values[3]) and torch.equal(holders[5].weight, values[5])
    finally:
        residency.close()


def test_a_served_model_reports_its_expert_cache(int8_package: Path, tmp_path: Path) -> None:
    prompt = _prompts(3)[2]
    unlimited = LLM(str(int8_package)).generate([prompt], GREEDY)[0].text
    budget = str(_weights_gb(int8_package) / 4)
    server = start_server(int8_package, tmp_path, "--weights-memory-gb", budget)
    try:
        body = {"model": int8_package.name, "prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
        answer = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
        assert answer["choices"][0]["text"] == unlimited
        metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
        assert sample_sum(metrics, "kvyard_expert_cache_misses_total") > 0
        resident = sample_sum(metrics, "kvyard_expert_cache_resident_bytes")
        assert 0 < resident <= sample_sum(metrics, "kvyard_expert_cache_budget_bytes")
        assert sample_sum(metrics, "kvyard_expert_cache_experts") == 64
        assert "experts paged from disk:" in server.log() and "of 64 in memory" in server.log()
    finally:
        server.stop()


def test_the_serve_log_gets_the_caches_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(expert_residency, "LOG_INTERVAL_S", 0.0)
    monkeypatch.setattr(expert_residency, "LOG_CHECK_USES", 4)
    residency, _, _ = _residency(tmp_path, count=5, fits=3)
    try:
        with caplog.at_level(logging.INFO, logger="kvyard.models.expert_residency"):
            for number in (0, 1, 0, 2):
                residency.use(0, number)
        lines = [r.getMessage() for r in caplog.records]
        assert any("experts: 3 of 5 resident" in line and "4 uses, hit ratio 0.250" in line for line in lines)
    finally:
        residency.close()


def test_the_cache_starts_warm_and_drops_the_unused_first(tmp_path: Path) -> None:
    residency, holders, values = _residency(tmp_path, count=5, fits=3)
    try:
        assert residency.fill() == 3  # the file's first three experts
        residency.use(0, 0)
        residency.use(0, 4)  # drops 1, read at start and never used, not the used 0
        assert holders[1].weight.numel() == 0
        assert torch.equal(holders[0].weight, values[0]) and torch.equal(holders[4].weight, values[4])
        snap = residency.snapshot()
        assert (snap.hits, snap.misses, snap.evictions, snap.read_bytes) == (1, 1, 1, 4 * 8 * 16 * 4)
    finally:
        residency.close()


def test_a_failed_read_is_raised_by_its_use_and_frees_its_slot(tmp_path: Path) -> None:
    residency, holders, values = _residency(tmp_path, count=4, fits=2)
    path = tmp_path / "experts.safetensors"
    whole = path.read_bytes()
    try:
        path.write_bytes(whole[:64])  # truncated: every expert's bytes are gone
        with pytest.raises(OSError, match="ended"):
            residency.use(0, 0)  # read then
        residency.prefetch(0, [1])  # read ahead, on the reader thread
        with pytest.raises(OSError, match="ended"):
            residency.use(0, 1)
        assert residency.snapshot().resident_bytes == 0  # both slots given back
        path.write_bytes(whole)
        for number in (0, 1, 2):
            residency.use(0, number)
        assert torch.equal(holders[2].weight, values[2]) and residency.snapshot().resident_experts == 2
    finally:
        residency.close()
        residency.close()  # a second close does nothing


def test_the_eviction_order_stays_bounded_when_nothing_is_evicted(tmp_path: Path) -> None:
    residency, _, _ = _residency(tmp_path, count=4, fits=4)
    try:
        for _ in range(5000):
            residency.use(0, 0)
            residency.use(0, 1)
        assert len(residency._order.heap) <= 2 * 4 + 64
        residency.use(0, 2)
        residency.use(0, 3)
        assert residency.snapshot().evictions == 0
    finally:
        residency.close()
