"""An agent's reply and its message read back in one native call each: ``HotPath.reply_inline``
and ``HotPath.read_inline`` (native/_cqueues.pyx) against their Python references
``Arena.reply_inline`` and ``Arena.read_inline`` (stealer/shared/arena.py), on twin segments
(no processes), over the three configurations of tests/rig.py.

A reply slot is made as a client's call makes it (``reply_slot``: K_ROOT, QUEUED|0) or as an
agent's call does (K_REPLY); then it is left alone, cancelled by its caller, recycled
(a stale handle), or already answered, and a reply of some size is stored.  Every twin must
return the same result and leave the same state word, completions ring and stored result.
A message is written as a sender writes it (a pickle inline, the small format, a payload too
large to sit inline, one with out-of-band buffers) and read back.
"""

from __future__ import annotations

import pickle

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stealer.shared import serialize
from stealer.shared._layout import (
    INLINE,
    K_MSG,
    K_REPLY,
    K_ROOT,
    S_CANCELLED,
    S_DONE,
    S_QUEUED,
    STATE_SHIFT,
    WHO_SHIFT,
)
from tests.rig import CONFIGS, make_rig

WHO = 2  # worker 1


def _rigs() -> list:
    made = []
    try:
        for cfg in CONFIGS:
            made.append(make_rig(cfg, nworkers=2, records=8))
    except BaseException:
        for rg in made:
            rg.seg.unlink()
        raise
    return made


def _agent_entry(rg, capacity: int) -> tuple:
    """A Directory on rig ``rg`` (native where the rig is) and an agent record with a fresh
    entry of mailbox ``capacity``: ``(directory, handle)``."""
    from stealer.agents.mailbox import Directory
    from stealer.shared.idle import Idle

    a, r = rg.arena, rg.seg.region
    d = Directory(r, a, rg.layout.offsets["agents"], rg.inboxes, Idle(r, rg.layout))
    assert (d.hot is not None) == (rg.cfg == "native")
    h = a.alloc()
    a.setup(h, K_ROOT, 0, 0)
    d.init(h, capacity)
    return d, h


def reply_case(rg, kind: int, fate: str, size: int) -> tuple:
    a = rg.arena
    rh = a.alloc()
    a.setup(rh, kind, 77, 0)  # QUEUED|0 on no queue: a call's reply slot
    r = rg.seg.region
    off = a.off(rh)
    gen = rh >> 32
    target = rh
    if fate == "cancelled":
        assert a.tr.cas(rh, S_QUEUED, 0, S_CANCELLED, 0).name == "OK"
    elif fate == "stale":  # recycled: our handle's generation is old
        target = rh - (1 << 32) if gen else rh + (1 << 32)
    elif fate == "answered":  # a replay answers a slot answered before
        r.store64(off, gen | (S_DONE << STATE_SHIFT) | (WHO << WHO_SHIFT))
    data = pickle.dumps(b"r" * size, 5)
    got = a.reply_inline(target, 0, data, rg.completions[1], WHO)
    st = a.tr.load(rh)
    ring = []
    while (h := rg.completions[1].pop()) >= 0:
        ring.append(h)
    stored = a.peek_result(rh)[3] if got in (1, 2) else None
    return got, st, ring == [rh] if ring else ring, stored


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from([K_ROOT, K_REPLY]),
       fate=st.sampled_from(["fresh", "cancelled", "stale", "answered"]),
       size=st.integers(0, INLINE + 40))
def test_native_reply_inline_matches_its_python_reference(kind, fate, size):
    rigs = _rigs()
    try:
        got = [reply_case(rg, kind, fate, size) for rg in rigs]
        assert got[0] == got[1] == got[2], got
        res, (_gen, state, who), ring, stored = got[0]
        # what each result means
        if fate != "fresh":
            assert res == -3 and ring == []
        elif len(pickle.dumps(b"r" * size, 5)) > INLINE:
            assert res == 0 and who == WHO and ring == []  # ours: stored the long way
        elif kind == K_ROOT:
            assert res == 1 and state == S_DONE and ring is True
            assert pickle.loads(stored) == b"r" * size
        else:
            assert res == 2 and state == S_DONE and ring == []  # the caller is pinged
    finally:
        for rg in rigs:
            rg.seg.unlink()


def write_msg(rg, how: str) -> tuple[int, object]:
    a = rg.arena
    m = a.alloc()
    off = a.setup(m, K_MSG, 0, 0)
    value = (5, "act", (np.arange(2, dtype=np.float32),), None, 7, None, None, 0, 0)
    if how == "inline":
        data, bufs = serialize.dumps(value)
    elif how == "small":
        data, bufs = serialize.encode_small_call(3, (1, 2.5)), []
        value = (3, (1, 2.5), None)
    elif how == "large":
        value = ("x" * 300,)
        data, bufs = serialize.dumps(value)
    else:  # out-of-band buffers
        value = (np.zeros(1000),)
        data, bufs = serialize.dumps(value)
        assert bufs
    a.put(off, data, bufs)
    return m, value


def test_read_inline_reads_an_inline_pickle_and_leaves_the_rest_to_read_call():
    rigs = _rigs()
    try:
        for how in ("inline", "small", "large", "oob"):
            outs = []
            for rg in rigs:
                m, value = write_msg(rg, how)
                got = rg.arena.read_inline(m)
                full = rg.arena.read_call(rg.arena.off(m))  # the long way: always right
                if how == "inline":
                    assert repr(got) == repr(full) == repr(value)
                else:
                    assert got is None, (rg.cfg, how)
                outs.append(repr(got))
            assert outs[0] == outs[1] == outs[2], (how, outs)
    finally:
        for rg in rigs:
            rg.seg.unlink()


def test_msg_done_marks_the_message_and_gives_its_slot_back_as_the_reference_does():
    """HotPath.msg_done (native) against Directory.mark_done + give_back (Python): the same
    D_DONE and D_COUNT after each handled message, a full mailbox included."""
    from stealer.shared._layout import D_COUNT, D_DONE

    rigs = _rigs()
    try:
        seen = []
        for rg in rigs:
            r = rg.seg.region
            d, h = _agent_entry(rg, 3)
            out = []
            for _ in range(3):
                assert d.reserve(h)
            assert not d.reserve(h)  # full
            for m in (5, 9, 2):
                d.msg_done(h, m)
                e = d.entry(h)
                out.append((r.load64(e + D_DONE), r.load32(e + D_COUNT)))
            seen.append(out)
        assert seen[0] == seen[1] == seen[2] == [(6, 2), (10, 1), (3, 0)], seen
    finally:
        for rg in rigs:
            rg.seg.unlink()


def test_take_mail_takes_what_was_pushed_oldest_first_as_the_reference_does():
    """HotPath.take_mail (native) against Directory.clear_notified + take + flags (Python):
    the same flags (NOTIFIED cleared, STOP kept), head and messages oldest first, from an
    empty mailbox, after one push, after three more, and after a stop."""
    from stealer.shared._layout import AF_NOTIFIED, AF_STOP, D_FLAGS

    rigs = _rigs()
    try:
        seen_all = []
        for rg in rigs:
            a, r = rg.arena, rg.seg.region
            d, h = _agent_entry(rg, 8)
            e = d.entry(h)
            out, seen = [], 0
            for batch, extra in ((0, 0), (1, 0), (3, 0), (0, AF_STOP), (1, 0)):
                pushed = []
                for _ in range(batch):
                    m = a.alloc()
                    a.setup(m, K_MSG, 0, 0)
                    assert d.push(h, m)
                    pushed.append(m)
                r.or64(e + D_FLAGS, AF_NOTIFIED | extra)
                flags, seen, got = d.take_mail(h, seen)
                assert got == pushed  # oldest first, only the new ones
                assert not r.load64(e + D_FLAGS) & AF_NOTIFIED
                out.append((flags, len(got)))
            seen_all.append(out)
        assert seen_all[0] == seen_all[1] == seen_all[2], seen_all
        assert [f & AF_STOP for f, _ in seen_all[0]] == [0, 0, 0, AF_STOP, AF_STOP]
    finally:
        for rg in rigs:
            rg.seg.unlink()


def test_free_older_frees_what_a_checkpoint_covers_as_the_reference_does():
    """Directory.free_older, native (HotPath.free_chain: inline payloads freed in the walk,
    the others handed to Arena.free) against its Python loop (older + Arena.free): the
    same messages freed, from the mark down to the old mark only, their blocks given back
    (a payload too large to sit inline took one), the newer and older ones untouched."""
    from stealer.shared._layout import S_FREE

    rigs = _rigs()
    try:
        seen_all = []
        for rg in rigs:
            a = rg.arena
            d, h = _agent_entry(rg, 8)
            chain = []
            for i in range(6):
                m = a.alloc()
                off = a.setup(m, K_MSG, 0, 0)
                data = pickle.dumps(("m", i, b"x" * (200 if i in (2, 3) else 1)), 5)
                a.put(off, data, [])
                assert d.push(h, m)
                chain.append(m)
            # a checkpoint covers messages 1..4 (mark: 4's handle + 1; old mark: 0's)
            d.free_older(chain[4] + 1, chain[0] + 1)
            states = [a.tr.state(m) for m in chain]
            assert [s is None or s[0] == S_FREE for s in states] == [
                False, True, True, True, True, False], states
            blocks = len(a.classes[0][1])  # 2 and 3 gave their blocks back: all 4 free
            assert blocks == 4, blocks
            got = []
            while (x := a.alloc()) >= 0:
                got.append(x & 0xFFFFFFFF)
            # the four come back, beside the one record never used
            assert {m & 0xFFFFFFFF for m in chain[1:5]} <= set(got) and len(got) == 5, got
            seen_all.append((blocks, len(got)))
        assert seen_all[0] == seen_all[1] == seen_all[2], seen_all
    finally:
        for rg in rigs:
            rg.seg.unlink()
