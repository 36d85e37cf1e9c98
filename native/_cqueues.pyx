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

from libc.stdint cimport INT64_MIN, int64_t, uint32_t, uint64_t

from atomics cimport *


# Worker-set helpers (stealer/shared/idle.py): one atomic RMW per transition of a worker's bit.
cdef extern from "<sched.h>":
    int sched_yield() nogil
    ctypedef struct cpu_set_t:
        pass
    int CPU_SETSIZE
    void CPU_ZERO(cpu_set_t *) nogil
    void CPU_SET(int, cpu_set_t *) nogil
    int sched_getcpu() nogil
    int sched_setaffinity(int, size_t, cpu_set_t *) nogil

cdef extern from *:
    """
    #include <stdatomic.h>
    #include <stdint.h>
    static inline uint64_t wset_fetch_or_seqcst(void *p, uint64_t v) {
        return atomic_fetch_or_explicit((_Atomic uint64_t *)p, v, memory_order_seq_cst);
    }
    static inline uint64_t wset_fetch_and_seqcst(void *p, uint64_t v) {
        return atomic_fetch_and_explicit((_Atomic uint64_t *)p, v, memory_order_seq_cst);
    }
    static inline int wset_popcount(uint64_t v) { return __builtin_popcountll(v); }
    static inline int wset_ctz(uint64_t v) { return __builtin_ctzll(v); }
    """
    uint64_t wset_fetch_or_seqcst(void *p, uint64_t v) nogil
    uint64_t wset_fetch_and_seqcst(void *p, uint64_t v) nogil
    int wset_popcount(uint64_t v) nogil
    int wset_ctz(uint64_t v) nogil

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

    def store_u64s(self, Py_ssize_t off, list values not None):
        """Store ``values`` (ints) as consecutive native u64 words from ``off`` (relaxed:
        a single writer's counters, Worker.flush; readers take each word as it is)."""
        cdef Py_ssize_t n = len(values), i
        if n == 0:
            return
        self._check(off, 8)
        self._check(off + 8 * (n - 1), 8)
        cdef uint64_t v
        for i in range(n):
            v = values[i]
            st_store_relaxed_u64(self.at(off + 8 * i), v)  # relaxed: read by stats()/top

    def fence(self):
        st_fence_seqcst()

    def or64(self, Py_ssize_t off, uint64_t bits):
        """Atomic fetch-or (seq_cst); returns the old value."""
        self._check(off, 8)
        # seq_cst RMW: a worker entering a set (stealer/shared/idle.py); its release half pairs with
        # the notifiers' acquire load of the parked set
        return wset_fetch_or_seqcst(self.at(off), bits)

    def and64(self, Py_ssize_t off, uint64_t bits):
        """Atomic fetch-and (seq_cst); returns the old value."""
        self._check(off, 8)
        # seq_cst RMW: a worker leaving a set, or the client clearing a dead worker's bit
        return wset_fetch_and_seqcst(self.at(off), bits)

    def count_bits(self, Py_ssize_t off, Py_ssize_t nwords):
        """Bits set in the ``nwords`` 64-bit words at ``off`` (a worker set's size)."""
        if nwords < 0:
            raise ValueError("nwords must be >= 0")
        if nwords:
            self._check(off, 8)
            self._check(off + 8 * (nwords - 1), 8)
        cdef Py_ssize_t j
        cdef int c = 0
        for j in range(nwords):
            # acquire: pairs with the or64/and64 RMWs of the set (a snapshot per word, not
            # across words: the set's size is advisory, used by the "half search" policy)
            c += wset_popcount(st_load_acquire_u64(self.at(off + 8 * j)))
        return c

    def idle_check(self, Py_ssize_t searching_off, Py_ssize_t parked_off, Py_ssize_t nwords=1):
        """After publishing work: True if nobody searches and somebody is parked.

        ``searching_off`` and ``parked_off`` are worker sets of ``nwords``
        64-bit words each (stealer/shared/idle.py).  The seq_cst fence orders the
        publication before the loads (the notifier's half of the park
        handshake; the worker's half is its RMW on the set, then a seq_cst
        fence, then its re-check of the queues).
        """
        if nwords < 1:
            raise ValueError("nwords must be >= 1")
        self._check(searching_off, 8)
        self._check(searching_off + 8 * (nwords - 1), 8)
        self._check(parked_off, 8)
        self._check(parked_off + 8 * (nwords - 1), 8)
        st_fence_seqcst()  # seq_cst: the work just published before the loads below
        cdef Py_ssize_t j
        for j in range(nwords):
            # relaxed after the fence: a searcher's bit (or64/and64, seq_cst) seen set means
            # that worker re-checks the queues after this publication (fence pairing above)
            if st_load_relaxed_u64(self.at(searching_off + 8 * j)) != 0:
                return False
        for j in range(nwords):
            # relaxed after the fence: the parker's or64 precedes its fence and queue re-check
            if st_load_relaxed_u64(self.at(parked_off + 8 * j)) != 0:
                return True
        return False

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
        self.c_hist_record(off, <uint64_t>(v if v > 0 else 0))

    cdef int c_hist_record(self, Py_ssize_t off, uint64_t v) except -1:
        self._check(off, 8)
        if off + 64 + 8 * ST_HIST_NBUCKETS > self.size:
            raise IndexError("histogram does not fit the region")
        st_hist_record(self.base + off, v)  # single writer (this worker); readers snapshot
        return 0

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
        self.lease = NULL

    def set_lease(self, Py_ssize_t off):
        """Record in the u64 word at ``off`` (handle + 1) every handle this process's pop or
        steal is about to take, *before* the CAS that takes it: a recoverer finds it there
        if the process dies holding it (stealer/shared/records.py).  -1 turns it off."""
        if off < 0:
            self.lease = NULL
            return
        self.region._check(off, 8)
        self.lease = self.region.base + off

    def repair(self):
        """Owner, before first use of a deque inherited from a dead owner: a pop killed
        between its bottom reservation and its undo can leave bottom < top; the item
        it was taking is in that owner's lease, so dropping it here loses nothing."""
        cdef int64_t t = <int64_t>st_load_acquire_u64(self.top_p)
        cdef int64_t b = <int64_t>st_load_relaxed_u64(self.bottom_p)
        if b < t:
            st_store_release_u64(self.bottom_p, <uint64_t>t)   # owner only; pairs with thieves' acquire
            return True
        return False

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
        if self.lease != NULL and b >= <int64_t>st_load_relaxed_u64(self.top_p):
            # lease before the reservation: relaxed is enough, a recoverer reads it only
            # after this process is dead (its stores are all visible by then)
            st_store_relaxed_u64(self.lease, st_load_relaxed_u64(self.ring + 8 * (b & self.mask)) + 1)
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
        if self.lease != NULL:
            st_store_relaxed_u64(self.lease, h + 1)  # lease before the CAS (read after our death)
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
        # and no stolen item is ever left without a home.  Leases: the
        # first item in the lease word, each further one in the next word
        # until it is in ``dest``.
        cdef uint64_t h
        cdef int rc = self.c_steal(out)
        if rc != ST_SUCCESS:
            return rc
        cdef char *lease0 = self.lease
        if lease0 != NULL:
            self.lease = lease0 + 8   # keep the first item's lease while moving the rest
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
        self.lease = lease0
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
        self.lease = NULL
        self.intent = NULL
        self.took = NULL
        self.took_rec = NULL
        self.took_n = 0
        self.tag = (<uint64_t>offset) << 2
        return 0

    def set_intent(self, Py_ssize_t off):
        """MPMC: record in the three u64 words at ``off`` ({ring offset << 2 | 1 push, 2 pop},
        position, a push's value) every position this process is about to claim, before the CAS that claims
        it, so the client can repair a cell left half-done by our death (stealer/client/ringfix.py).
        -1: off (the client, which never dies under its own repair)."""
        if off < 0:
            self.intent = NULL
            return
        self.region._check(off, 24)
        self.intent = self.region.base + off

    def set_lease(self, Py_ssize_t off):
        """MPMC: record in the u64 word at ``off`` (value + 1) every value this process's pop
        is about to take, before the CAS that takes it (see Deque.set_lease).  -1: off."""
        if off < 0:
            self.lease = NULL
            return
        self.region._check(off, 8)
        self.lease = self.region.base + off

    def set_take(self, Py_ssize_t off, Py_ssize_t rec_base=0, uint64_t nrecords=0):
        """MPMC, the free-record ring of a worker: record in the u64 word at ``off``
        (W_ALLOC) the handle + 1 of every record index this process's pop takes, *after* the
        CAS that claims it and before the cell is released (the generation from the record's
        word at ``rec_base``, RECORD_BYTES apart), so a recoverer finds a record taken off
        the ring and not yet set up (records.py, recovery.py ``allocated``).  -1: off."""
        if off < 0:
            self.took = NULL
            return
        self.region._check(off, 8)
        if rec_base < 0 or rec_base % 64 or rec_base + <Py_ssize_t>(nrecords * RECORD_BYTES) > self.region.size:
            raise ValueError("records do not fit the region")
        self.took = self.region.base + off
        self.took_rec = self.region.base + rec_base
        self.took_n = nrecords

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

    def pop_many(self, Py_ssize_t n, Py_ssize_t lease_off=-1):
        """Pop up to ``n`` values; returns a list (empty when the ring is empty).

        With ``lease_off`` (MPMC), the i-th value is leased in the u64 word at
        ``lease_off + 8 * i`` before the CAS that takes it (see set_lease).
        """
        cdef uint64_t v = 0
        cdef char *saved = self.lease
        cdef Py_ssize_t i = 0
        if lease_off >= 0:
            self.region._check(lease_off, 8)
            self.region._check(lease_off + 8 * (n - 1 if n > 0 else 0), 8)
        out = []
        try:
            while n > 0:
                if lease_off >= 0:
                    self.lease = self.region.base + lease_off + 8 * i
                if self.c_pop(&v) != ST_SUCCESS:
                    break
                out.append(v)
                n -= 1
                i += 1
        finally:
            self.lease = saved
        return out

    def __len__(self):
        cdef uint64_t c = st_load_acquire_u64(self.cons_p)  # approximate: the two loads race
        cdef uint64_t p = st_load_acquire_u64(self.prod_p)
        return <Py_ssize_t>(p - c) if p > c else 0


cdef inline bint _something_shows(_Ring inbox, _Ring injector, list victims) noexcept:
    # The cheap looks of Worker.search's round: its inbox, the injector, each victim's
    # deque (a lock-free hint only: nothing is taken; the caller's pop or steal re-reads).
    cdef Deque d
    cdef int64_t b, t
    cdef uint64_t c
    # acquire loads of each ring's positions, consumer first as _Ring.__len__ (the
    # producer's read after it is never behind it): they pair with the pushers' and
    # poppers' seq_cst/release updates of prod_p and cons_p
    c = st_load_acquire_u64(inbox.cons_p)
    if st_load_acquire_u64(inbox.prod_p) > c:
        return True
    c = st_load_acquire_u64(injector.cons_p)
    if st_load_acquire_u64(injector.prod_p) > c:
        return True
    for d in victims:
        # acquire loads, as Deque.__len__: pair with the owner's store of bottom (push)
        # and the thieves' CAS of top (steal)
        b = <int64_t>st_load_acquire_u64(d.bottom_p)
        t = <int64_t>st_load_acquire_u64(d.top_p)
        if b > t:
            return True
    return False


def something_shows(_Ring inbox not None, _Ring injector not None, list victims not None):
    """Worker.search's cheap looks once (see :func:`spin`): True if its inbox, the
    injector or a victim's deque holds something (a hint: nothing is taken)."""
    return _something_shows(inbox, injector, victims)


def spin(int n, _Ring inbox not None, _Ring injector not None, list victims,
         Region region not None, Py_ssize_t stop_off, Py_ssize_t shutdown_off):
    """Worker.search's spin rounds without their Python: up to ``n`` times, yield the CPU
    (sched_yield), then make the cheap looks of the Python round (its inbox, the
    injector, each victim's deque, the stop-agents and shutdown words).  Returns the
    rounds spent: fewer than ``n`` as soon as something shows, and the caller's full
    round then finds it (a lock-free hint only: nothing is taken here).  The Python round
    run once per round cost ~5 µs of a worker whose caches a handler had just emptied."""
    cdef int i
    region._check(stop_off, 4)
    region._check(shutdown_off, 4)
    for i in range(n):
        sched_yield()
        if _something_shows(inbox, injector, victims):
            return i + 1
        # acquire loads, as Region.load32 (pair with the client's seq_cst stores)
        if st_load_acquire_u32(region.at(stop_off)) or st_load_acquire_u32(region.at(shutdown_off)):
            return i + 1
    return n


def peers_to_poke(Region region not None, Py_ssize_t base0, Py_ssize_t stride, int n, int k,
                  Py_ssize_t runnable_at, Py_ssize_t in_step_at, Py_ssize_t state_at,
                  uint32_t ready):
    """Host.poke_peers' first look, natively: is there a peer of worker ``k`` (of ``n``,
    worker j's words at ``base0 + j * stride``) with agents runnable behind a running step,
    in state ``ready``?  Only then does the Python look at each one (and its last poke)."""
    cdef int j
    cdef char *b
    if n > 0:
        region._check(base0, 4)
        region._check(base0 + stride * (n - 1) + max(runnable_at, in_step_at, state_at), 4)
    for j in range(n):
        if j == k:
            continue
        b = <char *>region.at(base0 + stride * j)
        # acquire loads, as Region.load32: pair with the peer's seq_cst stores of its
        # W_RUNNABLE / W_IN_STEP / W_STATE (hints, re-read by poke_peers)
        if (st_load_acquire_u32(b + runnable_at) and st_load_acquire_u32(b + in_step_at)
                and st_load_acquire_u32(b + state_at) == ready):
            return True
    return False


# -- a worker's busy share (stealer/worker/agents/placement.py BusyShare, the reference) ---
from libc.math cimport exp as c_exp


cdef class BusyShare:
    """placement.BusyShare natively (the same fields, methods and arithmetic: libm's exp,
    as math.exp), and Balancer.note_busy's publication of it (:meth:`note`) in one call:
    the worker's busy/idle switches run at every idle transition, and their four Python
    frames cost ~6 µs of a worker whose caches its handlers had just emptied."""
    cdef public double avg      # the share at ``at``
    cdef public int64_t at      # monotonic ns of the last update; 0: none yet
    cdef public int64_t cur     # 1 busy, 0 idle, since ``at``
    cdef double tau_ns          # placement.AVG_TAU_NS
    cdef double scale           # shm.BUSY_SCALE, the published word's fixed point
    cdef Region region          # where note() publishes (None: nowhere)
    cdef Py_ssize_t avg_off     # this worker's W_BUSY_AVG
    cdef Py_ssize_t at_off      # this worker's W_BUSY_AT

    def __cinit__(self, double tau_ns, double scale=0.0, Region region=None,
                  Py_ssize_t avg_off=0, Py_ssize_t at_off=0):
        if tau_ns <= 0:
            raise ValueError("tau_ns must be > 0")
        if region is not None:
            region._check(avg_off, 8)
            region._check(at_off, 8)
        self.tau_ns = tau_ns
        self.scale = scale
        self.region = region
        self.avg_off = avg_off
        self.at_off = at_off

    cdef inline double _decayed(self, int64_t now_ns) noexcept:
        # placement.decayed(avg, at, now, cur)
        cdef int64_t dt = now_ns - self.at
        if dt <= 0:
            return self.avg
        return self.avg + (1.0 - c_exp(-(<double>dt) / self.tau_ns)) * (self.cur - self.avg)

    cpdef double update(self, int64_t now_ns, int64_t busy):
        """Busy (1) or idle (0) from ``now_ns`` on; returns the share at ``now_ns``."""
        self.avg = self._decayed(now_ns) if self.at else <double>busy
        self.at = now_ns
        self.cur = busy
        return self.avg

    cpdef double now(self, int64_t now_ns):
        """The share at ``now_ns``."""
        return self._decayed(now_ns) if self.at else 0.0

    def take(self, int64_t now_ns, double share):
        """Take ``share`` off (agents that carried it left)."""
        self.avg = max(0.0, self.now(now_ns) - share)
        if self.at:
            self.at = now_ns

    def note(self, int64_t busy):
        """Busy (1) or idle (0) from now on (monotonic clock), published (Balancer.note_busy)."""
        cdef int64_t t = <int64_t>_now_ns()
        cdef double avg = self.update(t, busy)
        if avg < 0.0:   # (never: the share stays in [0, 1]; a negative double's cast is UB)
            avg = 0.0
        if self.region is not None:
            # relaxed: a hint for the peers (Balancer.peer_share), read with W_BUSY_AT
            st_store_relaxed_u64(self.region.at(self.avg_off),
                                 (<uint64_t>(avg * self.scale) << 1) | <uint64_t>busy)
            st_store_relaxed_u64(self.region.at(self.at_off), <uint64_t>t)  # relaxed, likewise

    def idle(self):
        """The worker loop is about to search for work (Balancer.went_idle)."""
        if self.cur:
            self.note(0)


# -- MPMC claims a dead process left half-done (stealer/client/ringfix.py repairs them) ----------
# (RING_PUSH / RING_POP, the intent's op bits: _layout.pxi)
cdef uint64_t RING_SKIP = 0xFFFFFFFFFFFFFFFFULL   # a repaired producer cell's value: pops skip it
cdef uint64_t POS_UNKNOWN = 0xFFFFFFFFFFFFFFFFULL   # an intent's position before the push names
#   one (MPMCRing.pre_push: a free's, named before the record is marked FREE)


RING_SKIP_VALUE = RING_SKIP   # stealer/client/ringfix.py checks its copy against it
POS_UNKNOWN_VALUE = POS_UNKNOWN   # (and this one)


cdef inline void _say_intent(char *intent, uint64_t tag, uint64_t pos, uint64_t v) noexcept nogil:
    st_store_relaxed_u64(intent + 16, v)    # a push's value (the repair of a free ring pushes it)
    st_store_relaxed_u64(intent + 8, pos)   # read by the client's repair after our death, or
    st_store_relaxed_u64(intent, tag)       # while we live (a claim in flight: it waits)
    st_fence_release()   # both before the claim's CAS: pairs with the repair's acquire loads


cdef inline void _end_intent(char *intent) noexcept nogil:
    st_store_release_u64(intent, 0)   # our op is over (cell written, or none claimed): read by
    #                                   the client's repair (acquire), which then re-reads the seq


# Test-only failpoints ring.push_after_claim / ring.pop_after_claim (stealer/shared/failpoints.py
# arms them through arm_ring_failpoint): kill this process between a claim and its store;
# record.free_after_state (2): between a free's FREE store and its push (HotPath.c_free).
cdef int[3] _fp_ring = [0, 0, 0]      # countdown to the firing hit (0: off); this process only
cdef char[3][4096] _fp_once_path      # per failpoint: the file whose O_EXCL creation elects one process
cdef bint[3] _fp_once = [False, False, False]   # per failpoint: fire only in the process that creates it

from libc.signal cimport SIGKILL
from posix.fcntl cimport O_CREAT, O_EXCL, O_WRONLY
from posix.fcntl cimport open as c_open
from posix.signal cimport kill as c_kill
from posix.unistd cimport close as c_close
from posix.unistd cimport getpid as c_getpid
from libc.string cimport memcpy as _memcpy


cdef void _fp_ring_hit(int which) noexcept nogil:
    cdef int fd
    _fp_ring[which] -= 1
    if _fp_ring[which] != 0:
        return
    if _fp_once[which]:
        fd = c_open(_fp_once_path[which], O_CREAT | O_EXCL | O_WRONLY, 0o600)
        if fd < 0:
            return   # another process fired it
        c_close(fd)
    c_kill(c_getpid(), SIGKILL)
    while True:
        pass   # SIGKILL cannot be caught: we never get here for long


def arm_ring_failpoint(int which, int nth, once_path=None):
    """Arm (nth >= 1) or disarm (0) native failpoint ``which`` (0: after a push's claim,
    1: after a pop's claim, 2: after a free's FREE store) in this process; with
    ``once_path``, only the process that creates that file fires.  Tests only
    (stealer/shared/failpoints.py)."""
    if which not in (0, 1, 2):
        raise ValueError("native failpoint: 0 (push), 1 (pop) or 2 (free)")
    _fp_ring[which] = nth
    _fp_once[which] = once_path is not None
    if _fp_once[which]:
        import os
        b = os.fsencode(once_path)
        if len(b) >= 4096:
            raise ValueError("failpoint path too long")
        _memcpy(_fp_once_path[which], <char *>b, len(b))
        _fp_once_path[which][len(b)] = 0


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

    def pre_push(self, uint64_t v):
        """Name a push of ``v`` whose position is not known yet (ringfix.POS_UNKNOWN), before
        the caller makes ``v`` its to give back (a free: before the record's FREE store):
        the push names its position when it claims one.  Killed in between, the client's
        repair gives ``v`` back if the caller had made it so (stealer/client/ringfix.py).  No-op
        without an intent (set_intent)."""
        if self.intent != NULL:
            _say_intent(self.intent, self.tag | RING_PUSH, POS_UNKNOWN, v)

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
                if self.intent != NULL:   # our claim, named before it is made (read after our death)
                    _say_intent(self.intent, self.tag | RING_PUSH, pos, v)
                if st_cas_weak_relaxed_u64(self.prod_p, pos, pos + 1):   # claim position; ordering via seq
                    break
                pos = st_load_relaxed_u64(self.prod_p)
            elif dif < 0:
                if self.intent != NULL:
                    _end_intent(self.intent)   # a lost CAS may have named a position: not ours
                return ST_FULL
            else:
                pos = st_load_relaxed_u64(self.prod_p)
        if _fp_ring[0] and self.intent != NULL:
            _fp_ring_hit(0)   # test only (failpoint ring.push_after_claim): die holding the claim
        st_store_relaxed_u64(cell + 8, v)            # published by the release store of seq below
        st_store_release_u64(cell, pos + 1)          # pairs with the consumer's acquire load of seq
        if self.intent != NULL:
            _end_intent(self.intent)
        return ST_SUCCESS

    cdef int c_pop(self, uint64_t *out) noexcept nogil:
        cdef uint64_t pos
        cdef char *cell
        cdef uint64_t seq
        cdef int64_t dif
        while True:   # again after a RING_SKIP cell (a dead producer's claim, filled by repair)
            pos = st_load_relaxed_u64(self.cons_p)
            while True:
                cell = self.cells + 16 * (pos & self.mask)
                seq = st_load_acquire_u64(cell)          # pairs with the producer's release store of seq
                dif = <int64_t>(seq - (pos + 1))
                if dif == 0:
                    if self.lease != NULL:   # lease before the claim (read after our death)
                        st_store_relaxed_u64(self.lease, st_load_relaxed_u64(cell + 8) + 1)
                    if self.intent != NULL:   # our claim, named before it is made
                        _say_intent(self.intent, self.tag | RING_POP, pos, 0)
                    if st_cas_weak_relaxed_u64(self.cons_p, pos, pos + 1):   # claim position; ordering via seq
                        break
                    pos = st_load_relaxed_u64(self.cons_p)
                elif dif < 0:
                    if self.intent != NULL:
                        _end_intent(self.intent)   # a lost CAS may have named a position: not ours
                    return ST_EMPTY
                else:
                    pos = st_load_relaxed_u64(self.cons_p)
            if _fp_ring[1] and self.intent != NULL:
                _fp_ring_hit(1)   # test only (failpoint ring.pop_after_claim): die holding the claim
            out[0] = st_load_relaxed_u64(cell + 8)
            if self.took != NULL and out[0] < self.took_n:
                # the record is ours now (claimed): its handle, before the cell is released
                # (killed before this store, the repair of the claim gives it back; after
                # it, the recoverer reads W_ALLOC). Relaxed: read after our death. The gen
                # (relaxed load) was stored by the free before its push, which our acquire
                # load of seq ordered before this load.
                st_store_relaxed_u64(self.took, ((st_load_relaxed_u64(
                    self.took_rec + RECORD_BYTES * out[0]) & 0xFFFFFFFFU) << 32 | out[0]) + 1)
            st_store_release_u64(cell, pos + self.mask + 1)  # pairs with the next producer's acquire load
            if self.intent != NULL:
                _end_intent(self.intent)
            if out[0] != RING_SKIP:
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

    cdef int c_peek(self, uint64_t *out) noexcept nogil:
        # The next value, left in place (the consumer's read only).
        cdef uint64_t h = st_load_relaxed_u64(self.cons_p)      # consumer's own word
        cdef uint64_t t = st_load_acquire_u64(self.prod_p)      # pairs with the producer's release of tail
        if h == t:
            return ST_EMPTY
        out[0] = st_load_relaxed_u64(self.cells + 8 * (h & self.mask))
        return ST_SUCCESS

    cdef int c_pop(self, uint64_t *out) noexcept nogil:
        if self.c_peek(out) != ST_SUCCESS:
            return ST_EMPTY
        cdef uint64_t h = st_load_relaxed_u64(self.cons_p)      # consumer's own word (c_peek read it)
        st_store_release_u64(self.cons_p, h + 1)                # pairs with the producer's acquire of head
        return ST_SUCCESS

    def peek(self):
        """Consumer: the value ``pop`` would return next, left in place (EMPTY if none)."""
        cdef uint64_t v
        return <int64_t>v if self.c_peek(&v) == ST_SUCCESS else EMPTY


# Record layout constants (R_*, S_*, K_*, INLINE...) are in _cqueues.pxd.

from libc.string cimport memcpy, memset
from posix.time cimport CLOCK_MONOTONIC, clock_gettime, timespec


# c_submit_inline's result for a free-ring cell naming no record (shared memory overwritten):
# INT64_MIN, below every ``-2 - h`` (a handle's generation has 31 bits).  (It was
# -3 - 0x7FFFFFFFFFFF, which is also ``-2 - h`` for generation 0x8000, record 0.)
cdef int64_t CORRUPT_FREE_RING = INT64_MIN

# post_msg's results (HotPath.post_msg; stealer/client/agents.py reads them by these names)
DEF D_CLOSED = 0x8000000000000000ULL   # mailbox.CLOSED: the top bit of D_HEAD
DEF _WAITING = 1     # stealer/worker/agents/entry.py: RUNNABLE, WAITING, SLEEPING, SUSPENDED, ...
DEF _SUSPENDED = 3
cdef enum:
    C_POST_QUIET = -1
    C_POST_FULL = -2
    C_POST_STOPPED = -3
    C_POST_NOREC = -4
    C_POST_INBOX_FULL = -5      # - k: worker k's inbox was full
    C_POST_CONTROL = 1 << 24    # or-ed into an owner: the agent is control-tier
POST_QUIET = C_POST_QUIET
POST_FULL = C_POST_FULL
POST_STOPPED = C_POST_STOPPED
POST_NOREC = C_POST_NOREC
POST_INBOX_FULL = C_POST_INBOX_FULL
POST_CONTROL = C_POST_CONTROL


cdef inline uint64_t _now_ns() noexcept nogil:
    # CLOCK_MONOTONIC in ns: the clock of time.monotonic_ns() and perf_counter_ns() on Linux.
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return <uint64_t>ts.tv_sec * 1000000000ULL + <uint64_t>ts.tv_nsec
from cpython.bytes cimport PyBytes_FromStringAndSize
from cpython.object cimport PyObject_Call
from cpython.long cimport PyLong_AsLongLongAndOverflow
from cpython.float cimport PyFloat_AS_DOUBLE
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE
from cpython.bytearray cimport PyByteArray_AS_STRING
from cpython.unicode cimport PyUnicode_DecodeUTF8
from cpython.exc cimport PyErr_Clear
from cpython.tuple cimport PyTuple_New, PyTuple_SET_ITEM
from cpython.ref cimport Py_INCREF

cdef extern from "Python.h":
    const char *PyUnicode_AsUTF8AndSize(object s, Py_ssize_t *size) noexcept


cdef inline void _hand_over(char *park) noexcept nogil:
    # Move the parked result thread onto this CPU before waking it (idle.ResultPolicy):
    # with the yield after the wake it then runs now, not after another CPU's time slice.
    # Its thread id sits beside the park word (shm.H_CLIENT_TID; 0: not allowed): relaxed,
    # ordered after the caller's CAS of the park word; the client stores it seq_cst.
    cdef int tid = <int>st_load_relaxed_u32(park + CLIENT_TID_AT)
    if tid <= 0:
        return
    cdef int cpu = sched_getcpu()
    if cpu < 0 or cpu >= CPU_SETSIZE:
        return
    cdef cpu_set_t one
    CPU_ZERO(&one)
    CPU_SET(cpu, &one)
    if sched_setaffinity(tid, sizeof(cpu_set_t), &one) == 0:   # refused (EPERM...): a plain wake
        # shm.H_CLIENT_MOVED after the move: the client exchanges it back to 0 (seq_cst) at
        # the top of each loop and then restores its CPUs, so even a client that woke on its
        # own meanwhile sees this move at its next check (set before the move, the flag could
        # be cleared between the two and the move left unseen)
        st_store_seqcst_u32(park + CLIENT_MOVED_AT, 1)


# -- an agent's entry ---------------------------------------------------------------------
cdef extern from *:
    """
    #include <structmember.h>
    /* Replace a type's attribute descriptors (Cython makes getset properties for public
       fields) by member descriptors at the same offsets (``ints``: 64-bit int fields),
       found by storing a sentinel through each property and looking for it in the
       instance (a word-aligned field of 8 bytes: objects and int64_t): CPython 3.11 specializes
       attribute access to member descriptors (as for a __slots__ class), not to
       properties, and the Host's Python code reads and writes entries on every turn it
       runs (a property costs about twice as much there). */
    static int st_members_as_slots(PyTypeObject *tp, PyObject *inst, PyObject *names,
                                   PyObject *ints, PyObject *sentinel) {
        Py_ssize_t n = PyTuple_GET_SIZE(names);
        Py_ssize_t words = tp->tp_basicsize / 8;
        const int64_t mark = (int64_t)0x5A17C0DE5A17C0DELL;
        PyObject *mark_obj = PyLong_FromLongLong(mark);
        PyObject *zero = PyLong_FromLong(0);
        int rc = -1;
        /* kept for the type's life (a module's type is never freed) */
        PyMemberDef *defs = (PyMemberDef *)PyMem_Calloc((size_t)n + 1, sizeof(PyMemberDef));
        if (!defs || !mark_obj || !zero) { if (!defs) PyErr_NoMemory(); goto done; }
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *name = PyTuple_GET_ITEM(names, i);
            int is_int = PySequence_Contains(ints, name);
            if (is_int < 0) goto done;
            if (PyObject_SetAttr(inst, name, is_int ? mark_obj : sentinel) < 0) goto done;
            Py_ssize_t at = -1;
            for (Py_ssize_t k = (Py_ssize_t)(sizeof(PyObject) / 8); k < words; k++) {
                int hit = is_int ? ((int64_t *)inst)[k] == mark : ((PyObject **)inst)[k] == sentinel;
                if (hit) {
                    if (at >= 0) { PyErr_Format(PyExc_RuntimeError, "field %R found twice", name); goto done; }
                    at = k;
                }
            }
            if (PyObject_SetAttr(inst, name, is_int ? zero : Py_None) < 0) goto done;
            if (at < 0) { PyErr_Format(PyExc_RuntimeError, "field %R not found", name); goto done; }
            defs[i].name = PyUnicode_AsUTF8(name);  /* the names tuple lives in the module */
            if (!defs[i].name) goto done;
            defs[i].type = is_int ? T_LONGLONG : T_OBJECT_EX;
            defs[i].offset = at * 8;
            defs[i].flags = 0;
            PyObject *d = PyDescr_NewMember(tp, &defs[i]);
            if (!d) goto done;
            int set = PyDict_SetItem(tp->tp_dict, name, d);
            Py_DECREF(d);
            if (set < 0) goto done;
        }
        PyType_Modified(tp);
        rc = 0;
    done:
        Py_XDECREF(mark_obj);
        Py_XDECREF(zero);
        return rc;
    }
    """
    int st_members_as_slots(type tp, object inst, tuple names, tuple ints,
                            object sentinel) except -1




cdef class Entry:
    """The base of stealer/worker/agents/entry.py's ``_Entry`` where the extension is built:
    an agent's entry with its fields at fixed offsets (declared in _cqueues.pxd), so the
    native turn (Turns, HotPath.c_serve) reads and writes them as C struct fields instead
    of through attribute lookups; Python code sees them as it sees a ``__slots__`` class's
    (member descriptors: st_members_as_slots).  No field may be deleted: that leaves NULL
    there, which the native turn does not expect (nothing deletes one)."""


def _declared_fields(tp):
    """The fields declared public for ``tp`` in _cqueues.pxd (those Cython made properties
    for), sorted, and those of them that are 64-bit ints (they refuse None): read off the
    type, so the declaration is their only list here (entry.py keeps the reference
    build's; tests/test_fast_turn.py compares the two)."""
    from types import GetSetDescriptorType

    probe = tp.__new__(tp)
    names = sorted(k for k, v in tp.__dict__.items()
                   if type(v) is GetSetDescriptorType and not k.startswith("__"))
    ints = []
    for k in names:
        try:
            setattr(probe, k, None)
        except TypeError:
            ints.append(k)
    return tuple(names), tuple(ints)


# Entry's fields and its 64-bit int fields (what Python writes to those must be an int)
ENTRY_FIELDS, ENTRY_INTS = _declared_fields(Entry)
st_members_as_slots(Entry, Entry.__new__(Entry), ENTRY_FIELDS, ENTRY_INTS, object())


cdef class HotPath:
    """The per-task record operations, one native call each (see stealer/shared/arena.py).

    ``stealer.shared.arena.Arena`` holds the pure-Python reference of every method
    here; it delegates to this class when the extension is loaded.  Only
    payloads that fit inline in the record take this path; larger ones and
    out-of-band buffers go through the Python arena.  The state word and its
    transitions are stealer/shared/records.py's (diagram there).
    """

    def __cinit__(self, Region region, Py_ssize_t rec_base, uint64_t nrecords,
                  MPMCRing free_ring, MPMCRing injector, Py_ssize_t client_park_off,
                  Py_ssize_t searching_off=-1, Py_ssize_t parked_off=-1,
                  Py_ssize_t park_base=-1, Py_ssize_t park_stride=0, int nworkers=0):
        if rec_base < 0 or rec_base % 64 or rec_base + <Py_ssize_t>(nrecords * RECORD_BYTES) > region.size:
            raise ValueError("records do not fit the region")
        cdef int nwords = (nworkers + 63) // 64
        if nworkers > 0:
            region._check(searching_off, 8)
            region._check(searching_off + 8 * (nwords - 1), 8)
            region._check(parked_off, 8)
            region._check(parked_off + 8 * (nwords - 1), 8)
            region._check(park_base, 4)
            region._check(park_base + park_stride * (nworkers - 1), 4)
        self.searching_off = searching_off
        self.parked_off = parked_off
        self.nwords = nwords
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
        self.owed = False
        self.dir_off = -1
        self.inboxes = []

    cdef char *rec(self, uint64_t h) noexcept nogil:
        return self.rec_base + RECORD_BYTES * (h & 0xFFFFFFFFU)

    cdef int _check_handle(self, uint64_t h) except -1:
        if (h & 0xFFFFFFFFU) >= self.nrecords:
            raise IndexError(f"bad record handle {h:#x}: index out of range "
                             f"({self.nrecords} records); shared memory is corrupt")
        return 0

    cdef void c_free(self, uint64_t h) noexcept nogil:
        # Release (exclusive holder; payload storage already dropped by the caller).
        cdef char *r = self.rec(h)
        cdef uint64_t gen = (st_load_relaxed_u64(r) + 1) & 0x7FFFFFFF
        cdef char *intent = self.free_ring.intent
        if intent != NULL:
            # a worker: the push named before the FREE store (its position unknown yet:
            # MPMCRing.pre_push), so a death between the store and the push's claim leaves
            # an intent the client's repair completes (ringfix.py: FREE and on no ring)
            _say_intent(intent, self.free_ring.tag | RING_PUSH, POS_UNKNOWN, h & 0xFFFFFFFFU)
        (<uint32_t *>(r + R_PCLASS))[0] = 0
        (<uint32_t *>(r + R_RCLASS))[0] = 0
        (<uint64_t *>(r + R_PLEN))[0] = 0
        (<uint64_t *>(r + R_RLEN))[0] = 0
        st_store_release_u64(r, gen | (<uint64_t>S_FREE << STATE_SHIFT))  # stale handles now fail their CAS
        if _fp_ring[2] and intent != NULL:
            _fp_ring_hit(2)   # test only (failpoint record.free_after_state): FREE, on no ring
        self.free_ring.c_push(h & 0xFFFFFFFFU)                             # release: next owner sees the new gen

    def free(self, uint64_t h):
        self._check_handle(h)
        self.c_free(h)

    cdef int c_notify_one(self) noexcept nogil:
        # The notifier's half of the park handshake; Idle.notify_one (stealer/shared/idle.py) is the
        # reference.  Searching/parked are worker sets: bit k % 64 of u64 word k // 64.
        if self.nworkers <= 0:
            return -1
        cdef char *base = self.region.base
        cdef int nw = self.nwords
        cdef int i, j, k
        cdef uint64_t m
        cdef char *w
        st_fence_seqcst()          # seq_cst: the work just published before the loads below;
                                   # pairs with the fence a parker issues after its or64
        for j in range(nw):
            # relaxed after the fence: writers are the workers' or64/and64 (seq_cst) of their
            # own bit and the client's and64 in forget; a searcher seen here re-checks the
            # queues after this publication (it parks only after its fence and re-check)
            if st_load_relaxed_u64(base + self.searching_off + 8 * j) != 0:
                return -1          # a searcher will find it
        cdef int start = self.next_rr if self.next_rr < self.nworkers else 0
        cdef int sw = start >> 6
        cdef int sb = start & 63
        for i in range(nw + 1):    # round robin from worker ``start``: its word twice, split
            j = (sw + i) % nw
            # acquire: pairs with the parker's or64 (seq_cst, so release), which it issues
            # after storing PARKED: a bit seen set means the CAS below sees PARKED or later
            m = st_load_acquire_u64(base + self.parked_off + 8 * j)
            if i == 0:
                m &= ~<uint64_t>0 << sb
            elif i == nw:
                m &= (<uint64_t>1 << sb) - 1
            while m:
                k = 64 * j + wset_ctz(m)
                m &= m - 1
                if k >= self.nworkers:
                    break
                w = base + self.park_base + self.park_stride * k
                if st_cas_seqcst_u32(w, PARKED, NOTIFIED):   # pairs with the worker's store of PARKED
                    self.next_rr = k + 1
                    st_futex_wake(w, 1)
                    return k
        return -1              # nobody parked (or all of them already notified or awake)

    def notify_one(self):
        """Wake one parked worker if nobody searches; the worker index woken, or -1."""
        return self.c_notify_one()

    # -- a worker's idle transitions (Worker.search): Idle's flush_client, try_search,
    #    stop_search and park natively, one call each; stealer/shared/idle.py is the
    #    reference and says why each step is where it is.  The Python calls cost 30-40 µs
    #    of CPU per search (~2 µs per call at 32 lockstep agents) in a worker whose caches
    #    the handlers had just emptied.
    cdef inline char *_park_word(self, int k) noexcept nogil:
        return self.region.base + self.park_base + self.park_stride * k

    cdef inline char *_set_word(self, Py_ssize_t set_off, int k) noexcept nogil:
        return self.region.base + set_off + 8 * (k >> 6)

    cdef int _check_worker(self, int k) except -1:
        if self.nworkers <= 0:
            raise RuntimeError("this HotPath was made without the worker sets")
        if k < 0 or k >= self.nworkers:
            raise IndexError(f"worker {k} out of range ({self.nworkers} workers)")
        return 0

    cdef bint c_wake_parked(self, char *word) noexcept nogil:
        # Idle._wake_parked: the client thread parked (either mode) on ``word``.
        # seq_cst load and CAS: pair with the parker's store of its state and its re-check
        cdef uint32_t v = st_load_seqcst_u32(word)
        if (v == PARKED or v == PARKED_BATCH) and st_cas_seqcst_u32(word, v, NOTIFIED):
            st_futex_wake(word, 1)
            return True
        return False

    cdef void c_flush_client(self) noexcept nogil:
        # Idle.flush_client: the wakes owed for completions not announced (c_finish)
        cdef char *w = self.region.base + self.client_park_off
        st_fence_seqcst()   # the completion pushes before reading the park words; pairs
                            # with the parkers' store of their state and re-check
        # seq_cst load: pairs with the waiter's stores of its state (waiter_take/_park)
        cdef uint32_t v = st_load_seqcst_u32(w + WAITER_PARK_AT)
        if v == WAITER_AWAKE or v == NOTIFIED:
            return          # it looks at the rings before it parks or leaves
        if not self.c_wake_parked(w + WAITER_PARK_AT):
            self.c_wake_parked(w)

    cdef bint c_try_search(self, int k) noexcept nogil:
        # Idle.try_search: a searcher unless half the workers already search
        cdef int j, c = 0
        if self.nworkers > 1:
            for j in range(self.nwords):
                # acquire: pairs with the set's or64/and64 RMWs (an advisory count)
                c += wset_popcount(st_load_acquire_u64(
                    self.region.base + self.searching_off + 8 * j))
            if 2 * c >= self.nworkers:
                return False
        # seq_cst RMW, the whole transition: the notifiers' loads after their fence see the
        # bit (and skip the wake) only if this worker scans the queues after their publication
        wset_fetch_or_seqcst(self._set_word(self.searching_off, k), <uint64_t>1 << (k & 63))
        return True

    cdef void c_stop_search(self, int k, bint found_work) noexcept nogil:
        # Idle.stop_search: the last searcher to find work wakes another
        cdef uint64_t bit = <uint64_t>1 << (k & 63)
        cdef int j
        # seq_cst RMW, the whole transition; pairs with the notifiers' fence (try_search)
        cdef uint64_t old = wset_fetch_and_seqcst(self._set_word(self.searching_off, k), ~bit)
        if not found_work or old != bit:
            return
        for j in range(self.nwords):
            # acquire: pairs with the set's RMWs (nobody else searching anywhere)
            if st_load_acquire_u64(self.region.base + self.searching_off + 8 * j) != 0:
                return
        self.c_notify_one()

    def idle_enter(self, int k, bint owed=False):
        """Worker ``k`` runs out of work: pay the client wake it owes (``owed``, or this
        HotPath's :attr:`owed`: Idle.flush_client), then try to become a searcher
        (Idle.try_search).  True if it searches."""
        self._check_worker(k)
        if owed or self.owed:
            self.owed = False
            self.c_flush_client()
        return self.c_try_search(k)

    def try_search(self, int k):
        """Idle.try_search natively."""
        self._check_worker(k)
        return self.c_try_search(k)

    def stop_search(self, int k, bint found_work):
        """Idle.stop_search natively."""
        self._check_worker(k)
        self.c_stop_search(k, found_work)

    def flush_client(self):
        """Idle.flush_client natively (clears :attr:`owed`)."""
        self.owed = False
        self.c_flush_client()

    def park(self, int k, bint searching, _Ring inbox not None, _Ring injector not None,
             Deque mine not None, list victims not None, double timeout):
        """Worker ``k``: leave the searchers if ``searching`` (Idle.stop_search, no work
        found), then Idle.park with its re-check made natively: ``mine`` (its deque),
        ``inbox``, ``injector`` and the ``victims``' deques.  The caller looks at its
        process-local work (runnable agents, held items) just before: only other processes
        publish into these.  Returns False on timeout, True otherwise (woken, something
        showed, or a signal: the caller re-checks)."""
        self._check_worker(k)
        if searching:
            self.c_stop_search(k, False)
        cdef char *w = self._park_word(k)
        cdef char *set_w = self._set_word(self.parked_off, k)
        cdef uint64_t bit = <uint64_t>1 << (k & 63)
        cdef int64_t ns = <int64_t>(max(0.0, timeout) * 1e9)
        cdef int rc = 0
        cdef int64_t b, t
        st_store_seqcst_u32(w, PARKED)   # read by the notifiers' CAS (PARKED -> NOTIFIED)
        # seq_cst RMW (release): a notifier's acquire load that sees the bit sees PARKED above
        wset_fetch_or_seqcst(set_w, bit)
        st_fence_seqcst()   # the bit before the re-check; pairs with the notifier's fence
        # relaxed: the owner's own bottom; acquire top: pairs with the thieves' CAS
        b = <int64_t>st_load_relaxed_u64(mine.bottom_p)
        t = <int64_t>st_load_acquire_u64(mine.top_p)
        if b <= t and not _something_shows(inbox, injector, victims):
            with nogil:
                rc = st_futex_wait(w, PARKED, ns)
        # seq_cst RMW: out of the set first, so a set bit means the worker is parked or
        # dead (the client's forget clears it then)
        wset_fetch_and_seqcst(set_w, ~bit)
        st_store_seqcst_u32(w, 0)   # RUNNING (idle.py); overwrites NOTIFIED: notifiers' CAS fails
        if rc < 0:
            raise OSError(-rc, "futex wait failed")
        return rc == 0

    cdef int64_t c_fresh(self, uint32_t kind, uint64_t link, const char *data,
                         Py_ssize_t n, uint32_t retries) noexcept nogil:
        # A free record, filled as Arena.alloc + setup + an inline put do (n <= INLINE,
        # checked by the caller), QUEUED: its handle, -1 when none is free, or
        # CORRUPT_FREE_RING.  The state store is relaxed: whatever makes the record
        # reachable publishes it (a queue push, a mailbox's seq_cst CAS).
        cdef uint64_t idx
        if self.free_ring.c_pop(&idx) != ST_SUCCESS:
            return -1
        if idx >= self.nrecords:
            return CORRUPT_FREE_RING   # (the caller raises)
        cdef char *r = self.rec_base + RECORD_BYTES * idx
        cdef uint64_t gen = st_load_relaxed_u64(r) & 0xFFFFFFFFU   # ours since the pop
        memset(r + 8, 0, R_INLINE - 8)
        (<uint32_t *>(r + R_KIND))[0] = kind
        (<uint64_t *>(r + R_LINK))[0] = link
        (<uint32_t *>(r + R_RETRIES))[0] = retries
        (<uint64_t *>(r + R_PLEN))[0] = <uint64_t>n
        (<uint64_t *>(r + R_TSUBMIT))[0] = _now_ns()
        if n:
            memcpy(r + R_INLINE, data, n)
        st_store_relaxed_u64(r, gen | (<uint64_t>S_QUEUED << STATE_SHIFT))  # published by who links it
        return <int64_t>((gen << 32) | idx)

    cdef int64_t c_submit_inline(self, uint32_t kind, uint64_t link, const char *data,
                                 Py_ssize_t n, uint32_t retries) noexcept nogil:
        # submit_inline's body (n <= INLINE checked by the caller).
        cdef int64_t got = self.c_fresh(kind, link, data, n, retries)
        if got < 0:
            return got   # -1 (no record) or CORRUPT_FREE_RING
        cdef uint64_t h = <uint64_t>got
        if self.injector.c_push(h) != ST_SUCCESS:   # release (cell seq): the worker's pop acquires it
            return -2 - <int64_t>h   # set up, not queued: the caller pushes it when there is room
        self.c_notify_one()
        return <int64_t>h

    def submit_inline(self, uint32_t kind, uint64_t link, bytes data not None,
                      uint32_t retries=0):
        """Client: take a record, fill it with an inline payload, push it on the injector,
        and wake a parked worker if nobody searches.

        The submit time is CLOCK_MONOTONIC (time.monotonic_ns()).  Returns the
        handle, -1 when no record is free, or ``-2 - h`` when record ``h`` was set
        up but the injector was full.  ``len(data)`` must be <= INLINE.
        """
        cdef Py_ssize_t n = len(data)
        if n > INLINE:
            raise ValueError("payload too large for the inline path")
        cdef int64_t h = self.c_submit_inline(kind, link, <const char *>data, n, retries)
        if h == CORRUPT_FREE_RING:
            raise IndexError("corrupt free ring: record index out of range")
        return h

    def spawn_inline(self, list datas, uint32_t kind, uint64_t link_or, uint32_t retries,
                     Py_ssize_t dir_off, uint32_t cap, list out, MPMCRing ring=None):
        """Client: a batch of agents (stealer/client/agents_batch.py), one record each: for each
        payload of ``datas`` (bytes, each <= INLINE) take a record, fill it as
        ``submit_inline`` does with link ``link_or | h``, make its directory entry at
        ``dir_off`` fresh (zeroed, capacity ``cap``; before the push that publishes it) and
        push it on ``ring`` (a worker's inbox: that worker starts them) or, None, on the
        injector; append each handle to ``out``.  Wakes nobody: the caller notifies once
        for the batch.  Returns 0 when all were queued, -1 when no record was free (``out``
        holds those queued so far), or -2 when the ring was full: the last handle in
        ``out`` is set up but not queued (the caller queues it).
        """
        cdef MPMCRing q = self.injector if ring is None else ring
        cdef Py_ssize_t i, n
        cdef uint64_t t_submit = _now_ns()
        cdef uint64_t idx, gen, h
        cdef char *r
        cdef char *d
        cdef bytes data
        for data in datas:
            if data is None:
                raise TypeError("spawn_inline takes a list of bytes")
            if PyBytes_GET_SIZE(data) > INLINE:
                raise ValueError("payload too large for the inline path")
        if dir_off < 0 or dir_off + <Py_ssize_t>(self.nrecords * DIR_BYTES) > self.region.size:
            raise ValueError("the agent directory does not fit the region")
        for i in range(len(datas)):
            data = datas[i]
            n = PyBytes_GET_SIZE(data)
            if self.free_ring.c_pop(&idx) != ST_SUCCESS:
                return -1
            if idx >= self.nrecords:
                raise IndexError("corrupt free ring: record index out of range")
            r = self.rec_base + RECORD_BYTES * idx
            gen = st_load_relaxed_u64(r) & 0xFFFFFFFFU
            h = (gen << 32) | idx
            memset(r + 8, 0, R_INLINE - 8)
            (<uint32_t *>(r + R_KIND))[0] = kind
            (<uint64_t *>(r + R_LINK))[0] = link_or | h
            (<uint32_t *>(r + R_RETRIES))[0] = retries
            (<uint64_t *>(r + R_PLEN))[0] = <uint64_t>n
            (<uint64_t *>(r + R_TSUBMIT))[0] = t_submit
            if n:
                memcpy(r + R_INLINE, PyBytes_AS_STRING(data), n)
            # the directory entry: plain stores, published by the push below (as Directory.init)
            d = self.region.base + dir_off + DIR_BYTES * idx
            memset(d, 0, DIR_BYTES)
            (<uint32_t *>(d + D_CAP))[0] = cap
            st_store_relaxed_u64(r, gen | (<uint64_t>S_QUEUED << STATE_SHIFT))  # alloc: published by the push below
            out.append(<int64_t>h)
            if q.c_push(h) != ST_SUCCESS:   # release (cell seq): the worker's pop acquires it
                return -2
        return 0

    # -- the agents' client: a call in two native steps (stealer/client/agents.py) ------
    def set_agents(self, Py_ssize_t dir_off, list inboxes not None):
        """Client: where the agent directory is and the workers' inboxes (for post_msg)."""
        if dir_off < 0 or dir_off + <Py_ssize_t>(self.nrecords * DIR_BYTES) > self.region.size:
            raise ValueError("the agent directory does not fit the region")
        for q in inboxes:
            if not isinstance(q, MPMCRing):
                raise TypeError("set_agents takes the workers' inboxes (MPMCRing each)")
        self.dir_off = dir_off
        self.inboxes = list(inboxes)

    def reply_slot(self, uint64_t fid):
        """Client: a fresh record set up as a call's reply slot (K_ROOT, link ``fid``,
        QUEUED on no queue), as ``Arena.alloc`` + ``Arena.setup``; its handle, or -1 when
        no record is free (the caller waits in Python)."""
        # published to the owner by the message's push (post_msg's seq_cst CAS on D_HEAD,
        # after this in program order), whose claim (the seq_cst CAS QUEUED -> RUNNING in
        # Messages.reply) reads it
        cdef int64_t h = self.c_fresh(K_ROOT, fid, NULL, 0, 0)
        if h == CORRUPT_FREE_RING:
            raise IndexError("corrupt free ring: record index out of range")
        return h

    def calls(self, dumps, pool, future_cls, ids, dict futures, targets, str method,
              arglists, kw, call_py, post_call, defer):
        """Client: ``stealer.client.agents.AgentClient.calls`` (the reference, whose loop
        the pure-Python build and a journaled client run) in one native call, for a
        method the caller checked: per target ``(h, uid, deadline)`` with its arguments,
        a future (``future_cls(pool, fid, method)``), its reply slot (:meth:`reply_slot`),
        the future registered in ``futures``, the message written by ``dumps``
        (_fastpickle.dumps) and posted (:meth:`post_msg`).  A post that needs nobody woken
        (POST_QUIET), or only an owner already in ``defer`` (woken once for the batch by
        the caller), ends the call here; anything else goes to the reference's own steps
        from the same point: ``call_py(f, h, method, args, kwargs, deadline, uid, defer)``
        without a reply slot (a bad handle, no free record), ``post_call(f, h, method,
        args, kw, deadline, rh, defer, data, r)`` after one (a message ``dumps`` refuses
        or too large, a full mailbox, a stopped agent, a worker to wake, a full inbox).
        Returns the futures in order."""
        cdef Py_ssize_t n = len(targets), i
        cdef int64_t rh
        cdef uint64_t fid
        cdef object r
        cdef long code
        if len(arglists) != n:
            raise ValueError("one argument tuple per target")
        cdef list out = []
        kwargs = kw if kw is not None else {}
        for i in range(n):
            h, uid, deadline = targets[i]
            args = arglists[i]
            fobj = next(ids)
            f = future_cls(pool, fobj, method)
            if h < 0:
                out.append(call_py(f, h, method, args, kwargs, deadline, uid, defer))
                continue
            fid = <uint64_t>fobj
            rh = self.c_fresh(K_ROOT, fid, NULL, 0, 0)   # reply_slot's
            if rh == CORRUPT_FREE_RING:
                raise IndexError("corrupt free ring: record index out of range")
            if rh < 0:  # no free record: the reference waits for one
                out.append(call_py(f, h, method, args, kwargs, deadline, uid, defer))
                continue
            f._st_handle = rh  # cancel() withdraws it (the agent then drops the reply)
            futures[fobj] = f
            data = dumps((h, method, args, kw, rh, deadline, None, 0, 0))
            if data is None or PyBytes_GET_SIZE(data) > INLINE:
                out.append(post_call(f, h, method, args, kw, deadline, rh, defer, None, None))
                continue
            try:
                r = self.post_msg(h, data)
            except Exception:  # (raised before it did anything) the reference posts again
                out.append(post_call(f, h, method, args, kw, deadline, rh, defer, data, None))
                continue
            code = <long>r
            if code == C_POST_QUIET or (
                    code >= 0 and not (code & C_POST_CONTROL) and defer is not None
                    and code in <set>defer):
                out.append(f)
                continue
            out.append(post_call(f, h, method, args, kw, deadline, rh, defer, data, r))
        return out

    def post_msg(self, uint64_t h, bytes data not None, bint reserved=False):
        """Client: message ``data`` (an inline payload, ``len <= INLINE``) into agent
        ``h``'s mailbox, as ``AgentClient._check`` + ``Directory.reserve`` + a K_MSG record
        + ``Directory.push`` + ``Directory.notify`` (stealer/agents/mailbox.py, the
        reference) in one call.  ``reserved``: the caller holds a mailbox slot already.

        Returns the owner ``k >= 0`` to wake (``| POST_CONTROL`` for a control-tier agent:
        the caller may signal a busy owner), ``POST_QUIET`` (pushed; a notification was
        on its way already, or the agent is not running: nobody to wake),
        ``POST_INBOX_FULL - k`` (pushed; the notification found worker k's inbox full: the
        caller queues it), or, with nothing changed (a slot it reserved here given
        back): ``POST_FULL`` (mailbox full), ``POST_STOPPED`` (the agent is gone, done or
        closed), ``POST_NOREC`` (no free record)."""
        if self.dir_off < 0:
            raise RuntimeError("post_msg before set_agents")
        self._check_handle(h)
        cdef Py_ssize_t n = PyBytes_GET_SIZE(data)
        if n > INLINE:
            raise ValueError("payload too large for the inline path")
        cdef char *ar = self.rec(h)
        cdef char *e = self.region.base + self.dir_off + DIR_BYTES * (h & 0xFFFFFFFFU)
        # acquire: the agent's state word; pairs with its owner's seq_cst CASes (start, finish)
        cdef uint64_t w = st_load_acquire_u64(ar)
        if (w & GEN_MASK) != (h >> 32) or ((w >> STATE_SHIFT) & STATE_MASK) == S_DONE:
            return C_POST_STOPPED
        # acquire: pairs with the owner's closing CAS (Directory.close)
        if st_load_acquire_u64(e + D_HEAD) & D_CLOSED:
            return C_POST_STOPPED
        cdef uint32_t cap
        if not reserved:
            cap = st_load_relaxed_u32(e + D_CAP)   # set by the spawner before the agent's push
            # seq_cst RMW: pairs with the owner's add in Directory.give_back
            if st_fetch_add_seqcst_u32(e + D_COUNT, 1) >= cap:
                st_fetch_add_seqcst_u32(e + D_COUNT, <uint32_t>-1)   # overshot: undo (never seen)
                return C_POST_FULL
        # the message record: published with its fields by the push's seq_cst CAS below
        cdef int64_t got = self.c_fresh(K_MSG, 0, PyBytes_AS_STRING(data), n, 0)
        if got < 0:
            if not reserved:
                self._give_back(e)
            if got == CORRUPT_FREE_RING:
                raise IndexError("corrupt free ring: record index out of range")
            return C_POST_NOREC
        cdef uint64_t mh = <uint64_t>got
        cdef char *m = self.rec(mh)
        cdef uint64_t old
        while True:
            old = st_load_acquire_u64(e + D_HEAD)   # acquire: pairs with other senders' CAS
            if old & D_CLOSED:
                self.c_free(mh)                       # never published: still ours
                if not reserved:
                    self._give_back(e)
                return C_POST_STOPPED
            (<uint64_t *>(m + R_NEXT))[0] = old       # ours until the CAS publishes it
            # seq_cst CAS: publishes the message and its link; pairs with the owner's load of
            # D_HEAD in Directory.take and its closing CAS
            if st_cas_seqcst_u64(e + D_HEAD, old, mh + 1):
                break
        # the notification (Directory.notify): seq_cst RMW, pairs with the owner's and64
        # that clears AF_NOTIFIED before its walk
        cdef uint64_t flags = wset_fetch_or_seqcst(e + D_FLAGS, AF_NOTIFIED)
        if flags & AF_NOTIFIED:
            return C_POST_QUIET
        w = st_load_seqcst_u64(ar)   # seq_cst after the or64: the owner's start CAS or ours first
        if (w & GEN_MASK) != (h >> 32) or ((w >> STATE_SHIFT) & STATE_MASK) != S_RUNNING:
            return C_POST_QUIET   # gone, or QUEUED: whoever starts it walks the mailbox
        cdef int64_t owner = <int64_t>(w >> WHO_SHIFT) - 1
        if owner < 0 or owner >= len(self.inboxes):
            return C_POST_QUIET
        if (<MPMCRing>self.inboxes[owner]).c_push(h) != ST_SUCCESS:   # release: the owner's pop acquires it
            return C_POST_INBOX_FULL - owner
        return owner | (C_POST_CONTROL if flags & AF_CONTROL else 0)

    cdef void _give_back(self, char *e) noexcept nogil:
        # Directory.give_back of one slot, from the sender that reserved it: seq_cst RMW,
        # pairs with the senders' reserve; wakes blocked senders if the mailbox was full
        cdef uint32_t old = st_fetch_add_seqcst_u32(e + D_COUNT, <uint32_t>-1)
        if old >= st_load_relaxed_u32(e + D_CAP):
            st_futex_wake(e + D_COUNT, 1 << 30)

    def msg_done(self, Py_ssize_t ent, uint64_t m):
        """Worker, the owner of the agent whose directory entry is at ``ent``: message
        ``m`` is handled (Directory.mark_done, then give_back of its mailbox slot, in one
        call; the Python twin is Directory.msg_done)."""
        if ent < 0 or ent + DIR_BYTES > self.region.size:
            raise ValueError(f"directory entry at {ent} lies outside the segment")
        cdef char *e = self.region.base + ent
        # release store: read (acquire) by a recoverer after our death, and by the stats;
        # before the slot is given back (seq_cst RMW in _give_back)
        st_store_release_u64(e + D_DONE, m + 1)
        self._give_back(e)

    def take_mail(self, Py_ssize_t ent, uint64_t seen):
        """Worker, the owner of the agent whose directory entry is at ``ent``, notified:
        clear AF_NOTIFIED, take the messages pushed since head value ``seen`` (oldest
        first), then read the flags.  Returns ``(flags, head, messages)``; the Python twin
        is Directory.take_mail (clear_notified, take, flags)."""
        if ent < 0 or ent + DIR_BYTES > self.region.size:
            raise ValueError(f"directory entry at {ent} lies outside the segment")
        cdef char *e = self.region.base + ent
        # seq_cst RMW: pairs with post_msg's fetch_or of AF_NOTIFIED (Directory.notify):
        # a message pushed after the walk below sets it again and notifies again
        wset_fetch_and_seqcst(e + D_FLAGS, ~(<uint64_t>AF_NOTIFIED))
        cdef uint64_t head
        out = self.c_take_chain(e, seen, &head)
        # seq_cst load after clearing NOTIFIED: pairs with stop's or64 (a stop is never missed)
        cdef uint64_t flags = st_load_seqcst_u64(e + D_FLAGS)
        return flags, head, out

    cdef list c_take_chain(self, char *e, uint64_t seen, uint64_t *head_out):
        # take_mail's walk (after its clear): the messages pushed since head value ``seen``,
        # oldest first; the head read goes to head_out
        # acquire: pairs with the senders' seq_cst CAS on D_HEAD (and the closing CAS)
        cdef uint64_t head = st_load_acquire_u64(e + D_HEAD) & (D_CLOSED - 1)
        cdef list out = []
        cdef uint64_t v = head
        cdef uint64_t m
        cdef Py_ssize_t steps = 0
        while v and v != seen:
            m = v - 1
            self._check_handle(m)
            out.append(m)
            # plain load: written by the sender before its push CAS, which the acquire
            # load of D_HEAD above (or of a later head) synchronises with
            v = (<uint64_t *>(self.rec(m) + R_NEXT))[0]
            steps += 1
            if <uint64_t>steps > self.nrecords:
                raise ValueError("corrupt mailbox chain: longer than the record count")
        out.reverse()
        head_out[0] = head
        return out

    def free_chain(self, uint64_t mark, uint64_t stop):
        """Worker, an agent's owner, once a checkpoint covers them: free its handled
        messages from ``mark`` (a handle + 1) down to, not including, ``stop`` (the walk of
        Directory.older).  A record whose payloads both sit inline is freed here; the
        others come back (None: none), in walk order, for Arena.free, which drops their
        blocks or files first.  The Python twin is Directory.free_older's loop."""
        cdef list rest = None
        cdef uint64_t v = mark
        cdef uint64_t m
        cdef char *r
        cdef Py_ssize_t steps = 0
        while v and v != stop:
            m = v - 1
            self._check_handle(m)
            r = self.rec(m)
            # plain load, before the free (the record may be reused at once after it):
            # written by the sender before its push, which our take synchronised with
            v = (<uint64_t *>(r + R_NEXT))[0]
            # plain loads: the payload fields are the owner's now (the message is handled)
            if (<uint32_t *>(r + R_PCLASS))[0] == 0 and (<uint32_t *>(r + R_RCLASS))[0] == 0:
                self.c_free(m)
            else:
                if rest is None:
                    rest = []
                rest.append(m)
            steps += 1
            if <uint64_t>steps > self.nrecords:
                raise ValueError("corrupt mailbox chain: longer than the record count")
        return rest

    def start(self, uint64_t h, Py_ssize_t current_off, uint64_t t_start,
              Py_ssize_t wait_hist_off=-1, uint64_t who=0):
        """Worker ``who - 1``: the ``start`` transition QUEUED -> RUNNING|who.

        The worker's current-task word is set to ``h + 1`` *before* the CAS,
        so a recoverer always finds a claimed record (records.py).  Returns
        None if ``h`` was not QUEUED (cancelled, stale, or a copy another
        worker started; the caller sorts that out).  Otherwise records the
        start time and queue wait and returns (kind, link, inline call
        payload bytes or None).  The call payload stays in the record.
        """
        cdef uint32_t kind
        cdef uint64_t link
        cdef bint started
        data = self.c_start(h, current_off, t_start, wait_hist_off, who, &started, &kind, &link)
        return (kind, link, data) if started else None

    cdef object c_start(self, uint64_t h, Py_ssize_t current_off, uint64_t t_start,
                        Py_ssize_t wait_hist_off, uint64_t who, bint *started,
                        uint32_t *kind, uint64_t *link):
        # start's body: started[0] False if h was not QUEUED; else kind, link and the inline
        # call payload (None when it is not inline).
        self._check_handle(h)
        self.region._check(current_off, 8)
        cdef char *r = self.rec(h)
        cdef uint64_t gen = h >> 32
        started[0] = False
        st_store_seqcst_u64(self.region.base + current_off, h + 1)  # the lease, read by the recoverer
        # seq_cst CAS, pairs with the client's cancel CAS and every other transition on the word.
        if not st_cas_seqcst_u64(r, gen | (<uint64_t>S_QUEUED << STATE_SHIFT),
                                 gen | (<uint64_t>S_RUNNING << STATE_SHIFT) | (who << WHO_SHIFT)):
            return None
        started[0] = True
        (<uint64_t *>(r + R_TSTART))[0] = t_start
        cdef uint64_t t_submit = (<uint64_t *>(r + R_TSUBMIT))[0]
        if wait_hist_off >= 0 and wait_hist_off + 64 + 8 * ST_HIST_NBUCKETS <= self.region.size:
            st_hist_record(self.region.base + wait_hist_off,
                           t_start - t_submit if t_start > t_submit else 0)
        kind[0] = (<uint32_t *>(r + R_KIND))[0]
        link[0] = (<uint64_t *>(r + R_LINK))[0]
        cdef uint64_t n
        if (<uint32_t *>(r + R_PCLASS))[0] == 0:
            n = (<uint64_t *>(r + R_PLEN))[0]
            if n > INLINE:
                raise ValueError(f"corrupt record {h:#x}: inline payload of {n} bytes")
            return PyBytes_FromStringAndSize(r + R_INLINE, <Py_ssize_t>n)
        return None

    cdef int c_finish(self, uint64_t h, uint32_t status, const char *data, Py_ssize_t n,
                      SPSCRing completions, uint64_t who) except -2:
        # finish_inline's body.
        self._check_handle(h)
        cdef char *r = self.rec(h)
        cdef uint64_t at = 0
        if (<uint32_t *>(r + R_PCLASS))[0] == 0:
            at = (<uint64_t *>(r + R_PLEN))[0]       # the call payload stays: a retry needs it
        if at > INLINE or n > INLINE - <Py_ssize_t>at:
            return 0
        if n:
            memcpy(r + R_INLINE + at, data, n)
        (<uint32_t *>(r + R_RCLASS))[0] = 0
        (<uint64_t *>(r + R_RLEN))[0] = <uint64_t>n
        cdef uint32_t kind = (<uint32_t *>(r + R_KIND))[0] & ~(<uint32_t>F_RBUFFERS)
        (<uint32_t *>(r + R_KIND))[0] = kind
        (<uint32_t *>(r + R_STATUS))[0] = status
        cdef uint64_t gen = h >> 32
        # seq_cst CAS (release of the result above): pairs with the consumer's acquire of the
        # word and with a recoverer's CAS after this worker's death
        if not st_cas_seqcst_u64(r, gen | (<uint64_t>S_RUNNING << STATE_SHIFT) | (who << WHO_SHIFT),
                                 gen | (<uint64_t>S_DONE << STATE_SHIFT) | (who << WHO_SHIFT)):
            return -1
        if (kind & K_MASK) != K_ROOT:
            return 2
        while completions.c_push(h) != ST_SUCCESS:   # release: the client's pop acquires the result
            pass                                       # capacity == records: cannot stay full
        st_fence_seqcst()                              # pairs with the client's park store + recheck
        cdef char *w = self.region.base + self.client_park_off
        # A client thread waiting on a future settles completions itself (_Pool.wait_for):
        # it, not the result thread, is woken; awake, it looks at the rings before it parks;
        # parked for one record (PARKED_BATCH) it is woken for that record's completion only
        # (the others are owed, paid before this worker idles, and it polls meanwhile).
        cdef char *ww = w + WAITER_PARK_AT
        cdef uint32_t v
        while True:
            v = st_load_relaxed_u32(ww)              # ordered by the fence above
            if v == WAITER_AWAKE or v == NOTIFIED:   # it looks at the rings before it parks
                return 1
            if v == PARKED_BATCH and st_load_relaxed_u64(w + WAITER_FOR_AT) != h:
                self.owed = True                     # (relaxed: ordered by the load of 3)
                return 1
            if v != PARKED and v != PARKED_BATCH:
                break                                # no waiter: the result thread's word
            # seq_cst CAS: pairs with the waiter's store of its park state and its re-check
            if st_cas_seqcst_u32(ww, v, NOTIFIED):
                st_futex_wake(ww, 1)
                return 1
        v = st_load_relaxed_u32(w)                   # ordered by the fence above
        if v == PARKED_BATCH:
            # Throughput mode (idle.ResultPolicy): no wake per completion.  The thread
            # polls every BATCH_POLL, and this worker wakes it before it idles
            # (Worker.search -> Idle.flush_client), so a batch is announced once.
            self.owed = True
            return 1
        # seq_cst CAS: pairs with the client's store of the park word (idle.client_park)
        if v == PARKED and st_cas_seqcst_u32(w, v, NOTIFIED):
            _hand_over(w)
            st_futex_wake(w, 1)
            # Let the woken result thread run now if it was queued on this CPU: with as
            # many busy workers as cores it otherwise waits out this worker's time slice
            # (latency bench, 2 cores: result-return p90 0.6 -> 0.2 ms, p99 -0.1 ms).
            sched_yield()
        return 1

    def finish_inline(self, uint64_t h, uint32_t status, bytes data not None,
                      SPSCRing completions, uint64_t who=0):
        """Worker ``who - 1``: store a small result inline, then the ``finish`` transition
        RUNNING|who -> DONE|who, then (a root task) push the completion.

        Returns 0 if ``data`` does not fit beside the call payload (use the
        Python path), -1 if the record is no longer RUNNING|who (nothing
        published), 1 when a root task was completed (client woken if
        parked), 2 for a child (the caller pings its parent).
        """
        return self.c_finish(h, status, <const char *>data, len(data), completions, who)

    def reply_inline(self, uint64_t rh, uint32_t status, bytes data not None,
                     SPSCRing completions, uint64_t who):
        """Worker ``who - 1``, an agent's reply to call slot ``rh`` (QUEUED, made by the
        caller): claim it (QUEUED|0 -> RUNNING|who), then :meth:`finish_inline`, in one
        call (the Python twin is Arena.reply_inline).  Returns -3 if it was not QUEUED|0
        (nothing done: cancelled by its caller, or a stale replay), else as finish_inline:
        0 when ``data`` does not fit (the slot is RUNNING|who, ours: store it the long
        way), -1, 1 (a client's call: completed, its waiter woken as finish_inline says),
        2 (an agent's call: the caller pings it)."""
        self._check_handle(rh)
        cdef char *r = self.rec(rh)
        cdef uint64_t gen = rh >> 32
        # seq_cst CAS, the claim: pairs with the caller's cancel CAS (QUEUED -> CANCELLED)
        # and with a recoverer's CAS after our death
        if not st_cas_seqcst_u64(r, gen | (<uint64_t>S_QUEUED << STATE_SHIFT),
                                 gen | (<uint64_t>S_RUNNING << STATE_SHIFT) | (who << WHO_SHIFT)):
            return -3
        return self.c_finish(rh, status, <const char *>data, len(data), completions, who)

    cdef object c_read_inline(self, uint64_t h):
        # read_inline's body: the inline pickle of record h, loaded, or None
        self._check_handle(h)
        cdef char *r = self.rec(h)
        cdef uint64_t n
        if (<uint32_t *>(r + R_PCLASS))[0] != 0 or (<uint32_t *>(r + R_KIND))[0] & F_BUFFERS:
            return None
        n = (<uint64_t *>(r + R_PLEN))[0]
        if n < 1 or n > INLINE or (<unsigned char *>(r + R_INLINE))[0] == SMALL:
            return None
        return _pickle_loads(PyBytes_FromStringAndSize(r + R_INLINE, <Py_ssize_t>n))

    def serve(self, e, Py_ssize_t ent, SPSCRing completions, uint64_t who, list counters,
              Py_ssize_t c_msgs, w, rq, inbox, int64_t start_ns, int64_t slice_ns, int batch,
              dumps):
        """Worker: :meth:`c_serve` (below), from Python."""
        return self.c_serve(e, ent, completions, who, counters, c_msgs, w, rq, inbox,
                            start_ns, slice_ns, batch, dumps)

    cdef tuple c_serve(self, Entry e, Py_ssize_t ent, SPSCRing completions, uint64_t who,
                       list counters, Py_ssize_t c_msgs, w, rq, inbox, int64_t start_ns,
                       int64_t slice_ns, int batch, dumps):
        """Worker ``who - 1``: the turn's messages of agent ``e`` (a worker/agents _Entry
        whose directory entry is at ``ent``), handled here one after another while each is
        a plain call: Host.deliver_batch's loop with Messages.deliver, handled and reply
        in one native call (its Python twin is that loop itself, which runs where this
        does not: STEALER_NO_FAST_TURN=1, failpoints, no extension; tests/test_fast_turn.py
        runs one script both ways).

        The caller made sure the fast path applies to the agent (no journal, nothing to
        replay, no failpoints).  Each message is checked before it is taken: an inline
        pickle, for ``e`` itself, no sender (journal), no deadline, a public method that
        is not ``step``/``on_stop``; else this returns ``(SERVE_SLOW, ...)`` with the
        message left first in ``e.pending`` for Messages.deliver.  Returns ``(code, a, b,
        c)``:

        * SERVE_EMPTY: nothing pending, or the agent suspended or blocked meanwhile;
        * SERVE_BREAK: the batch ends here (the batch's size, the slice of ``slice_ns``
          from ``start_ns`` while others wait or a higher tier is runnable, a stop);
        * SERVE_SLOW: the next message needs Messages.deliver;
        * SERVE_EXC ``(m, reply, exc)``: the handler raised (message not marked done);
        * SERVE_GEN ``(m, reply, generator)``: the handler is a generator or a coroutine
          (not done);
        * SERVE_REPLY ``(reply, -, value)``: handled and done; the value is not one
          ``dumps`` (stealer._fastpickle.dumps) writes: the caller replies the long way;
        * SERVE_AFTER ``(reply, done, data)``: handled, done, c_finish returned ``done``
          (0 or 2) for ``data``: the caller finishes as Messages.reply does.

        A call's reply slot is claimed (QUEUED|0 -> RUNNING|who) just before its handler
        starts, as Messages.claim does: from then on its caller's cancel() fails.  A slot
        that is not QUEUED|0 (cancelled, stale) is Messages.deliver's (SERVE_SLOW).
        """
        cdef uint64_t m, rh
        cdef int64_t reply
        cdef char *ep = self.region.base + ent
        cdef int done
        cdef Py_ssize_t handled
        if ent < 0 or ent + DIR_BYTES > self.region.size:
            raise ValueError(f"directory entry at {ent} lies outside the segment")
        pending = e.pending
        h = e.h
        obj = e.obj
        while True:
            if pending is None or not pending:
                return SERVE_EMPTY, None, None, None
            if e.state >= _SUSPENDED or e.blocked:
                return SERVE_EMPTY, None, None, None
            handled = e.handled
            if handled >= batch:
                return SERVE_BREAK, None, None, None
            if handled:
                # another agent waits (runnable, or notified since the turn began) and our
                # slice is over, or it has a higher tier (Host.deliver_batch)
                if (rq.n or len(inbox)) and (_now_ns() - <uint64_t>start_ns > <uint64_t>slice_ns
                                             or (rq.n and rq.top_tier() < e.tier)):
                    return SERVE_BREAK, None, None, None
                # seq_cst load: pairs with ref.stop()'s or64 of AF_STOP
                if st_load_seqcst_u64(ep + D_FLAGS) & AF_STOP:
                    e.stop = True
                    return SERVE_BREAK, None, None, None
            m = <uint64_t>pending[0]
            msg = self.c_read_inline(m)
            if type(msg) is not tuple or len(<tuple>msg) != 9:
                return SERVE_SLOW, None, None, None
            target, method, args, kwargs, rep, deadline, sender, _seq, _ack = <tuple>msg
            if (sender is not None or deadline is not None or target != h
                    or type(method) is not str or type(args) is not tuple
                    or method == "on_stop" or (method == "step" and _drives(obj))):
                return SERVE_SLOW, None, None, None
            fn = getattr(obj, method, None)
            if fn is None or not callable(fn):
                return SERVE_SLOW, None, None, None
            reply = rep
            if reply >= 0:
                rh = <uint64_t>reply
                self._check_handle(rh)
                # seq_cst CAS, the claim before the handler starts (Messages.claim): pairs
                # with the caller's cancel CAS (which fails from now on) and with a
                # recoverer's CAS after our death; not QUEUED (cancelled, stale): deliver
                if not st_cas_seqcst_u64(self.rec(rh), (rh >> 32) | (<uint64_t>S_QUEUED << STATE_SHIFT),
                                         (rh >> 32) | (<uint64_t>S_RUNNING << STATE_SHIFT)
                                         | (who << WHO_SHIFT)):
                    return SERVE_SLOW, None, None, None
            # taken: from here on as Messages.deliver
            pending.popleft()
            e.handled = handled + 1
            # plain store, the owner's record (as deliver's pack_into): how many steps came
            # before this message, for an exact replay after a restore
            (<uint64_t *>(self.rec(m) + R_TSTART))[0] = <uint64_t>e.steps
            e.msgs += 1
            e.events += 1
            counters[c_msgs] += 1
            w.in_body = True
            try:
                res = fn(*args, **kwargs) if kwargs else fn(*args)
            except BaseException as exc:
                w.in_body = False
                return SERVE_EXC, m, reply, exc
            w.in_body = False
            if type(res) is _GeneratorType or type(res) is _CoroutineType:  # (async def too)
                return SERVE_GEN, m, reply, res
            e.applied = m + 1  # its effect is in the state now (a checkpoint may cover it)
            # release store then seq_cst RMW, as msg_done: D_DONE for a recoverer, the slot back
            st_store_release_u64(ep + D_DONE, m + 1)
            self._give_back(ep)
            if reply >= 0:
                data = dumps(res)
                if data is None:
                    return SERVE_REPLY, reply, 0, res
                rh = <uint64_t>reply
                # (claimed at the start: RUNNING|who -> DONE|who)
                done = self.c_finish(rh, ST_OK, <const char *>PyBytes_AS_STRING(data),
                                     PyBytes_GET_SIZE(data), completions, who)
                if done != 1 and done != -1:
                    return SERVE_AFTER, reply, done, data
            if e.state == _WAITING and e.want_step is False and _drives(obj):
                e.want_step = True  # ctx.wait(): step again once a message was handled

    def read_inline(self, uint64_t h):
        """Worker: the call payload of record ``h`` read back (``serialize.load_call``'s
        result) when it is a pickle stored inline, else None (the caller reads it the long
        way, Arena.read_call): an agent's message, an agent's spawn.  The record is the
        caller's to read: a message's push (seq_cst CAS on the mailbox's D_HEAD) happened
        before the notification that brought its owner here; a spawn's start CAS (QUEUED ->
        RUNNING) acquired what its submitter wrote."""
        return self.c_read_inline(h)

    def finish_value(self, uint64_t h, value, SPSCRing completions, uint64_t who=0):
        """Worker: :meth:`finish_inline` of a plain result (``ST_OK``), encoded here: the
        small format written from the value, else an in-band pickle (raises ``_OutOfBand``
        at the first out-of-band buffer, before anything is stored).  Returns as
        finish_inline, except that a payload too long to sit beside the call comes back
        (bytes, nothing stored) for the Python path to store without encoding it again."""
        cdef unsigned char buf[258]
        buf[0] = SMALL
        cdef Py_ssize_t n = _enc_value(buf + 1, 257, value)
        cdef int done
        if n >= 0:
            done = self.c_finish(h, ST_OK, <const char *>buf, n + 1, completions, who)
            return done if done else PyBytes_FromStringAndSize(<char *>buf, n + 1)
        data = PyObject_Call(_pickle_dumps, (value, 5), _NO_OOB)
        done = self.c_finish(h, ST_OK, <const char *>(<bytes>data), len(<bytes>data),
                             completions, who)
        return done if done else data

    def start_task(self, uint64_t h, Py_ssize_t current_off, Py_ssize_t wait_hist_off=-1,
                   uint64_t who=0):
        """Worker: :meth:`start` at the time of the call (CLOCK_MONOTONIC); None, or
        ``(kind, link, inline call payload or None, start time)``."""
        cdef uint64_t t = _now_ns()
        cdef uint32_t kind
        cdef uint64_t link
        cdef bint started
        data = self.c_start(h, current_off, t, wait_hist_off, who, &started, &kind, &link)
        return (kind, link, data, t) if started else None

    def end_task(self, Py_ssize_t current_off, Py_ssize_t run_hist_off, uint64_t t_start):
        """Worker: nothing runs now (the current word cleared: a release store, read by a
        recoverer), the run time since ``t_start`` recorded in the histogram at
        ``run_hist_off`` (-1: none); returns the time now (CLOCK_MONOTONIC ns)."""
        self.region._check(current_off, 8)
        st_store_release_u64(self.region.base + current_off, 0)  # pairs with the recoverer's load64 (acquire)
        cdef uint64_t t = _now_ns()
        if run_hist_off >= 0:
            self.region.c_hist_record(run_hist_off, t - t_start if t > t_start else 0)
        return t

    cdef object c_take(self, uint64_t h, uint32_t *kind, uint32_t *status, uint64_t *link):
        # complete_take's body: the inline result (record freed), or None (record kept).
        self._check_handle(h)
        cdef char *r = self.rec(h)
        st_load_acquire_u64(r)                        # pairs with the finish CAS (DONE)
        kind[0] = (<uint32_t *>(r + R_KIND))[0]
        status[0] = (<uint32_t *>(r + R_STATUS))[0]
        link[0] = (<uint64_t *>(r + R_LINK))[0]
        cdef object data = None
        cdef uint64_t at, n
        if (<uint32_t *>(r + R_PCLASS))[0] == 0 and (<uint32_t *>(r + R_RCLASS))[0] == 0:
            at = (<uint64_t *>(r + R_PLEN))[0]
            n = (<uint64_t *>(r + R_RLEN))[0]
            if at > INLINE or n > INLINE - at:
                raise ValueError(f"corrupt record {h:#x}: inline result out of bounds")
            data = PyBytes_FromStringAndSize(r + R_INLINE + at, <Py_ssize_t>n)
            self.c_free(h)
        return data

    def complete_take(self, uint64_t h):
        """Client: (kind, status, link, inline result or None) of a completed record.

        When both the call and the result are inline, the result is copied
        out and the record freed; otherwise (data None) the record stays for
        the Python path to read and free.
        """
        cdef uint32_t kind, status
        cdef uint64_t link
        data = self.c_take(h, &kind, &status, &link)
        return kind, status, link, data

    def complete_batch(self, list hs, dict futures, object loads, object slow, object other):
        """Client: ``stealer.client.pool._Pool.complete_batch`` (the reference) in one native call.

        For each completed handle: an inline ``ST_OK`` result is unpickled with
        ``loads`` and set on its future, popped from ``futures``; a future
        nobody waits on and with no callbacks is settled here (``_result``,
        then ``_state``: no thread runs between the checks and the stores, the
        GIL is held throughout), any other through its ``_st_resolve``; no
        future: ``other([(fid, value), ...])`` once, at the batch's end (agents'
        final values: a shutdown of a million idle agents brings a million).
        Everything else (errors, out-of-line results, a failed unpickle) goes to
        ``slow(h, kind, status, fid, data)``.
        """
        cdef uint32_t kind, status
        cdef uint64_t link
        cdef object data, value, f
        cdef list others = None
        for hobj in hs:
            data = self.c_take(<uint64_t>hobj, &kind, &status, &link)
            if data is None or status != ST_OK or (kind & F_RBUFFERS):
                slow(hobj, kind, status, link, data)
                continue
            try:
                if _is_small(<bytes>data):
                    value = _dec_result(<const unsigned char *>PyBytes_AS_STRING(data),
                                        PyBytes_GET_SIZE(data))
                else:
                    value = loads(data)
            except BaseException:
                slow(hobj, kind, status, link, data)
                continue
            f = futures.pop(link, None)
            if f is None:
                if others is None:
                    others = []
                others.append((link, value))
            elif _silent(f):
                f._result = value
                f._state = _FINISHED
            else:
                try:
                    f._st_resolve(value, None)
                except _InvalidStateError:
                    pass  # cancelled meanwhile
        if others is not None:
            other(others)


    cdef object c_small_result(self, uint64_t h, uint64_t *link):
        # The small-format ST_OK result stored inline in completed record h, or _NO_VALUE
        # (anything else, or a corrupt record: left for complete_batch, which reports it).
        # Reads only: the record stays DONE.
        if (h & 0xFFFFFFFFU) >= self.nrecords:
            return _NO_VALUE
        cdef char *r = self.rec(h)
        st_load_acquire_u64(r)                        # pairs with the finish CAS (DONE)
        if ((<uint32_t *>(r + R_STATUS))[0] != ST_OK or (<uint32_t *>(r + R_KIND))[0] & F_RBUFFERS
                or (<uint32_t *>(r + R_PCLASS))[0] != 0 or (<uint32_t *>(r + R_RCLASS))[0] != 0):
            return _NO_VALUE
        cdef uint64_t at = (<uint64_t *>(r + R_PLEN))[0]
        cdef uint64_t n = (<uint64_t *>(r + R_RLEN))[0]
        if at > INLINE or n > INLINE - at or n < 1 or (<unsigned char *>(r + R_INLINE + at))[0] != SMALL:
            return _NO_VALUE
        try:
            value = _dec_result(<const unsigned char *>(r + R_INLINE + at), <Py_ssize_t>n)
        except ValueError:
            return _NO_VALUE
        link[0] = (<uint64_t *>(r + R_LINK))[0]
        return value

    def help_complete(self, list rings, dict futures):
        """Client, a thread about to wait (``stealer.client.pool._Pool.help``; the reference is
        ``_Pool.help_complete``): from the head of each completion ring, take the
        completions that need no Python code and settle their futures here, exactly as
        complete_batch does (a small-format result stored inline, a future in
        ``futures`` that nobody waits on and that has no callback); stop at the first
        other one, which the result thread takes, in ring order, as before.  So every
        completion but these goes through the result thread in the order it was
        published (its recovery of a dead worker drains the rings and relies on that),
        and no user code runs here.  One native call, no Python code: no other thread
        (nor a signal handler) runs between a look at a ring's head and its pop.
        Returns how many futures it settled.
        """
        cdef SPSCRing ring
        cdef uint64_t h, h2, link
        cdef object value, f
        cdef Py_ssize_t settled = 0
        for ring in rings:
            while ring.c_peek(&h) == ST_SUCCESS:
                value = self.c_small_result(h, &link)
                if value is _NO_VALUE:
                    break                   # (a corrupt handle too: complete_batch reports it)
                f = futures.get(link)
                if f is None or not _silent(f):
                    break
                ring.c_pop(&h2)             # == h: the only consumer while the GIL is held
                self.c_free(h)              # (complete_take's free of an all-inline record)
                del futures[link]           # an int key: no Python code runs until the stores
                f._result = value
                f._state = _FINISHED
                settled += 1
        return settled


cdef dict _DRIVES = {}  # agent class -> self-driven (_drives); cleared at 1024 classes


cdef bint _drives(object obj) except -1:
    """Twin of stealer.agents.api.drives_itself: self-driven unless it has no ``step`` or
    its class says ``self_driven = False``.  The class's answer is kept per class (a class
    of a message-only agent has no ``step``: a miss raises and clears an AttributeError
    inside, ~0.45 µs); an instance of a class that is not self-driven is asked itself (a
    ``step`` attribute of its own), as hasattr(obj, "step") was before."""
    cls = obj if isinstance(obj, type) else type(obj)
    v = _DRIVES.get(cls)  # 1: self-driven; 0: says self_driven = False; 2: has no step
    if v is None:
        if len(_DRIVES) >= 1024:
            _DRIVES.clear()
        v = _DRIVES[cls] = (0 if getattr(cls, "self_driven", None) is False
                            else 1 if hasattr(cls, "step") else 2)
    if v != 2 or obj is cls:
        return v == 1
    return hasattr(obj, "step")


cdef object _NO_VALUE = object()  # c_small_result: no small inline result there


DEF _SLEEPING = 2
DEF _FINISHED = 4
DEF _SERVE_BREAK = 1   # SERVE_EMPTY 0 and SERVE_BREAK 1 end the batch (HotPath.c_serve)
DEF _SERVE_SLOW = 2


from collections import deque as _deque


cdef class Turns:
    """Worker: an agent's turn in one native call when it is a plain one (plain calls to
    handle, a step to run): Host.turn and Host.after_turn for that case, around
    HotPath.c_serve (its Python twin is those two methods, which run where this does not:
    STEALER_NO_FAST_TURN=1, failpoints, a journal, no extension; tests/test_fast_turn.py
    runs one script both ways).

    :meth:`turn` returns False, having done nothing, for any other agent: one to stop, one
    with a deadline, one asleep, suspended, blocked or replaying, one with neither a
    message pending nor a step wanted.  Whatever a turn meets that is not plain (a message
    that needs Messages.deliver, a handler that raised or is a generator, a reply that is
    not small, the step itself, a checkpoint due, an outbox, a frame) goes to the Python
    method that handles it, from the same point of the turn.  Made once per worker by its
    Host."""
    cdef HotPath hot
    cdef Region region
    cdef object host, w, rq, inbox, dumps, agents
    cdef list counters, tier_wait, tier_run
    cdef SPSCRing completions
    cdef Py_ssize_t cur_off, dir_base, c_busy, c_msgs
    cdef uint64_t who
    cdef int64_t slice_ns, throttle_ns, flush_ns
    cdef int batch
    cdef bint metrics
    cdef Py_ssize_t ckpt_div     # 2 x the workers: Host.after_turn's records share
    cdef uint64_t nrecords
    cdef public uint64_t turns   # how many ran here (tests; stats)
    cdef object bal              # the Host's Balancer (worker/agents/balance.py)
    cdef public object got       # start: adopt's result for the agent it returned
    cdef Py_ssize_t runnable_off, searching_off, parked_off
    cdef uint64_t peers_mask
    # Balancer.least_loaded natively (set_peers; nworkers 0: Balancer.balance runs it all)
    cdef int nworkers, k
    cdef Py_ssize_t workers_off, worker_bytes, state_at, peer_runnable_at
    cdef uint32_t ready
    cdef list inboxes

    def __init__(self, HotPath hot not None, host, w, Py_ssize_t dir_base, Py_ssize_t c_busy,
                 Py_ssize_t c_msgs, int64_t slice_ns, int batch, int64_t throttle_ns,
                 int64_t flush_ns, dumps, Py_ssize_t searching_off, Py_ssize_t parked_off):
        if dir_base < 0 or dir_base + <Py_ssize_t>(hot.nrecords * DIR_BYTES) > hot.region.size:
            raise ValueError("the agent directory does not fit the region")
        hot.region._check(searching_off, 8)
        hot.region._check(parked_off, 8)
        hot.region._check(host.runnable_off, 4)
        self.searching_off = searching_off
        self.parked_off = parked_off
        self.runnable_off = host.runnable_off
        self.peers_mask = host.peers_mask
        self.bal = host.bal
        self.hot = hot
        self.region = hot.region
        self.host = host
        self.w = w
        self.rq = host.rq
        self.agents = host.agents
        self.inbox = w.inbox
        self.completions = w.completions
        self.counters = w.c
        self.metrics = bool(w.metrics_on)
        self.tier_wait = list(w.mbase_tier_wait)
        self.tier_run = list(w.mbase_tier_run)
        self.cur_off = w.cur_off
        self.region._check(self.cur_off, 8)
        self.who = host.who
        self.dir_base = dir_base
        self.c_busy = c_busy
        self.c_msgs = c_msgs
        self.slice_ns = slice_ns
        self.batch = batch
        self.throttle_ns = throttle_ns
        self.flush_ns = flush_ns
        self.dumps = dumps
        self.ckpt_div = 2 * <Py_ssize_t>w.n
        self.nrecords = hot.nrecords
        self.turns = 0

    def set_peers(self, Py_ssize_t workers_off, Py_ssize_t worker_bytes, int k,
                  list inboxes not None, Py_ssize_t state_at, Py_ssize_t runnable_at,
                  uint32_t ready):
        """Where run_next's balance looks at the peers (Balancer.least_loaded's words):
        worker j's W_STATE at ``workers_off + j * worker_bytes + state_at`` (``ready``: one
        that takes agents), its W_RUNNABLE at ``runnable_at``, its inbox ``inboxes[j]``; we
        are worker ``k``."""
        cdef int n = len(inboxes)
        if n < 1 or not 0 <= k < n:
            raise ValueError("worker k out of range")
        self.region._check(workers_off + state_at, 4)
        self.region._check(workers_off + worker_bytes * (n - 1) + max(state_at, runnable_at), 4)
        for q in inboxes:
            if not isinstance(q, _Ring):
                raise TypeError("inboxes must be native rings")
        self.workers_off = workers_off
        self.worker_bytes = worker_bytes
        self.k = k
        self.inboxes = inboxes
        self.state_at = state_at
        self.peer_runnable_at = runnable_at
        self.ready = ready
        self.nworkers = n

    def least_loaded(self, Py_ssize_t mine):
        """Balancer.least_loaded natively (after set_peers): ``(best, low)``."""
        if self.nworkers <= 0:
            raise RuntimeError("set_peers was not called")
        cdef Py_ssize_t low = mine
        cdef int best = self.c_least_loaded(&low)
        return best, low

    cdef int c_least_loaded(self, Py_ssize_t *low) noexcept:
        cdef int j, best = -1
        cdef Py_ssize_t v
        cdef char *b
        cdef _Ring q
        cdef uint64_t c
        for j in range(self.nworkers):
            if j == self.k:
                continue
            b = self.region.base + self.workers_off + self.worker_bytes * j
            # acquire loads, as Region.load32: pair with the peer's seq_cst stores of its
            # W_STATE / W_RUNNABLE (hints, re-read at every check)
            if st_load_acquire_u32(b + self.state_at) != self.ready:
                continue
            q = <_Ring>self.inboxes[j]
            # acquire loads, as _Ring.__len__ (consumer first): pair with the ring's
            # pushers' and popper's updates of prod_p / cons_p
            c = st_load_acquire_u64(q.cons_p)
            v = <Py_ssize_t>st_load_acquire_u32(b + self.peer_runnable_at)
            c = st_load_acquire_u64(q.prod_p) - c
            v += <Py_ssize_t>c if <int64_t>c > 0 else 0
            if v < low[0]:
                best = j
                low[0] = v
        return best

    def start(self, uint64_t h, Py_ssize_t current_off, Py_ssize_t wait_hist_off):
        """Worker.execute's start of record ``h`` (its twin: HotPath.start_task, then for an
        agent the current word cleared and Host.adopt): 0 if ``h`` was not QUEUED (the
        caller's not_started); 1 when it was an agent and :meth:`adopt` held it dormant
        (all done); else ``(kind, link, inline payload or None, start time)`` as
        start_task's: a task to run, or an agent the caller gives to Host.adopt with
        :attr:`got`, :meth:`adopt`'s result (a task's path stays start_task's: an int
        or that tuple, nothing more to look at)."""
        cdef uint64_t t = _now_ns()
        cdef uint32_t kind
        cdef uint64_t link
        cdef bint started
        data = self.hot.c_start(h, current_off, t, wait_hist_off, self.who, &started, &kind,
                                &link)
        if not started:
            return 0
        if not (kind & F_AGENT):
            return (kind, link, data, t)
        # it lives here now, not as the task this worker runs: seq_cst store, as
        # Region.store64 in Worker.execute (read by a recoverer's load of the word)
        st_store_seqcst_u64(self.region.base + current_off, 0)
        got = self.adopt(h, link)
        if got == 1:
            return 1
        self.got = got
        return (kind, link, data, t)

    def adopt(self, uint64_t h, uint64_t link):
        """Host.adopt of an agent fresh from its spawn with nothing to do, held dormant
        (stealer/worker/agents/dormant.py): the common case of ``spawn_agents``, in one
        native call (a million agents took ~9 µs of a worker's CPU each in Python).  Its
        twin is Host.adopt with dormant.adopt, which run everything else.

        Returns 1 when done (the object built and held dormant); 0 when it is not that
        case, having done only what Host.adopt does first and does again (clear
        AF_NOTIFIED, note the owner): shutting down, taken back from a peer, a checkpoint,
        moving, a spawn not stored inline, a deadline, a journal, a ``step`` method, a
        stop asked, a control agent, a message; 2 when built and held but it needs
        dormant.built (a ``step`` attribute on the object, a message pushed meanwhile);
        ``(exc, gen, spawn)`` when building it raised (dormant.failed)."""
        host = self.host
        if host.stopping or (host.away and h in host.away):
            return 0
        self.hot._check_handle(h)
        cdef char *ep = self.region.base + self.dir_base + DIR_BYTES * <Py_ssize_t>(h & 0xFFFFFFFF)
        # seq_cst RMW, before the looks at the mailbox below: pairs with a sender's
        # fetch_or of AF_NOTIFIED (Directory.clear_notified, as Host.adopt)
        wset_fetch_and_seqcst(ep + D_FLAGS, ~(<uint64_t>AF_NOTIFIED))
        # stats only (read by collect()): ours now, its migrations kept; acquire load and
        # seq_cst store as Region.load32/store32 (Host.adopt's)
        cdef uint32_t owner = st_load_acquire_u32(ep + D_OWNER)
        if (owner & OWNER_MASK) == OWNER_MOVING:
            return 0                                 # published by a peer: Host.adopt counts it
        st_store_seqcst_u32(ep + D_OWNER, (owner & ~(<uint32_t>OWNER_MASK)) | <uint32_t>self.who)
        if st_load_acquire_u64(ep + D_CKPT):         # pairs with checkpoint()'s store
            return 0
        # seq_cst loads: pair with the or64 of a stop and the CAS of a push (mailbox.py)
        if (st_load_seqcst_u64(ep + D_FLAGS) & (AF_STOP | AF_CONTROL)
                or st_load_seqcst_u64(ep + D_HEAD)):
            return 0
        try:
            spawn = self.hot.c_read_inline(h)
        except BaseException:
            return 0                                 # Host.adopt reads it again and fails it
        if type(spawn) is not tuple or len(<tuple>spawn) < 5 or spawn[4] is not None or (
                len(<tuple>spawn) > 5 and spawn[5] is not None):
            return 0
        cls = spawn[0]
        if type(cls) is int:
            try:
                cls = self.w.fns.get(cls)
            except BaseException:
                return 0                             # Host.adopt loads it again and fails it
        # per class (_drives): hasattr(cls, "step")'s miss raises and clears an
        # AttributeError inside (~0.45 µs, a sixth of an adoption)
        if _drives(cls):
            return 0
        cdef uint32_t gen = (<uint32_t *>(self.hot.rec(h) + R_TRIES))[0]   # ours: RUNNING here
        args = spawn[1]
        kwargs = spawn[2]
        w = self.w
        w.in_body = True
        try:
            obj = cls(*args, **kwargs) if kwargs else cls(*args)
        except BaseException as exc:
            w.in_body = False
            return (exc, gen, spawn)
        w.in_body = False
        st_store_seqcst_u32(ep + D_GEN, gen)         # stats only: read by collect()
        host.dormant[h] = obj
        # seq_cst load: pairs with a sender's CAS of D_HEAD (a message pushed meanwhile)
        if _drives(obj) or st_load_seqcst_u64(ep + D_HEAD):
            return 2
        return 1

    def stop_dormant(self, dict dormant, dict has_stop, bytes none not None):
        """Shutdown, dormant agents (stealer.worker.agents.dormant.stop_all, whose loop is
        the twin): for each agent of ``dormant`` (handle -> object; emptied) whose class
        has no ``on_stop`` (``has_stop``: class -> bool, filled as met) and whose mailbox
        is empty: close the mailbox and report ``none`` (the final value None, encoded)
        inline, in one native pass (a million idle agents took ~3 µs each in Python).

        Returns ``(rest, unreported)``: ``rest`` the ``(h, obj)`` pairs left to the Python
        loop untouched (an ``on_stop`` to call; a message came: the mailbox is not closed
        here); ``unreported`` the ``(h, link)`` of agents closed here whose value did not
        fit the record's inline bytes beside their spawn payload (the caller reports
        them through ``Worker.report_encoded``)."""
        cdef list rest = []
        cdef list unreported = []
        cdef char *base = self.region.base + self.dir_base
        cdef char *ep
        cdef char *r
        cdef uint64_t h, link
        cdef int done
        cdef const char *data = <const char *>none
        cdef Py_ssize_t n = len(none)
        try:
            while dormant:
                hobj, obj = dormant.popitem()
                t = type(obj)
                fn = has_stop.get(t)
                if fn is None:
                    fn = has_stop[t] = getattr(t, "on_stop", None) is not None
                if fn:
                    rest.append((hobj, obj))
                    continue
                h = <uint64_t>hobj
                try:
                    self.hot._check_handle(h)
                except BaseException:
                    rest.append((hobj, obj))     # the Python loop meets it (and says why)
                    raise
                ep = base + DIR_BYTES * <Py_ssize_t>(h & 0xFFFFFFFF)
                # close an empty mailbox: acquire loads (pair with a sender's seq_cst CAS
                # of D_HEAD and its fetch_add of D_COUNT), then the seq_cst CAS that closes
                # it (pairs with a sender's CAS of D_HEAD: it sees CLOSED, or we see its push)
                if (st_load_acquire_u64(ep + D_HEAD) or st_load_acquire_u32(ep + D_COUNT)
                        or not st_cas_seqcst_u64(ep + D_HEAD, 0, D_CLOSED)):
                    rest.append((hobj, obj))
                    continue
                r = self.hot.rec(h)
                link = (<uint64_t *>(r + R_LINK))[0]  # its spawner's, written before QUEUED
                done = self.hot.c_finish(h, ST_OK, data, n, self.completions, self.who)
                if done == 0:
                    unreported.append((hobj, link))
        except BaseException:
            # nothing popped is dropped: what is left to do goes back (the caller's loop,
            # or its error path, still sees every agent that was dormant)
            dormant.update(rest)
            raise
        return rest, unreported

    def run_next(self):
        """Host.run_next (its twin): the next runnable agent's turn, with the run queue's
        pop (RunQueue.pop: a tier's FIFO here, its deadline heap there), the runnable count
        published, an agent offered to an idle peer, the balancer's turn and its checks."""
        rq = self.rq
        if not rq.n:
            return
        cdef int t
        cdef Entry e = None
        for t in range(3):  # NTIERS
            if rq.edf[t]:
                e = rq.pop()  # an agent with a deadline: its heap (runqueue.py)
                break
            q = rq.fifo[t]
            if q:
                e = q.popleft()
                rq.n -= 1
                if t == 0:
                    rq.n0 -= 1
                break
        if e is None:
            return
        e.queued = False
        if e.state == _FINISHED:
            return
        host = self.host
        cdef uint64_t turns = host.turns + 1
        host.turns = turns
        cdef Py_ssize_t n = rq.n
        cdef char *base = self.region.base
        # seq_cst store (Region.store32's): read by idle peers (Host.poke_peers)
        st_store_seqcst_u32(base + self.runnable_off, <uint32_t>n)
        cdef uint64_t idle
        bal = self.bal
        if n:
            # a peer searching or parked (first 64 workers; acquire loads, as Region.load64:
            # pair with the peers' seq_cst or64 of their bits; a hint, re-checked by the
            # thief's own steal)
            idle = ((st_load_acquire_u64(base + self.searching_off)
                     | st_load_acquire_u64(base + self.parked_off)) & self.peers_mask)
            # (Balancer.pays_to_idle's first test here: told "no" less than 1 ms ago, it
            # says no again; a lockstep round's end asked it at every turn)
            if idle and <int64_t>_now_ns() >= <int64_t>bal.quiet_until:
                host.offer(e, idle)
        if bal.on and not bal.busy.cur:
            bal.note_busy(1)  # Balancer.turn: busy from now on
        cdef Py_ssize_t mine, low
        cdef int best
        if turns & 7 == 0 and rq.n >= 2 and bal.on:  # (after offer: it may have published)
            if self.nworkers > 0:  # Balancer.balance: its look here, the rest only if due
                mine = rq.n + len(self.inbox)
                low = mine
                best = self.c_least_loaded(&low)
                if best >= 0 or bal.prev >= 0:
                    bal.balance_with(best, low, mine)
            else:
                bal.balance()
        if turns & 63 == 0:
            host.every_64_turns()
        if not self.c_turn(e):
            host.turn(e)

    def turn(self, Entry e not None):
        """Agent ``e``'s turn (a worker/agents _Entry just popped from the run queue), if
        it is a plain one: True; False (nothing done) if Host.turn must run it."""
        return self.c_turn(e)

    cdef bint c_turn(self, Entry e) except -1:
        if e.stop or e.deadline is not None or e.state > _WAITING or e.blocked or e.replay:
            return False
        pending = e.pending
        if (pending is None or not pending) and not e.want_step:
            return False
        cdef object host = self.host
        cdef object w = self.w
        cdef uint64_t h = <uint64_t>e.h
        if (h & 0xFFFFFFFF) >= self.nrecords:
            raise ValueError(f"agent handle {h:#x} names no record")
        cdef Py_ssize_t ent = self.dir_base + DIR_BYTES * <Py_ssize_t>(h & 0xFFFFFFFF)
        cdef char *ep = self.region.base + ent
        cdef int tier = e.tier
        cdef uint64_t t0, t1
        cdef int64_t dt, tn, nested
        cdef tuple res
        cdef int code
        # release: read by the recoverer after our death (Host.turn's store)
        st_store_release_u64(self.region.base + self.cur_off, h + 1)
        w.cur = e.cur
        w.frame = e.frame
        host.current = e
        t0 = _now_ns()
        if self.metrics:
            self.region.c_hist_record(self.tier_wait[tier],
                                      <uint64_t>max(<int64_t>(t0 - <uint64_t>e.ready_at), 0))
        e.handled = 0
        self.turns += 1
        try:
            # Host.deliver_batch's loop, its native part here
            while e.pending and e.state < _SUSPENDED and not e.blocked:
                res = self.hot.c_serve(e, ent, self.completions, self.who, self.counters,
                                       self.c_msgs, w, self.rq, self.inbox, <int64_t>t0,
                                       self.slice_ns, self.batch, self.dumps)
                code = <int>res[0]
                if code <= _SERVE_BREAK:
                    break
                if code != _SERVE_SLOW:
                    host.served(e, res[0], res[1], res[2], res[3])
                    continue
                host.deliver_batch(e, <int64_t>t0)  # the rest in Python, same slice
                break
            if not (e.state >= _SUSPENDED or e.blocked or e.stop):
                if e.want_step and e.state <= _WAITING:  # ctx.wait() and a message came
                    host.step(e)
        finally:
            host.current = None
            w.frame = None
            w.cur = None
            # release: nothing runs (read by the recoverer after our death)
            st_store_release_u64(self.region.base + self.cur_off, 0)
            t1 = _now_ns()
            dt = <int64_t>(t1 - t0)
            nested = host.nested_ns
            if nested:  # control turns ran inside this one (inline.py): theirs
                dt = max(0, dt - nested)
                host.nested_ns = 0
            if e.tier == 0:
                w.flush_client()  # a control agent's replies go out now
            e.cpu_ns += dt
            e.win_cpu += dt
            tn = e.turn_ns  # moving averages: Host.turn
            e.turn_ns = dt if not tn else (3 * tn + min(dt, 4 * tn)) >> 2
            tn = host.turn_avg
            host.turn_avg = dt if not tn else (7 * tn + min(dt, 4 * tn)) >> 3
            self.counters[self.c_busy] += dt
            if self.metrics:
                self.region.c_hist_record(self.tier_run[tier], <uint64_t>dt)
                if <int64_t>t0 - <int64_t>host.flushed > self.flush_ns:
                    host.flushed = t0
                    w.flush()  # counters reach stats() while agents keep the worker busy
            if e.state != _FINISHED:
                self.after(e, ep, t1)
        return True

    def ping(self, uint64_t h):
        """Worker loop: inbox entry ``h``, when it names an agent living here: its
        notification handled (Pings.clear, then Host.notify with HotPath.take_mail and
        Host.schedule): True.  False, with nothing done: ForkJoinHandling.on_ping (the
        twin of both) handles it."""
        if (h & 0xFFFFFFFF) >= self.nrecords:
            return False
        cdef Entry e = self.agents.get(h)
        cdef char *ep = self.region.base + self.dir_base + DIR_BYTES * <Py_ssize_t>(h & 0xFFFFFFFF)
        if e is None:
            return self.arrive(h, ep)
        # seq_cst RMW: Pings.clear's (pairs with Pings.ping's or64 of AF_PINGED: a child
        # done after this sends a fresh ping) and take_mail's (pairs with post_msg's
        # fetch_or of AF_NOTIFIED: a message pushed after the walk notifies again) in one
        wset_fetch_and_seqcst(ep + D_FLAGS, ~(<uint64_t>(AF_NOTIFIED | AF_PINGED)))
        cdef uint64_t head
        got = self.hot.c_take_chain(ep, <uint64_t>e.seen, &head)
        # seq_cst load after the clear: pairs with stop's or64 (a stop is never missed)
        cdef uint64_t flags = st_load_seqcst_u64(ep + D_FLAGS)
        e.seen = head
        if got:  # Adoption.add_pending
            pending = e.pending
            if pending is None:
                e.pending = _deque(got)
            else:
                pending.extend(got)
        if flags & AF_STOP:
            e.stop = True
            self.schedule(e, 0)
        elif e.state == _SUSPENDED:
            if self.host.ready(e):
                self.schedule(e, 0)
        elif e.pending or e.outbox:
            self.schedule(e, 0)
        return True

    cdef bint arrive(self, uint64_t h, char *ep) except -1:
        """:meth:`ping` of a record that is no agent living here: an agent sent to this
        worker to start (``spawn_agents``' share of a batch, a peer's hand-over) is started
        as ForkJoinHandling.on_ping does (Pings.clear, then Worker.execute while it is
        QUEUED): True.  False, with nothing done, for anything else (a dormant agent, a
        task's frame, not an agent's record): on_ping handles it."""
        host = self.host
        if host.dormant and h in host.dormant:
            return False                             # Adoption.notify thaws it
        cdef char *r = self.hot.rec(h)
        if not ((<uint32_t *>(r + R_KIND))[0] & F_AGENT):  # written before the push we popped
            return False
        # seq_cst RMW: Pings.clear's (pairs with Pings.ping's or64 of AF_PINGED)
        wset_fetch_and_seqcst(ep + D_FLAGS, ~(<uint64_t>AF_PINGED))
        # acquire: pairs with the seq_cst CASes on the state word (spawn's publication,
        # a peer's hand-over); a stale or no longer QUEUED copy is dropped, as on_ping does
        cdef uint64_t w = st_load_acquire_u64(r)
        if (w & GEN_MASK) == (h >> 32) and ((w >> STATE_SHIFT) & STATE_MASK) == S_QUEUED:
            self.w.execute(h)
        return True

    cdef int schedule(self, Entry e, uint64_t now) except -1:
        """Host.schedule (Adoption.schedule and RunQueue.push, their twin): an agent with
        no deadline and no CPU share to the back of its tier's FIFO; the others to it."""
        if e.queued or e.state == _FINISHED or (e.blocked and not e.stop):
            return 0
        if e.deadline is not None or e.opts.cpu_share is not None:
            self.host.schedule(e, now)
            return 0
        e.queued = True
        e.ready_at = now or _now_ns()
        cdef int tier = e.tier
        rq = self.rq
        rq.fifo[tier].append(e)
        rq.n += 1
        if tier == 0:
            rq.n0 += 1
        return 0

    cdef int after(self, Entry e, char *ep, uint64_t now) except -1:
        """Host.after_turn, its plain case here; the others go to it."""
        if <int64_t>(now - <uint64_t>e.win_start) > self.throttle_ns:
            e.win_start = now
            e.win_cpu = 0
            self.publish(e, ep)  # every 100 ms of an agent's life, and when it idles
        cdef int st = e.state
        if (e.frame is not None or e.outbox or st == _SUSPENDED or st == _SLEEPING
                or e.deadline is not None):
            self.host.after_turn(e, now)  # its window was looked at above: not again
            return 0
        cdef Py_ssize_t events = e.events
        cdef Py_ssize_t share
        if events:
            opts = e.opts
            # records share (Host.after_turn): half the records over this worker's agents
            # times the workers
            share = <Py_ssize_t>self.nrecords // (self.ckpt_div * len(self.agents) + 1)
            if share <= 0:
                share = 1
            if (events >= min(<Py_ssize_t>opts.checkpoint_every, share)
                    or <int64_t>(now - <uint64_t>e.ckpt_time) > <int64_t>opts.checkpoint_ns):
                self.host.checkpoint(e)
        if e.pending or (e.want_step and e.state <= _WAITING):
            self.schedule(e, now)
            return 0
        self.publish(e, ep)
        return 0

    cdef inline void publish(self, Entry e, char *ep):
        # Host.publish_stats: stats only (single writer, this worker; read by collect)
        st_store_release_u64(ep + D_CPU_NS, <uint64_t>e.cpu_ns)
        st_store_seqcst_u32(ep + D_STEPS, <uint32_t>(<uint64_t>e.steps & 0xFFFFFFFF))
        st_store_seqcst_u32(ep + D_MSGS, <uint32_t>(<uint64_t>e.msgs & 0xFFFFFFFF))


cdef inline bint _silent(object f) except -1:
    # A pending future nobody waits on and with no callback: settling it needs no Python
    # code (_result, then _state; the GIL is held from this check to those stores).
    return f._st_cond is None and f._st_cb is None and f._state == _PENDING


cdef str _PENDING = "PENDING"      # concurrent.futures._base's states (checked at import
cdef str _FINISHED = "FINISHED"    # by stealer.client.futures, which owns the Future subclass)
from concurrent.futures import InvalidStateError as _InvalidStateError


# -- the small format (stealer/shared/serialize.py holds its description and Python reference) --
cdef enum:
    SMALL = 0x01
    V_NONE = 0
    V_FALSE = 1
    V_TRUE = 2
    V_INT = 3
    V_FLOAT = 4
    V_STR = 5
    V_BYTES = 6


cdef Py_ssize_t _enc_value(unsigned char *out, Py_ssize_t room, object v) noexcept:
    # v's small encoding at out; its length, or -1 if v has none or it needs more than room.
    # Never leaves an exception set.
    cdef type t = type(v)
    cdef long long x
    cdef int overflow = 0
    cdef double d
    cdef const char *s
    cdef Py_ssize_t n
    if v is None:
        if room < 1:
            return -1
        out[0] = V_NONE
        return 1
    if t is bool:
        if room < 1:
            return -1
        out[0] = V_TRUE if v is True else V_FALSE
        return 1
    if t is int:
        x = PyLong_AsLongLongAndOverflow(v, &overflow)
        if overflow or room < 9:
            return -1
        out[0] = V_INT
        memcpy(out + 1, &x, 8)          # host byte order, as the reference ("=q")
        return 9
    if t is float:
        if room < 9:
            return -1
        d = PyFloat_AS_DOUBLE(v)
        out[0] = V_FLOAT
        memcpy(out + 1, &d, 8)
        return 9
    if t is str:
        s = PyUnicode_AsUTF8AndSize(v, &n)
        if s == NULL:                     # lone surrogates: pickle keeps them
            PyErr_Clear()
            return -1
    elif t is bytes:
        s = PyBytes_AS_STRING(v)
        n = PyBytes_GET_SIZE(v)
    else:
        return -1
    if n > 255 or room < 2 + n:
        return -1
    out[0] = V_STR if t is str else V_BYTES
    out[1] = <unsigned char>n
    memcpy(out + 2, s, n)
    return 2 + n


cdef object _dec_value(const unsigned char *p, Py_ssize_t n, Py_ssize_t *pos):
    cdef Py_ssize_t i = pos[0]
    cdef long long x
    cdef double d
    cdef Py_ssize_t m
    if i >= n:
        raise ValueError("corrupt small payload: truncated")
    cdef unsigned char tag = p[i]
    if tag == V_NONE or tag == V_FALSE or tag == V_TRUE:
        pos[0] = i + 1
        return None if tag == V_NONE else (tag == V_TRUE)
    if tag == V_INT or tag == V_FLOAT:
        if i + 9 > n:
            raise ValueError("corrupt small payload: truncated")
        pos[0] = i + 9
        if tag == V_INT:
            memcpy(&x, p + i + 1, 8)
            return x
        memcpy(&d, p + i + 1, 8)
        return d
    if tag == V_STR or tag == V_BYTES:
        if i + 2 > n or i + 2 + p[i + 1] > n:
            raise ValueError("corrupt small payload: a string runs past its end")
        m = p[i + 1]
        pos[0] = i + 2 + m
        if tag == V_STR:
            return PyUnicode_DecodeUTF8(<const char *>(p + i + 2), m, NULL)
        return PyBytes_FromStringAndSize(<const char *>(p + i + 2), m)
    raise ValueError(f"corrupt small payload: unknown tag {tag}")


cdef Py_ssize_t _enc_call(unsigned char *out, Py_ssize_t room, object fref, tuple args) noexcept:
    # (fref, args, None) in the small format at out; its length, or -1.
    cdef Py_ssize_t nargs = len(args)
    cdef Py_ssize_t at = 6, k
    cdef int overflow = 0
    cdef long long f
    if type(fref) is not int or nargs > 255 or room < 6:
        return -1
    f = PyLong_AsLongLongAndOverflow(fref, &overflow)
    if overflow or f < 0 or f > 0xFFFFFFFF:
        return -1
    cdef uint32_t f32 = <uint32_t>f
    out[0] = SMALL
    memcpy(out + 1, &f32, 4)
    out[5] = <unsigned char>nargs
    for a in args:
        k = _enc_value(out + at, room - at, a)
        if k < 0:
            return -1
        at += k
    return at


def encode_small(value):
    """``stealer.shared.serialize.encode_small``, natively."""
    cdef unsigned char buf[258]
    buf[0] = SMALL
    cdef Py_ssize_t n = _enc_value(buf + 1, 257, value)
    return None if n < 0 else PyBytes_FromStringAndSize(<char *>buf, n + 1)


def encode_small_call(fref, tuple args, Py_ssize_t limit=1 << 30):
    """``stealer.shared.serialize.encode_small_call``, natively (what ClientSubmit writes)."""
    cdef Py_ssize_t room = 6 + 258 * len(args)
    cdef bytearray buf = bytearray(room)
    cdef Py_ssize_t n = _enc_call(<unsigned char *>PyByteArray_AS_STRING(buf), room, fref, args)
    if n < 0 or n > limit:
        return None
    return bytes(buf[:n])


cdef inline bint _is_small(bytes data) noexcept:
    return PyBytes_GET_SIZE(data) > 0 and (<const unsigned char *>PyBytes_AS_STRING(data))[0] == SMALL


cdef object _dec_result(const unsigned char *p, Py_ssize_t n):
    # A whole result payload in the small format (p[0] is SMALL).
    cdef Py_ssize_t pos = 1
    v = _dec_value(p, n, &pos)
    if pos != n:
        raise ValueError("corrupt small payload: bytes after its value")
    return v


def load_value(data):
    """``stealer.shared.serialize.load_value``, natively: a result payload, small or pickled."""
    if type(data) is not bytes:  # (the readers pass bytes; anything else is copied once)
        data = bytes(data)
    if not _is_small(<bytes>data):
        return _pickle_loads(data)
    return _dec_result(<const unsigned char *>PyBytes_AS_STRING(data), PyBytes_GET_SIZE(data))


def load_call(data):
    """``stealer.shared.serialize.load_call``, natively: ``(fref, args, kwargs)`` of a call (the
    worker's, per task: bytes, no buffer set-up)."""
    if type(data) is not bytes:
        data = bytes(data)
    if not _is_small(<bytes>data):
        return _pickle_loads(data)
    return _dec_call(<const unsigned char *>PyBytes_AS_STRING(data), PyBytes_GET_SIZE(data))


cdef tuple _dec_call(const unsigned char *p, Py_ssize_t n):
    cdef uint32_t f32
    cdef Py_ssize_t pos = 6, i
    if n < 6:
        raise ValueError("corrupt small payload: truncated")
    memcpy(&f32, p + 1, 4)
    cdef Py_ssize_t nargs = p[5]
    cdef tuple args = PyTuple_New(nargs)
    for i in range(nargs):
        v = _dec_value(p, n, &pos)
        Py_INCREF(v)
        PyTuple_SET_ITEM(args, i, v)
    if pos != n:
        raise ValueError("corrupt small payload: bytes after its arguments")
    return (f32, args, None)


from pickle import dumps as _pickle_dumps, loads as _pickle_loads


from types import GeneratorType as _GeneratorType
from types import CoroutineType as _CoroutineType

# HotPath.serve's results (stealer/worker/agents/host.py reads them)
SERVE_EMPTY, SERVE_BREAK, SERVE_SLOW, SERVE_EXC, SERVE_GEN, SERVE_REPLY, SERVE_AFTER = range(7)


def set_loads(f):
    """The pickle reader of this module's inline reads (serialize.py sets the native
    reader of small pickles, stealer._fastpickle.loads, which falls back to pickle's)."""
    global _pickle_loads
    _pickle_loads = f


class _OutOfBand(Exception):
    """Raised by the fast submit's pickler at the first out-of-band buffer (before it is
    copied): such a payload takes the Python path, which keeps its buffers apart."""


# serialize.INBAND_MAX: a buffer up to this size is pickled in-band (the reference's rule)
cdef Py_ssize_t INBAND_MAX = 2048


def _refuse_buffers(buf):
    if memoryview(buf).nbytes <= INBAND_MAX:
        return True   # small (an array of a few hundred numbers): in the pickle itself
    raise _OutOfBand


cdef dict _NO_OOB = {"buffer_callback": _refuse_buffers}   # shared, never mutated


cdef class ClientSubmit:
    """Client: ``Executor.submit``'s common case in one native call.

    The common case: the function has an id in the function table, the call
    (in the small format, else pickled without out-of-band buffers) fits the
    record inline, and a record is free.  Everything else goes to the
    Python path, ``stealer.client.executor._submit`` (the reference, which the
    pure-Python build always takes): before anything is set up (``slow``)
    or with the pickled call and its future (``rest``).  The order of the
    steps is the reference's: register the future, re-check shutdown, then
    publish the record.
    """
    cdef HotPath hot
    cdef object pool          # stealer.client.pool._Pool (reads: shutdown, broken, requeue, wake)
    cdef object ids           # pool.ids, the future ids (itertools.count)
    cdef dict fn_ids          # pool.fns._ids: function -> id in the function table
    cdef dict futures         # pool.futures: id -> pending future
    cdef object future_cls    # stealer.client.futures._Future
    cdef object dumps         # pickle.dumps
    cdef object slow          # _submit(pool, retries, fn, args, kwargs)
    cdef object rest          # _submit_data(pool, retries, f, data, bufs)
    cdef readonly uint32_t retries

    def __cinit__(self, HotPath hot, pool, future_cls, dumps, slow, rest,
                  uint32_t retries):
        self.hot = hot
        self.pool = pool
        self.ids = pool.ids
        self.fn_ids = pool.fns._ids
        self.futures = pool.futures
        self.future_cls = future_cls
        self.dumps = dumps
        self.slow = slow
        self.rest = rest
        self.retries = retries

    def __call__(self, fn, /, *args, **kwargs):
        # No shutdown check before the work: the one after registering (the reference's
        # re-check) refuses the same calls (interpreter exit shuts every pool down first).
        pool = self.pool
        try:
            fref = self.fn_ids[fn]
        except (KeyError, TypeError):  # not in the table yet, or not hashable
            return self.slow(pool, self.retries, fn, args, kwargs)
        cdef unsigned char buf[INLINE]
        cdef Py_ssize_t n = -1
        cdef const char *p = <const char *>buf
        data = None
        if not kwargs:
            n = _enc_call(buf, INLINE, fref, args)  # the small format, straight from the args
        if n < 0:
            try:
                data = PyObject_Call(self.dumps, ((fref, args, kwargs if kwargs else None), 5),
                                     _NO_OOB)
            except Exception:  # a buffer, or not picklable by pickle: the reference decides
                return self.slow(pool, self.retries, fn, args, kwargs)
            n = len(<bytes>data)
            p = <const char *>(<bytes>data)
        fid = next(self.ids)
        f = self.future_cls(pool, fid, fn)
        if n > INLINE:
            return self.rest(pool, self.retries, f, data, [])
        self.futures[fid] = f
        if pool.shutdown or pool.broken:  # (the reference's register-then-re-check)
            del self.futures[fid]
            return self.slow(pool, self.retries, fn, args, kwargs)  # raises
        cdef int64_t h = self.hot.c_submit_inline(K_ROOT, <uint64_t>fid, p, n, self.retries)
        if h >= 0:
            f._st_handle = h
            return f
        if h == CORRUPT_FREE_RING:
            del self.futures[fid]
            raise IndexError("corrupt free ring: record index out of range")
        if h == -1:  # no record free: the reference's backlog
            if data is None:
                data = PyBytes_FromStringAndSize(p, n)
            return self.rest(pool, self.retries, f, data, [])
        f._st_handle = h = -2 - h  # set up, but the injector is full: the result thread pushes it
        pool.requeue.append(h)
        pool.wake()
        return f


include "_layout_py.pxi"


# -- signals held while a client thread settles a batch (stealer/client/waiting.py) ------------
from posix.signal cimport SIG_BLOCK, SIG_SETMASK, sigfillset, sigset_t


cdef extern from "<signal.h>" nogil:
    int pthread_sigmask(int how, const sigset_t *set, sigset_t *oldset)


def block_signals():
    """Block every signal in the calling thread (SIGKILL and SIGSTOP stay, as the kernel
    keeps them); returns the old mask, for :func:`restore_signals`.  Two calls instead
    of ``signal.pthread_sigmask``'s, which convert a set of 62 signals both ways (a
    lockstep client settles a batch several times per round)."""
    cdef sigset_t full, old
    sigfillset(&full)
    cdef int rc = pthread_sigmask(SIG_BLOCK, &full, &old)
    if rc != 0:
        raise OSError(rc, "pthread_sigmask failed")
    return PyBytes_FromStringAndSize(<char *>&old, sizeof(sigset_t))


def restore_signals(bytes old not None):
    """Set the calling thread's mask back to ``old`` (from :func:`block_signals`)."""
    if PyBytes_GET_SIZE(old) != sizeof(sigset_t):
        raise ValueError("not a mask from block_signals")
    cdef int rc = pthread_sigmask(SIG_SETMASK, <sigset_t *>PyBytes_AS_STRING(old), NULL)
    if rc != 0:
        raise OSError(rc, "pthread_sigmask failed")
