# cython: language_level=3
"""Native hot path: lock-free queues on a shared-memory segment.

Everything here operates on integer words at byte offsets inside one
writable buffer (an mmap of a /dev/shm file shared by the client and all
workers).  No pointers or Python objects live in shared memory.

Structures (each starts on a 64-byte cache line):

* ``Deque``   Chase-Lev work-stealing deque of uint64 handles, with the
  memory orderings of Lê, Pop, Cohen, Nardelli, "Correct and Efficient
  Work-Stealing for Weak Memory Models" (PPoPP 2013).  The owner pushes and
  pops at the bottom; thieves steal at the top.  Fixed capacity (no growth:
  the owner sees FULL and overflows to the injector).
* ``MPMCRing`` Vyukov's bounded multi-producer multi-consumer ring (one
  sequence word per cell).  Used for the injector, per-worker inboxes and
  the free lists of the arena.
* ``SPSCRing`` single-producer single-consumer ring (worker -> client
  completions).

Results are values, not exceptions: a handle (>= 0) or EMPTY (-1) / RETRY
(-2); pushes return False when full.  ``_pyqueues.py`` is the pure-Python
reference of the same layout and semantics; one test suite runs on both.
"""

from libc.stdint cimport int64_t, uint32_t, uint64_t

from atomics cimport *

EMPTY = ST_EMPTY
RETRY = ST_RETRY
NATIVE = True

DEF LINE = 64


cdef inline Py_ssize_t _round_line(Py_ssize_t n):
    return (n + LINE - 1) & ~(LINE - 1)


cdef class Region:
    """Atomic word access at byte offsets of a shared writable buffer."""

    def __cinit__(self, obj, lock=None):
        # ``lock`` is accepted for signature parity with the pure-Python
        # reference, which needs one; native atomics do not.
        self.obj = obj
        self.view = obj
        self.size = self.view.shape[0]
        self.base = <char *>&self.view[0] if self.size > 0 else NULL

    @property
    def nbytes(self):
        return self.size

    cdef inline int _check(self, Py_ssize_t off, Py_ssize_t width) except -1:
        if off < 0 or off + width > self.size or (off & (width - 1)) != 0:
            raise IndexError(f"bad {width}-byte word offset {off} in region of {self.size} bytes")
        return 0

    def load32(self, Py_ssize_t off):
        self._check(off, 4)
        return st_load_acquire_u32(self.at(off))       # pairs with store32/cas32/add32 (release or seq_cst)

    def store32(self, Py_ssize_t off, uint32_t v):
        self._check(off, 4)
        st_store_seqcst_u32(self.at(off), v)           # seq_cst: Dekker-style park/notify handshakes

    def cas32(self, Py_ssize_t off, uint32_t expected, uint32_t desired):
        self._check(off, 4)
        # seq_cst: park-word handshakes (worker stores PARKED / notifier CASes it) and flags
        return bool(st_cas_seqcst_u32(self.at(off), expected, desired))

    def add32(self, Py_ssize_t off, int64_t delta):
        """Atomic add (seq_cst); returns the old value."""
        self._check(off, 4)
        # seq_cst RMW: searching/parked counts, read by notifiers after their seq_cst fence
        return st_fetch_add_seqcst_u32(self.at(off), <uint32_t>delta)

    def exchange32(self, Py_ssize_t off, uint32_t v):
        self._check(off, 4)
        return st_exchange_seqcst_u32(self.at(off), v)  # seq_cst: the client resetting a dead worker's flags

    def load64(self, Py_ssize_t off):
        self._check(off, 8)
        return st_load_acquire_u64(self.at(off))       # pairs with store64 (release) / add64 (acq_rel)

    def store64(self, Py_ssize_t off, uint64_t v):
        self._check(off, 8)
        st_store_release_u64(self.at(off), v)          # pairs with load64 (acquire)

    def cas64(self, Py_ssize_t off, uint64_t expected, uint64_t desired):
        self._check(off, 8)
        # seq_cst: a record's gen|state word (client cancel vs worker start, both via this CAS)
        return bool(st_cas_seqcst_u64(self.at(off), expected, desired))

    def add64(self, Py_ssize_t off, int64_t delta):
        """Atomic add (acq_rel); returns the old value as a signed 64-bit integer."""
        self._check(off, 8)
        # acq_rel: join counters (a child's release of its result pairs with the resumer's
        # acquire on the final decrement) and the overflow-file counter
        return <int64_t>st_fetch_add_acqrel_u64(self.at(off), <uint64_t>delta)

    def fence(self):
        st_fence_seqcst()

    def idle_check(self, Py_ssize_t searching_off, Py_ssize_t parked_off):
        """After publishing work: True if nobody searches and somebody is parked.

        The seq_cst fence orders the publication before both loads (the
        notifier's half of the park handshake in stealer/idle.py).
        """
        self._check(searching_off, 4)
        self._check(parked_off, 4)
        st_fence_seqcst()
        return (st_load_relaxed_u32(self.at(searching_off)) == 0
                and st_load_relaxed_u32(self.at(parked_off)) != 0)

    def futex_wait(self, Py_ssize_t off, uint32_t expected, timeout=None):
        """Sleep while the 32-bit word at ``off`` equals ``expected``.

        Releases the GIL.  Returns False on timeout, True otherwise (woken,
        value changed, or interrupted: callers always re-check their condition).
        """
        self._check(off, 4)
        cdef int64_t ns = -1 if timeout is None else <int64_t>(max(0.0, timeout) * 1e9)
        cdef void *p = self.at(off)
        cdef int rc
        with nogil:
            rc = st_futex_wait(p, expected, ns)
        if rc < 0:
            raise OSError(-rc, "futex wait failed")
        return rc == 0

    def futex_wake(self, Py_ssize_t off, int n=1):
        self._check(off, 4)
        return st_futex_wake(self.at(off), n)

    def hist_record(self, Py_ssize_t off, int64_t v):
        """Record ``v`` (ns, clamped at 0) in the histogram at ``off`` (single writer)."""
        self._check(off, 8)
        if off + 64 + 8 * ST_HIST_NBUCKETS > self.size:
            raise IndexError("histogram does not fit the region")
        st_hist_record(self.base + off, <uint64_t>(v if v > 0 else 0))

    @staticmethod
    def hist_bucket(uint64_t v):
        return st_hist_bucket(v)


cdef class Deque:
    """Chase-Lev deque of uint64 handles (Lê et al. 2013 orderings).

    Layout: [top: int64, own line][bottom: int64, own line][ring: capacity x uint64].
    Invariants: top <= bottom + 1 at all times; items live in [top, bottom);
    top only grows (thieves' CAS, or the owner's CAS on the last item);
    bottom is written by the owner only.  A slot ring[i & mask] is rewritten
    only after top > i, so a thief that read it before losing its CAS
    discards what it read.
    """

    @staticmethod
    def nbytes(Py_ssize_t capacity):
        return 2 * LINE + _round_line(8 * capacity)

    def __cinit__(self, Region region, Py_ssize_t offset, Py_ssize_t capacity):
        if capacity <= 0 or (capacity & (capacity - 1)) != 0:
            raise ValueError("deque capacity must be a power of two")
        if offset < 0 or offset % LINE or offset + Deque.nbytes(capacity) > region.size:
            raise ValueError("deque does not fit the region at that offset")
        self.region = region
        self.offset = offset
        self.capacity = capacity
        self.mask = capacity - 1
        self.top_p = region.base + offset
        self.bottom_p = region.base + offset + LINE
        self.ring = region.base + offset + 2 * LINE

    def init(self):
        """Reset to empty; only before any other process uses it."""
        st_store_release_u64(self.top_p, 0)     # creator only, before publication
        st_store_release_u64(self.bottom_p, 0)  # creator only, before publication

    cdef int c_push(self, uint64_t h) noexcept nogil:
        cdef int64_t b = <int64_t>st_load_relaxed_u64(self.bottom_p)   # owner's own word
        cdef int64_t t = <int64_t>st_load_acquire_u64(self.top_p)      # pairs with thieves' seq_cst CAS on top
        if b - t > self.mask:
            return ST_FULL
        st_store_relaxed_u64(self.ring + 8 * (b & self.mask), h)       # published by the release fence below
        st_fence_release()                                             # pairs with the thief's acquire load of bottom
        st_store_relaxed_u64(self.bottom_p, <uint64_t>(b + 1))         # owner only
        return ST_SUCCESS

    cdef int c_pop(self, uint64_t *out) noexcept nogil:
        cdef int64_t b = <int64_t>st_load_relaxed_u64(self.bottom_p) - 1
        st_store_relaxed_u64(self.bottom_p, <uint64_t>b)   # reserve the bottom item (owner only)
        st_fence_seqcst()                                  # pairs with the thief's seq_cst fence between top and bottom loads
        cdef int64_t t = <int64_t>st_load_relaxed_u64(self.top_p)
        cdef int rc = ST_SUCCESS
        if t <= b:
            out[0] = st_load_relaxed_u64(self.ring + 8 * (b & self.mask))
            if t == b:
                # Last item: race thieves for it with the same CAS they use.
                if not st_cas_seqcst_u64(self.top_p, <uint64_t>t, <uint64_t>(t + 1)):
                    rc = ST_EMPTY
                st_store_relaxed_u64(self.bottom_p, <uint64_t>(b + 1))
            return rc
        st_store_relaxed_u64(self.bottom_p, <uint64_t>(b + 1))  # was empty: undo the reservation
        return ST_EMPTY

    cdef int c_steal(self, uint64_t *out) noexcept nogil:
        cdef int64_t t = <int64_t>st_load_acquire_u64(self.top_p)     # pairs with other thieves' CAS
        st_fence_seqcst()                                            # pairs with the owner's seq_cst fence in pop
        cdef int64_t b = <int64_t>st_load_acquire_u64(self.bottom_p)  # pairs with the owner's release fence in push
        if t >= b:
            return ST_EMPTY
        cdef uint64_t h = st_load_relaxed_u64(self.ring + 8 * (t & self.mask))
        if not st_cas_seqcst_u64(self.top_p, <uint64_t>t, <uint64_t>(t + 1)):
            return ST_RETRY                                          # lost to the owner or another thief
        out[0] = h
        return ST_SUCCESS

    cdef int c_steal_half(self, Deque dest, int cap, uint64_t *out) noexcept nogil:
        # Steal up to half (at most ``cap``) from the top, one CAS per item
        # (a single CAS for the batch would race the owner's CAS-free pops,
        # as crossbeam-deque notes for LIFO deques).  The first item goes
        # to ``out``; the rest are pushed into ``dest``, the thief's own
        # deque.  Only as many as ``dest`` has room for are taken: the
        # caller owns ``dest``, so its free space can only grow meanwhile,
        # and no stolen item is ever left without a home.
        cdef uint64_t h
        cdef int rc = self.c_steal(out)
        if rc != ST_SUCCESS:
            return rc
        cdef int64_t t = <int64_t>st_load_acquire_u64(self.top_p)
        cdef int64_t b = <int64_t>st_load_acquire_u64(self.bottom_p)
        cdef int64_t want = (b - t) // 2
        if want > cap - 1:
            want = cap - 1
        cdef int64_t room = dest.mask + 1 - (<int64_t>st_load_relaxed_u64(dest.bottom_p)
                                             - <int64_t>st_load_acquire_u64(dest.top_p))
        if want > room:
            want = room
        cdef int64_t i = 0
        while i < want:
            if self.c_steal(&h) != ST_SUCCESS:
                break
            dest.c_push(h)          # cannot be FULL: room was checked above
            i += 1
        return ST_SUCCESS

    def push(self, uint64_t h):
        """Owner only. False when full."""
        return self.c_push(h) == ST_SUCCESS

    def pop(self):
        """Owner only. A handle, or EMPTY."""
        cdef uint64_t h = 0
        if self.c_pop(&h) == ST_SUCCESS:
            return h
        return ST_EMPTY

    def steal(self):
        """Any process. A handle, EMPTY, or RETRY (lost a race: try again)."""
        cdef uint64_t h = 0
        cdef int rc = self.c_steal(&h)
        return h if rc == ST_SUCCESS else rc

    def steal_half(self, Deque dest, int cap=32):
        """Steal about half (at most ``cap``) into ``dest``; returns the first item, EMPTY or RETRY.

        ``dest`` must be the caller's own deque (it is pushed to as its owner).
        """
        cdef uint64_t h = 0
        if dest is self:
            raise ValueError("cannot steal from the deque being filled")
        if cap < 1:
            cap = 1
        cdef int rc = self.c_steal_half(dest, cap, &h)
        return h if rc == ST_SUCCESS else rc

    def __len__(self):
        cdef int64_t b = <int64_t>st_load_acquire_u64(self.bottom_p)
        cdef int64_t t = <int64_t>st_load_acquire_u64(self.top_p)
        return <Py_ssize_t>(b - t) if b > t else 0


cdef class _Ring:
    """What the two rings share: layout checks, the Python API, length."""

    cdef int _setup(self, Region region, Py_ssize_t offset, Py_ssize_t capacity,
                    Py_ssize_t cell_bytes, bint producer_first) except -1:
        if capacity <= 1 or (capacity & (capacity - 1)) != 0:
            raise ValueError("ring capacity must be a power of two >= 2")
        if offset < 0 or offset % LINE or offset + 2 * LINE + _round_line(cell_bytes * capacity) > region.size:
            raise ValueError("ring does not fit the region at that offset")
        self.region = region
        self.offset = offset
        self.capacity = capacity
        self.mask = capacity - 1
        self.prod_p = region.base + offset + (0 if producer_first else LINE)
        self.cons_p = region.base + offset + (LINE if producer_first else 0)
        self.cells = region.base + offset + 2 * LINE
        return 0

    cdef int c_push(self, uint64_t v) noexcept nogil:
        return ST_FULL

    cdef int c_pop(self, uint64_t *out) noexcept nogil:
        return ST_EMPTY

    def push(self, uint64_t v):
        """False when full (MPMC: any process; SPSC: the producer only)."""
        return self.c_push(v) == ST_SUCCESS

    def pop(self):
        """A value, or EMPTY (MPMC: any process; SPSC: the consumer only)."""
        cdef uint64_t v = 0
        if self.c_pop(&v) == ST_SUCCESS:
            return v
        return ST_EMPTY

    def pop_many(self, Py_ssize_t n):
        """Pop up to ``n`` values; returns a list (empty when the ring is empty)."""
        cdef uint64_t v = 0
        out = []
        while n > 0 and self.c_pop(&v) == ST_SUCCESS:
            out.append(v)
            n -= 1
        return out

    def __len__(self):
        cdef uint64_t c = st_load_acquire_u64(self.cons_p)  # approximate: the two loads race
        cdef uint64_t p = st_load_acquire_u64(self.prod_p)
        return <Py_ssize_t>(p - c) if p > c else 0


cdef class MPMCRing(_Ring):
    """Vyukov bounded MPMC queue of uint64 values.

    Layout: [enqueue pos, own line][dequeue pos, own line][cells: {seq, value} x capacity].
    Cell i is free for the producer at position p when seq == p, full for
    the consumer at position p when seq == p + 1; the consumer then sets
    seq = p + capacity, freeing it for the next lap.
    """

    @staticmethod
    def nbytes(Py_ssize_t capacity):
        return 2 * LINE + _round_line(16 * capacity)

    def __cinit__(self, Region region, Py_ssize_t offset, Py_ssize_t capacity):
        self._setup(region, offset, capacity, 16, True)

    def init(self):
        """Reset to empty; only before any other process uses it."""
        cdef Py_ssize_t i
        for i in range(self.capacity):
            st_store_relaxed_u64(self.cells + 16 * i, <uint64_t>i)   # creator only
        st_store_release_u64(self.prod_p, 0)   # creator only; publication via process start
        st_store_release_u64(self.cons_p, 0)

    cdef int c_push(self, uint64_t v) noexcept nogil:
        cdef uint64_t pos = st_load_relaxed_u64(self.prod_p)
        cdef char *cell
        cdef uint64_t seq
        cdef int64_t dif
        while True:
            cell = self.cells + 16 * (pos & self.mask)
            seq = st_load_acquire_u64(cell)          # pairs with the consumer's release store of seq
            dif = <int64_t>(seq - pos)
            if dif == 0:
                if st_cas_weak_relaxed_u64(self.prod_p, pos, pos + 1):   # claim position; ordering via seq
                    break
                pos = st_load_relaxed_u64(self.prod_p)
            elif dif < 0:
                return ST_FULL
            else:
                pos = st_load_relaxed_u64(self.prod_p)
        st_store_relaxed_u64(cell + 8, v)            # published by the release store of seq below
        st_store_release_u64(cell, pos + 1)          # pairs with the consumer's acquire load of seq
        return ST_SUCCESS

    cdef int c_pop(self, uint64_t *out) noexcept nogil:
        cdef uint64_t pos = st_load_relaxed_u64(self.cons_p)
        cdef char *cell
        cdef uint64_t seq
        cdef int64_t dif
        while True:
            cell = self.cells + 16 * (pos & self.mask)
            seq = st_load_acquire_u64(cell)          # pairs with the producer's release store of seq
            dif = <int64_t>(seq - (pos + 1))
            if dif == 0:
                if st_cas_weak_relaxed_u64(self.cons_p, pos, pos + 1):   # claim position; ordering via seq
                    break
                pos = st_load_relaxed_u64(self.cons_p)
            elif dif < 0:
                return ST_EMPTY
            else:
                pos = st_load_relaxed_u64(self.cons_p)
        out[0] = st_load_relaxed_u64(cell + 8)
        st_store_release_u64(cell, pos + self.mask + 1)  # pairs with the next producer's acquire load
        return ST_SUCCESS


cdef class SPSCRing(_Ring):
    """Single-producer single-consumer ring of uint64 values.

    Layout: [head (consumer), own line][tail (producer), own line][cells x capacity].
    """

    @staticmethod
    def nbytes(Py_ssize_t capacity):
        return 2 * LINE + _round_line(8 * capacity)

    def __cinit__(self, Region region, Py_ssize_t offset, Py_ssize_t capacity):
        self._setup(region, offset, capacity, 8, False)

    def init(self):
        st_store_release_u64(self.cons_p, 0)   # creator only, before publication
        st_store_release_u64(self.prod_p, 0)

    cdef int c_push(self, uint64_t v) noexcept nogil:
        cdef uint64_t t = st_load_relaxed_u64(self.prod_p)      # producer's own word
        cdef uint64_t h = st_load_acquire_u64(self.cons_p)      # pairs with the consumer's release of head
        if t - h > self.mask:
            return ST_FULL
        st_store_relaxed_u64(self.cells + 8 * (t & self.mask), v)
        st_store_release_u64(self.prod_p, t + 1)                # pairs with the consumer's acquire of tail
        return ST_SUCCESS

    cdef int c_pop(self, uint64_t *out) noexcept nogil:
        cdef uint64_t h = st_load_relaxed_u64(self.cons_p)      # consumer's own word
        cdef uint64_t t = st_load_acquire_u64(self.prod_p)      # pairs with the producer's release of tail
        if h == t:
            return ST_EMPTY
        out[0] = st_load_relaxed_u64(self.cells + 8 * (h & self.mask))
        st_store_release_u64(self.cons_p, h + 1)                # pairs with the producer's acquire of head
        return ST_SUCCESS


# Record layout constants (R_*, S_*, K_*, INLINE...) are in _cqueues.pxd.

from libc.string cimport memcpy, memset
from posix.time cimport CLOCK_MONOTONIC, clock_gettime, timespec
from cpython.bytes cimport PyBytes_FromStringAndSize


cdef inline int _check_index(uint64_t idx, uint64_t nrecords) except -1:
    # Handles and free-ring cells come from shared memory: check before touching a record.
    if idx >= nrecords:
        raise IndexError(f"bad task handle: record index {idx} >= {nrecords} records "
                         "(a corrupt queue cell or handle)")
    return 0


cdef inline int _check_inline(uint64_t n) except -1:
    # R_PLEN comes from shared memory: check before copying out of the record.
    if n > INLINE:
        raise ValueError(f"corrupt task record: inline payload length {n} > {INLINE} bytes "
                         "(the shared memory was overwritten)")
    return 0


cdef class HotPath:
    """The per-task record operations, one native call each (see stealer/arena.py).

    ``stealer.arena.Arena`` holds the pure-Python reference of every method
    here; it delegates to this class when the extension is loaded.  Only
    payloads that fit inline in the record take this path; larger ones and
    out-of-band buffers go through the Python arena.
    """

    def __cinit__(self, Region region, Py_ssize_t rec_base, uint64_t nrecords,
                  MPMCRing free_ring, MPMCRing injector, Py_ssize_t client_park_off,
                  Py_ssize_t searching_off=-1, Py_ssize_t parked_off=-1,
                  Py_ssize_t park_base=-1, Py_ssize_t park_stride=0, int nworkers=0):
        if rec_base < 0 or rec_base % 64 or rec_base + <Py_ssize_t>(nrecords * RECORD_BYTES) > region.size:
            raise ValueError("records do not fit the region")
        if nworkers > 0:
            region._check(searching_off, 4)
            region._check(parked_off, 4)
            region._check(park_base, 4)
            region._check(park_base + park_stride * (nworkers - 1), 4)
        self.searching_off = searching_off
        self.parked_off = parked_off
        self.park_base = park_base
        self.park_stride = park_stride
        self.nworkers = nworkers
        self.next_rr = 0
        self.region = region
        self.rec_base = region.base + rec_base
        self.nrecords = nrecords
        self.free_ring = free_ring
        self.injector = injector
        self.client_park_off = client_park_off

    cdef char *rec(self, uint64_t h) noexcept nogil:
        return self.rec_base + RECORD_BYTES * (h & 0xFFFFFFFFU)

    cdef void c_free(self, uint64_t h) noexcept nogil:
        cdef char *r = self.rec(h)
        cdef uint64_t gen = (st_load_relaxed_u64(r) + 1) & 0x7FFFFFFF
        (<uint32_t *>(r + R_PCLASS))[0] = 0
        (<uint64_t *>(r + R_PLEN))[0] = 0
        st_store_release_u64(r, gen | (<uint64_t>S_FREE << 32))  # stale handles now fail their CAS
        self.free_ring.c_push(h & 0xFFFFFFFFU)                     # release: next owner sees the new gen

    def free(self, uint64_t h):
        _check_index(h & 0xFFFFFFFFU, self.nrecords)
        self.c_free(h)

    cdef int c_notify_one(self) noexcept nogil:
        # The notifier's half of the park handshake (stealer/idle.py, Idle.notify_one).
        if self.nworkers <= 0:
            return -1
        cdef char *base = self.region.base
        st_fence_seqcst()          # seq_cst: the work just published before the loads below
        if (st_load_relaxed_u32(base + self.searching_off) != 0
                or st_load_relaxed_u32(base + self.parked_off) == 0):
            return -1              # a searcher will find it, or nobody sleeps
        cdef int i, k
        cdef char *w
        for i in range(self.nworkers):
            k = (self.next_rr + i) % self.nworkers
            w = base + self.park_base + self.park_stride * k
            if st_cas_seqcst_u32(w, PARKED, NOTIFIED):   # pairs with the worker's store of PARKED
                self.next_rr = k + 1
                st_futex_wake(w, 1)
                return k
        return -1

    def notify_one(self):
        """Wake one parked worker if nobody searches; the worker index woken, or -1."""
        return self.c_notify_one()

    def submit_inline(self, uint32_t kind, uint64_t link, const unsigned char[::1] data):
        """Client: take a record, fill it with an inline payload, push it on the injector,
        and wake a parked worker if nobody searches.

        The submit time is CLOCK_MONOTONIC (time.monotonic_ns()).  Returns the
        handle, or -1 when no record is free.  ``len(data)`` must be <= INLINE.
        """
        cdef timespec ts
        clock_gettime(CLOCK_MONOTONIC, &ts)
        cdef uint64_t t_submit = <uint64_t>ts.tv_sec * 1000000000ULL + <uint64_t>ts.tv_nsec
        cdef Py_ssize_t n = data.shape[0]
        if n > INLINE:
            raise ValueError("payload too large for the inline path")
        cdef uint64_t idx
        if self.free_ring.c_pop(&idx) != ST_SUCCESS:
            return -1
        _check_index(idx, self.nrecords)
        cdef char *r = self.rec_base + RECORD_BYTES * idx
        cdef uint64_t gen = st_load_relaxed_u64(r) & 0xFFFFFFFFU
        memset(r + 8, 0, R_INLINE - 8)
        (<uint32_t *>(r + R_KIND))[0] = kind
        (<uint64_t *>(r + R_LINK))[0] = link
        (<uint64_t *>(r + R_PLEN))[0] = <uint64_t>n
        (<uint64_t *>(r + R_TSUBMIT))[0] = t_submit
        if n:
            memcpy(r + R_INLINE, &data[0], n)
        st_store_relaxed_u64(r, gen | (<uint64_t>S_QUEUED << 32))  # published by the push below
        cdef uint64_t h = (gen << 32) | idx
        self.injector.c_push(h)     # release (cell seq): the worker's pop acquires the record
        self.c_notify_one()
        return h

    def start(self, uint64_t h, Py_ssize_t current_off, uint64_t t_start,
              Py_ssize_t wait_hist_off=-1):
        """Worker: claim a queued record. None if the client cancelled it (the caller frees it).

        Otherwise sets the worker's current-task word, the join token and the
        start time, records the queue wait (start - submit) in the histogram
        at ``wait_hist_off`` (if >= 0), and returns (kind, link, inline
        payload bytes or None).
        """
        self.region._check(current_off, 8)
        _check_index(h & 0xFFFFFFFFU, self.nrecords)
        cdef char *r = self.rec(h)
        cdef uint64_t gen = h >> 32
        # seq_cst CAS, pairs with the client's cancel CAS on the same word (gen-checked).
        if not st_cas_seqcst_u64(r, gen | (<uint64_t>S_QUEUED << 32), gen | (<uint64_t>S_RUNNING << 32)):
            return None
        st_store_release_u64(self.region.base + current_off, h + 1)  # read by the client after a death
        (<int64_t *>(r + R_PENDING))[0] = 1
        (<uint64_t *>(r + R_TSTART))[0] = t_start
        cdef uint64_t t_submit = (<uint64_t *>(r + R_TSUBMIT))[0]
        if wait_hist_off >= 0 and wait_hist_off + 64 + 8 * ST_HIST_NBUCKETS <= self.region.size:
            st_hist_record(self.region.base + wait_hist_off,
                           t_start - t_submit if t_start > t_submit else 0)
        cdef uint32_t kind = (<uint32_t *>(r + R_KIND))[0]
        cdef uint64_t link = (<uint64_t *>(r + R_LINK))[0]
        cdef uint64_t n
        if (<uint32_t *>(r + R_PCLASS))[0] == 0:
            n = (<uint64_t *>(r + R_PLEN))[0]
            _check_inline(n)
            (<uint64_t *>(r + R_PLEN))[0] = 0
            return kind, link, PyBytes_FromStringAndSize(r + R_INLINE, <Py_ssize_t>n)
        return kind, link, None

    def finish_inline(self, uint64_t h, uint32_t status, const unsigned char[::1] data,
                      SPSCRing completions):
        """Worker: store a small result; for a root task also push the completion.

        Returns 0 if ``data`` is too large (use the Python path), 1 when a root
        task was completed (client woken if parked), 2 for a child (the caller
        counts it off its parent).
        """
        cdef Py_ssize_t n = data.shape[0]
        if n > INLINE:
            return 0
        _check_index(h & 0xFFFFFFFFU, self.nrecords)
        cdef char *r = self.rec(h)
        if n:
            memcpy(r + R_INLINE, &data[0], n)
        (<uint32_t *>(r + R_PCLASS))[0] = 0
        (<uint64_t *>(r + R_PLEN))[0] = <uint64_t>n
        cdef uint32_t kind = (<uint32_t *>(r + R_KIND))[0] & ~(<uint32_t>F_BUFFERS)
        (<uint32_t *>(r + R_KIND))[0] = kind
        (<uint32_t *>(r + R_STATUS))[0] = status
        if (kind & K_MASK) != K_ROOT:
            return 2
        while completions.c_push(h) != ST_SUCCESS:   # release: the client's pop acquires the result
            pass                                       # capacity == records: cannot stay full
        st_fence_seqcst()                              # pairs with the client's park store + recheck
        cdef char *w = self.region.base + self.client_park_off
        if st_load_relaxed_u32(w) == PARKED and st_cas_seqcst_u32(w, PARKED, NOTIFIED):
            st_futex_wake(w, 1)
        return 1

    def complete_take(self, uint64_t h):
        """Client: (kind, status, link, inline payload or None) of a completed record.

        An inline payload is copied out and the record freed; otherwise the
        record stays for the Python path to read and free.
        """
        _check_index(h & 0xFFFFFFFFU, self.nrecords)
        cdef char *r = self.rec(h)
        cdef uint32_t kind = (<uint32_t *>(r + R_KIND))[0]
        cdef uint32_t status = (<uint32_t *>(r + R_STATUS))[0]
        cdef uint64_t link = (<uint64_t *>(r + R_LINK))[0]
        cdef object data = None
        cdef uint64_t n
        if (<uint32_t *>(r + R_PCLASS))[0] == 0:
            n = (<uint64_t *>(r + R_PLEN))[0]   # read once: check and copy the same value
            _check_inline(n)
            data = PyBytes_FromStringAndSize(r + R_INLINE, <Py_ssize_t>n)
            self.c_free(h)
        return kind, status, link, data
