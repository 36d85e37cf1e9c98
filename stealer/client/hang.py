"""Frozen workers: alive, holding work, making no progress (``Executor(hang_timeout=...)``).

A worker process stopped by SIGSTOP or a debugger, or a task stuck in C code that
never returns, keeps its process alive: its sentinel never fires, so the death path
(``_Pool.on_death`` -> ``recover``) never runs and its tasks wait forever, as in
ProcessPoolExecutor.  The client's result thread watches for that at its monitor
interval (``_Pool.check_hangs``, beside ``check_steps``) and, with ``hang_timeout``
set, kills such a worker with SIGKILL: the death path then re-runs its tasks under the
retry policy and starts a replacement.

*Progress* is read from words each worker already stores, so the hot path pays
nothing for it:

* ``W_CURRENT``: handle + 1 (generation included) of the task or agent step running
  on it, stored by the worker at every start and end (release, read here with an
  acquire load);
* its metrics counters (stealer/shared/metrics.py): flushed by their single writer at least
  every 2 ms while it finishes tasks or agent steps, and whenever it parks;
* the dequeue position of its inbox (a ring's second line, in both queue twins):
  moved by every ping it takes, even one that finds nothing to do.

A worker *holds work* while something runs on it (``W_CURRENT != 0``), or while it
is ready and pings or notifications wait in its inbox.  It is *frozen* for as long
as it holds work and none of these moved.  So a task
that legitimately runs longer than ``hang_timeout`` (a blocking join waiting for its
children included, and the import of its module by a worker's first call of a
function) counts as frozen: ``hang_timeout`` must exceed your longest task.
Unlike Dask, whose workers heartbeat from their event loop while tasks run on other
threads (``distributed.scheduler.worker-ttl``, 5 minutes by default: a worker silent
for that long is removed and its tasks rescheduled), and Ray, whose GCS health-checks
each node's raylet (``health_check_period_ms`` / ``health_check_timeout_ms`` /
``health_check_failure_threshold``) but kills no task stuck on a live node
(``ray.cancel(force=True)`` does that by hand), a worker here runs one task at a time
on its only thread: a task that never ends is the hang this catches.

:class:`Stalls` is the bookkeeping, shared with ``stealer top``, which keeps one over
its own snapshots (:meth:`Stalls.observe`) to show "frozen Ns" in the state column.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from stealer.shared.metrics import COUNTERS_BYTES
from stealer.shared.shm import LINE, W_CURRENT

if TYPE_CHECKING:
    from stealer.client.stats import WorkerStats

__all__ = ["HangWatch", "Stalls", "check_hang_timeout", "hang_message"]

SHOW_AFTER = 1.0  # seconds: stealer top shows a worker as frozen past this


def check_hang_timeout(value: Any) -> float | None:
    """``hang_timeout`` as given to the Executor: None (off) or seconds > 0."""
    if value is None:
        return None
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not math.isfinite(value) or value <= 0):
        raise ValueError(
            f"hang_timeout must be a number of seconds > 0 (longer than your longest task), "
            f"or None to never kill a frozen worker; not {value!r}")
    return float(value)


def hang_message(k: int, pid: int | None, frozen_s: float, timeout: float) -> str:
    """Why worker ``k`` died, for the tasks it held (their WorkerCrashedError)."""
    return (f"worker {k} (pid {pid}) was killed by stealer: it made no progress for "
            f"{frozen_s:.1f} s while holding work (hang_timeout={timeout:g} s): stopped "
            "(SIGSTOP, a debugger) or stuck in code that never returns; if the task was "
            "only slow, set hang_timeout above your longest task")


class Stalls:
    """Per worker: since when it has held work without progress."""

    __slots__ = ("_last", "_since")

    def __init__(self) -> None:
        self._since: dict[int, tuple[Any, float]] = {}  # worker -> (progress key, since)
        self._last: dict[int, float] = {}  # worker -> what the last look found

    def see(self, k: int, key: Any, holding: bool, now: float) -> float:
        """Record one look at worker ``k``; returns the seconds it has been frozen (0.0:
        it holds nothing, or its ``key`` changed since the last look)."""
        old = self._since.get(k)
        if not holding:
            self._since.pop(k, None)
            s = 0.0
        elif old is None or old[0] != key:
            self._since[k] = (key, now)
            s = 0.0
        else:
            s = now - old[1]
        self._last[k] = s
        return s

    def frozen(self, k: int) -> float:
        """Seconds worker ``k`` had been frozen at the last look (0.0: it was not)."""
        return self._last.get(k, 0.0)

    def observe(self, workers: list[WorkerStats], now: float) -> None:
        """Set ``frozen_s`` on each worker of a snapshot (``stealer top``'s own tracker:
        its snapshots are its looks, so it needs two frames to see anything)."""
        for w in workers:
            key = (w.pid, w.current, tuple(w.counters.values()))
            holding = bool(w.current) or (w.state == "ready" and w.inbox_depth > 0)
            w.frozen_s = self.see(w.index, key, holding, now)


class HangWatch:
    """The client's look at its workers' progress (``_Pool.check_hangs``)."""

    __slots__ = ("layout", "mm", "region", "stalls", "timeout")

    def __init__(self, seg: Any, timeout: float | None) -> None:
        self.layout = seg.layout
        self.region = seg.region
        self.mm = seg.mm
        self.timeout = timeout  # None: look (for stats), never kill
        self.stalls = Stalls()

    def look(self, k: int, incarnation: int, ready: bool, inbox: Any, now: float) -> float:
        """Seconds worker ``k`` (this ``incarnation`` of it) has been frozen."""
        L = self.layout
        # acquire load: pairs with the worker's release store64 at each start and end
        cur = self.region.load64(L.worker(k) + W_CURRENT)
        mb = L.metrics(k)
        # plain reads of words their single writer stores whole: a snapshot, never torn
        counters = bytes(self.mm[mb:mb + COUNTERS_BYTES])
        # acquire load of the inbox's dequeue position: pairs with its popper's CAS on it
        taken = self.region.load64(L.inbox(k) + LINE)
        holding = bool(cur) or (ready and len(inbox) > 0)
        return self.stalls.see(k, (incarnation, cur, counters, taken), holding, now)

    def frozen(self, k: int) -> float:
        return self.stalls.frozen(k)
