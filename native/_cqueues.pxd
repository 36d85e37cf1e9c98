# C-level interface of the native queues (implementation in _cqueues.pyx).
# Status codes of the three-way results; handles are >= 0.
from libc.stdint cimport int64_t, uint32_t, uint64_t

cdef enum:
    ST_SUCCESS = 0
    ST_EMPTY = -1
    ST_RETRY = -2
    ST_FULL = -3


cdef class Region:
    cdef object obj                     # the exporter (mmap / bytearray), kept alive
    cdef unsigned char[::1] view        # buffer export pinning the mapping
    cdef char *base
    cdef Py_ssize_t size
    cdef inline void *at(self, Py_ssize_t off) noexcept nogil:
        return <void *>(self.base + off)
    cdef inline int _check(self, Py_ssize_t off, Py_ssize_t width) except -1


cdef class Deque:
    cdef Region region
    cdef char *top_p         # int64 top: written by thieves (CAS) and owner (CAS on last item)
    cdef char *bottom_p      # int64 bottom: written by owner only, read by thieves
    cdef char *ring          # capacity x uint64 handles
    cdef int64_t mask
    cdef readonly Py_ssize_t capacity
    cdef readonly Py_ssize_t offset
    cdef int c_push(self, uint64_t h) noexcept nogil
    cdef int c_pop(self, uint64_t *out) noexcept nogil
    cdef int c_steal(self, uint64_t *out) noexcept nogil
    cdef int c_steal_half(self, Deque dest, int cap, uint64_t *out) noexcept nogil


cdef class MPMCRing:
    cdef Region region
    cdef char *enq_p         # uint64 enqueue position: claimed by producers (CAS)
    cdef char *deq_p         # uint64 dequeue position: claimed by consumers (CAS)
    cdef char *cells         # capacity x {uint64 seq, uint64 value}
    cdef uint64_t mask
    cdef readonly Py_ssize_t capacity
    cdef readonly Py_ssize_t offset
    cdef int c_push(self, uint64_t v) noexcept nogil
    cdef int c_pop(self, uint64_t *out) noexcept nogil


cdef class SPSCRing:
    cdef Region region
    cdef char *head_p        # uint64 head: written by the single consumer
    cdef char *tail_p        # uint64 tail: written by the single producer
    cdef char *cells         # capacity x uint64
    cdef uint64_t mask
    cdef readonly Py_ssize_t capacity
    cdef readonly Py_ssize_t offset
    cdef int c_push(self, uint64_t v) noexcept nogil
    cdef int c_pop(self, uint64_t *out) noexcept nogil
