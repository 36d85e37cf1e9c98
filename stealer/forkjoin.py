"""Fork-join inside tasks: :func:`spawn` children, join them by ``yield``.

A task that is a *generator function* may spawn children and join them::

    def fib(n):
        if n < 25:
            return fib_seq(n)
        a = stealer.spawn(fib, n - 1)
        b = stealer.spawn(fib, n - 2)
        x, y = yield [a, b]          # join: resumes when both are done
        return x + y

``spawn`` pushes the child on the bottom of the running worker's own deque
(the owner pops newest-first; idle workers steal the oldest, largest work
from the top).  ``yield child`` gives its result, ``yield [c1, c2]`` the list
of results; a child's exception is raised at the ``yield``.  A join is a
continuation, not a blocking wait: the parent is suspended, the worker runs
other work, and the parent resumes on its own worker once its last child
finishes (Cilk's "sync" semantics: a join waits for every child spawned so
far; results not yet yielded are kept until they are).  The generator
itself never leaves its worker (it cannot be pickled); children can.

Outside a worker :func:`spawn` raises :class:`~stealer.errors.NotInTaskError`;
:func:`run_inline` runs a fork-join task sequentially in the calling process
(children are evaluated depth-first at the ``spawn`` call), which is the
one-process baseline and handy in unit tests of user code.
"""

from __future__ import annotations

from collections.abc import Callable
from types import GeneratorType
from typing import Any

from stealer.errors import NotInTaskError

__all__ = ["Child", "spawn", "run_inline", "run_chunk", "run_items"]


class Child:
    """Handle of a spawned child task; ``yield`` it to get its result."""

    __slots__ = ("done", "exc", "handle", "value")

    def __init__(self, handle: int) -> None:
        self.handle = handle  # record handle, or -1 for a child evaluated inline
        self.done = False
        self.value: Any = None
        self.exc: BaseException | None = None

    def __repr__(self) -> str:
        state = "done" if self.done else "pending"
        return f"<stealer.Child {self.handle:#x} {state}>"


# Set by a worker process while it runs a task (stealer.worker.Worker), or
# to _INLINE while run_inline() drives a task in this process.
_current: Any = None
_INLINE = object()


def spawn(fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Child:
    """Spawn ``fn(*args, **kwargs)`` as a child of the running task.

    Must be called from inside a task running on a stealer worker (or under
    :func:`run_inline`).  Returns a :class:`Child`; ``yield`` it (or a list of
    them) from the task's generator to get the result.
    """
    cur = _current
    if cur is None:
        raise NotInTaskError(
            "stealer.spawn() can only be called from inside a task running on a stealer "
            "Executor (submit a generator function that spawns and yields its children), "
            "or under stealer.run_inline() to run it sequentially in this process"
        )
    if cur is _INLINE:
        return inline_child(fn, args, kwargs)
    return cur.spawn(fn, args, kwargs)


def inline_child(fn: Callable[..., Any], args: tuple, kwargs: dict) -> Child:
    """Evaluate a child right away in this process (depth-first)."""
    c = Child(-1)
    global _current
    saved, _current = _current, _INLINE
    try:
        c.value = drive_inline(fn(*args, **kwargs))
    except BaseException as exc:  # delivered at the parent's yield, like a remote child
        c.exc = exc
    finally:
        _current = saved
    c.done = True
    return c


def children_of(y: Any) -> tuple[list[Child], bool]:
    """Validate what a task generator yielded: a Child, or a list/tuple of them."""
    if isinstance(y, Child):
        return [y], True
    if isinstance(y, (list, tuple)) and all(isinstance(c, Child) for c in y):
        return list(y), False
    raise TypeError(
        f"a stealer task generator may only yield children returned by stealer.spawn() "
        f"(a Child, or a list or tuple of them), not {type(y).__name__}"
    )


def drive_inline(r: Any) -> Any:
    """Run a task's result to completion in this process when it is a generator."""
    if not isinstance(r, GeneratorType):
        return r
    send: Any = None
    exc: BaseException | None = None
    while True:
        try:
            y = r.throw(exc) if exc is not None else r.send(send)
        except StopIteration as stop:
            return stop.value
        exc = None
        try:
            kids, single = children_of(y)
        except TypeError as e:
            exc = e
            continue
        for c in kids:
            if c.handle != -1:
                exc = RuntimeError("a child spawned on a worker cannot be joined inline")
                break
            if c.exc is not None:
                exc = c.exc
                break
        if exc is None:
            send = kids[0].value if single else [c.value for c in kids]


def run_inline(fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """Run a (fork-join) task sequentially in this process and return its result."""
    global _current
    saved, _current = _current, _INLINE
    try:
        return drive_inline(fn(*args, **kwargs))
    finally:
        _current = saved


def run_chunk(fref: Any, chunk: list[tuple]) -> list:
    """Worker side of ``Executor.map(chunksize>1)``: fn over a chunk of argument tuples.

    It lives here, not in executor.py: a worker unpickling it must not import the client
    side (that cost ~50 ms at a worker's first chunk, 2 µs per task of a 20,000-task map).
    """
    fn = _current.fns.get(fref) if type(fref) is int else fref
    return [fn(*args) for args in chunk]


def run_items(fref: Any, token: int, chunk: list[tuple]) -> list:
    """Worker side of ``Executor.map`` with the automatic chunksize: every input of the
    chunk runs, each outcome apart ((0, value), (1, error payload)), so the map raises an
    input's exception at that input, after the results before it, as with one task per
    input.  Between inputs it reads the map's *token*, a record the client moves from
    QUEUED to CANCELLED (generation-checked) when the map is closed or times out: the
    inputs not started by then are not run ((2, None)), as queued tasks are withdrawn."""
    from stealer._layout import S_QUEUED

    w = _current
    tr = w.arena.tr
    fn = w.fns.get(fref) if type(fref) is int else fref
    out: list[tuple[int, Any]] = []
    for args in chunk:
        st = tr.state(token)  # acquire load of its state word: pairs with the client's cancel CAS
        if st is None or st[0] != S_QUEUED:
            out.append((2, None))  # the map was closed: not started, not run
            continue
        try:
            out.append((0, fn(*args)))
        except Exception as exc:
            out.append((1, w.error_payload(exc)))
    return out
