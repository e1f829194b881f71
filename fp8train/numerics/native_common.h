/* What fp8train's native kernels (native_cast.c, native_gemm.c) share: their threads and torch's fp32 -> bf16
 * rounding. Included by both. */
#ifndef FP8TRAIN_NATIVE_COMMON_H
#define FP8TRAIN_NATIVE_COMMON_H

#ifdef _OPENMP
#include <omp.h>
#endif
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* ---- threads -------------------------------------------------------------------------------------------- */
/* fn(items + i * size) for i in 0..n-1, on n threads. With OpenMP these are the threads of the process's OpenMP
 * runtime, which is torch's own when torch uses GNU OpenMP (one libgomp.so.1 in the process): they spin-wait
 * between torch's ops, and threads of our own would compete with them for the cores (measured on 2 cores: a
 * quantize 40-60% slower right after a torch op). Without OpenMP, pthreads started here; a thread that cannot
 * be started has its share run by the caller (slower, never wrong). */
static inline void parallel_run(int32_t n, void *(*fn)(void *), void *items, size_t size) {
    char *base = (char *)items;
    if (n <= 1) { fn(base); return; }
#ifdef _OPENMP
#pragma omp parallel num_threads(n)
    for (int32_t i = omp_get_thread_num(); i < n; i += omp_get_num_threads()) fn(base + (size_t)i * size);
#else
    pthread_t threads[64];
    int started[64] = {0};
    for (int32_t i = 1; i < n; i++) started[i] = pthread_create(&threads[i], NULL, fn, base + (size_t)i * size) == 0;
    fn(base);
    for (int32_t i = 1; i < n; i++) {
        if (started[i]) pthread_join(threads[i], NULL);
        else fn(base + (size_t)i * size);
    }
#endif
}

/* threads worth starting for `numel` elements of work split in `units` */
static inline int32_t thread_count(int64_t numel, int64_t units, int32_t nthreads) {
    int64_t want = numel / (1 << 18); /* below ~256K elements a thread costs more than it saves */
    want = want < 1 ? 1 : want;
    want = want < nthreads ? want : nthreads;
    want = want < units ? want : units;
    want = want < 1 ? 1 : want > 64 ? 64 : want;
    return (int32_t)want;
}

/* ---- torch's fp32 -> bf16 rounding: to nearest even on the bits, every NaN 0xFFFF (branch-free: loops of it
 * vectorize) ----------------------------------------------------------------------------------------------- */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    const uint32_t mask = 0u - (uint32_t)((u & 0x7FFFFFFFu) > 0x7F800000u);
    return (uint16_t)((0xFFFFu & mask) | (rounded & ~mask));
}

#endif
