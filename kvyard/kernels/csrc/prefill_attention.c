/*
 * Prefill-chunk attention straight from the paged KV cache, for CPU: fp32 queries and arithmetic, the cache
 * in any format of kv_rows.h (rows are widened to fp32 as they are packed into a key tile).
 *
 * A chunk of query_len new tokens sits at positions context_len - query_len .. context_len - 1 and
 * attends causally to all context_len keys. Keys and values are read through the block table where
 * they lie: nothing is gathered into a context-sized temporary, and there is no mask tensor, since
 * causality follows from positions. Flash-attention style: keys are visited in tiles with an online
 * softmax, so scores never outgrow one tile, and accumulation is fp32 throughout.
 *
 * Layout: q [query_len, num_heads, head_dim] with q_stride floats between tokens (heads contiguous);
 * out [query_len, num_heads, head_dim] contiguous; key j of KV head h is the row (kv_rows.h) at byte
 * k_cache + slot * kv_stride_bytes + h * row_bytes with slot = block_table[j / block_size] * block_size +
 * j % block_size (likewise values). A contiguous K of shape [context_len, Hkv, D] is the special
 * case of one block of context_len slots.
 *
 * Query rows. The rows of one KV head are its `group` query heads times the chunk's tokens,
 * token-major, so every query head of a group shares each key and value load. They are cut into
 * tiles of LANES rows, and a row is a SIMD lane: the query tile is stored transposed, q_t[d][lane],
 * so a score tile s[key][lane] is a sum over d of broadcast(k[key][d]) * q_t[d][lanes]; the softmax
 * runs down the keys with whole vectors of rows; and the output tile o_t[d][lane] sums
 * broadcast(v[key][d]) * p[key][lanes]. Nothing needs a transpose but the query and output tiles,
 * once per call.
 *
 * Loop order. A work item is one KV head and up to MAX_TILES_PER_ITEM of its query tiles; items go
 * to threads longest first (later query tiles see more keys). Within an item, for each tile of
 * TILE_KEYS keys up to the item's last position: copy the tile's key and value rows into a packed
 * L1-sized buffer (the only read of the cache), then for each query tile that sees any of them:
 * scores (micro-kernel: KEY_STEP keys x LANES rows, summed over d) -> causal mask if the tile crosses
 * the query tile's first position -> online softmax -> o_t = alpha * o_t + V^T p (micro-kernel:
 * DIM_STEP dims x LANES rows, summed over keys). Scores are in log2 units (q is pre-scaled by
 * scale * log2(e)), so the softmax uses exp2.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "kv_rows.h"
#include "kvyard_kernels.h"
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#include "vec_math.h"
#define USE_AVX2 1
#else
#define USE_AVX2 0
#endif

/* Measured on Zen 3 (AVX2), head_dim 64 and 128: 32 or 128 keys per tile were a few percent slower,
 * and 4-8 query tiles per item 5-15% slower (each item packs the keys it needs again). */
#define LANES 24              /* query rows per tile: three 8-float vectors */
#define TILE_KEYS 64          /* keys per softmax step and per packed tile */
#define KEY_STEP 4            /* keys per score micro-kernel */
#define DIM_STEP 4            /* head dims per accumulate micro-kernel */
#define MAX_TILES_PER_ITEM 16 /* query tiles that share each packed key tile */
#define PREFETCH_DISTANCE 8   /* keys ahead of the one being packed */
#define ALIGN 64
#define LOG2E 1.4426950408889634f

typedef struct {
    const float *q;
    int64_t q_stride;
    const uint8_t *k_cache, *v_cache;
    int64_t kv_stride_bytes, row_bytes;
    int kv_dtype;
    const int64_t *block_table;
    int block_size;
    int64_t query_len, context_len;
    int num_heads, num_kv_heads, head_dim, group;
    float q_scale; /* scale * log2(e) */
    float *out;
} Problem;

/* One tile of LANES query rows and its running softmax state. */
typedef struct {
    float *q_t;              /* [head_dim][LANES], scaled by q_scale */
    float *o_t;              /* [head_dim][LANES], unnormalised */
    _Alignas(32) float max_score[LANES];
    _Alignas(32) float sum[LANES];
    _Alignas(32) float alpha[LANES]; /* rescale of o_t and sum for the current key tile */
    int64_t position[LANES];
    int64_t first_row;
    int rows;
    int64_t unmasked_end;    /* keys below this are visible to every row of the tile */
    int64_t end_key;         /* and none at or past this is visible to any */
} QueryTile;

/* One thread's scratch. */
typedef struct {
    QueryTile tiles[MAX_TILES_PER_ITEM];
    float *k_tile, *v_tile; /* [TILE_KEYS][head_dim]: the key tile's rows, packed */
    float *scores;          /* [TILE_KEYS][LANES], then probabilities in place */
    float *buffer;
} Workspace;

static int workspace_init(Workspace *w, int head_dim) {
    const size_t tile_floats = (size_t)head_dim * LANES;
    const size_t key_floats = (size_t)TILE_KEYS * head_dim;
    const size_t floats = 2 * MAX_TILES_PER_ITEM * tile_floats + 2 * key_floats + (size_t)TILE_KEYS * LANES;
    const size_t bytes = floats * sizeof(float);
    w->buffer = aligned_alloc(ALIGN, (bytes + ALIGN - 1) / ALIGN * ALIGN);
    if (w->buffer == NULL) return 0;
    for (int t = 0; t < MAX_TILES_PER_ITEM; t++) {
        w->tiles[t].q_t = w->buffer + 2 * t * tile_floats;
        w->tiles[t].o_t = w->buffer + (2 * t + 1) * tile_floats;
    }
    w->k_tile = w->buffer + 2 * MAX_TILES_PER_ITEM * tile_floats;
    w->v_tile = w->k_tile + key_floats;
    w->scores = w->v_tile + key_floats;
    return 1;
}

/* ---------------------------------------------------------------- vector helpers */

#if USE_AVX2
/* Left alone, GCC folds each load of these vectors into every FMA that uses it: 16 loads per 12 FMAs
 * instead of 7, and the load ports, not the FMA units, set the pace (about 20% slower on Zen 3). */
#define KEEP_IN_REGISTERS(a, b, c) __asm__("" : "+x"(a), "+x"(b), "+x"(c))
#endif

/* ---------------------------------------------------------------- query and output tiles */

static inline const float *query_row(const Problem *p, int kv_head, int64_t row) {
    const int64_t token = row / p->group;
    const int head = kv_head * p->group + (int)(row % p->group);
    return p->q + token * p->q_stride + (int64_t)head * p->head_dim;
}

/* q_t[d][lane] = scaled q of row first_row + lane; lanes past the last row are zero. */
static void load_query_tile(const Problem *p, int kv_head, int64_t first_row, int rows, float *q_t) {
    memset(q_t, 0, sizeof(float) * (size_t)p->head_dim * LANES);
    for (int lane = 0; lane < rows; lane++) {
        const float *q = query_row(p, kv_head, first_row + lane);
        for (int d = 0; d < p->head_dim; d++) q_t[d * LANES + lane] = q[d] * p->q_scale;
    }
}

static void store_output_tile(const Problem *p, int kv_head, const QueryTile *tile) {
    const float *o_t = tile->o_t, *sum = tile->sum;
    for (int lane = 0; lane < tile->rows; lane++) {
        const int64_t row = tile->first_row + lane;
        const int head = kv_head * p->group + (int)(row % p->group);
        float *out = p->out + ((row / p->group) * p->num_heads + head) * (int64_t)p->head_dim;
        const float inv_sum = 1.0f / sum[lane];
        for (int d = 0; d < p->head_dim; d++) out[d] = o_t[d * LANES + lane] * inv_sum;
    }
}

/* ---------------------------------------------------------------- key tiles */

static inline const uint8_t *cache_row(const Problem *p, const uint8_t *cache, int kv_head, int64_t key) {
    const int64_t slot = p->block_table[key / p->block_size] * p->block_size + key % p->block_size;
    return cache + slot * p->kv_stride_bytes + (int64_t)kv_head * p->row_bytes;
}

static inline void prefetch_row(const uint8_t *row, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(row + i);
}

/* Copies keys first_key .. first_key + count - 1 of one KV head (and their values) into the packed
 * tiles, zero-padded to a whole KEY_STEP. In the cache, one head's rows lie in scattered blocks at a
 * stride of num_kv_heads * head_dim floats, usually a power of two, which folds them onto a fraction
 * of the L1 sets; packed, a tile stays in L1 while every query tile of the item uses it. */
static void pack_key_tile(const Problem *p, int kv_head, int64_t first_key, int count, int64_t end_key,
                         Workspace *w) {
    const int head_dim = p->head_dim;
    for (int n = 0; n < count; n++) {
        const int64_t key = first_key + n;
        /* The rows sit in scattered blocks, so the hardware prefetcher loses them at every block edge. */
        if (key + PREFETCH_DISTANCE < end_key) {
            prefetch_row(cache_row(p, p->k_cache, kv_head, key + PREFETCH_DISTANCE), p->row_bytes);
            prefetch_row(cache_row(p, p->v_cache, kv_head, key + PREFETCH_DISTANCE), p->row_bytes);
        }
        kv_load_row(cache_row(p, p->k_cache, kv_head, key), p->kv_dtype, head_dim, w->k_tile + (size_t)n * head_dim);
        kv_load_row(cache_row(p, p->v_cache, kv_head, key), p->kv_dtype, head_dim, w->v_tile + (size_t)n * head_dim);
    }
    const int padded = (count + KEY_STEP - 1) / KEY_STEP * KEY_STEP;
    const size_t pad_bytes = sizeof(float) * (size_t)head_dim * (size_t)(padded - count);
    memset(w->k_tile + (size_t)count * head_dim, 0, pad_bytes);
    memset(w->v_tile + (size_t)count * head_dim, 0, pad_bytes);
}

/* ---------------------------------------------------------------- micro-kernels */

/* scores[n][lane] = sum_d k[n][d] * q_t[d][lane] for KEY_STEP packed keys. */
static inline void score_block(const float *q_t, const float *k, int head_dim, float *scores) {
#if USE_AVX2
    const float *k0 = k, *k1 = k + head_dim, *k2 = k + 2 * head_dim, *k3 = k + 3 * head_dim;
    __m256 a00 = _mm256_setzero_ps(), a01 = _mm256_setzero_ps(), a02 = _mm256_setzero_ps();
    __m256 a10 = _mm256_setzero_ps(), a11 = _mm256_setzero_ps(), a12 = _mm256_setzero_ps();
    __m256 a20 = _mm256_setzero_ps(), a21 = _mm256_setzero_ps(), a22 = _mm256_setzero_ps();
    __m256 a30 = _mm256_setzero_ps(), a31 = _mm256_setzero_ps(), a32 = _mm256_setzero_ps();
    for (int d = 0; d < head_dim; d++) {
        const float *qd = q_t + d * LANES;
        __m256 q0 = _mm256_load_ps(qd), q1 = _mm256_load_ps(qd + 8), q2 = _mm256_load_ps(qd + 16);
        KEEP_IN_REGISTERS(q0, q1, q2);
        __m256 k = _mm256_broadcast_ss(k0 + d);
        a00 = _mm256_fmadd_ps(k, q0, a00), a01 = _mm256_fmadd_ps(k, q1, a01), a02 = _mm256_fmadd_ps(k, q2, a02);
        k = _mm256_broadcast_ss(k1 + d);
        a10 = _mm256_fmadd_ps(k, q0, a10), a11 = _mm256_fmadd_ps(k, q1, a11), a12 = _mm256_fmadd_ps(k, q2, a12);
        k = _mm256_broadcast_ss(k2 + d);
        a20 = _mm256_fmadd_ps(k, q0, a20), a21 = _mm256_fmadd_ps(k, q1, a21), a22 = _mm256_fmadd_ps(k, q2, a22);
        k = _mm256_broadcast_ss(k3 + d);
        a30 = _mm256_fmadd_ps(k, q0, a30), a31 = _mm256_fmadd_ps(k, q1, a31), a32 = _mm256_fmadd_ps(k, q2, a32);
    }
    _mm256_store_ps(scores, a00), _mm256_store_ps(scores + 8, a01), _mm256_store_ps(scores + 16, a02);
    scores += LANES;
    _mm256_store_ps(scores, a10), _mm256_store_ps(scores + 8, a11), _mm256_store_ps(scores + 16, a12);
    scores += LANES;
    _mm256_store_ps(scores, a20), _mm256_store_ps(scores + 8, a21), _mm256_store_ps(scores + 16, a22);
    scores += LANES;
    _mm256_store_ps(scores, a30), _mm256_store_ps(scores + 8, a31), _mm256_store_ps(scores + 16, a32);
#else
    for (int n = 0; n < KEY_STEP; n++) {
        float *s = scores + n * LANES;
#pragma omp simd
        for (int lane = 0; lane < LANES; lane++) s[lane] = 0.0f;
        for (int d = 0; d < head_dim; d++) {
            const float kd = k[n * head_dim + d];
#pragma omp simd
            for (int lane = 0; lane < LANES; lane++) s[lane] += kd * q_t[d * LANES + lane];
        }
    }
#endif
}

/* o_t[d][lane] += sum_n v[n][d] * probs[n][lane]: one head dim, for the portable path and for
 * head_dim % DIM_STEP. */
static void accumulate_dim(const float *probs, const float *v, int keys, int head_dim, int d, float *o_t) {
    float *o = o_t + d * LANES;
    for (int n = 0; n < keys; n++) {
        const float vd = v[n * head_dim + d];
#pragma omp simd
        for (int lane = 0; lane < LANES; lane++) o[lane] += vd * probs[n * LANES + lane];
    }
}

/* o_t[d0 + i][lane] += sum_n v[n][d0 + i] * probs[n][lane] for i < DIM_STEP, packed values. */
static inline void accumulate_block(const float *probs, const float *v, int keys, int head_dim, int d0, float *o_t) {
#if USE_AVX2
    float *o = o_t + d0 * LANES;
    __m256 acc[DIM_STEP][3];
    for (int i = 0; i < DIM_STEP; i++)
        for (int c = 0; c < 3; c++) acc[i][c] = _mm256_load_ps(o + i * LANES + 8 * c);
    for (int n = 0; n < keys; n++) {
        const float *pn = probs + n * LANES, *vn = v + (size_t)n * head_dim + d0;
        __m256 p0 = _mm256_load_ps(pn), p1 = _mm256_load_ps(pn + 8), p2 = _mm256_load_ps(pn + 16);
        KEEP_IN_REGISTERS(p0, p1, p2);
        for (int i = 0; i < DIM_STEP; i++) {
            const __m256 b = _mm256_broadcast_ss(vn + i);
            acc[i][0] = _mm256_fmadd_ps(b, p0, acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(b, p1, acc[i][1]);
            acc[i][2] = _mm256_fmadd_ps(b, p2, acc[i][2]);
        }
    }
    for (int i = 0; i < DIM_STEP; i++)
        for (int c = 0; c < 3; c++) _mm256_store_ps(o + i * LANES + 8 * c, acc[i][c]);
#else
    for (int i = 0; i < DIM_STEP; i++) accumulate_dim(probs, v, keys, head_dim, d0 + i, o_t);
#endif
}

/* ---------------------------------------------------------------- softmax */

/* scores[n][lane] = -inf where key first_key + n lies after the lane's position. */
static void mask_future_keys(float *scores, int keys, int64_t first_key, const int64_t *position) {
    for (int n = 0; n < keys; n++)
        for (int lane = 0; lane < LANES; lane++)
            if (first_key + n > position[lane]) scores[n * LANES + lane] = -INFINITY;
}

/* Online softmax step: scores become exp2(score - new max); alpha rescales what came before. */
static void softmax_update(float *scores, int keys, QueryTile *w) {
#if USE_AVX2
    for (int c = 0; c < LANES; c += 8) {
        __m256 tile_max = _mm256_set1_ps(-INFINITY);
        for (int n = 0; n < keys; n++) tile_max = _mm256_max_ps(tile_max, _mm256_load_ps(scores + n * LANES + c));
        const __m256 old_max = _mm256_load_ps(w->max_score + c);
        const __m256 new_max = _mm256_max_ps(old_max, tile_max);
        const __m256 alpha = exp2_nonpositive(_mm256_sub_ps(old_max, new_max));
        __m256 total = _mm256_setzero_ps();
        for (int n = 0; n < keys; n++) {
            float *s = scores + n * LANES + c;
            const __m256 prob = exp2_nonpositive(_mm256_sub_ps(_mm256_load_ps(s), new_max));
            _mm256_store_ps(s, prob);
            total = _mm256_add_ps(total, prob);
        }
        _mm256_store_ps(w->max_score + c, new_max);
        _mm256_store_ps(w->alpha + c, alpha);
        _mm256_store_ps(w->sum + c, _mm256_fmadd_ps(_mm256_load_ps(w->sum + c), alpha, total));
    }
#else
    for (int lane = 0; lane < LANES; lane++) {
        float tile_max = -INFINITY;
        for (int n = 0; n < keys; n++) tile_max = fmaxf(tile_max, scores[n * LANES + lane]);
        const float new_max = fmaxf(w->max_score[lane], tile_max);
        /* The first tile holds key 0, which every lane sees, so new_max is finite here. */
        const float alpha = exp2f(w->max_score[lane] - new_max);
        float total = 0.0f;
        for (int n = 0; n < keys; n++) {
            float *s = scores + n * LANES + lane;
            *s = exp2f(*s - new_max);
            total += *s;
        }
        w->max_score[lane] = new_max;
        w->alpha[lane] = alpha;
        w->sum[lane] = w->sum[lane] * alpha + total;
    }
#endif
}

/* o_t[d][lane] *= alpha[lane]: what earlier tiles added, measured against the new running max. */
static void rescale_output(float *o_t, int head_dim, const float *alpha) {
    for (int d = 0; d < head_dim; d++) {
        float *o = o_t + d * LANES;
#pragma omp simd aligned(o, alpha : 32)
        for (int lane = 0; lane < LANES; lane++) o[lane] *= alpha[lane];
    }
}

/* ---------------------------------------------------------------- one work item */

static void start_query_tile(const Problem *p, int kv_head, int64_t first_row, QueryTile *tile) {
    const int64_t total_rows = p->query_len * p->group;
    const int rows = total_rows - first_row < LANES ? (int)(total_rows - first_row) : LANES;
    const int64_t first_position = p->context_len - p->query_len;
    for (int lane = 0; lane < LANES; lane++) {
        /* Padding lanes repeat the last row's position: their (zero) scores stay finite. */
        const int64_t row = first_row + (lane < rows ? lane : rows - 1);
        tile->position[lane] = first_position + row / p->group;
        tile->max_score[lane] = -INFINITY;
        tile->sum[lane] = 0.0f;
    }
    tile->first_row = first_row;
    tile->rows = rows;
    tile->unmasked_end = tile->position[0] + 1;
    tile->end_key = tile->position[rows - 1] + 1;
    load_query_tile(p, kv_head, first_row, rows, tile->q_t);
    memset(tile->o_t, 0, sizeof(float) * (size_t)p->head_dim * LANES);
}

/* Keys first_key .. first_key + count - 1 (packed in w) into one query tile's running state. */
static void attend_key_tile(const Problem *p, int64_t first_key, int count, QueryTile *tile, Workspace *w) {
    const int keys = (count + KEY_STEP - 1) / KEY_STEP * KEY_STEP;
    const int head_dim = p->head_dim, dims_in_steps = head_dim / DIM_STEP * DIM_STEP;
    for (int n = 0; n < keys; n += KEY_STEP)
        score_block(tile->q_t, w->k_tile + (size_t)n * head_dim, head_dim, w->scores + n * LANES);
    if (first_key + keys > tile->unmasked_end) mask_future_keys(w->scores, keys, first_key, tile->position);
    softmax_update(w->scores, keys, tile);
    rescale_output(tile->o_t, p->head_dim, tile->alpha);
    for (int d = 0; d < dims_in_steps; d += DIM_STEP)
        accumulate_block(w->scores, w->v_tile, keys, head_dim, d, tile->o_t);
    for (int d = dims_in_steps; d < head_dim; d++) accumulate_dim(w->scores, w->v_tile, keys, head_dim, d, tile->o_t);
}

/* Query tiles first_tile .. first_tile + num_tiles - 1 of one KV head. Each key tile is read from the
 * cache once and then serves every query tile, from cache. */
static void attend_item(const Problem *p, int kv_head, int64_t first_tile, int num_tiles, Workspace *w) {
    for (int t = 0; t < num_tiles; t++) start_query_tile(p, kv_head, (first_tile + t) * LANES, &w->tiles[t]);
    const int64_t end_key = w->tiles[num_tiles - 1].end_key;
    for (int64_t first_key = 0; first_key < end_key; first_key += TILE_KEYS) {
        const int count = end_key - first_key < TILE_KEYS ? (int)(end_key - first_key) : TILE_KEYS;
        pack_key_tile(p, kv_head, first_key, count, end_key, w);
        for (int t = 0; t < num_tiles; t++) {
            QueryTile *tile = &w->tiles[t];
            if (tile->end_key <= first_key) continue;
            const int64_t visible = tile->end_key - first_key;
            attend_key_tile(p, first_key, visible < count ? (int)visible : count, tile, w);
        }
    }
    for (int t = 0; t < num_tiles; t++) store_output_tile(p, kv_head, &w->tiles[t]);
}

/* ---------------------------------------------------------------- entry point */

/* How many items to cut a KV head's query tiles into: as few as MAX_TILES_PER_ITEM allows, since each
 * item reads every key it needs once, but so many that the items can be shared evenly by the threads
 * (when the head has enough tiles for that). */
static int64_t split_head(int64_t tiles_per_head, int num_kv_heads, int num_threads) {
    int64_t items_per_head = (tiles_per_head + MAX_TILES_PER_ITEM - 1) / MAX_TILES_PER_ITEM;
    while ((items_per_head * num_kv_heads) % num_threads != 0 && items_per_head < tiles_per_head) items_per_head++;
    return items_per_head;
}

/* Returns 0 on success, -1 if a thread could not allocate its scratch (out is then incomplete). */
int kvyard_paged_prefill_attention(const float *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                                   int kv_dtype, int64_t kv_stride_bytes, const int64_t *block_table, int block_size, int64_t query_len,
                                   int64_t context_len, int num_heads, int num_kv_heads, int head_dim, float scale,
                                   float *out, int num_threads) {
    const Problem p = {
        .q = q, .q_stride = q_stride, .k_cache = k_cache, .v_cache = v_cache, .kv_stride_bytes = kv_stride_bytes,
        .row_bytes = kv_row_bytes(kv_dtype, head_dim), .kv_dtype = kv_dtype,
        .block_table = block_table, .block_size = block_size, .query_len = query_len, .context_len = context_len,
        .num_heads = num_heads, .num_kv_heads = num_kv_heads, .head_dim = head_dim,
        .group = num_heads / num_kv_heads, .q_scale = scale * LOG2E, .out = out,
    };
    const int64_t tiles_per_head = (query_len * p.group + LANES - 1) / LANES;
    const int64_t items_per_head = split_head(tiles_per_head, num_kv_heads, num_threads);
    const int64_t tiles_per_item = (tiles_per_head + items_per_head - 1) / items_per_head;
    const int64_t items = num_kv_heads * ((tiles_per_head + tiles_per_item - 1) / tiles_per_item);
    /* Waking the thread pool costs more than a small chunk's work. */
    const int parallel = items > 1 && query_len * context_len * num_heads * head_dim >= (1 << 20);
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (parallel) reduction(| : failed)
    {
        Workspace w;
        const int ready = workspace_init(&w, head_dim);
        /* Every thread must reach the worksharing loop, so one without scratch only records it. */
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; item++) {
            if (!ready) {
                failed = 1;
                continue;
            }
            /* Last query tiles first: they see the most keys. */
            const int64_t first_tile = (items / num_kv_heads - 1 - item / num_kv_heads) * tiles_per_item;
            const int64_t num_tiles = tiles_per_head - first_tile < tiles_per_item ? tiles_per_head - first_tile
                                                                                    : tiles_per_item;
            attend_item(&p, (int)(item % num_kv_heads), first_tile, (int)num_tiles, &w);
        }
        if (ready) free(w.buffer);
    }
    return failed ? -1 : 0;
}
