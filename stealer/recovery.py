"""What happens to the records a dead worker held: re-run, fail, publish, or free them.

Used by the client's result thread when it sees a worker die (stealer/pool.py)
and by a replacement worker that receives a ping for a fork-join frame its
dead predecessor held (stealer/worker.py).  Both act only through the
transitions of stealer/records.py, so when two recoverers (or a recoverer and
a stale ping) race, exactly one CAS wins and the other gets a named outcome.

The rules, by what the state word of a record says (who = dead worker + 1):

* QUEUED (named by the dead worker's lease or current word): it may have been
  taken off its queue and never started: push it on the injector again.  If
  it was still queued, there are now two copies; ``start`` lets one win.
* CANCELLED (lease/current): the dead worker was about to free it: free it.
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
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable
from typing import Any

from stealer import failpoints, serialize
from stealer._layout import (
    GEN_MASK,
    K_CHILD,
    K_MASK,
    K_ROOT,
    R_KIND,
    R_LINK,
    R_OWNER,
    R_RETRIES,
    R_STATUS,
    R_TRIES,
    RECORD_BYTES,
    S_CANCELLED,
    S_DONE,
    S_FREEING,
    S_QUEUED,
    S_RUNNING,
    ST_ERROR,
    STATE_MASK,
    STATE_SHIFT,
    WHO_SHIFT,
)
from stealer._lazy import lazy_numpy
from stealer.errors import WorkerCrashedError
from stealer.records import Outcome

np: Any = lazy_numpy(globals())  # numpy, imported on first use

__all__ = ["Recovery", "ping_parent"]

_U32 = struct.Struct("=I")
_U64 = struct.Struct("=Q")
_OWNER = struct.Struct("=II")  # R_OWNER, R_INCARNATION
_STRIDE = RECORD_BYTES // 8


def ping_parent(arena: Any, inboxes: list, idle: Any, parent: int, me: int = -1) -> None:
    """A child of ``parent`` is DONE: ask the parent's owner to look at its frame.

    Pings are idempotent (the owner re-checks every child's state), so a
    recoverer may send one again when it cannot know whether it was sent.
    """
    try:
        poff = arena.off(parent)
    except IndexError:
        return
    owner = _U32.unpack_from(arena.mm, poff + R_OWNER)[0]  # the parent's worker, set at its first spawn
    if owner >= len(inboxes):
        return
    while not inboxes[owner].push(parent):  # capacity == records
        time.sleep(0.0001)
    if owner != me:
        idle.notify_worker(owner)


class Recovery:
    """Recovery operations over one segment's records (client or worker side)."""

    def __init__(self, arena: Any, inboxes: list, idle: Any, me: int,
                 push: Callable[[int], None] | None = None) -> None:
        self.a = arena
        self.inboxes = inboxes
        self.idle = idle
        self.me = me  # who: our worker index + 1, or 0 for the client
        self.push = push or self._push  # puts a QUEUED handle where a worker will find it

    def _push(self, h: int) -> None:
        while not self.a.injector.push(h):
            time.sleep(0.0001)

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
        w, ks, link = self._columns()
        kind = ks & np.uint64(K_MASK)
        st = (w >> np.uint64(STATE_SHIFT)) & np.uint64(STATE_MASK)
        mask = (kind == np.uint64(K_CHILD)) & (link == np.uint64(parent)) & (st != np.uint64(0))
        out = []
        for i in np.nonzero(mask)[0]:
            x = int(w[i])
            out.append((((x & GEN_MASK) << 32) | int(i), (x >> STATE_SHIFT) & STATE_MASK,
                        x >> WHO_SHIFT))
        return out

    # -- the rules ------------------------------------------------------------------
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

    def orphan(self, h: int, dead: int, why: str, complete_root: Callable[[int, int, Any], None],
               state: int = S_RUNNING) -> bool:
        """``h`` is RUNNING|dead (or RECOVERING|dead: a recoverer died recovering it): re-run
        or fail it once its children are all done.

        Returns False while children are still queued or running (the last
        one's ping brings the frame's owner back here).  ``complete_root(h,
        status, value)`` publishes a failed root task (the client resolves
        its future; a worker pushes a completion).
        """
        a = self.a
        kids = self.children(h)
        if any(s in (S_QUEUED, S_RUNNING) for _k, s, _w in kids):
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
        ping_parent(a, self.inboxes, self.idle, link, self.me - 1)

    def frame_owner(self, h: int) -> tuple[int, int]:
        """(worker, incarnation) holding ``h``'s fork-join frame; incarnation 0: none."""
        return _OWNER.unpack_from(self.a.mm, self.a.off(h) + R_OWNER)

