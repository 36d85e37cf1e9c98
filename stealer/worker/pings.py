"""A worker's side of the fork-join pings that do not resume a frame of its own at once
(stealer/shared/recovery.py Pings has the protocol): pings for frames it does not hold are
forwarded, frames a dead predecessor held are looked at in batches, and pings that found
its own inbox full wait in a list for its loop.  A mixin of stealer/worker/loop.py's Worker.
"""

from __future__ import annotations

import time
from typing import Any

from stealer.shared._layout import F_AGENT, S_RUNNING

__all__ = ["PingHandling"]


class PingHandling:
    """Mixed into Worker, whose attributes these methods use."""

    arena: Any
    rec: Any
    pings: Any
    inboxes: list
    idle: Any
    k: int
    who: int
    incarnation: int
    held: list[int]  # pings for our own frames that found our inbox full
    orphans: list[int]  # frames our dead predecessor held, pinged: looked at in one scan

    def on_ping(self, h: int) -> None:  # (Worker's)
        raise NotImplementedError

    def complete_root(self, h: int, status: int, value: Any) -> None:  # (Worker's)
        raise NotImplementedError

    def pass_on(self, h: int) -> bool:
        """A ping for a frame not suspended here (its bit cleared): a frame our dead
        predecessor held is looked at later (:meth:`run_later`); one another worker holds
        (it moved, or the slot was reused) gets the ping forwarded.  False for an agent's
        record (the caller keeps the ping for the host)."""
        a = self.arena
        if a.kind_link(a.off(h))[0] & F_AGENT:
            return False
        st = a.tr.state(h)
        owner, inc = self.rec.frame_owner(h) if st is not None else (0, 0)
        if st == (S_RUNNING, self.who) and owner == self.k and inc and inc != self.incarnation:
            self.orphans.append(h)  # a frame our dead predecessor held: re-run or fail it
            return True
        # ours and running now (it looks at its children before it suspends), finished,
        # or another's: forwarded to the frame's owner (see Pings.forward)
        self.pings.forward(h, self.k)
        return True

    def run_later(self) -> None:
        """Handle :attr:`held` pings and :attr:`orphans` (our inbox is empty)."""
        held, self.held = self.held, []
        for h in held:
            self.on_ping(h)
        orphans, self.orphans = list(dict.fromkeys(self.orphans)), []
        if not orphans:
            return
        for h in orphans:
            self.pings.clear(h)  # (cleared again: before the one scan of their children)
        kids = self.rec.children_of(orphans)
        why = f"worker {self.k} (an earlier incarnation) died while this task waited for its children"
        for h in orphans:
            if self.arena.tr.state(h) == (S_RUNNING, self.who):
                self.rec.orphan(h, self.who, why, self.complete_root, kids=kids.get(h, []))

    def inbox_full(self, owner: int, h: int) -> None:
        """Pings.ping found ``owner``'s inbox full (its bit is set: nobody else pushes it)."""
        if owner == self.k:
            self.held.append(h)  # our own inbox: our loop looks at it instead
            return
        # A peer's: it drains its inbox, or it dies and the client drains it (recover):
        # the wait ends without anything from us, and the client never waits on us.
        while not self.inboxes[owner].push(h):
            time.sleep(0.0001)
        self.idle.notify_worker(owner)
