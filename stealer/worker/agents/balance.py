"""Where a worker's agents should go: its busy share, and the moves to its peers.

Owns the worker side of placement.py's rules, which are pure functions and objects: this
module reads the peers' words in shared memory and applies the rules to this worker's run
queue.  One :class:`Balancer` per worker, owned by its agents' host (host.py), which asks
it at every turn (``note_busy``, ``pays_to_idle``, ``balance``); the worker loop tells it
when the worker goes idle (``Host.went_idle``).  The moves themselves (checkpoint, record
transition, push) are the host's ``publish_one`` (leaving.py).

Shared words (stealer/shared/shm.py): this worker's W_BUSY_AVG / W_BUSY_AT, written here
only (relaxed stores: hints); the peers' W_BUSY_AVG, W_BUSY_AT, W_RUNNABLE and W_STATE,
read here (relaxed loads: hints, re-read at every check; a torn pair is harmless).
"""

from __future__ import annotations

import time
from typing import Any, Protocol

from stealer.shared.shm import (
    BUSY_SCALE,
    STATE_READY,
    W_BUSY_AT,
    W_BUSY_AVG,
    W_RUNNABLE,
    W_STATE,
)
from stealer.worker.agents.entry import _Entry
from stealer.worker.agents.placement import (
    AVG_TAU_NS,
    IDLE_SHARE,
    REVERSE_NS,
    BusyShare,
    MoveBudget,
    agents_for,
    decayed,
    gift,
    lasting,
    move_cost_ns,
    moves_to_busy,
    pays_to_idle,
)

__all__ = ["Balancer"]

QUIET_NS = 1_000_000  # ns pays_to_idle waits after a "no" before it looks again


class _Host(Protocol):
    """What a Balancer reads of its host (host.Host: named here by shape, not imported,
    so that host.py and this module do not import each other)."""

    w: Any  # the worker (loop.py): n, k, wbase, seg, inbox, inboxes
    r: Any  # the shared region
    rq: Any  # the run queue (runqueue.py)
    agents: dict[int, _Entry]
    turn_avg: int

    def publish_one(self, to: int = -1) -> bool: ...


class Balancer:
    """One worker's busy share (published for its peers) and its decisions to move agents
    to them.  Owns ``busy`` (placement.BusyShare), ``gifts`` (peer -> busy share handed to
    it lately, and when: not in its own average yet), ``budget`` (placement.MoveBudget) and
    ``prev`` (the peer :meth:`balance` found shortest at its previous check).  Reads the
    host's run queue, agents and turn average; moves agents with the host's
    ``publish_one``."""

    def __init__(self, host: _Host) -> None:
        w = host.w
        self.host = host
        self.w = w
        self.r = host.r
        self.avg_off = w.wbase + W_BUSY_AVG
        self.at_off = w.wbase + W_BUSY_AT
        # the native twin where the queues are native (_cqueues.BusyShare: note() publishes)
        native = getattr(w, "native", False) and getattr(getattr(w, "Q", None), "BusyShare", None)
        self.busy: Any = (native(AVG_TAU_NS, BUSY_SCALE, self.r, self.avg_off, self.at_off)
                          if native else BusyShare())
        self.quick = bool(native)
        self.gifts: dict[int, tuple[float, int]] = {}
        self.budget = MoveBudget()
        self.prev = -1
        self.on = w.n > 1  # nothing to balance with one worker
        self.quiet_until = 0  # monotonic ns before which pays_to_idle says no at once
        self.came = 0  # monotonic ns an agent last arrived here by migration (0: never)

    # -- our busy share ------------------------------------------------------------------
    def note_busy(self, busy: int) -> None:
        """Busy (1: a turn runs) or idle (0: the loop searches for work) from now on:
        folded into our busy share and published for the peers (W_BUSY_AVG)."""
        if self.quick:
            self.busy.note(busy)  # the same, natively (_cqueues.BusyShare)
            return
        now = time.monotonic_ns()
        avg = self.busy.update(now, busy)
        r = self.r
        r.store64(self.avg_off, int(avg * BUSY_SCALE) << 1 | busy)  # relaxed: a hint
        r.store64(self.at_off, now)  # relaxed, read with W_BUSY_AVG by the peers

    def turn(self) -> None:
        """A turn starts."""
        if not self.busy.cur and self.on:
            self.note_busy(1)  # busy from now on; readers extrapolate until we idle

    def went_idle(self) -> None:
        """The worker loop is about to search for work."""
        if self.busy.cur:
            self.note_busy(0)

    # -- the peers -------------------------------------------------------------------------
    def peer_share(self, j: int, now: int) -> float:
        """Peer ``j``'s busy share: its published one brought to now, plus the share we
        handed it lately (not in its average yet)."""
        r = self.r
        base = self.w.seg.layout.worker(j)
        at = r.load64(base + W_BUSY_AT)  # relaxed: a hint, with W_BUSY_AVG (shm.py)
        v = r.load64(base + W_BUSY_AVG)
        theirs = decayed((v >> 1) / BUSY_SCALE, at, now, v & 1) if at else 0.0
        g = self.gifts.get(j)
        if g is not None:
            theirs += gift(g[0], g[1], now)
        return theirs

    def cap(self, j: int, now: int) -> int:
        """How many agents may move to peer ``j`` now: none unless the gap between our
        busy shares lasts, and within the move budget unless the peer has been all but
        idle (a replacement, a worker left without agents: not a swap of shares)."""
        theirs = self.peer_share(j, now)
        mine = self.busy.now(now)
        agents = len(self.host.agents)
        back = self.came != 0 and now - self.came < REVERSE_NS
        if not lasting(mine - theirs, mine / max(agents, 1), back):
            return 0
        n = agents_for(mine - theirs, mine, agents)
        return n if theirs < IDLE_SHARE else min(n, self.budget.left(now))

    def got(self) -> None:
        """An agent arrived here by migration (a peer published it): moving one away
        takes a bigger gap for a while (placement.lasting's ``back``)."""
        self.came = time.monotonic_ns()

    def gave(self, j: int, n: int, now: int) -> None:
        """``n`` agents went to peer ``j`` (or may have: a publish for any idle thief):
        their share of our busy time goes with them."""
        share = n * self.busy.now(now) / max(len(self.host.agents) + n, 1)
        g = self.gifts.get(j)
        self.gifts[j] = (share + (gift(g[0], g[1], now) if g is not None else 0.0), now)
        self.busy.take(now, share)
        self.budget.spend(n)

    # -- the decisions ---------------------------------------------------------------------
    def balance(self) -> None:
        """Hand runnable agents to the least-loaded peer when that pays and the busy-share
        gap lasts (placement.py): busy peers never steal, so without this a worker that
        adopted more agents at the start keeps a longer round-robin for good.  A peer's
        load is its runnable agents (W_RUNNABLE) plus the notifications in its inbox
        (calls on their way to its agents); it must be the shortest at two checks in a
        row.  (Turns.run_next makes the look natively, then calls :meth:`balance_with`.)"""
        mine = self.host.rq.n + len(self.w.inbox)
        best, low = self.least_loaded(mine)
        self.balance_with(best, low, mine)

    def least_loaded(self, mine: int) -> tuple[int, int]:
        """The ready peer with the least load (runnable agents plus notifications on their
        way), and that load, if less than ``mine``; else ``(-1, mine)``."""
        w = self.w
        r = self.r
        best, low = -1, mine
        for j in range(w.n):
            if j == w.k:
                continue
            base = w.seg.layout.worker(j)
            if r.load32(base + W_STATE) != STATE_READY:
                continue
            # relaxed: a hint, re-read at every check
            v = r.load32(base + W_RUNNABLE) + len(w.inboxes[j])
            if v < low:
                best, low = j, v
        return best, low

    def balance_with(self, best: int, low: int, mine: int) -> None:
        """:meth:`balance` after its look: ``best`` (-1: none) the shortest peer now, with
        load ``low`` against our ``mine``."""
        host = self.host
        prev, self.prev = self.prev, best
        if best < 0 or best != prev:
            return
        c = host.rq.last()
        # whether a move pays first (integers); the busy-share cap (the peer's words and
        # an exp each) only then: 256 lockstep agents of 50 us found a shorter peer at
        # about every eighth turn of a round's end, where no move pays (8.6 us a look,
        # thread-CPU stamps included, 5.5 looks a round)
        n = moves_to_busy(mine, low, host.turn_avg,
                          move_cost_ns(c.ckpt_ns if c is not None else 0))
        if n <= 0:
            return
        now = time.monotonic_ns()
        n = min(n, self.cap(best, now))
        moved = 0
        while moved < n and host.publish_one(to=best):
            moved += 1
        if moved:
            self.gave(best, moved, now)

    def pays_to_idle(self, e: _Entry, idle: int) -> int:
        """Publish the next runnable agent for an idle peer (``idle``: their bits; ``e``:
        the agent whose turn starts)?  Only if one of them has nothing on its way, our
        busy share has exceeded its share for a while (not only at this round's end:
        placement.py) and the move pays.  Returns that peer (-1: no); the caller records
        the move with :meth:`gave` once it is made (a publish may still refuse: an agent
        that just arrived, a checkpoint that failed)."""
        host = self.host
        w = self.w
        now = time.monotonic_ns()
        if now < self.quiet_until:
            return -1
        # (the move's own test first: integers; the peers' busy shares only if it pays)
        c = host.rq.candidate()
        backlog = (e.turn_ns or host.turn_avg) + host.rq.n * host.turn_avg
        if c is None or not pays_to_idle(backlog, c.turn_ns or host.turn_avg,
                                         move_cost_ns(c.ckpt_ns)):
            # no agent to give, or one too short to pay for its move: asked at every turn
            # while a peer idles (256 lockstep agents of 50 us, at every round's end), so
            # not again for 1 ms
            self.quiet_until = now + QUIET_NS
            return -1
        for j in range(min(w.n, 64)):
            if idle >> j & 1 and not len(w.inboxes[j]) and self.cap(j, now):
                return j
        # every idle peer has work on its way, or has had as much as we: asked at every
        # turn while a peer idles, so not again for 1 ms either (the shares move over
        # 100 ms)
        self.quiet_until = now + QUIET_NS
        return -1
