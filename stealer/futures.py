"""The Future that stealer's executors return: a ``concurrent.futures.Future`` that asyncio
code can also ``await``.  A base module (no part of the core, no tool): the client side's
future (stealer/client/futures.py) and the cluster executor's (stealer/cluster/) both build
on it."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

__all__ = ["AwaitableFuture"]


class AwaitableFuture(Future):
    """A ``concurrent.futures.Future`` that asyncio code can ``await`` directly, as Ray's
    object refs and Dask's futures: ``await ex.submit(f, x)``, ``await ref.call("m")``,
    ``asyncio.gather(*futures)``.  Awaiting wraps it with ``asyncio.wrap_future`` on the
    running loop, so cancelling the awaiting task cancels the future."""

    def __await__(self) -> Any:
        import asyncio

        return asyncio.wrap_future(self).__await__()
