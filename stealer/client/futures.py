"""Futures of stealer tasks: ``concurrent.futures.Future`` objects that are cheap to create.

See :class:`_Future`.  The pool (stealer/client/pool.py) resolves them from its result
thread; the facade (stealer/client/executor.py) creates them in ``submit``.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from concurrent.futures import _base as _fbase
from typing import Any

from stealer.futures import AwaitableFuture, notify_cancelled
from stealer.shared._layout import S_RUNNING
from stealer.shared.records import Outcome

__all__ = ["_Future"]


class _NoLock:
    """The condition of a future that was settled before anybody asked for one.

    Entering it excludes nothing and notifying it wakes nobody: the future's
    state can no longer change, and every reader checks the state before it
    would wait (``_waiters`` appends and removes are atomic under the GIL).
    """

    def __enter__(self) -> bool:
        return True

    def __exit__(self, *exc: Any) -> None:
        return None

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        return True

    def release(self) -> None:
        return None

    def wait(self, timeout: float | None = None) -> bool:
        return True

    def notify(self, n: int = 1) -> None:
        return None

    def notify_all(self) -> None:
        return None


_SETTLED = _NoLock()


class _NoWaiters:
    """The waiter list of a future settled before anybody waited on it (see
    ``_Future._waiters``): ``wait`` and ``as_completed`` append a waiter to every future
    and remove it again, 20,000 futures 40,000 list operations; here both do nothing (a
    builtin taking one argument: no Python frame), and there is no list per future."""

    __slots__ = ()
    append = remove = staticmethod(id)

    def __iter__(self) -> Any:
        return iter(())

    def __len__(self) -> int:
        return 0


_NO_WAITERS = _NoWaiters()
_MAKE_LOCK = threading.Lock()  # makes a future's condition or list once (rare: a waiter)
# Hands a future's done callbacks over to whoever calls them, each exactly once: the
# resolver takes the whole list; an adder that finds the future settled right after its
# append takes its own back (held for a list copy or one remove, never around user code).
_CB_LOCK = threading.Lock()
_SETTLED_STATES = frozenset((_fbase.CANCELLED, _fbase.CANCELLED_AND_NOTIFIED, _fbase.FINISHED))


class _Future(AwaitableFuture):
    """A Future that withdraws its queued task on cancel() and is cheap to create.

    ``concurrent.futures.Future`` builds a ``threading.Condition`` per future
    (most of the cost of creating one) and takes it on every transition.
    Here the condition is created on first use (``_condition`` is a
    property), and the result thread resolves a future that nobody waits on
    yet without any lock:

    * resolver: store the result, publish ``_state = FINISHED``, *then* look
      for a condition; if one exists, take it, notify waiters and wake
      sleepers, as the stdlib does;
    * anyone who blocks (``result``, ``wait``, ``as_completed``,
      ``add_done_callback``, ``cancel``) first creates the condition, then
      reads ``_state`` under it.

    Under the GIL these steps are sequentially consistent, so either the
    reader sees FINISHED or the resolver sees the condition (a Dekker
    handshake): nothing is missed.  A future that is already settled when
    someone first asks for its condition gets :data:`_SETTLED`, a condition
    that locks nothing: a settled future never changes again and is never
    notified, so there is nothing to exclude (``wait`` and ``as_completed``
    over many finished futures then create nothing).  It must not be a real
    lock shared by several futures: ``wait`` and ``as_completed`` lock their
    futures in ``id()`` order, and a shared lock breaks that order (two
    threads waiting on overlapping sets deadlock).

    ``cancel()`` withdraws a queued task at once, so it also notifies at
    once: the future goes straight to CANCELLED_AND_NOTIFIED (the stdlib's
    executors get there later, when a worker would have run it), and
    ``wait``/``as_completed`` count it as done.  Every other method is the
    stdlib's.
    """

    _result: Any = None
    _exception: BaseException | None = None
    _st_handle: int | None = None
    _st_backlog = False  # waiting in the client-side backlog (no record yet)
    _st_keep = False  # a journaled agent call: it runs once sent, so cancel() says False
    _st_cond: threading.Condition | None = None  # made by the first waiter (_condition)
    _st_w: list[Any] | None = None  # _waiters, made on first use
    _st_cb: list[Any] | None = None  # _done_callbacks, made on first use

    def __reduce__(self) -> Any:
        # (pickling one reached the executor's shared memory: "cannot pickle 'mmap.mmap'")
        raise TypeError(
            "a stealer Future cannot be sent to a task or an agent (it belongs to the "
            "client): pass its result (f.result()), submit the next step when it is done "
            "(f.add_done_callback), or spawn children with stealer.spawn inside one task")

    def __init__(self, pool: Any, fid: int, fn: Any) -> None:  # pool: client.pool._Pool
        # Future.__init__ without the Condition and the two lists (made on first use): a
        # future nobody waits on is one GC-tracked object, not four (its attributes stay
        # inline: nothing here reads self.__dict__, which would make it a dict).
        # Every attribute a future may ever get is set here, always in this order: the
        # instances then share one key layout and keep their values inline (CPython makes a
        # per-object dict, a second GC-tracked object, for one that adds keys in another
        # order: results before handles, a waiter's condition first...).
        self._state = _fbase.PENDING
        self._st_pool = pool
        self._st_fid = fid
        self._st_fn = fn  # for messages only (see _st_name)
        self._st_handle = None
        self._st_batch = None  # call_all's: [the batch's ids, a cursor] (client/waiting.py)
        self._st_backlog = False
        self._result = None
        self._exception = None
        self._st_cond = None
        self._st_w = None
        self._st_cb = None

    def _st_list(self, slot: str) -> list[Any]:
        """The list in ``slot``, made on first use (once, whoever asks first)."""
        lst = getattr(self, slot)
        if lst is None:
            with _MAKE_LOCK:
                lst = getattr(self, slot)
                if lst is None:
                    lst = []
                    setattr(self, slot, lst)
        return lst

    @property
    def _waiters(self) -> list[Any]:  # type: ignore[override]
        w = self._st_w
        if w is not None:
            return w
        if self._st_cond is None and self._state in _SETTLED_STATES:
            # Settled with no condition ever made: whoever installs a waiter here (wait,
            # as_completed) took _SETTLED and will read the state as settled, so it counts
            # this future done and expects no notification; none will come.  With a
            # condition made, a resolver may be between its publish and its notify (see
            # _st_resolve): that case gets the real list.
            return _NO_WAITERS  # type: ignore[return-value]
        return self._st_list("_st_w")

    @property
    def _done_callbacks(self) -> list[Any]:  # type: ignore[override]
        return self._st_cb if self._st_cb is not None else self._st_list("_st_cb")

    @property
    def _st_name(self) -> str:
        fn = self._st_fn
        return getattr(fn, "__qualname__", None) or repr(fn)

    @property
    def _condition(self) -> threading.Condition:  # type: ignore[override]
        cond = self._st_cond
        if cond is None:
            if self._state in _SETTLED_STATES:
                return _SETTLED  # type: ignore[return-value]
            # Somebody is about to wait on it: settle first what is finished already
            # (_Pool.help); this one may be among them, and then needs no condition.
            pool = self._st_pool
            if pool is not None:
                pool.help()
                if self._state in _SETTLED_STATES:
                    return _SETTLED  # type: ignore[return-value]
            with _MAKE_LOCK:  # one condition per future, whoever asks first
                cond = self._st_cond
                if cond is None:
                    cond = self._st_cond = threading.Condition()
        return cond

    def _st_resolve(self, result: Any, exc: BaseException | None) -> None:
        """Result thread: set the outcome (raises InvalidStateError if already set)."""
        if self._st_cond is not None:  # somebody is (or was) waiting: the stdlib's locked path
            if exc is None:
                Future.set_result(self, result)
            else:
                Future.set_exception(self, exc)
            return
        if self._state != _fbase.PENDING:
            raise _fbase.InvalidStateError(f"{self._state}: {self!r}")
        self._result = result
        if exc is not None:
            self._exception = exc
        self._state = _fbase.FINISHED  # publish first ...
        cond = self._st_cond  # ... then look for a waiter that came meanwhile
        if cond is not None:
            with cond:
                for waiter in self._st_w or ():
                    if exc is None:
                        waiter.add_result(self)
                    else:
                        waiter.add_exception(self)
                cond.notify_all()
        if self._st_cb:
            self._invoke_callbacks()

    def add_done_callback(self, fn: Any) -> None:
        """As the stdlib's, without making the future's condition (a lock, a deque and a
        Condition, GC-tracked, per future: ``asyncio.wrap_future`` and most callers of
        this method never wait on it otherwise).

        Append, then read the state; the resolver publishes the state, then reads the
        list (:meth:`_st_resolve`): under the GIL one of the two sees the other.  If
        the future settled in between, both may have seen ``fn``: whichever takes it out
        of the list under ``_CB_LOCK`` calls it."""
        if self._state not in _SETTLED_STATES:
            cbs = self._done_callbacks
            cbs.append(fn)
            if self._state not in _SETTLED_STATES:
                return
            with _CB_LOCK:
                for i, cb in enumerate(cbs):
                    if cb is fn:
                        del cbs[i]
                        break
                else:
                    return  # the resolver took it: it calls it
        self._st_call(fn)

    def _invoke_callbacks(self) -> None:
        cbs = self._st_cb
        if not cbs:
            return
        pool = self._st_pool
        if pool is not None and pool.cb_owner == threading.get_ident():
            pool.cb_later.append(self)  # settled under the pool's consume lock: run after it
            return
        with _CB_LOCK:
            todo = cbs[:]
            cbs.clear()
        for cb in todo:
            self._st_call(cb)

    def _st_call(self, fn: Any) -> None:
        """Call one done callback as the stdlib does (its exception is logged)."""
        try:
            fn(self)
        except Exception:
            _fbase.LOGGER.exception("exception calling callback for %r", self)

    def result(self, timeout: float | None = None) -> Any:
        if self._state == _fbase.FINISHED and self._exception is None:
            return self._result  # fast path: no lock needed once finished
        pool = self._st_pool
        if pool is not None and self._state == _fbase.PENDING:
            timeout = pool.wait_for(self, timeout)  # settles completions while it waits
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        pool = self._st_pool
        if pool is not None and self._state == _fbase.PENDING:
            timeout = pool.wait_for(self, timeout)
        return super().exception(timeout)

    def done(self) -> bool:
        return self._state in (_fbase.CANCELLED, _fbase.CANCELLED_AND_NOTIFIED, _fbase.FINISHED)

    def cancel(self) -> bool:
        cond = self._condition
        with cond:
            state = self._state
            if state in (_fbase.CANCELLED, _fbase.CANCELLED_AND_NOTIFIED):
                return True
            if state != _fbase.PENDING:
                return False
            pool = self._st_pool
            h = self._st_handle
            if pool is not None and pool.forked:
                return False  # (a fork's copy: the task is its parent's)
            if self._st_keep:
                return False
            # In the client-side backlog: withdrawn here (drain_backlog skips it). Else a
            # generation-checked CAS on the record's state, pairs with the worker's start CAS.
            if h is None:
                if not self._st_backlog:
                    return False  # submit() is publishing it right now (another thread)
            elif pool.arena.tr.cancel(h) is not Outcome.OK:
                return False  # a worker started it, or it is already done
            pool.futures.pop(self._st_fid, None)
            # Nobody will run it, so nobody else would call set_running_or_notify_cancel():
            # do its part here, under the same lock as the cancel.
            notify_cancelled(self)
        if pool is not None:
            pool.idle.poke_waiter()  # a thread in wait_for may wait on this one
        self._invoke_callbacks()  # outside the lock, as the stdlib does
        return True

    def running(self) -> bool:
        with self._condition:
            if self._state == _fbase.PENDING and self._st_handle is not None:
                pool = self._st_pool
                h = self._st_handle
                st = pool.arena.tr.state(h)  # (state, holder) if h is still current
                return st is not None and st[0] == S_RUNNING
            return super().running()
