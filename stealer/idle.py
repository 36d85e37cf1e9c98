"""Who is searching, who is parked, and whom to wake.

Policy (after tokio's ``idle.rs``):

* A worker out of local work becomes a *searcher* only while at most half
  the workers search (``try_search``); the rest go straight to parking.
* A searcher that finds work stops searching; if it was the last searcher
  it wakes one more worker, so parallelism ramps up one wake at a time.
* Publishing work (submit, spawn, a stolen batch) wakes one parked worker
  only when nobody is searching: a searcher will find the work anyway.
* Parking is a Dekker handshake with the notifier.  The worker stores its
  park word (PARKED), counts itself parked, then re-checks every queue
  before sleeping on the futex; the notifier publishes work, issues a
  seq_cst fence, then reads the searching/parked counts and CASes one
  park word PARKED -> NOTIFIED before ``futex_wake``.  One of the two
  always sees the other, so no wake-up is lost.
"""

from __future__ import annotations

from typing import Any

from stealer.shm import H_CLIENT_PARK, H_PARKED, H_SEARCHING, W_PARK, W_SEARCHING, Layout

__all__ = ["Idle", "RUNNING", "PARKED", "NOTIFIED"]

RUNNING, PARKED, NOTIFIED = 0, 1, 2


class Idle:
    def __init__(self, region: Any, layout: Layout) -> None:
        self.r = region
        self.n = layout.nworkers
        self.park_words = [layout.worker(k) + W_PARK for k in range(self.n)]
        self.search_flags = [layout.worker(k) + W_SEARCHING for k in range(self.n)]
        self._next = 0

    # -- searching ---------------------------------------------------------
    def try_search(self, k: int) -> bool:
        """Worker ``k`` becomes a searcher unless half the workers already search."""
        r = self.r
        if 2 * r.load32(H_SEARCHING) >= self.n and self.n > 1:
            return False
        r.store32(self.search_flags[k], 1)  # for the client's correction if k dies while searching
        r.add32(H_SEARCHING, 1)  # seq_cst RMW: read by notify_one after its fence
        return True

    def stop_search(self, k: int, found_work: bool) -> None:
        """Leave the searching state; the last searcher to find work wakes another."""
        r = self.r
        old = r.add32(H_SEARCHING, -1)  # seq_cst RMW: pairs with notify_one's fence
        r.store32(self.search_flags[k], 0)
        if found_work and old == 1:
            self.notify_one()

    def forget(self, k: int) -> None:
        """Client, after worker ``k`` died: drop it from the searching/parked counts."""
        r = self.r
        if r.exchange32(self.search_flags[k], 0):
            r.add32(H_SEARCHING, -1)
        if r.exchange32(self.park_words[k], RUNNING) != RUNNING:
            r.add32(H_PARKED, -1)

    # -- waking --------------------------------------------------------------
    def notify_one(self) -> bool:
        """Wake one parked worker if nobody searches; call after publishing work.

        (The native HotPath.notify_one in native/_cqueues.pyx does the same in one call.)
        """
        r = self.r
        # seq_cst fence, then: nobody searching and somebody parked? (one native call)
        if not r.idle_check(H_SEARCHING, H_PARKED):
            return False
        n = self.n
        start = self._next
        for i in range(n):
            k = (start + i) % n
            w = self.park_words[k]
            if r.cas32(w, PARKED, NOTIFIED):  # pairs with the worker's store of PARKED
                self._next = k + 1
                r.futex_wake(w, 1)
                return True
        return False

    def notify_worker(self, k: int) -> None:
        """Wake worker ``k`` if parked (after pushing to its inbox)."""
        r = self.r
        r.fence()  # seq_cst: the inbox push before the park-word read
        w = self.park_words[k]
        if r.cas32(w, PARKED, NOTIFIED):
            r.futex_wake(w, 1)

    def notify_all(self) -> None:
        for k in range(self.n):
            self.notify_worker(k)

    # -- parking (worker k) ---------------------------------------------------
    def park(self, k: int, has_work: Any, timeout: float) -> bool:
        """Sleep until notified, work appears, or ``timeout``; False on timeout."""
        r = self.r
        w = self.park_words[k]
        r.store32(w, PARKED)  # seq_cst: read by notifiers' CAS after their fence
        r.add32(H_PARKED, 1)
        try:
            if has_work():
                return True
            return r.futex_wait(w, PARKED, timeout)
        finally:
            r.store32(w, RUNNING)
            r.add32(H_PARKED, -1)

    # -- the client's result thread -----------------------------------------
    def wake_client(self) -> None:
        """Worker side, after pushing a completion: wake the client if parked."""
        r = self.r
        r.fence()  # seq_cst: the completion push before reading the park word
        if r.load32(H_CLIENT_PARK) == PARKED and r.cas32(H_CLIENT_PARK, PARKED, NOTIFIED):
            r.futex_wake(H_CLIENT_PARK, 1)

    def client_park(self, has_work: Any, timeout: float) -> bool:
        r = self.r
        r.store32(H_CLIENT_PARK, PARKED)  # seq_cst: pairs with wake_client's fence and load
        try:
            if has_work():
                return True
            return r.futex_wait(H_CLIENT_PARK, PARKED, timeout)
        finally:
            r.store32(H_CLIENT_PARK, RUNNING)
