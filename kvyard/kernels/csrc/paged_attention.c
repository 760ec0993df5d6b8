/*
 * Decode attention straight from the paged KV cache, for CPU: fp32 queries and arithmetic, the cache in any
 * format of kv_rows.h (each row widened to fp32 as it is read).
 *
 * One query token per sequence. Keys and values are read in place through the block table,
 * so nothing is gathered into a temporary. Work is split over (sequence, KV head) pairs; the
 * query heads of one KV group share each key and value row as it is loaded.
 *
 * With AVX2, eight key rows are scored together (eight FMA chains sharing each load of q, where four had left the
 * FMA's latency exposed), and for head_dim a multiple of 64 each 64 outputs of a query head stay in registers over
 * 16 value rows, loaded and stored once, instead of once every 4 rows. Each score and each output is the same
 * sequence of operations as before, so the bits are unchanged; on a 2-core AMD EPYC Zen 2 (bench heads: 8 query
 * heads, 4 KV heads of 64; fp32 cache from L2/L3) one sequence took 0.87x the time at 150 tokens and 0.70-0.84x
 * at 1,000-3,000, five and eight sequences 0.86-0.88x.
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

#define ROW_STEP 4    /* value rows accumulate_rows takes together */
#define SCORE_ROWS 8  /* key rows scored together */
#define ACC_ROWS 16   /* value rows accumulated per load and store of the outputs */

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

#if defined(__AVX2__) && defined(__FMA__)
/* The four horizontal sums of a0..a3, in order. */
static inline __m128 sum_each(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    const __m256 pairs = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(pairs), _mm256_extractf128_ps(pairs, 1));
}

#ifdef __F16C__
#define HALF_ROWS_SIMD 1 /* bf16 and fp16 rows are read in place, widened in registers */
#endif

/* Eight values of a row as fp32: an fp32 row (kind KV_FP32), or with HALF_ROWS_SIMD a bf16 or fp16 one. Widened in
 * registers, a 16-bit row goes through the same FMAs in the same order as the fp32 row of its values, so a bf16 or
 * fp16 cache attends exactly as an fp32 cache holding the same values. */
static inline __m256 load_row8(const void *row, int d, int kind) {
#ifdef HALF_ROWS_SIMD
    if (kind != KV_FP32) {
        const __m128i raw = _mm_loadu_si128((const __m128i *)((const uint16_t *)row + d));
        return kind == KV_BF16 ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16))
                               : _mm256_cvtph_ps(raw);
    }
#else
    (void)kind;
#endif
    return _mm256_loadu_ps((const float *)row + d);
}
#endif

/* score_row for `rows` (at most SCORE_ROWS) key rows k[0..rows) of `kind` (load_row8; KV_FP32 only where the
 * vector path does not apply): scores[g * scores_stride + r]. With AVX2 eight dot products share each load of q,
 * and every four of them one reduction. */
static inline void score_rows(const float *q, const void *const *k, int rows, int group, int head_dim, float scale,
                              float *scores, int64_t scores_stride, int kind) {
#if defined(__AVX2__) && defined(__FMA__)
    if (head_dim % 8 == 0) {
        const void *kr[SCORE_ROWS];
        for (int r = 0; r < SCORE_ROWS; r++) kr[r] = k[r < rows ? r : 0];
        for (int g = 0; g < group; g++) {
            const float *qg = q + (int64_t)g * head_dim;
            __m256 a[SCORE_ROWS];
            for (int r = 0; r < SCORE_ROWS; r++) a[r] = _mm256_setzero_ps();
            for (int d = 0; d < head_dim; d += 8) {
                const __m256 qv = _mm256_loadu_ps(qg + d);
                for (int r = 0; r < SCORE_ROWS; r++) a[r] = _mm256_fmadd_ps(load_row8(kr[r], d, kind), qv, a[r]);
            }
            float dots[SCORE_ROWS];
            _mm_storeu_ps(dots, _mm_mul_ps(sum_each(a[0], a[1], a[2], a[3]), _mm_set1_ps(scale)));
            _mm_storeu_ps(dots + 4, _mm_mul_ps(sum_each(a[4], a[5], a[6], a[7]), _mm_set1_ps(scale)));
            for (int r = 0; r < rows; r++) scores[g * scores_stride + r] = dots[r];
        }
        return;
    }
#else
    (void)kind;
#endif
    for (int r = 0; r < rows; r++) score_row(q, k[r], group, head_dim, scale, scores + r, scores_stride);
}

/* accumulate_row for `rows` (at most ROW_STEP) value rows v[0..rows), probs[g * probs_stride + r]. With AVX2 each
 * output vector is loaded and stored once for all of them. */
static inline void accumulate_rows(const void *const *v, int rows, const float *probs, int64_t probs_stride,
                                   int group, int head_dim, float *out) {
#if defined(__AVX2__) && defined(__FMA__)
    if (head_dim % 8 == 0) {
        const float *v0 = v[0], *v1 = v[rows > 1], *v2 = v[rows > 2 ? 2 : 0], *v3 = v[rows > 3 ? 3 : 0];
        for (int g = 0; g < group; g++) {
            const float *p = probs + g * probs_stride;
            const __m256 p0 = _mm256_set1_ps(p[0]), p1 = _mm256_set1_ps(rows > 1 ? p[1] : 0.0f),
                         p2 = _mm256_set1_ps(rows > 2 ? p[2] : 0.0f), p3 = _mm256_set1_ps(rows > 3 ? p[3] : 0.0f);
            float *o = out + (int64_t)g * head_dim;
            for (int d = 0; d < head_dim; d += 8) {
                __m256 acc = _mm256_loadu_ps(o + d);
                acc = _mm256_fmadd_ps(p0, _mm256_loadu_ps(v0 + d), acc);
                acc = _mm256_fmadd_ps(p1, _mm256_loadu_ps(v1 + d), acc);
                acc = _mm256_fmadd_ps(p2, _mm256_loadu_ps(v2 + d), acc);
                acc = _mm256_fmadd_ps(p3, _mm256_loadu_ps(v3 + d), acc);
                _mm256_storeu_ps(o + d, acc);
            }
        }
        return;
    }
#endif
    for (int r = 0; r < rows; r++) accumulate_row(v[r], probs + r, probs_stride, group, head_dim, out);
}

/* accumulate_rows for `rows` (at most ACC_ROWS) value rows of `kind` (as score_rows). With AVX2 and head_dim a
 * multiple of 64, each 64 outputs of a query head sit in eight registers for all the rows. Each output is its rows'
 * FMAs in row order either way. */
static inline void accumulate_many_rows(const void *const *v, int rows, const float *probs, int64_t probs_stride,
                                        int group, int head_dim, float *out, int kind) {
#if defined(__AVX2__) && defined(__FMA__)
    if (head_dim % 64 == 0) {
        for (int g = 0; g < group; g++) {
            const float *p = probs + g * probs_stride;
            float *o = out + (int64_t)g * head_dim;
            for (int d0 = 0; d0 < head_dim; d0 += 64) {
                __m256 acc[8];
                for (int j = 0; j < 8; j++) acc[j] = _mm256_loadu_ps(o + d0 + 8 * j);
                for (int r = 0; r < rows; r++) {
                    const __m256 pr = _mm256_set1_ps(p[r]);
                    for (int j = 0; j < 8; j++)
                        acc[j] = _mm256_fmadd_ps(pr, load_row8(v[r], d0 + 8 * j, kind), acc[j]);
                }
                for (int j = 0; j < 8; j++) _mm256_storeu_ps(o + d0 + 8 * j, acc[j]);
            }
        }
        return;
    }
#else
    (void)kind;
#endif
    for (int r = 0; r < rows; r += ROW_STEP)
        accumulate_rows(v + r, rows - r < ROW_STEP ? rows - r : ROW_STEP, probs + r, probs_stride, group, head_dim,
                        out);
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
    int64_t t = 0;
#if defined(__AVX2__) && defined(__FMA__)
    /* The maximum eight lanes at a time (a scalar loop was a tenth of the kernel at 2,200 tokens); scores hold no
     * NaN, so the order of comparisons does not change it. */
    __m256 maxima = _mm256_set1_ps(-INFINITY);
    for (; t + 8 <= n; t += 8) maxima = _mm256_max_ps(maxima, _mm256_loadu_ps(s + t));
    float lane_max[8];
    _mm256_storeu_ps(lane_max, maxima);
    for (int i = 0; i < 8; i++) max_score = lane_max[i] > max_score ? lane_max[i] : max_score;
#endif
    for (; t < n; t++) max_score = s[t] > max_score ? s[t] : max_score;
    float total = 0.0f;
    t = 0;
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

/* score_rows and accumulate_many_rows with the row kind a constant at each call, so that each kind gets loops of its
 * own rather than a test of the kind at every load. */
static inline void score_rows_of(int kind, const float *q, const void *const *k, int rows, int group, int head_dim,
                                 float scale, float *scores, int64_t scores_stride) {
    switch (kind) {
    case KV_BF16: score_rows(q, k, rows, group, head_dim, scale, scores, scores_stride, KV_BF16); break;
    case KV_FP16: score_rows(q, k, rows, group, head_dim, scale, scores, scores_stride, KV_FP16); break;
    default: score_rows(q, k, rows, group, head_dim, scale, scores, scores_stride, KV_FP32);
    }
}

static inline void accumulate_many_rows_of(int kind, const void *const *v, int rows, const float *probs,
                                           int64_t probs_stride, int group, int head_dim, float *out) {
    switch (kind) {
    case KV_BF16: accumulate_many_rows(v, rows, probs, probs_stride, group, head_dim, out, KV_BF16); break;
    case KV_FP16: accumulate_many_rows(v, rows, probs, probs_stride, group, head_dim, out, KV_FP16); break;
    default: accumulate_many_rows(v, rows, probs, probs_stride, group, head_dim, out, KV_FP32);
    }
}

/* Whether the rows are bf16 or fp16 of a head_dim the vector paths read in place (load_row8). */
static inline int reads_half_rows(const Cache *c) {
#ifdef HALF_ROWS_SIMD
    return (c->kv_dtype == KV_BF16 || c->kv_dtype == KV_FP16) && c->head_dim % 64 == 0;
#else
    (void)c;
    return 0;
#endif
}

/* Pointers to `rows` consecutive rows of one KV head: in place `in_place` (16-bit rows read by load_row8) or for an
 * fp32 cache, else widened to fp32 into `buffer` (`rows` rows of head_dim floats). */
static inline void row_pointers(const Cache *c, const uint8_t *first, int rows, int in_place, float *buffer,
                                const void **out) {
    for (int r = 0; r < rows; r++) {
        const uint8_t *row = first + r * c->slot_bytes;
        out[r] = in_place ? (const void *)row
                          : (const void *)kv_row_as_float(row, c->kv_dtype, c->head_dim, buffer + r * c->head_dim);
    }
}

/*
 * Query heads of KV heads [first_kv_head, last_kv_head) of one sequence against their keys. Rows are
 * visited block by block (no division in the inner loop), a few at a time, and with every KV head in the
 * range at each step, so a whole range reads the cache as contiguous runs the prefetcher can stream.
 * q, out: this sequence's [num_heads, head_dim]; scores: num_heads * context_len floats.
 */
static void attend(const Cache *c, const float *q, const int64_t *table, int64_t context_len, float *out,
                   int first_kv_head, int last_kv_head, float *scores) {
    const int group = c->group, head_dim = c->head_dim, block_size = c->block_size;
    const int64_t group_size = (int64_t)group * head_dim, block_bytes = block_size * c->slot_bytes;
    const int num_heads = (last_kv_head - first_kv_head) * group;
    const int64_t span = (int64_t)(last_kv_head - first_kv_head) * c->row_bytes;
    const int64_t first_row = first_kv_head * c->row_bytes;
    float buffer[ACC_ROWS * head_dim];
    const void *row_ptrs[ACC_ROWS];
    const int in_place = reads_half_rows(c), kind = in_place ? c->kv_dtype : KV_FP32;
    q += first_kv_head * group_size;
    out += first_kv_head * group_size;
    for (int64_t t0 = 0, b = 0; t0 < context_len; t0 += block_size, b++) {
        const int64_t rows = context_len - t0 < block_size ? context_len - t0 : block_size;
        const uint8_t *k = c->k_cache + table[b] * block_bytes + first_row;
        const uint8_t *next_k = t0 + block_size < context_len ? c->k_cache + table[b + 1] * block_bytes + first_row
                                                               : NULL;
        for (int64_t r = 0; r < rows; r += SCORE_ROWS) {
            const int step = rows - r < SCORE_ROWS ? (int)(rows - r) : SCORE_ROWS;
            if (next_k != NULL)
                for (int i = 0; i < step; i++) prefetch_row(next_k + (r + i) * c->slot_bytes, span);
            for (int h = 0; h < last_kv_head - first_kv_head; h++) {
                row_pointers(c, k + r * c->slot_bytes + h * c->row_bytes, step, in_place, buffer, row_ptrs);
                score_rows_of(kind, q + h * group_size, row_ptrs, step, group, head_dim, c->scale,
                              scores + h * group * context_len + t0 + r, context_len);
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
        for (int64_t r = 0; r < rows; r += ACC_ROWS) {
            const int step = rows - r < ACC_ROWS ? (int)(rows - r) : ACC_ROWS;
            if (next_v != NULL)
                for (int i = 0; i < step; i++) prefetch_row(next_v + (r + i) * c->slot_bytes, span);
            for (int h = 0; h < last_kv_head - first_kv_head; h++) {
                row_pointers(c, v + r * c->slot_bytes + h * c->row_bytes, step, in_place, buffer, row_ptrs);
                accumulate_many_rows_of(kind, row_ptrs, step, scores + h * group * context_len + t0 + r, context_len,
                                        group, head_dim, out + h * group_size);
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
    /* Waking a thread pool costs about as much as 1,000 key rows of one KV head (bench heads, 2 threads:
     * one 256-token sequence 1.19x faster on two threads, 512 tokens 1.37x, 128 tokens even). */
    const int parallel = total_keys * num_kv_heads >= 1024;
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
