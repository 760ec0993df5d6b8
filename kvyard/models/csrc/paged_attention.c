/*
 * Decode attention straight from the paged KV cache, for CPU, fp32.
 *
 * One query token per sequence. Keys and values are read in place through the block table,
 * so nothing is gathered into a temporary. Work is split over (sequence, KV head) pairs; the
 * query heads of one KV group share each key and value row as it is loaded.
 *
 * Layout: q, out [num_seqs, num_heads, head_dim]; k_cache, v_cache [num_slots, num_kv_heads,
 * head_dim] with slot = block * block_size + offset; block_tables [num_seqs, max_blocks].
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

static void attend_one(const float *q, const float *k_cache, const float *v_cache, const int64_t *table,
                       int64_t context_len, float *out, int kv_head, int num_kv_heads, int group,
                       int head_dim, int block_size, float scale, float *scores) {
    const int64_t row_stride = (int64_t)num_kv_heads * head_dim;
    for (int g = 0; g < group; g++) {
        float *s = scores + (int64_t)g * context_len;
        const float *qg = q + (int64_t)g * head_dim;
        float max_score = -INFINITY;
        for (int64_t t = 0; t < context_len; t++) {
            const int64_t slot = table[t / block_size] * block_size + t % block_size;
            const float *k = k_cache + slot * row_stride + (int64_t)kv_head * head_dim;
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int d = 0; d < head_dim; d++) dot += qg[d] * k[d];
            s[t] = dot * scale;
            if (s[t] > max_score) max_score = s[t];
        }
        float total = 0.0f;
        for (int64_t t = 0; t < context_len; t++) {
            s[t] = expf(s[t] - max_score);
            total += s[t];
        }
        const float inv_total = 1.0f / total;
        float *o = out + (int64_t)g * head_dim;
        memset(o, 0, sizeof(float) * head_dim);
        for (int64_t t = 0; t < context_len; t++) {
            const int64_t slot = table[t / block_size] * block_size + t % block_size;
            const float *v = v_cache + slot * row_stride + (int64_t)kv_head * head_dim;
            const float p = s[t] * inv_total;
#pragma omp simd
            for (int d = 0; d < head_dim; d++) o[d] += p * v[d];
        }
    }
}

/* `workspace` holds num_threads * (num_heads / num_kv_heads) * max(context_lens) floats. */
void kvyard_paged_decode_attention(const float *q, const float *k_cache, const float *v_cache,
                                   const int64_t *block_tables, const int64_t *context_lens, float *out,
                                   float *workspace, int num_seqs, int num_heads, int num_kv_heads,
                                   int head_dim, int block_size, int max_blocks, int64_t max_context,
                                   float scale, int num_threads) {
    const int group = num_heads / num_kv_heads;
    int64_t total_keys = 0;
    for (int b = 0; b < num_seqs; b++) total_keys += context_lens[b];
    /* Waking a thread pool costs more than a few thousand dot products. */
    const int parallel = total_keys * num_kv_heads >= 16384;
#pragma omp parallel for collapse(2) schedule(dynamic, 4) num_threads(num_threads) if (parallel)
    for (int b = 0; b < num_seqs; b++) {
        for (int h = 0; h < num_kv_heads; h++) {
            float *scores = workspace + (int64_t)omp_get_thread_num() * group * max_context;
            const int64_t offset = ((int64_t)b * num_heads + (int64_t)h * group) * head_dim;
            attend_one(q + offset, k_cache, v_cache, block_tables + (int64_t)b * max_blocks, context_lens[b],
                       out + offset, h, num_kv_heads, group, head_dim, block_size, scale, scores);
        }
    }
}
