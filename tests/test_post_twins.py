"""A client's message in one call: native ``HotPath.post_msg`` against its Python reference
``Directory.post`` (stealer/agents/mailbox.py), and ``reply_slot`` against
``Arena.reply_slot``, driven by the same random operations on twin segments (no
processes).  After every operation both must return the same result and leave the same
observable state: the mailbox's count and flags, the chain of payloads from D_HEAD, what
each worker's inbox holds, and how many records are free.  Operations: post (with or
without a slot already reserved), reply slots, the owner handling messages (slots given
back), the agent moving (running on a worker, queued, done, a stale handle), its mailbox
closing, inboxes filling up and draining, the notification bit cleared by the owner, and
the free records running out.
"""

from __future__ import annotations

import pickle

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stealer.agents import mailbox as M
from stealer.agents.mailbox import CLOSED, Directory
from stealer.shared._layout import (
    AF_CONTROL,
    D_COUNT,
    D_FLAGS,
    D_HEAD,
    INLINE,
    K_MASK,
    K_MSG,
    K_ROOT,
    R_LINK,
    R_NEXT,
    S_DONE,
    S_QUEUED,
    S_RUNNING,
    STATE_SHIFT,
    WHO_SHIFT,
)
from stealer.shared.idle import Idle
from tests.rig import make_rig

CAP = 3
NW = 2


class Twin:
    """One segment with one agent, driven through one implementation of post."""

    def __init__(self, cfg: str, control: bool) -> None:
        self.rig = rg = make_rig(cfg, nworkers=NW, records=12)
        a = rg.arena
        self.a = a
        self.r = rg.seg.region
        self.dir = Directory(self.r, a, rg.layout.offsets["agents"], rg.inboxes,
                             Idle(self.r, rg.layout))
        self.h = a.alloc()
        a.setup(self.h, K_ROOT, 0, 0)
        self.dir.init(self.h, CAP, AF_CONTROL if control else 0)
        self.state(S_RUNNING, 1)
        if cfg == "native":
            a.hot.set_agents(rg.layout.offsets["agents"], rg.inboxes)
            self.post = a.hot.post_msg
        else:
            self.post = self.dir.post
        self.seen = 0  # the owner's walk
        self.hoard: list[int] = []  # records taken to exhaust the free ring

    def state(self, s: int, who: int) -> None:
        off = self.a.off(self.h)
        gen = self.h >> 32
        self.r.store64(off, gen | (s << STATE_SHIFT) | (who << WHO_SHIFT))

    def chain(self) -> list[object]:
        out = []
        v = self.r.load64(self.dir.entry(self.h) + D_HEAD) & ~CLOSED
        while v:
            m = v - 1
            out.append(self.a.read_call(self.a.off(m)))
            v = self.r.load64(self.a.off(m) + R_NEXT)
        return out

    def observe(self) -> tuple:
        e = self.dir.entry(self.h)
        inboxes = []
        for q in self.rig.inboxes:
            inboxes.append(len(q))
        return (self.r.load32(e + D_COUNT), self.r.load64(e + D_FLAGS),
                self.r.load64(e + D_HEAD) & CLOSED, self.chain(), inboxes,
                len(self.a.rec_free))


OPS = st.one_of(
    st.tuples(st.just("post"), st.integers(0, 1000), st.booleans()),
    st.tuples(st.just("big"), st.integers(0, 9), st.booleans()),
    st.tuples(st.just("reply_slot"), st.integers(1, 1 << 62)),
    st.tuples(st.just("handle"), st.integers(1, 3)),
    st.tuples(st.just("move"), st.sampled_from(["w0", "w1", "queued", "done", "stale"])),
    st.tuples(st.just("close")),
    st.tuples(st.just("fill_inbox"), st.integers(0, NW - 1)),
    st.tuples(st.just("drain_inbox"), st.integers(0, NW - 1)),
    st.tuples(st.just("clear_notified")),
    st.tuples(st.just("exhaust")),
    st.tuples(st.just("restore")),
)


def apply(t: Twin, op: tuple) -> object:
    kind = op[0]
    a, d, h = t.a, t.dir, t.h
    if kind == "post":
        return t.post(h, pickle.dumps(("msg", op[1])), op[2] and d.reserve(h))
    if kind == "big":
        try:
            return t.post(h, b"x" * (INLINE + 1 + op[1]), op[2])
        except ValueError as exc:
            return ("ValueError", "too large" in str(exc))
    if kind == "reply_slot":
        rh = a.reply_slot(op[1])
        if rh < 0:
            return -1
        off = a.off(rh)
        kind_, _st, link = a.kind_link(off)
        st_ = a.tr.state(rh)
        return (kind_ & K_MASK, link, a.region.load64(off + R_LINK) == link, st_)
    if kind == "handle":
        got, t.seen = d.take(h, t.seen)
        n = min(op[1], t.r.load32(d.entry(h) + D_COUNT))
        if n:
            d.give_back(h, n)
        return (len(got), n)
    if kind == "move":
        where = op[1]
        if where == "w0":
            t.state(S_RUNNING, 1)
        elif where == "w1":
            t.state(S_RUNNING, 2)
        elif where == "queued":
            t.state(S_QUEUED, 0)
        elif where == "done":
            t.state(S_DONE, 1)
        else:  # the slot recycled: the handle's generation is stale
            off = a.off(h)
            t.r.store64(off, ((h >> 32) + 1) | (S_RUNNING << STATE_SHIFT) | (1 << WHO_SHIFT))
        return None
    if kind == "close":
        d.close(h)
        return None
    if kind == "fill_inbox":
        q = t.rig.inboxes[op[1]]
        while q.push(999):
            pass
        return None
    if kind == "drain_inbox":
        return sorted(t.rig.inboxes[op[1]].pop_many(64))
    if kind == "clear_notified":
        d.clear_notified(h)
        return None
    if kind == "exhaust":
        while True:
            m = a.alloc()
            if m < 0:
                return len(t.hoard)
            t.hoard.append(m)
    if kind == "restore":
        n = len(t.hoard)
        for m in t.hoard:
            a.setup(m, K_MSG, 0, 0)
            a.free(m)
        t.hoard.clear()
        return n
    raise AssertionError(kind)


def _twins(control: bool) -> list[Twin]:
    made: list[Twin] = []
    try:
        for cfg in ("native", "native-pyarena", "python"):
            made.append(Twin(cfg, control))
    except BaseException:
        for t in made:
            t.rig.seg.unlink()
        raise
    return made


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(OPS, min_size=1, max_size=40), control=st.booleans())
def test_native_post_matches_its_python_reference(ops, control):
    twins = _twins(control)
    try:
        for i, op in enumerate(ops):
            got = [apply(t, op) for t in twins]
            assert got[0] == got[1] == got[2], (i, op, got)
            seen = [t.observe() for t in twins]
            assert seen[0] == seen[1] == seen[2], (i, op, seen)
    finally:
        for t in twins:
            t.rig.seg.unlink()


def test_the_results_name_each_case():
    """The scenarios one by one on the native path (the model above compares it with the
    reference; this pins what each result means)."""
    t = Twin("native", control=True)
    try:
        h, d, r = t.h, t.dir, t.r
        e = d.entry(h)
        data = pickle.dumps(1)
        t.state(S_RUNNING, 2)  # held by who 2: worker 1
        assert t.post(h, data) == 1 | M.POST_CONTROL  # wake worker 1 (a control agent)
        assert t.rig.inboxes[1].pop() == h
        assert t.post(h, data) == M.POST_QUIET  # the notification is on its way
        d.clear_notified(h)
        q = t.rig.inboxes[1]
        while q.push(7):
            pass
        assert t.post(h, data) == M.POST_INBOX_FULL - 1  # pushed, owner's inbox full
        assert r.load32(e + D_COUNT) == 3
        assert t.post(h, data) == M.POST_FULL  # the mailbox is full: nothing done
        assert r.load32(e + D_COUNT) == 3 and len(t.chain()) == 3
        assert t.post(h, data, True) == M.POST_QUIET  # a slot reserved before: pushed
        d.give_back(h, 3)  # the owner handled the three it had counted
        t.state(S_QUEUED, 0)
        d.clear_notified(h)
        assert t.post(h, data) == M.POST_QUIET  # queued: whoever starts it walks the chain
        d.give_back(h)
        t.state(S_DONE, 1)
        free = len(t.a.rec_free)
        assert t.post(h, data) == M.POST_STOPPED
        t.state(S_RUNNING, 1)
        d.close(h)
        assert t.post(h, data) == M.POST_STOPPED
        assert len(t.a.rec_free) == free and r.load32(e + D_COUNT) == 0
        with pytest.raises(ValueError, match="too large"):
            t.post(h, b"x" * (INLINE + 1))
    finally:
        t.rig.seg.unlink()
