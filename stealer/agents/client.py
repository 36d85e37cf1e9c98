"""The client's side of agents: spawn, send, call, stop, and the final values.

An agent's final value reaches the client as any root task's result does
(its record is published on a completion ring when it is DONE), under the
future id ``AGENT_FID | handle``.  No Future exists per agent until
somebody asks (``ref.result()``, ``ref.future``): a million idle agents
cost the client nothing; a final value nobody has asked for yet waits in
:attr:`AgentClient.finished`.
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Any

from stealer import serialize
from stealer._layout import (
    D_CKPT,
    F_AGENT,
    K_MASK,
    K_MSG,
    K_REPLY,
    K_ROOT,
    S_CANCELLED,
    S_DONE,
    S_QUEUED,
    S_RECOVERING,
    ST_ERROR,
)
from stealer.agents.api import AgentRef, _clients
from stealer.agents.mailbox import CLOSED, Directory
from stealer.agents.options import DEFAULT_OPTIONS, AgentOptions
from stealer.errors import AgentStopped, MailboxFull, StealerError
from stealer.futures import _Future
from stealer.records import Outcome

__all__ = ["AgentClient", "AGENT_FID", "lookup", "encode_message"]

AGENT_FID = 1 << 63  # future ids of agents' final values: AGENT_FID | agent handle
RECORD_WAIT = 30.0  # seconds a send or spawn waits for a free record before giving up



def lookup(seg: str) -> AgentClient | None:
    ref = _clients.get(seg)
    return ref() if ref is not None else None


def encode_message(target: int, method: str, args: tuple, kwargs: dict | None, reply: int,
                   deadline: float | None) -> tuple[bytes, list]:
    if not isinstance(method, str) or not method or method.startswith("_"):
        raise ValueError(f"a message names a public method of the agent, not {method!r}")
    return serialize.dumps((target, method, args, kwargs or None, reply, deadline),
                           f"message {method!r}")


class _AgentFuture(_Future):
    """The Future of an agent's final value: stop the agent to end it, not cancel()."""

    def cancel(self) -> bool:
        return False


class AgentClient:
    """Per-executor client state of its agents (created with the pool)."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.a = pool.arena
        self.dir = Directory(pool.region, pool.arena, pool.layout.offsets["agents"],
                             pool.inboxes, pool.idle)
        self.lock = threading.Lock()
        self.futures: dict[int, _Future] = {}  # agent handle -> its final value's Future
        self.finished: dict[int, tuple[int, Any]] = {}  # fid -> (status, value), nobody asked yet
        self.name = pool.name
        _clients[pool.name] = weakref.ref(self)

    def close(self) -> None:
        _clients.pop(self.name, None)

    # -- records ------------------------------------------------------------------
    def alloc(self, what: str) -> int:
        a = self.a
        h = a.alloc()
        if h >= 0:
            return h
        end = time.monotonic() + RECORD_WAIT
        delay = 0.0001
        while True:
            self.pool.check_open()
            time.sleep(delay)
            delay = min(delay * 2, 0.01)
            h = a.alloc()
            if h >= 0:
                return h
            if time.monotonic() > end:
                raise StealerError(
                    f"no free record for {what} in {RECORD_WAIT:.0f} s: every record holds a "
                    "live agent, a queued message or an unread result. Create the Executor "
                    "with more records (Executor(records=...)), or stop agents you no "
                    "longer need.")

    # -- spawn ------------------------------------------------------------------
    def spawn(self, cls: type, args: tuple, kwargs: dict, opts: AgentOptions,
              retries: int) -> AgentRef:
        pool = self.pool
        deadline_at = None if opts.deadline is None else time.monotonic() + opts.deadline
        fid = pool.fns.id_of(cls)  # the class once in the function table, then by id
        wopts = None if opts == DEFAULT_OPTIONS else opts.to_worker()
        # small enough for a record's inline bytes: a million idle agents use no blocks
        data, bufs = serialize.dumps((fid if fid >= 0 else cls, args, kwargs or None, wopts,
                                      deadline_at),
                                     f"agent {getattr(cls, '__qualname__', cls)!r} and its "
                                     "arguments")
        pool.check_open()
        h = self.alloc("a new agent")
        a = self.a
        try:
            self.dir.init(h, opts.mailbox)  # before the record is QUEUED
            off = a.setup(h, K_ROOT | F_AGENT, AGENT_FID | h, time.monotonic_ns(), retries)
            a.put(off, data, bufs)
        except BaseException:
            a.free(h)
            raise
        pool.push(h)
        pool.idle.notify_one()
        return AgentRef(h, self.name, self)

    # -- final values ---------------------------------------------------------------
    def future(self, h: int) -> _Future:
        with self.lock:
            f = self.futures.get(h)
            if f is not None:
                return f
            fid = AGENT_FID | h
            f = _AgentFuture(self.pool, fid, f"agent {h:#x}")
            self.futures[h] = f
            self.pool.futures[fid] = f
            got = self.finished.pop(fid, None)
        if got is not None:  # finished before anybody asked
            self.pool.futures.pop(fid, None)
            self.pool.resolve(f, *got)
        elif self.pool.broken and self.pool.futures.pop(fid, None) is not None:
            from stealer.errors import BrokenExecutor

            self.pool.resolve(f, 1, (BrokenExecutor(self.pool.broken), ""))
        return f

    def settle(self, fid: int, status: int, value: Any) -> bool:
        """Result thread: an agent's final value that no Future waited for."""
        if not fid & AGENT_FID:
            return False
        with self.lock:
            self.finished[fid] = (status, value)
        return True

    def alive(self) -> bool:
        """Any agent record whose final value the result thread has not read yet (a scan:
        shutdown only; DONE counts, its completion may still be on its way)."""
        import numpy as np

        from stealer._layout import K_MASK, S_FREE, STATE_MASK, STATE_SHIFT

        w, ks, _link = self.pool.rec._columns()
        kind = ks & np.uint64(0xFFFFFFFF)
        agent = (kind & np.uint64(F_AGENT | K_MASK)) == np.uint64(F_AGENT | K_ROOT)
        st = (w >> np.uint64(STATE_SHIFT)) & np.uint64(STATE_MASK)
        return bool(np.any(agent & (st != np.uint64(S_FREE))))

    # -- messages ---------------------------------------------------------------------
    def _check(self, h: int) -> None:
        st = self.a.tr.state(h)
        # acquire load of D_HEAD: pairs with the owner's closing CAS
        if st is None or st[0] == S_DONE or self.pool.region.load64(self.dir.entry(h)) & CLOSED:
            raise AgentStopped(f"agent {h:#x} was stopped, finished or failed; it takes no "
                               "more messages", h)

    def _deliver(self, h: int, m: int) -> None:
        if not self.dir.push(h, m):
            self.a.free(m)
            self.dir.give_back(h)  # the slot reserved for it
            raise AgentStopped(f"agent {h:#x} was stopped, finished or failed before the "
                               "message arrived", h)
        self.dir.notify(h)

    def _reserve(self, h: int, block: bool, timeout: float | None) -> None:
        d = self.dir
        if d.reserve(h):
            return
        if not block:
            raise MailboxFull(f"the mailbox of agent {h:#x} is full ({d.count(h)[1]} "
                              "messages); send with block=True to wait, or make it bigger "
                              "with spawn_agent(..., mailbox=N)", h)
        end = None if timeout is None else time.monotonic() + timeout
        while not d.reserve(h):
            self._check(h)
            self.pool.check_open()
            left = 0.05 if end is None else min(0.05, end - time.monotonic())
            if left <= 0:
                raise MailboxFull(f"the mailbox of agent {h:#x} stayed full for {timeout} s",
                                  h)
            d.wait_room(h, left)

    def send(self, h: int, method: str, args: tuple, kwargs: dict, block: bool,
             timeout: float | None) -> None:
        data, bufs = encode_message(h, method, args, kwargs, -1, None)
        self.pool.check_open()
        self._check(h)
        self._reserve(h, block, timeout)
        try:
            m = self.alloc("a message")
            off = self.a.setup(m, K_MSG, 0, time.monotonic_ns())
            self.a.put(off, data, bufs)
        except BaseException:
            self.dir.give_back(h)
            raise
        self._deliver(h, m)

    def call(self, h: int, method: str, args: tuple, kwargs: dict,
             deadline: float | None) -> _Future:
        pool = self.pool
        pool.check_open()
        fid = next(pool.ids)
        f = _Future(pool, fid, method)
        a = self.a
        try:
            self._check(h)
            rh = self.alloc("a reply")
            a.setup(rh, K_ROOT, fid, time.monotonic_ns())  # QUEUED on no queue: the reply slot
            f._st_handle = rh  # cancel() withdraws it (the agent then drops the reply)
            pool.futures[fid] = f
            try:
                data, bufs = encode_message(h, method, args, kwargs, rh, deadline)
                self._reserve(h, True, None)
                m = self.alloc("a message")
                off = a.setup(m, K_MSG, 0, time.monotonic_ns())
                a.put(off, data, bufs)
                self._deliver(h, m)
            except BaseException:
                if pool.futures.pop(fid, None) is not None:
                    a.release(rh, 1, 0, 0)  # QUEUED -> FREEING -> free (still ours)
                raise
        except (AgentStopped, MailboxFull, ValueError, StealerError) as exc:
            f.set_exception(exc)
        return f

    # -- agents that failed outside their worker ---------------------------------------
    def abandon(self, h: int, exc: BaseException) -> None:
        """Agent ``h`` failed for good outside its worker (its worker died more often than
        ``retries`` allows, or was killed for a step stuck past its step_timeout): close
        its mailbox, fail the calls waiting there with ``exc``, free its messages and its
        checkpoint.  The caller then publishes the agent's own failure."""
        a = self.a
        d = self.dir
        r = self.pool.region
        head = d.close(h)
        ent = d.entry(h)
        ck = r.load64(ent + D_CKPT)
        mark = a.kind_link(a.off(ck - 1))[2] if ck else 0
        for m in d.older(head, mark) if head else []:
            try:
                reply = a.read_call(a.off(m))[4]
            except BaseException:
                reply = -1
            if reply >= 0:
                self.fail_reply(reply, exc)  # a handled call's slot is gone: the CAS fails
            a.free(m)
        if ck:
            r.store64(ent + D_CKPT, 0)
            a.free(ck - 1)

    def fail_reply(self, rh: int, exc: BaseException) -> None:
        """The client answers reply slot ``rh`` (still QUEUED) with ``exc``."""
        a = self.a
        tr = a.tr
        st = tr.state(rh)
        if st is None:
            return
        kind, _status, link = a.kind_link(a.off(rh))
        if st[0] == S_CANCELLED:
            a.release(rh, S_CANCELLED, 0, 0)
            return
        if kind & K_MASK == K_ROOT:  # a client's call: its future, here
            if a.release(rh, S_QUEUED, 0, 0) is Outcome.OK:
                f = self.pool.futures.pop(link, None)
                if f is not None:
                    self.pool.resolve(f, ST_ERROR, (exc, ""))
            return
        if kind & K_MASK == K_REPLY and tr.cas(rh, S_QUEUED, 0, S_RECOVERING, 0) is Outcome.OK:
            data, bufs = serialize.dumps((exc, ""))
            off = a.off(rh)
            a.put_result(off, data, bufs)
            a.set_status(off, ST_ERROR)
            tr.fail(rh, 0)  # RECOVERING|0 -> DONE|0; seq_cst releases the result
            d = self.dir
            d.notify(link)  # the calling agent collects it

    def stop(self, h: int) -> None:
        from stealer._layout import AF_STOP, D_FLAGS

        if self.a.tr.state(h) is None:
            return  # already finished
        self.pool.region.or64(self.dir.entry(h) + D_FLAGS, AF_STOP)  # seq_cst; read by the owner
        self.dir.notify(h)
