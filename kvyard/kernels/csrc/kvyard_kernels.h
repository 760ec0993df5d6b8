/*
 * Every function the kvyard CPU kernel library exports, with its exact C signature.
 *
 * Each source includes this header, so the compiler rejects a definition that differs from its
 * declaration here (and, with -Werror=missing-prototypes, an exported function missing from it).
 * The Python bindings parse this file when they load the library and check their own expectations
 * against it (kvyard/kernels/header.py), so declarations keep to what that parser reads: one
 * prototype per statement, return and parameter types void, int, float, int64_t, int8_t or uint16_t, optionally
 * const-qualified pointers to them, every parameter named. No macros, arrays or attributes here.
 *
 * Activations are fp32 (indices int64, quantized weights int8 or 16-bit), row-major; the KV cache is in one of
 * the row formats of kv_rows.h, named by kv_dtype (0 fp32, 1 fp16, 2 bf16, 3 int8 with a scale per row).
 * See each source for layouts.
 */
#ifndef KVYARD_KERNELS_H
#define KVYARD_KERNELS_H

#include <stdint.h>

/* paged_attention.c: one query token per sequence against its keys in the paged cache. `workspace`
 * holds num_threads * num_heads * max_context floats. */
void kvyard_paged_decode_attention(const float *q, const void *k_cache, const void *v_cache, int kv_dtype,
                                   const int64_t *block_tables, const int64_t *context_lens, float *out,
                                   float *workspace, int num_seqs, int num_heads, int num_kv_heads, int head_dim,
                                   int block_size, int max_blocks, int64_t max_context, float scale,
                                   int num_threads);

/* prefill_attention.c: causal attention of a prefill chunk, keys read in place. Returns 0 on success,
 * -1 if a thread could not allocate its scratch (out is then incomplete). */
int kvyard_paged_prefill_attention(const float *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                                   int kv_dtype, int64_t kv_stride_bytes, const int64_t *block_table, int block_size, int64_t query_len,
                                   int64_t context_len, int num_heads, int num_kv_heads, int head_dim, float scale,
                                   float *out, int num_threads);

/* kv_store.c: a step's keys and values written into the paged cache in its row format. */
void kvyard_store_kv(const float *k, int64_t k_stride, const float *v, int64_t v_stride, const int64_t *slots,
                     int64_t num_tokens, int num_kv_heads, int head_dim, void *k_cache, void *v_cache, int kv_dtype,
                     int64_t slot_bytes, int num_threads);

/* small_linear.c: y = x w^T (+ bias) for a few rows of x; bias may be NULL. */
void kvyard_small_linear(const float *x, const float *w, const float *bias, float *y, int64_t m, int64_t n,
                         int64_t k, int num_threads);

/* small_linear_int8.c: the same with w as int8 q [n, k] and one fp32 scale per 32 weights of a row,
 * scales [n, k / 32]; k a multiple of 32. x is rounded to int16 per group of 32 (step: the group's max / 32767). */
void kvyard_small_linear_int8(const float *x, const int8_t *q, const float *scales, const float *bias, float *y,
                              int64_t m, int64_t n, int64_t k, int num_threads);

/* small_linear_half.c: the same with w [n, k] in 16 bits, fp16 (is_bf16 = 0) or bfloat16 (is_bf16 = 1). */
void kvyard_small_linear_half(const float *x, const uint16_t *w, const float *bias, float *y, int64_t m, int64_t n,
                              int64_t k, int is_bf16, int num_threads);

/* int8_to_bf16.c: int8 weights q [n, k] with their scales (as small_linear_int8.c) widened to bfloat16, out [n, k],
 * rounded to nearest even. */
void kvyard_int8_to_bf16(const int8_t *q, const float *scales, uint16_t *out, int64_t n, int64_t k,
                         int num_threads);

/* elementwise.c: the per-layer fused elementwise work and the greedy sampler's argmax. */
void kvyard_add_rms_norm(const float *x, float *residual, const float *weight, float *out, int64_t rows,
                         int64_t dim, float eps);
void kvyard_rotary(float *x, int64_t row_stride, int64_t num_tokens, int64_t num_heads, int64_t head_dim,
                   const float *cos_table, const float *sin_table, const int64_t *positions);
void kvyard_silu_mul(const float *gate_up, float *out, int64_t rows, int64_t dim);
void kvyard_argmax_rows(const float *x, int64_t rows, int64_t cols, int64_t *out);
void kvyard_add_rms_norm_bf16(const void *x, int x_is_bf16, float *residual, const float *weight, uint16_t *out,
                              int64_t rows, int64_t dim, float eps);
void kvyard_rotary_bf16(uint16_t *x, int64_t row_stride, int64_t num_tokens, int64_t num_heads, int64_t head_dim,
                        const float *cos_table, const float *sin_table, const int64_t *positions);
void kvyard_silu_mul_bf16(const uint16_t *gate_up, uint16_t *out, int64_t rows, int64_t dim);

/* decode_layer.c: one decoder layer of a step of m rows (decodes first, then short chunks) in one call,
 * computing exactly what the layer's kernels compute called one by one; weight kinds 0 fp32, 1 int8, 2 fp16,
 * 3 bf16. `scratch` holds kvyard_decode_layer_scratch_floats(...) floats. Returns 0, or -1 if a chunk's
 * attention could not allocate its scratch. */
int64_t kvyard_decode_layer_scratch_floats(int64_t m, int hidden_size, int num_heads, int num_kv_heads, int head_dim,
                                           int intermediate_size, int64_t max_context, int num_threads);
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
                         const float *sin_table, float scale, int num_threads);

#endif
