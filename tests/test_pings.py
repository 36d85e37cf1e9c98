"""The fork-join ping bit (stealer/shared/recovery.py Pings) and a recovery's redelivery of the
pings a dead worker held (Recovery.dead_pings), on an in-process segment (native and
pure-Python queues, tests/rig.py)."""

from __future__ import annotations

import struct

from rig import Rig, rig_fixture, ring_items

from stealer.shared._layout import F_AGENT, K_CHILD, K_ROOT, R_OWNER, S_DONE, S_QUEUED, S_RUNNING
from stealer.shared.records import word
from stealer.shared.recovery import Pings

rig = rig_fixture(records=16)

_OWNER = struct.Struct("=II")


def _frame(rig: Rig, owner: int, state: int = S_RUNNING, kind: int = K_ROOT,
           inc: int = 1) -> int:
    """A record in ``state`` held by worker ``owner`` whose frame that worker holds."""
    a = rig.arena
    h = a.alloc()
    assert h >= 0
    off = a.setup(h, kind, 0, 0)
    a.region.store64(off, word(h >> 32, state, owner + 1 if state == S_RUNNING else 0))
    _OWNER.pack_into(a.mm, off + R_OWNER, owner, inc)
    return h


def _pings(rig: Rig, me: int = -1, full=None) -> Pings:
    return Pings(rig.arena, rig.inboxes, rig.recovery.idle, me, -1, full)


def test_one_ping_per_frame_until_its_popper_clears_the_bit(rig):
    p = _pings(rig)
    h = _frame(rig, 1)
    for _ in range(5):
        p.ping(h)
    assert ring_items(rig.inboxes[1]) == [h]  # one, however many children finished
    assert rig.inboxes[1].pop() == h
    p.ping(h)
    assert ring_items(rig.inboxes[1]) == []  # popped, not cleared yet: still pending
    p.clear(h)
    p.ping(h)
    assert ring_items(rig.inboxes[1]) == [h]
    p.ping(h, force=True)  # a recoverer's: pushed whatever the bit says
    assert ring_items(rig.inboxes[1]) == [h, h]


def test_a_record_without_a_frame_gets_no_ping(rig):
    p = _pings(rig)
    h = _frame(rig, 0, inc=0)  # R_INCARNATION 0: no frame (never spawned, or re-queued)
    p.ping(h)
    assert ring_items(rig.inboxes[0]) == []
    p.ping(rig.arena.nrecords)  # an index out of range: ignored
    assert all(ring_items(q) == [] for q in rig.inboxes)


def test_a_full_inbox_goes_to_the_handler_once(rig):
    got = []
    p = _pings(rig, full=lambda owner, h: got.append((owner, h)))
    while rig.inboxes[1].push(2**40):  # filled with something else
        pass
    h = _frame(rig, 1)
    p.ping(h)
    p.ping(h)
    assert got == [(1, h)]  # the bit is set: the handler holds the only pending ping


def test_forward_pings_the_current_frame_of_the_slot(rig):
    a = rig.arena
    p = _pings(rig)
    old = _frame(rig, 1)
    a.free(old)
    while True:  # the same slot again, one generation on
        h = a.alloc()
        if h & 0xFFFFFFFF == old & 0xFFFFFFFF:
            break
    off = a.setup(h, K_ROOT, 0, 0)
    a.region.store64(off, word(h >> 32, S_RUNNING, 1))
    _OWNER.pack_into(a.mm, off + R_OWNER, 0, 3)
    p.forward(old, skip=1)  # a stale ping taken by worker 1: its slot's frame is on 0
    assert ring_items(rig.inboxes[0]) == [h]
    p.clear(h)
    p.forward(h, skip=0)  # worker 0's own frame, running there: nothing to send
    assert ring_items(rig.inboxes[0]) == [h]


def test_dead_pings_redelivers_what_the_dead_worker_held(rig):
    rec = rig.recovery
    p = rec.pings
    mine = _frame(rig, 1)  # a frame worker 1 (dead) held: its recoverer looks at it
    theirs = _frame(rig, 0)  # worker 0's frame, pinged at worker 1 (it moved)
    handed = _frame(rig, 0, state=S_QUEUED, kind=K_ROOT | F_AGENT, inc=0)  # Host.balance
    popped = _frame(rig, 0)  # popped by worker 1 (W_PING_IN), its bit never cleared
    half = _frame(rig, 0)  # marked by worker 1 (W_PING_OUT), never pushed
    for h in (mine, theirs, handed):
        rig.inboxes[1].push(h)
    for h in (mine, theirs, handed, popped, half):
        rig.arena.region.or64(p.flag_off(h), 4)  # AF_PINGED, as their senders left it
    lost = _frame(rig, 1)  # worker 1's frame whose ping it kept in a list of its own
    rig.arena.region.or64(p.flag_off(lost), 4)
    rec.dead_pings(1, popped + 1, half + 1)
    assert ring_items(rig.inboxes[1]) == []  # drained: nothing waits for the replacement
    assert sorted(ring_items(rig.inboxes[0])) == sorted([theirs, popped, half])
    assert ring_items(rig.injector) == [handed]  # its only copy, back on a queue
    flags = {h: rig.arena.region.load64(p.flag_off(h)) & 4 for h in (mine, lost, handed)}
    assert flags == {mine: 0, lost: 0, handed: 0}  # a new ping for them is sent


def test_children_of_scans_once_for_many_parents(rig):
    a = rig.arena
    rec = rig.recovery
    p1, p2 = _frame(rig, 0), _frame(rig, 1)
    kids = []
    for parent, state in ((p1, S_DONE), (p1, S_RUNNING), (p2, S_QUEUED)):
        h = a.alloc()
        off = a.setup(h, K_CHILD, parent, 0)
        a.region.store64(off, word(h >> 32, state, 1 if state != S_QUEUED else 0))
        kids.append(h)
    got = rec.children_of([p1, p2])
    assert got == {p1: [(kids[0], S_DONE, 1), (kids[1], S_RUNNING, 1)],
                   p2: [(kids[2], S_QUEUED, 0)]}
    assert rec.children(p1) == got[p1]
