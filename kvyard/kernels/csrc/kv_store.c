/*
 * Writes a step's keys and values into the paged KV cache, each row converted to the cache's format
 * (kv_rows.h): the one place the native path stores KV.
 *
 * Layout: k, v [num_tokens, num_kv_heads, head_dim] fp32, k_stride and v_stride floats between tokens (each
 * token's heads contiguous); slots [num_tokens], the slot each token's row goes to; k_cache, v_cache
 * [num_slots, num_kv_heads, row], slot_bytes between slots.
 */
#include <stdint.h>
#include "kv_rows.h"
#include "kvyard_kernels.h"

void kvyard_store_kv(const float *k, int64_t k_stride, const float *v, int64_t v_stride, const int64_t *slots,
                     int64_t num_tokens, int num_kv_heads, int head_dim, void *k_cache, void *v_cache, int kv_dtype,
                     int64_t slot_bytes, int num_threads) {
    const int64_t row_bytes = kv_row_bytes(kv_dtype, head_dim);
    uint8_t *k_rows = k_cache, *v_rows = v_cache;
    /* A decode step's few rows are done before a thread pool would wake. */
    const int parallel = num_tokens * num_kv_heads * head_dim >= (1 << 16);
#pragma omp parallel for schedule(static) num_threads(num_threads) if (parallel)
    for (int64_t t = 0; t < num_tokens; t++) {
        for (int h = 0; h < num_kv_heads; h++) {
            const int64_t offset = slots[t] * slot_bytes + h * row_bytes;
            kv_store_row(k + t * k_stride + (int64_t)h * head_dim, kv_dtype, head_dim, k_rows + offset);
            kv_store_row(v + t * v_stride + (int64_t)h * head_dim, kv_dtype, head_dim, v_rows + offset);
        }
    }
}
