# C declarations only (implementations in atomics.h / futex.h); see those headers.
from libc.stdint cimport int64_t, uint32_t, uint64_t


cdef extern from "atomics.h" nogil:
    uint64_t st_load_relaxed_u64(void *p)
    uint64_t st_load_acquire_u64(void *p)
    uint64_t st_load_seqcst_u64(void *p)
    void st_store_relaxed_u64(void *p, uint64_t v)
    void st_store_release_u64(void *p, uint64_t v)
    void st_store_seqcst_u64(void *p, uint64_t v)
    uint64_t st_fetch_add_acqrel_u64(void *p, uint64_t v)
    uint64_t st_fetch_add_seqcst_u64(void *p, uint64_t v)
    int st_cas_seqcst_u64(void *p, uint64_t expected, uint64_t desired)
    int st_cas_weak_relaxed_u64(void *p, uint64_t expected, uint64_t desired)
    uint32_t st_load_relaxed_u32(void *p)
    uint32_t st_load_acquire_u32(void *p)
    uint32_t st_load_seqcst_u32(void *p)
    void st_store_release_u32(void *p, uint32_t v)
    void st_store_seqcst_u32(void *p, uint32_t v)
    uint32_t st_fetch_add_seqcst_u32(void *p, uint32_t v)
    uint32_t st_exchange_seqcst_u32(void *p, uint32_t v)
    int st_cas_seqcst_u32(void *p, uint32_t expected, uint32_t desired)
    void st_fence_seqcst()
    void st_fence_release()
    void st_fence_acquire()


cdef extern from "futex.h" nogil:
    int st_futex_wait(void *addr, uint32_t expected, int64_t timeout_ns)
    int st_futex_wake(void *addr, int n)


cdef extern from "atomics.h" nogil:
    int st_hist_bucket(uint64_t v)
    int ST_HIST_NBUCKETS
    void st_hist_record(char *h, uint64_t v)
