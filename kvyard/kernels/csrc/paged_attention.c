/*
 * Decode attention straight from the paged KV cache, for CPU: fp32 queries and arithmetic, the cache in any
 * format of kv_rows.h (each row widened to fp32 as it is read).
 *
 * One query token per sequence. Keys and values are read in place through the block table,
 * so nothing is gathered into a temporary. Work is split over (sequence, KV head) pairs; the
 * query heads of one KV group share each key and value row as it is loaded.
 *
 * Layout: q, out [num_seqs, num_heads, head_dim]; k_cache, v_cache [num_slots, num_kv_heads,
 * row] with slot = block * block_size + offset and a row as kv_rows.h lays it out for kv_dtype; block_tables
 * [num_seqs, max_blocks].
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stddef.h>
#include <string.h>
#include "kv_rows.h"
#include "kvyard_kernels.h"
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#include "vec_math.h"
#endif
#define LOG2E 1.4426950408889634f

static inline void score_row(const float *q, const float *k, int group, int head_dim, float scale, float *scores,
                             int64_t scores_stride) {
    for (int g = 0; g < group; g++) {
        const float *qg = q + (int64_t)g * head_dim;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int d = 0; d < head_dim; d++) dot += qg[d] * k[d];
        scores[g * scores_stride] = dot * scale;
    }
}

static inline void accumulate_row(const float *v, const float *probs, int64_t probs_stride, int group,
                                  int head_dim, float *out) {
    for (int g = 0; g < group; g++) {
        const float p = probs[g * probs_stride];
        float *o = out + (int64_t)g * head_dim;
#pragma omp simd
        for (int d = 0; d < head_dim; d++) o[d] += p * v[d];
    }
}

/* Blocks sit at random places in the cache, which defeats the hardware prefetcher at every block
 * boundary; so while one block is read, the same row of the next block is requested. */
static inline void prefetch_row(const uint8_t *row, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(row + i);
}

/* exp(x - max) is taken as 2^(x log2(e) - max log2(e)): with AVX2 eight at a time, which made the
 * whole kernel about 15% faster at 1-64 sequences of 200-560 tokens (bench preset's heads). */
static void softmax_in_place(float *s, int64_t n) {
    float max_score = -INFINITY;
    for (int64_t t = 0; t < n; t++) max_score = s[t] > max_score ? s[t] : max_score;
    float total = 0.0f;
    int64_t t = 0;
#if defined(__AVX2__) && defined(__FMA__)
    const __m256 shift = _mm256_set1_ps(max_score * LOG2E), log2e = _mm256_set1_ps(LOG2E);
    __m256 sums = _mm256_setzero_ps();
    for (; t + 8 <= n; t += 8) {
        const __m256 e = exp2_nonpositive(_mm256_fmsub_ps(_mm256_loadu_ps(s + t), log2e, shift));
        _mm256_storeu_ps(s + t, e);
        sums = _mm256_add_ps(sums, e);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, sums);
    for (int i = 0; i < 8; i++) total += lanes[i];
#endif
    for (; t < n; t++) {
        s[t] = exp2f(s[t] * LOG2E - max_score * LOG2E);
        total += s[t];
    }
    const float inv_total = 1.0f / total;
#pragma omp simd
    for (int64_t i = 0; i < n; i++) s[i] *= inv_total;
}

typedef struct {
    const uint8_t *k_cache, *v_cache;
    int kv_dtype, group, head_dim, block_size;
    int64_t row_bytes;  /* one KV head's row */
    int64_t slot_bytes; /* every KV head's rows of one slot */
    float scale;
} Cache;

/*
 * Query heads of KV heads [first_kv_head, last_kv_head) of one sequence against their keys. Rows are
 * visited block by block (no division in the inner loop), and with every KV head in the range at each
 * row, so a whole range reads the cache as contiguous runs the prefetcher can stream.
 * q, out: this sequence's [num_heads, head_dim]; scores: num_heads * context_len floats.
 */
static void attend(const Cache *c, const float *q, const int64_t *table, int64_t context_len, float *out,
                   int first_kv_head, int last_kv_head, float *scores) {
    const int group = c->group, head_dim = c->head_dim, block_size = c->block_size;
    const int64_t group_size = (int64_t)group * head_dim, block_bytes = block_size * c->slot_bytes;
    const int num_heads = (last_kv_head - first_kv_head) * group;
    const int64_t span = (int64_t)(last_kv_head - first_kv_head) * c->row_bytes;
    const int64_t first_row = first_kv_head * c->row_bytes;
    float row_buffer[head_dim];
    q += first_kv_head * group_size;
    out += first_kv_head * group_size;
    for (int64_t t0 = 0, b = 0; t0 < context_len; t0 += block_size, b++) {
        const int64_t rows = context_len - t0 < block_size ? context_len - t0 : block_size;
        const uint8_t *k = c->k_cache + table[b] * block_bytes + first_row;
        const uint8_t *next_k = t0 + block_size < context_len ? c->k_cache + table[b + 1] * block_bytes + first_row
                                                               : NULL;
        for (int64_t r = 0; r < rows; r++) {
            if (next_k != NULL) prefetch_row(next_k + r * c->slot_bytes, span);
            for (int h = first_kv_head; h < last_kv_head; h++) {
                const uint8_t *row = k + r * c->slot_bytes + (h - first_kv_head) * c->row_bytes;
                score_row(q + (h - first_kv_head) * group_size, kv_row_as_float(row, c->kv_dtype, head_dim, row_buffer),
                          group, head_dim, c->scale, scores + (h - first_kv_head) * group * context_len + t0 + r,
                          context_len);
            }
        }
    }
    for (int i = 0; i < num_heads; i++) softmax_in_place(scores + (int64_t)i * context_len, context_len);
    memset(out, 0, sizeof(float) * num_heads * head_dim);
    for (int64_t t0 = 0, b = 0; t0 < context_len; t0 += block_size, b++) {
        const int64_t rows = context_len - t0 < block_size ? context_len - t0 : block_size;
        const uint8_t *v = c->v_cache + table[b] * block_bytes + first_row;
        const uint8_t *next_v = t0 + block_size < context_len ? c->v_cache + table[b + 1] * block_bytes + first_row
                                                               : NULL;
        for (int64_t r = 0; r < rows; r++) {
            if (next_v != NULL) prefetch_row(next_v + r * c->slot_bytes, span);
            for (int h = first_kv_head; h < last_kv_head; h++) {
                const uint8_t *row = v + r * c->slot_bytes + (h - first_kv_head) * c->row_bytes;
                accumulate_row(kv_row_as_float(row, c->kv_dtype, head_dim, row_buffer),
                               scores + (h - first_kv_head) * group * context_len + t0 + r, context_len, group,
                               head_dim, out + (h - first_kv_head) * group_size);
            }
        }
    }
}

/* `workspace` holds num_threads * num_heads * max(context_lens) floats. */
void kvyard_paged_decode_attention(const float *q, const void *k_cache, const void *v_cache, int kv_dtype,
                                   const int64_t *block_tables, const int64_t *context_lens, float *out,
                                   float *workspace, int num_seqs, int num_heads, int num_kv_heads,
                                   int head_dim, int block_size, int max_blocks, int64_t max_context,
                                   float scale, int num_threads) {
    const int64_t row_bytes = kv_row_bytes(kv_dtype, head_dim);
    const Cache cache = {
        .k_cache = k_cache, .v_cache = v_cache, .kv_dtype = kv_dtype, .group = num_heads / num_kv_heads, .head_dim = head_dim, .block_size = block_size, .row_bytes = row_bytes,
        .slot_bytes = row_bytes * num_kv_heads, .scale = scale,
    };
    int64_t total_keys = 0;
    for (int b = 0; b < num_seqs; b++) total_keys += context_lens[b];
    /* Waking a thread pool costs more than a few thousand dot products. */
    const int parallel = total_keys * num_kv_heads >= 16384;
    /* Whole sequences per task when there are enough of them to share out; else one KV head each. */
    const int heads_per_task = num_seqs >= 2 * num_threads ? num_kv_heads : 1;
    const int tasks_per_seq = num_kv_heads / heads_per_task;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) if (parallel)
    for (int task = 0; task < num_seqs * tasks_per_seq; task++) {
        const int b = task / tasks_per_seq, first = (task % tasks_per_seq) * heads_per_task;
        float *scores = workspace + (int64_t)omp_get_thread_num() * num_heads * max_context;
        const int64_t offset = (int64_t)b * num_heads * head_dim;
        attend(&cache, q + offset, block_tables + (int64_t)b * max_blocks, context_lens[b], out + offset, first,
               first + heads_per_task, scores);
    }
}
