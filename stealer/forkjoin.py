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

A task that is a plain function may instead block: :func:`join` (or
``child.result()``) waits, and meanwhile its worker runs the waiting task's
own descendants (see Worker.join_blocking for why nothing else).  An
executor captured by one of its own tasks becomes a :class:`NestedExecutor`
there, whose ``submit``/``map`` spawn children the same way.

Outside a worker :func:`spawn` raises :class:`~stealer.errors.NotInTaskError`;
:func:`run_inline` runs a fork-join task sequentially in the calling process
(children are evaluated depth-first at the ``spawn`` call), which is the
one-process baseline and handy in unit tests of user code.

Called by users' tasks (re-exported as ``stealer.spawn``, ``stealer.join``,
``stealer.run_inline``); the running worker sets ``_current`` (stealer/worker/loop.py),
whose fork-join mixin (stealer/worker/join.py) does the work; stealer/client/executor.py
makes the NestedExecutor and runs ``map`` chunks through :func:`run_items`; the agents
(stealer/agents/api.py) and stealer.joblib read ``_current`` too.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from types import GeneratorType
from typing import Any

from stealer.errors import NotInTaskError

__all__ = ["Child", "ChildFuture", "NestedExecutor", "TaskCall", "join", "spawn", "run_inline",
           "run_chunk", "run_items"]


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

    def result(self, timeout: float | None = None) -> Any:
        """Its result (or its exception raised): a blocking :func:`join` of this child."""
        return join(self, timeout)

    def __await__(self) -> Any:
        """``await`` it in an ``async def`` agent handler or step: the same as ``yield``."""
        return (yield self)


class TaskCall(Child):
    """A call a task made to an agent (``ref.call`` inside a task): ``yield`` it (alone, or
    in a list with children) in a generator task, or ``result()`` / :func:`join` it in a
    plain one, for the agent's reply (its exception is raised there).  It is a child of
    the task as a spawned one is: the task's end waits for its reply too."""

    __slots__ = ()

    def __repr__(self) -> str:
        state = "answered" if self.done else "waiting"
        return f"<stealer.TaskCall {self.handle:#x} {state}>"


# Set by a worker process while it runs a task (stealer.worker.loop.Worker), or
# to _INLINE while run_inline() drives a task in this process.
_current: Any = None
_INLINE = object()
# Set in a worker by an integration's worker initializer (stealer/cluster/children.py's
# install, on a cluster node): ``spawn`` then goes through its ``spawn(worker, fn, args,
# kwargs)``, which may make a child another node can run.  None (the default): never.
_export: Any = None


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
    ex = _export
    if ex is not None:
        return ex.spawn(cur, fn, args, kwargs)
    return cur.spawn(fn, args, kwargs)


def join(children: Child | list[Child] | tuple[Child, ...], timeout: float | None = None
         ) -> Any:
    """Blocking join, for task bodies that are plain functions (not generators).

    Returns the child's result (or the list of results, for a list); a child's
    exception is raised here.  While it waits, the worker runs the waiting task's
    own descendants (its children not yet stolen, and theirs) and its agents' turns
    (which never block), never another task, while free workers steal the rest; so
    joins nest to any depth without deadlock or extra processes.  A :class:`TaskCall`
    (``ref.call`` in a task) is joined the same way.  ``timeout`` (seconds) raises
    TimeoutError; the children still finish (a task's end waits for all of its
    children).  A child (or an agent's turn) this worker runs itself while it waits
    is not interrupted: the timeout is seen between them.

    In a generator task, ``yield`` the children instead: the worker then runs other
    work while they are pending.  Agents must yield (a blocking join would hold
    their turn).
    """
    kids, single = children_of(children)
    if timeout is not None and (isinstance(timeout, bool)
                                or not isinstance(timeout, (int, float))):
        raise TypeError(
            f"stealer.join()'s second argument is a timeout in seconds, not a "
            f"{type(timeout).__name__}: join several children as a list, "
            "stealer.join([a, b])")
    cur = _current
    if cur is None:
        raise NotInTaskError(
            "stealer.join() joins children spawned by the running task: call it inside a "
            "task running on a stealer Executor (or under stealer.run_inline())")
    if all(c.done for c in kids):  # inline children, or joined before
        for c in kids:
            if c.exc is not None:
                raise c.exc
        return kids[0].value if single else [c.value for c in kids]
    if cur is _INLINE:
        raise RuntimeError("a child spawned on a worker cannot be joined inline")
    return cur.join_blocking(kids, single, timeout)


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


class ChildFuture:
    """What ``Executor.submit`` returns inside one of the executor's own tasks: a child of
    the running task (:func:`spawn`).  ``result()``/``exception()`` join it (a helping
    join, :func:`join`).  Not a ``concurrent.futures.Future``: ``wait`` and
    ``as_completed`` would block the worker without running the child; join in order
    (``result()``, or ``ex.map``) instead."""

    __slots__ = ("child",)

    def __init__(self, child: Child) -> None:
        self.child = child

    def result(self, timeout: float | None = None) -> Any:
        return join(self.child, timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        try:
            join(self.child, timeout)
        except BaseException:
            if not self.child.done:  # a timeout (or an interrupt) while it is pending
                raise
            return self.child.exc
        return None

    def done(self) -> bool:
        c = self.child
        return c.done or c.handle == -1 or _current.child_done(c)

    def running(self) -> bool:
        return not self.done()

    def cancelled(self) -> bool:
        return False

    def cancel(self) -> bool:
        return False  # a spawned child runs (the task's end waits for it)

    def __repr__(self) -> str:
        return f"<stealer.ChildFuture {'done' if self.done() else 'pending'}>"


class NestedExecutor:
    """An :class:`~stealer.Executor` as seen from inside one of its own tasks.

    A task that uses its executor (a closure over ``ex``, or ``ex`` passed as an
    argument) gets this in the worker: ``submit`` and ``map`` spawn children of the
    running task on the same workers (no new process, no deadlock at any depth), and
    their results are joined as :func:`join` does.
    """

    def __init__(self, name: str) -> None:
        self._name = name

    def __reduce__(self) -> tuple:
        return (NestedExecutor, (self._name,))

    def _check(self) -> None:
        w = _current
        if w is None or w is _INLINE or getattr(w, "name", None) != self._name:
            raise RuntimeError(
                "this stealer Executor was pickled and used outside its own workers: an "
                "executor travels into its own tasks only (to submit children there)")
        if w.cur is None or w.host.current is not None:
            raise RuntimeError(
                "inside an agent, spawn children with stealer.spawn() and yield them: "
                "ex.submit/ex.map would block the agent's turn")

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> ChildFuture:
        """``fn(*args, **kwargs)`` as a child of the running task."""
        self._check()
        return ChildFuture(spawn(fn, *args, **kwargs))

    def map(self, fn: Callable[..., Any], *iterables: Any, timeout: float | None = None,
            chunksize: int = 1, **_ignored: Any) -> Any:
        """Like ``Executor.map``: every input is spawned now (``chunksize`` inputs per
        child), the results come in order as they are joined."""
        self._check()
        if not isinstance(chunksize, int) or chunksize < 1:
            raise ValueError(f"chunksize must be a positive int, not {chunksize!r}")
        items = list(zip(*iterables))
        if chunksize == 1:
            kids = [spawn(fn, *args) for args in items]
        else:
            kids = [spawn(run_chunk, fn, items[i:i + chunksize])
                    for i in range(0, len(items), chunksize)]
        return _results(kids, chunksize > 1, timeout)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        raise RuntimeError("a task cannot shut down the executor it runs on")


def _results(kids: list[Child], chunked: bool, timeout: float | None) -> Any:
    end = None if timeout is None else time.monotonic() + timeout
    for c in kids:
        left = None if end is None else max(0.0, end - time.monotonic())
        if chunked:
            yield from join(c, left)
        else:
            yield join(c, left)


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
    from stealer.shared._layout import S_QUEUED

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
