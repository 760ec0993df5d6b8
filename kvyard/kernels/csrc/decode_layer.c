/*
 * One decoder layer of a step of few rows in one call: the same kernels, in the same order, as the layer's
 * Python modules call one by one (kvyard/models/decoder.py), so the result is bit-identical to theirs.
 *
 * A step of a few rows (decode of a small batch, a speculative verification, a short chunk) is short, a few
 * hundred microseconds a layer on the bench model, and most of it went to calling a dozen kernels from Python:
 * argument checks, output allocations, views. Here the layer runs from C, its intermediates in one scratch
 * buffer the caller allocates once per step.
 *
 * The step's rows are laid out as the engine lays them out: num_decodes sequences with one query token first
 * (decode attention, through block_tables and context_lens), then num_chunks chunks, each described by four
 * int64 in `chunks`: first row, rows, context length, and the offset of its block table in chunk_tables, or -1
 * when the chunk is its whole context and its keys come straight from this step's projections.
 *
 *   residual += x (x NULL: the first layer, residual holds the embeddings)
 *   qkv = input_norm(residual) W_qkv^T (+ bias)
 *   q, k = q_norm(q), k_norm(k) per head (Qwen3; skipped when the norms are NULL); rotary(q, k)
 *   store k, v into the paged cache; attn = decode attention of the decodes, causal attention of each chunk
 *   residual += attn W_o^T;  out = (silu(gate) * up of post_norm(residual) W_gate_up^T) W_down^T
 *
 * Weights are [n, k] row-major in the format named by their kind: 0 fp32, 1 int8 with a scale per 32 weights
 * (scales [n, k / 32]), 2 fp16, 3 bf16. `out` may be `x`: x is read only before out is written.
 * Scratch floats: see kvyard_decode_layer_scratch_floats. Returns 0, or -1 when a chunk's attention could not
 * allocate its scratch (out is then incomplete).
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include "kvyard_kernels.h"

enum { KIND_FP32 = 0, KIND_INT8 = 1, KIND_FP16 = 2, KIND_BF16 = 3 };

static void linear(int kind, const float *x, const void *w, const float *scales, const float *bias, float *y,
                   int64_t m, int64_t n, int64_t k, int num_threads) {
    if (kind == KIND_INT8) {
        kvyard_small_linear_int8(x, (const int8_t *)w, scales, bias, y, m, n, k, num_threads);
    } else if (kind == KIND_FP16 || kind == KIND_BF16) {
        kvyard_small_linear_half(x, (const uint16_t *)w, bias, y, m, n, k, kind == KIND_BF16, num_threads);
    } else {
        kvyard_small_linear(x, (const float *)w, bias, y, m, n, k, num_threads);
    }
}

/* Each head of `rows` rows (row r at src + r * src_stride, heads back to back) normalised into dst [rows, heads,
 * head_dim], as RMSNorm does over a contiguous copy of them. */
static void norm_heads(const float *src, int64_t src_stride, float *dst, int64_t rows, int64_t heads,
                       int64_t head_dim, const float *weight, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        float *row = dst + r * heads * head_dim;
        memcpy(row, src + r * src_stride, (size_t)(heads * head_dim) * sizeof(float));
        kvyard_add_rms_norm(NULL, row, weight, row, heads, head_dim, eps);
    }
}

int64_t kvyard_decode_layer_scratch_floats(int64_t m, int hidden_size, int num_heads, int num_kv_heads, int head_dim,
                                           int intermediate_size, int64_t max_context, int num_threads) {
    const int64_t q_size = (int64_t)num_heads * head_dim, kv_size = (int64_t)num_kv_heads * head_dim;
    return m * (2 * (int64_t)hidden_size + (q_size + 2 * kv_size) + 2 * q_size + 2 * kv_size
                + 3 * (int64_t)intermediate_size)
           + (int64_t)num_threads * num_heads * (max_context > 0 ? max_context : 1);
}

int kvyard_decode_layer(const float *x, float *residual, float *out, int64_t m, const int64_t *positions,
                        void *k_cache, void *v_cache, int kv_dtype, int64_t slot_bytes, const int64_t *slots,
                        int num_decodes, const int64_t *block_tables, const int64_t *context_lens, int block_size,
                        int max_blocks, int64_t max_context, int num_chunks, const int64_t *chunks,
                        const int64_t *chunk_tables, float *scratch, int hidden_size, int intermediate_size, int num_heads,
                         int num_kv_heads, int head_dim, float eps, const float *input_norm, const float *post_norm,
                         const float *q_norm, const float *k_norm, int qkv_kind, const void *qkv_w,
                         const float *qkv_scales, const float *qkv_bias, int o_kind, const void *o_w,
                         const float *o_scales, int gate_up_kind, const void *gate_up_w, const float *gate_up_scales,
                         int down_kind, const void *down_w, const float *down_scales, const float *cos_table,
                         const float *sin_table, float scale, int num_threads) {
    const int64_t hidden = hidden_size, inter = intermediate_size;
    const int64_t q_size = (int64_t)num_heads * head_dim, kv_size = (int64_t)num_kv_heads * head_dim;
    const int64_t qkv_size = q_size + 2 * kv_size;
    float *normed = scratch;               /* [m, hidden] */
    float *qkv = normed + m * hidden;      /* [m, q + 2 kv] */
    float *q_rows = qkv + m * qkv_size;    /* [m, q]: normalised or contiguous queries */
    float *k_rows = q_rows + m * q_size;   /* [m, kv]: normalised keys */
    float *v_rows = k_rows + m * kv_size;  /* [m, kv]: values packed like those keys, for a whole-context chunk */
    float *attn = v_rows + m * kv_size;    /* [m, q] */
    float *o = attn + m * q_size;          /* [m, hidden] */
    float *gate_up = o + m * hidden;       /* [m, 2 inter] */
    float *act = gate_up + 2 * m * inter;  /* [m, inter] */
    float *workspace = act + m * inter;    /* num_threads * num_heads * max_context */

    kvyard_add_rms_norm(x, residual, input_norm, normed, m, hidden, eps);
    linear(qkv_kind, normed, qkv_w, qkv_scales, qkv_bias, qkv, m, qkv_size, hidden, num_threads);
    const float *q = qkv, *k = qkv + q_size, *v = qkv + q_size + kv_size;
    int64_t q_stride = qkv_size, k_stride = qkv_size;
    if (q_norm != NULL && k_norm != NULL) {
        norm_heads(q, qkv_size, q_rows, m, num_heads, head_dim, q_norm, eps);
        norm_heads(k, qkv_size, k_rows, m, num_kv_heads, head_dim, k_norm, eps);
        q = q_rows, k = k_rows, q_stride = q_size, k_stride = kv_size;
    }
    kvyard_rotary((float *)q, q_stride, m, num_heads, head_dim, cos_table, sin_table, positions);
    kvyard_rotary((float *)k, k_stride, m, num_kv_heads, head_dim, cos_table, sin_table, positions);
    kvyard_store_kv(k, k_stride, v, qkv_size, slots, m, num_kv_heads, head_dim, k_cache, v_cache, kv_dtype,
                    slot_bytes, num_threads);
    if (num_decodes > 0) {
        const float *decode_q = q;
        if (q_stride != q_size) { /* the decode kernel reads queries packed back to back */
            for (int64_t r = 0; r < num_decodes; r++)
                memcpy(q_rows + r * q_size, q + r * q_stride, (size_t)q_size * sizeof(float));
            decode_q = q_rows;
        }
        kvyard_paged_decode_attention(decode_q, k_cache, v_cache, kv_dtype, block_tables, context_lens, attn,
                                      workspace, num_decodes, num_heads, num_kv_heads, head_dim, block_size,
                                      max_blocks, max_context, scale, num_threads);
    }
    for (int c = 0; c < num_chunks; c++) {
        const int64_t start = chunks[4 * c], rows = chunks[4 * c + 1], context = chunks[4 * c + 2];
        const int64_t table = chunks[4 * c + 3];
        int status;
        if (table >= 0) {
            status = kvyard_paged_prefill_attention(q + start * q_stride, q_stride, k_cache, v_cache, kv_dtype,
                                                    slot_bytes, chunk_tables + table, block_size, rows, context,
                                                    num_heads, num_kv_heads, head_dim, scale, attn + start * q_size,
                                                    num_threads);
        } else { /* keys and values of this step, as one block of `rows` fp32 slots (one stride for both) */
            const float *chunk_k = k + start * k_stride, *chunk_v = v + start * qkv_size;
            int64_t kv_stride = qkv_size;
            if (k_stride != qkv_size) {
                for (int64_t r = 0; r < rows; r++)
                    memcpy(v_rows + (start + r) * kv_size, chunk_v + r * qkv_size, (size_t)kv_size * sizeof(float));
                chunk_v = v_rows + start * kv_size, kv_stride = kv_size;
            }
            const int64_t single_block = 0;
            status = kvyard_paged_prefill_attention(q + start * q_stride, q_stride, chunk_k, chunk_v, 0,
                                                    kv_stride * (int64_t)sizeof(float), &single_block,
                                                    rows > 0 ? (int)rows : 1, rows, rows, num_heads, num_kv_heads,
                                                    head_dim, scale, attn + start * q_size, num_threads);
        }
        if (status != 0) return -1;
    }
    linear(o_kind, attn, o_w, o_scales, NULL, o, m, hidden, q_size, num_threads);
    kvyard_add_rms_norm(o, residual, post_norm, normed, m, hidden, eps);
    linear(gate_up_kind, normed, gate_up_w, gate_up_scales, NULL, gate_up, m, 2 * inter, hidden, num_threads);
    kvyard_silu_mul(gate_up, act, m, inter);
    linear(down_kind, act, down_w, down_scales, NULL, out, m, hidden, inter, num_threads);
    return 0;
}
