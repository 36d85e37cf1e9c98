/* C11 atomics on words that live in a shared-memory segment.
 *
 * Every function names its memory ordering.  The words are plain 32/64-bit
 * integers inside an mmap'd file shared by several processes; lock-free
 * C11 atomics on naturally aligned words are address-free, so they work
 * across processes (C11 7.17.5 note, and GCC/Clang on x86-64 and AArch64).
 * Callers guarantee 8-byte alignment of 64-bit words and 4-byte of 32-bit.
 */
#ifndef STEALER_ATOMICS_H
#define STEALER_ATOMICS_H

#include <stdatomic.h>
#include <stdint.h>

#define ST_A64(p) ((_Atomic uint64_t *)(p))
#define ST_A32(p) ((_Atomic uint32_t *)(p))

static inline uint64_t st_load_relaxed_u64(void *p) { return atomic_load_explicit(ST_A64(p), memory_order_relaxed); }
static inline uint64_t st_load_acquire_u64(void *p) { return atomic_load_explicit(ST_A64(p), memory_order_acquire); }
static inline uint64_t st_load_seqcst_u64(void *p) { return atomic_load_explicit(ST_A64(p), memory_order_seq_cst); }
static inline void st_store_relaxed_u64(void *p, uint64_t v) { atomic_store_explicit(ST_A64(p), v, memory_order_relaxed); }
static inline void st_store_release_u64(void *p, uint64_t v) { atomic_store_explicit(ST_A64(p), v, memory_order_release); }
static inline void st_store_seqcst_u64(void *p, uint64_t v) { atomic_store_explicit(ST_A64(p), v, memory_order_seq_cst); }
static inline uint64_t st_fetch_add_acqrel_u64(void *p, uint64_t v) { return atomic_fetch_add_explicit(ST_A64(p), v, memory_order_acq_rel); }
static inline uint64_t st_fetch_add_seqcst_u64(void *p, uint64_t v) { return atomic_fetch_add_explicit(ST_A64(p), v, memory_order_seq_cst); }
/* Strong CAS, seq_cst on success, relaxed on failure (the Chase-Lev steal/pop CAS). */
static inline int st_cas_seqcst_u64(void *p, uint64_t expected, uint64_t desired) {
    return atomic_compare_exchange_strong_explicit(ST_A64(p), &expected, desired,
                                                   memory_order_seq_cst, memory_order_relaxed);
}
/* Weak CAS, relaxed both ways (the Vyukov ring position claim; the cell sequence carries ordering). */
static inline int st_cas_weak_relaxed_u64(void *p, uint64_t expected, uint64_t desired) {
    return atomic_compare_exchange_weak_explicit(ST_A64(p), &expected, desired,
                                                 memory_order_relaxed, memory_order_relaxed);
}

static inline uint32_t st_load_relaxed_u32(void *p) { return atomic_load_explicit(ST_A32(p), memory_order_relaxed); }
static inline uint32_t st_load_acquire_u32(void *p) { return atomic_load_explicit(ST_A32(p), memory_order_acquire); }
static inline uint32_t st_load_seqcst_u32(void *p) { return atomic_load_explicit(ST_A32(p), memory_order_seq_cst); }
static inline void st_store_release_u32(void *p, uint32_t v) { atomic_store_explicit(ST_A32(p), v, memory_order_release); }
static inline void st_store_seqcst_u32(void *p, uint32_t v) { atomic_store_explicit(ST_A32(p), v, memory_order_seq_cst); }
static inline uint32_t st_fetch_add_seqcst_u32(void *p, uint32_t v) { return atomic_fetch_add_explicit(ST_A32(p), v, memory_order_seq_cst); }
static inline uint32_t st_exchange_seqcst_u32(void *p, uint32_t v) { return atomic_exchange_explicit(ST_A32(p), v, memory_order_seq_cst); }
static inline int st_cas_seqcst_u32(void *p, uint32_t expected, uint32_t desired) {
    return atomic_compare_exchange_strong_explicit(ST_A32(p), &expected, desired,
                                                   memory_order_seq_cst, memory_order_relaxed);
}

static inline void st_fence_seqcst(void) { atomic_thread_fence(memory_order_seq_cst); }
static inline void st_fence_release(void) { atomic_thread_fence(memory_order_release); }
static inline void st_fence_acquire(void) { atomic_thread_fence(memory_order_acquire); }

#endif

/* Log-linear histogram bucket (mirrors stealer/metrics.py bucket_of):
 * values < 128 have their own bucket; above, 64 sub-buckets per power of two. */
#define ST_HIST_SUB_BITS 6
#define ST_HIST_NBUCKETS 2240
static inline int st_hist_bucket(uint64_t v) {
    if (v < (2u << ST_HIST_SUB_BITS)) return (int)v;
    int e = (63 - __builtin_clzll(v)) + 1 - (ST_HIST_SUB_BITS + 1);
    uint64_t idx = ((uint64_t)e << ST_HIST_SUB_BITS) + (v >> e);
    return idx < ST_HIST_NBUCKETS ? (int)idx : ST_HIST_NBUCKETS - 1;
}

/* Record v into the histogram at h: [count][sum][max][pad to 64][buckets].
 * Single writer (the worker owning it): relaxed load + relaxed store, no RMW;
 * readers (client snapshots) load relaxed and tolerate being a few events behind. */
static inline void st_hist_record(char *h, uint64_t v) {
    char *b = h + 64 + 8 * st_hist_bucket(v);
    st_store_relaxed_u64(b, st_load_relaxed_u64(b) + 1);
    st_store_relaxed_u64(h, st_load_relaxed_u64(h) + 1);
    st_store_relaxed_u64(h + 8, st_load_relaxed_u64(h + 8) + v);
    if (v > st_load_relaxed_u64(h + 16)) st_store_relaxed_u64(h + 16, v);
}
