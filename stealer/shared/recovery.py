"""What happens to the records a dead worker held: re-run, fail, publish, or free them.

Used by the client's result thread when it sees a worker die (stealer/client/deaths.py,
a mixin of stealer/client/pool.py's _Pool) and by a replacement worker that receives a
ping for a fork-join frame its dead predecessor held (stealer/worker/loop.py and
pings.py).  Both act only through the transitions of stealer/shared/records.py, so when
two recoverers (or a recoverer and a stale ping) race, exactly one CAS wins and the other
gets a named outcome.

The rules, by what the state word of a record says (who = dead worker + 1):

* QUEUED (named by the dead worker's lease or current word): it may have been
  taken off its queue and never started: push it on the injector again.  If
  it was still queued, there are now two copies; ``start`` lets one win.
* CANCELLED (lease/current): the dead worker was about to free it: free it.
* FREE (lease or W_ALLOC, same generation): the dead worker took it off the free ring
  (its pop names the handle in W_ALLOC before it releases the ring's cell; spawn leases
  it too) and was killed before setting it up: free it (give it back to the free ring).
  A free bumps the generation, so only one of these rules (and the ring repair's
  give-back, which frees too) acts on it.
* A record (or block) the dead worker was freeing, FREE and on no ring: its push's
  intent names it, the ring repair gives it back (stealer/client/ringfix.py, ``give_back``).
* FREEING|who: the dead worker was freeing it: finish that.
* DONE|who (current word): the result was stored but maybe not published:
  a root is completed by the client if its completion is not in the dead
  worker's ring (the client drains that ring first); a child pings its
  parent's owner again (pings are idempotent).
* RUNNING|who: the task was running, or was a suspended fork-join frame the
  dead worker held.  Once none of its children is still queued or running
  (they finish and ping the frame's owner, that is the replacement, which
  then calls :meth:`Recovery.orphan` again), it is claimed, its children's
  records are freed, and it is re-run (``tries < retries``) or failed with
  WorkerCrashedError.  Re-running is at-least-once for side effects.

Nobody waits on a full queue for a process that waits on it (issue 20).  The client
(its result thread, recoveries included) never waits on a shared queue: a QUEUED
handle that finds the injector full joins its requeue list, a ping or an agent's
notification that finds an inbox full its ping backlog, both pushed by the result
thread as room appears.  Workers wait only where the queue cannot stay full or its
consumer is another worker or the client: a peer's inbox (the peer drains it, or dies
and its recovery drains it), the injector (other workers take from it), a completion
ring (capacity == records, one completion per root; the client drains it).  A worker
never waits on its own inbox: a ping that finds it full is kept for its loop.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

from stealer._lazy import lazy_numpy
from stealer.errors import WorkerCrashedError
from stealer.shared import failpoints, serialize
from stealer.shared._layout import (
    AF_PINGED,
    D_FLAGS,
    DIR_BYTES,
    F_AGENT,
    F_TASKCALL,
    GEN_MASK,
    K_CHILD,
    K_MASK,
    K_REPLY,
    K_ROOT,
    R_INCARNATION,
    R_KIND,
    R_LINK,
    R_OWNER,
    R_PCLASS,
    R_PLEN,
    R_RETRIES,
    R_STATUS,
    R_TRIES,
    RECORD_BYTES,
    S_CANCELLED,
    S_DONE,
    S_FREE,
    S_FREEING,
    S_QUEUED,
    S_RECOVERING,
    S_RUNNING,
    ST_ERROR,
    STATE_MASK,
    STATE_SHIFT,
    WHO_SHIFT,
)
from stealer.shared.records import Outcome

np: Any = lazy_numpy(globals())  # numpy, imported on first use

__all__ = ["Pings", "Recovery"]

_U32 = struct.Struct("=I")
_U64 = struct.Struct("=Q")
_OWNER = struct.Struct("=II")  # R_OWNER, R_INCARNATION
_STRIDE = RECORD_BYTES // 8
_ALL = (1 << 64) - 1


class Pings:
    """Fork-join pings: "a child of frame h is done, look at it", at most one per frame.

    A frame's owner (the worker R_OWNER names) learns that it may resume from a
    ping: the frame's handle in its inbox.  The protocol is the agents' NOTIFIED
    one (stealer/agents/mailbox.py), with the AF_PINGED bit of the frame's slot in
    the agent directory (stealer/shared/_layout.py):

    * a sender sets the bit (or64); only the sender that set it pushes the handle,
      so an inbox holds at most one ping per frame and cannot fill from duplicates
      (recoveries used to resend every ping they could not prove sent, and piled
      them into the inbox of a worker still starting: issue 20);
    * whoever pops the ping clears the bit *before* it looks at the frame's
      children, so a child done after that look sends a fresh ping: no wake is lost;
    * a ping taken by a worker that does not hold the frame (it moved, or the slot
      was reused) is forwarded to the frame's owner (:meth:`forward`).

    Deaths: a worker stores the handle it pings in W_PING_OUT before its or64, and its
    inbox pop leases the handle in W_PING_IN; the client's recovery (stealer/client/pool.py)
    pings the first again (``force``: the bit may be set with nothing pushed) and
    delivers the second again, drains the dead worker's inbox, and clears the bits of
    the frames the dead worker held before it looks at their children.
    """

    def __init__(self, arena: Any, inboxes: list, idle: Any, me: int = -1, out_off: int = -1,
                 full: Callable[[int, int], None] | None = None) -> None:
        self.a = arena
        self.r = arena.region
        self.mm = arena.mm
        self.inboxes = inboxes
        self.idle = idle
        self.me = me  # our worker index, -1: the client
        self.out_off = out_off  # our W_PING_OUT word (-1: the client, which never dies alone)
        self.full = full or _no_room  # what to do when an inbox is full
        self.flags = arena.seg.layout.offsets["agents"] + D_FLAGS  # slot 0's flag word

    def flag_off(self, h: int) -> int:
        return self.flags + DIR_BYTES * (h & 0xFFFFFFFF)

    def ping(self, parent: int, force: bool = False) -> None:
        """A child of ``parent`` is DONE (or may be): ask the frame's owner to look at it.

        ``force``: push even if a ping is marked pending (a recoverer's, for the ping
        a dead worker marked and maybe never pushed)."""
        a = self.a
        idx = parent & 0xFFFFFFFF
        if idx >= a.nrecords:
            return
        # the frame's worker and incarnation: set at its first spawn, before any child's
        # push (which releases them to the child's worker); 0, 0: no frame, nobody waits
        owner, inc = _OWNER.unpack_from(self.mm, a.rec_base + RECORD_BYTES * idx + R_OWNER)
        if not inc or owner >= len(self.inboxes):
            return
        r = self.r
        if self.out_off >= 0:
            r.store64(self.out_off, parent + 1)  # release: read by the recoverer after our death
        # seq_cst RMW: pairs with the and64 of clear() (the popper's, before its look)
        if r.or64(self.flag_off(parent), AF_PINGED) & AF_PINGED and not force:
            if self.out_off >= 0:
                r.store64(self.out_off, 0)  # release: nothing half-sent (read after our death)
            return  # a ping is on its way: its popper looks at the children after clearing
        if failpoints.ON and self.me >= 0:
            failpoints.hit("worker.ping_after_set")
        if self.inboxes[owner].push(parent):
            if owner != self.me:
                self.idle.notify_worker(owner)
        else:
            self.full(owner, parent)
        if self.out_off >= 0:
            r.store64(self.out_off, 0)  # release: pushed (or held where our recoverer finds it)

    def clear(self, h: int) -> None:
        """The ping for ``h`` was taken (or its pusher is dead): a new one may be sent.
        Call it before looking at the frame's children."""
        # seq_cst RMW: pairs with the or64 of ping()
        self.r.and64(self.flag_off(h), ~AF_PINGED & _ALL)

    def forward(self, h: int, skip: int = -1) -> None:
        """A ping for ``h`` taken (and cleared) by one that does not hold the frame: ping
        the current frame of ``h``'s slot at its owner (unless that is worker ``skip``:
        the caller handles its own frames).  A sender may have found the bit set while
        this ping was on its way to the wrong place: without this, its wake was lost."""
        a = self.a
        idx = h & 0xFFFFFFFF
        if idx >= a.nrecords:
            return
        off = a.rec_base + RECORD_BYTES * idx
        owner, inc = _OWNER.unpack_from(self.mm, off + R_OWNER)  # see ping()
        cur = ((self.r.load64(off) & GEN_MASK) << 32) | idx  # the slot's handle now (acquire)
        if not inc or (owner == skip and cur == h):
            return  # no frame; or the caller's own, running now (it looks before it suspends)
        self.ping(cur)


def _no_room(owner: int, h: int) -> None:
    raise RuntimeError(f"the inbox of worker {owner} is full (ping for {h:#x})")


def task_call_slot(kind: int) -> bool:
    """Whether a record of ``kind`` (R_KIND) is the reply slot of a call a task made to an
    agent (K_CHILD | F_TASKCALL): answered by an agent, its DONE pings the task."""
    return kind & (K_MASK | F_TASKCALL) == K_CHILD | F_TASKCALL


def reply_slot(mm: Any, off: int) -> bool:
    """Whether the record at ``off`` is a reply slot: an agent's (K_REPLY), a task's
    (K_CHILD | F_TASKCALL), or a client call's (a K_ROOT that is no agent and has no call
    payload: tasks always have one)."""
    kind = _U32.unpack_from(mm, off + R_KIND)[0]
    if kind & K_MASK == K_REPLY or task_call_slot(kind):
        return True
    return (kind & K_MASK == K_ROOT and not kind & F_AGENT
            and _U32.unpack_from(mm, off + R_PCLASS)[0] == 0
            and _U64.unpack_from(mm, off + R_PLEN)[0] == 0)


class Recovery:
    """Recovery operations over one segment's records (client or worker side)."""

    def __init__(self, arena: Any, inboxes: list, idle: Any, me: int,
                 push: Callable[[int], None] | None = None, pings: Pings | None = None) -> None:
        self.a = arena
        self.inboxes = inboxes
        self.idle = idle
        self.me = me  # who: our worker index + 1, or 0 for the client
        self.push = push or self._push  # puts a QUEUED handle where a worker will find it
        self.pings = pings or Pings(arena, inboxes, idle, me - 1)

    def _push(self, h: int) -> None:
        # Only without a ``push`` of the caller's (tests): the pool passes one that never
        # waits (its requeue list), a worker one that falls back on its own deque.
        if not self.a.injector.push(h):
            raise RuntimeError(f"the injector is full (recovering {h:#x})")

    # -- scans (crash paths only) ------------------------------------------------
    def _columns(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        a = self.a
        n = a.nrecords
        v = np.frombuffer(a.mm, np.uint64, n * _STRIDE, a.rec_base).reshape(n, _STRIDE)
        # word0, kind|status, link: plain (racy) reads; every decision re-checks by CAS
        return v[:, 0].copy(), v[:, R_KIND // 8].copy(), v[:, R_LINK // 8].copy()

    def held_by(self, who: int, states: tuple[int, ...]) -> list[int]:
        """Handles of records in one of ``states`` held by ``who``."""
        w = self._columns()[0]
        st = (w >> np.uint64(STATE_SHIFT)) & np.uint64(STATE_MASK)
        mask = ((w >> np.uint64(WHO_SHIFT)) == np.uint64(who)) & np.isin(st, states)
        idx = np.nonzero(mask)[0]
        return [int(((w[i] & np.uint64(GEN_MASK)) << np.uint64(32)) | np.uint64(i)) for i in idx]

    def children(self, parent: int) -> list[tuple[int, int, int]]:
        """(handle, state, who) of every live child record of ``parent``."""
        return self.children_of((parent,)).get(parent, [])

    def children_of(self, parents: Any) -> dict[int, list[tuple[int, int, int]]]:
        """:meth:`children` of each of ``parents``, from one scan of the records (a
        recovery looks at many frames at once: one scan each was O(records) per frame)."""
        w, ks, link = self._columns()
        kind = ks & np.uint64(K_MASK)
        st = (w >> np.uint64(STATE_SHIFT)) & np.uint64(STATE_MASK)
        want = np.fromiter(parents, np.uint64)
        mask = (kind == np.uint64(K_CHILD)) & (st != np.uint64(0)) & np.isin(link, want)
        out: dict[int, list[tuple[int, int, int]]] = {}
        for i in np.nonzero(mask)[0]:
            x = int(w[i])
            out.setdefault(int(link[i]), []).append(
                (((x & GEN_MASK) << 32) | int(i), (x >> STATE_SHIFT) & STATE_MASK,
                 x >> WHO_SHIFT))
        return out

    # -- the rules ------------------------------------------------------------------
    def dead_pings(self, k: int, ping_in: int, ping_out: int) -> None:
        """Worker ``k`` died (its process is gone): the pings it held or half-sent.

        Its inbox is drained here (nobody else pops it; the replacement starts with an
        empty one), with the ping its last pop leased (``ping_in``: W_PING_IN, handle + 1).
        Each one's bit is cleared; frames the dead worker held are left to the caller's
        look at them (stealer/client/pool.py recover, after it clears their bits too); a QUEUED
        agent a peer handed it goes back on a queue; any other ping is forwarded to the
        frame's owner.  ``ping_out`` (W_PING_OUT): a ping it marked and maybe never
        pushed, sent again.
        """
        a = self.a
        who = k + 1
        got = self.inboxes[k].pop_many(1 << 30)  # its pops are gone with it: we are the only one
        if ping_in:
            got.append(ping_in - 1)
        for h in dict.fromkeys(got):
            if (h & 0xFFFFFFFF) >= a.nrecords:
                continue
            self.pings.clear(h)
            st = a.tr.state(h)
            if st is not None and st[1] == who and st[0] in (S_RUNNING, S_RECOVERING):
                continue  # the dead worker's own frame (or agent): the caller looks at it
            if (st is not None and st[0] == S_QUEUED
                    and a.kind_link(a.off(h))[0] & F_AGENT):
                self.push(h)  # handed over by a peer (Host.balance): its only copy
                a.notify_one()
                continue
            self.pings.forward(h, k)
        # Bits of frames it held that no ping in its inbox named: pings it held in a list
        # of its own (a blocking join's deferred ones, its own inbox full), lost with it.
        for i in self.frames_of(k):
            self.pings.clear(i)
        if ping_out:
            self.pings.ping(ping_out - 1, force=True)

    def allocated(self, h: int) -> None:
        """The handle in a dead worker's W_ALLOC: the last record its pops took off the free
        ring.  FREE in that generation: never set up (alloc to setup), nobody else's: freed.
        Anything else (set up since, or freed: a newer generation) is covered by the other
        rules."""
        a = self.a
        if h < 0 or (h & 0xFFFFFFFF) >= a.nrecords:
            return
        st = a.tr.state(h)
        if st is not None and st[0] == S_FREE:
            a.free(h)  # a new generation: the same handle in a lease word is stale now

    def owned(self, ring: int, v: int) -> bool:
        """ringfix.repair's ``owned``: whether ``v``, which a dead worker's push onto free
        ring ``ring`` never landed, is that worker's to give back: a record index whose
        record is FREE (the free stored it before it named its push's position, and a FREE
        record on no ring is nobody else's); a block index (named by the push only after
        its record's descriptor was zeroed)."""
        a = self.a
        if ring != a.rec_free.offset:
            return True
        if v >= a.nrecords:
            return False  # a corrupt value: never put on the ring
        state = (a.region.load64(a.rec_base + RECORD_BYTES * v) >> STATE_SHIFT) & STATE_MASK
        return state == S_FREE  # acquire: pairs with the free's release store of FREE

    def give_back(self, ring: int, v: int) -> None:
        """ringfix.repair's ``give_back``: put ``v`` (a record or block index a dead worker
        held off free ring ``ring``) back on that ring.  A record is freed (a new
        generation: a handle in the dead worker's W_ALLOC or lease goes stale, so no other
        rule frees it again); one that is not FREE is nobody's to give back (left)."""
        a = self.a
        if ring == a.rec_free.offset:
            if v >= a.nrecords:
                return
            w = a.region.load64(a.rec_base + RECORD_BYTES * v)  # acquire, as in owned()
            if (w >> STATE_SHIFT) & STATE_MASK == S_FREE:
                a.free(((w & GEN_MASK) << 32) | v)
            return
        for q in a.mpmc_rings():
            if q.offset == ring:
                if not q.push(v):  # capacity 2 x count: full means the segment is corrupt
                    raise RuntimeError(f"free ring at {ring:#x} is full; shared memory is corrupt")
                return

    def frames_of(self, k: int) -> list[int]:
        """Record slots whose R_OWNER names worker ``k`` (any incarnation of it)."""
        a = self.a
        n = a.nrecords
        v = np.frombuffer(a.mm, np.uint32, n * (RECORD_BYTES // 4), a.rec_base).reshape(
            n, RECORD_BYTES // 4)
        # plain (racy) reads: R_OWNER/R_INCARNATION are written by k itself, dead now
        return np.nonzero((v[:, R_OWNER // 4] == k) & (v[:, R_INCARNATION // 4] != 0))[0].tolist()

    def leased(self, h: int, dead: int) -> None:
        """A handle in dead worker's (who ``dead``) lease or current word."""
        a = self.a
        if h < 0 or (h & 0xFFFFFFFF) >= a.nrecords:
            return
        st = a.tr.state(h)
        if st is None:
            return  # freed since: nothing of ours
        state, who = st
        if state == S_QUEUED:
            self.push(h)
            a.notify_one()
        elif state == S_CANCELLED:
            a.release(h, S_CANCELLED, 0, self.me)
        elif state == S_FREEING and who == dead:
            a.free(h)  # its holder is dead: finish the release (payload fields zeroed first)
        elif state == S_FREE:
            # allocated (spawn leases a child's record right after its alloc) and never set
            # up: off the free ring, in no queue: ours to give back (a free bumps the
            # generation, so a record freed since is stale, never FREE with this one)
            a.free(h)

    def orphan(self, h: int, dead: int, why: str, complete_root: Callable[[int, int, Any], None],
               state: int = S_RUNNING, kids: list[tuple[int, int, int]] | None = None) -> bool:
        """``h`` is RUNNING|dead (or RECOVERING|dead: a recoverer died recovering it): re-run
        or fail it once its children are all done.

        Returns False while children are still queued or running (the last
        one's ping brings the frame's owner back here).  ``complete_root(h,
        status, value)`` publishes a failed root task (the client resolves
        its future; a worker pushes a completion).  ``kids``: :meth:`children` of
        ``h``, if the caller scanned for a batch of frames (:meth:`children_of`), after it
        cleared their ping bits (a child done after the scan pings again).
        """
        a = self.a
        if kids is None:
            kids = self.children(h)
        kids = self.drop_calls(kids)
        if kids is None or any(s in (S_QUEUED, S_RUNNING) for _k, s, _w in kids):
            return False
        if a.tr.take_over(h, state, dead, self.me) is not Outcome.OK:
            return True  # somebody else recovered it, or it moved on
        if failpoints.ON:
            failpoints.hit("recovery.after_take_over")
        for k, s, w in kids:
            if s == S_DONE:
                a.release(k, S_DONE, w, self.me)
            elif s == S_FREEING and w == dead:
                a.free(k)
        off = a.off(h)
        mm = a.mm
        if reply_slot(mm, off):
            # The dead worker was storing an agent's reply here (Messages.reply: QUEUED ->
            # RUNNING|it, store, DONE). Its message was handled after the agent's last
            # checkpoint, so the agent's restart replays it and answers again: QUEUED again,
            # on no queue, as the caller made it (failing it lost a reply the replay gives).
            a.drop_result(off)
            a.tr.requeue(h, self.me)  # ours (taken over): cannot fail
            return True
        tries = _U32.unpack_from(mm, off + R_TRIES)[0]
        retries = _U32.unpack_from(mm, off + R_RETRIES)[0]
        _OWNER.pack_into(mm, off + R_OWNER, 0, 0)  # no frame: pings for it are ignored
        if tries < retries:
            _U32.pack_into(mm, off + R_TRIES, tries + 1)
            a.drop_result(off)
            a.tr.requeue(h, self.me)  # ours (taken over): cannot fail; published by the push
            self.push(h)
            a.notify_one()
            return True
        n = tries + 1
        exc = WorkerCrashedError(
            f"{why}; the task ran {n} time{'s' if n > 1 else ''} and its worker died each "
            f"time (retries={retries}). Other tasks go on.")
        self.fail(h, exc, complete_root)
        return True

    def drop_calls(self, kids: list[tuple[int, int, int]]
                   ) -> list[tuple[int, int, int]] | None:
        """The dead frame's calls to agents not answered yet (QUEUED task reply slots) are
        freed: the task runs again and calls again (a message may never have been sent, so
        waiting for its reply could wait forever; an answer that comes later finds the
        slot's generation changed and is dropped).  The other children are returned; None
        if an agent claimed one of them first (its answer pings the frame again)."""
        a = self.a
        out = []
        for k, s, w in kids:
            if s == S_QUEUED and reply_slot(a.mm, a.off(k)):
                if a.release(k, S_QUEUED, 0, self.me) is not Outcome.OK:
                    return None
                continue
            out.append((k, s, w))
        return out

    def fail(self, h: int, exc: BaseException, complete_root: Callable[[int, int, Any], None]
             ) -> None:
        """Store ``exc`` as the result of ``h`` (claimed by us) and publish it."""
        a = self.a
        off = a.off(h)
        kind, _status, link = a.kind_link(off)
        if kind & K_MASK == K_ROOT:
            complete_root(h, ST_ERROR, (exc, ""))
            return
        data, bufs = serialize.dumps((exc, ""))
        a.put_result(off, data, bufs)
        _U32.pack_into(a.mm, off + R_STATUS, ST_ERROR)
        a.tr.fail(h, self.me)  # ours (taken over); seq_cst CAS releases the result above
        self.pings.ping(link)

    def frame_owner(self, h: int) -> tuple[int, int]:
        """(worker, incarnation) holding ``h``'s fork-join frame; incarnation 0: none."""
        return _OWNER.unpack_from(self.a.mm, self.a.off(h) + R_OWNER)

