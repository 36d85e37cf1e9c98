"""MPMC ring cells a dead process left half-done, and their repair (stealer/client/ringfix.py).

A claim without its store is made by hand here (the position word moved by the
dead process's CAS, the cell untouched), on both queue implementations; a
hypothesis model runs random pushes, pops, dead claims and repairs against a
sequential oracle; the last test kills real workers inside the window
(failpoints ring.push_after_claim / ring.pop_after_claim).
"""

from __future__ import annotations

import collections
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rig import IMPLS

import stealer
from stealer.client import ringfix
from stealer.shared import pyqueues as _pyqueues
from stealer.shared._layout import RING_POP, RING_PUSH
from stealer.shared.shm import LINE

CAP = 8
OFF = 128  # the ring's offset in its buffer (an intent names it)


def _ring(impl):
    region = impl.Region(bytearray(OFF + impl.MPMCRing.nbytes(CAP)))
    q = impl.MPMCRing(region, OFF, CAP)
    q.init()
    return q, region


def _dead_claim(region, kind: int) -> tuple[int, int]:
    """A process claims the next position (its CAS) and dies: the intent it left."""
    word = OFF if kind == RING_PUSH else OFF + LINE
    pos = region.load64(word)
    region.store64(word, pos + 1)
    return (OFF << 2) | kind, pos


CAPS = {OFF: CAP}


def test_the_skip_value_is_one_value_in_both_implementations():
    native = pytest.importorskip("stealer._cqueues")
    assert native.RING_SKIP_VALUE == _pyqueues.RING_SKIP == ringfix.RING_SKIP


def test_a_dead_push_claim_stops_consumers_until_repaired(impl):
    q, region = _ring(impl)
    assert q.push(1)
    intent = _dead_claim(region, RING_PUSH)
    assert q.push(3) and q.push(4)  # producers go past the stuck cell
    assert q.pop() == 1
    assert q.pop() == impl.EMPTY  # stuck: 3 and 4 are behind a cell nobody will write
    assert ringfix.repair(region, CAPS, *intent) == ringfix.DONE
    assert [q.pop(), q.pop(), q.pop()] == [3, 4, impl.EMPTY]  # the skip cell is skipped
    assert ringfix.repair(region, CAPS, *intent) == ringfix.NOTHING  # once only
    for v in range(3 * CAP):  # the ring works on for laps
        assert q.push(v)
        assert q.pop() == v


def test_a_dead_push_claim_on_a_free_ring_is_finished_with_its_value(impl):
    """A free-record (or free-block) ring: the dead worker was giving index 42 back and
    nothing else would; its intent's value is pushed in its cell, not skipped."""
    q, region = _ring(impl)
    mine = OFF - 32  # the dying worker's W_RING_OP, W_RING_POS, W_RING_VAL
    q.set_intent(mine)
    assert q.push(1)
    word = OFF  # the enqueue position: the dead claim is the CAS alone
    pos = region.load64(word)
    region.store64(mine + 16, 42)
    region.store64(mine + 8, pos)
    region.store64(mine, (OFF << 2) | RING_PUSH)
    region.store64(word, pos + 1)
    q.set_intent(-1)
    assert q.push(3)
    intent = (region.load64(mine), region.load64(mine + 8), region.load64(mine + 16))
    assert ringfix.repair(region, CAPS, intent[0], intent[1], (), intent[2],
                          fill={OFF}) == ringfix.DONE
    assert q.pop_many(4) == [1, 42, 3]


def test_a_dead_pop_claim_fills_the_ring_one_lap_later_until_repaired(impl):
    q, region = _ring(impl)
    for v in range(CAP):
        assert q.push(v)
    intent = _dead_claim(region, RING_POP)  # took position 0 (value 0) and died
    assert q.pop_many(CAP) == list(range(1, CAP))
    assert not q.push(99)  # the next lap meets the cell never released
    assert ringfix.repair(region, CAPS, *intent) == ringfix.DONE
    assert q.push(99) and q.pop() == 99


@pytest.mark.parametrize("kind", [RING_PUSH, RING_POP])
def test_a_live_claim_of_the_same_position_is_left_alone(impl, kind):
    q, region = _ring(impl)
    assert q.push(7)
    intent = _dead_claim(region, kind)
    before = bytes(region.load64(OFF + 2 * LINE + 8 * i) for i in range(2 * CAP))
    # the dead worker named it, but a live one names it too: its CAS may be the winner
    assert ringfix.repair(region, CAPS, *intent, live=[(0, 0), intent]) == ringfix.PENDING
    assert bytes(region.load64(OFF + 2 * LINE + 8 * i) for i in range(2 * CAP)) == before
    assert ringfix.repair(region, CAPS, *intent, live=[(0, 0)]) == ringfix.DONE


def test_finished_and_unclaimed_intents_change_nothing(impl):
    q, region = _ring(impl)
    for v in range(3):
        assert q.push(v)
    assert q.pop() == 0
    cells = [region.load64(OFF + 2 * LINE + 8 * i) for i in range(2 * CAP)]
    for intent in [((OFF << 2) | RING_PUSH, 1), ((OFF << 2) | RING_POP, 0),  # finished
                   ((OFF << 2) | RING_PUSH, 3), ((OFF << 2) | RING_POP, 1),  # not claimed
                   (0, 0), ((OFF + 64) << 2 | RING_PUSH, 0), ((OFF << 2) | 3, 0)]:  # none
        assert ringfix.repair(region, CAPS, *intent) == ringfix.NOTHING, intent
    assert [region.load64(OFF + 2 * LINE + 8 * i) for i in range(2 * CAP)] == cells
    assert q.pop_many(4) == [1, 2]


def test_an_intent_lives_only_while_its_op_is_in_flight(impl):
    """Each op names its claim before the CAS (the failpoint tests below die there) and
    ends it after its store: a finished op leaves no intent a repair could match, so a
    live worker's word never holds up a dead one's repair for longer than one op."""
    q, region = _ring(impl)
    mine = OFF - 32  # this process's intent words (a worker's W_RING_OP, _POS, _VAL)
    q.set_intent(mine)
    region.store64(mine, 12345)
    assert q.push(5)
    assert region.load64(mine) == 0 and region.load64(mine + 8) == 0  # named pos 0, ended
    region.store64(mine, 12345)
    assert q.pop() == 5
    assert region.load64(mine) == 0
    region.store64(mine, 12345)
    assert q.pop() == impl.EMPTY  # nothing claimed
    assert region.load64(mine) in (0, 12345)
    for v in range(CAP):
        assert q.push(v)
    region.store64(mine, 12345)
    assert not q.push(99)  # full
    assert region.load64(mine) in (0, 12345)
    q.set_intent(-1)
    region.store64(mine, 777)
    assert q.pop() == 0
    assert region.load64(mine) == 777  # off: untouched


# -- a model: random ops and deaths against a sequential oracle -------------------------
OPS = st.lists(st.one_of(
    st.tuples(st.just("push"), st.integers(0, 2**40)),
    st.tuples(st.just("pop"), st.just(0)),
    st.tuples(st.just("dead_push"), st.just(0)),
    st.tuples(st.just("dead_pop"), st.just(0)),
    st.tuples(st.just("repair"), st.just(0)),
), max_size=60)


@settings(max_examples=150, deadline=None)
@given(ops=OPS)
def test_ring_with_deaths_matches_a_sequential_oracle(ops):
    for impl in [m for m in IMPLS.values() if m is not None]:
        q, region = _ring(impl)
        # oracle: the positions in order, each ("v", value) | ("hole",) a dead push's claim
        #         | ("skip",) a repaired hole; dead pops: positions taken, not yet released
        fifo: collections.deque = collections.deque()
        prod = cons = 0
        held: list[int] = []  # dead pops' positions, cells not released
        dead: list[tuple[int, int]] = []
        for op, v in ops:
            low = min([cons, *held])
            if op == "push":
                ok = prod - low < CAP
                assert q.push(v) is ok
                if ok:
                    fifo.append(("v", v))
                    prod += 1
            elif op == "dead_push":
                if prod - low < CAP:
                    dead.append(_dead_claim(region, RING_PUSH))
                    fifo.append(("hole",))
                    prod += 1
            elif op == "pop":
                while fifo and fifo[0] == ("skip",):
                    fifo.popleft()
                    cons += 1
                if fifo and fifo[0][0] == "v":
                    assert q.pop() == fifo.popleft()[1]
                    cons += 1
                else:
                    assert q.pop() == impl.EMPTY
            elif op == "dead_pop":
                if fifo and fifo[0][0] == "v":  # a pop claims only a written cell
                    dead.append(_dead_claim(region, RING_POP))
                    held.append(cons)
                    fifo.popleft()
                    cons += 1
            else:
                for intent in dead:
                    ringfix.repair(region, CAPS, *intent)
                dead.clear()
                held.clear()
                fifo = collections.deque(("skip",) if e == ("hole",) else e for e in fifo)
        for intent in dead:
            ringfix.repair(region, CAPS, *intent)
        rest = [e[1] for e in fifo if e[0] == "v"]
        assert q.pop_many(CAP) == rest


# -- real workers killed inside the window ---------------------------------------------
@pytest.mark.parametrize("nth", [1, 40, 300])
@pytest.mark.parametrize("point", ["ring.push_after_claim", "ring.pop_after_claim"])
def test_worker_killed_between_a_claim_and_its_store(monkeypatch, tmp_path, point, nth):
    """Without the repair a push's dead claim stops the ring it was on for every process
    (a free-record ring: no more submits; an inbox: no more pings), and a pop's stops
    its producers one lap later: the load below hangs (its timeouts fail the test)."""
    pytest.importorskip("stealer._cqueues")
    from test_failpoints import _crashes_seen, _run_mixed_load

    monkeypatch.setenv("STEALER_FAILPOINTS", f"{point}=kill@{nth}!once")
    monkeypatch.setenv("STEALER_FAILPOINTS_DIR", str(tmp_path))
    with stealer.Executor(2, retries=5) as e:
        free0 = e.stats().records_free
        for _ in range(8):  # how many ring ops one load makes per worker varies with timing
            _run_mixed_load(e)
            if (tmp_path / point).exists():
                break
        assert (tmp_path / point).exists(), f"{point} was never reached"
        assert _crashes_seen(e) == 1
        _run_mixed_load(e)
        for _ in range(2):  # lap every free-record cell: a pop's stuck cell would be met
            assert sum(e.map(abs, range(-free0, 0), chunksize=1)) == free0 * (free0 + 1) // 2
        assert e.stats().client["rings_repaired"] == 1
        deadline = time.monotonic() + 10
        while e.stats().records_free != free0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert e.stats().records_free == free0
