/* Software prefetch for the few-rows matmul kernels, which stream their weights from memory once per step.
 *
 * With one row of x the loop issues loads fast enough for the hardware prefetcher to keep memory busy; with a few
 * rows (a speculative verification, a small batch) it spends more time per cache line on FMAs and the stream
 * stalls on memory latency. Asking for the weights a little ahead keeps them arriving: on a 2-core Intel Xeon
 * (AVX-512, weights of 224 MB fp32 / 63 MB int8), fp32 at 5 rows took 0.75x the time and int8 at 1 row 0.68x.
 * A prefetch never faults, so reading past a matrix's end is harmless.
 */
#ifndef KVYARD_PREFETCH_H
#define KVYARD_PREFETCH_H

/* How far ahead of its current read a kernel reading one weight row at a time asks for the next weights. */
#define WEIGHT_PREFETCH_BYTES 2048

static inline __attribute__((always_inline)) void prefetch_weights(const void *address) {
    __builtin_prefetch(address, 0, 3);
}

#endif
