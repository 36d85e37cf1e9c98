"""Leases (records.py): every take off a shared queue names its handle where a recoverer
finds it, and what recovery.Recovery does with the handles it finds.

Queue tests run on both queue implementations (``native``: stealer._cqueues,
``python``: stealer.shared.pyqueues) over a bytearray region: lease words at the
start, the structure after them.  Recovery tests run on a real segment set up
like stealer/client/pool.py does, for the three arenas of tests/rig.py.
"""

from __future__ import annotations

import struct
from types import ModuleType
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rig import IMPLS, Rig, rig_fixture, ring_items

from stealer.shared._layout import (
    F_BUFFERS,
    K_CHILD,
    K_ROOT,
    S_CANCELLED,
    S_DONE,
    S_FREE,
    S_FREEING,
    S_QUEUED,
    S_RUNNING,
)
from stealer.shared.records import Outcome, word
from stealer.shared.shm import W_CURRENT

LEASES = 256  # bytes of lease words before the structure (32 words)
_Q64 = struct.Struct("=Q")
_I64 = struct.Struct("=q")


def make(impl: ModuleType, kind: str, capacity: int = 64, count: int = 1) -> tuple[Any, ...]:
    """``count`` structures ``kind`` after LEASES bytes of lease words: (buf, region, *qs)."""
    cls = getattr(impl, kind)
    size = cls.nbytes(capacity)
    buf = bytearray(LEASES + size * count)
    region = impl.Region(buf)
    qs = []
    for i in range(count):
        q = cls(region, LEASES + size * i, capacity)
        q.init()
        qs.append(q)
    return (buf, region, *qs)


def lease(buf: bytearray, i: int = 0) -> int:
    """Lease word i (handle + 1, 0: none)."""
    return _Q64.unpack_from(buf, 8 * i)[0]


def leases(buf: bytearray, n: int) -> list[int]:
    return [lease(buf, i) for i in range(n)]


# --------------------------------------------------------------------------- Deque


def test_deque_pop_and_steal_lease_each_taken_item(impl):
    buf, _r, d = make(impl, "Deque")
    d.set_lease(16)
    for h in range(100, 110):
        assert d.push(h)
    assert lease(buf, 2) == 0  # pushes lease nothing
    for want in (109, 108):
        assert d.pop() == want
        assert lease(buf, 2) == want + 1
    for want in (100, 101):
        assert d.steal() == want
        assert lease(buf, 2) == want + 1
    while (h := d.pop()) >= 0:
        assert lease(buf, 2) == h + 1
    assert h == impl.EMPTY
    assert lease(buf, 2) == 102 + 1  # the last one taken; an empty pop leases nothing
    assert d.steal() == impl.EMPTY
    assert lease(buf, 2) == 103
    assert leases(buf, 2) == [0, 0]  # no other word written


def test_deque_lease_of_handle_zero_and_large(impl):
    buf, _r, d = make(impl, "Deque")
    d.set_lease(0)
    for h in (0, (1 << 62) | 5):
        assert d.push(h)
        assert d.pop() == h
        assert lease(buf) == h + 1  # 0 means "none": handle 0 is leased as 1
        assert d.push(h)
        assert d.steal() == h
        assert lease(buf) == h + 1


def test_deque_lease_off(impl):
    buf, _r, d = make(impl, "Deque")
    d.set_lease(8)
    assert d.push(5)
    assert d.pop() == 5
    d.set_lease(-1)
    for h in (6, 7):
        assert d.push(h)
    assert d.pop() == 7
    assert d.steal() == 6
    assert leases(buf, 3) == [0, 6, 0]


@pytest.mark.parametrize("where", ["misaligned", "past-end"])
def test_set_lease_rejects_bad_offsets(impl, where):
    for kind in ("Deque", "MPMCRing"):
        buf, _region, q = make(impl, kind)
        with pytest.raises(IndexError):
            q.set_lease(4 if where == "misaligned" else len(buf))


def test_deque_lease_survives_last_item_race_order(impl):
    """One item: the owner's pop takes it (the CAS on top); the lease names it."""
    buf, _r, d = make(impl, "Deque")
    d.set_lease(0)
    assert d.push(42)
    assert d.pop() == 42
    assert lease(buf) == 43
    assert len(d) == 0
    assert d.steal() == impl.EMPTY
    assert d.push(43)
    assert d.steal() == 43
    assert lease(buf) == 44


@pytest.mark.parametrize("n,cap", [(1, 32), (2, 32), (7, 32), (20, 32), (20, 4), (64, 2)])
def test_steal_half_leases(impl, n, cap):
    buf, _r, victim, dest = make(impl, "Deque", 64, count=2)
    for h in range(200, 200 + n):
        assert victim.push(h)
    victim.set_lease(8)  # the thief's lease words: 8 (first item), 16 (the ones moving)
    first = victim.steal_half(dest, cap)
    assert first == 200
    moved = min((n - 1) // 2, cap - 1)
    assert len(dest) == moved
    assert lease(buf, 1) == 201  # the first item
    if moved:
        # each further item was leased in the next word until it was in dest: the
        # last one moved is what that word holds now
        assert lease(buf, 2) == 200 + moved + 1
    else:
        assert lease(buf, 2) == 0
    assert lease(buf, 0) == 0 and lease(buf, 3) == 0
    # dest got 201.. in order (the owner pops the newest first)
    assert [dest.pop() for _ in range(moved)] == list(range(200 + moved, 200, -1))
    # the lease pointer is back on the first word
    if len(victim):
        h = victim.steal()
        assert lease(buf, 1) == h + 1
        assert lease(buf, 2) == (200 + moved + 1 if moved else 0)


def test_steal_half_empty_leases_nothing(impl):
    buf, _r, victim, dest = make(impl, "Deque", 16, count=2)
    victim.set_lease(0)
    assert victim.steal_half(dest, 8) == impl.EMPTY
    assert leases(buf, 4) == [0, 0, 0, 0]


# --------------------------------------------------------------------------- repair


def _top_bottom(buf: bytearray) -> tuple[int, int]:
    return _I64.unpack_from(buf, LEASES)[0], _I64.unpack_from(buf, LEASES + 64)[0]


@pytest.mark.parametrize("top", [1, 5, 1 << 40])
def test_repair_empties_a_deque_with_bottom_below_top(impl, top):
    buf, _r, d = make(impl, "Deque", 8)
    # a pop killed between its reservation (bottom - 1) and its undo, on an empty deque
    _I64.pack_into(buf, LEASES, top)
    _I64.pack_into(buf, LEASES + 64, top - 1)
    assert d.repair() is True
    assert _top_bottom(buf) == (top, top)
    assert len(d) == 0
    assert d.pop() == impl.EMPTY
    assert d.steal() == impl.EMPTY
    assert d.repair() is False
    # usable: a full round of pushes, pops and steals
    for h in range(8):
        assert d.push(h)
    assert not d.push(99)  # full at capacity, not before
    assert d.steal() == 0
    assert d.pop() == 7
    assert d.steal() == 1
    assert [d.pop() for _ in range(5)] == [6, 5, 4, 3, 2]
    assert d.pop() == impl.EMPTY
    assert d.steal() == impl.EMPTY


@pytest.mark.parametrize("top,bottom", [(0, 0), (3, 3), (2, 6), (1 << 40, (1 << 40) + 3)])
def test_repair_leaves_a_consistent_deque_alone(impl, top, bottom):
    buf, _r, d = make(impl, "Deque", 8)
    _I64.pack_into(buf, LEASES, top)
    _I64.pack_into(buf, LEASES + 64, bottom)
    for i in range(top, bottom):  # the items top..bottom-1
        _Q64.pack_into(buf, LEASES + 128 + 8 * (i & 7), 1000 + i - top)
    image = bytes(buf)
    assert d.repair() is False
    assert bytes(buf) == image
    n = bottom - top
    assert len(d) == n
    if n:
        assert d.steal() == 1000
        assert d.pop() == 1000 + n - 1


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.sampled_from(["push", "pop", "steal", "kill_pop"]), max_size=40))
def test_repair_after_killed_pops_keeps_every_item_somewhere(ops):
    """A pop killed after its reservation: repair() plus the lease account for every item."""
    for mod in (m for m in IMPLS.values() if m is not None):
        buf, _r, d = make(mod, "Deque", 16)
        d.set_lease(0)
        model: list[int] = []
        taken: list[int] = []
        nxt = 0
        for op in ops:
            if op == "push" and len(model) < 16:
                assert d.push(nxt)
                model.append(nxt)
                nxt += 1
            elif op == "pop":
                h = d.pop()
                assert h == (model.pop() if model else mod.EMPTY)
                if h >= 0:
                    taken.append(h)
            elif op == "steal":
                h = d.steal()
                assert h == (model.pop(0) if model else mod.EMPTY)
                if h >= 0:
                    taken.append(h)
            elif op == "kill_pop":
                # the owner died right after `bottom -= 1` (the lease already written)
                t, b = _top_bottom(buf)
                if b > t:
                    _Q64.pack_into(buf, 0, _Q64.unpack_from(buf, LEASES + 128 + 8 * ((b - 1) & 15))[0] + 1)
                _I64.pack_into(buf, LEASES + 64, b - 1)
                lost = model.pop() if model else None
                assert d.repair() is (b - 1 < t)
                if lost is not None:
                    assert lease(buf) == lost + 1  # the recoverer finds it there
                    taken.append(lost)
        assert sorted(taken + model) == list(range(nxt))
        assert len(d) == len(model)


# --------------------------------------------------------------------------- MPMCRing


def test_ring_pop_leases(impl):
    buf, _r, q = make(impl, "MPMCRing", 16)
    q.set_lease(24)
    for v in (0, 7, 1 << 62):
        assert q.push(v)
    for v in (0, 7, 1 << 62):
        assert q.pop() == v
        assert lease(buf, 3) == v + 1
    assert q.pop() == impl.EMPTY
    assert lease(buf, 3) == (1 << 62) + 1
    q.set_lease(-1)
    assert q.push(9)
    assert q.pop() == 9
    assert lease(buf, 3) == (1 << 62) + 1
    assert leases(buf, 3) == [0, 0, 0]


@pytest.mark.parametrize("have,n", [(5, 3), (5, 5), (3, 8), (0, 4), (16, 16)])
def test_ring_pop_many_leases_slot_i(impl, have, n):
    buf, _r, q = make(impl, "MPMCRing", 16)
    q.set_lease(8 * 20)  # the ring's own lease word, used by single pops
    for v in range(50, 50 + have):
        assert q.push(v)
    got = q.pop_many(n, 0)
    assert got == list(range(50, 50 + min(have, n)))
    assert leases(buf, 17) == [v + 1 for v in got] + [0] * (17 - len(got))
    assert lease(buf, 20) == 0  # pop_many with lease_off does not use the ring's word
    # the ring's own lease is back in force afterwards
    assert q.push(99)
    while (v := q.pop()) >= 0 and v != 99:
        pass
    assert lease(buf, 20) == 100


def test_ring_pop_many_without_lease_off_uses_set_lease(impl):
    buf, _r, q = make(impl, "MPMCRing", 16)
    q.set_lease(8)
    for v in range(3):
        assert q.push(v)
    assert q.pop_many(8) == [0, 1, 2]
    assert leases(buf, 3) == [0, 3, 0]  # the last taken, in the ring's own word


@pytest.mark.parametrize("where", ["past-end", "misaligned"])
def test_ring_pop_many_bad_lease_off_takes_nothing(impl, where):
    """A lease slot outside the region is an error before anything is taken (none lost)."""
    buf, _region, q = make(impl, "MPMCRing", 16)
    for v in range(4):
        assert q.push(v)
    off = len(buf) if where == "past-end" else 4
    with pytest.raises(IndexError):
        q.pop_many(2, off)
    assert len(q) == 4
    assert q.pop_many(8) == [0, 1, 2, 3]


# --------------------------------------------------------------------------- Recovery


rig = rig_fixture()


def _record(rig: Rig, state: int, who: int = 0, kind: int = K_ROOT, link: int = 0) -> int:
    """A record of ``kind`` linked to ``link``, forced into (state, who); its handle."""
    a = rig.arena
    h = a.alloc()
    assert h >= 0
    a.setup(h, kind, link, 0)
    a.region.store64(a.off(h), word(h >> 32, state, who))
    return h


def _free_ring(rig: Rig) -> list[int]:
    return ring_items(rig.arena.rec_free)


def test_leased_queued_is_pushed_again(rig):
    a = rig.arena
    h = a.submit_inline(K_ROOT, 5, b"call")
    assert rig.injector.pop() == h  # the dead worker had taken it, not started it
    rig.recovery.leased(h, 1)
    assert rig.injector.pop_many(4) == [h]
    assert a.tr.load(h) == (h >> 32, S_QUEUED, 0)
    assert a.start(h, rig.layout.worker(1) + W_CURRENT, 1, -1, 2) == (K_ROOT, 5, b"call")


def test_leased_queued_still_queued_two_copies_one_start(rig):
    a = rig.arena
    h = a.submit_inline(K_ROOT, 5, b"call")  # still on the injector
    rig.recovery.leased(h, 1)
    copies = rig.injector.pop_many(4)
    assert copies == [h, h]
    cur = rig.layout.worker(0) + W_CURRENT
    assert a.start(copies[0], cur, 1, -1, 1) is not None
    assert a.start(copies[1], cur, 1, -1, 1) is None  # the stale copy is dropped


def test_leased_cancelled_is_freed(rig):
    a = rig.arena
    h = a.submit_inline(K_ROOT, 5, b"call")
    assert rig.injector.pop() == h
    assert a.tr.cancel(h) is Outcome.OK
    rig.recovery.leased(h, 1)
    assert a.tr.load(h) == ((h >> 32) + 1, S_FREE, 0)
    assert _free_ring(rig).count(h & 0xFFFFFFFF) == 1
    assert len(rig.injector) == 0
    rig.recovery.leased(h, 1)  # again (both the lease and the current word named it): nothing
    assert _free_ring(rig).count(h & 0xFFFFFFFF) == 1


@pytest.mark.parametrize("dead", [1, 2])
def test_leased_freeing_by_the_dead_is_finished(rig, dead):
    a = rig.arena
    h = _record(rig, S_FREEING, 1)
    rig.recovery.leased(h, dead)
    if dead == 1:
        assert a.tr.load(h) == ((h >> 32) + 1, S_FREE, 0)
        assert h & 0xFFFFFFFF in _free_ring(rig)
    else:  # another worker is freeing it: not ours
        assert a.tr.load(h) == (h >> 32, S_FREEING, 1)
        assert h & 0xFFFFFFFF not in _free_ring(rig)


def test_leased_allocated_never_set_up_is_given_back(rig):
    """spawn() leases a child's record right after its alloc: killed before setup, the
    record is FREE, off the free ring and in no queue; its recoverer gives it back."""
    a = rig.arena
    h = a.alloc()
    assert h >= 0
    assert len(a.rec_free) == a.nrecords - 1
    rig.recovery.leased(h, 1)
    assert len(a.rec_free) == a.nrecords
    assert a.tr.state(h) is None  # the generation moved on
    assert len(rig.injector) == 0


@pytest.mark.parametrize("state,who", [(S_RUNNING, 1), (S_DONE, 1), (S_DONE, 0), (S_RUNNING, 2)])
def test_leased_running_or_done_left_to_the_scans(rig, state, who):
    a = rig.arena
    h = _record(rig, state, who)
    before = _free_ring(rig)
    rig.recovery.leased(h, 1)
    assert a.tr.load(h) == (h >> 32, state, who)
    assert len(rig.injector) == 0
    assert _free_ring(rig) == before


@pytest.mark.parametrize("then", [S_QUEUED, S_CANCELLED, S_FREEING])
def test_leased_stale_is_ignored(rig, then):
    a = rig.arena
    for _ in range(a.nrecords - 1):
        assert a.alloc() >= 0
    old = a.submit_inline(K_ROOT, 1, b"old")
    assert rig.injector.pop() == old
    assert a.release(old, S_QUEUED, 0, 0) is Outcome.OK
    rig.recovery.leased(old, 1)  # freed, not reused
    assert len(rig.injector) == 0
    assert _free_ring(rig) == [old & 0xFFFFFFFF]
    new = _record(rig, then, 1 if then == S_FREEING else 0)
    assert new & 0xFFFFFFFF == old & 0xFFFFFFFF
    rig.recovery.leased(old, 1)  # reused in a state the rules would act on: still ignored
    assert len(rig.injector) == 0
    assert a.tr.load(new) == (new >> 32, then, 1 if then == S_FREEING else 0)
    assert _free_ring(rig) == []


@pytest.mark.parametrize("h", [-1, 16, 17, (3 << 32) | 0xFFFFFFFF])
def test_leased_garbage_is_ignored(rig, h):
    rig.recovery.leased(h, 1)
    assert len(rig.injector) == 0
    assert len(rig.arena.rec_free) == rig.arena.nrecords


def test_children_finds_exactly_the_live_children(rig):
    a = rig.arena
    parent = _record(rig, S_RUNNING, 1)
    other = _record(rig, S_RUNNING, 2)
    want = set()
    for state, who in [(S_QUEUED, 0), (S_RUNNING, 2), (S_DONE, 1), (S_DONE, 0),
                       (S_CANCELLED, 0), (S_FREEING, 1)]:
        h = _record(rig, state, who, K_CHILD, parent)
        want.add((h, state, who))
    flagged = _record(rig, S_DONE, 2, K_CHILD | F_BUFFERS, parent)  # flags beside the kind
    want.add((flagged, S_DONE, 2))
    _record(rig, S_QUEUED, 0, K_CHILD, other)  # another parent's child
    _record(rig, S_QUEUED, 0, K_ROOT, parent)  # a root whose future id equals the handle
    gone = _record(rig, S_DONE, 1, K_CHILD, parent)
    a.free(gone)  # freed: kind and link stay in the record, but it is no child any more
    # a child of an earlier generation of the parent's record is not the parent's
    stale_parent = parent + (1 << 32)
    _record(rig, S_RUNNING, 1, K_CHILD, stale_parent)
    got = rig.recovery.children(parent)
    assert len(got) == len(set(got))
    assert set(got) == want
    assert rig.recovery.children(other) != []
    assert rig.recovery.children(gone) == []


def test_children_of_reused_child_record(rig):
    a = rig.arena
    parent = _record(rig, S_RUNNING, 1)
    held = [a.alloc() for _ in range(a.nrecords - 2)]  # one record left
    assert all(h >= 0 for h in held)
    kid = _record(rig, S_DONE, 1, K_CHILD, parent)
    assert rig.recovery.children(parent) == [(kid, S_DONE, 1)]
    assert a.release(kid, S_DONE, 1, 0) is Outcome.OK
    assert rig.recovery.children(parent) == []
    kid2 = _record(rig, S_QUEUED, 0, K_CHILD, parent)
    assert kid2 & 0xFFFFFFFF == kid & 0xFFFFFFFF and kid2 != kid
    assert rig.recovery.children(parent) == [(kid2, S_QUEUED, 0)]


def test_held_by_finds_exactly_the_held_records(rig):
    a = rig.arena
    made: list[tuple[int, int, int]] = []
    for state, who in [(S_RUNNING, 1), (S_RUNNING, 2), (S_DONE, 1), (S_DONE, 0),
                       (S_FREEING, 1), (S_FREEING, 2), (S_QUEUED, 0), (S_CANCELLED, 0),
                       (S_RUNNING, 1), (S_DONE, 1)]:
        made.append((_record(rig, state, who), state, who))
    # a record freed after being RUNNING|1 (generation moved on, state FREE)
    h = _record(rig, S_RUNNING, 1)
    a.region.store64(a.off(h), word(h >> 32, S_FREEING, 0))
    a.free(h)
    for who in (0, 1, 2, 3):
        for states in [(S_RUNNING,), (S_DONE,), (S_FREEING,), (S_RUNNING, S_DONE),
                       (S_QUEUED, S_CANCELLED)]:
            want = sorted(h for h, s, w in made if w == who and s in states)
            assert sorted(rig.recovery.held_by(who, states)) == want, (who, states)
    # generations are part of the handles it returns
    h2 = made[0][0]
    a.region.store64(a.off(h2), word((h2 >> 32) + 7, S_RUNNING, 1))
    assert ((h2 & 0xFFFFFFFF) | (((h2 >> 32) + 7) << 32)) in rig.recovery.held_by(1, (S_RUNNING,))
