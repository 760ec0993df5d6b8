"""The command line: options generated from the config dataclasses, help for every command, clear errors."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from kvyard.bench.settings import BenchSettings, LengthRange
from kvyard.cli import COMMANDS, build_parser
from kvyard.cli.options import config_from_args
from kvyard.engine.config import EngineConfig
from kvyard.engine.sampling.params import SamplingParams
from kvyard.engine.scheduling.scheduler import SchedulerConfig
from kvyard.kvcache.config import KVTierConfig
from kvyard.router.config import RouterConfig
from kvyard.server.options import ServerOptions
from kvyard.settings import from_flat, walk_settings
from kvyard.sim.config import SimConfig


def run_kvyard(*arguments: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvyard", *arguments], capture_output=True, text=True, timeout=120)


def flags_of(cls: type) -> list[str]:
    return [item.metadata.get("flag") or "--" + item.name.replace("_", "-") for _, item, _ in walk_settings(cls)]


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_answers_help(command: str) -> None:
    result = run_kvyard(command, "--help")
    assert result.returncode == 0, result.stderr
    assert "usage: kvyard" in result.stdout


def test_a_named_command_builds_its_parser_alone() -> None:
    """`kvyard serve` parses its options without importing the simulator or the benchmark client."""
    code = (
        "import sys; from kvyard.cli import build_parser; parser = build_parser(['serve', 'm']); "
        "print(sorted(parser._subparsers._group_actions[0].choices), "
        "[m for m in ('kvyard.sim.config', 'kvyard.bench.client') if m in sys.modules])"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == "['serve'] []", result.stderr


def test_bench_parses_its_options_without_the_load_client() -> None:
    code = (
        "import sys; from kvyard.cli import build_parser; "
        "build_parser(['bench']).parse_args(['bench', '--seed', '1']); "
        "print([m for m in ('kvyard.bench.client', 'kvyard.bench.workloads', 'numpy') if m in sys.modules])"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == "[]", result.stderr


@pytest.mark.parametrize(
    ("command", "configs"),
    [
        ("serve", [EngineConfig, ServerOptions]),
        ("generate", [SamplingParams, EngineConfig]),
        ("sim", [SimConfig]),
        ("route", [RouterConfig]),
        ("bench", [BenchSettings]),
    ],
)
def test_each_setting_is_an_option_with_its_help_and_default(command: str, configs: list[type]) -> None:
    subparsers = build_parser()._subparsers
    assert subparsers is not None
    parser = subparsers._group_actions[0].choices[command]  # type: ignore[attr-defined]
    options = {flag: action for action in parser._actions for flag in action.option_strings}
    for cls in configs:
        for (_, item, _), flag in zip(walk_settings(cls), flags_of(cls)):
            if item.name == "served_model_name" and command == "generate":
                continue
            assert flag in options, f"{command} lacks {flag}"
            assert item.metadata["help"] in (options[flag].help or "")
            assert "(default: " in (options[flag].help or "") or "(none:" in item.metadata["help"]


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_option_of_every_command_has_help(command: str) -> None:
    subparsers = build_parser()._subparsers
    assert subparsers is not None
    parser = subparsers._group_actions[0].choices[command]  # type: ignore[attr-defined]
    bare = [action.option_strings[0] for action in parser._actions if action.option_strings and not action.help]
    assert not bare, f"{command}: options without help: {bare}"


@pytest.mark.parametrize("cls", [EngineConfig, SimConfig, RouterConfig, ServerOptions, SamplingParams, BenchSettings])
def test_setting_names_are_unique_within_a_config_tree(cls: type) -> None:
    names = [item.name for _, item, _ in walk_settings(cls)]
    assert len(names) == len(set(names))


def test_parsed_options_build_nested_configs() -> None:
    arguments = [
        "serve",
        "model-dir",
        "--max-num-seqs",
        "3",
        "--no-prefix-caching",
        "--kv-tier",
        "memory",
        "--kv-memory-gb",
        "0.5",
        "--max-queued-seqs",
        "7",
        "--prefill-only-step-tokens",
        "8192",
        "--prefill-order",
        "shortest",
        "--scheduling-policy",
        "priority",
    ]
    args = build_parser().parse_args(arguments)
    engine = config_from_args(EngineConfig, args, model="model-dir")
    assert engine.scheduler == SchedulerConfig(
        max_num_batched_tokens=2048,
        max_num_seqs=3,
        prefill_only_step_tokens=8192,
        prefill_order="shortest",
        scheduling_policy="priority",
    )
    assert not engine.enable_prefix_caching
    assert engine.kv_tier == KVTierConfig(tiers=("memory",), memory_gb=0.5)
    assert config_from_args(ServerOptions, args).max_queued_seqs == 7


def test_parsed_bench_options_build_its_settings() -> None:
    """Parsed values (a length range, a boolean's --no- form) reach the group that declares them; the default
    concurrency depends on the arrivals."""
    arguments = ["bench", "--base-url", "u", "--first-len", "8:16", "--no-ignore-eos", "--no-progress", "--seed", "3"]
    settings = config_from_args(BenchSettings, build_parser().parse_args(arguments))
    assert settings.server.base_url == "u" and not settings.server.ignore_eos and not settings.output.progress
    assert settings.multiturn.first_len == LengthRange(8, 16) and settings.load.seed == 3
    assert settings.load.concurrency_limit() == 1
    for more, limit in ((["--request-rate", "2"], None), (["--workload", "trace"], None), (["--concurrency", "4"], 4)):
        load = config_from_args(BenchSettings, build_parser().parse_args([*arguments, *more])).load
        assert load.concurrency_limit() == limit


def test_flat_keywords_go_to_the_setting_that_declares_them() -> None:
    config = EngineConfig.create("m", max_num_seqs=4, block_size=32)
    assert (config.scheduler.max_num_seqs, config.block_size, config.kv_tier) == (4, 32, None)
    tier = KVTierConfig(tiers=("memory",))
    assert EngineConfig.create("m", kv_tier=tier).kv_tier is tier
    with pytest.raises(TypeError, match="no setting 'max_num_seq'"):
        EngineConfig.create("m", max_num_seq=4)
    assert from_flat(SimConfig, {"max_num_seqs": 2}).scheduler.max_num_seqs == 2
    assert dataclasses.replace(SamplingParams(), stop="x").stop == ["x"]


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["serve", "--kv-tier", "floppy"], "kv tiers must be a non-empty subset"),
        (["serve", "--kv-tier", "redis"], "needs a URL"),
        (["serve", "--max-queued-seqs", "-1"], "max_queued_seqs must be >= 0"),
        (["sim", "--replicas", "0"], "--replicas must be at least 1"),
        (["sim", "--time-scale", "0"], "time_scale must be positive"),
        (["sim", "--catch-up-s", "-0.1"], "catch_up_s must be >= 0"),
        (["route", "--max-attempts", "0"], "max_attempts"),
        (["bench", "--base-url", "http://127.0.0.1:1", "--turns", "0"], "--turns must be at least 1"),
        (["bench", "--base-url", "http://127.0.0.1:1", "--length-scale", "0"], "--length-scale must be positive"),
        (["generate", "tiny", "--temperature", "-1", "--prompt", "x"], "temperature must be >= 0"),
    ],
)
def test_bad_settings_exit_2_with_the_reason_before_any_model_loads(arguments: list[str], message: str) -> None:
    result = run_kvyard(*arguments)
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr


def test_a_malformed_option_is_an_argparse_error() -> None:
    result = run_kvyard("serve", "--max-num-seqs", "many")
    assert result.returncode == 2 and "invalid int value: 'many'" in result.stderr


def test_a_blend_fraction_out_of_range_is_refused_naming_the_option() -> None:
    result = run_kvyard("serve", "--blend-recompute-fraction", "2")
    assert result.returncode == 2
    assert "argument --blend-recompute-fraction: must be from 0 to 1, not 2" in result.stderr


@pytest.mark.parametrize(("command", "code"), [("generate", 2), ("serve", 1)])
def test_a_model_that_cannot_load_ends_the_command_with_the_reason(tmp_path: Path, command: str, code: int) -> None:
    extra = ["--prompt", "x"] if command == "generate" else ["--port", "0"]
    result = run_kvyard(command, str(tmp_path), *extra)
    assert result.returncode == code
    assert f"no config.json in model directory {tmp_path}" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("command", ["serve", "route", "bench", "sim"])
def test_an_unknown_option_is_answered_with_the_commands_own_usage(command: str) -> None:
    result = run_kvyard(command, "--bogus")
    assert result.returncode == 2
    assert f"usage: kvyard {command}" in result.stderr and "unrecognized arguments: --bogus" in result.stderr


def test_a_model_path_that_does_not_exist_is_refused_before_serving(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    result = run_kvyard("serve", str(missing), "--port", "0")
    assert result.returncode == 2 and f"no such model directory: {missing}" in result.stderr
    assert "listening on" not in result.stderr + result.stdout


def test_convert_without_a_model_converts_the_demo_and_a_missing_one_is_refused(tmp_path: Path) -> None:
    result = run_kvyard("convert", "--weights", "bf16", "--out", str(tmp_path / "demo-bf16"))
    assert result.returncode == 0, result.stderr
    assert "the embedded demo model" in result.stderr
    assert (tmp_path / "demo-bf16" / "config.json").exists()
    missing = run_kvyard("convert", str(tmp_path / "nothing"), "--out", str(tmp_path / "out"))
    assert missing.returncode != 0 and "no such model directory" in missing.stderr
