"""The worker's side of agents: the agents a worker holds, their turns, their moves.

An agent record (``K_ROOT | F_AGENT``) that a worker starts (QUEUED ->
RUNNING|k, the core's ordinary ``start``) becomes an agent living in that
worker's heap: :meth:`Host.adopt` builds it (``__init__`` from the spawn
payload, or the latest checkpoint plus a replay of the mailbox chain above
its mark, see mailbox.py) and the record stays RUNNING|k while it lives
here.  No second scheduler: the worker loop (stealer/worker.py) gives a
*turn* to the next runnable agent of :class:`RunQueue` between its other
work, and an agent that leaves (migration, done) goes back through the
record's transitions:

* migrate: checkpoint (state pickled once, numpy out-of-band) ->
  RUNNING|k -> QUEUED -> pushed on this worker's deque, only while a peer
  is idle (private deques: nothing is published or pickled otherwise).
  Whoever starts it next owns it; if that is us, the object in our heap is
  used again without unpickling.
* done / stopped / failed: the mailbox is closed, unhandled calls get
  AgentStopped, the final value is stored and RUNNING|k -> DONE|k
  publishes it like any root task's result.
* worker death: the record is RUNNING|dead; the client's recovery re-queues
  it (retries) and the next worker adopts it from its checkpoint.

A turn: the agent's new messages are handled (FIFO, up to MSG_BATCH per
turn), then one step if it wants one.  Handlers and steps may be
generators that yield what they wait for (a reply, a blocking call,
fork-join children); the agent is then *suspended* (not in the run queue)
until a notification (inbox) says it may go on.
"""

from __future__ import annotations

import collections
import functools
import heapq
import os
import signal
import struct
import sys
import time
from types import GeneratorType
from typing import Any

from stealer import failpoints as FP
from stealer import metrics, serialize
from stealer._layout import (
    AF_CONTROL,
    AF_STOP,
    D_CKPT,
    D_CPU_NS,
    D_FLAGS,
    D_GEN,
    D_MSGS,
    D_OWNER,
    D_STEPS,
    F_AGENT,
    K_CKPT,
    K_MASK,
    K_MSG,
    K_REPLY,
    K_ROOT,
    R_TRIES,
    R_TSTART,
    S_CANCELLED,
    S_DONE,
    S_QUEUED,
    S_RUNNING,
    ST_ERROR,
    ST_OK,
)
from stealer.agents import api, dormant, inline
from stealer.agents.api import AgentRef, Ctx, Done, Pending, PendingAll, Sleep, Wait
from stealer.agents.client import AGENT_FID, encode_message
from stealer.agents.jblob import pack as journal_pack
from stealer.agents.jblob import sender_is_agent
from stealer.agents.mailbox import Directory
from stealer.agents.options import DEFAULT_OPTIONS, AgentOptions
from stealer.agents.placement import COOLDOWN_NS, move_cost_ns, moves_to_busy, pays_to_idle
from stealer.agents.runqueue import RunQueue
from stealer.errors import (
    AgentError,
    AgentStopped,
    DeadlineExceeded,
    JournalError,
    MailboxFull,
    NotInTaskError,
    StepTimeout,
    WorkerCrashedError,
    result_value,
    with_remote_tb,
)
from stealer.forkjoin import children_of
from stealer.records import Outcome
from stealer.shm import (
    H_PARKED,
    H_SEARCHING,
    H_STOP_AGENTS,
    W_CURRENT,
    W_PID,
    W_RUNNABLE,
    W_STATE,
    W_STEP_DEADLINE,
)

__all__ = ["Host"]

MSG_BATCH = 16  # messages an agent handles per turn before the others get theirs
FLUSH_NS = 50_000_000  # publish the worker's counters at least this often while agents run
THROTTLE_WINDOW_NS = 100_000_000  # over which an agent's CPU share is measured
_U32 = struct.Struct("=I")
_U64 = struct.Struct("=Q")
_C = {name: i for i, name in enumerate(metrics.COUNTERS)}  # the worker's counter indices
C_BUSY_NS, C_STEPS, C_MSGS = _C["busy_ns"], _C["agent_steps"], _C["agent_messages"]
C_MIGRATIONS, C_THROTTLED, C_RESUMES = _C["migrations"], _C["throttled"], _C["resumes"]
C_PREEMPT, C_INLINE = _C["preempt_publishes"], _C["inline_controls"]
READY = 1  # stealer.worker.STATE_READY

def _unpicklable(obj: Any) -> str:
    """Which attribute of an agent keeps it from pickling (for the error message)."""
    for k, v in (getattr(obj, "__dict__", None) or {}).items():
        try:
            serialize.dumps(v)
        except BaseException:
            return f"its attribute {k!r} ({type(v).__name__}) does not pickle"
    return "its state does not pickle"


def _api(fn: Any) -> Any:
    """A Host method a step may call: the preemption signal handler leaves it alone."""

    @functools.wraps(fn)
    def call(self: Host, *args: Any) -> Any:
        self.in_api += 1
        try:
            return fn(self, *args)
        finally:
            self.in_api -= 1

    return call


# what an entry is doing
RUNNABLE, WAITING, SLEEPING, SUSPENDED, FINISHED = range(5)


class _Entry:
    """One agent living in this worker's heap."""

    # (its states, for dormant.py, which cannot import this module)
    RUNNABLE = RUNNABLE
    WAITING = WAITING

    __slots__ = (
        "applied",
        "arrived",
        "blocked",
        "ckpt_ns",
        "ckpt_time",
        "cls",
        "cpu_ns",
        "ctx",
        "cur",
        "deadline",
        "deadline_ns",
        "events",
        "frame",
        "gen",
        "h",
        "handled",
        "it",
        "it_msg",
        "jacked",
        "jreplies",
        "jseen",
        "jsent",
        "jspawned",
        "last_ckpt",
        "link",
        "msgs",
        "obj",
        "opts",
        "outbox",
        "pending",
        "pinned",
        "queued",
        "rcache",
        "ready_at",
        "replay",
        "restarts",
        "seen",
        "spawn_args",
        "state",
        "steps",
        "stop",
        "tier",
        "turn_ns",
        "uid",
        "ver",
        "waiting",
        "wake_at",
        "want_step",
        "win_cpu",
        "win_start",
    )

    def __init__(self, h: int, link: int) -> None:
        self.h = h
        self.link = link
        self.obj: Any = None
        self.cls: Any = None
        self.spawn_args: tuple = ((), None)
        self.opts = AgentOptions()
        self.tier = 1
        self.deadline: float | None = None
        self.gen = 0
        self.state = RUNNABLE
        self.want_step = True
        self.queued = False
        # made on first use: a million idle agents hold no deques (see Host.take, _send)
        self.pending: collections.deque[int] | None = None
        self.replay = 0  # the first `replay` pending messages were handled before a restore
        self.applied = 0  # handle + 1 of the newest message whose effect is in obj (0: none)
        self.seen = 0  # the mailbox head value walked up to
        self.it: Any = None  # a suspended generator (step or handler)
        # (message, reply, replay, sender, seq) of a suspended handler
        self.it_msg: tuple | None = None
        self.waiting: Any = None
        self.frame: Any = None  # fork-join frame of children spawned in this agent
        self.wake_at = 0.0
        self.ready_at = 0
        self.outbox: collections.deque[tuple[int, int]] | None = None
        self.blocked = False
        self.pinned = False  # its state does not pickle: it never moves
        self.stop = False  # AF_STOP seen (adopt, notify, stop_all): stops at its next turn
        self.events = 0  # steps + messages since the last checkpoint
        self.last_ckpt = 0  # D_CKPT value of our latest checkpoint
        self.ckpt_time = time.monotonic_ns()
        self.steps = 0
        self.msgs = 0
        self.handled = 0  # messages handled in the current turn
        self.cpu_ns = 0
        # placement (placement.py): run time per turn (moving average), the last
        # checkpoint's pickling time, when it moved here (0: spawned here)
        self.turn_ns = 0
        self.ckpt_ns = 0
        self.arrived = 0
        self.win_start = 0  # monotonic ns
        self.cur = (h, K_ROOT | F_AGENT, link)  # the worker's `cur` while it runs (spawn())
        self.deadline_ns = 0
        self.win_cpu = 0
        self.restarts: list[float] | None = None
        self.ctx: Ctx | None = None  # made at the first step or handler
        # the journal (journal.py): durable id, snapshot version, messages applied per
        # sender (seq), messages sent and agents spawned so far, replies logged for calls
        # a replay makes again, and the last reply given to each calling agent
        self.uid: str | None = None
        self.ver = 0
        self.jseen: dict[str, int] | None = None
        self.jsent = 0
        self.jacked = 0  # jsent when the latest checkpoint was taken: the `ack` we send
        self.jspawned = 0
        self.jreplies: dict[int, tuple] | None = None
        # per calling agent: seq -> (status, value) of the calls answered that the caller's
        # checkpoint may not cover yet (pruned by the `ack` of its later messages)
        self.rcache: dict[str, dict[int, tuple]] | None = None


class CallPending(Pending):
    """A call made by an agent: the reply arrives in record ``rh`` (K_REPLY)."""

    __slots__ = ("rh",)

    def __init__(self, rh: int) -> None:
        super().__init__()
        self.rh = rh


class Host:
    """The agents of one worker (created by stealer.worker.Worker)."""

    SUSPENDED = SUSPENDED  # (agents/inline.py)
    c_inline = C_INLINE

    def __init__(self, w: Any) -> None:
        self.w = w
        self.a = w.arena
        self.r = w.r
        self.name = w.name
        self.who = w.who
        self.k = w.k
        self.dir = Directory(w.r, w.arena, w.seg.layout.offsets["agents"], w.inboxes, w.idle,
                             worker_base=w.seg.layout.worker if w.native else None)
        self.agents: dict[int, _Entry] = {}
        self.controls: dict[int, _Entry] = {}  # the control-tier agents of agents (inline.py)
        self.nested = False  # a control agent's turn inside a step runs (inline.py)
        self.nested_ns = 0  # time of those turns, taken off the running step's
        self.alarm_due = False  # the step's timer fired during a nested turn
        self.dormant: dict[int, Any] = {}  # handle -> object of an agent idle since its spawn
        # published for a thief (with its R_TRIES then): ours again if we start it
        self.away: dict[int, tuple[_Entry, int]] = {}
        self.rq = RunQueue()
        self.timers: list[tuple[float, int, _Entry]] = []
        self.tseq = 0
        self.blocked: list[_Entry] = []  # agents whose sends wait for room
        self.task_sends = _Entry(-1, 0)  # the outbox of plain tasks' sends (never a turn)
        self.task_sends.state = FINISHED
        self.blocking: Any = None  # thread pool of run_blocking, made on first use
        self.current: _Entry | None = None
        self.in_step = False
        self.turns = 0
        self.step_deadline_off = w.wbase + W_STEP_DEADLINE
        self.stopping = False
        self._alarm = False
        self.opts_cache: dict[tuple, AgentOptions] = {}
        self.flushed = 0  # monotonic ns of the last counter flush
        self.peers_mask = ((1 << min(64, w.n)) - 1) & ~(1 << w.k if w.k < 64 else 0)
        self.runnable_off = w.wbase + W_RUNNABLE
        self.in_api = 0  # > 0 while a step calls into us (send, call, spawn_agent...)
        self.poked: dict[int, int] = {}  # peer -> monotonic ns we last asked it for an agent
        self.turn_avg = 0  # ns per turn over every agent here (moving average): backlogs
        self.bal_prev = -1  # the peer balance() found short at its previous check
        # An idle peer asks (SIGUSR1) for one of the agents waiting behind our long step;
        # only with the native queues: the reference queues' lock is not reentrant.
        self.preempt = w.native
        self.balancing = w.n > 1
        self.journal: Any = getattr(w, "journal", None)  # journal.WorkerJournal or None
        if self.journal is not None:
            api._remap.append(self._remap)
        if self.preempt:
            signal.signal(signal.SIGUSR1, self._on_request)
            signal.signal(inline.SIGNAL, self._on_control)

    # -- the worker loop's questions -------------------------------------------------
    def poll(self) -> None:
        """Wake due sleepers and retry blocked sends (cheap when there are none)."""
        if self.timers:
            now = time.monotonic()
            timers = self.timers
            agents = self.agents
            while timers and timers[0][0] <= now:
                _t, _s, e = heapq.heappop(timers)
                if agents.get(e.h) is not e:
                    continue  # it moved to another worker (or finished) since it slept
                if e.state == SLEEPING and e.wake_at <= now:
                    e.state = RUNNABLE
                    e.want_step = True
                    self.schedule(e)
                elif e.state == WAITING and e.deadline is not None and e.deadline <= now:
                    self.schedule(e)  # its turn fails it with DeadlineExceeded
        if self.blocked:
            self.flush_outboxes()

    def has_work(self) -> bool:
        return bool(self.rq.n) or (bool(self.timers) and self.timers[0][0] <= time.monotonic())

    # -- adopting an agent (its record was just started by this worker) -----------------
    def adopt(self, h: int, kind: int, link: int) -> None:
        d = self.dir
        if FP.ON:
            FP.hit("agent.adopt")
        d.clear_notified(h)  # before the walk (mailbox.py); a dead owner may have left it set
        if self.stopping:  # shutting down: it stops at its first turn here
            self.r.or64(d.entry(h) + D_FLAGS, AF_STOP)  # seq_cst: read by our own turn
        self.r.store32(d.entry(h) + D_OWNER, self.who)  # stats only: read by collect()
        e, tries = self.away.pop(h, (None, 0))
        ck = self.r.load64(d.entry(h) + D_CKPT)  # acquire: pairs with checkpoint()'s store
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
        spawn = None
        if not ck:  # from its spawn: kept dormant if it has nothing to do (dormant.py)
            spawn = dormant.adopt(self, h, link, _Entry)
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
            e.want_step = hasattr(e.obj, "step")
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
        self.dir.clear_notified(h)
        self.take(e)
        if self.dir.flags(h) & AF_STOP:  # read after clearing NOTIFIED: a stop is never missed
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

    # -- a turn -----------------------------------------------------------------------
    def run_next(self) -> None:
        e = self.rq.pop()
        if e is None:
            return
        e.queued = False
        if e.state == FINISHED:
            return
        self.turns += 1
        r = self.r
        r.store32(self.runnable_off, self.rq.n)  # release: read by idle peers (poke_peers)
        # a peer searching or parked (first 64 workers; relaxed loads: a hint, re-checked
        # by the thief's own steal): publish one more runnable agent for it, if that pays
        if self.rq.n:
            idle = (r.load64(H_SEARCHING) | r.load64(H_PARKED)) & self.peers_mask
            if idle and self.pays_to_idle(e, idle):
                self.publish_one()
        if self.turns & 7 == 0 and self.rq.n >= 2 and self.balancing:
            self.balance()
        if self.turns & 63 == 0:
            if not self.stopping and self.r.load32(H_STOP_AGENTS):
                self.stop_all()
            if self.turns & 1023 == 0 and self.w.client.gone():
                self.w.orphaned()  # our client died while agents kept us busy: exit
        self.turn(e)

    def turn(self, e: _Entry) -> None:
        w = self.w
        r = self.r
        r.store64(w.cur_off, e.h + 1)  # release: read by the recoverer after our death
        w.cur = e.cur
        w.frame = e.frame
        self.current = e
        t0 = time.monotonic_ns()
        metrics_on = w.metrics_on
        if metrics_on:
            r.hist_record(w.mbase_tier_wait[e.tier], t0 - e.ready_at)
        e.handled = 0
        try:
            if e.stop:
                self.stop_entry(e)
                return
            if e.deadline is not None and t0 > e.deadline_ns:
                self.finish(e, ST_ERROR, DeadlineExceeded(
                    f"agent {e.h:#x} missed its deadline", e.h, e.gen))
                return
            if e.state == SUSPENDED:
                if not self.ready(e):
                    return
                self.resume(e)
            if e.pending:
                self.deliver_batch(e)
                if e.state >= SUSPENDED or e.blocked or e.stop:
                    return
            if e.want_step and e.state <= WAITING:
                self.step(e)
        finally:
            self.current = None
            w.frame = None
            w.cur = None
            r.store64(w.cur_off, 0)
            t1 = time.monotonic_ns()
            dt = t1 - t0
            if self.nested_ns:  # control turns ran inside this one (inline.py): theirs
                dt = max(0, dt - self.nested_ns)
                self.nested_ns = 0
            if e.tier == 0:
                w.flush_client()  # a control agent's replies go out now
            e.cpu_ns += dt
            e.win_cpu += dt
            # moving averages of the run time per turn (placement.py); a sample counts for
            # at most 4x the average: a turn preempted by another process, or the first
            # one after a restore, does not make every agent look long
            e.turn_ns = dt if not e.turn_ns else (3 * e.turn_ns + min(dt, 4 * e.turn_ns)) >> 2
            avg = self.turn_avg
            self.turn_avg = dt if not avg else (7 * avg + min(dt, 4 * avg)) >> 3
            w.c[C_BUSY_NS] += dt
            if metrics_on:
                r.hist_record(w.mbase_tier_run[e.tier], dt)
                if t0 - self.flushed > FLUSH_NS:
                    self.flushed = t0
                    w.flush()  # counters reach stats() while agents keep the worker busy
            if e.state != FINISHED:
                self.after_turn(e, t1)

    def deliver_batch(self, e: _Entry) -> None:
        """Handle the agent's pending messages, up to MSG_BATCH (a turn's, or a nested
        control turn's: inline.py)."""
        while e.pending and e.state < SUSPENDED and not e.blocked:
            if e.handled >= MSG_BATCH:
                break
            # ref.stop() during the batch: its ping waits in our inbox until this turn
            # ends (16 slow handlers: seconds), so look at the flag itself; the next turn
            # stops it, as a stop seen at a ping does
            if e.handled and self.dir.flags(e.h) & AF_STOP:
                e.stop = True
                break
            if (e.replay and e.want_step and e.state <= WAITING
                    and e.steps < self.steps_before(e.pending[0])):
                break  # replay: the steps that came before this message come first
            self.deliver(e, e.pending.popleft())

    def after_turn(self, e: _Entry, now_ns: int = 0) -> None:
        now_ns = now_ns or time.monotonic_ns()
        if now_ns - e.win_start > THROTTLE_WINDOW_NS:
            e.win_start = now_ns
            e.win_cpu = 0
            self.publish_stats(e)  # every 100 ms of an agent's life, and when it idles
        if e.frame is not None and not e.frame.kids and e.state != SUSPENDED:
            e.frame = None
        if e.outbox:
            if e not in self.blocked:
                self.blocked.append(e)
            e.blocked = True
            return
        if e.state == SUSPENDED:
            return
        if e.events and (e.events >= e.opts.checkpoint_every
                         or now_ns - e.ckpt_time > e.opts.checkpoint_ns):
            self.checkpoint(e)
        if e.state == SLEEPING and not e.pending:
            self.tseq += 1
            heapq.heappush(self.timers, (e.wake_at, self.tseq, e))
            self.publish_stats(e)
            return
        if e.pending or (e.want_step and e.state <= WAITING):
            self.schedule(e, now_ns)
            return
        self.publish_stats(e)
        if e.deadline is not None:
            self.tseq += 1
            heapq.heappush(self.timers, (e.deadline, self.tseq, e))

    def publish_stats(self, e: _Entry) -> None:
        ent = self.dir.entry(e.h)
        r = self.r
        r.store64(ent + D_CPU_NS, e.cpu_ns)  # stats only (single writer; read by collect)
        r.store32(ent + D_STEPS, e.steps & 0xFFFFFFFF)
        r.store32(ent + D_MSGS, e.msgs & 0xFFFFFFFF)

    # -- steps ---------------------------------------------------------------------------
    def step(self, e: _Entry) -> None:
        w = self.w
        e.steps += 1
        e.events += 1
        w.c[C_STEPS] += 1
        st = e.opts.step_timeout
        if st is not None:
            self.arm(st)
        self.in_step = True
        w.in_body = True
        try:
            out = e.obj.step(e.ctx or self.new_ctx(e))
        except BaseException as exc:
            w.in_body = False
            self.in_step = False
            if st is not None:
                self.disarm()
            self.failed(e, exc)
            return
        w.in_body = False
        self.in_step = False
        if st is not None:
            self.disarm()
        if FP.ON:
            FP.hit("agent.after_step")
        self.outcome(e, out)

    def arm(self, seconds: float) -> None:
        if not self._alarm:
            signal.signal(signal.SIGALRM, self._on_alarm)
            self._alarm = True
        signal.setitimer(signal.ITIMER_REAL, seconds)
        # a step stuck in C ignores the signal: the client kills us past this (2x + 1 s)
        self.r.store64(self.step_deadline_off,
                       time.monotonic_ns() + int((2 * seconds + 1.0) * 1e9))

    def disarm(self) -> None:
        signal.setitimer(signal.ITIMER_REAL, 0)
        self.r.store64(self.step_deadline_off, 0)

    def _on_request(self, signum: int, frame: Any) -> None:
        """SIGUSR1 from an idle peer: publish one waiting agent now, between two bytecodes
        of the step running here (never inside our own bookkeeping: in_step and not in_api;
        the agent published is not the running one, and native queue calls are atomic
        with respect to signal handlers)."""
        if self.in_step and not self.in_api and self.rq.n:
            self.in_api += 1
            try:
                if self.publish_one():
                    self.w.c[C_PREEMPT] += 1
            finally:
                self.in_api -= 1

    def poke_peers(self) -> bool:
        """About to park: ask each peer that has agents waiting behind a running step for
        one (at most once per 2 ms per peer).  True if any was asked."""
        if not self.preempt:
            return False
        w = self.w
        r = self.r
        now = time.monotonic_ns()
        asked = False
        for j in range(w.n):
            if j == w.k:
                continue
            base = w.seg.layout.worker(j)
            if not r.load32(base + W_RUNNABLE) or not r.load64(base + W_CURRENT):
                continue
            if r.load32(base + W_STATE) != READY or now - self.poked.get(j, 0) < 2_000_000:
                continue
            pid = r.load32(base + W_PID)
            if pid:
                self.poked[j] = now
                try:
                    os.kill(pid, signal.SIGUSR1)
                    asked = True
                except OSError:
                    pass
        return asked

    def _on_control(self, signum: int, frame: Any) -> None:
        """inline.SIGNAL from a sender: a control agent's message waits (inline.py)."""
        inline.on_signal(self)

    def _on_alarm(self, signum: int, frame: Any) -> None:
        if self.nested:  # inside a control turn nested in the step: raised after it
            self.alarm_due = True
            return
        self.on_alarm_now()

    def on_alarm_now(self) -> None:
        e = self.current
        if self.in_step and e is not None:
            raise StepTimeout(f"a step of agent {e.h:#x} ran longer than its step_timeout "
                              f"({e.opts.step_timeout} s)", e.h, e.gen)

    def outcome(self, e: _Entry, out: Any) -> None:
        if out is None:
            e.state = RUNNABLE
            e.want_step = True
        elif type(out) is GeneratorType:
            e.it = out
            e.it_msg = None
            self.drive(e, None, None)
        elif isinstance(out, Sleep):
            e.state = SLEEPING
            e.want_step = False
            e.wake_at = out.until
        elif isinstance(out, Wait):
            e.state = WAITING
            e.want_step = False
        elif isinstance(out, Done):
            self.finish(e, ST_OK, out.value)
        else:
            self.failed(e, TypeError(
                f"{type(e.obj).__qualname__}.step() must return None, ctx.sleep(s), ctx.wait() "
                f"or ctx.done(value), not {type(out).__name__}"))

    # -- messages --------------------------------------------------------------------------
    def deliver(self, e: _Entry, m: int) -> None:
        a = self.a
        w = self.w
        replay = e.replay > 0
        if replay:
            e.replay -= 1
        e.handled += 1
        try:
            msg = a.read_call(a.off(m))
            target, method, args, kwargs, reply, deadline, sender, seq = msg[:8]
        except BaseException:  # a message that does not unpickle here: nobody to answer
            self.handled(e, m, replay)
            return
        call = reply >= 0
        if sender is not None:  # journaled: deduplicated by (sender, seq)
            if a.kind_link(a.off(m))[2] == 1:  # replayed from the journal by a recovery
                target, reply, deadline = e.h, -1, None
            rc = e.rcache
            if rc and len(msg) > 8 and sender in rc:  # replies its checkpoint covers now
                ack = msg[8]
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
        if not replay:  # for an exact replay: how many steps came before this message
            _U64.pack_into(a.mm, a.off(m) + R_TSTART, e.steps)
        fn = None if method in ("step", "on_stop") else getattr(e.obj, method, None)
        if fn is None or not callable(fn):
            self.handled(e, m, replay)
            self.reply(reply, ST_ERROR, AttributeError(
                f"{type(e.obj).__qualname__} has no message handler {method!r} (handlers are "
                "its public methods)"))
            return
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
            self.reply(reply, ST_ERROR, exc, enc)  # the caller gets it; the agent goes on
            return
        w.in_body = False
        if type(res) is GeneratorType:
            e.it = res
            e.it_msg = (m, -1 if replay else reply, replay, sender, seq, call)
            self.drive(e, None, None)
            return
        self.handled(e, m, replay)
        enc = (self.answered(e, sender, seq, call, reply, ST_OK, res)
               if sender is not None and self.journal is not None else None)
        self.reply(reply, ST_OK, res, enc)
        if e.state == WAITING and e.want_step is False and hasattr(e.obj, "step"):
            e.want_step = True  # ctx.wait(): step again once a message was handled

    def handled(self, e: _Entry, m: int, replay: bool) -> None:
        if FP.ON:
            FP.hit("agent.after_handler")
        e.applied = m + 1  # its effect is in the state now (a checkpoint may cover it)
        if replay:
            return  # D_DONE is already past it (never move it back) and its slot was returned
        self.dir.mark_done(e.h, m)
        if FP.ON:
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

    def reply(self, rh: int, status: int, value: Any, enc: tuple | None = None) -> None:
        """Store a reply in slot ``rh`` (QUEUED, made by the caller) and publish it
        (``enc``: the reply already encoded by :meth:`answered`)."""
        if rh < 0:
            return
        a = self.a
        tr = a.tr
        if tr.cas(rh, S_QUEUED, 0, S_RUNNING, self.who) is not Outcome.OK:
            st = tr.state(rh)
            if st is not None and st[0] == S_CANCELLED:
                a.release(rh, S_CANCELLED, 0, self.who)  # the caller gave up on it
            return  # stale: a replayed message whose reply was sent before
        kind, _status, link = a.kind_link(a.off(rh))
        if enc is None:
            self.w.report(rh, kind, link, status, value)
        else:
            self.w.report_encoded(rh, kind, link, *enc)

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
                self.it_done(e, ST_ERROR, err)
                return
            w.in_body = False
            exc = None
            send = None
            if type(y) is list and y and all(isinstance(p, Pending) for p in y):
                y = PendingAll(y)  # several calls yielded together: resumed with every reply
            if isinstance(y, Pending):
                if y.done:
                    send, exc = self.collect_pending(y)
                    continue
                e.waiting = y
            else:
                try:
                    _kids, _single = children_of(y)
                except TypeError:
                    exc = TypeError(
                        "an agent may yield what ref.call(), ctx.run_blocking() or "
                        f"stealer.spawn() returned, not {type(y).__name__}")
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
        if isinstance(y, CallPending) and y.rh >= 0 and not y.done:
            st = self.a.tr.state(y.rh)
            return st is not None and st[0] == S_DONE
        return y.done

    def all_ready(self, y: PendingAll) -> bool:
        """Every part there?  Parts before ``y.next`` were seen there: a notification per
        reply looks at each part once, not at all of them each time."""
        parts = y.parts
        i = y.next
        while i < len(parts) and self.part_ready(parts[i]):
            i += 1
        y.next = i
        y.done = i == len(parts)
        return y.done

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
        if isinstance(y, CallPending) and y.rh >= 0 and not y.done:
            a = self.a
            off = a.off(y.rh)
            status = a.kind_link(off)[1]
            try:
                status, value = result_value(status, a.take(off))
            except BaseException as exc:
                status, value = ST_ERROR, (exc, "")
            a.free(y.rh)
            y.done = True
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
        m, reply, replay, sender, seq, call = msg
        self.handled(e, m, replay)
        enc = (self.answered(e, sender, seq, call, reply, status, value)
               if sender is not None and self.journal is not None else None)
        self.reply(reply, status, value, enc)

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
            self.a.free(m)  # closed: the agent is gone (the send is dropped, as to a dead pid)
            self.dir.give_back(h)
            return
        self.dir.notify(h, self.k)

    def flush_outboxes(self) -> None:
        still = []
        for e in self.blocked:
            ob = e.outbox
            while ob:
                h, m = ob[0]
                st = self.a.tr.state(h)
                if st is None or st[0] == S_DONE:
                    ob.popleft()
                    self.a.free(m)
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
             deadline: float | None, uid: str | None = None) -> CallPending:
        e = self.current
        if e is None:
            raise NotInTaskError("ref.call() on a worker must be made from inside an agent "
                                 "(and yielded); a plain task can ref.send()")
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
            p.done, p.exc = True, AgentStopped(f"agent {uid!r} had finished before the "
                                               "recovery", h)
            return p
        a = self.a
        rh = self.alloc()
        a.setup(rh, K_REPLY, e.h, time.monotonic_ns())  # QUEUED on no queue: the reply slot
        if j is None:
            data, bufs = encode_message(h, method, args, kwargs, rh, deadline)
        else:
            data, bufs = encode_message(h, method, args, kwargs, rh, deadline, sender, seq,
                                        e.jacked)
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
            p.done, p.exc = True, exc
            return p
        return CallPending(rh)

    def call_all(self, targets: list[tuple[int, str | None, float | None]], method: str,
                 arglists: list[tuple]) -> PendingAll:
        """api.call_all inside an agent: ``yield`` it for the list of replies."""
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
        p.done = True
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

    @_api
    def run_blocking(self, fn: Any, args: tuple, kwargs: dict) -> Pending:
        e = self.current
        if e is None:
            raise NotInTaskError("ctx.run_blocking() is for agents")
        if self.blocking is None:
            from concurrent.futures import ThreadPoolExecutor

            self.blocking = ThreadPoolExecutor(4, thread_name_prefix="stealer-blocking")
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
            p.done = True
            while not inbox.push(h):  # our own inbox: the loop wakes and resumes the agent
                time.sleep(0.0001)
            idle.notify_worker(k)

        self.blocking.submit(fn, *args, **kwargs).add_done_callback(done)
        return p

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
        fn = getattr(e.obj, "on_stop", None)
        if fn is None:
            self.finish(e, ST_OK, None, suspend)
            return
        self.w.in_body = True
        try:
            value = fn()
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
                e.want_step = hasattr(obj, "step")
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
        stopped = AgentStopped(f"agent {h:#x} ({type(e.obj).__qualname__}) stopped before "
                               "handling this message", h, e.gen)
        for m in list(e.pending or ()) + new:
            try:
                msg = a.read_call(a.off(m))
                if not (suspend and self._agent_reply(msg[4])):
                    self.reply(msg[4], ST_ERROR, stopped)
            except BaseException:
                pass
        if e.it_msg is not None and not (suspend and self._agent_reply(e.it_msg[1])):
            self.reply(e.it_msg[1], ST_ERROR, stopped)
        y = e.waiting
        for p in y.parts if isinstance(y, PendingAll) else (y,):
            if isinstance(p, CallPending) and p.rh >= 0 and not p.done:
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
                                        "agent state")
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
                print(f"stealer: agent {e.h:#x} ({type(e.obj).__qualname__}) cannot be "
                      f"pickled, so it never moves and a worker death restarts it from its "
                      f"spawn arguments: {exc}", file=sys.stderr)
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
            for m in d.older(mark, old_mark):
                a.free(m)
        if j is not None and state is not None:
            if FP.ON:
                FP.hit("journal.before_snap_logged")
            body, oob = journal_pack(state)
            try:
                j.shard.snap(e.uid, e.ver, e.gen, e.jsent, e.jseen or {}, body, oob)
            except JournalError as exc:
                print(f"stealer: {exc}", file=sys.stderr)
        return state is not None

    def balance(self) -> None:
        """Hand runnable agents to the least-loaded peer when that pays (placement.py):
        busy peers never steal, so without this a worker that adopted more agents at the
        start keeps a longer round-robin for good.  A peer's load is its runnable agents
        (W_RUNNABLE) plus the notifications in its inbox (calls on their way to its
        agents); it must be the shortest at two checks in a row."""
        w = self.w
        r = self.r
        mine = self.rq.n + len(w.inbox)
        best, low = -1, mine
        for j in range(w.n):
            if j == w.k:
                continue
            base = w.seg.layout.worker(j)
            if r.load32(base + W_STATE) != READY:
                continue
            # relaxed: a hint, re-read at every check
            v = r.load32(base + W_RUNNABLE) + len(w.inboxes[j])
            if v < low:
                best, low = j, v
        prev, self.bal_prev = self.bal_prev, best
        if best < 0 or best != prev:
            return
        c = self.rq.last()
        n = moves_to_busy(mine, low, self.turn_avg,
                          move_cost_ns(c.ckpt_ns if c is not None else 0))
        for _ in range(n):
            if not self.publish_one(to=best):
                break

    def pays_to_idle(self, e: _Entry, idle: int) -> bool:
        """Publish the next runnable agent for an idle peer (``idle``: their bits)?  Only
        if one of them has nothing on its way and the move pays (placement.py)."""
        w = self.w
        if not any(idle >> j & 1 and not len(w.inboxes[j]) for j in range(min(w.n, 64))):
            return False  # every idle peer has notifications waiting: it has work
        c = self.rq.candidate()
        if c is None:
            return False
        backlog = (e.turn_ns or self.turn_avg) + self.rq.n * self.turn_avg
        return pays_to_idle(backlog, c.turn_ns or self.turn_avg, move_cost_ns(c.ckpt_ns))

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
        self.r.store32(self.dir.entry(h) + D_OWNER, 0)  # stats only: read by collect()
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
