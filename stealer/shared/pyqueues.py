"""Pure-Python reference of the native queues (``native/_cqueues.pyx``).

Same shared-memory layout, same API, same results (a handle, or EMPTY /
RETRY; pushes return False when full).  It serves two purposes:

* the **test oracle**: one test suite runs against both implementations;
* the **fallback** when the extension cannot be loaded or
  ``STEALER_NO_EXTENSIONS=1`` is set.

Python has no atomic read-modify-write on shared memory, so every
operation runs under one lock.  Within a single process a ``threading``
lock (the default) is enough; across processes, pass a
``multiprocessing`` lock shared by every process that maps the buffer
(the executor does this in fallback mode).  Under the lock each operation
is trivially linearizable, so the reference is slow but exact.

Parking uses the real futex through ``ctypes`` when libc exposes
``syscall``; otherwise it polls with short sleeps.

Loaded through stealer/shared/queues.py (by the client's pool and every worker, the same
implementation on both sides); stealer/client/ringfix.py takes its ring constants from
here; tests/ run each queue test against both.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os as _os
import struct
import threading
import time
from typing import Any

from stealer.shared._layout import RECORD_BYTES, RING_POP, RING_PUSH

__all__ = ["EMPTY", "RETRY", "NATIVE", "Region", "Deque", "MPMCRing", "SPSCRing"]

EMPTY = -1
RETRY = -2
NATIVE = False
RING_SKIP = (1 << 64) - 1  # a repaired producer cell's value (stealer/client/ringfix.py): pops skip it
POS_UNKNOWN = (1 << 64) - 1  # an intent's position before its push names one (pre_push)

_LINE = 64
_U32 = struct.Struct("=I")
_U64 = struct.Struct("=Q")
_I64 = struct.Struct("=q")
_M64 = (1 << 64) - 1
_M32 = (1 << 32) - 1

_SYS_FUTEX = 202  # x86-64; aarch64 is 98
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1


def _load_futex() -> Any:
    import platform

    nr = {"x86_64": 202, "aarch64": 98}.get(platform.machine())
    if nr is None:
        return None, None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.syscall
        fn.restype = ctypes.c_long
        return fn, nr
    except (OSError, AttributeError):
        return None, None


_syscall, _futex_nr = _load_futex()


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _round_line(n: int) -> int:
    return (n + _LINE - 1) & ~(_LINE - 1)


class _HeldLock:
    """A lock that records its holder's pid in a shared word (see Region)."""

    def __init__(self, lock: Any, mv: memoryview, off: int) -> None:
        self._lock = lock
        self._mv = mv
        self._off = off

    def __enter__(self) -> _HeldLock:
        self._lock.acquire()
        _U32.pack_into(self._mv, self._off, _os.getpid())  # under the lock: its holder
        return self

    def __exit__(self, *exc: Any) -> None:
        _U32.pack_into(self._mv, self._off, 0)
        self._lock.release()

    def holder(self) -> int:
        return _U32.unpack_from(self._mv, self._off)[0]


class Region:
    """Word access at byte offsets of a shared writable buffer, under one lock."""

    def __init__(self, obj: Any, lock: Any = None, holder_off: int = -1) -> None:
        self.obj = obj
        self.mv = memoryview(obj).cast("B")
        lock = lock if lock is not None else threading.Lock()
        # With ``holder_off``, the pid holding the lock is kept in that u32 word, so a
        # client that sees a process die holding it can say so instead of hanging: this
        # reference is not kill-safe (a process killed inside an operation leaves the
        # lock held and the structure half-updated); the native queues are.
        self.lock = _HeldLock(lock, self.mv, holder_off) if holder_off >= 0 else lock
        self.nbytes = len(self.mv)
        self._addr: int | None = None

    def _check(self, off: int, width: int) -> None:
        if off < 0 or off + width > self.nbytes or off & (width - 1):
            raise IndexError(f"bad {width}-byte word offset {off} in region of {self.nbytes} bytes")

    # Unlocked primitives, for use inside an operation already holding the lock.
    def _r64(self, off: int) -> int:
        return _U64.unpack_from(self.mv, off)[0]

    def _w64(self, off: int, v: int) -> None:
        _U64.pack_into(self.mv, off, v & _M64)

    def _r32(self, off: int) -> int:
        return _U32.unpack_from(self.mv, off)[0]

    def _w32(self, off: int, v: int) -> None:
        _U32.pack_into(self.mv, off, v & _M32)

    def load32(self, off: int) -> int:
        self._check(off, 4)
        with self.lock:
            return self._r32(off)

    def store32(self, off: int, v: int) -> None:
        self._check(off, 4)
        with self.lock:
            self._w32(off, v)

    def cas32(self, off: int, expected: int, desired: int) -> bool:
        self._check(off, 4)
        with self.lock:
            if self._r32(off) != expected:
                return False
            self._w32(off, desired)
            return True

    def add32(self, off: int, delta: int) -> int:
        self._check(off, 4)
        with self.lock:
            old = self._r32(off)
            self._w32(off, old + delta)
            return old

    def exchange32(self, off: int, v: int) -> int:
        self._check(off, 4)
        with self.lock:
            old = self._r32(off)
            self._w32(off, v)
            return old

    def load64(self, off: int) -> int:
        self._check(off, 8)
        with self.lock:
            return self._r64(off)

    def store64(self, off: int, v: int) -> None:
        self._check(off, 8)
        with self.lock:
            self._w64(off, v)

    def cas64(self, off: int, expected: int, desired: int) -> bool:
        self._check(off, 8)
        with self.lock:
            if self._r64(off) != expected & _M64:
                return False
            self._w64(off, desired)
            return True

    def add64(self, off: int, delta: int) -> int:
        self._check(off, 8)
        with self.lock:
            old = _I64.unpack_from(self.mv, off)[0]
            self._w64(off, old + delta)
            return old

    def fence(self) -> None:
        with self.lock:
            pass

    def or64(self, off: int, bits: int) -> int:
        """Atomic fetch-or; returns the old value (a worker entering a set, stealer/shared/idle.py)."""
        self._check(off, 8)
        with self.lock:
            old = self._r64(off)
            self._w64(off, old | bits)
            return old

    def and64(self, off: int, bits: int) -> int:
        """Atomic fetch-and; returns the old value (a worker leaving a set, or forget)."""
        self._check(off, 8)
        with self.lock:
            old = self._r64(off)
            self._w64(off, old & bits)
            return old

    def count_bits(self, off: int, nwords: int) -> int:
        """Bits set in the ``nwords`` 64-bit words at ``off`` (a worker set's size)."""
        if nwords < 0:
            raise ValueError("nwords must be >= 0")
        if nwords:
            self._check(off, 8)
            self._check(off + 8 * (nwords - 1), 8)
        with self.lock:
            return sum(self._r64(off + 8 * j).bit_count() for j in range(nwords))

    def idle_check(self, searching_off: int, parked_off: int, nwords: int = 1) -> bool:
        """After publishing work: True if nobody searches and somebody is parked.

        ``searching_off`` and ``parked_off`` are worker sets of ``nwords`` 64-bit words.
        """
        if nwords < 1:
            raise ValueError("nwords must be >= 1")
        for off in (searching_off, parked_off):
            self._check(off, 8)
            self._check(off + 8 * (nwords - 1), 8)
        with self.lock:
            if any(self._r64(searching_off + 8 * j) for j in range(nwords)):
                return False
            return any(self._r64(parked_off + 8 * j) for j in range(nwords))

    def _address(self, off: int) -> int:
        if self._addr is None:
            self._addr = ctypes.addressof(ctypes.c_char.from_buffer(self.obj))
        return self._addr + off

    def futex_wait(self, off: int, expected: int, timeout: float | None = None) -> bool:
        self._check(off, 4)
        if _syscall is not None and not isinstance(self.obj, bytearray):
            ts = None
            if timeout is not None:
                t = max(0.0, timeout)
                ts = _Timespec(int(t), int((t - int(t)) * 1e9))
            rc = _syscall(
                _futex_nr,
                ctypes.c_void_p(self._address(off)),
                _FUTEX_WAIT,
                ctypes.c_uint32(expected),
                ctypes.byref(ts) if ts is not None else None,
                None,
                0,
            )
            if rc == 0:
                return True
            err = ctypes.get_errno()
            return err != errno.ETIMEDOUT
        # Polling fallback.
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.load32(off) == expected:
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(0.0002)
        return True

    def hist_record(self, off: int, v: int) -> None:
        """Record ``v`` in the histogram at ``off``: [count][sum][max][pad][buckets]."""
        from stealer.shared.metrics import NBUCKETS

        self._check(off, 8)
        if off + 64 + 8 * NBUCKETS > self.nbytes:
            raise IndexError("histogram does not fit the region")
        v = max(0, v)
        b = off + 64 + 8 * _hist_bucket(v)
        with self.lock:
            self._w64(b, self._r64(b) + 1)
            self._w64(off, self._r64(off) + 1)
            self._w64(off + 8, self._r64(off + 8) + v)
            if v > self._r64(off + 16):
                self._w64(off + 16, v)

    @staticmethod
    def hist_bucket(v: int) -> int:
        return _hist_bucket(v)

    def futex_wake(self, off: int, n: int = 1) -> int:
        self._check(off, 4)
        if _syscall is not None and not isinstance(self.obj, bytearray):
            rc = _syscall(_futex_nr, ctypes.c_void_p(self._address(off)), _FUTEX_WAKE, n, None, None, 0)
            return max(0, rc)
        return 0


def _hist_bucket(v: int) -> int:
    from stealer.shared.metrics import bucket_of

    return bucket_of(v)


class _Ring:
    """Common layout checks of the three structures."""

    _cell = 8
    _min_capacity = 2

    def __init__(self, region: Region, offset: int, capacity: int) -> None:
        if capacity < self._min_capacity or capacity & (capacity - 1):
            raise ValueError(f"{type(self).__name__} capacity must be a power of two")
        if offset < 0 or offset % _LINE or offset + self.nbytes(capacity) > region.nbytes:
            raise ValueError(f"{type(self).__name__} does not fit the region at that offset")
        self.region = region
        self.offset = offset
        self.capacity = capacity
        self.mask = capacity - 1
        self._a = offset  # first control word
        self._b = offset + _LINE  # second control word
        self._cells = offset + 2 * _LINE
        self._lease = -1  # offset of this process's lease word (see set_lease), -1: off

    def set_lease(self, off: int) -> None:
        """Record (value + 1 at ``off``) every value a pop or steal of this process takes,
        in the same locked step (native: before its CAS); -1 turns it off."""
        if off >= 0:
            self.region._check(off, 8)
        self._lease = off

    def _leased(self, v: int) -> int:
        if self._lease >= 0 and v >= 0:
            self.region._w64(self._lease, v + 1)
        return v

    @classmethod
    def nbytes(cls, capacity: int) -> int:
        return 2 * _LINE + _round_line(cls._cell * capacity)


class Deque(_Ring):
    """Chase-Lev deque layout: [top][bottom][ring]; see the native version."""

    _min_capacity = 1

    def init(self) -> None:
        r = self.region
        with r.lock:
            r._w64(self._a, 0)
            r._w64(self._b, 0)

    def _top_bottom(self) -> tuple[int, int]:
        r = self.region
        return _I64.unpack_from(r.mv, self._a)[0], _I64.unpack_from(r.mv, self._b)[0]

    def push(self, h: int) -> bool:
        r = self.region
        with r.lock:
            t, b = self._top_bottom()
            if b - t > self.mask:
                return False
            r._w64(self._cells + 8 * (b & self.mask), h)
            r._w64(self._b, b + 1)
            return True

    def pop(self) -> int:
        r = self.region
        with r.lock:
            t, b = self._top_bottom()
            if t >= b:
                return EMPTY
            b -= 1
            r._w64(self._b, b)
            return self._leased(r._r64(self._cells + 8 * (b & self.mask)))

    def repair(self) -> bool:
        """Owner of an inherited deque: bottom < top (a killed pop) becomes empty."""
        r = self.region
        with r.lock:
            t, b = self._top_bottom()
            if b < t:
                r._w64(self._b, t)
                return True
            return False

    def _steal_locked(self) -> int:
        r = self.region
        t, b = self._top_bottom()
        if t >= b:
            return EMPTY
        h = r._r64(self._cells + 8 * (t & self.mask))
        r._w64(self._a, t + 1)
        return self._leased(h)

    def steal(self) -> int:
        with self.region.lock:
            return self._steal_locked()

    def steal_half(self, dest: Deque, cap: int = 32) -> int:
        if dest is self:
            raise ValueError("cannot steal from the deque being filled")
        cap = max(1, cap)
        with self.region.lock:
            first = self._steal_locked()
            if first < 0:
                return first
            lease0 = self._lease
            if lease0 >= 0:  # as the native one: the first keeps its lease, the rest use the next
                self._lease = lease0 + 8
            try:
                t, b = self._top_bottom()
                dt, db = dest._top_bottom()
                want = min((b - t) // 2, cap - 1, dest.capacity - (db - dt))
                for _ in range(want):
                    h = self._steal_locked()
                    dr = dest.region
                    dt, db = dest._top_bottom()
                    dr._w64(dest._cells + 8 * (db & dest.mask), h)
                    dr._w64(dest._b, db + 1)
            finally:
                self._lease = lease0
            return first

    def __len__(self) -> int:
        with self.region.lock:
            t, b = self._top_bottom()
            return max(0, b - t)


class _QueueRing(_Ring):
    """What the two rings share: pop, pop_many and length (positions at _prod/_cons)."""

    _prod_first = True

    def __init__(self, region: Region, offset: int, capacity: int) -> None:
        super().__init__(region, offset, capacity)
        self._prod, self._cons = (self._a, self._b) if self._prod_first else (self._b, self._a)

    def _pop_locked(self) -> int:
        raise NotImplementedError

    def pop(self) -> int:
        with self.region.lock:
            return self._pop_locked()

    def pop_many(self, n: int, lease_off: int = -1) -> list[int]:
        out: list[int] = []
        saved = self._lease
        if lease_off >= 0 and n > 0:  # as the native one: check before taking anything
            self.region._check(lease_off, 8)
            self.region._check(lease_off + 8 * (n - 1), 8)
        with self.region.lock:
            try:
                while len(out) < n:
                    if lease_off >= 0:
                        self._lease = lease_off + 8 * len(out)
                    v = self._pop_locked()
                    if v < 0:
                        break
                    out.append(v)
            finally:
                self._lease = saved
        return out

    def __len__(self) -> int:
        r = self.region
        with r.lock:
            return max(0, r._r64(self._prod) - r._r64(self._cons))


class MPMCRing(_QueueRing):
    """Vyukov ring layout: [enqueue pos][dequeue pos][{seq, value} cells].

    Under the region's lock a claim and its store cannot be split by a death; the
    intent words are written all the same (stealer/client/ringfix.py reads them the same way)
    and a RING_SKIP cell (a repair's) is skipped, as by the native ring."""

    _cell = 16
    _intent = -1  # offset of this process's intent words (set_intent), -1: off
    _take = -1  # offset of this process's W_ALLOC word (set_take), -1: off
    _take_rec = 0
    _take_n = 0

    def set_intent(self, off: int) -> None:
        if off >= 0:
            self.region._check(off, 24)
        self._intent = off

    def set_take(self, off: int, rec_base: int = 0, nrecords: int = 0) -> None:
        """The free-record ring of a worker: every record index a pop takes is named as a
        handle + 1 at ``off`` (W_ALLOC) in the same locked step (native: after the claim,
        before the cell is released); -1 turns it off."""
        if off >= 0:
            self.region._check(off, 8)
            if rec_base < 0 or rec_base % _LINE or rec_base + nrecords * RECORD_BYTES > self.region.nbytes:
                raise ValueError("records do not fit the region")
        self._take, self._take_rec, self._take_n = off, rec_base, nrecords

    def pre_push(self, v: int) -> None:
        """Name a push of ``v`` whose position is not known yet (POS_UNKNOWN), before the
        caller makes ``v`` its to give back (a free: before the FREE store); see the native
        twin.  No-op without an intent."""
        if self._intent >= 0:
            with self.region.lock:
                self._say(RING_PUSH, POS_UNKNOWN, v)

    def _say(self, op: int, pos: int, v: int = 0) -> None:
        if self._intent >= 0:  # op 0: no claim in flight
            self.region._w64(self._intent + 16, v)
            self.region._w64(self._intent + 8, pos)
            self.region._w64(self._intent, (self.offset << 2) | op if op else 0)

    def init(self) -> None:
        r = self.region
        with r.lock:
            for i in range(self.capacity):
                r._w64(self._cells + 16 * i, i)
            r._w64(self._a, 0)
            r._w64(self._b, 0)

    def push(self, v: int) -> bool:
        r = self.region
        with r.lock:
            pos = r._r64(self._a)
            cell = self._cells + 16 * (pos & self.mask)
            if r._r64(cell) != pos:
                return False
            self._say(RING_PUSH, pos, v)
            r._w64(cell + 8, v)
            r._w64(cell, pos + 1)
            r._w64(self._a, pos + 1)
            self._say(0, pos, v)  # the op is over (as the native ring's _end_intent)
            return True

    def _pop_locked(self) -> int:
        r = self.region
        while True:
            pos = r._r64(self._b)
            cell = self._cells + 16 * (pos & self.mask)
            if r._r64(cell) != pos + 1:
                return EMPTY
            v = r._r64(cell + 8)
            self._say(RING_POP, pos)
            if self._take >= 0 and v < self._take_n:  # the record taken (see set_take)
                gen = r._r64(self._take_rec + RECORD_BYTES * v) & _M32
                r._w64(self._take, ((gen << 32) | v) + 1)
            r._w64(cell, pos + self.capacity)
            r._w64(self._b, pos + 1)
            self._say(0, pos)
            if v != RING_SKIP:
                return self._leased(v)



class SPSCRing(_QueueRing):
    """Single-producer single-consumer ring layout: [head][tail][cells]."""

    _prod_first = False

    def init(self) -> None:
        r = self.region
        with r.lock:
            r._w64(self._a, 0)
            r._w64(self._b, 0)

    def push(self, v: int) -> bool:
        r = self.region
        with r.lock:
            h, t = r._r64(self._a), r._r64(self._b)
            if t - h > self.mask:
                return False
            r._w64(self._cells + 8 * (t & self.mask), v)
            r._w64(self._b, t + 1)
            return True

    def _pop_locked(self) -> int:
        r = self.region
        h, t = r._r64(self._a), r._r64(self._b)
        if h == t:
            return EMPTY
        v = r._r64(self._cells + 8 * (h & self.mask))
        r._w64(self._a, h + 1)
        return v

    def peek(self) -> int:
        """Consumer: the value ``pop`` would return next, left in place (EMPTY if none)."""
        r = self.region
        with r.lock:
            h, t = r._r64(self._a), r._r64(self._b)
            return EMPTY if h == t else r._r64(self._cells + 8 * (h & self.mask))

