"""The Host's messages: handling one, marking it done, and the replies (journal included).

:class:`Messages` is a mixin of :class:`stealer.worker.agents.host.Host`: the turn
(``Host.deliver_batch``, and inline.py's nested control turns) calls ``deliver`` for
each message; generator handlers finish through ``it_done`` (generators.py), which
calls ``handled``, ``answered`` and ``reply``; ``finish`` (leaving.py) replies to
what is left.
"""

from __future__ import annotations

import functools
import sys
import time
from types import CoroutineType, GeneratorType
from typing import Any

from stealer.agents.api import drives_itself
from stealer.agents.jblob import pack as journal_pack
from stealer.agents.jblob import sender_is_agent
from stealer.agents.message import (
    SET_STATE,
    STATE,
    agent_state,
    decode_message,
    message_chain,
    set_agent_state,
)
from stealer.errors import AgentError, AgentStopped, DeadlineExceeded, JournalError
from stealer.shared import failpoints as FP
from stealer.shared._layout import R_TSTART, S_CANCELLED, S_QUEUED, S_RUNNING, ST_ERROR, ST_OK
from stealer.shared.records import Outcome
from stealer.worker.agents.entry import _U64, C_MSGS, SKIPPED, WAITING, _Entry
from stealer.worker.outcome import encode_result

# HotPath.serve's results (native/_cqueues.pyx; the same numbers without the extension)
SERVE_EMPTY, SERVE_BREAK, SERVE_SLOW, SERVE_EXC, SERVE_GEN, SERVE_REPLY, SERVE_AFTER = range(7)



def no_handler(obj: Any, method: str) -> str:
    """The error text of a message to ``obj`` naming no handler of it."""
    name = type(obj).__qualname__
    if method == "step" and drives_itself(obj):
        return (f"{name}.step is the agent's own step (the worker calls step(ctx) while "
                "the agent runs: a self-driven agent), not a message handler; for a step "
                "that messages call (a gymnasium-style env.step(action)), set "
                "`self_driven = False` on the class")
    if method == "on_stop":
        return (f"{name}.on_stop gives the value of a stopped agent (ref.stop()); it is not "
                "a message handler")
    return f"{name} has no message handler {method!r} (handlers are its public methods)"

class Messages:
    """A message handled (``deliver``, ``handled``), and its reply (``reply``), with the
    journal's deduplication by (sender, seq) and its cache of replies (``answered``,
    ``duplicate``).

    Owns no Host attribute: its state is each entry's (``jseen``, ``rcache``,
    ``applied``, ``replay``).  Relies on the Host's ``w``, ``a``, ``dir``, ``who`` and
    ``journal``, and on ``drive`` (generators.py).  A mixin, not an object: it runs
    once per message, on the Host's state.
    """

    # -- messages --------------------------------------------------------------------------
    def deliver(self, e: _Entry, m: int) -> None:
        a = self.a
        w = self.w
        replay = e.replay > 0
        if replay:
            e.replay -= 1
        e.handled += 1
        try:
            msg = a.read_inline(m)  # one native call for a pickle stored inline
            if msg is None:
                msg = a.read_call(a.off(m))
            target, method, args, kwargs, reply, deadline, sender, seq, ack = decode_message(
                msg)
        except BaseException:  # a message that does not unpickle here: nobody to answer
            self.handled(e, m, replay)
            return
        call = reply >= 0
        if sender is not None:  # journaled: deduplicated by (sender, seq)
            if a.kind_link(a.off(m))[2] == 1:  # replayed from the journal by a recovery
                target, reply, deadline = e.h, -1, None
            rc = e.rcache
            if rc and sender in rc:  # replies its checkpoint covers now (ack 0: none)
                # in seq order: answered() adds a sender's calls as they come (were one
                # ever out of order, pruning stops at it: a reply kept longer, not lost)
                kept = rc[sender]
                while kept:
                    first = next(iter(kept))
                    if first > ack:
                        break
                    del kept[first]
                if not kept:
                    del rc[sender]
            seen = e.jseen
            if seen is None:
                seen = e.jseen = {}
            if seq <= seen.get(sender, 0):
                self.handled(e, m, replay)
                self.duplicate(e, sender, seq, reply)
                return
            if target == e.h:
                seen[sender] = seq
        if target != e.h:  # pushed into a recycled slot's mailbox by a stale ref
            self.handled(e, m, replay)
            self.reply(reply, ST_ERROR, AgentStopped(
                f"agent {target:#x} was stopped, finished or failed", target, 0))
            return
        if deadline is not None and time.monotonic() > deadline:
            self.handled(e, m, replay)
            self.reply(reply, ST_ERROR, DeadlineExceeded(
                f"the call {method!r} to agent {e.h:#x} waited past its deadline", e.h, e.gen))
            return
        if replay and self.steps_before_raw(m) & SKIPPED:
            self.handled(e, m, replay)  # cancelled before it started, the first time too
            return
        if not replay:  # for an exact replay: how many steps came before this message
            _U64.pack_into(a.mm, a.off(m) + R_TSTART, e.steps)
        hook = method == "on_stop" or (method == "step" and drives_itself(e.obj))
        fn = None if hook else getattr(e.obj, method, None)
        if fn is None and method in (STATE, SET_STATE):  # every agent's two (message.py)
            fn = functools.partial(agent_state if method == STATE else set_agent_state, e.obj)
        if fn is None or not callable(fn):
            self.handled(e, m, replay)
            self.reply(reply, ST_ERROR, AttributeError(no_handler(e.obj, method)))
            return
        claimed = False
        if call and sender is None and not replay:  # (journaled: see claim)
            got = self.claim(reply)
            if got is None:  # its caller cancelled it before it started: not run
                _U64.pack_into(a.mm, a.off(m) + R_TSTART, e.steps | SKIPPED)
                self.handled(e, m, replay)
                return
            if got:
                claimed = True
            else:
                reply = -1  # a stale slot: nobody to answer
        e.msgs += 1
        e.events += 1
        w.c[C_MSGS] += 1
        w.in_body = True
        try:
            res = fn(*args, **kwargs) if kwargs else fn(*args)
        except BaseException as exc:
            w.in_body = False
            self.handled(e, m, replay)
            enc = (self.answered(e, sender, seq, call, reply, ST_ERROR, exc)
                   if sender is not None and self.journal is not None else None)
            self.reply(reply, ST_ERROR, exc, enc, claimed)  # the caller's; the agent goes on
            return
        w.in_body = False
        if type(res) is GeneratorType or type(res) is CoroutineType:  # (async def: the same)
            e.it = res
            # (the calls' chain above its caller: Calls.waiters)
            e.it_msg = (m, -1 if replay else reply, replay, sender, seq, call,
                        message_chain(msg) if reply >= 0 and not replay else ())
            self.drive(e, None, None)
            return
        self.handled(e, m, replay)
        enc = (self.answered(e, sender, seq, call, reply, ST_OK, res)
               if sender is not None and self.journal is not None else None)
        self.reply(reply, ST_OK, res, enc, claimed)
        if e.state == WAITING and e.want_step is False and drives_itself(e.obj):
            e.want_step = True  # ctx.wait(): step again once a message was handled

    def served(self, e: _Entry, code: int, x: Any, y: Any, z: Any) -> None:
        """What HotPath.serve (Host.deliver_batch) left to finish here, as deliver would:
        a handler that raised or is a generator, a reply that is not a small pickle or not
        stored inline (its codes: native/_cqueues.pyx)."""
        if code == SERVE_EXC:  # (m, reply, exception): the caller gets it; the agent goes on
            self.handled(e, x, False)
            self.reply(y, ST_ERROR, z, None, True)  # (serve claimed its slot at the start)
            return
        if code == SERVE_GEN:  # (m, reply, generator)
            e.it = z
            e.it_msg = (x, y, False, None, 0, y >= 0, ())  # (nine fields: no chain)
            self.drive(e, None, None)
            return
        if code == SERVE_REPLY:  # (reply, -, value): handled and done; the native writer
            # refused the value already: straight to the Pickler
            self.reply(x, ST_OK, z, encode_result(ST_OK, z, fast=False), True)
        else:  # SERVE_AFTER (reply, c_finish's result, data): handled and done
            self.after_inline(x, y, (ST_OK, z, []))
        if e.state == WAITING and e.want_step is False and drives_itself(e.obj):
            e.want_step = True  # ctx.wait(): step again once a message was handled

    def handled(self, e: _Entry, m: int, replay: bool) -> None:
        if FP.ON:
            FP.hit("agent.after_handler")
        e.applied = m + 1  # its effect is in the state now (a checkpoint may cover it)
        if replay:
            return  # D_DONE is already past it (never move it back) and its slot was returned
        if not FP.ON:
            self.dir.msg_done(e.h, m)  # both steps below, in one native call
            return
        self.dir.mark_done(e.h, m)
        FP.hit("agent.after_mark_done")
        self.dir.give_back(e.h)

    # -- the journal: replies and duplicates ------------------------------------------------
    def answered(self, e: _Entry, sender: str, seq: int, call: bool, reply: int, status: int,
                 value: Any) -> tuple | None:
        """Message #seq from ``sender`` was handled.  If it was a call from an agent: keep
        the reply until the caller's checkpoint covers the call (a caller restarted from an
        older checkpoint calls again and gets it from here, see deliver's ``ack``), and log
        it (a caller replaying after a recovery takes it instead of calling again).
        Returns the encoded reply (encode_result), which :meth:`reply` stores as is."""
        if not call or not sender_is_agent(sender):
            return None
        if e.rcache is None:
            e.rcache = {}
        kept = e.rcache.get(sender)
        if kept is None:
            kept = e.rcache[sender] = {}
        kept[seq] = (status, value)
        if reply < 0:
            return None  # a one-way send, or a call replayed from the journal (logged before)
        enc = self.w.encode_result(status, value)
        body, oob = journal_pack(enc[1:])
        try:
            self.journal.shard.reply(sender, seq, enc[0], body, oob)
        except JournalError as exc:
            print(f"stealer: {exc}", file=sys.stderr)
        if FP.ON:
            FP.hit("journal.after_reply_logged")
        return enc

    def duplicate(self, e: _Entry, sender: str, seq: int, reply: int) -> None:
        """Message #seq of ``sender`` was applied before (a replay sent it again)."""
        if reply < 0:
            return
        kept = e.rcache.get(sender) if e.rcache else None
        c = kept.get(seq) if kept else None
        if c is not None:
            self.reply(reply, c[0], c[1])
            return
        self.reply(reply, ST_ERROR, AgentError(
            f"call #{seq} from {sender} to agent {e.h:#x} was made again by a replay after "
            "a crash, and its first reply is gone: it is not run twice", e.h, e.gen))

    def claim(self, rh: int) -> bool | None:
        """A call's handler is about to start: its reply slot QUEUED|0 -> RUNNING|who, so
        that its caller's ``cancel()`` fails from now on (a Future's contract: True only
        for a call that will not run).  True: claimed; None: the caller cancelled it (the
        slot released; the handler must not run); False: no slot to answer (a stale one,
        its reply sent before a worker death; the handler runs, nobody hears it).  A slot
        still RUNNING for a dead worker is waited for: its recovery puts it back QUEUED.

        Not for a journaled call (deliver does not call this): the journal has it and a
        recovery would replay it, so it always runs, and its caller's cancel() says False
        (client/agents.py, ``_st_keep``)."""
        tr = self.a.tr
        for _ in range(20000):  # (a recovery in progress: at most ~2 s)
            if tr.cas(rh, S_QUEUED, 0, S_RUNNING, self.who) is Outcome.OK:
                if FP.ON:
                    FP.hit("agent.reply_after_claim")
                return True
            st = tr.state(rh)
            if st is not None and st[0] == S_CANCELLED:
                self.a.release(rh, S_CANCELLED, 0, self.who)  # the caller gave up on it
                return None
            if st is None or st[0] != S_RUNNING or st[1] == self.who:
                return False  # (DONE: answered before a worker death; None: freed since)
            time.sleep(0.0001)  # RUNNING for a dead worker, not requeued yet
        return False

    def reply(self, rh: int, status: int, value: Any, enc: tuple | None = None,
              claimed: bool = False) -> None:
        """Store a reply in slot ``rh`` (QUEUED, made by the caller; RUNNING|who if
        ``claimed`` at the handler's start) and publish it (``enc``: the reply already
        encoded by :meth:`answered`)."""
        if rh < 0:
            return
        a = self.a
        w = self.w
        if not FP.ON:  # (failpoints: the Python path below, which has them)
            if enc is None:
                enc = encode_result(status, value)
            if not enc[2]:
                # (claim +) store + finish + publish in one call (HotPath.reply_inline,
                # finish_inline)
                done = (a.finish_inline(rh, enc[0], enc[1], w.completions, self.who)
                        if claimed else
                        a.reply_inline(rh, enc[0], enc[1], w.completions, self.who))
                if done != 1 and done != -1:
                    self.after_inline(rh, done, enc)
                return
        tr = a.tr
        if not claimed:
            if tr.cas(rh, S_QUEUED, 0, S_RUNNING, self.who) is not Outcome.OK:
                self.unclaimed(rh)
                return
            if FP.ON:
                FP.hit("agent.reply_after_claim")
        kind, _status, link = a.kind_link(a.off(rh))
        if enc is None:
            w.report(rh, kind, link, status, value)
        else:
            w.report_encoded(rh, kind, link, *enc)

    def after_inline(self, rh: int, done: int, enc: tuple) -> None:
        """reply_inline (or HotPath.serve) returned ``done`` (-3, 0 or 2) for reply ``enc``
        to slot ``rh``: finish as it says."""
        if done == -3:
            self.unclaimed(rh)
            return
        a = self.a
        kind, _status, link = a.kind_link(a.off(rh))
        if done == 2:
            self.w.publish_child(kind, link)
        else:  # 0: too large to sit inline; the slot is ours (RUNNING|who)
            self.w.report_encoded(rh, kind, link, *enc)

    def unclaimed(self, rh: int) -> None:
        """Reply slot ``rh`` was not QUEUED|0 when we came to answer it."""
        a = self.a
        st = a.tr.state(rh)
        if st is not None and st[0] == S_CANCELLED:
            a.release(rh, S_CANCELLED, 0, self.who)  # the caller gave up on it
        # else stale: a replayed message whose reply was sent before
