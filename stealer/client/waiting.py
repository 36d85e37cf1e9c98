"""Settling completions: the result thread's batches, and a client thread that waits on a
future and settles them itself meanwhile (the *waiter*, :meth:`Settling.wait_for`).

A mixin of ``_Pool`` (stealer/client/pool.py), whose attributes it uses: the completion
rings, the consume lock, the futures, the idle words.  Called by the result thread's
loop, by ``WorkerDeaths.drain`` and by ``_Future.result``/``exception``.
"""

from __future__ import annotations

import _signal
import os
import signal
import threading
import time
from concurrent.futures import _base as _fbase
from typing import Any

from stealer.shared.idle import BATCH_ENTER, BATCH_LEAVE, BATCH_POLL

__all__ = ["Settling", "WAITER_POLL_MAX", "NO_TARGET"]

WAITER_POLL_MAX = 0.016  # seconds: the longest a thread in wait_for sleeps between looks
NO_TARGET = (1 << 64) - 1  # a handle no record has: the waiter is woken for no completion
# what a thread in wait_for holds while it settles a batch (SIGKILL/SIGSTOP excepted);
# _signal's call: signal.pthread_sigmask makes an enum of every signal in the old mask
_ALL_SIGNALS = frozenset(int(s) for s in signal.valid_signals()) - {signal.SIGKILL, signal.SIGSTOP}
_sigmask = _signal.pthread_sigmask


def _block_py() -> Any:
    return _sigmask(signal.SIG_BLOCK, _ALL_SIGNALS)


def _restore_py(old: Any) -> None:
    _sigmask(signal.SIG_SETMASK, old)


# native: two system calls, no conversion of a 62-signal set each way (about 3 µs a pair)
_block, _restore = _block_py, _restore_py
if os.environ.get("STEALER_NO_EXTENSIONS", "") in ("", "0"):
    try:
        from stealer._cqueues import block_signals as _block  # type: ignore[no-redef]
        from stealer._cqueues import restore_signals as _restore  # type: ignore[no-redef]
    except ImportError:  # not built: the reference queues warn about it (queues.py)
        pass


def _signals_due() -> None:
    """Run the Python handlers of signals that arrived before the mask went up.

    The mask stops new signals, not a handler already due: CPython runs it at the next
    check of its eval loop, which could be inside the batch (seen: a handler's exception
    between a pop and its settling broke the executor).  A Python call is such a check
    (3.11's RESUME), so a due handler runs, and raises if it does, here."""


class Settling:
    """Mixed into _Pool: popping and settling completions, and the waiter."""

    completions: list[Any]
    consume_lock: Any
    cb_owner: int
    cb_later: Any
    waiter_role: Any
    futures: dict[int, Any]
    backlog: Any
    requeue: Any
    ping_backlog: Any
    idle: Any
    n: int
    closed: bool
    forked: bool
    broken: str | None
    thread: threading.Thread | None

    def complete_batch(self, hs: list[int]) -> None:  # (_Pool's, or its native twin)
        raise NotImplementedError

    def wake(self) -> None:  # (_Pool's)
        raise NotImplementedError

    def has_completions(self) -> bool:  # (_Pool's)
        raise NotImplementedError

    def internal_error(self, exc: BaseException) -> None:  # (_Pool's)
        raise NotImplementedError

    def batch_target(self, f: Any) -> int:
        """The record whose completion wakes a thread waiting on ``f``, one of a
        ``call_all`` batch: the last one of the batch still pending.  A worker answers its
        calls in the order they came, so the batch's other replies come before it (or are
        announced when their worker runs out of work, or seen at the next poll): a client
        gathering a lockstep round is woken about once per worker, not once per reply."""
        futures = self.futures
        pending = _fbase.PENDING
        batch = f._st_batch
        fids, i = batch
        # from the cursor down: a settled future stays settled, so the batch is walked once
        # in all, however often its waiters park (a batch of 100,000 calls: not 100,000
        # lookups per park)
        while i >= 0:
            g = futures.get(fids[i])
            if g is not None and g._state == pending and g._st_handle is not None:
                batch[1] = i
                return g._st_handle
            i -= 1
        batch[1] = -1
        h = f._st_handle
        return -1 if h is None else h

    def consume(self, ring: Any, limit: int) -> int:
        """Pop up to ``limit`` completions from ``ring`` and settle them (the result thread
        and a thread in :meth:`wait_for`).  Popped and settled under ``consume_lock``; the
        done callbacks of the futures settled run after it is released, in the result
        thread (as before: a waiting thread never runs other futures' callbacks, which may
        need a lock it holds)."""
        with self.consume_lock:
            hs = ring.pop_many(limit)
            if not hs:
                return 0
            self.cb_owner = threading.get_ident()
            try:
                self.complete_batch(hs)
            finally:
                self.cb_owner = 0
        if self.cb_later:
            if threading.current_thread() is self.thread:
                self.run_callbacks()
            else:
                self.wake()  # the result thread runs them (_loop)
        return len(hs)

    def settle_rings(self, main: bool) -> int:
        """:meth:`wait_for`'s look at the rings: settle what they hold (up to 1024 per
        ring); how many, or -1 after an internal error (reported; the caller returns)."""
        if not self.has_completions():  # (no list made per look: this runs at every wake)
            return 0
        got = 0
        if main:  # one mask for all the rings (two system calls a look, not two a ring)
            old = _block()
            try:
                _signals_due()
            except BaseException:
                _restore(old)
                raise  # before the batch: nothing popped
        try:
            for ring in self.completions:
                if len(ring):
                    got += self.consume(ring, 1024)
        except BaseException as exc:  # as in the result thread: a bug, reported
            self.internal_error(exc)
            return -1
        finally:
            if main:
                _restore(old)
        if got and (self.backlog or self.requeue or self.ping_backlog):
            self.wake()  # records freed here: the result thread moves backlogs in
        return got

    def run_callbacks(self) -> None:
        """The done callbacks deferred while their futures were settled (:meth:`consume`)."""
        q = self.cb_later
        while q:
            try:
                f = q.popleft()
            except IndexError:  # another thread took the last one
                return
            f._invoke_callbacks()

    def wait_for(self, f: Any, timeout: float | None) -> float | None:
        """A client thread about to block on ``f`` (``result()``, ``exception()``): unless
        another thread already does, settle completions here until ``f`` is settled.

        The result thread would otherwise be woken for each completion and then wake this
        thread through the future's condition: two context switches per result, which on
        a machine with as many busy workers as cores cost the workers' CPU.  Here the
        thread parks on the waiter word (Idle.waiter_park) with the handle of ``f``'s
        record: the worker that completes that record wakes it; other completions wake
        nobody (they are announced when their worker idles, and this thread polls every
        ``BATCH_POLL`` to ``WAITER_POLL_MAX``), so a client that waits on one reply after
        another is woken about once per reply it waits for, and replies that came first
        are settled on the way.  A future of a ``call_all`` batch parks for the batch's
        last pending reply (:meth:`batch_target`), in throughput mode too, and polls only
        every ``WAITER_POLL_MAX``: a lockstep round wakes it about once per worker.
        Returns the time left of ``timeout`` (None: no limit);
        the caller then waits as the stdlib does, which returns at once if ``f`` is
        settled.  Done callbacks still run in the result thread (:meth:`consume`)."""
        if self.forked:  # (a pending future of the parent's: nothing here settles it)
            from stealer.errors import BrokenExecutor

            raise BrokenExecutor(self.broken)
        end = None if timeout is None else time.monotonic() + timeout
        if (self.closed or threading.current_thread() is self.thread
                or not self.waiter_role.acquire(blocking=False)):
            return timeout
        idle = self.idle
        pending = _fbase.PENDING
        enter, leave = BATCH_ENTER * self.n, BATCH_LEAVE * self.n
        batch = False
        # A call_all batch's waiter is woken by the batch's last reply (or a worker running
        # out of work: see batch_target), so it needs no early polls: each poll was a
        # wake, 3-4 per lockstep round, each on a CPU that a busy worker had to give up.
        base_poll = poll = WAITER_POLL_MAX if f._st_batch is not None else BATCH_POLL
        # In the main thread a signal handler (Ctrl-C's KeyboardInterrupt) could raise in
        # the middle of a batch it popped: completions lost. Signals are held while it
        # consumes and handled right after (two system calls per batch, main thread only).
        main = threading.current_thread() is threading.main_thread()
        idle.waiter_take()
        try:
            while f._state == pending and not self.closed:
                got = self.settle_rings(main)
                if got < 0:
                    return timeout
                if f._state != pending:
                    # One more pass before leaving: completions pushed meanwhile (the other
                    # worker's replies of a lockstep round) are settled here, not by a
                    # wake of the result thread that takes the GIL from this thread.
                    # One pass only: a steady stream never keeps the caller here.
                    if self.has_completions() and self.settle_rings(main) < 0:
                        return timeout
                    break
                if got:
                    poll = base_poll
                    continue
                left = poll
                if end is not None:
                    left = min(left, end - time.monotonic())
                    if left <= 0:
                        break
                # With many tasks or calls outstanding (the result thread's throughput mode,
                # ResultPolicy's thresholds) no completion wakes it: a batch is announced
                # once, when its worker idles (a client stepping 256 agents in lockstep
                # was woken for most of its replies, one by one); else its record's does.
                batch = len(self.futures) >= (leave if batch else enter)
                h = f._st_handle
                if f._st_batch is not None:  # (in throughput mode too: one wake a batch)
                    h = self.batch_target(f)
                elif batch:
                    h = NO_TARGET
                elif h is None:
                    h = -1  # no record known (an agent's final value): any completion
                if not idle.waiter_park(lambda: f._state != pending or self.has_completions(),
                                        left, h):
                    poll = min(2 * poll, WAITER_POLL_MAX)  # nothing came: look less often
        finally:
            idle.waiter_leave()
            self.waiter_role.release()
            if self.has_completions():
                self.wake()  # pushed after its last look by a worker that saw it awake
        return None if end is None else max(0.0, end - time.monotonic())
