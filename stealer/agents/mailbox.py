"""Agent mailboxes: the directory entry of each agent in shared memory.

An agent *is* a record (kind ``K_ROOT | F_AGENT``): its handle is the agent
id, its state word says where it lives (RUNNING|k: in worker k's heap;
QUEUED: on a queue, migrating or not started yet; DONE: finished).  The
directory has one entry (DIR_BYTES, layout in stealer/shared/_layout.py) per
record slot; the entry of an agent is its record's slot.

The mailbox is a lock-free multi-producer stack of message records (kind
K_MSG), linked newest to oldest through R_NEXT, with its head in D_HEAD.
Senders push with one CAS; nobody ever pops.  The owner *walks* from the
head down to the newest message it has already seen, and reverses: FIFO
per sender, since a sender's pushes are ordered by its own CASes.  Messages
stay in the chain after they are handled, until a checkpoint covers them
(its record names the newest message whose effect it contains, the *mark*;
the owner then frees the mark and everything older).  So after a worker
dies, the agent restarts from its latest checkpoint and replays the chain
above the mark: every message accepted by a send or call is applied
(D_DONE tells which of them had been handled before, so only the others
give back their mailbox slot).

Closing (the agent finished or was stopped): the owner sets CLOSED (the
top bit) in D_HEAD with a CAS; a sender's push then fails and it raises
AgentStopped.  The chain stays readable under the bit, so an owner killed
while finishing leaves a successor that can still answer every call in it.

Notification (as tokio's NOTIFIED bit): after pushing, a sender sets
AF_NOTIFIED; the one that set it first reads the agent's state word and,
if it is RUNNING|k, pushes the agent's handle onto worker k's inbox and
wakes k.  A starting worker (QUEUED -> RUNNING) and an owner taking a
notification clear the bit *before* walking the chain, so a push is either
seen by the walk or followed by a fresh notification (all seq_cst).

Backpressure: D_COUNT counts messages accepted and not yet handled; a
sender reserves a slot (add32) before it pushes and gives it back if that
overshot D_CAP.  The owner gives slots back as it handles messages and
futex-wakes blocked client senders when the count falls from the cap.

Used by both sides: the agents' client (stealer/client/agents.py: send, call, stop from the
client) and their host on each worker (stealer/worker/agents/: host, inline, dormant), on
the directory that stealer/shared/shm.py places in the segment.
"""

from __future__ import annotations

import os
import signal
import struct
import time
from typing import Any

from stealer.shared._layout import (
    AF_CONTROL,
    AF_NOTIFIED,
    D_CAP,
    D_COUNT,
    D_DONE,
    D_FLAGS,
    D_HEAD,
    DIR_BYTES,
    GEN_MASK,
    INLINE,
    K_MSG,
    R_NEXT,
    S_DONE,
    S_RUNNING,
    STATE_MASK,
    STATE_SHIFT,
    WHO_SHIFT,
)
from stealer.shared.shm import W_CURRENT, W_PID

__all__ = ["CLOSED", "Directory", "POST_CONTROL", "POST_FULL", "POST_INBOX_FULL", "POST_NOREC",
           "POST_QUIET", "POST_STOPPED", "SIGNAL", "signal_if_busy"]

SIGNAL = signal.SIGUSR2  # "a control message is waiting": SIGUSR1 is an idle peer's request


def signal_if_busy(region: Any, worker_base: int, h: int, flags: int) -> bool:
    """Sender side, after a control agent's notification reached its owner's inbox: if
    the owner is in a turn of another agent, ask it (SIGNAL) to handle the message now.
    ``flags``: the agent's directory flags (D_FLAGS).  True if a signal was sent."""
    if not flags & AF_CONTROL:
        return False
    # seq_cst fence: the message's and the notification's pushes before the load of
    # W_CURRENT; pairs with Host.step's fence after the turn's store of it (the owner then
    # looks at its control agents' mailboxes): we signal it, or it sees the message
    region.fence()
    cur = region.load64(worker_base + W_CURRENT)  # acquire: pairs with the turn's store
    if not cur or cur == h + 1:
        return False  # between turns (the loop sees the inbox), or the agent itself
    pid = region.load32(worker_base + W_PID)  # set once by the worker at its start
    if not pid:
        return False
    try:
        os.kill(pid, SIGNAL)
    except OSError:  # it died meanwhile: its recovery handles the message
        return False
    return True


# The sender's side of a control-tier message that finds its agent's worker busy in another
# agent's step; the owner's side is stealer/worker/agents/inline.py.

CLOSED = 1 << 63  # the bit of D_HEAD that closes a mailbox (handles + 1 stay below it)
# Directory.post/route's results, the same as native/_cqueues.pyx's HotPath.post_msg's
POST_QUIET, POST_FULL, POST_STOPPED, POST_NOREC, POST_INBOX_FULL = -1, -2, -3, -4, -5
POST_CONTROL = 1 << 24  # or-ed into the owner to wake: a control-tier agent
_OWNER = POST_CONTROL - 1
_CHAIN = CLOSED - 1
_ALL = (1 << 64) - 1
_U64 = struct.Struct("=Q")


class Directory:
    """The agent directory of one segment (usable from the client and from workers)."""

    def __init__(self, region: Any, arena: Any, base: int, inboxes: list, idle: Any,
                 full: Any = None, worker_base: Any = None) -> None:
        self.r = region
        self.a = arena
        self.mm = arena.mm
        self.base = base
        self.inboxes = inboxes
        self.idle = idle
        # (owner, h) -> None: a notification found the owner's inbox full.  The client
        # passes one that queues it for its result thread (it never waits on a worker's
        # inbox: a worker still starting does not drain it).  A worker (None) keeps it in
        # ``held`` for its loop (deliver_held): waiting here could wait for a peer that
        # waits for room in our inbox, which only our loop makes.
        self.full = full
        self.held: list[tuple[int, int, int]] = []  # (owner, h, flags): a worker's, see above
        # Layout.worker: where a worker's words are (a control agent's busy owner is
        # signalled, inline.py); None: never signal
        self.worker_base = worker_base
        self.hot = getattr(arena, "hot", None)  # the native HotPath (msg_done), if used

    def entry(self, h: int) -> int:
        """Byte offset of agent ``h``'s directory entry."""
        return self.base + DIR_BYTES * (h & 0xFFFFFFFF)

    def init(self, h: int, capacity: int, flags: int = 0) -> None:
        """Spawner: a fresh entry for agent ``h`` (before its record is pushed; the push
        publishes these stores); ``flags``: AF_CONTROL for a control-tier agent."""
        e = self.entry(h)
        self.mm[e : e + DIR_BYTES] = bytes(DIR_BYTES)
        self.r.store32(e + D_CAP, capacity)
        if flags:
            self.r.store64(e + D_FLAGS, flags)  # plain: published by the record's push

    # -- senders ----------------------------------------------------------------
    def reserve(self, h: int) -> bool:
        """Take one mailbox slot of agent ``h``; False if the mailbox is full."""
        e = self.entry(h)
        cap = self.r.load32(e + D_CAP)
        # seq_cst RMW: pairs with the owner's add32 in give_back
        if self.r.add32(e + D_COUNT, 1) >= cap:
            self.r.add32(e + D_COUNT, -1)  # overshot: give it back (the owner never sees it)
            return False
        return True

    def count(self, h: int) -> tuple[int, int]:
        """(messages waiting, capacity) of agent ``h``'s mailbox."""
        e = self.entry(h)
        # stats reads: D_COUNT pairs with reserve/give_back (add32), D_CAP with init
        return self.r.load32(e + D_COUNT), self.r.load32(e + D_CAP)

    def wait_room(self, h: int, timeout: float) -> None:
        """Client: sleep until the count of ``h`` may have dropped (or ``timeout``)."""
        e = self.entry(h)
        c = self.r.load32(e + D_COUNT)  # pairs with give_back's add32 and futex_wake
        if c >= self.r.load32(e + D_CAP):
            self.r.futex_wait(e + D_COUNT, c, timeout)  # woken by give_back

    def push(self, h: int, m: int) -> bool:
        """Push message record ``m`` onto agent ``h``'s mailbox; False if it is closed."""
        e = self.entry(h)
        r = self.r
        moff = self.a.off(m)
        while True:
            old = r.load64(e + D_HEAD)  # acquire: pairs with other senders' CAS
            if old & CLOSED:
                return False
            _U64.pack_into(self.mm, moff + R_NEXT, old)  # ours until the CAS publishes it
            # seq_cst CAS: publishes the message and its link; pairs with the owner's
            # load of D_HEAD in take() and its closing CAS
            if r.cas64(e + D_HEAD, old, m + 1):
                return True

    def post(self, h: int, data: bytes, reserved: bool = False) -> int:
        """Sender: message ``data`` (an inline payload) into agent ``h``'s mailbox, in one
        call: the agent checked (current, not DONE, not closed), a slot reserved (unless
        ``reserved``: the caller holds one), a K_MSG record made, pushed and routed
        (:meth:`route`).  The reference of native/_cqueues.pyx's ``HotPath.post_msg``,
        with its results: :meth:`route`'s once pushed, or, with nothing changed (a slot
        reserved here given back), POST_FULL (the mailbox is full), POST_STOPPED (the
        agent is gone, done or closed), POST_NOREC (no free record)."""
        a = self.a
        if len(data) > INLINE:
            raise ValueError("payload too large for the inline path")
        st = a.tr.state(h)
        # acquire load of D_HEAD: pairs with the owner's closing CAS
        if st is None or st[0] == S_DONE or self.r.load64(self.entry(h) + D_HEAD) & CLOSED:
            return POST_STOPPED
        if not reserved and not self.reserve(h):
            return POST_FULL
        m = a.alloc()
        if m < 0:
            if not reserved:
                self.give_back(h)
            return POST_NOREC
        try:
            off = a.setup(m, K_MSG, 0, time.monotonic_ns())
            a.put(off, data, [])
        except BaseException:  # (a corrupt offset, KeyboardInterrupt): nothing was posted
            a.free(m)
            if not reserved:
                self.give_back(h)
            raise
        if not self.push(h, m):
            a.free(m)  # never published: still ours
            if not reserved:
                self.give_back(h)
            return POST_STOPPED
        return self.route(h)

    def route(self, h: int) -> int:
        """After a push (or a stop): the notification's half that needs no decision.  Sets
        AF_NOTIFIED and, if this sender set it first and the agent is RUNNING on worker k,
        pushes ``h`` onto k's inbox.  Returns ``k`` (``| POST_CONTROL`` for a control-tier
        agent) for the caller to wake, ``POST_INBOX_FULL - k`` when k's inbox was full
        (the caller keeps it for later), or POST_QUIET (nobody to wake: a notification
        was on its way, or the agent is not running)."""
        r = self.r
        # seq_cst RMW: pairs with the owner's and64 that clears it before its walk
        flags = r.or64(self.entry(h) + D_FLAGS, AF_NOTIFIED)
        if flags & AF_NOTIFIED:
            return POST_QUIET  # a notification is already on its way
        w = r.load64(self.a.off(h))  # the agent's state word (seq_cst after the or64)
        if w & GEN_MASK != h >> 32 or (w >> STATE_SHIFT) & STATE_MASK != S_RUNNING:
            return POST_QUIET  # gone, or QUEUED: whoever starts it walks the mailbox
        owner = (w >> WHO_SHIFT) - 1
        if not 0 <= owner < len(self.inboxes):
            return POST_QUIET
        if not self.inboxes[owner].push(h):  # one notification per agent at a time
            return POST_INBOX_FULL - owner
        return owner | (POST_CONTROL if flags & AF_CONTROL else 0)

    def routed(self, h: int, code: int, me: int = -1, defer: set[int] | None = None) -> None:
        """Act on :meth:`route`'s (or post's) result: wake the owner (or add it to
        ``defer``: the caller wakes each owner of a batch once, ``Idle.notify_worker``,
        before it blocks and when it is done), or keep a notification its owner's full
        inbox refused."""
        if code >= 0:
            self._woken(code & _OWNER, h, AF_CONTROL if code & POST_CONTROL else 0, me, defer)
        elif code <= POST_INBOX_FULL:
            owner = POST_INBOX_FULL - code
            if self.full is not None:  # the client: never waits on a worker's inbox
                self.full(owner, h)
            else:  # a worker: for its loop (the AF_NOTIFIED bit stays set: nobody else pushes)
                self.held.append((owner, h, self.flags(h)))

    def notify(self, h: int, me: int = -1, defer: set[int] | None = None) -> None:
        """After a push (or a stop): make sure agent ``h``'s owner looks at it
        (:meth:`route`, then :meth:`routed`)."""
        self.routed(h, self.route(h), me, defer)

    def _woken(self, owner: int, h: int, flags: int, me: int = -1,
               defer: set[int] | None = None) -> None:
        """The notification for ``h`` is in ``owner``'s inbox: wake the owner (or defer)."""
        if owner != me:
            if defer is None:
                self.idle.notify_worker(owner)
            elif owner not in defer:
                # a batch's first message for this owner wakes it now, so it works while
                # the rest of the batch is written; the caller wakes each owner once more
                # when it is done (the owner may have drained its inbox and parked since)
                defer.add(owner)
                self.idle.notify_worker(owner)
            if flags & AF_CONTROL and self.worker_base is not None:
                signal_if_busy(self.r, self.worker_base(owner), h, flags)

    def deliver_held(self, me: int = -1) -> bool:
        """A worker's loop: push the notifications that found their owner's inbox full
        (``held``) where there is room now; True if some are still held.  Lost with the
        worker if it dies first, as one it waited to push was."""
        still = []
        for owner, h, flags in self.held:
            if self.inboxes[owner].push(h):
                self._woken(owner, h, flags, me)
            else:
                still.append((owner, h, flags))
        self.held = still
        return bool(still)

    # -- the owner ----------------------------------------------------------------
    def clear_notified(self, h: int) -> None:
        self.r.and64(self.entry(h) + D_FLAGS, ~AF_NOTIFIED & _ALL)  # seq_cst: see notify

    def flags(self, h: int) -> int:
        return self.r.load64(self.entry(h) + D_FLAGS)  # pairs with the or64 of stop/notify

    def take_mail(self, h: int, seen: int) -> tuple[int, int, list[int]]:
        """Owner, notified: :meth:`clear_notified`, :meth:`take`, then :meth:`flags`, in
        that order (a message pushed after the walk notifies again; a stop set before the
        clear is seen); ``(flags, head, messages oldest first)``.  One native call with
        the extension (HotPath.take_mail)."""
        hot = self.hot
        if hot is not None:
            return hot.take_mail(self.entry(h), seen)
        self.clear_notified(h)
        got, head = self.take(h, seen)
        return self.flags(h), head, got

    def take(self, h: int, seen: int) -> tuple[list[int], int]:
        """Messages pushed since ``seen`` (a head value), oldest first, and the new head
        (a closed mailbox's chain too: a successor of an owner killed while finishing)."""
        # acquire: pairs with push's CAS and close's
        head = self.r.load64(self.entry(h) + D_HEAD) & _CHAIN
        if head == seen:
            return [], seen
        out = self.older(head, seen)
        out.reverse()
        return out, head

    def older(self, mark: int, stop: int) -> list[int]:
        """Message handles from ``mark`` (a handle + 1) down to, not including, ``stop``."""
        out = []
        v = mark
        mm = self.mm
        off = self.a.off
        while v and v != stop:
            m = v - 1
            out.append(m)
            v = _U64.unpack_from(mm, off(m) + R_NEXT)[0]
        return out

    def free_older(self, mark: int, stop: int) -> None:
        """Owner, once a checkpoint covers them: free the messages from ``mark`` down to,
        not including, ``stop`` (:meth:`older`).  With the extension, one native call frees
        those whose payloads are inline (HotPath.free_chain); Arena.free the others."""
        hot = self.hot
        free = self.a.free
        if hot is not None:
            for m in hot.free_chain(mark, stop) or ():
                free(m)
            return
        for m in self.older(mark, stop):
            free(m)

    def mark_done(self, h: int, m: int) -> None:
        """Owner: message ``m`` is handled (release: read by a recoverer after our death)."""
        self.r.store64(self.entry(h) + D_DONE, m + 1)

    def msg_done(self, h: int, m: int) -> None:
        """Owner: message ``m`` is handled and its slot given back (:meth:`mark_done`,
        then :meth:`give_back`; one native call with the extension, HotPath.msg_done)."""
        hot = self.hot
        if hot is not None:
            hot.msg_done(self.entry(h), m)
            return
        self.mark_done(h, m)
        self.give_back(h)

    def done_mark(self, h: int) -> int:
        return self.r.load64(self.entry(h) + D_DONE)

    def give_back(self, h: int, n: int = 1) -> None:
        """Owner: ``n`` messages handled; wake blocked client senders if it was full."""
        e = self.entry(h)
        # seq_cst RMW: pairs with the senders' reserve
        old = self.r.add32(e + D_COUNT, -n)
        if old >= self.r.load32(e + D_CAP):
            self.r.futex_wake(e + D_COUNT, 1 << 30)

    def close(self, h: int) -> int:
        """Owner: no more messages; returns the last head (the chain to drain), also when
        an earlier, killed owner had closed it already."""
        e = self.entry(h)
        r = self.r
        while True:
            old = r.load64(e + D_HEAD)  # acquire: pairs with push's CAS
            if old & CLOSED:
                return old & _CHAIN
            if r.cas64(e + D_HEAD, old, old | CLOSED):  # seq_cst: pairs with push's CAS
                # blocked senders see it closed.  Only a full mailbox can have one (wait_room
                # sleeps only on a count >= the cap, and a count that fell since wakes it at
                # give_back's futex_wake or fails its futex_wait's compare): seq_cst loads
                # after the CAS. (A system call per close was most of stopping a dormant agent.)
                if r.load32(e + D_COUNT) >= r.load32(e + D_CAP):
                    r.futex_wake(e + D_COUNT, 1 << 30)
                return old
