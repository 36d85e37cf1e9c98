"""A worker's run queue of agents: one per tier, earliest deadline first, then round-robin.

Private to its worker (plain Python objects, no shared memory): an agent
that stays on its worker is never serialized.  Tiers are strict: a
runnable control agent goes before any interactive one, which goes before
any bulk one, at the next turn boundary.  Within a tier, agents with a
deadline go first, earliest first (EDF); the others take turns in FIFO
order, and an agent that wants another step goes to the back (round-robin:
each runnable agent of the tier gets one turn before any gets two, so none
starves behind a busy one).
"""

from __future__ import annotations

import collections
import heapq
import itertools
from typing import Any

__all__ = ["RunQueue", "NTIERS"]

NTIERS = 3


class RunQueue:
    __slots__ = ("edf", "fifo", "n", "n0", "seq")

    def __init__(self) -> None:
        self.fifo: list[collections.deque[Any]] = [collections.deque() for _ in range(NTIERS)]
        self.edf: list[list[tuple[float, int, Any]]] = [[] for _ in range(NTIERS)]
        self.n = 0
        self.n0 = 0  # runnable control-tier agents (the worker loop checks it every pass)
        self.seq = itertools.count()

    def __len__(self) -> int:
        return self.n

    def push(self, e: Any, tier: int) -> None:
        if e.deadline is not None:
            heapq.heappush(self.edf[tier], (e.deadline, next(self.seq), e))
        else:
            self.fifo[tier].append(e)
        self.n += 1
        if tier == 0:
            self.n0 += 1

    def pop(self) -> Any:
        if not self.n:
            return None
        for t in range(NTIERS):
            if self.edf[t]:
                self.n -= 1
                if t == 0:
                    self.n0 -= 1
                return heapq.heappop(self.edf[t])[2]
            if self.fifo[t]:
                self.n -= 1
                if t == 0:
                    self.n0 -= 1
                return self.fifo[t].popleft()
        return None

    def top_tier(self) -> int:
        """The highest tier with a runnable agent (NTIERS when empty)."""
        for t in range(NTIERS):
            if self.edf[t] or self.fifo[t]:
                return t
        return NTIERS

    def candidate(self) -> Any:
        """The agent that would run next (published for an idle thief: highest tier first)."""
        for t in range(NTIERS):
            if self.edf[t]:
                return self.edf[t][0][2]
            if self.fifo[t]:
                return self.fifo[t][0]
        return None

    def last(self) -> Any:
        """The agent that would run last (handed to a busy peer: it just had its turn, so
        the peer's round is all it waits)."""
        for t in range(NTIERS - 1, -1, -1):
            if self.fifo[t]:
                return self.fifo[t][-1]
            if self.edf[t]:
                return max(self.edf[t])[2]
        return None

    def remove(self, e: Any) -> bool:
        for t in range(NTIERS):
            q = self.fifo[t]
            if q and e in q:
                q.remove(e)
                self.n -= 1
                if t == 0:
                    self.n0 -= 1
                return True
            h = self.edf[t]
            for i, item in enumerate(h):
                if item[2] is e:
                    h.pop(i)
                    heapq.heapify(h)
                    self.n -= 1
                    if t == 0:
                        self.n0 -= 1
                    return True
        return False
