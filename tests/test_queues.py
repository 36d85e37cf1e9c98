"""Single-process tests of the shared-memory queues, run on both implementations.

Every test takes the ``impl`` fixture (tests/conftest.py), parametrized over the native
Cython module (``stealer._cqueues``) and the pure-Python reference (``stealer.shared.pyqueues``),
so the two are held to one specification.  Sequential random op sequences are checked
against ``collections.deque`` models with hypothesis, and the same sequences are
fed to both implementations and their results compared.  Multi-process tests
live in ``test_queue_stress.py``.
"""

from __future__ import annotations

import collections
import contextlib
import importlib
import mmap
import struct
import threading
import time
from types import ModuleType

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from rig import IMPLS

from stealer.shared import pyqueues as _pyqueues

_cqueues = IMPLS["native"]  # None where the extension is not built
LINE = 64
MAX_HANDLE = 2**63 - 1
RING_KINDS = ["MPMCRing", "SPSCRing"]
ALL_KINDS = ["Deque", *RING_KINDS]
needs_native = pytest.mark.skipif(_cqueues is None, reason="native extension not built")


def make_with_region(impl: ModuleType, kind: str, capacity: int, offset: int = 0):
    """A fresh initialized structure ``kind`` of ``capacity`` in its own bytearray, and its Region."""
    cls = getattr(impl, kind)
    region = impl.Region(bytearray(offset + cls.nbytes(capacity)))
    q = cls(region, offset, capacity)
    q.init()
    return q, region


def make(impl: ModuleType, kind: str, capacity: int):
    return make_with_region(impl, kind, capacity)[0]


# --------------------------------------------------------------------------- module


def test_module_constants(impl):
    assert impl.EMPTY == -1
    assert impl.RETRY == -2
    assert impl.NATIVE is (impl is _cqueues)
    for name in ("Region", "Deque", "MPMCRing", "SPSCRing"):
        assert hasattr(impl, name)


@needs_native
@pytest.mark.parametrize(
    ("kind", "capacity"),
    [(k, c) for k in ALL_KINDS for c in (1, 2, 4, 8, 64, 1024, 4096) if k == "Deque" or c >= 2],
)
def test_nbytes_identical_and_line_rounded(kind, capacity):
    n_native = getattr(_cqueues, kind).nbytes(capacity)
    n_python = getattr(_pyqueues, kind).nbytes(capacity)
    assert n_native == n_python
    assert n_native % LINE == 0
    cell = 16 if kind == "MPMCRing" else 8
    assert n_native >= 2 * LINE + cell * capacity


def test_queues_load_selects_module():
    queues = importlib.import_module("stealer.shared.queues")
    assert queues.load(force_python=True) is _pyqueues
    if _cqueues is not None:
        assert queues.load(force_python=False) is _cqueues


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize("kind", ALL_KINDS)
@pytest.mark.parametrize("capacity", [0, 3, 6, 12, 100, -4])
def test_capacity_must_be_power_of_two(impl, kind, capacity):
    region = impl.Region(bytearray(1 << 16))
    with pytest.raises(ValueError):
        getattr(impl, kind)(region, 0, capacity)


@pytest.mark.parametrize("kind", RING_KINDS)
def test_ring_capacity_one_rejected(impl, kind):
    region = impl.Region(bytearray(4096))
    with pytest.raises(ValueError):
        getattr(impl, kind)(region, 0, 1)


def test_deque_capacity_one(impl):
    d = make(impl, "Deque", 1)
    assert d.push(5)
    assert not d.push(6)
    assert len(d) == 1
    assert d.pop() == 5
    assert d.pop() == impl.EMPTY
    assert d.push(7)
    assert d.steal() == 7
    assert d.steal() == impl.EMPTY


@pytest.mark.parametrize("kind", ALL_KINDS)
@pytest.mark.parametrize("offset", [1, 8, 32, 63, 96, 100])
def test_offset_must_be_line_aligned(impl, kind, offset):
    region = impl.Region(bytearray(1 << 14))
    with pytest.raises(ValueError):
        getattr(impl, kind)(region, offset, 8)


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_structure_must_fit_region(impl, kind):
    cls = getattr(impl, kind)
    n = cls.nbytes(8)
    region = impl.Region(bytearray(n + LINE))
    cls(region, 0, 8)
    cls(region, LINE, 8)  # exactly fits
    for off in (2 * LINE, n, n + LINE, 1 << 20):
        with pytest.raises(ValueError):
            cls(region, off, 8)
    with pytest.raises(ValueError):
        cls(impl.Region(bytearray(n - 1)), 0, 8)
    with pytest.raises(ValueError):
        cls(region, 0, 64)  # a bigger capacity does not fit the same region


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_negative_offset_rejected(impl, kind):
    region = impl.Region(bytearray(1 << 14))
    with pytest.raises(ValueError):
        getattr(impl, kind)(region, -LINE, 8)


def test_steal_half_into_self_rejected(impl):
    d = make(impl, "Deque", 8)
    for h in range(4):
        d.push(h)
    with pytest.raises(ValueError):
        d.steal_half(d, 4)
    assert len(d) == 4  # nothing was taken


def test_two_structures_side_by_side(impl):
    """Structures at different offsets of one region do not interfere."""
    nd, nm, ns = (getattr(impl, k).nbytes(8) for k in ALL_KINDS)
    buf = bytearray(nd + nm + ns)
    region = impl.Region(buf)
    d = impl.Deque(region, 0, 8)
    m = impl.MPMCRing(region, nd, 8)
    s = impl.SPSCRing(region, nd + nm, 8)
    for q in (d, m, s):
        q.init()
    for i in range(8):
        assert d.push(100 + i)
        assert m.push(200 + i)
        assert s.push(300 + i)
    assert not d.push(0) and not m.push(0) and not s.push(0)
    assert d.pop() == 107 and d.steal() == 100
    assert m.pop_many(100) == list(range(200, 208))
    assert s.pop_many(100) == list(range(300, 308))
    assert len(d) == 6


# --------------------------------------------------------------------------- Deque


def test_deque_lifo_pop_fifo_steal(impl):
    d = make(impl, "Deque", 16)
    assert len(d) == 0
    assert d.pop() == impl.EMPTY
    assert d.steal() == impl.EMPTY
    for h in range(10):
        assert d.push(h)
    assert len(d) == 10
    assert d.pop() == 9
    assert d.pop() == 8
    assert d.steal() == 0
    assert d.steal() == 1
    assert len(d) == 6
    assert [d.pop() for _ in range(3)] == [7, 6, 5]
    assert [d.steal() for _ in range(3)] == [2, 3, 4]
    assert len(d) == 0
    assert d.pop() == impl.EMPTY
    assert d.steal() == impl.EMPTY
    assert len(d) == 0


def test_deque_full_and_recover(impl):
    d = make(impl, "Deque", 8)
    for h in range(8):
        assert d.push(h)
    assert not d.push(99)
    assert len(d) == 8
    assert d.steal() == 0
    assert d.push(8)
    assert not d.push(99)
    assert d.pop() == 8
    assert d.push(9)
    assert [d.steal() for _ in range(8)] == [1, 2, 3, 4, 5, 6, 7, 9]
    assert d.steal() == impl.EMPTY


def test_deque_extreme_handles(impl):
    d = make(impl, "Deque", 4)
    for h in (0, 1, MAX_HANDLE, 2**32, 2**32 - 1):
        assert d.push(h)
        assert d.pop() == h
    d.push(MAX_HANDLE)
    assert d.steal() == MAX_HANDLE


def test_deque_init_resets(impl):
    d = make(impl, "Deque", 4)
    for h in range(3):
        d.push(h)
    d.steal()
    d.init()
    assert len(d) == 0
    assert d.pop() == impl.EMPTY
    assert d.steal() == impl.EMPTY


def test_deque_wraparound_many_laps(impl):
    cap, laps = 8, 500
    d, region = make_with_region(impl, "Deque", cap, offset=LINE)
    nxt, expected = 0, collections.deque()
    for lap in range(laps):
        while d.push(nxt):
            expected.append(nxt)
            nxt += 1
        assert len(d) == cap
        # Alternate stealing most (FIFO) and popping a few (LIFO), so both ends move.
        for _ in range(cap - 2):
            assert d.steal() == expected.popleft()
        assert d.pop() == expected.pop()
        if lap % 3 == 0:
            assert d.pop() == expected.pop()
    while expected:
        assert d.steal() == expected.popleft()
    assert d.steal() == impl.EMPTY
    assert nxt > laps * (cap - 2)
    # The indices (top at +0, bottom at +64) have grown far past the capacity.
    top = region.load64(d.offset)
    assert top >= laps * (cap - 2)
    assert top > 50 * cap


def test_deque_large_starting_indices(impl):
    """Indices near 2**62 (a very long-lived deque) behave like small ones."""
    d, region = make_with_region(impl, "Deque", 8)
    start = 2**62 + 5
    region.store64(d.offset, start)  # top
    region.store64(d.offset + LINE, start)  # bottom
    assert len(d) == 0
    for h in range(8):
        assert d.push(h)
    assert not d.push(8)
    assert len(d) == 8
    assert d.steal() == 0
    assert d.pop() == 7
    dest = make(impl, "Deque", 8)
    assert d.steal_half(dest, 32) == 1
    assert len(dest) == 2
    assert [dest.steal(), dest.steal()] == [2, 3]
    assert [d.pop(), d.pop(), d.pop()] == [6, 5, 4]
    assert d.pop() == impl.EMPTY


def _steal_half_expected(n: int, cap: int, room: int) -> int:
    """How many items one sequential steal_half takes from a deque of n items."""
    if n == 0:
        return 0
    return 1 + min((n - 1) // 2, max(1, cap) - 1, room)


@pytest.mark.parametrize("n", [0, 1, 2, 3, 4, 5, 9, 10, 31, 64])
@pytest.mark.parametrize("cap", [1, 2, 4, 32, 1000])
def test_steal_half_amounts(impl, n, cap):
    d = make(impl, "Deque", 64)
    dest = make(impl, "Deque", 64)
    for h in range(n):
        assert d.push(h)
    got = d.steal_half(dest, cap)
    taken = _steal_half_expected(n, cap, 64)
    if n == 0:
        assert got == impl.EMPTY
        assert len(dest) == 0
        return
    assert got == 0  # the first item, from the top
    assert len(dest) == taken - 1
    assert len(d) == n - taken
    # About half: never more than half rounded up, at least one.
    assert 1 <= taken <= max(1, (n + 1) // 2)
    assert taken <= max(1, cap)
    if cap >= n:
        assert taken == (n + 1) // 2
    # The rest went into dest in top-to-bottom order: dest's steal sees them FIFO.
    assert [dest.steal() for _ in range(taken - 1)] == list(range(1, taken))
    # The victim keeps the bottom items intact.
    assert [d.steal() for _ in range(n - taken)] == list(range(taken, n))


@pytest.mark.parametrize("cap", [-5, 0, 1])
def test_steal_half_nonpositive_cap_takes_one(impl, cap):
    d = make(impl, "Deque", 16)
    dest = make(impl, "Deque", 16)
    for h in range(10):
        d.push(h)
    assert d.steal_half(dest, cap) == 0
    assert len(dest) == 0
    assert len(d) == 9


def test_steal_half_default_cap(impl):
    d = make(impl, "Deque", 256)
    dest = make(impl, "Deque", 256)
    for h in range(200):
        d.push(h)
    assert d.steal_half(dest) == 0
    assert len(dest) == 31  # default cap 32: the first plus 31 pushed
    assert len(d) == 200 - 32


@pytest.mark.parametrize("room", [0, 1, 2, 3])
def test_steal_half_respects_dest_room(impl, room):
    d = make(impl, "Deque", 64)
    dest = make(impl, "Deque", 4)
    for h in range(4 - room):
        assert dest.push(1000 + h)
    for h in range(40):
        d.push(h)
    assert d.steal_half(dest, 32) == 0
    assert len(dest) == 4  # filled exactly to capacity, never beyond
    assert not dest.push(5000)
    assert len(d) == 40 - 1 - room
    # dest's own items are still there, followed by the stolen ones.
    contents = [dest.steal() for _ in range(4)]
    assert contents == [1000 + h for h in range(4 - room)] + list(range(1, 1 + room))
    assert d.steal() == 1 + room


def test_steal_half_room_zero_still_returns_first(impl):
    d = make(impl, "Deque", 8)
    dest = make(impl, "Deque", 2)
    dest.push(10)
    dest.push(11)
    for h in range(8):
        d.push(h)
    assert d.steal_half(dest, 32) == 0
    assert len(d) == 7
    assert len(dest) == 2


def test_steal_half_wraps_dest(impl):
    """steal_half into a dest whose indices have wrapped many times."""
    d = make(impl, "Deque", 64)
    dest = make(impl, "Deque", 4)
    for _ in range(37):
        dest.push(1)
        dest.push(2)
        dest.steal()
        dest.steal()
    nxt = 0
    for _ in range(50):
        while d.push(nxt):
            nxt += 1
        first = d.steal_half(dest, 32)
        assert first >= 0
        stolen = [first]
        while (h := dest.pop()) != impl.EMPTY:
            stolen.append(h)
        # first, then the others popped LIFO from dest: consecutive handles.
        assert sorted(stolen) == list(range(first, first + len(stolen)))
        assert len(stolen) == 5  # dest capacity 4 bounds the batch at 1 + 4


# --------------------------------------------------------------------------- rings


@pytest.mark.parametrize("kind", RING_KINDS)
def test_ring_fifo(impl, kind):
    q = make(impl, kind, 16)
    assert len(q) == 0
    assert q.pop() == impl.EMPTY
    assert q.pop_many(5) == []
    for v in range(10):
        assert q.push(v)
    assert len(q) == 10
    assert q.pop() == 0
    assert q.pop() == 1
    assert q.pop_many(3) == [2, 3, 4]
    assert len(q) == 5
    assert q.pop_many(100) == [5, 6, 7, 8, 9]
    assert q.pop() == impl.EMPTY
    assert len(q) == 0


@pytest.mark.parametrize("kind", RING_KINDS)
def test_ring_full_and_recover(impl, kind):
    q = make(impl, kind, 4)
    for v in range(4):
        assert q.push(v)
    assert not q.push(99)
    assert len(q) == 4
    assert q.pop() == 0
    assert q.push(4)
    assert not q.push(99)
    assert q.pop_many(10) == [1, 2, 3, 4]


@pytest.mark.parametrize("kind", RING_KINDS)
@pytest.mark.parametrize("n", [-3, 0])
def test_ring_pop_many_nonpositive(impl, kind, n):
    q = make(impl, kind, 4)
    q.push(1)
    assert q.pop_many(n) == []
    assert len(q) == 1


@pytest.mark.parametrize("kind", RING_KINDS)
def test_ring_extreme_values(impl, kind):
    q = make(impl, kind, 4)
    vals = [0, MAX_HANDLE, 2**32, 2**32 - 1]
    for v in vals:
        assert q.push(v)
    assert q.pop_many(4) == vals


@pytest.mark.parametrize("kind", RING_KINDS)
def test_ring_wraparound_many_laps(impl, kind):
    cap, laps = 8, 600
    q, region = make_with_region(impl, kind, cap, offset=2 * LINE)
    nxt, expected = 0, collections.deque()
    for lap in range(laps):
        while q.push(nxt):
            expected.append(nxt)
            nxt += 1
        assert len(q) == cap
        k = 1 + lap % cap
        got = q.pop_many(k)
        assert got == [expected.popleft() for _ in range(k)]
    assert q.pop_many(cap) == list(expected)
    assert q.pop() == impl.EMPTY
    assert nxt > 50 * cap
    # Both positions (+0 and +64) are monotone counters, far past the capacity.
    assert q.offset == 2 * LINE
    assert region.load64(q.offset) == nxt
    assert region.load64(q.offset + LINE) == nxt


@pytest.mark.parametrize("kind", RING_KINDS)
def test_ring_init_resets(impl, kind):
    q = make(impl, kind, 4)
    for v in range(7):
        q.push(v)
        if v % 2:
            q.pop()
    q.init()
    assert len(q) == 0
    assert q.pop() == impl.EMPTY
    for v in range(4):
        assert q.push(v)
    assert not q.push(4)
    assert q.pop_many(4) == [0, 1, 2, 3]


def test_spsc_large_starting_indices(impl):
    q, region = make_with_region(impl, "SPSCRing", 4)
    start = 2**62 + 3
    region.store64(q.offset, start)  # head
    region.store64(q.offset + LINE, start)  # tail
    assert len(q) == 0
    for v in range(4):
        assert q.push(v)
    assert not q.push(9)
    assert len(q) == 4
    assert q.pop_many(3) == [0, 1, 2]
    assert q.push(4)
    assert q.pop_many(9) == [3, 4]


# --------------------------------------------------------------------------- Region


@pytest.fixture(params=["bytearray", "mmap"])
def region(impl, request):
    if request.param == "bytearray":
        buf = bytearray(4096)
    else:
        buf = mmap.mmap(-1, 4096)
    r = impl.Region(buf)
    yield r
    del r
    if isinstance(buf, mmap.mmap):
        with contextlib.suppress(BufferError):
            buf.close()


def test_region_nbytes_and_lock_argument(impl):
    buf = bytearray(1024)
    assert impl.Region(buf).nbytes == 1024
    r = impl.Region(buf, threading.Lock())
    r.store64(8, 42)
    assert r.load64(8) == 42


def test_region_32bit_ops(region):
    r = region
    assert r.load32(0) == 0
    r.store32(0, 7)
    assert r.load32(0) == 7
    assert r.cas32(0, 7, 9) is True
    assert r.load32(0) == 9
    assert r.cas32(0, 7, 11) is False
    assert r.load32(0) == 9
    assert r.exchange32(0, 13) == 9
    assert r.load32(0) == 13
    assert r.add32(0, 5) == 13
    assert r.load32(0) == 18
    assert r.add32(0, -8) == 18
    assert r.load32(0) == 10
    # Neighbouring words are untouched.
    assert r.load32(4) == 0
    assert r.load64(8) == 0


def test_region_add32_wraps(region):
    r = region
    r.store32(4, 0xFFFFFFFF)
    assert r.add32(4, 1) == 0xFFFFFFFF
    assert r.load32(4) == 0
    assert r.add32(4, -1) == 0
    assert r.load32(4) == 0xFFFFFFFF
    r.store32(4, 0xFFFFFFF0)
    assert r.add32(4, 0x20) == 0xFFFFFFF0
    assert r.load32(4) == 0x10
    assert r.load32(0) == 0 and r.load32(8) == 0  # no carry into neighbours


def test_region_64bit_ops(region):
    r = region
    r.store64(16, 2**64 - 1)
    assert r.load64(16) == 2**64 - 1
    assert r.cas64(16, 2**64 - 1, 5) is True
    assert r.load64(16) == 5
    assert r.cas64(16, 4, 6) is False
    assert r.load64(16) == 5
    assert r.add64(16, 10) == 5
    assert r.load64(16) == 15
    r.store64(24, 2**40 + 3)
    assert r.load64(24) == 2**40 + 3
    assert r.load64(16) == 15


def test_region_add64_negative(region):
    r = region
    assert r.add64(32, -5) == 0
    assert r.add64(32, 0) == -5  # the old value is returned signed
    assert r.load64(32) == 2**64 - 5  # loads are unsigned
    assert r.add64(32, 7) == -5
    assert r.load64(32) == 2
    r.store64(32, 2**63)
    assert r.add64(32, 1) == -(2**63)
    assert r.load64(32) == 2**63 + 1


def test_region_fence(region):
    region.fence()


def test_region_byte_layout(impl):
    """Words are stored in native byte order at the given byte offsets of the buffer."""
    buf = bytearray(256)
    r = impl.Region(buf)
    r.store64(8, 0x1122334455667788)
    r.store32(64, 0xDEADBEEF)
    assert struct.unpack_from("=Q", buf, 8)[0] == 0x1122334455667788
    assert struct.unpack_from("=I", buf, 64)[0] == 0xDEADBEEF
    struct.pack_into("=Q", buf, 128, 12345)
    assert r.load64(128) == 12345
    assert r.load32(128) == 12345  # little-end half on x86-64/aarch64 (little-endian)
    assert buf[:8] == bytes(8)


@pytest.mark.parametrize(
    ("op", "args", "width"),
    [
        ("load32", (), 4),
        ("store32", (1,), 4),
        ("cas32", (0, 1), 4),
        ("add32", (1,), 4),
        ("exchange32", (1,), 4),
        ("futex_wake", (1,), 4),
        ("load64", (), 8),
        ("store64", (1,), 8),
        ("cas64", (0, 1), 8),
        ("add64", (1,), 8),
    ],
)
def test_region_bad_offsets(impl, op, args, width):
    r = impl.Region(bytearray(256))
    fn = getattr(r, op)
    bad = [-width, -1, 256, 256 - width + 1, 1 << 30]
    if width == 8:
        bad += [4, 252, 12]
    else:
        bad += [1, 2, 3, 254]
    for off in bad:
        with pytest.raises(IndexError):
            fn(off, *args)
    fn(256 - width, *args)  # the last word is fine


def test_region_futex_wait_bad_offset(impl):
    r = impl.Region(bytearray(256))
    for off in (-4, 2, 256):
        with pytest.raises(IndexError):
            r.futex_wait(off, 0, 0.01)


# --------------------------------------------------------------------------- futex


def test_futex_wait_times_out(region):
    region.store32(0, 3)
    t0 = time.monotonic()
    assert region.futex_wait(0, 3, 0.05) is False
    assert time.monotonic() - t0 < 10
    assert region.futex_wait(0, 3, 0) is False


def test_futex_wait_value_differs(region):
    region.store32(0, 3)
    t0 = time.monotonic()
    assert region.futex_wait(0, 4, 10.0) is True
    assert region.futex_wait(0, 4, None) is True  # differs: returns at once even with no timeout
    assert time.monotonic() - t0 < 10


def test_futex_wake_without_waiters(impl):
    buf = mmap.mmap(-1, 4096)
    r = impl.Region(buf)
    assert r.futex_wake(0, 1) == 0
    assert r.futex_wake(0, 100) == 0


def test_futex_wake_across_threads(region):
    off = 128
    region.store32(off, 0)
    result: list[bool] = []
    started = threading.Event()

    def waiter() -> None:
        started.set()
        # Loop like a real parker: re-check after every return.
        deadline = time.monotonic() + 10.0
        while region.load32(off) == 0 and time.monotonic() < deadline:
            region.futex_wait(off, 0, 10.0)
        result.append(region.load32(off) == 1)

    th = threading.Thread(target=waiter, daemon=True)
    th.start()
    try:
        assert started.wait(10.0)
        time.sleep(0.05)  # let it (most likely) go to sleep in the kernel
        region.store32(off, 1)
        region.futex_wake(off, 1)
    finally:
        th.join(10.0)
    assert not th.is_alive(), "waiter was not woken within 10 s"
    assert result == [True]


def test_futex_wait_single_call_woken(impl):
    """One futex_wait call (no re-check loop) returns True once woken by another thread."""
    buf = mmap.mmap(-1, 4096)
    r = impl.Region(buf)
    result: list[bool] = []
    th = threading.Thread(target=lambda: result.append(r.futex_wait(0, 0, 10.0)), daemon=True)
    th.start()
    try:
        time.sleep(0.05)
        r.store32(0, 1)
        r.futex_wake(0, 1)
    finally:
        th.join(10.0)
    assert not th.is_alive(), "futex_wait did not return within 10 s"
    assert result == [True]


# --------------------------------------------------------------------------- hypothesis: models

HANDLES = st.one_of(st.integers(0, 1000), st.integers(0, MAX_HANDLE))
HSETTINGS = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


class DequeMachine(RuleBasedStateMachine):
    """Two deques (``a`` small, ``b`` smaller) against ``collections.deque`` models.

    push/pop act at the right end of the model, steal and steal_half at the
    left; steal_half moves its extra items, top first, onto the right end of the
    other deque's model.
    """

    impl: ModuleType = _pyqueues
    CAPS = (8, 4)

    @initialize()
    def setup(self) -> None:
        ca, cb = self.CAPS
        buf = bytearray(self.impl.Deque.nbytes(ca) + self.impl.Deque.nbytes(cb))
        region = self.impl.Region(buf)
        self.q = [
            self.impl.Deque(region, 0, ca),
            self.impl.Deque(region, self.impl.Deque.nbytes(ca), cb),
        ]
        for d in self.q:
            d.init()
        self.model = [collections.deque(), collections.deque()]
        self.caps = list(self.CAPS)

    @rule(i=st.integers(0, 1), h=HANDLES)
    def push(self, i: int, h: int) -> None:
        ok = self.q[i].push(h)
        full = len(self.model[i]) >= self.caps[i]
        assert ok is (not full)
        if ok:
            self.model[i].append(h)

    @rule(i=st.integers(0, 1), k=st.integers(1, 10))
    def fill(self, i: int, k: int) -> None:
        for _ in range(k):
            self.push(i, len(self.model[i]))

    @rule(i=st.integers(0, 1))
    def pop(self, i: int) -> None:
        got = self.q[i].pop()
        want = self.model[i].pop() if self.model[i] else self.impl.EMPTY
        assert got == want

    @rule(i=st.integers(0, 1))
    def steal(self, i: int) -> None:
        got = self.q[i].steal()
        want = self.model[i].popleft() if self.model[i] else self.impl.EMPTY
        assert got == want

    @rule(i=st.integers(0, 1), cap=st.integers(-1, 10))
    def steal_half(self, i: int, cap: int) -> None:
        j = 1 - i
        src, dst = self.model[i], self.model[j]
        n = len(src)
        got = self.q[i].steal_half(self.q[j], cap)
        if n == 0:
            assert got == self.impl.EMPTY
            return
        k = _steal_half_expected(n, cap, self.caps[j] - len(dst))
        assert got == src.popleft()
        for _ in range(k - 1):
            dst.append(src.popleft())

    @precondition(lambda self: len(self.model[0]) > 0)
    @rule()
    def steal_half_self(self) -> None:
        try:
            self.q[0].steal_half(self.q[0], 4)
        except ValueError:
            pass
        else:
            raise AssertionError("steal_half into itself did not raise ValueError")

    @invariant()
    def lengths(self) -> None:
        if hasattr(self, "q"):
            assert [len(d) for d in self.q] == [len(m) for m in self.model]


class RingMachine(RuleBasedStateMachine):
    """A ring (MPMC or SPSC) against a bounded ``collections.deque`` model."""

    impl: ModuleType = _pyqueues
    kind = "MPMCRing"
    CAP = 4

    @initialize()
    def setup(self) -> None:
        self.q = make(self.impl, self.kind, self.CAP)
        self.model: collections.deque[int] = collections.deque()

    @rule(v=HANDLES)
    def push(self, v: int) -> None:
        ok = self.q.push(v)
        assert ok is (len(self.model) < self.CAP)
        if ok:
            self.model.append(v)

    @rule(k=st.integers(1, 6))
    def fill(self, k: int) -> None:
        for v in range(k):
            self.push(v)

    @rule()
    def pop(self) -> None:
        want = self.model.popleft() if self.model else self.impl.EMPTY
        assert self.q.pop() == want

    @rule(n=st.integers(-1, 6))
    def pop_many(self, n: int) -> None:
        want = [self.model.popleft() for _ in range(min(max(n, 0), len(self.model)))]
        assert self.q.pop_many(n) == want

    @invariant()
    def length(self) -> None:
        if hasattr(self, "q"):
            assert len(self.q) == len(self.model)


def _machine_tests() -> dict[str, type]:
    """One unittest TestCase per (machine, implementation[, ring kind])."""
    out: dict[str, type] = {}
    for name, mod in IMPLS.items():
        machines = {
            f"TestDequeMachine_{name}": type(f"Deque_{name}", (DequeMachine,), {"impl": mod})
        }
        for kind in RING_KINDS:
            machines[f"Test{kind}Machine_{name}"] = type(
                f"{kind}_{name}", (RingMachine,), {"impl": mod, "kind": kind}
            )
        for key, machine in machines.items():
            case = machine.TestCase
            case.settings = settings(HSETTINGS, stateful_step_count=60)
            if mod is None:
                case = pytest.mark.skip(reason="native extension not built")(case)
            out[key] = case
    return out


globals().update(_machine_tests())


# --------------------------------------------------------------------------- hypothesis: op lists

# "fill" pushes a burst of consecutive handles (and reports each push's result), so
# the structures regularly get full, which single random pushes rarely achieve.
DEQUE_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("push"), st.integers(0, 1), HANDLES),
        st.tuples(st.just("fill"), st.integers(0, 1), st.integers(1, 20)),
        st.tuples(st.just("pop"), st.integers(0, 1)),
        st.tuples(st.just("steal"), st.integers(0, 1)),
        st.tuples(st.just("steal_half"), st.integers(0, 1), st.integers(-1, 40)),
        st.tuples(st.just("len"), st.integers(0, 1)),
    ),
    max_size=300,
)
RING_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("push"), HANDLES),
        st.tuples(st.just("fill"), st.integers(1, 12)),
        st.tuples(st.just("pop")),
        st.tuples(st.just("pop_many"), st.integers(-1, 12)),
        st.tuples(st.just("len")),
    ),
    max_size=300,
)


def _run_deque_ops(impl: ModuleType, ops, caps=(16, 4)) -> tuple[list, list[int]]:
    """Apply ``ops`` to two deques (0 and 1; steal_half moves into the other); results and lengths."""
    ca, cb = caps
    na = impl.Deque.nbytes(ca)
    region = impl.Region(bytearray(na + impl.Deque.nbytes(cb)))
    qs = [impl.Deque(region, 0, ca), impl.Deque(region, na, cb)]
    for d in qs:
        d.init()
    out: list = []
    for op in ops:
        name, i, *args = op
        if name == "steal_half":
            out.append(qs[i].steal_half(qs[1 - i], *args))
        elif name == "fill":
            out.append([qs[i].push(1000 * k) for k in range(args[0])])
        elif name == "len":
            out.append(len(qs[i]))
        else:
            out.append(getattr(qs[i], name)(*args))
    return out, [len(d) for d in qs]


def _run_ring_ops(impl: ModuleType, kind: str, ops, cap=8) -> tuple[list, bytes]:
    buf = bytearray(getattr(impl, kind).nbytes(cap))
    q = getattr(impl, kind)(impl.Region(buf), 0, cap)
    q.init()
    out: list = []
    for name, *args in ops:
        if name == "fill":
            out.append([q.push(1000 * k) for k in range(args[0])])
        else:
            out.append(len(q) if name == "len" else getattr(q, name)(*args))
    del q
    return out, bytes(buf)


def _model_deque_ops(ops, caps=(16, 4)) -> tuple[list, list[int]]:
    model = [collections.deque(), collections.deque()]
    out: list = []
    for op in ops:
        name, i, *args = op
        m, other = model[i], model[1 - i]
        if name == "push":
            ok = len(m) < caps[i]
            if ok:
                m.append(args[0])
            out.append(ok)
        elif name == "fill":
            oks = [len(m) + k < caps[i] for k in range(args[0])]
            m.extend(1000 * k for k, ok in enumerate(oks) if ok)
            out.append(oks)
        elif name == "pop":
            out.append(m.pop() if m else -1)
        elif name == "steal":
            out.append(m.popleft() if m else -1)
        elif name == "steal_half":
            if not m:
                out.append(-1)
                continue
            k = _steal_half_expected(len(m), args[0], caps[1 - i] - len(other))
            out.append(m.popleft())
            for _ in range(k - 1):
                other.append(m.popleft())
        else:
            out.append(len(m))
    return out, [len(m) for m in model]


def _model_ring_ops(ops, cap=8) -> list:
    m: collections.deque[int] = collections.deque()
    out: list = []
    for name, *args in ops:
        if name == "push":
            ok = len(m) < cap
            if ok:
                m.append(args[0])
            out.append(ok)
        elif name == "fill":
            oks = [len(m) + k < cap for k in range(args[0])]
            m.extend(1000 * k for k, ok in enumerate(oks) if ok)
            out.append(oks)
        elif name == "pop":
            out.append(m.popleft() if m else -1)
        elif name == "pop_many":
            out.append([m.popleft() for _ in range(min(max(args[0], 0), len(m)))])
        else:
            out.append(len(m))
    return out


@HSETTINGS
@given(ops=DEQUE_OPS)
def test_deque_random_ops_match_model(impl, ops):
    assert _run_deque_ops(impl, ops) == _model_deque_ops(ops)


@HSETTINGS
@given(ops=RING_OPS)
@pytest.mark.parametrize("kind", RING_KINDS)
def test_ring_random_ops_match_model(impl, kind, ops):
    out, _ = _run_ring_ops(impl, kind, ops)
    assert out == _model_ring_ops(ops)


@needs_native
@HSETTINGS
@given(ops=DEQUE_OPS)
def test_cross_check_deque_native_vs_python(ops):
    assert _run_deque_ops(_cqueues, ops) == _run_deque_ops(_pyqueues, ops)


@needs_native
@HSETTINGS
@given(ops=RING_OPS)
@pytest.mark.parametrize("kind", RING_KINDS)
def test_cross_check_ring_native_vs_python(kind, ops):
    """Same results, and the same bytes in shared memory (the layout is shared)."""
    native = _run_ring_ops(_cqueues, kind, ops)
    python = _run_ring_ops(_pyqueues, kind, ops)
    assert native[0] == python[0]
    assert native[1] == python[1]


@needs_native
@pytest.mark.parametrize("kind", RING_KINDS)
def test_rings_interoperate_on_one_buffer(kind):
    """A ring written by one implementation is readable by the other (shared layout)."""
    cap = 8
    buf = bytearray(getattr(_cqueues, kind).nbytes(cap))
    qn = getattr(_cqueues, kind)(_cqueues.Region(buf), 0, cap)
    qp = getattr(_pyqueues, kind)(_pyqueues.Region(buf), 0, cap)
    qn.init()
    expected = collections.deque()
    nxt = 0
    for lap in range(40):
        writer, reader = (qn, qp) if lap % 2 else (qp, qn)
        while writer.push(nxt):
            expected.append(nxt)
            nxt += 1
        assert len(reader) == len(writer) == cap
        for _ in range(1 + lap % cap):
            assert reader.pop() == expected.popleft()


@needs_native
def test_deque_interoperates_on_one_buffer():
    cap = 8
    buf = bytearray(_cqueues.Deque.nbytes(cap))
    dn = _cqueues.Deque(_cqueues.Region(buf), 0, cap)
    dp = _pyqueues.Deque(_pyqueues.Region(buf), 0, cap)
    dn.init()
    expected = collections.deque()
    nxt = 0
    for lap in range(40):
        owner, thief = (dn, dp) if lap % 2 else (dp, dn)
        while owner.push(nxt):
            expected.append(nxt)
            nxt += 1
        assert len(thief) == cap
        assert thief.steal() == expected.popleft()
        assert owner.pop() == expected.pop()
        if lap % 4 == 0:  # drain completely, including the last-item pop
            while expected:
                assert owner.pop() == expected.pop()
            assert owner.pop() == -1 and thief.steal() == -1
            assert len(dn) == len(dp) == 0


@needs_native
def test_the_native_spin_returns_as_soon_as_a_look_finds_something():
    """_cqueues.spin (Worker.search's spin rounds): all ``n`` rounds when nothing shows; the
    round it shows in when the inbox, the injector or a victim's deque holds an item, or a
    stop word is set; nothing taken."""
    impl = _cqueues
    nd, nm, ns = (getattr(impl, k).nbytes(8) for k in ALL_KINDS)
    words = 2 * LINE
    region = impl.Region(bytearray(2 * nd + nm + ns + words))
    d1 = impl.Deque(region, 0, 8)
    d2 = impl.Deque(region, nd, 8)
    inj = impl.MPMCRing(region, 2 * nd, 8)
    inbox = impl.SPSCRing(region, 2 * nd + nm, 8)
    for q in (d1, d2, inj, inbox):
        q.init()
    stop, shut = 2 * nd + nm + ns, 2 * nd + nm + ns + LINE

    def spin(n: int) -> int:
        return impl.spin(n, inbox, inj, [d1, d2], region, stop, shut)

    def shows() -> bool:  # the same looks once, without the yield or the stop words
        return impl.something_shows(inbox, inj, [d1, d2])

    assert spin(5) == 5 and spin(1) == 1 and not shows()
    for push, take in ((inbox.push, inbox.pop), (inj.push, inj.pop), (d2.push, d2.pop)):
        assert push(7)
        assert spin(5) == 1 and shows()
        assert take() == 7  # nothing was taken by the spin or the look
        assert spin(5) == 5 and not shows()
    assert d2.push(9) and not impl.something_shows(inbox, inj, [d1])  # only the victims'
    assert d2.pop() == 9
    for off in (stop, shut):
        region.store32(off, 1)
        assert spin(5) == 1
        region.store32(off, 0)
    assert spin(3) == 3
    with pytest.raises(IndexError):  # a word outside the region
        impl.spin(1, inbox, inj, [], region, 1 << 30, shut)


@needs_native
def test_store_u64s_writes_what_struct_packs_and_refuses_words_outside():
    """Region.store_u64s (Worker.flush's counters): the bytes struct.pack_into wrote
    before, and an error (nothing written) for a row that does not fit or a bad value."""
    import struct

    buf = bytearray(64)
    region = _cqueues.Region(buf)
    vals = [0, 1, 2**63 + 5, 2**64 - 1, 12345]
    region.store_u64s(8, vals)
    want = bytearray(64)
    struct.pack_into("=5Q", want, 8, *vals)
    assert buf == want
    region.store_u64s(0, [])  # nothing to store: nothing checked either
    for off, row in ((32, [1] * 5), (4, [1]), (-8, [1])):
        with pytest.raises(IndexError):
            region.store_u64s(off, row)
    assert buf == want
    with pytest.raises(OverflowError):
        region.store_u64s(0, [-1])


@needs_native
def test_peers_to_poke_finds_a_ready_peer_with_agents_behind_a_step():
    """_cqueues.peers_to_poke (Host.poke_peers' first look): True only for a peer other than
    the caller with W_RUNNABLE and W_IN_STEP set and W_STATE ready; every other mix, and
    the caller's own words, say no; a layout past the region is refused."""
    import itertools

    from stealer.shared.shm import STATE_READY, W_IN_STEP, W_RUNNABLE, W_STATE, WORKER_BYTES

    n, base0 = 3, 64
    region = _cqueues.Region(bytearray(base0 + n * WORKER_BYTES))

    def look(k: int) -> bool:
        return _cqueues.peers_to_poke(region, base0, WORKER_BYTES, n, k, W_RUNNABLE,
                                      W_IN_STEP, W_STATE, STATE_READY)

    for runnable, in_step, state in itertools.product((0, 2), (0, 1), (STATE_READY, 2)):
        b = base0 + WORKER_BYTES * 1
        region.store32(b + W_RUNNABLE, runnable)
        region.store32(b + W_IN_STEP, in_step)
        region.store32(b + W_STATE, state)
        want = bool(runnable and in_step and state == STATE_READY)
        assert look(0) is want and look(2) is want
        assert look(1) is False  # its own words never count
    with pytest.raises(IndexError):
        _cqueues.peers_to_poke(region, base0, WORKER_BYTES, n + 1, 0, W_RUNNABLE, W_IN_STEP,
                               W_STATE, STATE_READY)
