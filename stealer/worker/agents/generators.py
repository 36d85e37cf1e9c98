"""The Host's generators: steps and handlers that yield what they wait for.

:class:`Generators` is a mixin of :class:`stealer.worker.agents.host.Host`: ``Host.outcome``
and ``deliver`` (messages.py) start a generator with ``drive``; the turn and
``notify`` (adopt.py) ask ``ready`` and resume it (``resume``); ``finish``
(leaving.py) drops the replies it waited for (``drop_reply``).
"""

from __future__ import annotations

import time
from types import CoroutineType
from typing import Any

from stealer.agents.api import Pending, PendingAll
from stealer.errors import result_value, with_remote_tb
from stealer.forkjoin import children_of
from stealer.shared._layout import S_CANCELLED, S_DONE, S_QUEUED, ST_ERROR, ST_OK
from stealer.shared.records import Outcome
from stealer.worker.agents.entry import C_RESUMES, RUNNABLE, SUSPENDED, CallPending, _Entry


def _outside_asyncio(err: BaseException, why: str = "") -> None:
    """An ``async def`` handler or step that awaited asyncio itself ("no running event
    loop", or ``asyncio.sleep(0)``'s bare yield: ``why``): say where it runs and what it
    may await (a note: the error stays as it is)."""
    if (why or "event loop" in str(err)) and hasattr(err, "add_note"):
        err.add_note(
            (f"{why}. " if why else "")
            + "stealer runs an `async def` handler or step on its worker, not in an asyncio "
            "event loop: it may await ref.call(), stealer.call_all(), ctx.run_blocking() and "
            "stealer.spawn(); run asyncio code with asyncio.run() in a blocking call (a "
            "step's `await ctx.run_blocking(asyncio.run, fetch(url))`) or in a task")


class Generators:
    """Drive a suspended generator (a step or a handler), tell when what it waits for is
    there (a reply, several, a blocking call, fork-join children) and resume it.

    Owns no Host attribute: its state is each entry's (``it``, ``it_msg``, ``waiting``,
    ``frame``).  Relies on the Host's ``w`` and ``a``, and on ``schedule``
    (adopt.py), ``outcome`` (host.py), ``failed`` (leaving.py) and ``handled``,
    ``answered``, ``reply`` (messages.py).  A mixin: it runs inside steps and
    handlers, on the Host's state.
    """

    # -- generators ---------------------------------------------------------------------
    def drive(self, e: _Entry, send: Any, exc: BaseException | None) -> None:
        it = e.it
        w = self.w
        while True:
            w.in_body = True
            try:
                y = it.throw(exc) if exc is not None else it.send(send)
            except StopIteration as stop:
                w.in_body = False
                self.it_done(e, ST_OK, stop.value)
                return
            except BaseException as err:
                w.in_body = False
                if type(it) is CoroutineType and isinstance(err, RuntimeError):
                    _outside_asyncio(err)
                self.it_done(e, ST_ERROR, err)
                return
            w.in_body = False
            exc = None
            send = None
            if type(y) is list and y and all(isinstance(p, Pending) for p in y):
                y = PendingAll(y)  # several calls yielded together: resumed with every reply
            if isinstance(y, Pending):
                if y.arrived:
                    send, exc = self.collect_pending(y)
                    continue
                e.waiting = y
            else:
                try:
                    _kids, _single = children_of(y)
                except TypeError:
                    exc = TypeError(
                        "an agent may yield (or await) what ref.call(), stealer.call_all(), "
                        "ctx.run_blocking() or stealer.spawn() returned, not "
                        f"{type(y).__name__}")
                    if y is None and type(it) is CoroutineType:
                        _outside_asyncio(exc, "it awaited asyncio (asyncio.sleep(0)?); to let "
                                              "other agents run, return from the step")
                    continue
                e.waiting = y
                e.frame = w.frame
            e.state = SUSPENDED
            if self.ready(e):
                self.schedule(e)
            return

    def ready(self, e: _Entry) -> bool:
        y = e.waiting
        if isinstance(y, PendingAll):
            return self.all_ready(y)
        if isinstance(y, Pending):
            return self.part_ready(y)
        frame = e.frame
        return frame is None or self.w.kids_done(frame)

    def part_ready(self, y: Pending) -> bool:
        if isinstance(y, CallPending) and y.rh >= 0 and not y.arrived:
            st = self.a.tr.state(y.rh)
            return st is not None and st[0] == S_DONE
        return y.arrived

    def all_ready(self, y: PendingAll) -> bool:
        """Every part there?  Parts before ``y.next`` were seen there: a notification per
        reply looks at each part once, not at all of them each time."""
        parts = y.parts
        i = y.next
        while i < len(parts) and self.part_ready(parts[i]):
            i += 1
        y.next = i
        y.arrived = i == len(parts)
        return y.arrived

    def collect_all(self, y: PendingAll) -> tuple[Any, BaseException | None]:
        """The replies of a PendingAll (every reply slot freed), or its first failure."""
        values = []
        first: BaseException | None = None
        for p in y.parts:
            v, exc = self.collect_pending(p)
            values.append(v)
            if exc is not None and first is None:
                first = exc
        return (None, first) if first is not None else (values, None)

    def collect_pending(self, y: Pending) -> tuple[Any, BaseException | None]:
        if isinstance(y, PendingAll):
            return self.collect_all(y)
        if isinstance(y, CallPending) and y.rh >= 0 and not y.arrived:
            a = self.a
            off = a.off(y.rh)
            status = a.kind_link(off)[1]
            try:
                status, value = result_value(status, a.take(off))
            except BaseException as exc:
                status, value = ST_ERROR, (exc, "")
            a.free(y.rh)
            y.arrived = True
            if status == ST_OK:
                return value, None
            return None, with_remote_tb(value)
        return (y.value, None) if y.exc is None else (None, y.exc)

    def resume(self, e: _Entry) -> None:
        y = e.waiting
        e.waiting = None
        e.state = RUNNABLE
        w = self.w
        w.c[C_RESUMES] += 1
        if isinstance(y, Pending):
            send, exc = self.collect_pending(y)
        else:
            frame = e.frame
            kids, single = children_of(y)
            frame.waiting = (kids, single)
            send, exc = w.collect(frame)
        self.drive(e, send, exc)

    def it_done(self, e: _Entry, status: int, value: Any) -> None:
        """A generator step or handler finished."""
        e.it = None
        msg = e.it_msg
        e.it_msg = None
        if e.state == SUSPENDED:
            e.state = RUNNABLE
        if msg is None:  # a step
            if status == ST_OK:
                self.outcome(e, value)
            else:
                self.failed(e, value)
            return
        m, reply, replay, sender, seq, call, _chain = msg
        self.handled(e, m, replay)
        enc = (self.answered(e, sender, seq, call, reply, status, value)
               if sender is not None and self.journal is not None else None)
        # (a call's slot was claimed when its handler started, unless journaled)
        self.reply(reply, status, value, enc, sender is None)

    def drop_reply(self, rh: int) -> None:
        """We stop waiting for reply slot ``rh``: free it, or cancel it (the callee frees it)."""
        a = self.a
        for _ in range(1000):
            st = a.tr.state(rh)
            if st is None or st[0] == S_CANCELLED:
                return
            if st[0] == S_DONE:
                a.free(rh)  # we were its only reader
                return
            if st[0] == S_QUEUED and a.tr.cancel(rh) is Outcome.OK:
                return  # the callee's reply CAS fails and it releases the slot
            time.sleep(0)  # RUNNING: the callee is storing the reply right now
