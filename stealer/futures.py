"""The Future that stealer's executors return: a ``concurrent.futures.Future`` that asyncio
code can also ``await``; and their ``with`` block's end (:class:`CancelOnInterrupt`).  A base module (no part of the core, no tool): the client side's
future (stealer/client/futures.py) and the cluster executor's (stealer/cluster/) both build
on it."""

from __future__ import annotations

from concurrent.futures import Future
from concurrent.futures import _base as _fbase
from typing import Any

__all__ = ["AwaitableFuture", "CancelOnInterrupt", "notify_cancelled"]


class AwaitableFuture(Future):
    """A ``concurrent.futures.Future`` that asyncio code can ``await`` directly, as Ray's
    object refs and Dask's futures: ``await ex.submit(f, x)``, ``await ref.call("m")``,
    ``asyncio.gather(*futures)``.  Awaiting wraps it with ``asyncio.wrap_future`` on the
    running loop, so cancelling the awaiting task cancels the future."""

    def __await__(self) -> Any:
        import asyncio

        return asyncio.wrap_future(self).__await__()


def notify_cancelled(fut: Future) -> None:
    """Settle ``fut`` as cancelled, with its ``_condition`` held by the caller, for an
    executor that withdrew its task where the stdlib's cancel() could not (a task in
    shared memory, or one its node holds): what cancel() and the executor's
    set_running_or_notify_cancel() would do together.  The caller then runs
    ``fut._invoke_callbacks()`` outside the lock, as the stdlib does."""
    fut._state = _fbase.CANCELLED_AND_NOTIFIED  # type: ignore[attr-defined]
    for waiter in fut._waiters:  # type: ignore[attr-defined]
        waiter.add_cancelled(fut)
    fut._condition.notify_all()  # type: ignore[attr-defined]


class CancelOnInterrupt:
    """``with executor:`` as the stdlib's (``shutdown(wait=True)`` at the end), except that
    an interruption leaving the block (Ctrl-C's KeyboardInterrupt, SystemExit, an asyncio
    task's cancellation: a BaseException that is not an Exception) also cancels the tasks
    not started yet.  With the stdlib's, Ctrl-C in ``with ProcessPoolExecutor()`` first
    runs every task still queued.  An error (an Exception) still lets them all run."""

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        interrupted = exc_type is not None and not issubclass(exc_type, Exception)
        self.shutdown(wait=True, cancel_futures=interrupted)  # type: ignore[attr-defined]
        return False

