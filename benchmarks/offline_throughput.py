"""Offline throughput: kvyard against its peers, side by side, in one run.

    .venv/bin/python benchmarks/offline_throughput.py [--engines kvyard,hf,llamacpp,vllm] [--quick]

The driver creates the bench model once (kvyard's model creator, cached under
``--work-dir``), writes one seeded workload (token-id prompts) to JSON and runs
each engine's runner (``benchmarks/runners/*_runner.py``) as a subprocess in
that engine's own venv, one engine at a time, so each has the machine to
itself. Peer venvs come from ``benchmarks/setup_peers.sh``; a peer whose venv
or runner fails is recorded as skipped, with the reason.

Scenarios (greedy, EOS ignored, identical prompts for every engine):
  batch    N prompts, input 128-512, output 64-256 tokens (seeded): output and total tok/s
  decode   one 128-token prompt, 256 output tokens: decode tok/s and time to first token
  prefill  one 2048-token prompt, 1 output token: prefill tok/s

The result JSON holds the conditions, every engine's numbers and the
kvyard/peer ratio of each headline metric. Nothing here asserts on timings.
"""

from __future__ import annotations

import argparse
import datetime as dt
import fcntl
import json
import os
import platform
import random
import resource
import subprocess
import sys
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RUNNERS = REPO / "benchmarks" / "runners"
PEERS_DIR = Path(os.environ.get("KVYARD_PEERS_DIR", "/opt/kvyard-peers"))
LLAMA_CPP_VERSION = os.environ.get("LLAMA_CPP_VERSION", "0.3.36")
ALL_ENGINES = ("kvyard", "kvyard-int8", "kvyard-fp16", "kvyard-bf16", "hf", "llamacpp", "vllm")
# Also accepted: kvyard with its KV cache in another format, "kvyard[-WEIGHTS]+kv-FORMAT" (kvyard+kv-int8,
# kvyard-int8+kv-fp16, ...), FORMAT one of fp16, bf16, int8; and either ending in "+mm-bf16": fp32, int8 or bf16
# weights multiplying many rows in bf16 (--matmul-dtype bfloat16), as in kvyard-int8+kv-int8+mm-bf16.
KV_FORMATS = ("fp16", "bf16", "int8")
# Headline metric(s) per scenario; the ratio kvyard/peer is reported for each (higher is better).
HEADLINE = {
    "batch": ("output_tok_s", "total_tok_s"),
    "decode": ("decode_tok_s",),
    "prefill": ("prefill_tok_s",),
}


@dataclass(frozen=True)
class WorkloadShape:
    num_prompts: int
    input_len: tuple[int, int]
    output_len: tuple[int, int]
    decode_input: int
    decode_output: int
    prefill_input: int
    warmup_prompts: int = 2
    warmup_input: int = 32
    warmup_output: int = 8


FULL = WorkloadShape(64, (128, 512), (64, 256), 128, 256, 2048)
QUICK = WorkloadShape(8, (32, 64), (8, 16), 32, 32, 256, warmup_input=16, warmup_output=4)


@dataclass
class Engine:
    name: str
    python: Path
    runner: str
    env: dict[str, str] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)
    skip_reason: str | None = None


# ---------------------------------------------------------------- arguments


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--engines",
        default=",".join(ALL_ENGINES),
        help="comma-separated subset of "
        + ",".join(ALL_ENGINES)
        + ", or kvyard[-WEIGHTS][+kv-FORMAT][+mm-bf16] (FORMAT: "
        + ",".join(KV_FORMATS)
        + "; +mm-bf16: "
        "--matmul-dtype bfloat16)",
    )
    p.add_argument("--num-prompts", type=int, default=None, help="prompts in the offline batch (default 64, quick 8)")
    p.add_argument("--quick", action="store_true", help="tiny workload for smoke-testing")
    p.add_argument("--scenarios", default="batch,decode,prefill")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "offline_throughput.json")
    p.add_argument("--work-dir", type=Path, default=Path(os.environ.get("KVYARD_BENCH_DIR", "/tmp/kvyard-bench")))
    p.add_argument("--peers-dir", type=Path, default=PEERS_DIR)
    p.add_argument("--model-dir", type=Path, default=None, help="use this HF model dir instead of creating one")
    p.add_argument("--gguf-types", default="f16,f32", help="GGUF weight types to run llama.cpp with")
    p.add_argument("--llamacpp-slots", type=int, default=8, help="concurrent sequences for llama.cpp's batch run")
    p.add_argument(
        "--llamacpp-kv-split",
        action="store_true",
        help="one KV stream per llama.cpp slot instead of a unified cache (slower here)",
    )
    p.add_argument(
        "--llamacpp-no-repack",
        action="store_true",
        help="load llama.cpp weights without its extra buffer types (weight repacking, AMX): on a VM where its AMX "
        "path crashes",
    )
    p.add_argument("--hf-batch-size", type=int, default=8)
    p.add_argument(
        "--omp-wait-policy",
        choices=("active", "passive"),
        default=None,
        help="OMP_WAIT_POLICY for every engine (default: each engine's own); passive helps on a shared machine",
    )
    p.add_argument("--repeats", type=int, default=1, help="timed runs per scenario; the fastest is reported")
    p.add_argument("--timeout", type=int, default=3600, help="seconds per engine run")
    p.add_argument(
        "--wait-idle",
        type=int,
        default=600,
        help="wait up to this many seconds for idle CPUs before each engine",
    )
    return p.parse_args()


# ---------------------------------------------------------------- model and workload


def run_logged(cmd: list[str], log: Path, env: dict[str, str] | None = None, timeout: int | None = None) -> int:
    """Run ``cmd`` with stdout+stderr to ``log``; returns the exit code (124 on timeout)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as fh:
        try:
            return subprocess.run(
                cmd, stdout=fh, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}, timeout=timeout
            ).returncode
        except subprocess.TimeoutExpired:
            fh.write(f"\n[driver] timed out after {timeout} s\n")
            return 124


def ensure_model(args: argparse.Namespace, kvyard_python: Path) -> Path:
    """The bench model: ``--model-dir`` or kvyard's creator output, created once and cached."""
    if args.model_dir:
        return args.model_dir.resolve()
    out = args.work_dir / "models" / "llama-bench"
    if (out / "config.json").exists():
        return out
    model_args = ["--arch", "llama", "--preset", "bench", "--out", str(out)]
    log = args.work_dir / "logs" / "create_model.log"
    for entry in (
        ["kvyard.cli", "create-model"],
        ["kvyard.testing.create_model"],
    ):  # the CLI, else the creator module itself
        cmd = [str(kvyard_python), "-m", *entry, *model_args]
        print("creating bench model:", " ".join(cmd), flush=True)
        if run_logged(cmd, log, {"PYTHONPATH": str(REPO)}) == 0 and (out / "config.json").exists():
            return out
    sys.exit(f"model creation failed, see {log} (or pass --model-dir)")


def usable_token_ids(model_dir: Path) -> tuple[int, int, set[int]]:
    """Token-id range for random prompts, and the special ids to avoid."""
    config = json.loads((model_dir / "config.json").read_text())
    vocab = int(config["vocab_size"])
    special: set[int] = {
        int(config[k]) for k in ("bos_token_id", "eos_token_id", "pad_token_id") if isinstance(config.get(k), int)
    }
    tok_file = model_dir / "tokenizer.json"
    if tok_file.exists():
        tok = json.loads(tok_file.read_text())
        special |= {int(t["id"]) for t in tok.get("added_tokens", [])}
        vocab = min(vocab, len(tok.get("model", {}).get("vocab", {})) or vocab)
    return 0, vocab, special


def random_prompt(rng: random.Random, length: int, id_range: tuple[int, int, set[int]]) -> list[int]:
    lo, hi, special = id_range
    out: list[int] = []
    while len(out) < length:
        t = rng.randrange(lo, hi)
        if t not in special:
            out.append(t)
    return out


def make_workload(shape: WorkloadShape, num_prompts: int, seed: int, model_dir: Path) -> dict[str, Any]:
    rng = random.Random(seed)
    ids = usable_token_ids(model_dir)

    def scenario(inputs: list[int], outputs: list[int]) -> dict[str, Any]:
        return {"prompts": [random_prompt(rng, n, ids) for n in inputs], "output_lens": outputs}

    batch_in = [rng.randint(*shape.input_len) for _ in range(num_prompts)]
    batch_out = [rng.randint(*shape.output_len) for _ in range(num_prompts)]
    return {
        "model_dir": str(model_dir),
        "seed": seed,
        "warmup": scenario([shape.warmup_input] * shape.warmup_prompts, [shape.warmup_output] * shape.warmup_prompts),
        "scenarios": {
            "batch": scenario(batch_in, batch_out),
            "decode": scenario([shape.decode_input], [shape.decode_output]),
            "prefill": scenario([shape.prefill_input], [1]),
        },
    }


def workload_params(shape: WorkloadShape, num_prompts: int, seed: int, repeats: int) -> dict[str, Any]:
    return {
        "seed": seed,
        "batch": {
            "num_prompts": num_prompts,
            "input_len_uniform": shape.input_len,
            "output_len_uniform": shape.output_len,
        },
        "decode": {"input_len": shape.decode_input, "output_len": shape.decode_output},
        "prefill": {"input_len": shape.prefill_input, "output_len": 1},
        "warmup": {
            "prompts": shape.warmup_prompts,
            "input_len": shape.warmup_input,
            "output_len": shape.warmup_output,
        },
        "sampling": "greedy (temperature 0), ignore_eos",
        "repeats": repeats,
    }


# ---------------------------------------------------------------- engines


def venv_python(peers_dir: Path, name: str) -> Path:
    return peers_dir / name / "bin" / "python"


def ensure_gguf(args: argparse.Namespace, model_dir: Path, outtype: str) -> Path:
    """Convert the bench model to GGUF (cached next to the model's other derived files)."""
    out = args.work_dir / "gguf" / f"{model_dir.name}-{outtype}.gguf"
    if out.exists() and out.stat().st_mtime >= (model_dir / "config.json").stat().st_mtime:
        return out
    llama_dir = args.peers_dir / "src" / f"llama_cpp_python-{LLAMA_CPP_VERSION}" / "vendor" / "llama.cpp"
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [
        str(venv_python(args.peers_dir, "llamacpp")),
        str(RUNNERS / "gguf_convert.py"),
        "--llama-cpp-dir",
        str(llama_dir),
        str(model_dir),
        "--outtype",
        outtype,
        "--outfile",
        str(out),
    ]
    log = args.work_dir / "logs" / f"gguf_{outtype}.log"
    if run_logged(cmd, log) != 0 or not out.exists():
        raise RuntimeError(f"GGUF conversion ({outtype}) failed, see {log}")
    return out


def kvyard_engine(
    args: argparse.Namespace, quantization: str = "none", kv_cache_dtype: str = "auto", matmul_dtype: str = "float32"
) -> Engine:
    python = REPO / ".venv" / "bin" / "python"
    name = "kvyard" if quantization == "none" else f"kvyard-{quantization}"
    name += "" if kv_cache_dtype == "auto" else f"+kv-{kv_cache_dtype}"
    name += "" if matmul_dtype == "float32" else "+mm-bf16"
    return Engine(
        name,
        python if python.exists() else Path(sys.executable),
        "kvyard_runner.py",
        {"PYTHONPATH": str(REPO)},
        {"llm_kwargs": {"quantization": quantization, "kv_cache_dtype": kv_cache_dtype, "matmul_dtype": matmul_dtype}},
    )


def kvyard_variant(name: str) -> tuple[str, str, str] | None:
    """(weight scheme, KV format, matmul dtype) of an engine name kvyard[-WEIGHTS][+kv-FORMAT][+mm-bf16]; None if it
    is not one."""
    base, bf16_matmul, rest = name.partition("+mm-bf16")
    if rest:
        return None
    base, _, kv = base.partition("+kv-")
    weights = "none" if base == "kvyard" else base.removeprefix("kvyard-")
    if not base.startswith("kvyard") or weights not in ("none", "int8", "fp16", "bf16"):
        return None
    if "+kv-" in name and kv not in KV_FORMATS:
        return None
    return weights, kv or "auto", "bfloat16" if bf16_matmul else "float32"


def llamacpp_engines(args: argparse.Namespace, model_dir: Path) -> list[Engine]:
    python = venv_python(args.peers_dir, "llamacpp")
    engines = []
    for outtype in args.gguf_types.split(","):
        engine = Engine(f"llamacpp-{outtype}", python, "llamacpp_runner.py")
        if not python.exists():
            engine.skip_reason = f"no venv at {python.parent.parent} (run benchmarks/setup_peers.sh llamacpp)"
        else:
            try:
                engine.options = {
                    "gguf": str(ensure_gguf(args, model_dir, outtype)),
                    "dtype": outtype,
                    "slots": args.llamacpp_slots,
                    "kv_unified": not args.llamacpp_kv_split,
                    "extra_buffer_types": not args.llamacpp_no_repack,
                }
            except RuntimeError as exc:
                engine.skip_reason = str(exc)
        engines.append(engine)
    return engines


def vllm_engine(args: argparse.Namespace) -> Engine:
    venv = args.peers_dir / "vllm"
    env = {
        "LD_PRELOAD": str(venv / "lib" / "libiomp5.so"),
        "VLLM_CPU_KVCACHE_SPACE": "2",
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}",
    }
    return Engine("vllm", venv / "bin" / "python", "vllm_runner.py", env, {"dtype": "float32"})


def build_engines(args: argparse.Namespace, model_dir: Path) -> list[Engine]:
    engines: list[Engine] = []
    for name in args.engines.split(","):
        variant = kvyard_variant(name)
        if variant is not None:
            engines.append(kvyard_engine(args, *variant))
        elif name == "hf":
            engines.append(
                Engine(
                    "hf",
                    venv_python(args.peers_dir, "hf"),
                    "hf_runner.py",
                    options={"batch_size": args.hf_batch_size},
                )
            )
        elif name == "llamacpp":
            engines.extend(llamacpp_engines(args, model_dir))
        elif name == "vllm":
            engines.append(vllm_engine(args))
        else:
            sys.exit(f"unknown engine {name!r}; choose from {','.join(ALL_ENGINES)}")
    for engine in engines:
        if engine.skip_reason is None and not engine.python.exists():
            engine.skip_reason = f"no python at {engine.python} (run benchmarks/setup_peers.sh)"
    return engines


def cpu_times() -> tuple[float, float]:
    """Machine-wide (total, busy) CPU seconds since boot, from /proc/stat ((0, 0) where unavailable)."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return 0.0, 0.0
    tick = os.sysconf("SC_CLK_TCK")
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return sum(fields) / tick, (sum(fields) - idle) / tick


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def cpu_busy_fraction(window_s: float = 3.0) -> float:
    """Share of CPU time spent busy over ``window_s`` seconds."""
    total0, busy0 = cpu_times()
    time.sleep(window_s)
    total1, busy1 = cpu_times()
    return (busy1 - busy0) / max(total1 - total0, 1e-9)


def wait_for_idle(max_wait_s: int, busy_limit: float = 0.15) -> float:
    """Wait (at most ``max_wait_s``) for other work to leave the CPUs; returns the last busy share seen."""
    deadline = time.monotonic() + max_wait_s
    busy = cpu_busy_fraction()
    while busy > busy_limit and time.monotonic() < deadline:
        print(f"  machine busy ({busy:.0%} CPU), waiting ...", flush=True)
        time.sleep(10)
        busy = cpu_busy_fraction()
    return busy


def run_engine(args: argparse.Namespace, engine: Engine, workload_path: Path) -> dict[str, Any]:
    """Run one engine's runner alone; a failure becomes a skipped entry with its reason."""
    if engine.skip_reason:
        return {"engine": engine.name, "skipped": True, "reason": engine.skip_reason}
    out = args.work_dir / "results" / f"{engine.name}.json"
    out.unlink(missing_ok=True)
    log = args.work_dir / "logs" / f"{engine.name}.log"
    cmd = [
        str(engine.python),
        str(RUNNERS / engine.runner),
        "--workload",
        str(workload_path),
        "--out",
        str(out),
        "--engine",
        engine.name,
        "--scenarios",
        args.scenarios,
    ]
    busy = wait_for_idle(args.wait_idle)  # other work on the machine skews every number: keep it on record
    print(f"running {engine.name} (log: {log}) ...", flush=True)
    env = {**engine.env, **({"OMP_WAIT_POLICY": args.omp_wait_policy.upper()} if args.omp_wait_policy else {})}
    (total0, busy0), own0 = cpu_times(), children_cpu_s()
    code = run_logged(cmd, log, env, args.timeout)
    (total1, busy1), own1 = cpu_times(), children_cpu_s()
    # CPU share used by other processes while this engine ran (its own process tree excluded).
    foreign = max(0.0, (busy1 - busy0) - (own1 - own0)) / max(total1 - total0, 1e-9)
    if code != 0 or not out.exists():
        tail = log.read_text(errors="replace").strip().splitlines()[-5:]
        return {
            "engine": engine.name,
            "skipped": True,
            "reason": f"runner exited {code}; log {log}",
            "log_tail": tail,
        }
    return {
        **json.loads(out.read_text()),
        "cpu_busy_before": round(busy, 3),
        "foreign_cpu_share_during_run": round(foreign, 3),
    }


# ---------------------------------------------------------------- report


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def cpu_flags() -> list[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return [f for f in ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]


def git_commit() -> str:
    try:
        res = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
        dirty = subprocess.run(
            ["git", "-C", str(REPO), "status", "--porcelain", "kvyard"], capture_output=True, text=True
        ).stdout
        return res.stdout.strip() + ("-dirty" if dirty.strip() else "")
    except (subprocess.CalledProcessError, FileNotFoundError):
        return "unknown (no commit yet)"


def model_shape(model_dir: Path) -> dict[str, Any]:
    config = json.loads((model_dir / "config.json").read_text())
    keys = (
        "model_type",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "intermediate_size",
        "vocab_size",
        "max_position_embeddings",
        "tie_word_embeddings",
        "torch_dtype",
        "dtype",
    )
    shape = {k: config[k] for k in keys if k in config}
    shape["weights_bytes"] = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
    return shape


def version_of(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def conditions(args: argparse.Namespace, model_dir: Path, params: dict[str, Any]) -> dict[str, Any]:
    return {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "cpu": cpu_model(),
        "cpu_flags": cpu_flags(),
        "cores": os.cpu_count(),
        "threads": args.threads,
        "omp_wait_policy": args.omp_wait_policy or "engine default",
        "platform": platform.platform(),
        "kvyard_commit": git_commit(),
        "driver_torch": version_of("torch"),
        "model_dir": str(model_dir),
        "model": model_shape(model_dir),
        "workload": params,
        "quick": args.quick,
    }


def ratios(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """kvyard / peer for each scenario's headline metrics (>1 means kvyard is faster)."""
    base = results.get("kvyard", {}).get("scenarios")
    if not base:
        return {}
    out: dict[str, dict[str, Any]] = {}
    for name, res in results.items():
        if name == "kvyard" or res.get("skipped"):
            continue
        out[name] = {}
        for scenario, metrics in HEADLINE.items():
            for metric in metrics:
                mine, theirs = (
                    base.get(scenario, {}).get(metric),
                    res["scenarios"].get(scenario, {}).get(metric),
                )
                if mine and theirs:
                    out[name][f"{scenario}.{metric}"] = round(mine / theirs, 3)
    return out


def agreement(results: dict[str, dict[str, Any]], reference: str = "hf") -> dict[str, Any]:
    """Leading greedy decode-scenario tokens equal to the reference engine's (a sanity check, not a score)."""
    ref = results.get(reference, {}).get("scenarios", {}).get("decode", {}).get("first_tokens")
    if not ref:
        return {}
    out: dict[str, Any] = {"reference": reference}
    for name, res in results.items():
        mine = res.get("scenarios", {}).get("decode", {}).get("first_tokens") if not res.get("skipped") else None
        if mine and name != reference:
            pairs = list(zip(mine[0], ref[0], strict=False))
            same = next((i for i, (a, b) in enumerate(pairs) if a != b), len(pairs))
            out[name] = f"{same}/{len(ref[0])} leading tokens equal"
    return out


def fmt(value: Any, digits: int = 1) -> str:
    return f"{value:.{digits}f}" if isinstance(value, (int, float)) else "-"


def print_table(results: dict[str, dict[str, Any]], ratio: dict[str, dict[str, Any]]) -> None:
    cols = (
        "engine",
        "dtype",
        "batch out/s",
        "batch tot/s",
        "decode tok/s",
        "ttft s",
        "prefill tok/s",
        "vs kvyard (batch,dec,pre)",
        "others' CPU",
    )
    print("\n" + " | ".join(f"{c:>14}" for c in cols))
    for name, res in results.items():
        if res.get("skipped"):
            print(f"{name:>14} | skipped: {res['reason']}")
            continue
        s = res["scenarios"]
        r = ratio.get(name, {})
        rel = ",".join(fmt(r.get(k), 2) for k in ("batch.output_tok_s", "decode.decode_tok_s", "prefill.prefill_tok_s"))
        row = (
            name,
            res.get("dtype", "?"),
            fmt(s.get("batch", {}).get("output_tok_s")),
            fmt(s.get("batch", {}).get("total_tok_s")),
            fmt(s.get("decode", {}).get("decode_tok_s")),
            fmt(s.get("decode", {}).get("ttft_s"), 3),
            fmt(s.get("prefill", {}).get("prefill_tok_s")),
            rel if name != "kvyard" else "",
            fmt(100 * res.get("foreign_cpu_share_during_run", float("nan")), 0) + "%",
        )
        print(" | ".join(f"{c!s:>14}" for c in row))
    print("(ratios are kvyard/peer: >1 means kvyard is faster; others' CPU: share used by other processes)")


# ---------------------------------------------------------------- main


def hold_work_dir(work_dir: Path) -> Any:
    """Lock the work dir for this run: a second driver waits, so engines never run two at once."""
    work_dir.mkdir(parents=True, exist_ok=True)
    lock = (work_dir / ".lock").open("w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        print(f"another offline_throughput run holds {work_dir / '.lock'}; waiting for it ...", flush=True)
        fcntl.flock(lock, fcntl.LOCK_EX)
    return lock


def main() -> None:
    args = parse_args()
    lock = hold_work_dir(args.work_dir)  # held until the process exits
    shape = QUICK if args.quick else FULL
    num_prompts = args.num_prompts or shape.num_prompts
    model_dir = ensure_model(args, kvyard_engine(args).python)

    workload = make_workload(shape, num_prompts, args.seed, model_dir)
    engines = build_engines(args, model_dir)
    workload["threads"] = args.threads
    workload["repeats"] = args.repeats
    workload["engine_options"] = {e.name: e.options for e in engines}
    workload_path = args.work_dir / "workload.json"
    workload_path.write_text(json.dumps(workload))

    results = {engine.name: run_engine(args, engine, workload_path) for engine in engines}
    ratio = ratios(results)
    report = {
        "conditions": conditions(args, model_dir, workload_params(shape, num_prompts, args.seed, args.repeats)),
        "engines": results,
        "ratios_kvyard_over_peer": ratio,
        "greedy_agreement": agreement(results),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print_table(results, ratio)
    print(f"\nwrote {args.out}")
    lock.close()


if __name__ == "__main__":
    main()
