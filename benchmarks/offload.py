"""Decode speed of a mixture-of-experts model bigger than the memory it is given: kvyard with --weights-memory-gb
against llama.cpp reading the same weights through its memory map, each process in a memory cgroup (cgroup v1,
as root) limited to a fraction of the weights' size, the page cache dropped before every run.

The model: a Qwen3-MoE of random weights in bf16 (--layers x --experts experts of --expert-size, --top-k a token,
hidden --hidden), written once as a Hugging Face checkpoint, converted to a kvyard int8 package and to a llama.cpp
q8_0 GGUF (both int8 with one scale per 32 weights). Two routers, each its own checkpoint:
- `uniform`: the random router as created, over a token embedding large enough (EMBED_STD) that each router sees
  mostly the token: sampled text spreads its picks about evenly, which no trained router does.
- `zipf`: the same weights but every token's hidden state carries a constant component (embedding column 0) that
  each layer's router reads with weight ln(p_e) for a Zipf law p_e ~ rank^-alpha over a random order of that
  layer's experts, scaled so the component's logit gaps match the router's other inputs (a Gumbel-like noise: top-k
  then samples about as p says). alpha is a parameter of this benchmark (default 1.0, the classic Zipf law), not a
  measurement of any trained model; the picks each run actually made are recorded and a fitted alpha reported.

Each run: one process, load, prefill a 16-token prompt, decode --tokens tokens one step each (or as many as
--max-seconds allows); decode tok/s is over every step after the first, and over the second half alone (once a page
cache has learnt what is popular). kvyard samples at temperature 1 with seed 0: a random model's greedy tokens soon
repeat a few tokens, whose experts any cache then holds. llama.cpp is fed kvyard's unlimited run's tokens, so both
decode the same text. kvyard's budget is the cgroup's limit less --allowance-gb for what is not weights
(interpreter, PyTorch, KV, activations). Outputs are checked: each engine's tokens under every limit equal its own
unlimited run's (kvyard's sampled tokens, llama.cpp's argmax at each fed position).

    .venv/bin/python benchmarks/offload.py --out benchmarks/results/offload.json

Disk: each router's model is written three times (bf16 checkpoint 4.9 GB, int8 package 2.9 GB, GGUF 2.7 GB at the
default shape): about 21 GB under --work-dir for both routers, kept for the next run; delete the directory after.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
PEERS = Path(os.environ.get("KVYARD_PEERS_DIR", "/opt/kvyard-peers"))
LLAMA_PYTHON = PEERS / "llamacpp" / "bin" / "python"
CGROUP = Path("/sys/fs/cgroup/memory/kvyard-offload")
GB = 1024**3
GUMBEL_STD = math.pi / math.sqrt(6)
# The token embedding's std. At the presets' ~1.2/sqrt(hidden) a random model's residual stream is the sum of its
# sublayers' outputs, much alike from token to token, and its router sent 68 % of picks to a tenth of the experts
# even for sampled text (measured in this benchmark's first runs); this large, every layer's router sees mostly the
# token itself, so sampled text spreads its picks.
EMBED_STD = 16.0


@dataclass(frozen=True, slots=True)
class Shape:
    hidden: int
    layers: int
    experts: int
    top_k: int
    expert_size: int
    heads: int = 16
    kv_heads: int = 4
    head_dim: int = 64


def main() -> None:
    args = _parse_args()
    if args.resummarize:
        summary = _summarize(json.loads(Path(args.resummarize).read_text()))
        Path(args.out).write_text(json.dumps(summary, indent=2) + "\n")
        _print_table(summary)
        if args.png:
            _plot(summary, Path(args.out).with_suffix(".png"))
        return
    work = Path(args.work_dir).expanduser()
    work.mkdir(parents=True, exist_ok=True)
    print(f"[offload] model files under {work} (about 10 GB a router at the default shape)", file=sys.stderr)
    shape = Shape(args.hidden, args.layers, args.experts, args.top_k, args.expert_size)
    _check_machine(args)
    results: dict[str, Any] = {"conditions": _conditions(args, shape), "runs": []}
    prompt = ",".join(str(17 + (i * 7919) % 30000) for i in range(16))
    for router in args.routers:
        checkpoint = _checkpoint(work, shape, router, args.alpha)
        package = _package(checkpoint, work / f"{checkpoint.name}-int8")
        gguf = None if args.skip_llamacpp else _gguf(checkpoint, work / f"{checkpoint.name}-q8_0.gguf")
        weights_bytes = (package / "model.safetensors").stat().st_size
        results["conditions"][f"{router}_weights_bytes"] = {
            "kvyard_package": weights_bytes,
            "gguf": gguf.stat().st_size if gguf else None,
        }
        feed: list[int] = []  # kvyard's unlimited run's tokens, fed to llama.cpp: both engines decode one text
        for fraction in args.fractions:
            limit = None if fraction >= 1.0 else int(fraction * weights_bytes)
            budget = None if limit is None else (limit - args.allowance_gb * GB) / GB
            run = _run("kvyard", router, fraction, limit, _kvyard_command(package, prompt, args, budget), args)
            results["runs"].append(run)
            feed = feed or run.get("tokens", [])
            if gguf is not None:
                llama = _llama_command(gguf, prompt, feed, args)
                results["runs"].append(_run("llama.cpp", router, fraction, limit, llama, args))
            Path(args.out).write_text(json.dumps(_summarize(results), indent=2) + "\n")
    summary = _summarize(results)
    Path(args.out).write_text(json.dumps(summary, indent=2) + "\n")
    _print_table(summary)
    if args.png:
        _plot(summary, Path(args.out).with_suffix(".png"))


# ------------------------------------------------------------------------------------------- the model


def _checkpoint(work: Path, shape: Shape, router: str, alpha: float) -> Path:
    """The bf16 Hugging Face checkpoint of `router` (made once; the same random weights for both routers)."""
    name = f"qwen3moe-h{shape.hidden}-l{shape.layers}-e{shape.experts}x{shape.expert_size}-k{shape.top_k}-v2-{router}"
    if router == "zipf":
        name += f"{alpha:g}"
    out = work / name
    if (out / "config.json").is_file():
        return out
    import torch
    from safetensors.torch import save_file

    from kvyard.testing.create_model import ensure_default_model

    template = ensure_default_model("qwen3_moe", "bench")  # its tokenizer and config fields
    partial = work / f".{name}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    for file in template.iterdir():
        if file.suffix != ".safetensors" and file.name != "model.safetensors.index.json":
            shutil.copy(file, partial / file.name)
    config = json.loads((template / "config.json").read_text())
    config.update(
        hidden_size=shape.hidden,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        num_experts=shape.experts,
        num_local_experts=shape.experts,
        num_experts_per_tok=shape.top_k,
        moe_intermediate_size=shape.expert_size,
        intermediate_size=shape.expert_size * shape.top_k,
        dtype="bfloat16",
    )
    (partial / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    print(f"[offload] writing {name} ...", file=sys.stderr, flush=True)
    tensors = _random_tensors(shape, int(config["vocab_size"]))
    if router == "zipf":
        _skew_routers(tensors, shape, alpha)
    save_file({key: value.to(torch.bfloat16) for key, value in tensors.items()}, str(partial / "model.safetensors"))
    partial.rename(out)
    return out


def _random_tensors(shape: Shape, vocab: int) -> dict[str, Any]:
    import torch

    generator = torch.Generator().manual_seed(0)
    std = 1.2 / math.sqrt(shape.hidden)  # as kvyard.testing's presets: logits of std ~1

    def normal(*size: int) -> torch.Tensor:
        return (torch.randn(*size, generator=generator) * std).to(torch.bfloat16)

    h, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    tensors: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": (torch.randn(vocab, h, generator=generator) * EMBED_STD).to(torch.bfloat16),
        "model.norm.weight": torch.ones(h),
        "lm_head.weight": normal(vocab, h),
    }
    for layer in range(shape.layers):
        prefix = f"model.layers.{layer}."
        tensors |= {
            prefix + "input_layernorm.weight": torch.ones(h),
            prefix + "post_attention_layernorm.weight": torch.ones(h),
            prefix + "self_attn.q_proj.weight": normal(q, h),
            prefix + "self_attn.k_proj.weight": normal(kv, h),
            prefix + "self_attn.v_proj.weight": normal(kv, h),
            prefix + "self_attn.o_proj.weight": normal(h, q),
            prefix + "self_attn.q_norm.weight": torch.ones(shape.head_dim),
            prefix + "self_attn.k_norm.weight": torch.ones(shape.head_dim),
            prefix + "mlp.gate.weight": normal(shape.experts, h),
        }
        for expert in range(shape.experts):
            e = f"{prefix}mlp.experts.{expert}."
            tensors[e + "gate_proj.weight"] = normal(shape.expert_size, h)
            tensors[e + "up_proj.weight"] = normal(shape.expert_size, h)
            tensors[e + "down_proj.weight"] = normal(h, shape.expert_size)
    return tensors


def _skew_routers(tensors: dict[str, Any], shape: Shape, alpha: float) -> None:
    """Embedding column 0 set to c, so that every token's normalized hidden state has about half its energy there
    (x0 ~ sqrt(H / 2)); each router's column 0 set to ln(p_e) s / (GUMBEL_STD x0), s the std of the router's logit
    from the other columns, so logit gaps are ln(p) in units of a Gumbel-like noise."""
    import torch

    h = shape.hidden
    std = 1.2 / math.sqrt(h)
    embed = tensors["model.embed_tokens.weight"].float()
    embed[:, 0] = EMBED_STD * math.sqrt(h)
    tensors["model.embed_tokens.weight"] = embed.to(torch.bfloat16)
    x0 = math.sqrt(h / 2)
    noise = std * math.sqrt(h / 2)
    generator = torch.Generator().manual_seed(1)
    ranks = torch.arange(1, shape.experts + 1, dtype=torch.float64)
    log_p = -alpha * ranks.log() - torch.log((ranks ** (-alpha)).sum())
    for layer in range(shape.layers):
        order = torch.randperm(shape.experts, generator=generator)
        gate = tensors[f"model.layers.{layer}.mlp.gate.weight"].float()
        gate[order, 0] = (log_p * noise / (GUMBEL_STD * x0)).float()
        tensors[f"model.layers.{layer}.mlp.gate.weight"] = gate.to(torch.bfloat16)


def _package(checkpoint: Path, out: Path) -> Path:
    if (out / "kvyard_package.json").is_file():
        return out
    print(f"[offload] converting {checkpoint.name} to an int8 package ...", file=sys.stderr, flush=True)
    partial = out.with_name(f".{out.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    subprocess.run(
        [sys.executable, "-m", "kvyard.cli", "convert", str(checkpoint), "--weights", "int8", "--out", str(partial)],
        check=True,
    )
    partial.rename(out)
    return out


def _gguf(checkpoint: Path, out: Path) -> Path:
    if out.is_file():
        return out
    print(f"[offload] converting {checkpoint.name} to GGUF q8_0 ...", file=sys.stderr, flush=True)
    llama_cpp_dir = next((PEERS / "src").glob("llama_cpp_python-*/vendor/llama.cpp"))
    partial = out.with_name(f".{out.name}.partial")
    command = [str(LLAMA_PYTHON), str(HERE / "runners" / "gguf_convert.py"), "--llama-cpp-dir", str(llama_cpp_dir)]
    subprocess.run([*command, str(checkpoint), "--outtype", "q8_0", "--outfile", str(partial)], check=True)
    partial.rename(out)
    return out


# ------------------------------------------------------------------------------------------- the runs


def _kvyard_command(package: Path, prompt: str, args: argparse.Namespace, budget_gb: float | None) -> list[str]:
    command = [sys.executable, str(HERE / "runners" / "offload_kvyard.py"), str(package), "--prompt", prompt]
    command += ["--tokens", str(args.tokens), "--max-seconds", str(args.max_seconds)]
    return command + ([] if budget_gb is None else ["--weights-memory-gb", f"{budget_gb:.4f}"])


def _llama_command(gguf: Path, prompt: str, feed: list[int], args: argparse.Namespace) -> list[str]:
    command = [str(LLAMA_PYTHON), str(HERE / "runners" / "offload_llamacpp.py"), str(gguf), "--prompt", prompt]
    command += ["--feed", ",".join(map(str, feed))] if feed else []
    return [*command, "--tokens", str(args.tokens), "--max-seconds", str(args.max_seconds)]


def _run(
    engine: str, router: str, fraction: float, limit: int | None, command: list[str], args: argparse.Namespace
) -> dict[str, Any]:
    subprocess.run(["sync"], check=True)
    Path("/proc/sys/vm/drop_caches").write_text("3\n")
    _cgroup(limit)
    print(f"[offload] {engine} {router} at {fraction:g}x ({_gb(limit)}) ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    procs = CGROUP / "cgroup.procs"
    done = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=args.max_seconds + 600,
        preexec_fn=lambda: procs.write_text(str(os.getpid())),
        env={**os.environ, "OMP_NUM_THREADS": str(os.cpu_count() or 1)},
    )
    wall = time.perf_counter() - start
    run: dict[str, Any] = {
        "engine": engine,
        "router": router,
        "fraction": fraction,
        "limit_bytes": limit,
        "wall_s": wall,
        "peak_bytes": int((CGROUP / "memory.max_usage_in_bytes").read_text()),
        "returncode": done.returncode,
    }
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        run["error"] = (done.stderr or done.stdout)[-2000:]
        print(f"[offload]   failed ({done.returncode}): {run['error'][-300:]}", file=sys.stderr, flush=True)
        return run
    run |= json.loads(lines[-1])
    steps = run["step_s"][1:]
    run["decode_tok_s"] = len(steps) / sum(steps) if steps else None
    later = steps[len(steps) // 2 :]
    run["second_half_tok_s"] = len(later) / sum(later) if later else None
    print(f"[offload]   {run['decode_tok_s']:.2f} tok/s over {len(steps)} steps", file=sys.stderr, flush=True)
    return run


def _cgroup(limit: int | None) -> None:
    CGROUP.mkdir(exist_ok=True)
    (CGROUP / "memory.limit_in_bytes").write_text("-1\n" if limit is None else f"{limit}\n")
    (CGROUP / "memory.max_usage_in_bytes").write_text("0\n")


def _gb(limit: int | None) -> str:
    return "no limit" if limit is None else f"{limit / GB:.2f} GB"


# ------------------------------------------------------------------------------------------- the summary


def _summarize(results: dict[str, Any]) -> dict[str, Any]:
    runs = results["runs"]
    unlimited = {(r["engine"], r["router"]): r.get("tokens") for r in runs if r["fraction"] >= 1.0}
    for run in runs:
        reference = unlimited.get((run["engine"], run["router"]))
        tokens = run.get("tokens")
        if tokens is not None and reference is not None:
            common = min(len(tokens), len(reference))
            run["tokens_equal_unlimited"] = tokens[:common] == reference[:common]
        if "picks" in run:
            run["zipf_alpha_fitted"] = _fitted_alpha(run["picks"])
            run["top_decile_share"] = _top_decile_share(run["picks"])
    table = []
    for run in runs:
        if run["engine"] != "kvyard":
            continue
        peer = next(
            (
                r
                for r in runs
                if r["engine"] == "llama.cpp" and (r["router"], r["fraction"]) == (run["router"], run["fraction"])
            ),
            None,
        )
        mine, theirs = run.get("decode_tok_s"), peer.get("decode_tok_s") if peer else None
        mine_late, theirs_late = run.get("second_half_tok_s"), peer.get("second_half_tok_s") if peer else None
        table.append(
            {
                "router": run["router"],
                "fraction": run["fraction"],
                "kvyard_tok_s": mine,
                "llamacpp_tok_s": theirs,
                "kvyard_over_llamacpp": mine / theirs if mine and theirs else None,
                "second_half_kvyard_over_llamacpp": mine_late / theirs_late if mine_late and theirs_late else None,
                "expert_hit_ratio": _hit_ratio(run.get("expert_cache")),
                "top_decile_share": run.get("top_decile_share"),
            }
        )
    return {**results, "table": table}


def _fitted_alpha(picks: dict[str, list[int]]) -> float:
    """The Zipf exponent fitted to the picks (least squares of log count on log rank, every layer's counts ranked)."""
    xs, ys = [], []
    for counts in picks.values():
        for rank, count in enumerate(sorted(counts, reverse=True), start=1):
            if count > 0:
                xs.append(math.log(rank))
                ys.append(math.log(count))
    if len(xs) < 2:
        return float("nan")
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum((x - mean_x) ** 2 for x in xs)
    return -slope


def _top_decile_share(picks: dict[str, list[int]]) -> float:
    """The share of picks that went to each layer's most picked tenth of experts, over all layers (0.1 for a
    router picking evenly; sampling noise in a short run adds a little)."""
    top, total = 0, 0
    for counts in picks.values():
        ranked = sorted(counts, reverse=True)
        top += sum(ranked[: max(1, len(ranked) // 10)])
        total += sum(ranked)
    return top / total if total else float("nan")


def _hit_ratio(cache: dict[str, Any] | None) -> float | None:
    """The share of expert uses that found the expert in memory, read and ready (a read ahead still under way is
    not a hit here)."""
    if not cache:
        return None
    uses = cache["hits"] + cache["misses"]
    return (cache["hits"] - cache["late_prefetches"]) / uses if uses else None


def _print_table(summary: dict[str, Any]) -> None:
    print(f"{'router':8} {'budget':>7} {'kvyard':>9} {'llama.cpp':>9} {'ratio':>6} {'late':>6} {'hit':>5}")
    for row in summary["table"]:
        keys = ("kvyard_tok_s", "llamacpp_tok_s", "kvyard_over_llamacpp", "second_half_kvyard_over_llamacpp")
        cells = [row[key] for key in keys] + [row["expert_hit_ratio"]]
        t = ["-" if v is None else f"{v:.2f}" for v in cells]
        print(f"{row['router']:8} {row['fraction']:>6g}x {t[0]:>9} {t[1]:>9} {t[2]:>6} {t[3]:>6} {t[4]:>5}")


def _plot(summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    routers = sorted({r["router"] for r in summary["runs"]})
    for axis, router in zip(axes, routers):
        for engine, style in (("kvyard", "o-"), ("llama.cpp", "s--")):
            points = sorted(
                (r["fraction"], r["decode_tok_s"])
                for r in summary["runs"]
                if r["engine"] == engine and r["router"] == router and r.get("decode_tok_s")
            )
            if points:
                axis.plot(*zip(*points), style, label=engine)
        axis.set_title(f"{router} router")
        axis.set_xlabel("memory limit / weights size")
        axis.set_xscale("log", base=2)
        axis.grid(alpha=0.3)
    axes[0].set_ylabel("single-stream decode tok/s")
    axes[0].legend()
    conditions = summary["conditions"]
    figure.suptitle(f"MoE decode under a memory cgroup ({conditions['cpu']}, page cache dropped per run)", fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


# ------------------------------------------------------------------------------------------- set-up


def _conditions(args: argparse.Namespace, shape: Shape) -> dict[str, Any]:
    from kvyard.bench.provenance import host, of_run

    return {
        "cpu": host()["cpu"],
        "cores": os.cpu_count(),
        "run": of_run(),
        "shape": asdict(shape),
        "alpha": args.alpha,
        "tokens": args.tokens,
        "max_seconds": args.max_seconds,
        "allowance_gb": args.allowance_gb,
        "prompt_tokens": 16,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "kvyard": "int8 package (one fp32 scale per 32 weights), --weights-memory-gb = limit - allowance",
        "llama.cpp": "q8_0 GGUF, memory-mapped, weight repacking off, 2 threads, fed kvyard's tokens",
        "sampling": "kvyard: temperature 1, seed 0",
    }


def _check_machine(args: argparse.Namespace) -> None:
    if os.geteuid() != 0:
        raise SystemExit("offload.py needs root: it makes a memory cgroup and drops the page cache")
    if not Path("/sys/fs/cgroup/memory").is_dir():
        raise SystemExit("offload.py needs cgroup v1's memory controller at /sys/fs/cgroup/memory")
    if not args.skip_llamacpp and not LLAMA_PYTHON.is_file():
        raise SystemExit(
            f"no llama.cpp peer at {LLAMA_PYTHON}: bash benchmarks/setup_peers.sh llamacpp, or --skip-llamacpp"
        )


def _fractions(text: str) -> list[float]:
    values = [float(v) for v in text.split(",")]
    if any(not 0 < v <= 1 for v in values):
        raise argparse.ArgumentTypeError(f"fractions must be in (0, 1], got {text}")
    return sorted(values, reverse=True)


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--work-dir",
        default="~/.cache/kvyard/offload",
        help="where the model files are kept (about 21 GB for both routers at the default shape)",
    )
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--experts", type=int, default=96)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--expert-size", type=int, default=512)
    parser.add_argument("--routers", type=lambda t: t.split(","), default=["uniform", "zipf"])
    parser.add_argument("--alpha", type=float, default=1.0, help="the zipf router's exponent")
    parser.add_argument(
        "--fractions", type=_fractions, default=[1.0, 0.75, 0.5, 0.375, 0.25], help="memory limits / weights size"
    )
    parser.add_argument(
        "--allowance-gb",
        type=float,
        default=0.35,
        help="kvyard's memory for what is not weights: measured here 0.2 GB anonymous (interpreter, PyTorch, KV, "
        "activations) and 0.09 GB of mapped code after decoding",
    )
    parser.add_argument("--tokens", type=int, default=48, help="greedy tokens per run")
    parser.add_argument("--max-seconds", type=float, default=240, help="decoding stops after this many seconds")
    parser.add_argument("--skip-llamacpp", action="store_true")
    parser.add_argument("--png", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--out", default=str(HERE / "results" / "offload.json"))
    parser.add_argument("--resummarize", metavar="JSON", help="summarize an earlier run's file again into --out")
    args = parser.parse_args()
    if args.routers and any(r not in ("uniform", "zipf") for r in args.routers):
        parser.error(f"--routers takes uniform and zipf, got {args.routers}")
    return args


if __name__ == "__main__":
    main()
