/* Software prefetch for the few-rows matmul kernels, which stream their weights from memory once per step.
 *
 * With one row of x the loop issues loads fast enough for the hardware prefetcher to keep memory busy; with a few
 * rows (a speculative verification, a small batch) it spends more time per cache line on FMAs and the stream
 * stalls on memory latency. Asking for the weights a little ahead keeps them arriving: on a 2-core Intel Xeon
 * (AVX-512, weights of 224 MB fp32 / 63 MB int8), fp32 at 5 rows took 0.75x the time and int8 at 1 row 0.68x.
 * A prefetch never faults, so reading past a matrix's end is harmless.
 *
 * Kernels that read several weight rows side by side must not prefetch past the end of a row into one the same pass
 * reads: with rows shorter than the distance (int8 rows of 1536 weights), most prefetches were wasted that way.
 * prefetch_ahead() sends them to the next pass's rows instead: int8 at 1 row and k = 1536 (8192 x 1536), 2-core
 * Intel Xeon, 1.15-1.3x the throughput from cache and 1.2-1.25x from memory (alternating builds, 3 runs each).
 */
#ifndef KVYARD_PREFETCH_H
#define KVYARD_PREFETCH_H

#include <stdint.h>

/* How far ahead of its current read a kernel reading one weight row at a time asks for the next weights. */
#define WEIGHT_PREFETCH_BYTES 2048

static inline __attribute__((always_inline)) void prefetch_weights(const void *address) {
    __builtin_prefetch(address, 0, 3);
}

/* How far ahead a kernel reading `wrows` weight rows of `row_bytes` side by side asks for weights. Reading one row,
 * the rows after it follow in memory, so WEIGHT_PREFETCH_BYTES ahead is right wherever it lands. Reading several,
 * an address past the end of a row lies in a row this pass is already reading: prefetch_ahead() moves it to the
 * row the next pass reads in its place, and a distance of at most one row keeps it within that row. */
static inline int64_t prefetch_distance(int64_t row_bytes, int wrows) {
    return wrows > 1 && row_bytes < WEIGHT_PREFETCH_BYTES ? row_bytes : WEIGHT_PREFETCH_BYTES;
}

/* The weights `distance` bytes ahead of byte `offset` of a row, in the stream a pass of `wrows` rows reads. */
static inline __attribute__((always_inline)) void prefetch_ahead(const char *row, int64_t offset, int64_t row_bytes,
                                                                 int64_t distance, int wrows) {
    const int64_t ahead = offset + distance;
    prefetch_weights(row + (ahead < row_bytes || wrows == 1 ? ahead : ahead + (wrows - 1) * row_bytes));
}

#endif
