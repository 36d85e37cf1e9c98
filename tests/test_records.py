"""The task-record lifecycle (stealer/shared/records.py): state words and named transitions.

Every test runs on three arenas over a real segment (see tests/test_arena.py):
native queues with HotPath (``native``), native queues with the Arena's Python
methods (``native-pyarena``, ``STEALER_PY_HOTPATH=1``), and the pure-Python
reference queues (``python``).  The transition table is checked exhaustively
(every transition from every (state, holder) at the handle's generation, and
from stale generations); a hypothesis state machine drives alloc / start /
cancel / finish / requeue / fail / claim / free with fresh and stale handles
against a sequential oracle of each record's (generation, state, holder) and
of the free ring.
"""

from __future__ import annotations

import collections
import glob
import itertools
import threading
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    invariant,
    multiple,
    precondition,
    rule,
    run_state_machine_as_test,
)
from rig import CONFIGS, Rig, load_impl, make_rig, rig_fixture, ring_items

from stealer.shared._layout import (
    GEN_MASK,
    INLINE,
    K_ROOT,
    OVERFLOW,
    R_PCLASS,
    S_CANCELLED,
    S_DONE,
    S_FREE,
    S_FREEING,
    S_QUEUED,
    S_RECOVERING,
    S_RUNNING,
    ST_OK,
    STATE_MASK,
)
from stealer.shared.records import STATE_NAMES, Outcome, Transitions, unpack, word

STATES = (S_FREE, S_QUEUED, S_RUNNING, S_CANCELLED, S_DONE, S_FREEING, S_RECOVERING)
WHOS = (0, 1, 2, 3)
GEN_WRAP = 0x7FFFFFFF  # Arena.free / HotPath.c_free: generation + 1 modulo 2**31


# --------------------------------------------------------------------------- rig

rig = rig_fixture(nworkers=3)


def set_word(rig: Rig, idx: int, gen: int, state: int, who: int) -> int:
    """Force record ``idx``'s state word; returns the handle of that generation."""
    rig.arena.region.store64(rig.arena.off(idx), word(gen, state, who))
    return (gen << 32) | idx


# --------------------------------------------------------------------------- words


@given(gen=st.integers(0, GEN_MASK), state=st.integers(0, STATE_MASK),
       who=st.integers(0, (1 << 24) - 1))
def test_word_unpack_round_trip(gen, state, who):
    w = word(gen, state, who)
    assert 0 <= w < 1 << 64
    assert unpack(w) == (gen, state, who)
    assert word(gen + (1 << 32), state, who) == w  # the generation is 32 bits


@given(st.integers(0, (1 << 64) - 1))
def test_unpack_word_round_trip(w):
    g, s, who = unpack(w)
    assert word(g, s, who) == w


@pytest.mark.parametrize("impl", ["native", "python"])
@settings(max_examples=50)
@given(gen=st.integers(0, GEN_MASK), state=st.integers(0, STATE_MASK),
       who=st.integers(0, (1 << 24) - 1))
def test_word_through_region(impl, gen, state, who):
    Q = load_impl(impl)
    region = Q.Region(bytearray(64))
    tr = Transitions(region, lambda h: 8 * (h & 0xFFFFFFFF))
    region.store64(8, word(gen, state, who))
    h = (gen << 32) | 1
    assert tr.load(h) == (gen, state, who)
    assert tr.current(h)
    assert tr.state(h) == (state, who)
    other = (((gen + 1) & GEN_MASK) << 32) | 1
    assert not tr.current(other)
    assert tr.state(other) is None


def test_state_names_cover_every_state():
    assert sorted(STATE_NAMES) == sorted(STATES)
    assert len(set(STATE_NAMES.values())) == len(STATES)


# --------------------------------------------------------------------------- transition table

K = 2  # the worker (who) the transitions below name
ME = 3  # the claimer

# name -> (call, the (state, who) it starts from, the (state, who) it leaves)
NAMED = {
    "cancel": (lambda tr, h: tr.cancel(h), (S_QUEUED, 0), (S_CANCELLED, 0)),
    "finish": (lambda tr, h: tr.finish(h, K), (S_RUNNING, K), (S_DONE, K)),
    "requeue": (lambda tr, h: tr.requeue(h, K), (S_RECOVERING, K), (S_QUEUED, 0)),
    "fail": (lambda tr, h: tr.fail(h, K), (S_RECOVERING, K), (S_DONE, K)),
    "take_over-running": (lambda tr, h: tr.take_over(h, S_RUNNING, K, ME), (S_RUNNING, K),
                          (S_RECOVERING, ME)),
    "take_over-recovering": (lambda tr, h: tr.take_over(h, S_RECOVERING, K, ME),
                             (S_RECOVERING, K), (S_RECOVERING, ME)),
}
for _s, _w in itertools.product(STATES, WHOS):
    NAMED[f"claim-{STATE_NAMES[_s]}-{_w}"] = (
        lambda tr, h, s=_s, w=_w: tr.claim(h, s, w, ME), (_s, _w), (S_FREEING, ME))


@pytest.mark.parametrize("gen", [1, 5, GEN_WRAP - 1, GEN_MASK])
@pytest.mark.parametrize("name", ["cancel", "finish", "requeue", "fail", "claim", "take_over"])
def test_transition_table(rig, name, gen):
    tr = rig.arena.tr
    idx = 3
    names = [n for n in NAMED if n == name or n.startswith(name + "-")]
    for n in names:
        call, src, dst = NAMED[n]
        for s, w in itertools.product(STATES, WHOS):
            h = set_word(rig, idx, gen, s, w)
            before = rig.arena.region.load64(rig.arena.off(h))
            out = call(tr, h)
            if (s, w) == src:
                assert out is Outcome.OK, (n, s, w)
                assert tr.load(h) == (gen, *dst), n
            else:
                assert out is Outcome.CONFLICT, (n, s, w, out)
                assert rig.arena.region.load64(rig.arena.off(h)) == before, n
        # the word it starts from, through a stale handle (an older or a newer generation)
        for g in ((gen - 1) & GEN_MASK, (gen + 1) & GEN_MASK, gen ^ (1 << 31)):
            h = set_word(rig, idx, gen, *src)
            out = call(tr, (g << 32) | idx)
            assert out is Outcome.STALE, (n, g, out)
            assert tr.load(h) == (gen, *src), n


@pytest.mark.parametrize("who", [1, 2, 3])
def test_start_table(rig, who):
    """start (Arena/HotPath): QUEUED|0 -> RUNNING|who, from that word only."""
    a = rig.arena
    h = a.alloc()
    assert h >= 0
    idx = h & 0xFFFFFFFF
    a.setup(h, K_ROOT, 77, 0)
    for gen in (4, GEN_WRAP - 1):
        for s, w in itertools.product(STATES, WHOS):
            h = set_word(rig, idx, gen, s, w)
            a.region.store64(rig.cur_off(who - 1), 0)
            t = a.start(h, rig.cur_off(who - 1), 1, -1, who)
            assert a.region.load64(rig.cur_off(who - 1)) == h + 1  # set before the CAS
            if (s, w) == (S_QUEUED, 0):
                assert t == (K_ROOT, 77, b"")
                assert a.tr.load(h) == (gen, S_RUNNING, who)
            else:
                assert t is None, (s, w)
                assert a.tr.load(h) == (gen, s, w)
        for g in (gen - 1, gen + 1):
            h = set_word(rig, idx, gen, S_QUEUED, 0)
            assert a.start((g << 32) | idx, rig.cur_off(0), 1, -1, who) is None
            assert a.tr.load(h) == (gen, S_QUEUED, 0)


def test_free_bumps_generation_and_stales_the_handle(rig):
    a = rig.arena
    h = a.alloc()
    gen, idx = h >> 32, h & 0xFFFFFFFF
    a.setup(h, K_ROOT, 1, 0)
    assert a.release(h, S_QUEUED, 0, 0) is Outcome.OK
    assert a.tr.load(h) == (gen + 1, S_FREE, 0)
    assert not a.valid(h)
    assert ring_items(a.rec_free)[-1] == idx
    # near the top of the generation space it wraps to 0 (31 bits), in both implementations
    h = set_word(rig, idx, GEN_WRAP, S_FREEING, 0)
    for _ in range(a.nrecords):  # take it off the free ring first (it is "held" now)
        if a.alloc() & 0xFFFFFFFF == idx:
            break
    a.free(h)
    assert a.tr.load(h) == (0, S_FREE, 0)


STATES_OF_NEW = [(S_QUEUED, 0), (S_RUNNING, 1), (S_RUNNING, 2), (S_CANCELLED, 0),
                 (S_DONE, 1), (S_DONE, 0), (S_FREEING, 1), (S_FREEING, 0)]


@pytest.mark.parametrize("new_state", STATES_OF_NEW,
                         ids=[f"{STATE_NAMES[s]}-{w}" for s, w in STATES_OF_NEW])
def test_old_handle_never_acts_on_reused_record(rig, new_state):
    a, tr = rig.arena, rig.arena.tr
    held = [a.alloc() for _ in range(a.nrecords - 1)]  # all but one record in use
    assert all(h >= 0 for h in held)
    old = a.submit_inline(K_ROOT, 1, b"old")
    assert rig.injector.pop() == old
    assert a.release(old, S_QUEUED, 0, 0) is Outcome.OK
    new = a.submit_inline(K_ROOT, 2, b"new")
    assert rig.injector.pop() == new
    assert new & 0xFFFFFFFF == old & 0xFFFFFFFF and new >> 32 == (old >> 32) + 1
    set_word(rig, new & 0xFFFFFFFF, new >> 32, *new_state)
    before = a.region.load64(a.off(new))
    free_before = ring_items(a.rec_free)

    assert a.start(old, rig.cur_off(0), 1, -1, 1) is None
    assert a.start(old, rig.cur_off(1), 1, -1, 2) is None
    assert tr.cancel(old) is Outcome.STALE
    for who in (0, 1, 2):
        assert tr.finish(old, who) is Outcome.STALE
        assert tr.requeue(old, who) is Outcome.STALE
        assert tr.fail(old, who) is Outcome.STALE
    for s, w in itertools.product(STATES, WHOS):
        assert tr.claim(old, s, w, 1) is Outcome.STALE
        assert a.release(old, s, w, 1) is Outcome.STALE
    for who in (1, 2):
        assert a.finish_inline(old, ST_OK, b"r", rig.completions[who - 1], who) == -1
        assert rig.completions[who - 1].pop() < 0
    assert not a.valid(old)
    assert tr.state(old) is None
    rig.recovery.leased(old, 1)  # a dead worker's lease naming the old handle: ignored
    rig.recovery.leased(old, 2)
    assert len(rig.injector) == 0
    assert a.region.load64(a.off(new)) == before
    assert ring_items(a.rec_free) == free_before


def test_two_claims_one_wins(rig):
    a, tr = rig.arena, rig.arena.tr
    h = a.alloc()
    a.setup(h, K_ROOT, 1, 0)
    assert tr.cas(h, S_QUEUED, 0, S_DONE, 1) is Outcome.OK
    assert tr.claim(h, S_DONE, 1, 0) is Outcome.OK  # the client
    assert tr.claim(h, S_DONE, 1, 3) is Outcome.CONFLICT  # a recoverer, too late
    assert tr.load(h) == (h >> 32, S_FREEING, 0)
    a.free(h)
    assert tr.claim(h, S_DONE, 1, 3) is Outcome.STALE
    assert tr.claim(h, S_FREEING, 0, 3) is Outcome.STALE


def _race(fns: list) -> list:
    """Run ``fns`` at once on threads (released together); their results."""
    barrier = threading.Barrier(len(fns), timeout=30)
    out: list = [None] * len(fns)

    def go(i: int) -> None:
        barrier.wait()
        out[i] = fns[i]()

    ts = [threading.Thread(target=go, args=(i,)) for i in range(len(fns))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
        assert not t.is_alive()
    return out


def test_competing_claims_threads(rig):
    a = rig.arena
    for _round in range(20):
        h = a.alloc()
        a.setup(h, K_ROOT, 1, 0)
        assert a.tr.cas(h, S_QUEUED, 0, S_DONE, 2) is Outcome.OK
        outs = _race([lambda me=me, h=h: a.release(h, S_DONE, 2, me) for me in range(4)])
        assert outs.count(Outcome.OK) == 1, outs
        assert set(outs) <= {Outcome.OK, Outcome.CONFLICT, Outcome.STALE}
        assert a.tr.load(h) == ((h >> 32) + 1, S_FREE, 0)
        items = ring_items(a.rec_free)
        assert items.count(h & 0xFFFFFFFF) == 1
    assert sorted(ring_items(a.rec_free)) == list(range(a.nrecords))


def test_competing_start_cancel_claim_threads(rig):
    """A queued record: start by two workers, cancel, and a claim race; one wins."""
    a = rig.arena
    for _round in range(20):
        h = a.submit_inline(K_ROOT, 1, b"c")
        assert rig.injector.pop() == h
        outs = _race([
            lambda h=h: a.start(h, rig.cur_off(0), 1, -1, 1) is not None,
            lambda h=h: a.start(h, rig.cur_off(1), 1, -1, 2) is not None,
            lambda h=h: a.tr.cancel(h) is Outcome.OK,
            lambda h=h: a.tr.claim(h, S_QUEUED, 0, 3) is Outcome.OK,
        ])
        assert outs.count(True) == 1, outs
        winner = outs.index(True)
        want = [(S_RUNNING, 1), (S_RUNNING, 2), (S_CANCELLED, 0), (S_FREEING, 3)][winner]
        assert a.tr.load(h) == (h >> 32, *want)
        a.region.store64(a.off(h), word(h >> 32, S_FREEING, 0))
        a.free(h)
    assert sorted(ring_items(a.rec_free)) == list(range(a.nrecords))


# --------------------------------------------------------------------------- state machine

PAYLOADS = (0, 40, INLINE, 200)
BLOCKS = 4  # the one block class of the machine's segment: (256, 4)


class RecordMachine(RuleBasedStateMachine):
    """Records driven through the transitions, fresh and stale handles alike.

    The oracle: each record's (generation, state, who), the free ring's order
    (FIFO), and which payload storage each live record holds.
    """

    handles = Bundle("handles")

    def __init__(self, cfg: str) -> None:
        super().__init__()
        self.rig = make_rig(cfg, nworkers=3, records=8, block_classes=((256, BLOCKS),))
        n = self.rig.arena.nrecords
        self.model = [(0, S_FREE, 0)] * n
        self.free = collections.deque(range(n))
        self.call: list[bytes] = [b""] * n
        self.pclass = [0] * n
        self.max_gen = [0] * n

    def teardown(self) -> None:
        self.rig.seg.unlink()

    # -- the oracle ------------------------------------------------------------
    def expect(self, h: int, state: int, who: int) -> Outcome:
        g, s, w = self.model[h & 0xFFFFFFFF]
        if h >> 32 != g:
            return Outcome.STALE
        return Outcome.OK if (s, w) == (state, who) else Outcome.CONFLICT

    def moved(self, h: int, state: int, who: int) -> None:
        idx = h & 0xFFFFFFFF
        self.model[idx] = (self.model[idx][0], state, who)

    def freed(self, idx: int) -> None:
        g = self.model[idx][0]
        self.model[idx] = ((g + 1) & GEN_WRAP, S_FREE, 0)
        self.free.append(idx)
        self.pclass[idx] = 0
        self.call[idx] = b""  # free drops the payloads (their length fields too)

    # -- rules -------------------------------------------------------------------
    @rule(target=handles, size=st.sampled_from(PAYLOADS), submit=st.booleans())
    def alloc(self, size: int, submit: bool):
        a = self.rig.arena
        data = bytes((size + i) & 0xFF for i in range(size))
        submit = submit and size <= INLINE
        if not self.free:
            assert (a.submit_inline(K_ROOT, 0, data) if submit else a.alloc()) == -1
            return multiple()
        idx = self.free.popleft()
        if submit:
            h = a.submit_inline(K_ROOT, idx, data)
            assert self.rig.injector.pop() == h
        else:
            h = a.alloc()
            off = a.setup(h, K_ROOT, idx, 0)
            a.put(off, data, [])
        assert h == (self.model[idx][0] << 32) | idx
        self.moved(h, S_QUEUED, 0)
        self.call[idx] = data
        in_blocks = sum(c == 1 for c in self.pclass)
        self.pclass[idx] = 0 if size <= INLINE else 1 if in_blocks < BLOCKS else OVERFLOW
        pclass = int.from_bytes(a.mm[a.off(h) + R_PCLASS : a.off(h) + R_PCLASS + 4], "little")
        assert pclass == self.pclass[idx]
        return h

    @rule(h=handles, who=st.integers(1, 3))
    def start(self, h: int, who: int) -> None:
        a = self.rig.arena
        exp = self.expect(h, S_QUEUED, 0)
        cur = self.rig.cur_off(who - 1)
        t = a.start(h, cur, 1, -1, who)
        assert a.region.load64(cur) == h + 1
        assert (t is not None) == (exp is Outcome.OK), (exp, t)
        if t is not None:
            idx = h & 0xFFFFFFFF
            assert t == (K_ROOT, idx, self.call[idx] if self.pclass[idx] == 0 else None)
            self.moved(h, S_RUNNING, who)

    @rule(h=handles)
    def cancel(self, h: int) -> None:
        exp = self.expect(h, S_QUEUED, 0)
        assert self.rig.arena.tr.cancel(h) is exp
        if exp is Outcome.OK:
            self.moved(h, S_CANCELLED, 0)

    @rule(h=handles, who=st.integers(1, 3))
    def finish(self, h: int, who: int) -> None:
        exp = self.expect(h, S_RUNNING, who)
        assert self.rig.arena.tr.finish(h, who) is exp
        if exp is Outcome.OK:
            self.moved(h, S_DONE, who)

    @rule(h=handles, who=st.integers(1, 3), size=st.sampled_from([0, 30, 60]))
    def finish_inline(self, h: int, who: int, size: int) -> None:
        a = self.rig.arena
        idx = h & 0xFFFFFFFF
        at = len(self.call[idx]) if self.pclass[idx] == 0 else 0
        exp = self.expect(h, S_RUNNING, who)
        comp = self.rig.completions[who - 1]
        rc = a.finish_inline(h, ST_OK, bytes(size), comp, who)
        if at + size > INLINE:
            assert rc == 0
        elif exp is Outcome.OK:
            assert rc == 1
            assert comp.pop() == h
            self.moved(h, S_DONE, who)
        else:
            assert rc == -1
        assert comp.pop() < 0

    @rule(h=handles, who=st.integers(1, 3), me=st.integers(0, 3))
    def take_over(self, h: int, who: int, me: int) -> None:
        exp = self.expect(h, S_RUNNING, who)
        assert self.rig.arena.tr.take_over(h, S_RUNNING, who, me) is exp
        if exp is Outcome.OK:
            self.moved(h, S_RECOVERING, me)

    @rule(h=handles, me=st.integers(0, 3))
    def requeue(self, h: int, me: int) -> None:
        exp = self.expect(h, S_RECOVERING, me)
        assert self.rig.arena.tr.requeue(h, me) is exp
        if exp is Outcome.OK:
            self.moved(h, S_QUEUED, 0)

    @rule(h=handles, me=st.integers(0, 3))
    def fail(self, h: int, me: int) -> None:
        exp = self.expect(h, S_RECOVERING, me)
        assert self.rig.arena.tr.fail(h, me) is exp
        if exp is Outcome.OK:
            self.moved(h, S_DONE, me)

    @rule(h=handles, me=st.integers(0, 3), believed=st.booleans(),
          state=st.sampled_from((S_QUEUED, S_RUNNING, S_CANCELLED, S_DONE)),
          who=st.integers(0, 3), and_free=st.booleans())
    def claim(self, h: int, me: int, believed: bool, state: int, who: int,
              and_free: bool) -> None:
        """Claim for release: believing the oracle's current (state, who), or a guess."""
        a = self.rig.arena
        if believed:
            _g, state, who = self.model[h & 0xFFFFFFFF]
            if state in (S_FREE, S_FREEING):
                return  # nobody claims a free record or one being freed
        exp = self.expect(h, state, who)
        out = a.release(h, state, who, me) if and_free else a.tr.claim(h, state, who, me)
        assert out is exp, (out, exp)
        if exp is Outcome.OK:
            if and_free:
                self.freed(h & 0xFFFFFFFF)
            else:
                self.moved(h, S_FREEING, me)

    @precondition(lambda self: any(s == S_FREEING for _g, s, _w in self.model))
    @rule(data=st.data())
    def free_claimed(self, data: Any) -> None:
        """The claimer (or a recoverer, for a dead claimer) finishes the release."""
        idx = data.draw(st.sampled_from(
            [i for i, (_g, s, _w) in enumerate(self.model) if s == S_FREEING]))
        g, _s, who = self.model[idx]
        if data.draw(st.booleans()):
            self.rig.recovery.leased((g << 32) | idx, who)  # FREEING|dead: freed
        else:
            self.rig.arena.free((g << 32) | idx)
        self.freed(idx)

    @rule(h=handles, dead=st.integers(1, 3))
    def recover_lease(self, h: int, dead: int) -> None:
        """Recovery.leased on any handle: QUEUED re-pushed, CANCELLED and FREEING|dead freed."""
        rec = self.rig.recovery
        g, s, w = self.model[h & 0xFFFFFFFF]
        rec.leased(h, dead)
        pushed = self.rig.injector.pop_many(4)
        if h >> 32 != g:
            assert pushed == []
        elif s == S_QUEUED:
            assert pushed == [h]
        else:
            assert pushed == []
            if s == S_CANCELLED or (s == S_FREEING and w == dead):
                self.freed(h & 0xFFFFFFFF)

    # -- invariants -------------------------------------------------------------
    @invariant()
    def words_match(self) -> None:
        tr = self.rig.arena.tr
        for i, (g, s, w) in enumerate(self.model):
            assert tr.load(i) == (g, s, w), (i, tr.load(i), (g, s, w))
            assert g >= self.max_gen[i], "a generation went back"
            self.max_gen[i] = g

    @invariant()
    def free_ring_matches(self) -> None:
        items = ring_items(self.rig.arena.rec_free)
        assert items == list(self.free)  # each free record exactly once, in FIFO order
        assert sorted(items) == [i for i, (_g, s, _w) in enumerate(self.model) if s == S_FREE]

    @invariant()
    def payload_storage_matches(self) -> None:
        a = self.rig.arena
        assert len(a.classes[0][1]) == BLOCKS - sum(c == 1 for c in self.pclass)
        files = glob.glob(self.rig.seg.path + "-x*")
        assert len(files) == sum(c == OVERFLOW for c in self.pclass)


@pytest.mark.parametrize("cfg", CONFIGS)
def test_record_state_machine(cfg):
    load_impl("python" if cfg == "python" else "native")
    run_state_machine_as_test(
        lambda: RecordMachine(cfg),
        settings=settings(max_examples=100, stateful_step_count=50, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow]))
