"""The Future that stealer's executors return: a ``concurrent.futures.Future`` that asyncio
code can also ``await``; and their ``with`` block's end (:class:`CancelOnInterrupt`).  A base module (no part of the core, no tool): the client side's
future (stealer/client/futures.py) and the cluster executor's (stealer/cluster/) both build
on it."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

__all__ = ["AwaitableFuture", "CancelOnInterrupt"]


class AwaitableFuture(Future):
    """A ``concurrent.futures.Future`` that asyncio code can ``await`` directly, as Ray's
    object refs and Dask's futures: ``await ex.submit(f, x)``, ``await ref.call("m")``,
    ``asyncio.gather(*futures)``.  Awaiting wraps it with ``asyncio.wrap_future`` on the
    running loop, so cancelling the awaiting task cancels the future."""

    def __await__(self) -> Any:
        import asyncio

        return asyncio.wrap_future(self).__await__()


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

