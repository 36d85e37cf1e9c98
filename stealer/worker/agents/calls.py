"""The Host's sends and calls from inside a worker: what an agent (or a plain task) does
with an AgentRef, and the spawns and blocking calls it makes.

:class:`Calls` is a mixin of :class:`stealer.worker.agents.host.Host`: the Host is the runtime
of every AgentRef used on a worker (api.py calls ``send``, ``call``, ``call_all``,
``stop``, ``future``), and of an agent's Ctx (``spawn_agent``, ``run_blocking``); the
worker loop calls ``flush_outboxes`` (through ``Host.poll``).
"""

from __future__ import annotations

import collections
import functools
import time
from typing import Any

from stealer.agents.api import AgentRef, Pending, PendingAll, _Kids
from stealer.agents.jblob import pack as journal_pack
from stealer.agents.message import AGENT_FID, encode_message, message_reply
from stealer.agents.options import DEFAULT_OPTIONS, AgentOptions
from stealer.errors import (
    AgentDeadlock,
    AgentStopped,
    MailboxFull,
    NotInTaskError,
    result_value,
    with_remote_tb,
)
from stealer.forkjoin import TaskCall
from stealer.shared import failpoints as FP
from stealer.shared import serialize
from stealer.shared._layout import (
    AF_CONTROL,
    AF_STOP,
    D_FLAGS,
    F_AGENT,
    F_AWAITED,
    F_TASKCALL,
    K_CHILD,
    K_MASK,
    K_MSG,
    K_REPLY,
    K_ROOT,
    S_DONE,
    ST_ERROR,
    ST_OK,
)
from stealer.shared.shm import H_STOP_AGENTS
from stealer.worker.agents.entry import FINISHED, CallPending, _Entry


def _api(fn: Any) -> Any:
    """A Host method a step may call: the preemption signal handler leaves it alone."""

    @functools.wraps(fn)
    def call(self: Any, *args: Any) -> Any:
        self.in_api += 1
        try:
            return fn(self, *args)
        finally:
            self.in_api -= 1
            if self.ctl_missed and self.in_step and not self.in_api:
                # a control message's signal came during this call, in a step: its handler
                # runs now, back at the step's user code, not at the step's end
                self.ctl_missed = False
                self.on_control_now()

    return call


class Calls:
    """Sends, calls, stops and spawns made on a worker, the outboxes of sends waiting for
    room, the journal's write-ahead of messages and spawns, and run_blocking's threads.

    Owns: ``blocked`` (the entries whose sends wait for room), ``task_sends`` (the outbox
    of plain tasks' sends), ``blocking`` (the thread pool, made on first use) and
    ``in_api`` (raised by :func:`_api` while a step calls in).  Relies on the Host's
    ``w``, ``a``, ``r``, ``dir``, ``k``, ``name``, ``current`` and ``journal``, and on
    ``after_turn`` (host.py).  A mixin: the preemption signal handler (host.py) reads
    ``in_api``, and the hot sends use the Host's state directly.
    """

    # -- sends and calls from inside a worker ------------------------------------------
    @_api
    def send(self, h: int, method: str, args: tuple, kwargs: dict, block: bool,
             timeout: float | None, uid: str | None = None) -> None:
        if h < 0:
            raise AgentStopped(f"agent {uid!r} had finished before the recovery", h)
        e = self.current
        j = self.journal
        if j is None or uid is None:
            data, bufs = encode_message(h, method, args, kwargs, -1, None)
        else:
            sender, seq = self._next_seq(e)
            data, bufs = encode_message(h, method, args, kwargs, -1, None, sender, seq,
                                        self._ack(e))
            self._log_msg(uid, sender, seq, False, data, bufs)
            self._send(h, data, bufs, block, True)
            return
        self._send(h, data, bufs, block)

    @staticmethod
    def _ack(e: _Entry | None) -> int:
        """What our messages up to this seq need no longer: our checkpoint covers them."""
        return e.jacked if e is not None and e.uid is not None else 0

    def _next_seq(self, e: _Entry | None) -> tuple[str, int]:
        if e is not None and e.uid is not None:
            e.jsent += 1
            return e.uid, e.jsent
        j = self.journal
        j.task_seq += 1
        return j.task_key, j.task_seq

    def _log_msg(self, target: str, sender: str, seq: int, call: bool, data: bytes,
                 bufs: list) -> None:
        """Write-ahead: the message is in the journal before any mailbox has it."""
        body, oob = journal_pack((data, bufs))
        self.journal.shard.msg(target, sender, seq, call, body, oob)
        if FP.ON:
            FP.hit("journal.after_msg_logged")

    def _send(self, h: int, data: bytes, bufs: list, block: bool,
              logged: bool = False) -> None:
        a = self.a
        st = a.tr.state(h)
        if st is None or st[0] == S_DONE:
            if logged and self.r.load32(H_STOP_AGENTS):  # seq_cst: begin_shutdown's store
                # shutting down: the receiver was suspended (journal), not ended; the
                # message is in the journal, so the recovered receiver gets it
                return
            raise AgentStopped(f"agent {h:#x} was stopped, finished or failed", h)
        m = self.alloc()
        off = a.setup(m, K_MSG, 0, time.monotonic_ns())
        a.put(off, data, bufs)
        # A plain task's sends queue like an agent's: waiting here could wait forever for
        # an agent that lives on this very worker.
        e = self.current or self.task_sends
        if e.outbox or not self.dir.reserve(h):
            if not block and not e.outbox:
                a.free(m)
                raise MailboxFull(f"the mailbox of agent {h:#x} is full", h)
            if e.outbox is None:
                e.outbox = collections.deque()
            e.outbox.append((h, m))  # sent when there is room; an agent waits for it
            if e is self.task_sends and not e.blocked:
                e.blocked = True
                self.blocked.append(e)
            return
        self.deliver_to(h, m)

    def deliver_to(self, h: int, m: int) -> None:
        if not self.dir.push(h, m):
            self.dir.give_back(h)
            self.dropped(h, m)  # closed: the agent is gone
            return
        self.dir.notify(h, self.k)

    def dropped(self, h: int, m: int) -> None:
        """Message ``m`` never reached agent ``h`` (it stopped, finished or failed first):
        freed, as a send to a dead pid; a call's caller gets AgentStopped as its reply
        (the agent that closed its mailbox answered only what was in it: a call dropped
        here was never answered, and a task waiting for it hung)."""
        a = self.a
        try:
            rh = message_reply(a.read_call(a.off(m)))
        except BaseException:
            rh = -1
        a.free(m)
        if rh >= 0:
            self.reply(rh, ST_ERROR, AgentStopped(
                f"agent {h:#x} was stopped, finished or failed before this call reached it",
                h))

    def flush_outboxes(self) -> None:
        still = []
        for e in self.blocked:
            ob = e.outbox
            while ob:
                h, m = ob[0]
                st = self.a.tr.state(h)
                if st is None or st[0] == S_DONE:
                    ob.popleft()
                    self.dropped(h, m)
                    continue
                if not self.dir.reserve(h):
                    break
                ob.popleft()
                self.deliver_to(h, m)
            if ob:
                still.append(e)
            else:
                e.blocked = False
                if e.state != FINISHED:
                    self.after_turn(e)
        self.blocked = still

    @_api
    def call(self, h: int, method: str, args: tuple, kwargs: dict,
             deadline: float | None, uid: str | None = None) -> CallPending | TaskCall:
        e = self.current
        if e is None:
            return self.task_call(h, method, args, kwargs, deadline, uid)
        j = self.journal if uid is not None and e.uid is not None else None
        if j is not None:
            sender, seq = self._next_seq(e)
            logged = e.jreplies.pop(seq, None) if e.jreplies else None
            if logged is not None and h >= 0:
                # replaying after a recovery, and the reply is in the journal: the call goes
                # again as a one-way message (in order with the sender's others; the callee
                # drops it if its snapshot has it) and the logged reply is the answer
                data, bufs = encode_message(h, method, args, kwargs, -1, deadline, sender, seq,
                                            e.jacked)
                self._log_msg(uid, sender, seq, True, data, bufs)
                self._send(h, data, bufs, True, True)
                return self._logged_reply(logged)
        if h < 0:
            p = CallPending(-1)
            p.arrived, p.exc = True, AgentStopped(f"agent {uid!r} had finished before the "
                                               "recovery", h)
            return p
        chain: tuple = ()
        if e.it is not None:  # from a generator, which may wait for the reply (yield)
            chain = self.waiters(e)
            self.refuse_cycle(e, chain, h, method)
        a = self.a
        rh = self.alloc()
        # QUEUED on no queue: the reply slot (F_AWAITED: from a generator, which may wait)
        a.setup(rh, K_REPLY | F_AWAITED if e.it is not None else K_REPLY, e.h,
                time.monotonic_ns())
        if j is None:
            data, bufs = encode_message(h, method, args, kwargs, rh, deadline, chain=chain)
        else:
            data, bufs = encode_message(h, method, args, kwargs, rh, deadline, sender, seq,
                                        e.jacked, chain)
            try:
                self._log_msg(uid, sender, seq, True, data, bufs)
            except BaseException:
                a.free(rh)
                raise
        try:
            self._send(h, data, bufs, True, j is not None)
        except AgentStopped as exc:
            a.free(rh)
            p = CallPending(-1)
            p.arrived, p.exc = True, exc
            return p
        return CallPending(rh)

    def task_call(self, h: int, method: str, args: tuple, kwargs: dict,
                  deadline: float | None, uid: str | None) -> TaskCall:
        """``ref.call`` from a task: a child of the task that the agent completes (a reply
        slot, K_CHILD | F_TASKCALL, QUEUED on no queue, linked to the task's frame): its
        answer pings the task as a finished child would, so ``yield`` and the blocking
        join (which runs this worker's agents while it waits) take it as one.  Not
        journaled: a task is re-run whole after a crash, and calls again."""
        if h < 0:
            return self._answered(AgentStopped(f"agent {uid!r} had finished before the "
                                               "recovery", h))

        def send(rh: int) -> None:
            data, bufs = encode_message(h, method, args, kwargs, rh, deadline)
            if FP.ON:
                FP.hit("agent.task_call_before_send")
            self._send(h, data, bufs, True)

        try:
            return self._task_slot(send)
        except AgentStopped as exc:
            return self._answered(exc)

    def _task_slot(self, send: Any) -> TaskCall:
        """A task's reply slot (QUEUED on no queue: the agent claims it when it answers; a
        recoverer frees it if this task's worker dies first, Recovery.drop_calls), made a
        child of the running task's frame before ``send(rh)`` sends the call; undone if
        that raises.  Ctrl-C is held back meanwhile (as in ForkJoinHandling.spawn): a slot
        left out of the frame's children, or in them with no call sent, would leak or
        hang the task's end."""
        w = self.w
        frame = w.task_frame()
        if frame is None:
            raise NotInTaskError("ref.call() on a worker is made from a task or an agent "
                                 "running there")
        a = self.a
        w.in_spawn = True
        try:
            rh = self.alloc()
            a.setup(rh, K_CHILD | F_TASKCALL, frame.h, time.monotonic_ns())
            c = TaskCall(rh)
            frame.kids[rh] = c  # before the send: the task's end waits for the reply
            try:
                send(rh)
            except BaseException:
                del frame.kids[rh]
                a.free(rh)
                raise
        finally:
            w.in_spawn = False
        if w.interrupted:
            w.interrupted = False
            raise KeyboardInterrupt
        return c

    @staticmethod
    def _answered(exc: BaseException) -> TaskCall:
        c = TaskCall(-1)
        c.done, c.exc = True, exc
        return c

    def waiters(self, e: _Entry) -> tuple:
        """The agents waiting, each in a generator, for the reply of the generator handler
        ``e`` runs now (outermost first): the chain its message carried, then its caller,
        an agent's generator if the reply slot is a K_REPLY with F_AWAITED (its link names
        it; a plain handler's call is not waited on).  () for a step, a one-way message, a
        call from the client or a task."""
        msg = e.it_msg
        if msg is None or msg[1] < 0:
            return ()
        kind, _status, link = self.a.kind_link(self.a.off(msg[1]))
        if kind & K_MASK != K_REPLY or not kind & F_AWAITED:
            return msg[6]
        return (*msg[6], link)

    def refuse_cycle(self, e: _Entry, chain: tuple, h: int, method: str) -> None:
        """Raise AgentDeadlock if a call from ``e``'s generator to agent ``h`` closes a
        cycle: ``h`` is ``e`` itself or waits (``chain``) for ``e``'s reply.  It handles
        messages only between its steps and handlers, so the call would never be served."""
        if h != e.h and h not in chain:
            return
        me = f"agent {e.h:#x} ({type(e.obj).__qualname__})"
        if h == e.h:
            what = f"{me} called itself ({method!r}) from its own step or handler"
        else:
            path = " -> ".join(f"{x:#x}" for x in (*chain[chain.index(h):], e.h, h))
            what = (f"{me} called agent {h:#x} ({method!r}), which waits for this agent's "
                    f"reply: the calls {path} form a cycle")
        raise AgentDeadlock(
            f"{what}; an agent handles messages only between its steps and handlers, so "
            "this call would wait forever. Call the method directly when it is the same "
            "agent, send (ref.send) what needs no reply, or return and let the other agent "
            "call back later", e.h, e.gen)

    def call_all(self, targets: list[tuple[int, str | None, float | None]], method: str,
                 arglists: list[tuple]) -> PendingAll | _Kids:
        """api.call_all inside an agent: ``yield`` it for the list of replies."""
        e = self.current
        if e is None:  # a task's: its children, to yield (a list) or join
            return _Kids([self.call(h, method, args, {}, dl, uid)
                          for (h, uid, dl), args in zip(targets, arglists)])
        if e.it is not None:  # every target checked before any is sent
            chain = self.waiters(e)
            for h, _uid, _dl in targets:
                self.refuse_cycle(e, chain, h, method)
        return PendingAll([self.call(h, method, args, {}, dl, uid)
                           for (h, uid, dl), args in zip(targets, arglists)])

    @_api
    def stop(self, h: int) -> None:
        if self.a.tr.state(h) is None:
            return
        self.r.or64(self.dir.entry(h) + D_FLAGS, AF_STOP)  # seq_cst; read by the owner after it clears NOTIFIED
        self.dir.notify(h, self.k)

    @staticmethod
    def _logged_reply(logged: tuple) -> CallPending:
        from stealer.agents.jblob import loads

        status, body, oob = logged
        p = CallPending(-1)
        p.arrived = True
        try:
            status, value = result_value(status, loads(body, oob))
        except BaseException as exc:
            status, value = ST_ERROR, (exc, "")
        if status == ST_OK:
            p.value = value
        else:
            p.exc = with_remote_tb(value)
        return p

    def _remap(self, uid: str) -> tuple[str, int] | None:
        """api._rebuild: the handle of agent ``uid`` recovered into this executor."""
        h = self.journal.handle(uid)
        return None if h is None else (self.name, h)

    def future(self, h: int, uid: str | None = None) -> Any:
        raise NotInTaskError("ref.result() is for the client; inside an agent, call() the "
                             "agent and yield the reply")

    def alloc(self) -> int:
        a = self.a
        h = a.alloc()
        delay = 0.0001
        while h < 0:  # every record in use: wait for one (the client frees results)
            time.sleep(delay)
            delay = min(delay * 2, 0.01)
            h = a.alloc()
        return h

    @_api
    def spawn_agent(self, cls: type, args: tuple, options: dict) -> AgentRef:
        opts = dict(options)
        retries = opts.pop("retries", 3)
        if opts.pop("name", None) is not None:
            raise ValueError("agents are named by the client (Executor.spawn_agent(..., "
                             "name=...)); an agent's children are found through the refs "
                             "spawn_agent returns")
        ao = AgentOptions.parse(opts)
        deadline_at = None if ao.deadline is None else time.monotonic() + ao.deadline
        wopts = None if ao == DEFAULT_OPTIONS else ao.to_worker()
        what = f"agent {getattr(cls, '__qualname__', cls)!r}"
        j = self.journal
        uid = None
        if j is None:
            data, bufs = serialize.dumps((cls, args, None, wopts, deadline_at), what)
        else:
            e = self.current
            if e is not None and e.uid is not None:
                e.jspawned += 1
                uid, parent = f"{e.uid}/{e.jspawned}", e.uid
            else:
                j.task_spawned += 1
                uid, parent = f"{j.task_key}.{j.task_spawned}", None
            old = j.handle(uid)
            if old is not None:  # a replay spawns it again: it was recovered already
                return AgentRef(old, self.name, self, uid)
            body, oob = journal_pack(serialize.dumps((cls, args, None, wopts), what))
            j.shard.spawn(uid, None, parent, f"{cls.__module__}.{cls.__qualname__}", body, oob)
            data, bufs = serialize.dumps((cls, args, None, wopts, deadline_at,
                                          (uid, None, None, 0)), what)
        a = self.a
        h = self.alloc()
        w = self.w
        # before the record is QUEUED (a recoverer may push it)
        self.dir.init(h, ao.mailbox, AF_CONTROL if ao.tier == 0 else 0)
        self.r.store64(w.lease_off, h + 1)  # leased: killed before the push, it is pushed again
        off = a.setup(h, K_ROOT | F_AGENT, AGENT_FID | h, time.monotonic_ns(), retries)
        a.put(off, data, bufs)
        if not w.deque.push(h):
            w.push_any(h)
        a.notify_one()
        return AgentRef(h, self.name, self, uid)

    def _threads(self) -> Any:
        """The thread pool of blocking calls (made on first use)."""
        if self.blocking is None:
            from concurrent.futures import ThreadPoolExecutor

            self.blocking = ThreadPoolExecutor(4, thread_name_prefix="stealer-blocking")
        return self.blocking

    def task_blocking(self, fn: Any, args: tuple) -> TaskCall:
        """A task's call that ``fn(*args)`` answers on the blocking thread pool (a cluster
        agent's reply, stealer/cluster/asks.py): a TaskCall child of the running task,
        completed by this worker's loop (:meth:`take_answer`) when the thread is done, so
        the task yields or joins it as any call, and the worker runs its agents meanwhile
        (the agent called may live on this node)."""
        answers = self.answers
        inbox = self.w.inbox
        idle = self.w.idle
        k = self.k

        def send(rh: int) -> None:
            def done(f: Any) -> None:
                answers[rh] = f  # (a dict store: atomic under the GIL)
                while not inbox.push(rh):  # our own inbox: the loop completes the slot
                    time.sleep(0.0001)
                idle.notify_worker(k)

            self._threads().submit(fn, *args).add_done_callback(done)

        return self._task_slot(send)

    def take_answer(self, rh: int) -> bool:
        """An inbox entry ``rh``: if it is a :meth:`task_blocking` slot whose thread is
        done, store its outcome there (the reply pings the task).  False otherwise."""
        f = self.answers.pop(rh, None)
        if f is None:
            return False
        exc = f.exception()
        if exc is None:
            self.reply(rh, ST_OK, f.result())
        else:
            self.reply(rh, ST_ERROR, exc)
        return True

    @_api
    def run_blocking(self, fn: Any, args: tuple, kwargs: dict) -> Pending:
        e = self.current
        if e is None:
            raise NotInTaskError("ctx.run_blocking() is for agents")
        self._threads()
        p = Pending()
        h = e.h
        inbox = self.w.inbox
        idle = self.w.idle
        k = self.k

        def done(f: Any) -> None:
            exc = f.exception()
            if exc is None:
                p.value = f.result()
            else:
                p.exc = exc
            p.arrived = True
            while not inbox.push(h):  # our own inbox: the loop wakes and resumes the agent
                time.sleep(0.0001)
            idle.notify_worker(k)

        self.blocking.submit(fn, *args, **kwargs).add_done_callback(done)
        return p
