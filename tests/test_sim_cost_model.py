"""The simulated replica's cost model and its calibration from a benchmark JSON (pure arithmetic, no clock)."""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path
from typing import Any

import pytest

from kvyard.cli.sim import add_sim_arguments, sim_config
from kvyard.sim.calibration import CalibrationError, _batch_lengths, _replay_seconds, attention_ratio, calibrate
from kvyard.sim.calibration import calibrate_from_json as calibrate_file
from kvyard.sim.cost_model import CostModel, StepShape, prefill_pairs
from kvyard.sim.roofline import LLAMA3_8B_BF16, roofline_preset

BENCHMARK_JSON = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "offline_throughput.json"
MODEL = CostModel(
    step_base_s=0.03, prefill_token_s=5e-4, attention_pair_s=2e-7, decode_seq_s=2e-3, decode_context_s=1e-7
)


def test_prefill_pairs_count_causal_attention() -> None:
    assert prefill_pairs(1, 0) == 1
    assert prefill_pairs(3, 0) == 6  # 1 + 2 + 3
    assert prefill_pairs(2, 10) == 11 + 12
    assert prefill_pairs(0, 100) == 0


def test_step_seconds_sums_every_term() -> None:
    shape = StepShape(prefill_tokens=100, prefill_pairs=5050, decode_seqs=4, decode_context_tokens=1000)
    expected = 0.03 + 100 * 5e-4 + 5050 * 2e-7 + 4 * 2e-3 + 1000 * 1e-7
    assert MODEL.step_seconds(shape) == pytest.approx(expected)
    assert MODEL.step_seconds(StepShape()) == 0.0


def test_prefill_is_linear_plus_quadratic_in_uncached_tokens() -> None:
    assert MODEL.prefill_seconds(1000) == pytest.approx(0.03 + 1000 * 5e-4 + 500500 * 2e-7)
    # Cached tokens cost nothing to compute, but the new ones attend to them.
    assert MODEL.prefill_seconds(100, num_cached=900) == pytest.approx(0.03 + 100 * 5e-4 + (90000 + 5050) * 2e-7)
    assert MODEL.prefill_seconds(100, num_cached=900) < MODEL.prefill_seconds(1000)
    doubled = MODEL.prefill_seconds(4000) - MODEL.step_base_s
    assert doubled > 2 * (MODEL.prefill_seconds(2000) - MODEL.step_base_s)  # the quadratic term shows


def test_decode_step_grows_with_sequences_and_context() -> None:
    assert MODEL.decode_step_seconds(8, 4000) == pytest.approx(0.03 + 8 * 2e-3 + 4000 * 1e-7)
    assert MODEL.scaled(0.5).decode_step_seconds(8, 4000) == pytest.approx(MODEL.decode_step_seconds(8, 4000) / 2)


def test_negative_constants_are_rejected() -> None:
    with pytest.raises(ValueError, match="decode_seq_s"):
        CostModel(decode_seq_s=-1.0)


def test_attention_ratio_from_model_dimensions() -> None:
    bench = {
        "hidden_size": 512,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "intermediate_size": 1408,
    }
    assert attention_ratio(bench) == pytest.approx(16384 / 47185920)
    assert attention_ratio(None) == attention_ratio(bench)


def _report_from(cost: CostModel) -> dict[str, Any]:
    """A benchmark JSON whose timings a replica with `cost` would have measured."""
    report = json.loads(BENCHMARK_JSON.read_text())
    kvyard = report["engines"]["kvyard"]["scenarios"]
    prefill_tokens = kvyard["prefill"]["input_tokens"]
    kvyard["prefill"]["prefill_tok_s"] = prefill_tokens / cost.prefill_seconds(prefill_tokens)
    context = kvyard["decode"]["input_tokens"] + (kvyard["decode"]["output_tokens"] + 1) // 2
    kvyard["decode"]["decode_tok_s"] = 1 / cost.decode_step_seconds(1, context)
    lengths = _batch_lengths(kvyard["batch"], report["conditions"]["workload"]["batch"])
    kvyard["batch"]["wall_s"] = _replay_seconds(cost, lengths, 2048)
    return report


def test_calibration_recovers_the_constants_that_produced_the_measurements() -> None:
    ratio = attention_ratio(None)
    truth = CostModel(
        step_base_s=0.025,
        prefill_token_s=6e-4,
        attention_pair_s=6e-4 * ratio,
        decode_seq_s=3e-3,
        decode_context_s=6e-4 * ratio,
    )
    fitted = calibrate(_report_from(truth)).cost
    for name in ("step_base_s", "prefill_token_s", "attention_pair_s", "decode_seq_s", "decode_context_s"):
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=1e-3), name


def test_calibration_reproduces_the_checked_in_benchmark() -> None:
    report = json.loads(BENCHMARK_JSON.read_text())
    calibration = calibrate_file(BENCHMARK_JSON)
    cost, measured = calibration.cost, report["engines"]["kvyard"]["scenarios"]
    assert calibration.max_num_batched_tokens == report["engines"]["kvyard"]["config"]["max_num_batched_tokens"]
    prefill = measured["prefill"]
    assert cost.prefill_seconds(prefill["input_tokens"]) == pytest.approx(
        prefill["input_tokens"] / prefill["prefill_tok_s"], rel=1e-6
    )
    assert cost.decode_step_seconds(1, 256) == pytest.approx(1 / measured["decode"]["decode_tok_s"], rel=1e-6)
    assert calibration.source["batch"]["fit_seconds"] == pytest.approx(measured["batch"]["wall_s"], rel=1e-3)


def test_default_constants_are_the_rounded_calibration() -> None:
    fitted, default = calibrate_file(BENCHMARK_JSON).cost, CostModel()
    for name in ("step_base_s", "prefill_token_s", "attention_pair_s", "decode_seq_s", "decode_context_s"):
        assert getattr(default, name) == pytest.approx(getattr(fitted, name), rel=0.01), name


def test_calibration_names_a_missing_field(tmp_path: Path) -> None:
    report = json.loads(BENCHMARK_JSON.read_text())
    broken = copy.deepcopy(report)
    del broken["engines"]["kvyard"]["scenarios"]["decode"]
    with pytest.raises(CalibrationError, match="decode"):
        calibrate(broken)
    with pytest.raises(CalibrationError, match=r"engines\.nope"):
        calibrate(report, engine="nope")
    path = tmp_path / "bad.json"
    path.write_text("{not json")
    with pytest.raises(CalibrationError, match="cannot read"):
        calibrate_file(path)


def test_roofline_preset_has_the_gpu_shape_prefill_bound_by_compute_decode_by_bandwidth() -> None:
    preset = roofline_preset("h100-llama3-8b")
    cost, model, device = preset.cost, preset.model, preset.device
    assert model.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2  # K and V, 32 layers, 8 KV heads, 128 dims, bf16
    # A step reads every weight once: 16 GB at 75 % of 3.35 TB/s, plus the launch overhead.
    assert cost.step_base_s == pytest.approx(8.03e9 * 2 / (3.35e12 * 0.75) + device.launch_overhead_s)
    assert cost.prefill_token_s == pytest.approx(2 * 8.03e9 / (989e12 * 0.5))
    # Decode: one more sequence costs little beside the weight read; a 2k-token prefill chunk costs ten steps.
    assert cost.decode_step_seconds(64, 64 * 1000) < 3 * cost.decode_step_seconds(1, 1000)
    assert cost.prefill_seconds(2048) > 10 * cost.decode_step_seconds(1, 1000)
    # On the measured CPU model the same comparison is the other way round: decode is not bandwidth-bound there.
    cpu = CostModel()
    assert cpu.decode_step_seconds(64, 64 * 1000) > 3 * cpu.decode_step_seconds(1, 1000)


def test_measured_h200_preset_takes_its_efficiencies_from_the_committed_calibration() -> None:
    results = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
    measured = json.loads((results / "gpu_roofline_calibration_2026-12-04_h200.json").read_text())["results"]
    preset = roofline_preset("h200-llama3-8b")
    device, cost, model = preset.device, preset.cost, LLAMA3_8B_BF16
    prefill = {row["tokens"]: row for row in measured["prefill_linears"]}
    assert device.compute_efficiency == pytest.approx(prefill[2048]["compute_efficiency"], abs=0.01)
    attention = {row["tokens"]: row for row in measured["prefill_attention"]}
    assert device.attention_efficiency == pytest.approx(attention[8192]["attention_efficiency"], abs=0.01)
    # Whole decode steps (CUDA graph): the step at 1 sequence is the weight read, the slope over sequences the KV.
    steps = {row["rows"]: row for row in measured["decode_steps_cuda_graph"]}
    context = steps[1]["context"]
    per_kv_token = (steps[128]["seconds"] - steps[1]["seconds"]) / (127 * context)
    assert device.kv_bandwidth_efficiency == pytest.approx(model.kv_bytes_per_token / per_kv_token / 4.8e12, abs=0.01)
    weight_read = steps[1]["seconds"] - context * per_kv_token
    assert device.bandwidth_efficiency == pytest.approx(model.weight_bytes / weight_read / 4.8e12, abs=0.01)
    assert cost.decode_context_s == pytest.approx(model.kv_bytes_per_token / (4.8e12 * 0.87))
    # The preset then predicts every measured whole step within 15 % (prefills from 2k tokens; at 512 it is 1.26x).
    for row in measured["decode_steps_cuda_graph"]:
        predicted = cost.decode_step_seconds(row["rows"], row["rows"] * row["context"])
        assert predicted == pytest.approx(row["seconds"], rel=0.15)
    for row in measured["prefills"]:
        if row["tokens"] >= 2048:
            assert cost.prefill_seconds(row["tokens"]) == pytest.approx(row["seconds"], rel=0.15)


def test_unknown_roofline_preset_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="h100-llama3-8b"):
        roofline_preset("tpu-v9")


def test_sim_cost_preset_sets_cost_kv_bytes_and_bandwidth_unless_given() -> None:
    parser = argparse.ArgumentParser()
    add_sim_arguments(parser)
    preset = roofline_preset("h100-llama3-8b")
    config = sim_config(parser.parse_args(["--cost-preset", preset.name]))
    assert (config.cost, config.kv_bytes_per_token, config.transfer_gb_per_s) == (
        preset.cost,
        131072,
        preset.transfer_gb_per_s,
    )
    given = sim_config(parser.parse_args(["--cost-preset", preset.name, "--transfer-gb-per-s", "3"]))
    assert (given.cost, given.transfer_gb_per_s) == (preset.cost, 3.0)
    default = sim_config(parser.parse_args([]))
    assert (default.cost, default.kv_bytes_per_token, default.transfer_gb_per_s) == (CostModel(), 16384, 1.25)
    with pytest.raises(ValueError, match="--calibrate and --cost-preset"):
        sim_config(parser.parse_args(["--cost-preset", preset.name, "--calibrate", str(BENCHMARK_JSON)]))
