"""The Host's arrivals: adopting an agent its worker just started, and notifications.

:class:`Adoption` is a mixin of :class:`stealer.worker.agents.host.Host`: the worker calls
``Host.adopt`` when it starts an agent record (stealer/worker/loop.py) and ``Host.notify`` for
each inbox entry of an agent (a message, a reply, a child, a stop); the turn
(host.py) and every other piece call :meth:`Adoption.schedule`.
"""

from __future__ import annotations

import collections
import time
from typing import Any

from stealer.agents.api import Ctx, drives_itself
from stealer.agents.options import DEFAULT_OPTIONS, AgentOptions
from stealer.shared import failpoints as FP
from stealer.shared._layout import (
    AF_STOP,
    D_CKPT,
    D_FLAGS,
    D_GEN,
    D_OWNER,
    MIGR_SHIFT,
    OWNER_MASK,
    OWNER_MOVING,
    R_TRIES,
    R_TSTART,
    ST_ERROR,
)
from stealer.worker.agents import dormant
from stealer.worker.agents.entry import (
    _U32,
    _U64,
    C_THROTTLED,
    FINISHED,
    RUNNABLE,
    SKIPPED,
    SLEEPING,
    SUSPENDED,
    WAITING,
    _Entry,
)


class Adoption:
    """Adopting an agent (its entry built from its spawn or its checkpoint) and the inbox
    notifications that make it runnable.

    Owns: ``opts_cache`` (the shared AgentOptions), the scheduling of an entry on ``rq``
    (``schedule``, ``_tier``) and the walk of its mailbox (``take``).
    Relies on the Host's ``w``, ``a``, ``r``, ``dir``, ``who``, ``agents``, ``controls``, ``bal``,
    ``dormant``, ``away`` (an agent we published and take back), ``stopping`` and ``rq``,
    and on ``finish`` (leaving.py) and ``ready`` (generators.py).  A mixin, not
    an object of its own: ``schedule`` runs at every turn, and these methods read the
    Host's state throughout.
    """

    # -- adopting an agent (its record was just started by this worker) -----------------
    def adopt(self, h: int, kind: int, link: int, got: Any = None) -> None:
        """Agent ``h`` was started by this worker: it lives here now.  ``got``: what
        Turns.adopt already returned for it (Turns.start calls it), None if not asked."""
        quick = self.quick
        if quick is not None:  # an agent fresh from its spawn, held dormant: Turns.adopt
            if got is None:
                got = quick.adopt(h, link)
            if got == 1:
                return
            if got == 2:
                dormant.built(self, h, _Entry)
                return
            if got:  # its constructor raised
                dormant.failed(self, h, link, _Entry, *got)
                return
        d = self.dir
        r = self.r
        ent = d.entry(h)
        if FP.ON:
            FP.hit("agent.adopt")
        d.clear_notified(h)  # before the walk (mailbox.py); a dead owner may have left it set
        if self.stopping:  # shutting down: it stops at its first turn here
            r.or64(ent + D_FLAGS, AF_STOP)  # seq_cst: read by our own turn
        # stats only, read by collect(): ours now, its migrations kept (_layout.py D_OWNER)
        owner = r.load32(ent + D_OWNER)
        r.store32(ent + D_OWNER, (owner & ~OWNER_MASK) | self.who)
        e, tries = self.away.pop(h, (None, 0)) if self.away else (None, 0)
        ck = r.load64(ent + D_CKPT)  # acquire: pairs with checkpoint()'s store
        # we published it and took it back, and nobody ran it in between: an owner that
        # handled messages and died before checkpointing leaves the same checkpoint but
        # a moved D_DONE and one more R_TRIES (then: restore, replay, a new generation)
        if (e is not None and e.last_ckpt == ck and tries == self.tries(h)
                and d.done_mark(h) == self._ckpt_mark(ck)):
            e.pending = None
            e.replay = 0
            e.seen = self._ckpt_mark(ck)
            e.stop = bool(d.flags(h) & AF_STOP)
            self.agents[h] = e
            if e.tier == 0:
                self.controls[h] = e
            self.take(e)
            self.schedule(e)
            return
        if (owner & OWNER_MASK) == OWNER_MOVING and owner >> MIGR_SHIFT < OWNER_MASK:
            # published by a peer (or by us, then run elsewhere): one more migration
            self.r.store32(d.entry(h) + D_OWNER, owner + (1 << MIGR_SHIFT) - OWNER_MOVING
                           + self.who)
            self.bal.got()  # a move back takes a bigger gap for a while (balance.py)
        spawn = None
        if not ck:  # from its spawn: kept dormant if it has nothing to do (dormant.py)
            spawn = dormant.adopt(self, h, link, _Entry, ent)
            if spawn is None:
                return
        e = _Entry(h, link)
        self.agents[h] = e
        try:
            cls, args, kwargs, jinfo = self.spawned(e, spawn or self.a.read_call(self.a.off(h)))
            saved = self.a.read_call(self.a.off(ck - 1)) if ck else None
            if saved is not None:
                obj, gen, steps, msgs, tries, _sched, jstate = saved
                e.obj = obj
                # a new generation per worker death since the checkpoint, not per move
                e.gen = gen + self.tries(h) - tries
                if jstate is not None:
                    _uid, e.ver, e.jseen, e.jsent, e.jspawned = jstate[:5]
                    e.jacked = e.jsent
                    e.rcache = jstate[5] if len(jstate) > 5 else None
                    if jinfo is not None and ck == jinfo[3]:  # the snapshot recovered from
                        e.gen = gen + 1 + self.tries(h)  # the journal: a new generation
                e.steps, e.msgs = steps, msgs
                e.last_ckpt = ck
                e.arrived = time.monotonic_ns()  # moved (or restarted): it stays a while
                mark = self._ckpt_mark(ck)
            else:  # from the spawn (the messages a stateless checkpoint covered are gone)
                mark = self._ckpt_mark(ck)
                e.gen = self.tries(h)  # re-run from the spawn after worker deaths
                if jinfo is not None and jinfo[3] < 0:
                    e.gen += 1  # recovered from the journal (it had no snapshot)
                self.w.in_body = True
                try:
                    e.obj = cls(*args, **kwargs) if kwargs else cls(*args)
                finally:
                    self.w.in_body = False
            self.r.store32(d.entry(h) + D_GEN, e.gen)  # stats only: read by collect()
        except BaseException as exc:
            e.seen = self.dir.done_mark(h)
            self.finish(e, ST_ERROR, exc)
            return
        e.seen = mark
        e.applied = mark
        e.stop = bool(d.flags(h) & AF_STOP)
        if saved is not None:  # where it was in its life: stepping, waiting or sleeping
            e.state, e.want_step, e.wake_at = saved[5]
            recovered = jinfo is not None and ck == jinfo[3]  # another boot's clock
            if e.state == SLEEPING and (recovered or e.wake_at <= time.monotonic()):
                e.state, e.want_step = RUNNABLE, True
        else:
            e.want_step = drives_itself(e.obj)
            e.state = RUNNABLE if e.want_step else WAITING
        self.take(e)
        done = d.done_mark(h)
        if done and done != mark and e.pending:  # handled before a restore: replayed first
            for i, m in enumerate(e.pending):
                if m + 1 == done:
                    e.replay = i + 1
                    break
        e.win_start = time.monotonic_ns()
        if e.tier == 0:
            self.controls[h] = e
        self.schedule(e)

    def spawned(self, e: _Entry, spawn: tuple) -> tuple:
        """Fill ``e`` from its record's spawn payload; (cls, args, kwargs, jinfo)."""
        cls, args, kwargs, opts, deadline_at = spawn[:5]
        jinfo = spawn[5] if len(spawn) > 5 else None
        if jinfo is not None:
            e.uid = jinfo[0]
            e.jreplies = dict(jinfo[2]) if jinfo[2] else None
        if type(cls) is int:
            cls = self.w.fns.get(cls)
        e.cls = cls
        e.spawn_args = (args, kwargs)
        e.opts = self.options(opts)
        e.tier = e.opts.tier
        e.deadline = deadline_at
        if deadline_at is not None:
            e.deadline_ns = int(deadline_at * 1e9)
        return cls, args, kwargs, jinfo

    def _ckpt_mark(self, ck: int) -> int:
        if not ck:
            return 0
        return self.a.kind_link(self.a.off(ck - 1))[2]

    def steps_before(self, m: int) -> int:
        """Steps the agent had run when it first handled message ``m`` (deliver wrote it)."""
        return self.steps_before_raw(m) & ~SKIPPED

    def steps_before_raw(self, m: int) -> int:
        """:meth:`steps_before` with its SKIPPED bit (a call cancelled before it started)."""
        return _U64.unpack_from(self.a.mm, self.a.off(m) + R_TSTART)[0]

    def tries(self, h: int) -> int:
        """Times the agent's record was re-queued after a worker death (R_TRIES)."""
        return _U32.unpack_from(self.a.mm, self.a.off(h) + R_TRIES)[0]

    def new_ctx(self, e: _Entry) -> Ctx:
        e.ctx = Ctx(self, e)
        return e.ctx

    def options(self, t: tuple | None) -> AgentOptions:
        """One shared (frozen) AgentOptions per distinct option tuple (None: the defaults)."""
        if t is None:
            return DEFAULT_OPTIONS
        o = self.opts_cache.get(t)
        if o is None:
            if len(self.opts_cache) > 1024:
                self.opts_cache.clear()
            o = self.opts_cache[t] = AgentOptions.from_worker(t)
        return o

    # -- notifications (inbox) ----------------------------------------------------------
    def notify(self, h: int) -> bool:
        """An inbox entry for ``h``: new messages, a reply, a child, a stop. False if ``h``
        is not an agent of ours."""
        e = self.agents.get(h)
        if e is None:
            e = dormant.thaw(self, h, _Entry) if self.dormant else None
            if e is None:
                return False
        # NOTIFIED cleared, the new messages, then the flags: a stop is never missed
        flags, e.seen, got = self.dir.take_mail(h, e.seen)
        self.add_pending(e, got)
        if flags & AF_STOP:
            e.stop = True
            self.schedule(e)
        elif e.state == SUSPENDED:
            if self.ready(e):
                self.schedule(e)
        elif e.pending or e.outbox:
            self.schedule(e)
        return True

    def take(self, e: _Entry) -> None:
        got, e.seen = self.dir.take(e.h, e.seen)
        self.add_pending(e, got)

    @staticmethod
    def add_pending(e: _Entry, got: list[int]) -> None:
        """Messages taken from the mailbox (oldest first) join the agent's pending ones."""
        if got:
            if e.pending is None:
                e.pending = collections.deque(got)
            else:
                e.pending.extend(got)

    def schedule(self, e: _Entry, now_ns: int = 0) -> None:
        if e.queued or e.state == FINISHED or (e.blocked and not e.stop):
            return
        e.queued = True
        e.ready_at = now_ns or time.monotonic_ns()
        self.rq.push(e, self._tier(e) if e.opts.cpu_share is not None else e.tier)

    def _tier(self, e: _Entry) -> int:
        share = e.opts.cpu_share
        if share is not None and e.win_cpu > 0:
            dt = time.monotonic_ns() - e.win_start
            if dt > 0 and e.win_cpu / dt > share:
                self.w.c[C_THROTTLED] += 1
                return 2  # over its share: demoted to bulk
        return e.tier
