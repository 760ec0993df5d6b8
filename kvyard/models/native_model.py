"""A weight package run by the native CPU kernels alone, over numpy arrays: no PyTorch.

`kvyard serve` answers from this model while PyTorch loads (kvyard.engine.fast_start.engine): importing PyTorch takes
longer than loading a package. It computes what the PyTorch model computes on its fused few-rows path
(kvyard.models.fused_decode), calling `kvyard_decode_layer` once per layer with the same weights, tables and
cache layout, so the KV cache it fills is the one the PyTorch model later continues from.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvyard.kernels.bindings import bind_functions
from kvyard.kernels.build import HEADER, KernelsUnavailable, compiled_library
from kvyard.kernels.threads import engine_threads
from kvyard.models.config import ModelConfig, load_model_config
from kvyard.models.mapped_safetensors import map_tensors
from kvyard.models.package_info import PackageError, checked_tensors_file, read_info
from kvyard.models.rope_tables import rotary_tables

# KV formats the kernels store (kv_rows.h): numpy storage dtype, the kernels' code, extra bytes per row.
KV_STORAGE = {
    "fp32": (np.float32, 0, 0),
    "fp16": (np.float16, 1, 0),
    "bf16": (np.uint16, 2, 0),
    "int8": (np.uint8, 3, 4),
}
# The same codes by the name of the cache tensor's element type (PyTorch's, "torch." left off).
KV_CODES_BY_ELEMENT = {"float32": 0, "float16": 1, "bfloat16": 2, "uint8": 3}
FP16_KIND, BF16_KIND = 2, 3
_WEIGHT_KINDS = {np.dtype(np.float32): 0, np.dtype(np.int8): 1, np.dtype(np.float16): FP16_KIND}


def kernel_functions() -> dict[str, Any]:
    """The kernel library's functions, typed from its header (KernelsUnavailable where it cannot be built)."""
    path = compiled_library()
    try:
        library = ctypes.CDLL(str(path))
    except OSError as error:
        raise KernelsUnavailable(f"the compiled kernels at {path} would not load: {error}") from error
    header = HEADER.read_text()
    return bind_functions(library, header, header)  # argtypes come from the header the library was built from


def default_num_threads() -> int:
    """The served engine's threads (kvyard.kernels.threads), else one kernel thread per CPU this process may
    run on."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return engine_threads() or cpus


@dataclass(frozen=True, slots=True)
class Weights:
    """A linear layer's weights as the kernels take them: kind (0 fp32, 1 int8, 2 fp16, 3 bf16), [n, k], the
    int8 scales [n, k / 32], the bias [n]."""

    kind: int
    weight: np.ndarray
    scales: np.ndarray | None
    bias: np.ndarray | None


class NativeModel:
    """The package's model: embeddings, one native call per decoder layer, the final norm, the LM head."""

    def __init__(
        self,
        config: ModelConfig,
        tensors: dict[str, np.ndarray],
        weights_scheme: str,
        max_positions: int,
        functions: dict[str, Any],
        num_threads: int,
    ) -> None:
        """`tensors`: the model's own, by their names in a package (a PyTorch model's state dict, as numpy views, has
        the same names); `weights_scheme`: int8, fp16, bf16 (16-bit patterns as uint16) or none (fp32)."""
        self.config = config
        self.weights_scheme = weights_scheme
        self.tensors = tensors
        self.functions = functions
        self.num_threads = num_threads
        self.embed = self._tensor("model.embed_tokens.weight")
        self.final_norm = self._tensor("model.norm.weight")
        lm_head = self._weights("lm_head")
        self.lm_head = lm_head if lm_head is not None else Weights(0, self.embed, None, None)  # tied embeddings
        self.cos_table, self.sin_table = rotary_tables(config.rope, config.head_dim, max_positions)
        self.shape = (
            config.hidden_size,
            config.intermediate_size,
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
        )
        self.layer_args = [self._layer_args(index) for index in range(config.num_layers)]

    @classmethod
    def from_package(
        cls, package_dir: str | Path, max_positions: int, functions: dict[str, Any], num_threads: int
    ) -> NativeModel:
        """The package's model over its memory-mapped tensors, once their SHA-256 matches its description."""
        info = read_info(package_dir)
        tensors = map_tensors(checked_tensors_file(package_dir, info))
        return cls(load_model_config(package_dir), tensors, info.weights, max_positions, functions, num_threads)

    def _tensor(self, name: str) -> np.ndarray:
        tensor = self.tensors.get(name)
        if tensor is None:
            raise PackageError(f"the package lacks tensor {name!r}")
        return tensor

    def _weights(self, prefix: str) -> Weights | None:
        bias = self.tensors.get(f"{prefix}.bias")
        if f"{prefix}.qweight" in self.tensors:
            return Weights(1, self._tensor(f"{prefix}.qweight"), self._tensor(f"{prefix}.scales"), bias)
        for name in (f"{prefix}.weight16", f"{prefix}.weight"):
            if name in self.tensors:
                weight = self.tensors[name]
                bf16 = self.weights_scheme == "bf16" and weight.dtype == np.uint16
                if not bf16 and weight.dtype not in _WEIGHT_KINDS:
                    raise PackageError(f"{name} is {weight.dtype}: the native path reads fp32, int8, fp16 and bf16")
                return Weights(BF16_KIND if bf16 else _WEIGHT_KINDS[weight.dtype], weight, None, bias)
        return None

    def _linear(self, prefix: str) -> Weights:
        weights = self._weights(prefix)
        if weights is None:
            raise PackageError(f"the package lacks the weights of {prefix}")
        return weights

    def _layer_args(self, index: int) -> tuple[Any, ...]:
        """The fixed arguments of the layer's `kvyard_decode_layer` call, in the order DecodeLayerKernel.layer_args
        passes them."""
        config, prefix = self.config, f"model.layers.{index}"
        qkv, o = self._linear(f"{prefix}.self_attn.qkv_proj"), self._linear(f"{prefix}.self_attn.o_proj")
        gate_up, down = self._linear(f"{prefix}.mlp.gate_up_proj"), self._linear(f"{prefix}.mlp.down_proj")
        if any(linear.bias is not None for linear in (o, gate_up, down)):
            raise PackageError(f"{prefix} has a bias outside the QKV projection: not on the native path")
        q_norm = k_norm = None
        if config.qk_norm:
            q_norm = _ptr(self._tensor(f"{prefix}.self_attn.q_norm.weight"))
            k_norm = _ptr(self._tensor(f"{prefix}.self_attn.k_norm.weight"))
        return (
            *self.shape[:2],
            *self.shape[2:],
            config.rms_norm_eps,
            _ptr(self._tensor(f"{prefix}.input_layernorm.weight")),
            _ptr(self._tensor(f"{prefix}.post_attention_layernorm.weight")),
            q_norm,
            k_norm,
            *_weight_args(qkv),
            _optional_ptr(qkv.bias),
            *_weight_args(o),
            *_weight_args(gate_up),
            *_weight_args(down),
            _ptr(self.cos_table),
            _ptr(self.sin_table),
            config.head_dim**-0.5,
            self.num_threads,
        )

    def forward(self, input_ids: np.ndarray, step: NativeStep, kv: KVPointers) -> np.ndarray:
        """The final hidden states [rows, hidden] of a step's tokens, whose keys and values go into the caches."""
        return self.prepare(step, kv).run(input_ids)

    def prepare(self, step: NativeStep, kv: KVPointers) -> PreparedStep:
        """Every argument of the step's native calls, built once: the step can run again with other tokens after
        its arrays (positions, slots, context lengths) are updated in place, as a greedy draft does pass by pass."""
        rows = step.positions.shape[0]
        hidden, inter, num_heads, num_kv_heads, head_dim = self.shape
        max_context = step.max_blocks * step.block_size
        scratch = np.empty(
            self.functions["kvyard_decode_layer_scratch_floats"](
                rows, hidden, num_heads, num_kv_heads, head_dim, inter, max_context, self.num_threads
            ),
            dtype=np.float32,
        )
        residual = np.empty((rows, hidden), dtype=np.float32)
        out, normed = np.empty_like(residual), np.empty_like(residual)
        step_args = (
            kv.code,
            kv.slot_bytes,
            _ptr(step.slots),
            step.num_decodes,
            _ptr(step.block_tables),
            _ptr(step.context_lens),
            step.block_size,
            step.max_blocks,
            max_context,
            step.chunks.shape[0],
            _ptr(step.chunks),
            _ptr(step.chunk_tables),
            _ptr(scratch),
        )
        layers = enumerate(zip(self.layer_args, kv.layers, strict=True))
        calls = [
            (
                None if index == 0 else _ptr(out),
                _ptr(residual),
                _ptr(out),
                rows,
                _ptr(step.positions),
                k_cache,
                v_cache,
                *step_args,
                *args,
            )
            for index, (args, (k_cache, v_cache)) in layers
        ]
        norm = (_ptr(out), _ptr(residual), _ptr(self.final_norm), _ptr(normed), rows, hidden, self.config.rms_norm_eps)
        # Converted to C values once: a call of 47 Python values cost about 6 us more than one of C values.
        layer_types = self.functions["kvyard_decode_layer"].argtypes
        calls = [_c_values(layer_types, call) for call in calls]
        norm = _c_values(self.functions["kvyard_add_rms_norm"].argtypes, norm)
        return PreparedStep(self, step, calls, norm, residual, normed, (scratch, out))

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        """[rows, vocab] float32 logits of final hidden states [rows, hidden]."""
        hidden = np.ascontiguousarray(hidden, dtype=np.float32)
        head = self.lm_head
        rows, (n, k) = hidden.shape[0], head.weight.shape
        out = np.empty((rows, n), dtype=np.float32)
        x, w, y = hidden.ctypes.data, head.weight.ctypes.data, out.ctypes.data
        if head.kind == 1:
            self.functions["kvyard_small_linear_int8"](x, w, _ptr(head.scales), None, y, rows, n, k, self.num_threads)
        elif head.kind in (FP16_KIND, BF16_KIND):
            self.functions["kvyard_small_linear_half"](
                x, w, None, y, rows, n, k, int(head.kind == BF16_KIND), self.num_threads
            )
        else:
            self.functions["kvyard_small_linear"](x, w, None, y, rows, n, k, self.num_threads)
        return out

    def argmax(self, logits: np.ndarray) -> np.ndarray:
        """The greedy tokens of rows of logits, by the kernel the PyTorch runner uses (the same tie-breaking)."""
        logits = np.ascontiguousarray(logits, dtype=np.float32)
        out = np.empty(logits.shape[0], dtype=np.int64)
        self.functions["kvyard_argmax_rows"](logits.ctypes.data, logits.shape[0], logits.shape[1], out.ctypes.data)
        return out


@dataclass(frozen=True, slots=True)
class NativeStep:
    """A step's layout as `kvyard_decode_layer` reads it: every row's position and cache slot; the decodes'
    block tables [num_decodes, max_blocks] and context lengths; the chunks [num_chunks, 4] after them (first
    row, rows, context length, offset of the chunk's table in chunk_tables)."""

    positions: np.ndarray
    slots: np.ndarray
    num_decodes: int
    block_tables: np.ndarray
    context_lens: np.ndarray
    chunks: np.ndarray
    chunk_tables: np.ndarray
    block_size: int
    max_blocks: int

    @classmethod
    def of_queries(
        cls, starts: Sequence[int], lengths: Sequence[int], block_tables: Sequence[Sequence[int]], block_size: int
    ) -> NativeStep:
        """The step of queries in the engine's order, single-token ones first: query i computes `lengths[i]` tokens
        from position `starts[i]` in the blocks of `block_tables[i]`. A single-token query goes through decode
        attention (its table padded with block 0, which holds zeros); a longer one is a chunk reading its earlier
        keys from the cache through its table."""
        num_decodes = next((index for index, length in enumerate(lengths) if length != 1), len(lengths))
        max_blocks = max((len(table) for table in block_tables[:num_decodes]), default=1)
        tables = np.zeros((num_decodes, max_blocks), dtype=np.int64)
        chunks: list[list[int]] = []
        chunk_tables: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        for index, (start, length, table) in enumerate(zip(starts, lengths, block_tables, strict=True)):
            if index < num_decodes:
                tables[index, : len(table)] = table
            else:
                chunks.append([len(positions), length, start + length, len(chunk_tables)])
                chunk_tables += table
            for position in range(start, start + length):
                positions.append(position)
                slots.append(table[position // block_size] * block_size + position % block_size)
        context_lens = np.array([start + 1 for start in starts[:num_decodes]], dtype=np.int64)
        return cls(
            np.array(positions, dtype=np.int64),
            np.array(slots, dtype=np.int64),
            num_decodes,
            tables,
            context_lens,
            np.array(chunks, dtype=np.int64).reshape(-1, 4),
            np.array(chunk_tables, dtype=np.int64),
            block_size,
            max_blocks,
        )


@dataclass(frozen=True, slots=True)
class KVPointers:
    """The layers' caches as the kernels take them: (keys, values) addresses per layer, the bytes of one slot
    (kv heads x row), the format's code."""

    layers: list[tuple[int, int]]
    slot_bytes: int
    code: int

    @classmethod
    def of_arrays(cls, caches: list[np.ndarray], code: int) -> KVPointers:
        """From contiguous [2, slots, kv heads, row] arrays (kv_cache_views)."""
        layers = [(int(cache.ctypes.data), int(cache.ctypes.data) + cache.strides[0]) for cache in caches]
        return cls(layers, caches[0].strides[1], code)


@dataclass(slots=True)
class PreparedStep:
    """A step's native calls with their arguments built (NativeModel.prepare); holds every buffer they point to."""

    model: NativeModel
    step: NativeStep
    calls: list[tuple[Any, ...]]
    norm: tuple[Any, ...]
    residual: np.ndarray
    normed: np.ndarray
    buffers: tuple[np.ndarray, ...]

    def run(self, input_ids: np.ndarray) -> np.ndarray:
        """The final hidden states of `input_ids` at the step's positions (the returned array is reused)."""
        np.take(self.model.embed, input_ids, axis=0, out=self.residual)
        decode_layer = self.model.functions["kvyard_decode_layer"]
        for call in self.calls:
            if decode_layer(*call) != 0:
                raise MemoryError("prefill attention kernel could not allocate its scratch")
        self.model.functions["kvyard_add_rms_norm"](*self.norm)
        return self.normed


def kv_cache_buffers(config: ModelConfig, num_blocks: int, block_size: int, kv_name: str) -> list[mmap.mmap]:
    """One zero-filled anonymous map per layer for its cache [2, slots, kv heads, row]: pages cost nothing until
    written, and PyTorch can later view the same memory (torch.frombuffer)."""
    storage, _, extra = KV_STORAGE[kv_name]
    row_bytes = (config.head_dim + extra // np.dtype(storage).itemsize) * np.dtype(storage).itemsize
    num_bytes = 2 * num_blocks * block_size * config.num_kv_heads * row_bytes
    return [mmap.mmap(-1, num_bytes) for _ in range(config.num_layers)]


def kv_cache_views(buffers: list[mmap.mmap], config: ModelConfig, kv_name: str) -> list[np.ndarray]:
    storage, _, extra = KV_STORAGE[kv_name]
    row_width = config.head_dim + extra // np.dtype(storage).itemsize
    return [np.frombuffer(buffer, dtype=storage).reshape(2, -1, config.num_kv_heads, row_width) for buffer in buffers]


def _c_values(argtypes: Sequence[Any], values: Sequence[Any]) -> tuple[Any, ...]:
    """A call's arguments as the C values its argument types make of them (ctypes passes those on as they are)."""
    return tuple(ctype(value) for ctype, value in zip(argtypes, values, strict=True))


def _weight_args(weights: Weights) -> tuple[int, int, int | None]:
    return weights.kind, _ptr(weights.weight), _optional_ptr(weights.scales)


def _ptr(array: np.ndarray | None) -> int:
    assert array is not None and array.flags.c_contiguous
    return int(array.ctypes.data)


def _optional_ptr(array: np.ndarray | None) -> int | None:
    return None if array is None else _ptr(array)


__all__ = ["NativeModel", "NativeStep", "kernel_functions", "kv_cache_buffers", "kv_cache_views"]
