# C-level interface of the native queues (implementation in _cqueues.pyx).
# Status codes of the three-way results; handles are >= 0.
from libc.stdint cimport int64_t, uint32_t, uint64_t

cdef enum:
    ST_SUCCESS = 0
    ST_EMPTY = -1
    ST_RETRY = -2
    ST_FULL = -3


# Record layout, states and kinds: generated from stealer/shared/_layout.py by setup.py.
include "_layout.pxi"


cdef class Region:
    cdef object obj                     # the exporter (mmap / bytearray), kept alive
    cdef unsigned char[::1] view        # buffer export pinning the mapping
    cdef char *base
    cdef Py_ssize_t size
    cdef inline void *at(self, Py_ssize_t off) noexcept nogil:
        return <void *>(self.base + off)
    cdef inline int _check(self, Py_ssize_t off, Py_ssize_t width) except -1
    cdef int c_hist_record(self, Py_ssize_t off, uint64_t v) except -1


cdef class Deque:
    cdef Region region
    cdef char *top_p         # int64 top: written by thieves (CAS) and owner (CAS on last item)
    cdef char *bottom_p      # int64 bottom: written by owner only, read by thieves
    cdef char *ring          # capacity x uint64 handles
    cdef char *lease         # u64 handle+1 being taken (set_lease; NULL: off): this process writes, a recoverer reads after its death
    cdef int64_t mask
    cdef readonly Py_ssize_t capacity
    cdef readonly Py_ssize_t offset
    cdef int c_push(self, uint64_t h) noexcept nogil
    cdef int c_pop(self, uint64_t *out) noexcept nogil
    cdef int c_steal(self, uint64_t *out) noexcept nogil
    cdef int c_steal_half(self, Deque dest, int cap, uint64_t *out) noexcept nogil


cdef class _Ring:
    # Shared by both rings: the two position words on their own cache lines.
    cdef Region region
    cdef char *prod_p        # uint64 producer position (MPMC: enqueue pos, claimed by CAS; SPSC: tail)
    cdef char *cons_p        # uint64 consumer position (MPMC: dequeue pos, claimed by CAS; SPSC: head)
    cdef char *cells
    cdef char *lease         # MPMC pops: u64 value+1 being taken, as Deque.lease
    cdef char *intent        # MPMC: 3 x u64 {ring tag | op, position, a push's value} this process is about to claim (set_intent; NULL: off): this process writes, the client's ring repair reads after its death
    cdef char *took          # MPMC pops of the free-record ring: u64 handle+1 of the record just claimed (set_take; NULL: off): this process writes (relaxed) after its claim's CAS, the client reads after its death (records.py, W_ALLOC)
    cdef char *took_rec      # the records (their gen|state words, RECORD_BYTES apart) whose indices this ring holds (set_take)
    cdef uint64_t took_n     # how many records: a value >= it is not a record (a corrupt cell: not named)
    cdef uint64_t tag        # this ring's offset << 2 (the op is OR-ed in)
    cdef uint64_t mask
    cdef readonly Py_ssize_t capacity
    cdef readonly Py_ssize_t offset
    cdef int _setup(self, Region region, Py_ssize_t offset, Py_ssize_t capacity,
                    Py_ssize_t cell_bytes, bint producer_first) except -1
    cdef int c_push(self, uint64_t v) noexcept nogil
    cdef int c_pop(self, uint64_t *out) noexcept nogil


cdef class MPMCRing(_Ring):
    pass        # cells: capacity x {uint64 seq, uint64 value}


cdef class SPSCRing(_Ring):
    # cells: capacity x uint64
    cdef int c_peek(self, uint64_t *out) noexcept nogil


cdef class Entry:
    # A worker's agent entry (stealer/worker/agents/entry.py's _Entry, whose base this is
    # where the extension is built): the fields a turn reads and writes, at fixed offsets,
    # so Turns and HotPath.c_serve reach them without an attribute lookup.  Python code
    # reaches them through member descriptors (ENTRY_FIELDS, installed at import), as it
    # reaches a __slots__ class's; the counters, times and states are 64-bit ints (a turn
    # adds to them without making int objects), the rest objects.  Owned by the worker's
    # main thread only (not shared memory).
    cdef public object applied
    cdef public object arrived
    cdef public object blocked
    cdef public int64_t ckpt_ns
    cdef public int64_t ckpt_time
    cdef public object cls
    cdef public int64_t cpu_ns
    cdef public object ctx
    cdef public object cur
    cdef public object deadline
    cdef public object deadline_ns
    cdef public int64_t events
    cdef public object frame
    cdef public object gen
    cdef public object h
    cdef public int64_t handled
    cdef public object it
    cdef public object it_msg
    cdef public object jacked
    cdef public object jreplies
    cdef public object jseen
    cdef public object jsent
    cdef public object jspawned
    cdef public object last_ckpt
    cdef public object link
    cdef public int64_t msgs
    cdef public object obj
    cdef public object opts
    cdef public object outbox
    cdef public object pending
    cdef public object pinned
    cdef public object queued
    cdef public object rcache
    cdef public int64_t ready_at
    cdef public object replay
    cdef public object restarts
    cdef public object seen
    cdef public object spawn_args
    cdef public int64_t state
    cdef public int64_t steps
    cdef public object stop
    cdef public int64_t tier
    cdef public int64_t turn_ns
    cdef public object uid
    cdef public object ver
    cdef public object waiting
    cdef public object wake_at
    cdef public object want_step
    cdef public int64_t win_cpu
    cdef public int64_t win_start


cdef class HotPath:
    cdef Region region
    cdef char *rec_base      # records: 128 bytes each, fields in stealer/shared/arena.py
    cdef MPMCRing free_ring  # free record indices
    cdef MPMCRing injector   # client submissions
    cdef uint64_t nrecords
    cdef Py_ssize_t client_park_off
    # Idle accounting (stealer/shared/idle.py), for the native notify after a submit.
    cdef Py_ssize_t searching_off   # u64[nwords] set of searching workers (bit k % 64 of word k // 64)
    cdef Py_ssize_t parked_off      # u64[nwords] set of parked workers
    cdef int nwords                 # (nworkers + 63) // 64
    cdef Py_ssize_t park_base       # worker 0's park word; worker k's is park_base + k * park_stride
    cdef Py_ssize_t park_stride
    cdef int nworkers
    # A completion published while the result thread parked in throughput mode
    # (PARKED_BATCH) is not announced: this worker wakes it before it idles
    # (Worker.search -> Idle.flush_client) and the thread polls every BATCH_POLL anyway.
    # Process-local (this worker's HotPath), read and cleared by the worker loop.
    cdef public bint owed
    cdef int next_rr                # where the next notify starts scanning (this process only)
    # Agents' client fast path (set_agents): the directory's offset (-1: not set) and the
    # workers' inboxes (MPMCRing each), where a message's notification goes.
    cdef Py_ssize_t dir_off
    cdef list inboxes
    cdef char *rec(self, uint64_t h) noexcept nogil
    cdef int c_notify_one(self) noexcept nogil
    cdef inline char *_park_word(self, int k) noexcept nogil
    cdef inline char *_set_word(self, Py_ssize_t set_off, int k) noexcept nogil
    cdef int _check_worker(self, int k) except -1
    cdef bint c_wake_parked(self, char *word) noexcept nogil
    cdef void c_flush_client(self) noexcept nogil
    cdef bint c_try_search(self, int k) noexcept nogil
    cdef void c_stop_search(self, int k, bint found_work) noexcept nogil
    cdef void c_free(self, uint64_t h) noexcept nogil
    cdef void _give_back(self, char *e) noexcept nogil
    cdef int _check_handle(self, uint64_t h) except -1
    cdef object c_read_inline(self, uint64_t h)
    cdef list c_take_chain(self, char *e, uint64_t seen, uint64_t *head_out)
    cdef tuple c_serve(self, Entry e, Py_ssize_t ent, SPSCRing completions, uint64_t who,
                       list counters, Py_ssize_t c_msgs, w, rq, inbox, int64_t start_ns,
                       int64_t slice_ns, int batch, dumps)
    cdef int64_t c_fresh(self, uint32_t kind, uint64_t link, const char *data,
                         Py_ssize_t n, uint32_t retries) noexcept nogil
    cdef int64_t c_submit_inline(self, uint32_t kind, uint64_t link, const char *data,
                                 Py_ssize_t n, uint32_t retries) noexcept nogil
    cdef object c_take(self, uint64_t h, uint32_t *kind, uint32_t *status, uint64_t *link)
    cdef object c_small_result(self, uint64_t h, uint64_t *link)
    cdef object c_start(self, uint64_t h, Py_ssize_t current_off, uint64_t t_start,
                        Py_ssize_t wait_hist_off, uint64_t who, bint *started,
                        uint32_t *kind, uint64_t *link)
    cdef int c_finish(self, uint64_t h, uint32_t status, const char *data, Py_ssize_t n,
                      SPSCRing completions, uint64_t who) except -2
