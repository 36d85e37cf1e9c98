"""The Host's leavings: an agent that stops, fails or finishes, its checkpoints, and its
moves to other workers.

:class:`Leaving` is a mixin of :class:`stealer.worker.agents.host.Host`: the turn (host.py)
calls ``stop_entry``, ``finish``, ``failed``, ``checkpoint`` (after a turn), and, to
spread agents over the workers, ``publish_one`` when the host's Balancer (balance.py,
with placement.py's rules) says a move pays; the Balancer and the preemption handler
call ``publish_one`` too; the worker loop calls ``stop_all`` at shutdown.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from stealer.agents.api import PendingAll, drives_itself, stop_value
from stealer.agents.jblob import pack as journal_pack
from stealer.agents.message import message_reply
from stealer.errors import AgentStopped, JournalError, WorkerCrashedError
from stealer.shared import failpoints as FP
from stealer.shared import serialize
from stealer.shared._layout import (
    AF_STOP,
    D_CKPT,
    D_FLAGS,
    D_GEN,
    D_OWNER,
    F_AGENT,
    K_CKPT,
    K_MASK,
    K_REPLY,
    K_ROOT,
    OWNER_MASK,
    OWNER_MOVING,
    S_DONE,
    S_QUEUED,
    S_RUNNING,
    ST_ERROR,
    ST_OK,
)
from stealer.shared.records import Outcome
from stealer.shared.shm import (
    H_STOP_AGENTS,
)
from stealer.worker.agents import dormant
from stealer.worker.agents.entry import (
    C_MIGRATIONS,
    FINISHED,
    RUNNABLE,
    SUSPENDED,
    WAITING,
    CallPending,
    _Entry,
)
from stealer.worker.agents.placement import COOLDOWN_NS

#: agent classes whose state did not pickle, already said on stderr (once per worker)
_SAID_UNPICKLABLE: set[type] = set()


def _unpicklable(obj: Any) -> str:
    """Which attribute of an agent keeps it from pickling (for the error message)."""
    for k, v in (getattr(obj, "__dict__", None) or {}).items():
        try:
            serialize.dumps(v)
        except BaseException:
            return f"its attribute {k!r} ({type(v).__name__}) does not pickle"
    return "its state does not pickle"


class Leaving:
    """Leaving: stop, restart-on-failure, finish (close, drain, publish); checkpoints
    (the state pickled into a K_CKPT record); migration (publish one agent for an idle
    peer, or hand it to a shorter one).

    Owns: ``away`` (agents we published, ours again if we start them) and ``stopping``
    (set by ``stop_all``).  Relies on the
    Host's ``w``, ``a``, ``r``, ``dir``, ``who``, ``journal``, ``agents``, ``controls``,
    ``blocked``, ``rq``, ``runnable_off`` and ``turn_avg``, and on ``schedule``,
    ``tries``, ``_ckpt_mark`` (adopt.py), ``reply`` (messages.py) and
    ``drop_reply`` (generators.py).  A mixin: these touch the Host's agents and
    run queue throughout.
    """

    # -- leaving -------------------------------------------------------------------------
    def stop_entry(self, e: _Entry) -> None:
        """ref.stop(): the final value is ``on_stop()`` (None if the agent has none).

        At shutdown a journaled agent is *suspended*, not ended: a last snapshot, and no
        end in the journal, so ``recover=True`` resumes it later."""
        # (the shared flag, not self.stopping: an agent stopped by a peer's stop_all may
        # be adopted here before this worker saw the flag)
        if e.uid is not None and self.journal is not None and (
                self.stopping or self.r.load32(H_STOP_AGENTS)):  # seq_cst: begin_shutdown
            e.events = 1
            self.checkpoint(e)  # (not possible mid-call: its last snapshot then stands)
            if e.state == FINISHED:
                return  # its state did not pickle: checkpoint() failed it
            e.uid = None  # no end event
            suspend = True
        else:
            suspend = False
        if getattr(e.obj, "on_stop", None) is None:
            self.finish(e, ST_OK, None, suspend)
            return
        self.w.in_body = True
        try:
            value = stop_value(e.obj)
        except BaseException as exc:
            self.w.in_body = False
            self.finish(e, ST_ERROR, exc, suspend)
            return
        self.w.in_body = False
        self.finish(e, ST_OK, value, suspend)

    def _agent_reply(self, rh: int) -> bool:
        """Reply slot ``rh`` waits for an agent's call (K_REPLY), not a client's."""
        return rh >= 0 and self.a.kind_link(self.a.off(rh))[0] & K_MASK == K_REPLY

    def failed(self, e: _Entry, exc: BaseException) -> None:
        """A step raised: restart by policy (OTP's restart intensity), else fail."""
        o = e.opts
        if o.restart == "on-failure":
            now = time.monotonic()
            e.restarts = [t for t in e.restarts or () if now - t < o.restart_window]
            if len(e.restarts) < o.max_restarts:
                e.restarts.append(now)
                args, kwargs = e.spawn_args
                try:
                    self.w.in_body = True
                    try:
                        obj = e.cls(*args, **kwargs) if kwargs else e.cls(*args)
                    finally:
                        self.w.in_body = False
                except BaseException as exc2:
                    self.finish(e, ST_ERROR, exc2)
                    return
                e.obj = obj
                e.gen += 1
                self.r.store32(self.dir.entry(e.h) + D_GEN, e.gen)  # stats only: read by collect()
                e.it = None
                e.waiting = None
                e.state = RUNNABLE
                e.want_step = drives_itself(obj)
                if not e.want_step:
                    e.state = WAITING
                print(f"stealer: agent {e.h:#x} ({type(obj).__qualname__}) failed with "
                      f"{type(exc).__name__}: {exc}; restarted (generation {e.gen})",
                      file=sys.stderr)
                return
        self.finish(e, ST_ERROR, exc)

    def finish(self, e: _Entry, status: int, value: Any, suspend: bool = False) -> None:
        """The agent is done (or stopped, or failed for good): close, drain, publish.

        ``suspend``: a journaled agent stopped by the shutdown.  Calls from other agents
        waiting in its mailbox get no AgentStopped (that would fail their callers, which
        the shutdown is suspending too): the journal has them, and recovery delivers them
        (the callers call again when they replay)."""
        a = self.a
        d = self.dir
        h = e.h
        e.state = FINISHED
        self.agents.pop(h, None)
        self.controls.pop(h, None)
        head = d.close(h)
        if FP.ON:
            FP.hit("agent.finish_after_close")
        # Unhandled messages: the pending ones and any pushed since our last walk.
        new = d.older(head, e.seen) if head else []
        name = (type(e.obj).__qualname__ if e.obj is not None
                else getattr(getattr(e, "cls", None), "__qualname__", "never built"))
        why = (f"failed ({type(value).__name__}: {value})"
               if status == ST_ERROR and isinstance(value, BaseException) else "stopped")
        stopped = AgentStopped(f"agent {h:#x} ({name}) {why} before handling this message",
                               h, e.gen)
        for m in list(e.pending or ()) + new:
            try:
                reply = message_reply(a.read_call(a.off(m)))
                if not (suspend and self._agent_reply(reply)):
                    self.reply(reply, ST_ERROR, stopped)
            except BaseException:
                pass
        if e.it_msg is not None and not (suspend and self._agent_reply(e.it_msg[1])):
            # (claimed when the handler started, unless journaled: Messages.claim)
            self.reply(e.it_msg[1], ST_ERROR, stopped, None, e.it_msg[3] is None)
        y = e.waiting
        for p in y.parts if isinstance(y, PendingAll) else (y,):
            if isinstance(p, CallPending) and p.rh >= 0 and not p.arrived:
                self.drop_reply(p.rh)
        for _h, m in e.outbox or ():
            a.free(m)  # never pushed: in no chain
        e.outbox = None
        if e in self.blocked:
            self.blocked.remove(e)
        if e.frame is not None and e.frame.kids:
            for kh in list(e.frame.kids):
                if a.tr.state(kh) is not None and a.tr.state(kh)[0] == S_DONE:
                    a.free(kh)
        # The chain (handled or not) and the checkpoint are freed only once the record is
        # DONE: killed before, a successor restarts the agent and walks an intact chain
        # (killed after, they leak; they are never freed twice).
        ck = self.r.load64(d.entry(h) + D_CKPT)  # our own store (single writer)
        chain = d.older(head, self._ckpt_mark(ck))
        if e.uid is not None and self.journal is not None:
            enc = self.w.encode_result(status, value)  # pickled once: the end and the result
            body, oob = journal_pack(enc[1:])
            try:
                self.journal.shard.end(e.uid, enc[0], body, oob)
            except JournalError as exc:
                print(f"stealer: {exc}", file=sys.stderr)
            if FP.ON:
                FP.hit("journal.after_end_logged")
            self.w.report_encoded(h, K_ROOT | F_AGENT, e.link, *enc)
        else:
            self.w.report(h, K_ROOT | F_AGENT, e.link, status, value)
        for m in chain:
            a.free(m)
        if ck:
            a.free(ck - 1)

    # -- checkpoints and migration ---------------------------------------------------------
    def checkpoint(self, e: _Entry) -> bool:
        """Pickle the agent's state into a fresh K_CKPT record and switch D_CKPT to it; then
        free the previous checkpoint and the messages the new one covers."""
        e.events = 0
        if e.state in (SUSPENDED, FINISHED) or e.it is not None or (e.frame and e.frame.kids):
            return False
        d = self.dir
        a = self.a
        state: Any = None  # None: the state does not pickle; a restore starts from the spawn
        j = self.journal if e.uid is not None else None
        if j is not None:
            e.ver += 1
        if not e.pinned:
            # rcache too: a caller restored from an older checkpoint calls again, and the
            # reply must come from the cache when this checkpoint covers the first call
            jstate = (None if j is None else
                      (e.uid, e.ver, e.jseen, e.jsent, e.jspawned, e.rcache))
            try:
                t0 = time.monotonic_ns()
                state = serialize.dumps((e.obj, e.gen, e.steps, e.msgs, self.tries(e.h),
                                         (e.state, e.want_step, e.wake_at), jstate),
                                        "agent state", arrays=True)
                e.ckpt_ns = time.monotonic_ns() - t0  # what a move costs (placement.py)
            except BaseException as exc:
                if j is not None:  # a journaled agent must pickle: it fails, saying why
                    self.finish(e, ST_ERROR, JournalError(
                        f"agent {e.uid!r} ({type(e.obj).__qualname__}) cannot be journaled: "
                        f"{_unpicklable(e.obj)} ({type(exc).__name__}: {exc}). A journaled "
                        "agent's state must pickle: keep such objects out of its attributes "
                        "(make them in the step that uses them)"))
                    return False
                e.pinned = True
                cls = type(e.obj)
                if cls not in _SAID_UNPICKLABLE:  # once per class and worker, not per agent
                    _SAID_UNPICKLABLE.add(cls)
                    print(f"stealer: agent {e.h:#x} ({cls.__qualname__}) cannot be pickled, "
                          "so it never moves and a worker death restarts it from its spawn "
                          f"arguments: {exc} (said once for its class in this worker)",
                          file=sys.stderr)
        data, bufs = state if state is not None else serialize.dumps(None)
        ch = a.alloc()
        if ch < 0:
            return False
        # the newest message whose effect is in the state: not D_DONE, which runs ahead of
        # the state while messages handled before a restore are being replayed
        mark = e.applied
        off = a.setup(ch, K_CKPT, mark, time.monotonic_ns())
        a.put(off, data, bufs)
        ent = d.entry(e.h)
        old = self.r.load64(ent + D_CKPT)
        old_mark = self._ckpt_mark(old)
        if FP.ON:
            FP.hit("agent.ckpt_before_switch")
        self.r.store64(ent + D_CKPT, ch + 1)  # release: the checkpoint is complete before
        if FP.ON:
            FP.hit("agent.ckpt_after_switch")
        e.last_ckpt = ch + 1
        e.ckpt_time = time.monotonic_ns()
        if state is not None:
            e.jacked = e.jsent  # a restart re-sends only what comes after: acked from now
        if old:
            a.free(old - 1)
        if mark and mark != old_mark:
            d.free_older(mark, old_mark)
        if j is not None and state is not None:
            if FP.ON:
                FP.hit("journal.before_snap_logged")
            body, oob = journal_pack(state)
            try:
                j.shard.snap(e.uid, e.ver, e.gen, e.jsent, e.jseen or {}, body, oob)
            except JournalError as exc:
                print(f"stealer: {exc}", file=sys.stderr)
        return state is not None

    def publish_one(self, to: int = -1) -> bool:
        """Publish one runnable agent: for an idle peer (on our deque, for a thief), or
        handed to peer ``to`` through its inbox (balance)."""
        e = self.rq.candidate() if to < 0 else self.rq.last()
        if (e is None or e.frame is not None or e.outbox or e.it is not None or e.pinned
                or (e.arrived and time.monotonic_ns() - e.arrived < COOLDOWN_NS)):
            return False
        if not self.checkpoint(e):
            return False
        self.rq.remove(e)
        e.queued = False
        h = e.h
        self.agents.pop(h, None)
        self.controls.pop(h, None)
        self.away[h] = (e, self.tries(h))
        if len(self.away) > 64:
            self._prune_away()
        # stats only, read by collect() (moving) and by the adopter (a migration if it is
        # not us taking it back): _layout.py D_OWNER
        ent = self.dir.entry(h)
        self.r.store32(ent + D_OWNER, (self.r.load32(ent + D_OWNER) & ~OWNER_MASK) | OWNER_MOVING)
        w = self.w
        if FP.ON:
            FP.hit("agent.migrate_after_ckpt")
        self.r.store64(w.lease_off, h + 1)  # leased: killed before the push, it is pushed again
        if self.a.tr.cas(h, S_RUNNING, self.who, S_QUEUED, 0) is not Outcome.OK:
            raise WorkerCrashedError(f"agent {h:#x}: its record left RUNNING|{self.who}")
        if FP.ON:
            FP.hit("agent.migrate_after_cas")
        w.c[C_MIGRATIONS] += 1
        self.r.store32(self.runnable_off, self.rq.n)  # release: fewer left for idle peers
        if to >= 0:
            while not w.inboxes[to].push(h):  # the peer starts it from its inbox (on_ping)
                time.sleep(0.0001)
            w.idle.notify_worker(to)
            return True
        if not w.deque.push(h):
            w.push_any(h)
        self.a.notify_one()
        return True

    def _prune_away(self) -> None:
        tr = self.a.tr
        for h in list(self.away):
            st = tr.state(h)
            if st is None or st[0] != S_QUEUED:
                del self.away[h]

    def stop_all(self) -> None:
        """Shutdown: every agent here stops at its next step boundary."""
        self.stopping = True
        for h, e in list(self.agents.items()):
            self.r.or64(self.dir.entry(h) + D_FLAGS, AF_STOP)  # seq_cst; read at its next turn
            e.stop = True
            self.schedule(e)
        dormant.stop_all(self, _Entry)  # (they stop now: no turn to wait for)
