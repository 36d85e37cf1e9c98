"""The worker's side of agents: the agents a worker holds, their turns, their moves.

An agent record (``K_ROOT | F_AGENT``) that a worker starts (QUEUED ->
RUNNING|k, the core's ordinary ``start``) becomes an agent living in that
worker's heap: :meth:`Host.adopt` builds it (``__init__`` from the spawn
payload, or the latest checkpoint plus a replay of the mailbox chain above
its mark, see mailbox.py) and the record stays RUNNING|k while it lives
here.  No second scheduler: the worker loop (stealer/worker/loop.py) gives a
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

A turn: the agent's new messages are handled (FIFO, up to MSG_BATCH, or MSG_SLICE_NS, per
turn), then one step if it wants one.  Handlers and steps may be
generators that yield what they wait for (a reply, a blocking call,
fork-join children); the agent is then *suspended* (not in the run queue)
until a notification (inbox) says it may go on.

The Host is one class split over modules by its seams.  Most are mixins: they share
the Host's agents, run queue and counters and run once per message or turn, where an
owned object would add an attribute hop per access (``self.x.y``) on the hot path.  A
seam with state of its own that is asked once per turn is an object the host owns:
the Balancer (balance.py, where agents go).  The modules:

* host.py: the Host itself, the worker loop's questions, a turn, steps;
* entry.py: an agent's entry (``_Entry``), its states, the counters;
* adopt.py: adopting an agent, notifications (inbox), scheduling;
* messages.py: messages, and the journal's replies and duplicates;
* generators.py: steps and handlers that are generators;
* calls.py: sends, calls and spawns from inside a worker;
* leaving.py: leaving, checkpoints and migration (the move itself);
* balance.py: the Balancer, an owned object: the busy share, when an agent moves
  (placement.py: its rules, pure);
* inline.py: a control-tier agent's turn inside another agent's step.

A message's payload has one format, message.py's, which the client shares.
"""

from __future__ import annotations

import functools
import heapq
import os
import signal
import sys
import time
from types import CoroutineType, GeneratorType
from typing import Any

from stealer.agents import api
from stealer.agents.api import Done, Sleep, Wait
from stealer.agents.mailbox import Directory
from stealer.agents.options import AgentOptions
from stealer.errors import DeadlineExceeded, StepTimeout
from stealer.shared import failpoints as FP
from stealer.shared import serialize
from stealer.shared._layout import AF_STOP, D_CPU_NS, D_MSGS, D_STEPS, ST_ERROR, ST_OK
from stealer.shared.shm import (
    H_PARKED,
    H_SEARCHING,
    H_STOP_AGENTS,
    STATE_READY,
    W_IN_STEP,
    W_PID,
    W_RUNNABLE,
    W_STATE,
    W_STEP_DEADLINE,
    WORKER_BYTES,
)
from stealer.worker.agents import inline
from stealer.worker.agents.adopt import Adoption
from stealer.worker.agents.balance import Balancer
from stealer.worker.agents.calls import Calls
from stealer.worker.agents.entry import (
    C_BUSY_NS,
    C_INLINE,
    C_MSGS,
    C_PREEMPT,
    C_STEPS,
    FINISHED,
    RUNNABLE,
    SLEEPING,
    SUSPENDED,
    WAITING,
    _Entry,
)
from stealer.worker.agents.generators import Generators
from stealer.worker.agents.leaving import Leaving
from stealer.worker.agents.messages import SERVE_BREAK, SERVE_SLOW, Messages
from stealer.worker.agents.runqueue import RunQueue

__all__ = ["Host"]

# added to the error of an agent whose first step raised about its Ctx: a class whose step
# was meant as a message handler (a gymnasium-style env.step(action))
CTX_HINT = ("{0}.step was called by the worker as the agent's own step, step(ctx): an "
            "agent with a step method is self-driven. If step is a message handler (a "
            "gymnasium-style env.step(action) its client calls), set `self_driven = False` "
            "on {0}.")

MSG_BATCH = 16  # messages an agent handles per turn before the others get theirs
# ... or fewer: past this much time in its batch (a bulk step's length), or once an agent of
# a higher tier is runnable, the batch ends at the next message boundary when another agent
# waits (16 handlers of 3 s held a worker for 48 s while its other agents got nothing)
MSG_SLICE_NS = 5_000_000
# publish the worker's counters at least this often while agents' turns run (tasks:
# worker/loop.py FLUSH_NS, 2 ms)
TURN_FLUSH_NS = 50_000_000
THROTTLE_WINDOW_NS = 100_000_000  # over which an agent's CPU share is measured


class Host(Adoption, Messages, Generators, Calls, Leaving):
    """The agents of one worker (created by stealer.worker.loop.Worker).

    Its pieces are mixins (see the module's docstring), and this class holds their
    state: ``__init__`` makes every attribute they share.
    """

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
        # reply slot -> the done Future of a task's blocking call (Calls.task_blocking),
        # set by the pool's thread before it pushes the slot on our inbox
        self.answers: dict[int, Any] = {}
        self.current: _Entry | None = None
        self.in_step = False
        # inline.on_signal came outside a step's user code: set up (Host.step), or in one of
        # its API calls (calls._api): handled where that ends
        self.ctl_missed = False
        self.turns = 0
        self.step_deadline_off = w.wbase + W_STEP_DEADLINE
        self.stopping = False
        self._alarm = False
        self.opts_cache: dict[tuple, AgentOptions] = {}
        self.flushed = 0  # monotonic ns of the last counter flush
        self.peers_mask = ((1 << min(64, w.n)) - 1) & ~(1 << w.k if w.k < 64 else 0)
        self.runnable_off = w.wbase + W_RUNNABLE
        self.in_step_off = w.wbase + W_IN_STEP
        self.in_api = 0  # > 0 while a step calls into us (send, call, spawn_agent...)
        self.poked: dict[int, int] = {}  # peer -> monotonic ns we last asked it for an agent
        self.turn_avg = 0  # ns per turn over every agent here (moving average): backlogs
        # An idle peer asks (SIGUSR1) for one of the agents waiting behind our long step;
        # only with the native queues: the reference queues' lock is not reentrant.
        self.preempt = w.native
        # poke_peers' first look natively (_cqueues.peers_to_poke, its arguments bound
        # here: the layout does not change; None: the Python looks)
        self.quick_poke: Any = None
        look = getattr(getattr(w, "Q", None), "peers_to_poke", None) if w.native else None
        if look is not None:
            self.quick_poke = functools.partial(
                look, self.r, w.seg.layout.worker(0), WORKER_BYTES, w.n, w.k, W_RUNNABLE,
                W_IN_STEP, W_STATE, STATE_READY)
        self.bal = Balancer(self)  # our busy share and the moves to peers (balance.py)
        self.journal: Any = getattr(w, "journal", None)  # journal.WorkerJournal or None
        # A turn's plain calls in one native call each (HotPath.serve, messages.py), with
        # the extension and its small-pickle writer, no journal and no failpoints;
        # STEALER_NO_FAST_TURN=1 keeps the Python loop (its reference) for comparisons.
        hot = getattr(w.arena, "hot", None)
        self.serve: Any = None
        if (hot is not None and serialize._fast is not None and self.journal is None
                and not FP.ON and os.environ.get("STEALER_NO_FAST_TURN", "") in ("", "0")):
            self.serve = hot.serve
            self.fast_dumps = serialize._fast
        # ... and a turn of plain calls with turn and after_turn around it (Turns.turn, the
        # same conditions; these two methods are its twin), and an agent's notification
        # (Turns.ping; twin: ForkJoinHandling.on_ping)
        self.quick: Any = None  # Turns (None: the Python methods run everything)
        self.quick_ping: Any = None
        turns = getattr(sys.modules.get(type(hot).__module__), "Turns", None)
        if self.serve is not None and turns is not None:
            self.quick = turns(hot, self, w, self.dir.base, C_BUSY_NS, C_MSGS, MSG_SLICE_NS,
                               MSG_BATCH, THROTTLE_WINDOW_NS, TURN_FLUSH_NS, self.fast_dumps,
                               H_SEARCHING, H_PARKED)
            self.quick_ping = self.quick.ping
            if w.native:  # the balancer's look at the peers natively (Balancer.least_loaded)
                self.quick.set_peers(w.seg.layout.worker(0), WORKER_BYTES, w.k, w.inboxes,
                                     W_STATE, W_RUNNABLE, STATE_READY)
            self.run_next = self.quick.run_next  # type: ignore[method-assign]
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
        r.store32(self.runnable_off, self.rq.n)  # seq_cst: read by idle peers (poke_peers)
        # a peer searching or parked (first 64 workers; acquire loads: a hint, re-checked
        # by the thief's own steal)
        if self.rq.n:
            idle = (r.load64(H_SEARCHING) | r.load64(H_PARKED)) & self.peers_mask
            if idle:
                self.offer(e, idle)
        bal = self.bal
        bal.turn()
        if self.turns & 7 == 0 and self.rq.n >= 2 and bal.on:
            bal.balance()
        if self.turns & 63 == 0:
            self.every_64_turns()
        self.turn(e)

    def offer(self, e: _Entry, idle: int) -> None:
        """Peers ``idle`` (a bit set) search or park while agents wait here: publish one
        more runnable agent for them, if that pays (``e`` runs now)."""
        j = self.bal.pays_to_idle(e, idle)
        if j >= 0 and self.publish_one():
            # the thief may be another idle peer than j: a hint all the same
            self.bal.gave(j, 1, time.monotonic_ns())

    def every_64_turns(self) -> None:
        if not self.stopping and self.r.load32(H_STOP_AGENTS):
            self.stop_all()
        if self.turns & 1023 == 0 and self.w.client.gone():
            self.w.orphaned()  # our client died while agents kept us busy: exit

    def turn(self, e: _Entry) -> None:
        w = self.w
        r = self.r
        if FP.ON:
            FP.hit("agent.turn_enter")
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
                if t0 - self.flushed > TURN_FLUSH_NS:
                    self.flushed = t0
                    w.flush()  # counters reach stats() while agents keep the worker busy
            if e.state != FINISHED:
                self.after_turn(e, t1)

    def deliver_batch(self, e: _Entry, start: int = 0) -> None:
        """Handle the agent's pending messages, up to MSG_BATCH or MSG_SLICE_NS while
        other agents wait (a turn's, or a nested control turn's: inline.py); ``start``: the
        slice's (monotonic ns; 0: now)."""
        start = start or time.monotonic_ns()
        rq = self.rq
        w = self.w
        inbox = w.inbox
        serve = self.serve if not e.replay else None
        while e.pending and e.state < SUSPENDED and not e.blocked:
            if serve is not None:
                # this loop and deliver's common case natively, up to the next message
                # that needs them here (the checks below then agree: nothing ended it)
                code, x, y, z = serve(e, self.dir.entry(e.h), w.completions, self.who, w.c,
                                      C_MSGS, w, rq, inbox, start, MSG_SLICE_NS, MSG_BATCH,
                                      self.fast_dumps)
                if code <= SERVE_BREAK:
                    return
                if code != SERVE_SLOW:
                    self.served(e, code, x, y, z)
                    continue
            if e.handled >= MSG_BATCH:
                break
            # another agent waits (runnable here, or notified since the turn began: its inbox
            # entry is read only between turns) and our slice is over, or it has a higher tier
            if (e.handled and (rq.n or len(inbox))
                    and (time.monotonic_ns() - start > MSG_SLICE_NS
                         or (rq.n and rq.top_tier() < e.tier))):
                break  # the others' turn; the rest of ours after them (it stays runnable)
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
        # Handled messages stay in their records until a checkpoint covers them: with many
        # agents, checkpoint_every (64) of them each would take every record (256 agents
        # x 64 > 16,384: senders then wait for one).  So an agent keeps at most its share
        # of half the records (this worker's agents times the workers: about all); the
        # other half is for messages in flight and replies.  (A quarter made 256 lockstep
        # agents checkpoint every 16 calls: 11% of the workers' time beyond the handlers.)
        if e.events and (e.events >= min(e.opts.checkpoint_every,
                                         self.a.nrecords // (2 * len(self.agents) * self.w.n
                                                             + 1) or 1)
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
        r = self.r
        r.store32(self.in_step_off, 1)  # seq_cst: read by idle peers (poke_peers)
        if FP.ON:
            FP.hit("agent.step_enter")
        w.in_body = True
        try:
            if self.controls:
                # A control message for an agent here runs now, at the step's start, not
                # after the whole step, if its sender did not signal (it found no turn: it
                # looked before our W_CURRENT store above) or its signal landed while this
                # turn was set up (inline.on_signal left it, ctl_missed).  seq_cst fence:
                # the W_CURRENT store before the mailboxes' loads in on_signal (take);
                # pairs with signal_if_busy's fence between the sender's push and its load
                # of W_CURRENT: it signals us, or we see its message here, or both.  A
                # signal from now on is handled where it lands.
                r.fence()
                self.ctl_missed = False
                inline.on_signal(self)
            out = e.obj.step(e.ctx or self.new_ctx(e))
        except BaseException as exc:
            w.in_body = False
            self.in_step = False
            r.store32(self.in_step_off, 0)
            if st is not None:
                self.disarm()
            if e.steps == 1 and "Ctx" in str(exc) and hasattr(exc, "add_note"):
                exc.add_note(CTX_HINT.format(type(e.obj).__qualname__))  # (3.11+)
            self.failed(e, exc)
            return
        w.in_body = False
        self.in_step = False
        r.store32(self.in_step_off, 0)  # seq_cst: read by idle peers (poke_peers)
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

    def went_idle(self) -> None:
        """The worker loop is about to search for work (balance.py)."""
        self.bal.went_idle()

    def poke_peers(self) -> bool:
        """About to park: ask each peer that has agents waiting behind a running step for
        one (at most once per 2 ms per peer).  True if any was asked."""
        if not self.preempt:
            return False
        w = self.w
        r = self.r
        look = self.quick_poke
        if look is not None and not look():
            return False  # (the looks below, natively: nobody to ask)
        now = time.monotonic_ns()
        asked = False
        for j in range(w.n):
            if j == w.k:
                continue
            base = w.seg.layout.worker(j)
            # agents wait there behind a step (a handler does not take the request: a poke
            # at each lockstep round's end interrupted a handler for nothing)
            if not r.load32(base + W_RUNNABLE) or not r.load32(base + W_IN_STEP):
                continue
            if (r.load32(base + W_STATE) != STATE_READY
                    or now - self.poked.get(j, 0) < 2_000_000):
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

    def on_control_now(self) -> None:
        """A step's API call ended after a control signal it held back (calls._api)."""
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
        elif type(out) is GeneratorType or type(out) is CoroutineType:  # (async def step)
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
