"""No record lost after any death (issue 20): the windows where a worker's record is on no
ring and named by no word, closed.

* free: between a free's FREE store and its push's claim (``record.free_after_state``;
  HotPath.c_free natively, Arena.free in the reference).  The push is named before the
  store (``MPMCRing.pre_push``: position unknown), and the client's repair of the dead
  worker's intent (stealer/client/ringfix.py) gives the record back when its push never landed.
* alloc: between the free-ring pop and the setup that makes the record somebody's
  (``record.alloc_after_pop``: spawn's, and the agents' messages, replies and
  checkpoints).  The pop names the record's handle in W_ALLOC before it releases its
  cell (``MPMCRing.set_take``); the recoverer frees it if it is still FREE in that
  generation (stealer/shared/recovery.py ``allocated``).

The single-process cases build each death by hand on both queue implementations; the
last ones kill a real worker inside each window (native and Python hot paths) and check
``records_free`` comes back to its start value.
"""

from __future__ import annotations

import time

import pytest
import tasks
from rig import IMPLS, _py_hotpath, rig_fixture

import stealer
from stealer.client import ringfix
from stealer.shared import pyqueues as _pyqueues
from stealer.shared._layout import RECORD_BYTES, RING_POP, RING_PUSH, S_FREE, S_QUEUED
from stealer.shared.arena import Arena
from stealer.shared.records import unpack, word
from stealer.shared.shm import LINE, W_ALLOC, W_RING_OP

rig = rig_fixture()

NOTHING, DONE, PENDING = ringfix.NOTHING, ringfix.DONE, ringfix.PENDING


def test_the_unknown_position_is_one_value_in_both_implementations():
    native = pytest.importorskip("stealer._cqueues")
    assert native.POS_UNKNOWN_VALUE == _pyqueues.POS_UNKNOWN == ringfix.POS_UNKNOWN


# -- the rig: a segment set up like the pool's, one "worker" block whose words we read ------
K = 0  # the worker whose death we stage


def _worker_words(rig) -> int:
    return rig.layout.worker(K)


def _as_worker(rig):
    """Worker K's arena over the rig's segment, set up as worker.py sets its own up
    (intents on every MPMC ring, W_ALLOC on the free ring); the rig's arena and recovery
    stay the client's."""
    base = _worker_words(rig)
    with _py_hotpath(rig.cfg == "native-pyarena"):
        w = Arena(rig.seg, rig.injector)
    for q in w.mpmc_rings(rig.inboxes):
        q.set_intent(base + W_RING_OP)
    w.set_worker(base)
    rig.w = w
    return base


def _intent(rig) -> tuple[int, int, int]:
    r, base = rig.arena.region, _worker_words(rig)
    return r.load64(base + W_RING_OP), r.load64(base + W_RING_OP + 8), r.load64(base + W_RING_OP + 16)


def _recover(rig, live=()):
    """What the client's recovery does with dead worker K's intent and W_ALLOC
    (client/deaths.py repair_rings and recover): repair, then the record W_ALLOC names."""
    a = rig.arena
    op, pos, val = _intent(rig)
    out = ringfix.repair(a.region, a.ring_caps, op, pos, live, val, a.free_ring_offsets(),
                         lambda off, v: rig.recovery.give_back(off, v),
                         lambda off, v: rig.recovery.owned(off, v))
    took = a.region.load64(_worker_words(rig) + W_ALLOC)
    if took:
        rig.recovery.allocated(took - 1)
    return out


def _free_count(rig) -> int:
    return len(rig.arena.rec_free)


def _ring_values(rig) -> list[int]:
    """The record indices on the free ring, in order (the ring left as it was)."""
    a = rig.arena
    q = a.rec_free
    r = a.region
    enq, deq = r.load64(q.offset), r.load64(q.offset + LINE)
    cells = q.offset + 2 * LINE
    return [r.load64(cells + 16 * (p & (q.capacity - 1)) + 8) for p in range(deq, enq)]


def _state(rig, idx: int) -> tuple[int, int, int]:
    return unpack(rig.arena.region.load64(rig.arena.rec_base + RECORD_BYTES * idx))


def _a_held_record(rig) -> int:
    """A record set up (QUEUED, on no queue): what a worker frees after its use."""
    a = rig.arena
    h = a.alloc()
    a.setup(h, 0, 0, 0)
    return h


def test_killed_after_the_free_named_its_push_and_before_the_free_store(rig):
    """The pre-intent names the push before the FREE store: dead before the store, the
    record is not FREE (its holder's other words cover it): nothing is pushed."""
    base = _as_worker(rig)
    h = _a_held_record(rig)
    n0 = _free_count(rig)
    rig.w.rec_free.pre_push(h & 0xFFFFFFFF)
    assert _intent(rig)[1] == ringfix.POS_UNKNOWN
    assert _recover(rig) == NOTHING
    assert _free_count(rig) == n0 and _state(rig, h & 0xFFFFFFFF)[1] == S_QUEUED
    assert base


def test_killed_between_the_free_store_and_the_push(rig):
    """FREE and on no ring: the repair of the pre-intent gives it back, once."""
    _as_worker(rig)
    a = rig.arena
    h = _a_held_record(rig)
    idx = h & 0xFFFFFFFF
    n0 = _free_count(rig)
    rig.w.rec_free.pre_push(idx)
    a.region.store64(a.off(h), word((h >> 32) + 1, S_FREE))  # the free's store, then death
    assert _recover(rig) == DONE  # (asked once per death: client/deaths.py repair_rings)
    assert _free_count(rig) == n0 + 1 and _ring_values(rig).count(idx) == 1


def _say(rig, op: int, pos: int, v: int) -> None:
    r, base = rig.arena.region, _worker_words(rig)
    r.store64(base + W_RING_OP + 16, v)
    r.store64(base + W_RING_OP + 8, pos)
    r.store64(base + W_RING_OP, op)


def _freed_and_named(rig) -> tuple[int, int, int]:
    """A record freed by the dead worker up to its push's intent (a position named, the
    CAS not made): (index, its ring's enqueue position, the push op)."""
    _as_worker(rig)
    a = rig.arena
    h = _a_held_record(rig)
    idx = h & 0xFFFFFFFF
    rig.w.rec_free.pre_push(idx)
    a.region.store64(a.off(h), word((h >> 32) + 1, S_FREE))
    pos = a.region.load64(a.rec_free.offset)
    op = (a.rec_free.offset << 2) | RING_PUSH
    _say(rig, op, pos, idx)
    return idx, pos, op


def test_killed_after_naming_the_position_before_the_cas(rig):
    idx, _pos, _op = _freed_and_named(rig)
    n0 = _free_count(rig)
    assert _recover(rig) == DONE  # nobody claimed the position: not on the ring
    assert _free_count(rig) == n0 + 1 and _ring_values(rig).count(idx) == 1


def test_killed_after_losing_the_cas_to_another_producer(rig):
    """Another producer took the named position (its value there, popped or not): ours
    never landed, it is given back."""
    idx, _pos, _op = _freed_and_named(rig)
    a = rig.arena
    other = _a_held_record(rig)
    q = a.rec_free  # the client's: no intent (another process)
    a.region.store64(a.off(other), word((other >> 32) + 1, S_FREE))
    assert q.push(other & 0xFFFFFFFF)
    assert _recover(rig) == DONE
    assert _ring_values(rig).count(idx) == 1 and _ring_values(rig).count(other & 0xFFFFFFFF) == 1


def test_killed_after_the_push_landed(rig):
    """The push landed (its cell written; then maybe taken by an alloc that has not set
    the record up yet: still FREE): never pushed twice."""
    idx, pos, _op = _freed_and_named(rig)
    a = rig.arena
    q = a.rec_free  # the client's: no intent
    r = a.region
    assert r.load64(q.offset) == pos
    assert q.push(idx)  # our CAS won and the cell was written: only the intent's end is missing
    _say(rig, (q.offset << 2) | RING_PUSH, pos, idx)
    n0 = _free_count(rig)
    assert _recover(rig) == NOTHING
    assert _free_count(rig) == n0
    # taken off the ring again by a live alloc, not set up yet (FREE): still nothing
    while q.pop() != idx:
        pass
    before = _ring_values(rig)
    assert _recover(rig) == NOTHING
    assert _ring_values(rig) == before


def test_killed_with_the_claim_made_and_the_cell_unwritten(rig):
    idx, pos, _op = _freed_and_named(rig)
    a = rig.arena
    a.region.store64(a.rec_free.offset, pos + 1)  # the CAS, then death
    assert _recover(rig, live=[(0, 0)]) == DONE
    assert _ring_values(rig)[-1] == idx and _ring_values(rig).count(idx) == 1


def test_a_live_claim_naming_the_same_position_waits(rig):
    idx, pos, op = _freed_and_named(rig)
    a = rig.arena
    a.region.store64(a.rec_free.offset, pos + 1)
    assert _recover(rig, live=[(op, pos)]) == PENDING
    # the live one wins and writes its value: ours is given back when asked again
    other = _a_held_record(rig)
    cell = a.rec_free.offset + 2 * LINE + 16 * (pos & (a.rec_free.capacity - 1))
    a.region.store64(a.off(other), word((other >> 32) + 1, S_FREE))
    a.region.store64(cell + 8, other & 0xFFFFFFFF)
    a.region.store64(cell, pos + 1)
    assert _recover(rig) == DONE
    vals = _ring_values(rig)
    assert vals.count(idx) == 1 and vals.count(other & 0xFFFFFFFF) == 1


def test_killed_between_the_pop_and_the_setup(rig):
    """Alloc's window: the pop names the handle in W_ALLOC before it releases the cell;
    the recoverer frees the record (FREE in that generation), once."""
    base = _as_worker(rig)
    a = rig.arena
    n0 = _free_count(rig)
    h = rig.w.alloc()
    assert a.region.load64(base + W_ALLOC) == h + 1
    assert _free_count(rig) == n0 - 1
    _recover(rig)
    assert _free_count(rig) == n0 and _state(rig, h & 0xFFFFFFFF)[0] == (h >> 32) + 1
    _recover(rig)  # stale now (a newer generation): nothing again
    assert _free_count(rig) == n0


def test_a_record_set_up_since_its_alloc_is_left_alone(rig):
    base = _as_worker(rig)
    a = rig.arena
    h = rig.w.alloc()
    a.setup(h, 0, 0, 0)
    n0 = _free_count(rig)
    assert a.region.load64(base + W_ALLOC) == h + 1
    _recover(rig)
    assert _free_count(rig) == n0 and _state(rig, h & 0xFFFFFFFF)[1] == S_QUEUED
    a.free(h)  # freed since (a newer generation, on the ring): stale too
    n1 = _free_count(rig)
    _recover(rig)
    assert _free_count(rig) == n1


def test_killed_inside_the_pop_after_its_claim(rig):
    """The pop's claim made, its cell not released (ring.pop_after_claim): the repair
    gives the index back through a free (a new generation), so the handle W_ALLOC may
    name is stale and the record is given back once."""
    base = _as_worker(rig)
    a = rig.arena
    q = a.rec_free
    r = a.region
    n0 = _free_count(rig)
    deq = r.load64(q.offset + LINE)
    cell = q.offset + 2 * LINE + 16 * (deq & (q.capacity - 1))
    idx = r.load64(cell + 8)
    gen = _state(rig, idx)[0]
    r.store64(base + W_ALLOC, ((gen << 32) | idx) + 1)  # named after the claim...
    _say(rig, (q.offset << 2) | RING_POP, deq, 0)
    r.store64(q.offset + LINE, deq + 1)  # ...the claim, and death before the release
    assert _recover(rig, live=[(0, 0)]) == DONE
    assert _free_count(rig) == n0 and _ring_values(rig).count(idx) == 1
    assert _state(rig, idx)[:2] == (gen + 1, S_FREE)


@pytest.mark.parametrize("impl_name", ["native", "python"])
def test_set_take_names_what_a_pop_takes_in_both_implementations(impl_name):
    impl = IMPLS[impl_name]
    if impl is None:
        pytest.skip("native extension not built")
    nrec = 4
    rec_base = 256
    off = rec_base + RECORD_BYTES * nrec
    region = impl.Region(bytearray(off + impl.MPMCRing.nbytes(8)))
    q = impl.MPMCRing(region, off, 8)
    q.init()
    q.set_take(8, rec_base, nrec)
    region.store64(rec_base + RECORD_BYTES * 2, word(7, S_FREE))
    assert q.push(2) and q.push(9)  # 9: no record (a corrupt cell): not named
    assert q.pop() == 2 and region.load64(8) == ((7 << 32) | 2) + 1
    assert q.pop() == 9 and region.load64(8) == ((7 << 32) | 2) + 1
    q.set_take(-1)
    assert q.push(2) and q.pop() == 2
    with pytest.raises(ValueError):
        q.set_take(8, rec_base, 1 << 20)  # records beyond the region


@pytest.mark.parametrize("impl_name", ["native", "python"])
def test_pre_push_names_a_push_of_unknown_position(impl_name):
    impl = IMPLS[impl_name]
    if impl is None:
        pytest.skip("native extension not built")
    region = impl.Region(bytearray(1024))
    q = impl.MPMCRing(region, 128, 8)
    q.init()
    q.pre_push(5)  # no intent: nothing
    assert [region.load64(i) for i in (0, 8, 16)] == [0, 0, 0]
    q.set_intent(0)
    q.pre_push(5)
    assert [region.load64(i) for i in (0, 8, 16)] == [(128 << 2) | RING_PUSH,
                                                      ringfix.POS_UNKNOWN, 5]
    assert q.push(5)
    assert region.load64(0) == 0  # the push named its position and ended the op
    assert RING_POP  # (the pop side is test_ringfix's)


# -- real workers killed inside each window --------------------------------------------
def _forkjoin_load(e) -> None:
    trees = [e.submit(tasks.fib, 15, 8) for _ in range(4)]
    blocking = [e.submit(tasks.fib_blocking, 14, 8) for _ in range(2)]
    plain = [e.submit(tasks.square, i) for i in range(100)]
    assert [f.result(timeout=60) for f in trees] == [tasks.fib_seq(15)] * 4
    assert [f.result(timeout=60) for f in blocking] == [tasks.fib_seq(14)] * 2
    assert [f.result(timeout=60) for f in plain] == [i * i for i in range(100)]


@pytest.mark.parametrize("nth", [1, 50])
@pytest.mark.parametrize("hot", ["native", "python"])
@pytest.mark.parametrize("point", ["record.free_after_state", "record.alloc_after_pop"])
def test_worker_killed_inside_a_record_window(monkeypatch, tmp_path, point, hot, nth):
    """Without the fix the record the dead worker was freeing or had just taken is FREE
    and on no ring: records_free stays one short for good."""
    pytest.importorskip("stealer._cqueues")  # the reference queues are not kill-safe
    monkeypatch.setenv("STEALER_FAILPOINTS", f"{point}=kill@{nth}!once")
    monkeypatch.setenv("STEALER_FAILPOINTS_DIR", str(tmp_path))
    monkeypatch.setenv("STEALER_PY_HOTPATH", "1" if hot == "python" else "0")
    from test_failpoints import _crashes_seen

    with stealer.Executor(2, retries=5) as e:
        assert (e._pool.arena.hot is None) == (hot == "python")
        free0 = e.stats().records_free
        for _ in range(8):
            _forkjoin_load(e)
            if (tmp_path / point).exists():
                break
        assert (tmp_path / point).exists(), f"{point} was never reached"
        assert _crashes_seen(e) == 1
        _forkjoin_load(e)
        deadline = time.monotonic() + 10
        while e.stats().records_free != free0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert e.stats().records_free == free0
        assert e.stats().client["stray_completions"] == 0
