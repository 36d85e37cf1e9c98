"""How a worker encodes a task's outcome for the client: (status, pickle, buffers) that
always pickle, whatever the task returned or raised.

Owns :func:`error_payload` (an exception with its formatted traceback), :func:`stand_in`
(for an exception that does not pickle) and :func:`encode_result` (never raises).  Called
by stealer/worker/loop.py's Worker (report, complete_root), by its fork-join mixin
(stealer/worker/join.py: a child's result that cannot be read), and through the Worker's
``encode_result`` / ``error_payload`` by the agents' host (stealer/worker/agents/) and
forkjoin.run_items.  Still importable from stealer.worker.loop.
"""

from __future__ import annotations

import pickle
import traceback
from types import CoroutineType
from typing import Any

from stealer.errors import RemoteError, SerializationError
from stealer.shared import serialize
from stealer.shared._layout import ST_ERROR, ST_OK

__all__ = ["error_payload", "stand_in", "encode_result"]


def error_payload(exc: BaseException) -> tuple:
    """(exception, formatted traceback) of a task that raised.

    A :class:`~stealer.shared.serialize.ErrorPayload`: it pickles (and unpickles)
    whatever the exception, so the client always gets the traceback.
    """
    try:
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    except BaseException:
        tb = f"{type(exc).__qualname__} (the traceback could not be formatted)\n"
    return serialize.ErrorPayload(exc, tb)


def _describe(exc: BaseException) -> str:
    text = serialize.safe_str(exc)
    return f"{type(exc).__qualname__}: {text}" if text else type(exc).__qualname__


def stand_in(payload: tuple) -> tuple:
    """An error payload whose exception did not pickle: a RemoteError with its type and text."""
    exc, tb = payload
    return RemoteError(f"{_describe(exc)} (the original exception could not be pickled)"), tb


def encode_result(status: int, value: Any, fast: bool = True) -> tuple[int, bytes, list]:
    """(status, pickle, buffers) of a task's outcome; never raises.

    A result that does not pickle becomes a SerializationError; an exception
    that does not pickle becomes a RemoteError with its text; anything raised
    meanwhile (even SystemExit from a ``__reduce__``) is caught the same way.
    """
    try:
        if status != ST_OK:
            value = error_payload(value)
        data, bufs = serialize.dumps(value, "task result", fast)
        return status, data, bufs
    except BaseException as exc:
        try:
            if status != ST_OK:
                payload = stand_in(value)
            else:
                err = exc if isinstance(exc, SerializationError) else SerializationError(
                    f"could not pickle the task result ({_describe(exc)})")
                if type(value) is CoroutineType:  # (the error path only)
                    value.close()  # (never awaited: no RuntimeWarning)
                    err = SerializationError(
                        f"the task returned a coroutine ({value.__qualname__} is `async def`): "
                        "a task is a plain function or a generator; run the coroutine in "
                        "one, e.g. submit `def job(x): return asyncio.run(fn(x))`. (Agents' "
                        "handlers and steps may be `async def`: they await ref.call(), "
                        "stealer.call_all(), ctx.run_blocking() and stealer.spawn().)")
                payload = error_payload(err)
            data, bufs = serialize.dumps(payload)
            return ST_ERROR, data, bufs
        except BaseException:
            data = pickle.dumps((RemoteError("the task's outcome could not be pickled"), ""))
            return ST_ERROR, data, []
