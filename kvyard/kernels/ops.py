"""Native CPU kernels as functions of torch tensors (fp32 activations, on CPU).

Only what PyTorch lacks or does slowly here: decode and prefill-chunk attention that read the paged
KV cache in place instead of gathering it into a temporary first, the few-row matmul of a decode step,
which must stream the weights at memory speed, and fused elementwise work. Each wrapper states the C
prototypes it calls; `bind_kernels` checks them against the library's header before binding anything.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kvyard.kernels.bindings import bind_functions
from kvyard.kernels.build import HEADER, KernelsUnavailable, compiled_library
from kvyard.kernels.threads import engine_threads

# The KV-cache formats the kernels read and write (kv_rows.h), by the cache tensor's dtype (uint8: int8 rows with
# their scale, kvyard.models.kv_format).
KV_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.uint8: 3}
INT8_ROW_SCALE_BYTES = 4  # an int8 row is head_dim int8 values, then its fp32 scale


@dataclass(frozen=True, slots=True)
class PagedDecodeKernel:
    PROTOTYPES: ClassVar[str] = """
        void kvyard_paged_decode_attention(const float *q, const void *k_cache, const void *v_cache, int kv_dtype,
            const int64_t *block_tables, const int64_t *context_lens, float *out, float *workspace, int num_seqs,
            int num_heads, int num_kv_heads, int head_dim, int block_size, int max_blocks, int64_t max_context,
            float scale, int num_threads);
    """

    function: Callable[..., Any]
    num_threads: int

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        max_context: int,
        block_size: int,
        scale: float,
    ) -> torch.Tensor:
        """q: [B, Hq, D]; caches: [slots, Hkv, row] contiguous; tables: [B, max_blocks] int64; lens: [B] int64."""
        q = q.contiguous()
        num_seqs, num_heads, head_dim = q.shape
        num_kv_heads = k_cache.shape[1]
        _check_cache(k_cache, v_cache, head_dim)
        if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            raise ValueError("the decode kernel reads slots packed back to back: the caches must be contiguous")
        out = torch.empty_like(q)
        workspace = torch.empty(self.num_threads * num_heads * max(1, max_context))
        self.function(
            _ptr(q),
            _ptr(k_cache),
            _ptr(v_cache),
            KV_DTYPE_CODES[k_cache.dtype],
            _ptr(block_tables),
            _ptr(context_lens),
            _ptr(out),
            _ptr(workspace),
            num_seqs,
            num_heads,
            num_kv_heads,
            head_dim,
            block_size,
            block_tables.shape[1],
            max_context,
            scale,
            self.num_threads,
        )
        return out


@dataclass(frozen=True, slots=True)
class PagedPrefillKernel:
    """Causal attention of a prefill chunk (the last query_len of context_len positions), fp32 arithmetic.

    Keys and values are read in place, either from the paged cache (any KV format) through a block table or
    from contiguous fp32 [context_len, Hkv, D] rows; rows may be strided but each row's heads are contiguous."""

    PROTOTYPES: ClassVar[str] = """
        int kvyard_paged_prefill_attention(const float *q, int64_t q_stride, const void *k_cache,
            const void *v_cache, int kv_dtype, int64_t kv_stride_bytes, const int64_t *block_table, int block_size,
            int64_t query_len, int64_t context_len, int num_heads, int num_kv_heads, int head_dim, float scale,
            float *out, int num_threads);
    """

    function: Callable[..., Any]
    num_threads: int

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_table: torch.Tensor,
        context_len: int,
        block_size: int,
        scale: float,
    ) -> torch.Tensor:
        """q: [Tq, Hq, D]; caches: [slots, Hkv, row]; block_table: int64, covering context_len keys."""
        block_table = block_table.contiguous()
        q, k_cache, v_cache = _heads_contiguous(q), _heads_contiguous(k_cache), _heads_contiguous(v_cache)
        if k_cache.stride(0) != v_cache.stride(0):
            k_cache, v_cache = k_cache.contiguous(), v_cache.contiguous()
        query_len, num_heads, head_dim = q.shape
        _check_cache(k_cache, v_cache, head_dim)
        out = q.new_empty(query_len, num_heads, head_dim)
        status = self.function(
            _ptr(q),
            q.stride(0),
            _ptr(k_cache),
            _ptr(v_cache),
            KV_DTYPE_CODES[k_cache.dtype],
            k_cache.stride(0) * k_cache.element_size(),
            _ptr(block_table),
            block_size,
            query_len,
            context_len,
            num_heads,
            k_cache.shape[1],
            head_dim,
            scale,
            _ptr(out),
            self.num_threads,
        )
        if status != 0:
            raise MemoryError("prefill attention kernel could not allocate its scratch")
        return out

    def causal(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """Whole-context chunk: q, k, v hold every position ([T, Hq, D], [T, Hkv, D], [T, Hkv, D])."""
        # Contiguous keys are a paged cache of one block holding all of them.
        single_block = torch.zeros(1, dtype=torch.long)
        return self(q, k, v, single_block, k.shape[0], max(1, k.shape[0]), scale)


@dataclass(frozen=True, slots=True)
class StoreKVKernel:
    """Writes a step's fp32 keys and values into the paged cache's rows, converted to its format (rounding as
    `kvyard.models.kv_format` does, so the bytes equal PyTorch's)."""

    PROTOTYPES: ClassVar[str] = """
        void kvyard_store_kv(const float *k, int64_t k_stride, const float *v, int64_t v_stride,
            const int64_t *slots, int64_t num_tokens, int num_kv_heads, int head_dim, void *k_cache, void *v_cache,
            int kv_dtype, int64_t slot_bytes, int num_threads);
    """

    function: Callable[..., Any]
    num_threads: int

    def __call__(
        self, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """caches: [slots, Hkv, row], contiguous; slots: [T] int64, each < num_slots; k, v: [T, Hkv, D] fp32."""
        k, v, slots = _heads_contiguous(k), _heads_contiguous(v), slots.contiguous()
        num_tokens, num_kv_heads, head_dim = k.shape
        _check_cache(k_cache, v_cache, head_dim)
        if v.shape != k.shape or slots.shape != (num_tokens,) or k_cache.shape[1] != num_kv_heads:
            raise ValueError(
                f"k {tuple(k.shape)}, v {tuple(v.shape)} and slots {tuple(slots.shape)} do not match "
                f"a cache of {tuple(k_cache.shape)}"
            )
        self.function(
            _ptr(k),
            k.stride(0),
            _ptr(v),
            v.stride(0),
            _ptr(slots),
            num_tokens,
            num_kv_heads,
            head_dim,
            _ptr(k_cache),
            _ptr(v_cache),
            KV_DTYPE_CODES[k_cache.dtype],
            k_cache.stride(0) * k_cache.element_size(),
            self.num_threads,
        )


@dataclass(frozen=True, slots=True)
class SmallLinearKernel:
    """`F.linear` for fp32 inputs of a few rows; weights [n, k] contiguous."""

    PROTOTYPES: ClassVar[str] = """
        void kvyard_small_linear(const float *x, const float *w, const float *bias, float *y, int64_t m, int64_t n,
            int64_t k, int num_threads);
    """

    function: Callable[..., Any]
    num_threads: int

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x = x.contiguous()
        out = x.new_empty(x.shape[0], weight.shape[0])
        self.function(
            _ptr(x),
            _ptr(weight),
            None if bias is None else _ptr(bias),
            _ptr(out),
            x.shape[0],
            weight.shape[0],
            weight.shape[1],
            self.num_threads,
        )
        return out


@dataclass(frozen=True, slots=True)
class SmallLinearInt8Kernel:
    """`F.linear` for fp32 inputs of a few rows against int8 weights [n, k] with a scale per 32 of a row's
    weights (scales [n, k / 32]); k a multiple of 32."""

    PROTOTYPES: ClassVar[str] = """
        void kvyard_small_linear_int8(const float *x, const int8_t *q, const float *scales, const float *bias,
            float *y, int64_t m, int64_t n, int64_t k, int num_threads);
    """

    function: Callable[..., Any]
    num_threads: int

    def __call__(
        self, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        x = x.contiguous()
        out = x.new_empty(x.shape[0], qweight.shape[0])
        self.function(
            _ptr(x),
            _ptr(qweight),
            _ptr(scales),
            None if bias is None else _ptr(bias),
            _ptr(out),
            x.shape[0],
            qweight.shape[0],
            qweight.shape[1],
            self.num_threads,
        )
        return out


@dataclass(frozen=True, slots=True)
class SmallLinearHalfKernel:
    """`F.linear` for fp32 inputs of a few rows against fp16 or bfloat16 weights [n, k] (fp32 accumulation)."""

    PROTOTYPES: ClassVar[str] = """
        void kvyard_small_linear_half(const float *x, const uint16_t *w, const float *bias, float *y, int64_t m,
            int64_t n, int64_t k, int is_bf16, int num_threads);
    """

    function: Callable[..., Any]
    num_threads: int

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if weight.dtype not in (torch.float16, torch.bfloat16):
            raise TypeError(f"half-precision weights must be float16 or bfloat16, got {weight.dtype}")
        x, weight = x.contiguous(), weight.contiguous()
        out = x.new_empty(x.shape[0], weight.shape[0])
        self.function(
            _ptr(x),
            _ptr(weight),
            None if bias is None else _ptr(bias),
            _ptr(out),
            x.shape[0],
            weight.shape[0],
            weight.shape[1],
            int(weight.dtype == torch.bfloat16),
            self.num_threads,
        )
        return out


@dataclass(frozen=True, slots=True)
class Int8ToBf16Kernel:
    """int8 weights [n, k] with a scale per 32 of a row's weights, widened to one bfloat16 tensor [n, k]:
    bit-identical to `dequantize_int8(q, scales).to(torch.bfloat16)`, in one pass over memory."""

    PROTOTYPES: ClassVar[str] = """
        void kvyard_int8_to_bf16(const int8_t *q, const float *scales, uint16_t *out, int64_t n, int64_t k,
            int num_threads);
    """

    function: Callable[..., Any]
    num_threads: int

    def __call__(self, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        rows, columns = qweight.shape
        if qweight.dtype != torch.int8 or columns % 32 or tuple(scales.shape) != (rows, columns // 32):
            raise ValueError(f"int8 weights [{rows}, {columns}] need float32 scales [{rows}, {columns // 32}]")
        qweight, scales = qweight.contiguous(), scales.float().contiguous()
        out = torch.empty(rows, columns, dtype=torch.bfloat16)
        self.function(_ptr(qweight), _ptr(scales), _ptr(out), rows, columns, self.num_threads)
        return out


@dataclass(frozen=True, slots=True)
class ElementwiseKernels:
    """Fused residual-add + RMSNorm, in-place rotary embedding, SiLU-and-multiply, row-wise argmax; fp32, and the
    first three with bf16 activations (a bf16-matmul prefill step: kvyard.models.bf16_prefill)."""

    PROTOTYPES: ClassVar[str] = """
        void kvyard_add_rms_norm(const float *x, float *residual, const float *weight, float *out, int64_t rows,
            int64_t dim, float eps);
        void kvyard_rotary(float *x, int64_t row_stride, int64_t num_tokens, int64_t num_heads, int64_t head_dim,
            const float *cos_table, const float *sin_table, const int64_t *positions);
        void kvyard_silu_mul(const float *gate_up, float *out, int64_t rows, int64_t dim);
        void kvyard_argmax_rows(const float *x, int64_t rows, int64_t cols, int64_t *out);
        void kvyard_add_rms_norm_bf16(const void *x, int x_is_bf16, float *residual, const float *weight,
            uint16_t *out, int64_t rows, int64_t dim, float eps);
        void kvyard_rotary_bf16(uint16_t *x, int64_t row_stride, int64_t num_tokens, int64_t num_heads,
            int64_t head_dim, const float *cos_table, const float *sin_table, const int64_t *positions);
        void kvyard_silu_mul_bf16(const uint16_t *gate_up, uint16_t *out, int64_t rows, int64_t dim);
    """

    add_rms_norm_function: Callable[..., Any]
    rotary_function: Callable[..., Any]
    silu_mul_function: Callable[..., Any]
    argmax_function: Callable[..., Any]
    add_rms_norm_bf16_function: Callable[..., Any]
    rotary_bf16_function: Callable[..., Any]
    silu_mul_bf16_function: Callable[..., Any]

    def add_rms_norm(
        self, x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """Adds x into `residual` in place (unless x is None) and returns the normalised residual."""
        out = torch.empty_like(residual)
        x = None if x is None else x.contiguous()  # bound to a name: the buffer must outlive the call
        rows, dim = residual.shape
        self.add_rms_norm_function(
            None if x is None else _ptr(x), _ptr(residual), _ptr(weight), _ptr(out), rows, dim, eps
        )
        return out

    def rotary(
        self, x: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor, positions: torch.Tensor
    ) -> None:
        """x: [T, H, D] with contiguous heads (rows may be strided), rotated in place."""
        num_tokens, num_heads, head_dim = x.shape
        self.rotary_function(
            _ptr(x), x.stride(0), num_tokens, num_heads, head_dim, _ptr(cos_table), _ptr(sin_table), _ptr(positions)
        )

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up: [rows, 2 * dim] as [gate | up]; returns silu(gate) * up, [rows, dim]."""
        gate_up = gate_up.contiguous()
        rows, dim = gate_up.shape[0], gate_up.shape[1] // 2
        out = gate_up.new_empty(rows, dim)
        self.silu_mul_function(_ptr(gate_up), _ptr(out), rows, dim)
        return out

    def add_rms_norm_bf16(
        self, x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """As add_rms_norm, for x in fp32 or bf16 (or None), returning the normalised rows in bf16; `residual` and
        `weight` are fp32."""
        rows, dim = residual.shape
        out = torch.empty(rows, dim, dtype=torch.bfloat16)
        x = None if x is None else x.contiguous()
        if x is not None and (x.shape != residual.shape or x.dtype not in (torch.float32, torch.bfloat16)):
            raise ValueError(f"x {tuple(x.shape)} {x.dtype} does not match the residual {tuple(residual.shape)}")
        x_bf16 = x is not None and x.dtype == torch.bfloat16
        self.add_rms_norm_bf16_function(
            None if x is None else _ptr(x), int(x_bf16), _ptr(residual), _ptr(weight), _ptr(out), rows, dim, eps
        )
        return out

    def rotary_bf16(
        self, x: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor, positions: torch.Tensor
    ) -> None:
        """As rotary, for bf16 x [T, H, D] (contiguous heads, rows may be strided), rotated in place."""
        if x.dtype != torch.bfloat16 or x.stride(2) != 1 or x.stride(1) != x.shape[2]:
            raise ValueError(f"rotary_bf16 takes bf16 [T, H, D] with contiguous heads, got {x.dtype} {x.stride()}")
        num_tokens, num_heads, head_dim = x.shape
        self.rotary_bf16_function(
            _ptr(x), x.stride(0), num_tokens, num_heads, head_dim, _ptr(cos_table), _ptr(sin_table), _ptr(positions)
        )

    def silu_mul_bf16(self, gate_up: torch.Tensor) -> torch.Tensor:
        """As silu_mul, for bf16 gate_up; bf16 [rows, dim] back."""
        gate_up = gate_up.contiguous()
        if gate_up.dtype != torch.bfloat16:
            raise ValueError(f"silu_mul_bf16 takes bf16, got {gate_up.dtype}")
        rows, dim = gate_up.shape[0], gate_up.shape[1] // 2
        out = gate_up.new_empty(rows, dim)
        self.silu_mul_bf16_function(_ptr(gate_up), _ptr(out), rows, dim)
        return out

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """Row-wise argmax of a 2-D fp32 tensor (first index of the maximum; rows must hold no NaN)."""
        x = x.contiguous()
        out = torch.empty(x.shape[0], dtype=torch.long)
        self.argmax_function(_ptr(x), x.shape[0], x.shape[1], _ptr(out))
        return out


@dataclass(frozen=True, slots=True)
class DecodeLayerWeights:
    """One linear layer's weights as `kvyard_decode_layer` takes them: a kind (WEIGHT_KINDS), the weight [n, k]
    in that format, its int8 group scales, its bias."""

    kind: int
    weight: torch.Tensor
    scales: torch.Tensor | None = None
    bias: torch.Tensor | None = None


WEIGHT_KINDS = {torch.float32: 0, torch.int8: 1, torch.float16: 2, torch.bfloat16: 3}


@dataclass(frozen=True, slots=True)
class DecodeLayerKernel:
    """A whole decoder layer of a step of few rows (decodes, then short chunks such as a speculative verification)
    in one native call: the kernels the layer's modules call one by one, called from C in the same order on the
    same data, so the output is bit-identical and the step is spared a dozen Python-level calls a layer.

    `layer_args` turns a layer's shapes and weights into the call's fixed arguments once (pointers: the caller
    keeps the tensors alive and in place); `__call__` runs it for one step."""

    PROTOTYPES: ClassVar[str] = """
        int64_t kvyard_decode_layer_scratch_floats(int64_t m, int hidden_size, int num_heads, int num_kv_heads,
            int head_dim, int intermediate_size, int64_t max_context, int num_threads);
        int kvyard_decode_layer(const float *x, float *residual, float *out, int64_t m, const int64_t *positions,
            void *k_cache, void *v_cache, int kv_dtype, int64_t slot_bytes, const int64_t *slots, int num_decodes,
            const int64_t *block_tables, const int64_t *context_lens, int block_size, int max_blocks,
            int64_t max_context, int num_chunks, const int64_t *chunks, const int64_t *chunk_tables, float *scratch,
            int hidden_size, int intermediate_size, int num_heads, int num_kv_heads, int head_dim, float eps,
            const float *input_norm, const float *post_norm,
            const float *q_norm, const float *k_norm, int qkv_kind, const void *qkv_w, const float *qkv_scales,
            const float *qkv_bias, int o_kind, const void *o_w, const float *o_scales, int gate_up_kind,
            const void *gate_up_w, const float *gate_up_scales, int down_kind, const void *down_w,
            const float *down_scales, const float *cos_table, const float *sin_table, float scale, int num_threads);
    """

    scratch_floats_function: Callable[..., Any]
    function: Callable[..., Any]
    num_threads: int

    def layer_args(
        self,
        shape: tuple[int, int, int, int, int],
        eps: float,
        norms: tuple[torch.Tensor, ...],
        qk_norms: tuple[torch.Tensor, torch.Tensor] | None,
        linears: tuple[DecodeLayerWeights, ...],
        rotary_tables: tuple[torch.Tensor, torch.Tensor],
        scale: float,
    ) -> tuple[Any, ...]:
        """shape: (hidden_size, intermediate_size, num_heads, num_kv_heads, head_dim); norms: the input and
        post-attention norm weights; qk_norms: Qwen3's per-head query and key norm weights; linears: qkv, o,
        gate_up, down (only qkv may have a bias); rotary_tables: cos, sin [max_positions, head_dim / 2]."""
        hidden, inter, num_heads, num_kv_heads, head_dim = shape
        qkv_size = (num_heads + 2 * num_kv_heads) * head_dim
        expected = ((qkv_size, hidden), (hidden, num_heads * head_dim), (2 * inter, hidden), (hidden, inter))
        for linear, (rows, columns) in zip(linears, expected, strict=True):
            _check_linear(linear, rows, columns)
        if any(linear.bias is not None for linear in linears[1:]):
            raise ValueError("only the qkv projection may have a bias in a fused decode layer")
        tables = [*norms, *(qk_norms or ()), *rotary_tables]
        if any(t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu" for t in tables):
            raise TypeError("norm weights and rotary tables must be contiguous float32 CPU tensors")
        qkv, o, gate_up, down = linears
        q_norm, k_norm = (_ptr(qk_norms[0]), _ptr(qk_norms[1])) if qk_norms is not None else (None, None)
        return (
            hidden,
            inter,
            num_heads,
            num_kv_heads,
            head_dim,
            eps,
            _ptr(norms[0]),
            _ptr(norms[1]),
            q_norm,
            k_norm,
            *_weight_args(qkv),
            _optional_ptr(qkv.bias),
            *_weight_args(o),
            *_weight_args(gate_up),
            *_weight_args(down),
            _ptr(rotary_tables[0]),
            _ptr(rotary_tables[1]),
            scale,
            self.num_threads,
        )

    def scratch(self, rows: int, shape: tuple[int, int, int, int, int], max_context: int) -> torch.Tensor:
        """The scratch buffer one step's layers share."""
        hidden, inter, num_heads, num_kv_heads, head_dim = shape
        floats = self.scratch_floats_function(
            rows, hidden, num_heads, num_kv_heads, head_dim, inter, max_context, self.num_threads
        )
        return torch.empty(floats)

    def __call__(
        self,
        x: torch.Tensor | None,
        residual: torch.Tensor,
        out: torch.Tensor,
        step: DecodeStepArgs,
        kv_cache: torch.Tensor,
        layer_args: tuple[Any, ...],
    ) -> None:
        """residual += x (x None: the first layer); out = the layer's MLP output ([m, hidden]; may be x).
        kv_cache: [2, num_slots, Hkv, row], checked by `DecodeStepArgs.check_cache`."""
        k_cache = kv_cache.data_ptr()
        v_cache = k_cache + kv_cache.stride(0) * kv_cache.element_size()
        status = self.function(
            None if x is None else _ptr(x),
            _ptr(residual),
            _ptr(out),
            step.rows,
            step.positions,
            k_cache,
            v_cache,
            *step.rest,
            *layer_args,
        )
        if status != 0:
            raise MemoryError("prefill attention kernel could not allocate its scratch")


@dataclass(frozen=True, slots=True)
class DecodeStepArgs:
    """What every layer of one decode step passes to `kvyard_decode_layer`, checked once: the step's positions,
    cache slots, block tables and context lengths, and the scratch buffer. Holds the tensors so the pointers stay
    valid while the step runs."""

    rows: int
    positions: int
    rest: tuple[Any, ...]
    tensors: tuple[torch.Tensor, ...]

    @classmethod
    def of(
        cls,
        positions: torch.Tensor,
        slots: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        chunks: torch.Tensor,
        chunk_tables: torch.Tensor,
        block_size: int,
        kv_cache: torch.Tensor,
        scratch: torch.Tensor,
    ) -> DecodeStepArgs:
        """block_tables, context_lens: the decodes' ([num_decodes, max_blocks], [num_decodes]); chunks: [num_chunks,
        4] (first row, rows, context length, offset of its table in chunk_tables or -1), rows after the decodes."""
        rows, num_decodes, num_chunks = positions.shape[0], context_lens.shape[0], chunks.shape[0]
        max_blocks = block_tables.shape[-1]
        for name, tensor, shape in (
            ("positions", positions, (rows,)),
            ("slots", slots, (rows,)),
            ("context_lens", context_lens, (num_decodes,)),
            ("block_tables", block_tables, (num_decodes, max_blocks)),
            ("chunks", chunks, (num_chunks, 4)),
            ("chunk_tables", chunk_tables, (chunk_tables.shape[0],)),
        ):
            if tensor.dtype != torch.int64 or not tensor.is_contiguous() or tuple(tensor.shape) != shape:
                raise ValueError(
                    f"{name} must be a contiguous int64 tensor of shape {shape}, got "
                    f"{tensor.dtype} {tuple(tensor.shape)}"
                )
        _check_chunks(chunks.tolist(), num_decodes, rows, chunk_tables.shape[0], block_size)
        rest = (
            KV_DTYPE_CODES[kv_cache.dtype],
            kv_cache.stride(1) * kv_cache.element_size(),
            _ptr(slots),
            num_decodes,
            _ptr(block_tables),
            _ptr(context_lens),
            block_size,
            max_blocks,
            max_blocks * block_size,
            num_chunks,
            _ptr(chunks),
            _ptr(chunk_tables),
            _ptr(scratch),
        )
        tensors = (positions, slots, block_tables, context_lens, chunks, chunk_tables, scratch)
        return cls(rows, _ptr(positions), rest, tensors)

    @staticmethod
    def check_cache(kv_cache: torch.Tensor, head_dim: int) -> None:
        """A layer's cache [2, num_slots, Hkv, row] as the kernel walks it: K and V halves alike, contiguous."""
        if kv_cache.dim() != 4 or kv_cache.shape[0] != 2 or not kv_cache.is_contiguous():
            raise ValueError(
                f"a fused decode layer needs a contiguous [2, slots, heads, row] cache, got {tuple(kv_cache.shape)}"
            )
        _check_cache(kv_cache[0], kv_cache[1], head_dim)


def _check_chunks(
    chunks: list[list[int]], num_decodes: int, rows: int, num_table_entries: int, block_size: int
) -> None:
    """The chunks tile the rows after the decodes, in order, and each table covers its context."""
    next_row = num_decodes
    for start, length, context, table in chunks:
        blocks = -(-context // block_size)
        covered = table + blocks <= num_table_entries if table >= 0 else context == length
        if start != next_row or length < 1 or context < length or not covered:
            raise ValueError(
                f"chunk (first row {start}, {length} rows, context {context}, table at {table}) does not "
                f"follow row {next_row} or its table of {num_table_entries} entries"
            )
        next_row += length
    if next_row != rows:
        raise ValueError(f"the decodes and chunks cover {next_row} rows of {rows}")


def _check_linear(linear: DecodeLayerWeights, rows: int, columns: int) -> None:
    weight = linear.weight
    if WEIGHT_KINDS.get(weight.dtype) != linear.kind or tuple(weight.shape) != (rows, columns):
        raise ValueError(
            f"a weight of kind {linear.kind} and shape {(rows, columns)} was expected, got "
            f"{weight.dtype} {tuple(weight.shape)}"
        )
    if not weight.is_contiguous() or weight.device.type != "cpu":
        raise ValueError("fused decode weights must be contiguous CPU tensors")
    if linear.kind == WEIGHT_KINDS[torch.int8]:
        scales = linear.scales
        if scales is None or scales.dtype != torch.float32 or tuple(scales.shape) != (rows, columns // 32):
            raise ValueError(f"int8 weights [{rows}, {columns}] need float32 scales [{rows}, {columns // 32}]")
    bias = linear.bias
    if bias is not None and (bias.dtype != torch.float32 or tuple(bias.shape) != (rows,) or not bias.is_contiguous()):
        raise ValueError(f"a bias must be a contiguous float32 tensor [{rows}]")


def _weight_args(linear: DecodeLayerWeights) -> tuple[int, int, int | None]:
    return linear.kind, _ptr(linear.weight), _optional_ptr(linear.scales)


def _optional_ptr(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


@dataclass(frozen=True, slots=True)
class NativeKernels:
    paged_decode: PagedDecodeKernel
    paged_prefill: PagedPrefillKernel
    small_linear: SmallLinearKernel
    elementwise: ElementwiseKernels
    small_linear_int8: SmallLinearInt8Kernel
    small_linear_half: SmallLinearHalfKernel
    int8_to_bf16: Int8ToBf16Kernel
    store_kv: StoreKVKernel
    decode_layer: DecodeLayerKernel


def load_native_kernels() -> NativeKernels:
    """Compile (once per machine) and load the kernels.

    KernelsUnavailable when this machine cannot build or load them (callers may fall back to PyTorch);
    KernelBindingError when the library, its header and the bindings disagree (a bug: never swallow it)."""
    path = compiled_library()
    try:
        library = ctypes.CDLL(str(path))
    except OSError as error:
        raise KernelsUnavailable(f"the compiled kernels at {path} would not load: {error}") from error
    return bind_kernels(library, engine_threads() or torch.get_num_threads())


def bind_kernels(library: ctypes.CDLL, threads: int, header_text: str | None = None) -> NativeKernels:
    """Wrap a built kernel library's functions, after checking the wrappers' prototypes against the header.

    `header_text` defaults to the header the library was built from; tests pass an altered one."""
    wrappers = (
        PagedDecodeKernel,
        PagedPrefillKernel,
        SmallLinearKernel,
        ElementwiseKernels,
        SmallLinearInt8Kernel,
        SmallLinearHalfKernel,
        Int8ToBf16Kernel,
        StoreKVKernel,
        DecodeLayerKernel,
    )
    header = HEADER.read_text() if header_text is None else header_text
    functions = bind_functions(library, header, "".join(wrapper.PROTOTYPES for wrapper in wrappers))
    return NativeKernels(
        PagedDecodeKernel(functions["kvyard_paged_decode_attention"], threads),
        PagedPrefillKernel(functions["kvyard_paged_prefill_attention"], threads),
        SmallLinearKernel(functions["kvyard_small_linear"], threads),
        ElementwiseKernels(
            functions["kvyard_add_rms_norm"],
            functions["kvyard_rotary"],
            functions["kvyard_silu_mul"],
            functions["kvyard_argmax_rows"],
            functions["kvyard_add_rms_norm_bf16"],
            functions["kvyard_rotary_bf16"],
            functions["kvyard_silu_mul_bf16"],
        ),
        SmallLinearInt8Kernel(functions["kvyard_small_linear_int8"], threads),
        SmallLinearHalfKernel(functions["kvyard_small_linear_half"], threads),
        Int8ToBf16Kernel(functions["kvyard_int8_to_bf16"], threads),
        StoreKVKernel(functions["kvyard_store_kv"], threads),
        DecodeLayerKernel(functions["kvyard_decode_layer_scratch_floats"], functions["kvyard_decode_layer"], threads),
    )


def _heads_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    """[rows, heads, dim] with any row stride, but each row's heads packed back to back."""
    if tensor.stride(2) == 1 and tensor.stride(1) == tensor.shape[2]:
        return tensor
    return tensor.contiguous()


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, head_dim: int) -> None:
    """The kernels walk the caches by raw pointer: a format, row width or layout they do not expect must stop here,
    not read or write past a buffer."""
    if k_cache.dtype not in KV_DTYPE_CODES or v_cache.dtype != k_cache.dtype or k_cache.device.type != "cpu":
        raise TypeError(
            f"a KV cache of {k_cache.dtype}/{v_cache.dtype} on {k_cache.device} is not one the kernels read"
        )
    row_width = head_dim + INT8_ROW_SCALE_BYTES if k_cache.dtype == torch.uint8 else head_dim
    for cache in (k_cache, v_cache):
        if cache.dim() != 3 or cache.shape[2] != row_width or cache.stride(2) != 1 or cache.stride(1) != row_width:
            raise ValueError(
                f"KV cache {tuple(cache.shape)} (strides {cache.stride()}) does not hold rows of "
                f"{row_width} for head_dim {head_dim}"
            )


def _ptr(tensor: torch.Tensor) -> int:
    return tensor.data_ptr()
