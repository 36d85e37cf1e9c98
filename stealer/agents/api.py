"""What agent authors write and hold: Agent, the step context, step outcomes, refs.

::

    class Walker(stealer.Agent):
        def __init__(self, seed): ...          # runs on a worker; state = the attributes
        def step(self, ctx): ...               # optional: self-driven agents step until done
        def observe(self, k): return ...       # any public method is a message handler

    class CartPole(stealer.Agent):
        self_driven = False                    # its step(action) is a message handler
        def step(self, action): return ...

    ref = ex.spawn_agent(Walker, 7, tier="interactive", mailbox=64)
    ref.call("observe", 3).result()            # request/reply: a concurrent.futures.Future
    ref.send("observe", 3)                     # one-way; blocks while the mailbox is full
    ref.stop(); ref.result(timeout)            # stop at the next step boundary; final value

``step(ctx)`` returns what happens next: ``None`` (step again, after the
other runnable agents of its tier had their turn), ``ctx.sleep(s)``,
``ctx.wait()`` (until a message), ``ctx.done(value)``; raising fails the
agent (its ``restart`` policy decides).  Messages are handled between
steps, never during one.  A step or handler may be a generator: it
``yield``\\ s what it waits for (``ref.call(...)`` made inside an agent,
``ctx.run_blocking(fn, ...)``, children from :func:`stealer.spawn`) and is
resumed with the value, as fork-join tasks are; the worker runs other
agents meanwhile.  An ``async def`` step or handler ``await``\\ s the same things
(it runs on the worker, not in an asyncio event loop).
"""

from __future__ import annotations

import time
from types import CoroutineType
from typing import Any

from stealer.errors import AgentError, NotInTaskError

__all__ = ["Agent", "AgentRef", "Ctx", "TIERS", "Sleep", "Wait", "Done", "Pending", "PendingAll",
           "call_all", "drives_itself", "gather", "stop_value"]

TIERS = {"control": 0, "interactive": 1, "bulk": 2}
TIER_NAMES = {v: k for k, v in TIERS.items()}
_clients: dict[str, Any] = {}  # segment name -> weakref of its AgentClient (client.py)


class Agent:
    """Base class of agents: subclass it; its attributes are its state.

    The state is pickled only when the agent moves to another worker or is
    checkpointed (numpy arrays travel out-of-band).  Public methods (names
    not starting with ``_``, other than ``step`` and ``on_stop``) are
    message handlers.  ``on_stop(self)``, if defined, gives the final value
    of an agent stopped by ``ref.stop()``.

    ``step(self, ctx)``, if defined, makes the agent *self-driven*: the worker
    calls it again and again while the agent runs.  A class whose ``step`` is
    a message handler instead (a gymnasium-style environment, ``step(action)``
    called by its client) says ``self_driven = False``: its ``step`` is then
    called only by messages, like any other handler.
    """

    #: None or True: a ``step`` method is the agent's own step (the worker calls
    #: ``step(ctx)``); False: ``step`` is an ordinary message handler.
    self_driven: bool | None = None


def drives_itself(agent: Any) -> bool:
    """Whether an agent (its class or an instance) is self-driven: it has a ``step`` and
    its class does not say ``self_driven = False``.  The worker's checks (and their native
    twins in ``native/_cqueues.pyx``, ``_drives``) follow this rule."""
    cls = agent if isinstance(agent, type) else type(agent)
    return getattr(cls, "self_driven", None) is not False and hasattr(agent, "step")


def stop_value(agent: Any) -> Any:
    """The final value of a stopped agent: its ``on_stop()`` (None without one).  An
    ``async def on_stop`` is run here to its end: it may not wait for anything (a stop
    gives its value at once), so one that awaits raises a TypeError that says so."""
    fn = getattr(agent, "on_stop", None)
    if fn is None:
        return None
    value = fn()
    if type(value) is CoroutineType:
        try:
            value.send(None)
        except StopIteration as done:
            return done.value
        value.close()
        raise TypeError(f"{type(agent).__qualname__}.on_stop is `async def` and awaited "
                        "something: it gives a stopped agent's final value at once and "
                        "cannot wait; do the waiting in a handler before ref.stop()")
    return value


class Sleep:
    __slots__ = ("until",)

    def __init__(self, until: float) -> None:
        self.until = until


class Wait:
    __slots__ = ()


class Done:
    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


_WAIT = Wait()


_NOT_A_FUTURE = (
    "inside an agent, ref.call(), stealer.call_all() and ctx.run_blocking() return a pending "
    "result, not a Future: get the value with `value = yield ref.call(...)` in a generator "
    "handler or step, or `value = await ref.call(...)` in an `async def` one (the worker runs "
    "other agents meanwhile). A handler cannot block on it: its worker may be the one that "
    "has to run the agent whose reply it waits for")


class Pending:
    """Something an agent waits for by ``yield`` (or ``await``): a reply, a blocking call.

    Not a Future: ``result()``, ``done()`` and the rest of the Future API raise an
    :class:`~stealer.AgentError` that says to ``yield`` it (a handler that blocked on a
    reply could wait for an agent that only its own worker can run)."""

    __slots__ = ("arrived", "exc", "value")

    def __init__(self) -> None:
        self.arrived = False  # the value (or exc) is in, or (CallPending) read from its slot
        self.value: Any = None
        self.exc: BaseException | None = None

    def __await__(self) -> Any:
        """``await`` it in an ``async def`` handler or step: the same as ``yield``."""
        return (yield self)

    def _not_a_future(self, *args: Any, **kwargs: Any) -> Any:
        raise AgentError(_NOT_A_FUTURE)

    result = exception = done = cancel = add_done_callback = _not_a_future


class PendingAll(Pending):
    """Several things an agent waits for at once (:func:`call_all`, or a list of
    ``ref.call`` results yielded together): resumed with the list of their values, in
    order, once all are there; if any failed, the first failure (in order) is raised at
    the ``yield``, after every reply has arrived (none is left behind)."""

    __slots__ = ("next", "parts")

    def __init__(self, parts: list) -> None:
        super().__init__()
        self.parts = parts
        self.next = 0  # parts before this one are known to be there (the host's ready())


class _Kids(list):
    """Children of :func:`stealer.spawn` gathered (:func:`gather`): a list, as a generator
    yields them, that an ``async def`` handler or step can await."""

    __slots__ = ()

    def __await__(self) -> Any:
        return (yield list(self))


def gather(*pending: Any) -> Any:
    """Inside an agent: several pending results as one, to ``await`` in an ``async def``
    handler or step (or ``yield``), resumed with the list of their values in order.

    Either what ``ref.call``, ``stealer.call_all`` and ``ctx.run_blocking`` return (the
    first failure, in order, is raised once every one has arrived), or children of
    :func:`stealer.spawn`, not both.  It is what ``yield [p1, p2]`` does in a generator:
    ``asyncio.gather`` cannot do it, since an agent's coroutine runs on its worker, not in
    an event loop.  One list or tuple argument is taken as the items."""
    from stealer.forkjoin import Child

    items = list(pending[0]) if len(pending) == 1 and isinstance(pending[0], (list, tuple)) \
        else list(pending)
    if all(isinstance(p, Pending) for p in items):
        return PendingAll(items)
    if all(isinstance(c, Child) for c in items):
        return _Kids(items)
    bad = next((p for p in items if not isinstance(p, (Pending, Child))), None)
    if bad is None:
        raise TypeError("stealer.gather() takes pending replies or children of "
                        "stealer.spawn(), not both: await them in two gathers")
    raise TypeError("stealer.gather() takes what ref.call(), stealer.call_all() and "
                    "ctx.run_blocking() return inside an agent, or children of "
                    f"stealer.spawn(), not {type(bad).__name__}")


def call_all(refs: Any, method: str, args: Any = None, seg: str | None = None) -> Any:
    """Call ``method`` on every agent of ``refs`` at once, the i-th with the i-th tuple
    of positional arguments in ``args`` (``None``: no arguments for any).

    From the client: a list of Futures, in the order of ``refs`` (one Python call for
    the batch; each agent's worker is woken once).  From inside an agent: ``yield`` it
    to get the list of replies (see :class:`PendingAll`).  A full mailbox blocks, as
    ``ref.call`` does, until it has room (backpressure: nothing is dropped); a stopped
    agent's future fails with AgentStopped and the others resolve.  Every ref must
    belong to the same executor (``seg``: the one that executor's ``call_all`` names).
    Every check is made before anything is sent, in one pass over ``refs``.
    """
    refs = refs if type(refs) is list else list(refs)
    if args is None:
        arglists = [()] * len(refs)
    else:
        arglists = []
        for a in args:
            if not isinstance(a, (tuple, list)):
                raise TypeError(f"call_all() takes one tuple of positional arguments per agent "
                                f"(e.g. [(x,) for x in xs]), not {type(a).__name__}")
            arglists.append(a if type(a) is tuple else tuple(a))
        if len(arglists) != len(refs):
            raise ValueError(f"call_all() got {len(refs)} agents but {len(arglists)} "
                             "argument tuples")
    if not isinstance(method, str) or not method or method.startswith("_"):
        raise ValueError(f"a message names a public method of the agent, not {method!r}")
    if not refs:
        return []
    first = refs[0]
    if not isinstance(first, AgentRef):
        return _each(refs, method, arglists)
    want = first._seg if seg is None else seg
    now = time.monotonic()
    targets = []
    add = targets.append
    for r in refs:
        if type(r) is not AgentRef and not isinstance(r, AgentRef):
            return _each(refs, method, arglists)
        if r._seg != want:
            raise ValueError(f"call_all(): {r!r} belongs to another executor" if seg is not None
                             else "call_all(): every agent must belong to the same executor")
        dl = r._deadline
        add((r._h, r._uid, None if dl is None else now + dl))
    return first._runtime().call_all(targets, method, arglists)


def _each(refs: list, method: str, arglists: list[tuple]) -> list:
    """call_all over refs that are not all this process's AgentRefs (a cluster executor's:
    stealer/cluster/asks.py): one call each, the list of their futures (inside an agent,
    one :class:`PendingAll` of their pending replies, to yield or await)."""
    for r in refs:
        if not callable(getattr(r, "call", None)):
            raise TypeError(f"call_all() takes agent refs, not {type(r).__name__}")
    out = [r.call(method, *a) for r, a in zip(refs, arglists)]
    if all(isinstance(p, Pending) for p in out):  # inside an agent: one awaitable for all
        return PendingAll(out)
    return out


class Ctx:
    """The context a step or handler gets: what to do next, and the agent's services."""

    __slots__ = ("_e", "_host")

    def __init__(self, host: Any, entry: Any) -> None:
        self._host = host
        self._e = entry

    @property
    def agent_id(self) -> int:
        return self._e.h

    @property
    def generation(self) -> int:
        """How many times this agent was restarted (by its supervisor or a worker death)."""
        return self._e.gen

    @property
    def self_ref(self) -> AgentRef:
        return AgentRef(self._e.h, self._host.name, self._host, self._e.uid)

    @property
    def uid(self) -> str | None:
        """The agent's durable id in the executor's journal (None without a journal)."""
        return self._e.uid

    @property
    def tier(self) -> str:
        return TIER_NAMES[self._e.tier]

    def sleep(self, seconds: float) -> Sleep:
        """Step again after ``seconds`` (messages still wake it to be handled)."""
        return Sleep(time.monotonic() + max(0.0, float(seconds)))

    def wait(self) -> Wait:
        """Step again once a message has been handled."""
        return _WAIT

    def done(self, value: Any = None) -> Done:
        """Finish: ``value`` becomes ``ref.result()``."""
        return Done(value)

    def spawn_agent(self, cls: type, /, *args: Any, **options: Any) -> AgentRef:
        """Spawn another agent (same options as ``Executor.spawn_agent``)."""
        return self._host.spawn_agent(cls, args, options)

    def run_blocking(self, fn: Any, /, *args: Any, **kwargs: Any) -> Pending:
        """Run a blocking call on the worker's small thread pool; ``yield`` the result.

        The worker runs other agents meanwhile; the agent resumes with the
        call's return value (or its exception raised at the ``yield``).
        """
        return self._host.run_blocking(fn, args, kwargs)


def _runtime(seg: str) -> Any:
    from stealer import forkjoin

    w = forkjoin._current
    if w is not None and getattr(w, "name", None) == seg:
        return w.host
    ref = _clients.get(seg)
    rt = ref() if ref is not None else None
    if rt is None:
        raise NotInTaskError(
            "this agent ref belongs to an executor that is not running here (it was shut "
            "down, or the ref was sent to another process that does not host it: a task "
            "of another executor, such as the joblib backend's own, cannot call it)")
    return rt


_remap: list[Any] = []  # callables uid -> (segment, handle) | None: journaled runtimes here


def _rebuild(h: int, seg: str, deadline: float | None, uid: str | None = None) -> AgentRef:
    if uid is not None and seg not in _clients and not _hosts(seg):
        # a ref from an executor that is gone (pickled in a journal snapshot): the agent
        # it names lives on under the executor that recovered it
        for find in _remap:
            got = find(uid)
            if got is not None:
                seg, h = got
                break
    ref = AgentRef(h, seg, None, uid)
    ref._deadline = deadline
    return ref


def _hosts(seg: str) -> bool:
    from stealer import forkjoin

    w = forkjoin._current
    return w is not None and getattr(w, "name", None) == seg


class AgentRef:
    """A handle on an agent: send it messages, call it, stop it, get its result.

    Refs pickle: pass them to other agents and tasks of the same executor.
    Inside an agent, ``ref.call`` returns something to ``yield`` (the
    caller is resumed with the reply); in the client it returns a
    ``concurrent.futures.Future``; in a task, a child to ``result()`` or ``yield``.
    """

    __slots__ = ("_deadline", "_h", "_rt", "_seg", "_uid")

    def __init__(self, h: int, seg: str, rt: Any, uid: str | None = None) -> None:
        self._h = h
        self._seg = seg
        self._rt = rt
        self._uid = uid  # durable id (journaled executors): refs survive a recovery
        self._deadline: float | None = None

    def __reduce__(self) -> tuple:
        if self._uid is None:
            return (_rebuild, (self._h, self._seg, self._deadline))
        return (_rebuild, (self._h, self._seg, self._deadline, self._uid))

    def __repr__(self) -> str:
        return f"<stealer.AgentRef {self._h:#x}>"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, AgentRef) and (other._h, other._seg) == (self._h, self._seg)

    def __hash__(self) -> int:
        return hash((self._h, self._seg))

    @property
    def id(self) -> int:
        """The agent id (unique among the live agents of its executor)."""
        return self._h

    @property
    def uid(self) -> str | None:
        """The agent's durable id in the journal (None without a journal)."""
        return self._uid

    def _runtime(self) -> Any:
        rt = self._rt
        if rt is None:
            rt = self._rt = _runtime(self._seg)
        return rt

    def options(self, *, deadline: float | None = None) -> AgentRef:
        """A ref whose calls carry a deadline ``deadline`` seconds from each call: a call
        still in the mailbox then fails with DeadlineExceeded instead of running."""
        ref = AgentRef(self._h, self._seg, self._rt, self._uid)
        ref._deadline = deadline
        return ref

    def call(self, method: str, /, *args: Any, **kwargs: Any) -> Any:
        """Request/reply: run handler ``method`` and get its return value.

        From the client: a Future.  From inside an agent: ``yield`` the
        returned object; the agent is resumed with the reply.  From a task: a
        :class:`~stealer.forkjoin.TaskCall` child, to ``result()`` (the worker runs
        its agents while it waits) or ``yield`` in a generator task.  Inside an agent's
        generator, a call to itself or to an agent that waits for its reply (a cycle
        of calls, which would wait forever) raises AgentDeadlock, before sending.
        """
        dl = None if self._deadline is None else time.monotonic() + self._deadline
        return self._runtime().call(self._h, method, args, kwargs, dl, self._uid)

    def send(self, method: str, /, *args: Any, block: bool = True,
             timeout: float | None = None, **kwargs: Any) -> None:
        """One-way message.  A full mailbox blocks the client (up to ``timeout``) or,
        with ``block=False``, raises MailboxFull; from inside an agent, the send is
        queued and the sending agent waits (no step, no message) until it is delivered;
        from a plain task on a worker, it is queued and the task goes on."""
        self._runtime().send(self._h, method, args, kwargs, block, timeout, self._uid)

    def stop(self) -> None:
        """Stop the agent at its next step boundary; queued messages fail with AgentStopped."""
        self._runtime().stop(self._h)

    def result(self, timeout: float | None = None) -> Any:
        """The agent's final value (``ctx.done(value)``, or ``on_stop()`` after stop)."""
        return self._runtime().future(self._h, self._uid).result(timeout)

    @property
    def future(self) -> Any:
        """The Future of the agent's final value (client only; works with asyncio)."""
        return self._runtime().future(self._h, self._uid)
