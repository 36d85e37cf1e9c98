"""Worker process: find a task, run it, report it.

::

    find_task (one worker)
      inbox[k]   pings for this worker's suspended fork-join frames, first
      deque[k]   own Chase-Lev deque, newest first (children, injector batches)
      injector   client submissions, a batch at a time (also first every 61 tasks, for fairness)
      steal      half of a peer's deque, oldest first, peers in steal order
      spin       a few rounds, then park on the futex word (idle.py)

    run (records.py has the state diagram):
      lease the handle (W_LEASE, before the take's CAS) -> current word = h + 1 ->
      start: QUEUED -> RUNNING|k -> unpickle the call (it stays in the record) ->
      call (Ctrl-C is delivered only here) -> a generator is driven as a fork-join
      frame -> store the result -> finish: RUNNING|k -> DONE|k -> publish it
      (root: completion ring k, client woken if parked; child: ping the parent's
      owner) -> clear the current word.

A worker killed anywhere in there leaves words that say what it had done
(stealer/shared/recovery.py decides from them).  Nothing a task raises, and no
failure to pickle or store its result, escapes the report: the future
always resolves.

A generator task is pinned to its worker (generators do not pickle): while
it waits for children its frame lives in ``self.conts`` and the record says
which worker and incarnation hold it (R_OWNER, R_INCARNATION).  Every child
that finishes pings that worker through its inbox; the worker resumes the
frame once all its children are DONE (it re-checks their state words, so a
ping sent twice or late is harmless).  A ping for a frame a dead
predecessor held lets the replacement recover that task.

This module owns the process contract (:class:`WorkerArgs`, built by stealer/client/pool.py's
``_Pool.start_worker`` and pickled by multiprocessing; :func:`main`, the process's
entry point) and the Worker's loop (find a task: inbox, deque, injector, steal, park)
and running/reporting.  Its fork-join frames, ``spawn`` and the blocking join are
stealer/worker/join.py's (ForkJoinHandling), the pings it does not resume at once
stealer/worker/pings.py's (PingHandling), both mixins of Worker; the encoding of an
outcome is stealer/worker/outcome.py's (its names still importable from here).  The
agents living on a worker (stealer/worker/agents/host.py) and stealer/forkjoin.py (through
``forkjoin._current``) call into the Worker.
"""

from __future__ import annotations

import os
import signal
import struct
import sys
import time
import traceback
from dataclasses import dataclass
from time import thread_time_ns
from types import GeneratorType
from typing import Any

from stealer import forkjoin
from stealer.errors import result_value
from stealer.shared import failpoints, metrics, serialize
from stealer.shared._layout import (
    F_AGENT,
    F_BUFFERS,
    K_MASK,
    K_REPLY,
    K_ROOT,
    S_CANCELLED,
    ST_ERROR,
    ST_LOST,
    ST_OK,
)
from stealer.shared.arena import Arena
from stealer.shared.idle import Idle
from stealer.shared.liveness import ProcessWatch
from stealer.shared.records import Outcome
from stealer.shared.recovery import Pings, Recovery
from stealer.shared.shm import (
    H_SHUTDOWN,
    H_STARTED,
    H_STOP_AGENTS,
    LEASE_SLOTS,
    STATE_EXITING,
    STATE_INIT_FAILED,
    STATE_READY,
    STATE_RETIRED,
    STATE_STARTING,
    W_CPU,
    W_CURRENT,
    W_IN_STEP,
    W_JOURNAL,
    W_LEASE,
    W_PID,
    W_PING_IN,
    W_PING_OUT,
    W_RING_OP,
    W_STATE,
    Layout,
    Segment,
    unlink_all,
)
from stealer.worker.join import ForkJoinHandling, _Frame
from stealer.worker.outcome import _describe, encode_result, error_payload
from stealer.worker.pings import PingHandling

# (the W_STATE values live in shm.py, next to the word; still importable from here)
__all__ = ["WorkerArgs", "main", "error_payload", "encode_result", "result_value",
           "STATE_STARTING", "STATE_READY", "STATE_EXITING", "STATE_RETIRED", "STATE_INIT_FAILED"]

EXIT_INIT_FAILED = 3

_NO_BUFS: list = []  # (read only)

SPIN_ROUNDS = 64  # search rounds before parking, at most (Worker.spin_limit adapts)
SPIN_MIN = 4  # ... and at least
PARK_TIMEOUT = 0.5  # seconds; on timeout the worker checks that its client is alive
INJECTOR_BATCH = LEASE_SLOTS  # one lease slot per handle of a batch
STEAL_CAP = 32
FAIR_TICK = 61
FLUSH_MASK = 63  # publish counters every 64 steps (and before parking)
FLUSH_NS = 2_000_000  # ... and at least this often while busy (stats() is never far behind)
_COUNTERS = struct.Struct(f"={metrics.NCOUNTERS}Q")
_C = {name: i for i, name in enumerate(metrics.COUNTERS)}  # by name: reordering is safe
C_TASKS, C_STEALS, C_STEAL_ATTEMPTS = _C["tasks"], _C["steals"], _C["steal_attempts"]
C_PARKS, C_WAKEUPS, C_INJECTOR_TAKES = _C["parks"], _C["wakeups"], _C["injector_takes"]
C_ERRORS, C_BUSY_NS = _C["errors"], _C["busy_ns"]  # (spawns, resumes: worker/join.py)
C_SPIN_NS = _C["spin_ns"]

FP = failpoints  # `if FP.ON:` costs one attribute load when no failpoint is armed


@dataclass
class WorkerArgs:
    """Everything a worker process needs; pickled by multiprocessing at start.

    Built by stealer/client/pool.py's ``_Pool.start_worker``, one field per argument it passes.
    ``ppid`` is the client's pid (not necessarily the worker's parent: with
    forkserver that is the fork server) and ``client_start`` the client's
    start time (liveness.start_time), which together name the client.
    """

    index: int  # the worker's slot k (holder id k + 1 in record state words)
    incarnation: int  # how many processes slot k has had, this one included
    name: str  # the shared segment's name (Segment.attach)
    layout: tuple  # Layout.to_args()
    lock: Any  # the reference queues' shared lock; None with the native queues
    native: bool  # the client's queues are the native ones (every process must agree)
    cpu: int | None  # pin to this CPU (affinity.pin_current_process), or not at all
    metrics: bool  # record counters and histograms (metrics.py)
    steal_order: list[int] | None  # victims in steal order; None: the next peers in turn
    initializer: bytes | None  # pickled (serialize.loads_frame), run once at start
    initargs: tuple
    max_tasks: int | None  # retire after this many tasks (max_tasks_per_child)
    ppid: int
    thread_limit: int | None  # affinity.apply_thread_limits
    client_start: int | None = None
    # (STEALER_FAILPOINTS, STEALER_FAILPOINTS_DIR): a forkserver's children inherit *its*
    # environment, so they travel here
    failpoints: tuple[str | None, str | None] = (None, None)
    journal: tuple | None = None  # (path, mode, epoch) of the agents' journal, or None
    # the client's environment, for a process started by a forkserver (start_worker sets it)
    env: dict[str, str] | None = None


def _on_sigint(signum: int, frame: Any) -> None:
    """Ctrl-C reaches every process of the terminal's group: a worker raises
    KeyboardInterrupt only inside a task body (the task fails with it, as in
    ProcessPoolExecutor); anywhere else (storing a result, idle) it is ignored,
    so the interrupt can never lose or hang a task.  The client decides."""
    w = forkjoin._current
    if w is not None and getattr(w, "in_body", False):
        if w.in_spawn:
            w.interrupted = True  # raised at the end of spawn(), once the child is queued
            return
        raise KeyboardInterrupt


def next_spin(limit: int, spun_ns: int, slept_ns: int) -> int:
    """The search rounds before the next park, after spinning ``limit`` rounds for
    ``spun_ns`` and then parking for ``slept_ns`` (Worker.spin_limit): twice as many when
    the park ended sooner than the spin had lasted (a longer spin would have caught that
    work), half as many when it lasted over four times longer (spinning does not pay
    between such gaps), within [SPIN_MIN, SPIN_ROUNDS]."""
    if slept_ns < spun_ns:
        return min(SPIN_ROUNDS, limit * 2)
    if slept_ns > 4 * spun_ns:
        return max(SPIN_MIN, limit >> 1)
    return limit


class Worker(ForkJoinHandling, PingHandling):
    """One worker process's state and its loop (the only instance is made by :func:`main`).

    Over 400 lines: its ``__init__`` wires every shared structure the loop and the
    run/report path read (rings, deques, leases, intents, metrics offsets, the agent
    host), and the loop, search, execute and report share those attributes on the
    hot path; the fork-join and ping handling are already mixins (worker/join.py,
    worker/pings.py).
    """

    def __init__(self, a: WorkerArgs) -> None:
        from stealer.shared import queues as _queues

        # The client chose the implementation; every process must use the same one.
        Q = _queues.load(force_python=not a.native)
        if a.native != Q.NATIVE:
            raise RuntimeError("this worker could not load the native queues its client uses")
        self.RETRY = Q.RETRY
        self.native = Q.NATIVE
        self.Q = Q  # the queues' implementation (its native twins: Balancer's BusyShare)
        self.k = a.index
        self.who = a.index + 1  # our holder id in record state words
        self.incarnation = a.incarnation
        self.ppid = a.ppid
        self.max_tasks = a.max_tasks or 0
        self.name = a.name
        layout = Layout.from_args(a.layout)
        self.seg = seg = Segment.attach(a.name, layout, a.lock, Q)
        seg.populate()
        self.r = r = seg.region
        self.arena = Arena(seg)
        self.idle = Idle(r, layout)
        self.arena._idle = self.idle  # one owed-wake flag for both paths (Idle.wake_client)
        n = layout.nworkers
        self.n = n
        self.deques = [Q.Deque(r, layout.deque(i), layout.records) for i in range(n)]
        self.inboxes = [Q.MPMCRing(r, layout.inbox(i), layout.inbox_cap) for i in range(n)]
        self.deque = self.deques[self.k]
        self.inbox = self.inboxes[self.k]
        self.injector = Q.MPMCRing(r, layout.offsets["injector"], layout.injector_cap)
        self.completions = Q.SPSCRing(r, layout.completion(self.k), layout.records)
        o = layout.offsets
        self.fns = serialize.FunctionTable(seg.mm, r, o["fn_table"], layout.fn_entries,
                                           o["fn_data"], layout.fn_data)
        self.fcache = self.fns._fns  # id -> function loaded (FunctionTable.get fills it)
        self.load_call = getattr(Q, "load_call", serialize.load_call)
        self.wbase = layout.worker(self.k)
        self.cur_off = self.wbase + W_CURRENT
        self.lease_off = self.wbase + W_LEASE
        # Every take off a shared queue is leased (records.py): the handle is written to
        # W_LEASE before the CAS that takes it.
        for q in (*self.deques, self.injector):
            q.set_lease(self.lease_off)
        self.inbox.set_lease(self.wbase + W_PING_IN)  # a ping taken: read after our death
        # Every claim on an MPMC ring is named first: repaired if we die holding it (ringfix.py)
        for q in self.arena.mpmc_rings(self.inboxes, self.injector):
            q.set_intent(self.wbase + W_RING_OP)
        self.arena.set_worker(self.wbase)  # records taken off the free ring: named in W_ALLOC
        self.deque.repair()  # inherited from a predecessor killed inside a pop
        order = a.steal_order or [(self.k + i) % n for i in range(1, n)]
        self.victims = [self.deques[i] for i in order]
        # each victim's cell in our steal row (metrics.py VICTIMS: the last one lumps the rest)
        self.victim_cells = [metrics.victim_cell(i) for i in order]
        self.pings = Pings(self.arena, self.inboxes, self.idle, self.k, self.wbase + W_PING_OUT,
                           self.inbox_full)
        self.rec = Recovery(self.arena, self.inboxes, self.idle, self.who, self.push_any,
                            self.pings)
        # Work for later, when our inbox is empty: pings for our own frames that found our
        # inbox full, and frames a dead predecessor held (looked at in one scan, not one per
        # ping).  Lost with us if we die: all are frames we hold, which our recoverer
        # looks at anyway.
        self.held: list[int] = []
        self.orphans: list[int] = []
        # Metrics (metrics.py): local counters flushed to the shared block every
        # FLUSH_MASK + 1 steps, FLUSH_NS while busy, and before parking; histograms recorded per step.
        self.c = [0] * metrics.NCOUNTERS
        self.mbase = layout.metrics(self.k)
        # successful steals by victim (metrics.py STEALS_FROM_OFF), flushed with the counters
        self.steals_from = [0] * min(n, metrics.VICTIMS)
        self._steals_row = struct.Struct(f"={len(self.steals_from)}Q")
        self.metrics_on = a.metrics
        t = metrics.DEFAULT_TIER
        self.wait_off = self.mbase + metrics.hist_offset(t, 0) if a.metrics else -1
        self.run_off = self.mbase + metrics.hist_offset(t, 1)
        # per-tier histograms of agent turns (queue wait, run time)
        self.mbase_tier_wait = [self.mbase + metrics.hist_offset(i, 0) for i in range(3)]
        self.mbase_tier_run = [self.mbase + metrics.hist_offset(i, 1) for i in range(3)]
        self.conts: dict[int, _Frame] = {}  # suspended frames by handle
        self.frame: _Frame | None = None
        self.cur: tuple[int, int, int] | None = None  # (handle, kind, link) of the running task
        self.in_body = False  # True only while user code runs (see _on_sigint)
        self.in_spawn = False  # inside spawn(): Ctrl-C waits for its end
        self.joined_ns = 0  # ns spent in blocking joins (join_blocking), not busy time
        self.joining: set[int] = set()  # tasks waiting in a blocking join on our stack
        self.interrupted = False  # a Ctrl-C held back by spawn()
        self.tick = 0
        # Search rounds before parking (search): halved after a park that lasted much
        # longer than the spin before it (spinning would not have caught that work),
        # doubled after one that ended sooner (a longer spin would have).  A lockstep
        # client's round (0.5-1 ms between a worker's last reply and its next message)
        # had each worker spin 64 rounds, ~340 µs of CPU, before every park: 15 µs per
        # call, and CPU the client needed on a machine with as many workers as cores.
        self.spin_limit = SPIN_ROUNDS
        self.flushed_ns = 0  # monotonic ns of the last flush() of the counters
        self.journal: Any = None  # the agents' journal (Executor(journal=PATH)): our shard
        jcfg = a.journal
        if jcfg is not None:
            from stealer.agents.journal.opening import WorkerJournal

            self.journal = WorkerJournal(*jcfg, a.index, a.incarnation)
            self.journal.shard.publish_to(self.seg.region, self.wbase + W_JOURNAL)  # its lag
        from stealer.worker.agents.host import Host

        self.host = Host(self)  # the agents living on this worker (stealer/worker/agents/host.py)
        # execute's start natively where the Host's turn is native (Turns.start; None: the
        # Python start, its twin)
        self.quick_start: Any = self.host.quick.start if self.host.quick is not None else None
        # search's spin rounds natively (_cqueues.spin; None: the reference queues, whose
        # rings are Python)
        self.quick_spin: Any = getattr(Q, "spin", None) if Q.NATIVE else None
        self.quick_look: Any = getattr(Q, "something_shows", None) if Q.NATIVE else None
        # search's idle transitions natively (HotPath: Idle's flush_client, try_search,
        # stop_search and park; None: Idle's, the reference)
        self.quick_idle: Any = self.arena.hot if Q.NATIVE else None
        bal = self.host.bal
        # (the native busy share's own went_idle where the Balancer has one: no frames)
        self.went_idle: Any = bal.busy.idle if bal.quick else self.host.went_idle

    # (status, pickle, buffers) of an outcome, for the agents' journal (host.py)
    encode_result = staticmethod(encode_result)
    # (exception, traceback) that always pickles: map's per-input outcomes (forkjoin.run_items)
    error_payload = staticmethod(error_payload)

    # -- main loop -----------------------------------------------------------
    def loop(self) -> int:
        inbox_pop = self.inbox.pop
        deque_pop = self.deque.pop
        host = self.host
        rq = host.rq
        notes = host.dir  # its ``held``: notifications that found a peer's inbox full
        ping = host.quick_ping  # an agent's notification natively (None: on_ping does all)
        on_ping = self.on_ping
        while True:
            h = inbox_pop()
            if h >= 0:
                if ping is None or not ping(h):
                    on_ping(h)
                continue
            if notes.held:
                notes.deliver_held(self.k)  # where there is room now; the rest next time
            if self.held or self.orphans:
                self.run_later()
                continue
            self.tick += 1
            if host.timers or host.blocked:
                host.poll()
            # Agents' turns and tasks alternate; a runnable control-tier agent goes first.
            if rq.n and (self.tick & 1 or rq.n0):
                host.run_next()
                continue
            if self.tick % FAIR_TICK == 0:
                h = self.injector.pop()
                if h < 0:
                    h = deque_pop()
            else:
                h = deque_pop()
            if h < 0 and rq.n:
                # new submissions and agents are not starved behind runnable agents
                h = self.take_injector() if len(self.injector) else -1
                if h < 0:
                    host.run_next()
                    continue
            if h < 0:
                h = self.search()
                if h is None:
                    return STATE_EXITING
                if h < 0:
                    continue
            self.execute(h)
            if self.max_tasks and self.c[C_TASKS] >= self.max_tasks and not self.conts:
                return STATE_RETIRED

    def has_work(self) -> bool:
        if (len(self.inbox) or len(self.injector) or len(self.deque) or self.host.has_work()
                or self.held or self.orphans):
            return True
        return any(len(d) for d in self.victims)

    def take_injector(self) -> int:
        inj = self.injector
        n = len(inj)
        if n <= 0:
            return -1
        want = max(1, min(INJECTOR_BATCH, n // self.n))
        items = inj.pop_many(want, self.lease_off)  # item i leased in slot i until in our deque
        if not items:
            return -1
        self.c[C_INJECTOR_TAKES] += 1
        if len(items) > 1:
            push = self.deque.push
            for h in reversed(items[1:]):  # owner pops newest first: keep submission order
                if not push(h):
                    while not inj.push(h):
                        time.sleep(0.0001)
            self.arena.notify_one()
        return items[0]

    def steal(self) -> int:
        mine = self.deque
        # Peers in steal order (affinity.steal_order): SMT siblings, then the same NUMA
        # node, then the rest; ties were already rotated per worker, so no two workers
        # start with the same victim and none is needed here.
        for i, v in enumerate(self.victims):
            for _attempt in range(2):
                self.c[C_STEAL_ATTEMPTS] += 1
                h = v.steal_half(mine, STEAL_CAP)
                if h >= 0:
                    self.c[C_STEALS] += 1
                    self.steals_from[self.victim_cells[i]] += 1
                    if len(mine):
                        self.arena.notify_one()
                    return h
                if h != self.RETRY:  # EMPTY: next victim; RETRY (lost a race): once more
                    break
        return -1

    def search(self) -> int | None:
        """Injector, then peers; spin briefly, then park. None means shut down."""
        idle = self.idle
        r = self.r
        k = self.k
        spin = self.quick_spin
        look = self.quick_look
        quick = self.quick_idle
        if quick is not None:  # Idle's transitions natively (HotPath: flush, search, park)
            try_search, stop_search = quick.try_search, quick.stop_search
            owed = idle.owed  # a wake owed by the Python finish (Idle.wake_client)
            if owed:
                idle.owed = False
            self.went_idle()  # idle from now on: our busy share (agents/placement.py)
            searching = quick.idle_enter(k, owed)  # flush_client, then try_search
        else:
            try_search, stop_search = idle.try_search, idle.stop_search
            self.flush_client()
            self.went_idle()
            searching = try_search(k)
        rounds = 0
        spun_from = time.monotonic_ns()
        while True:
            host = self.host
            if len(self.inbox) or host.has_work() or self.held or self.orphans:
                if searching:
                    stop_search(k, False)
                return -1
            # (natively first, where built: nothing shows in the injector or a victim's
            # deque, so neither Python look would take anything)
            if look is None or look(self.inbox, self.injector, self.victims):
                h = self.take_injector()
                if h < 0:
                    h = self.steal()
                if h >= 0:
                    if searching:
                        stop_search(k, True)
                    return h
            if (host.agents or host.dormant) and not host.stopping and r.load32(H_STOP_AGENTS):
                host.stop_all()  # shutdown: agents stop at their next step boundary
                continue
            if r.load32(H_SHUTDOWN) and not self.conts and not host.agents and not host.dormant:
                if searching:
                    stop_search(k, False)
                return None
            rounds += 1
            if rounds < self.spin_limit:
                # Yield every round: on a machine with few cores the client (or another
                # worker) may be waiting for this CPU; a pure spin would take half of it.
                # (their CPU time counted apart: a worker's CPU beyond its calls' own is
                # partly these yields while it waits for work, on a CPU nobody else wanted)
                t_spin = thread_time_ns()
                if spin is not None and not host.timers:
                    # the rounds' cheap looks natively (_cqueues.spin), then this full
                    # round again once something shows or they run out
                    rounds += spin(self.spin_limit - rounds, self.inbox, self.injector,
                                   self.victims, r, H_STOP_AGENTS, H_SHUTDOWN) - 1
                else:
                    os.sched_yield()
                self.c[C_SPIN_NS] += thread_time_ns() - t_spin
                continue
            if searching and quick is None:
                stop_search(k, False)  # (the native park stops searching first)
                searching = False
            poked = host.poke_peers()  # agents waiting behind a peer's long step: ask for one
            self.c[C_PARKS] += 1
            self.flush()
            timeout = PARK_TIMEOUT if not poked else 0.002
            if host.timers:
                timeout = min(timeout, max(0.0, host.timers[0][0] - time.monotonic()))
            if host.blocked or host.dir.held:
                # sends waiting for room in a peer's mailbox, notifications for room in a
                # peer's inbox (mailbox.py deliver_held)
                timeout = min(timeout, 0.001)
            parked = time.monotonic_ns()
            if quick is None:
                woke = idle.park(k, self.has_work, timeout)
            elif self.held or self.orphans or host.has_work():  # ours: no other process adds
                if searching:
                    stop_search(k, False)
                woke = True
            else:  # has_work's other looks made natively after the park handshake's fence
                woke = quick.park(k, searching, self.inbox, self.injector, self.deque,
                                  self.victims, timeout)
            searching = False
            t = time.monotonic_ns()
            self.spin_limit = next_spin(self.spin_limit, parked - spun_from, t - parked)
            spun_from = t
            if woke:
                self.c[C_WAKEUPS] += 1
            if host.dir.held:
                host.dir.deliver_held(self.k)
            if host.timers or host.blocked:
                host.poll()
            if not woke and self.client.gone():  # the client itself, not our parent (forkserver)
                self.orphaned()
            rounds = 0
            searching = try_search(k)

    def flush_client(self) -> None:
        """Completions published in the client's throughput mode and not announced
        (Idle.wake_client, HotPath.c_finish): wake the result thread now, once, rather
        than let them wait for its next poll (before idling; after a control turn)."""
        hot = self.arena.hot
        if self.idle.owed or (hot is not None and hot.owed):
            if hot is not None:
                hot.owed = False
            self.idle.flush_client()

    def flush(self) -> None:
        """Publish the local counters to this worker's metrics block (single writer)."""
        if self.metrics_on:
            if self.native:  # the same words, one native call each (Region.store_u64s)
                self.r.store_u64s(self.mbase, self.c)
                self.r.store_u64s(self.mbase + metrics.STEALS_FROM_OFF, self.steals_from)
            else:
                _COUNTERS.pack_into(self.seg.mm, self.mbase, *self.c)
                self._steals_row.pack_into(self.seg.mm, self.mbase + metrics.STEALS_FROM_OFF,
                                           *self.steals_from)
            self.flushed_ns = time.monotonic_ns()

    def orphaned(self) -> None:
        """Our client died without shutting down: remove its files and exit."""
        unlink_all(self.name)
        if self.journal is not None:
            self.journal.close()  # every event is committed already; this syncs and unlocks
        os._exit(0)

    # -- running tasks -------------------------------------------------------
    def execute(self, h: int) -> None:
        a = self.arena
        if FP.ON:
            FP.hit("worker.after_take")
        # current word first, then QUEUED -> RUNNING|who (records.py)
        quick = self.quick_start
        if quick is not None:  # Turns.start: an idle agent adopted in one call
            t = quick(h, self.cur_off, self.wait_off)
            if t.__class__ is int:
                if t:
                    self.tick -= 1  # as below
                else:
                    self.not_started(h)
                return
        else:
            t = a.start_task(h, self.cur_off, self.wait_off, self.who)
            if t is None:
                self.not_started(h)
                return
            if FP.ON:
                FP.hit("worker.after_start")
        kind, link, data, t0 = t
        if kind & F_AGENT:
            self.r.store64(self.cur_off, 0)
            # it lives here now (stealer/worker/agents/host.py); Turns.adopt's answer if asked
            got = None
            if quick is not None:
                q = self.host.quick
                got, q.got = q.got, None  # (a constructor's exception: not kept past this)
            self.host.adopt(h, kind, link, got)
            # Adopting runs no step: the next pass takes work again instead of a turn, so a
            # batch of new agents joins the round-robin at once (not one per turn).
            self.tick -= 1
            return
        c = self.c
        c[C_TASKS] += 1
        self.cur = (h, kind, link)
        joined = self.joined_ns
        status = ST_OK
        try:
            if data is None:
                fref, args, kwargs = a.read_call(a.off(h))
            elif kind & F_BUFFERS:
                fref, args, kwargs = serialize.loads_frame(data, True)
            else:
                fref, args, kwargs = self.load_call(data)  # small format or pickle
            if type(fref) is int:
                fn = self.fcache.get(fref) or self.fns.get(fref)
            else:
                fn = fref
            self.in_body = True
            try:
                res = fn(*args, **kwargs) if kwargs else fn(*args)
            finally:
                self.in_body = False
        except BaseException as exc:
            status, res = ST_ERROR, exc
            c[C_ERRORS] += 1
        try:
            if FP.ON:
                FP.hit("worker.after_body")
            frame = self.frame  # created by spawn() if the task forked
            if status == ST_OK and type(res) is GeneratorType:
                if frame is None:
                    frame = self.new_frame(h, kind, link)
                frame.gen = res
                self.drive(frame, None, None)
            elif frame is not None:
                self.finish(frame, status, res)
            elif status == ST_OK and not FP.ON:
                # encode_result's common case without its wrapping: a result with an
                # out-of-band buffer, or one pickle refuses, takes report (which has it all)
                try:
                    done = a.finish_value(h, res, self.completions, self.who)
                except BaseException:  # not in-band (raised before anything was stored)
                    done = None
                if done is None:
                    self.report(h, kind, link, status, res)
                elif done == 2:
                    self.publish_child(kind, link)
                elif type(done) is bytes:  # too long to sit beside the call: stored apart
                    self.report_encoded(h, kind, link, ST_OK, done, _NO_BUFS)
            else:
                self.report(h, kind, link, status, res)
        finally:
            self.frame = None
            self.cur = None
            if self.metrics_on:  # current word cleared (release), run time recorded
                t0 += self.joined_ns - joined  # less its blocking joins
                t1 = a.end_task(self.cur_off, self.run_off, t0)
                c[C_BUSY_NS] += t1 - t0
                if c[C_TASKS] & FLUSH_MASK == 0 or t1 - self.flushed_ns > FLUSH_NS:
                    self.flush()
            else:
                a.end_task(self.cur_off, -1, 0)  # release: nothing running now

    def not_started(self, h: int) -> None:
        """``start`` found ``h`` not QUEUED: free it if cancelled; a stale copy is dropped."""
        a = self.arena
        st = a.tr.state(h)
        if st is not None and st[0] == S_CANCELLED:
            a.release(h, S_CANCELLED, 0, self.who)  # one claimer wins (copies may exist)
        self.r.store64(self.cur_off, 0)

    def report(self, h: int, kind: int, link: int, status: int, value: Any) -> None:
        """Store the outcome, RUNNING -> DONE, publish it (root: completion; child: ping).

        Never raises: a result that cannot be pickled or stored is reported as
        an error of that task (records.py: the record is ours until DONE).
        """
        self.report_encoded(h, kind, link, *encode_result(status, value))

    def report_encoded(self, h: int, kind: int, link: int, status: int, data: bytes,
                       bufs: list) -> None:
        """:meth:`report` of an outcome already pickled by :func:`encode_result` (the
        agents' journal logs the same bytes: pickled once)."""
        a = self.arena
        if not bufs and not FP.ON:  # (failpoints: take the Python path, which has them)
            done = a.finish_inline(h, status, data, self.completions, self.who)
            if done == 1 or done == -1:
                return
            if done == 2:
                self.publish_child(kind, link)
                return
        off = a.off(h)
        try:
            a.put_result(off, data, bufs)
        except BaseException as exc:  # no space for it (ENOSPC, exhausted classes), ...
            status = ST_LOST
            try:
                a.put_result(off, _describe(exc).encode()[:40], [])
            except BaseException:
                a.drop_result(off)
        a.set_status(off, status)
        if FP.ON:
            FP.hit("worker.after_store")
        if a.tr.finish(h, self.who) is not Outcome.OK:
            return  # not ours any more (cannot happen while we live: only for dead holders)
        if FP.ON:
            FP.hit("worker.after_finish")
        if kind & K_MASK == K_ROOT:
            self.publish_root(h)
        else:
            self.publish_child(kind, link)
        if FP.ON:
            FP.hit("worker.after_publish")

    def publish_child(self, kind: int, link: int) -> None:
        """A child's result (ping its parent's owner) or an agent's reply (notify the caller)."""
        if kind & K_MASK == K_REPLY:
            self.host.dir.notify(link, self.k)
        else:
            self.pings.ping(link)

    def push_any(self, h: int) -> None:
        """Recovery: a QUEUED handle onto the injector, else our own deque (never lost)."""
        while not self.injector.push(h) and not self.deque.push(h):
            time.sleep(0.0001)

    def publish_root(self, h: int) -> None:
        while not self.completions.push(h):  # capacity == records: cannot stay full
            time.sleep(0.0001)
        self.idle.wake_client(h)

    def complete_root(self, h: int, status: int, value: Any) -> None:
        """Recovery: publish a failed root task we claimed (recovery.py)."""
        a = self.arena
        off = a.off(h)
        _st, data, bufs = encode_result(ST_OK, value)  # value is already (exc, tb)
        a.put_result(off, data, bufs)
        a.set_status(off, ST_ERROR)
        a.tr.fail(h, self.who)  # ours (taken over); seq_cst CAS releases the result above
        self.publish_root(h)

def _ignore(signum: int, frame: Any) -> None:
    """A signal the worker loop needs no handler for (main)."""


def main(a: WorkerArgs) -> None:
    """Entry point of a worker process."""
    from stealer import affinity

    env = a.env
    if env is not None:  # a forkserver's child: the client's environment, not the server's
        os.environ.clear()
        os.environ.update(env)

    client = ProcessWatch(a.ppid, a.client_start)
    if client.gone():  # died (or its pid was reused) before we got here: nobody else cleans up
        unlink_all(a.name)
        os._exit(0)
    if a.thread_limit is not None:
        affinity.apply_thread_limits(a.thread_limit)
    signal.signal(signal.SIGINT, _on_sigint)
    # A peer's request (SIGUSR1) or a control message's nudge (SIGUSR2, agents/inline.py)
    # may come before the agent host installs its handlers, or where it installs none
    # (the reference queues): it must never kill the worker, the loop sees both anyway.
    # A no-op handler, not SIG_IGN, which the task's own subprocesses would inherit.
    signal.signal(signal.SIGUSR1, _ignore)
    signal.signal(signal.SIGUSR2, _ignore)
    spec, fp_dir = a.failpoints
    if fp_dir:
        os.environ["STEALER_FAILPOINTS_DIR"] = fp_dir
    failpoints.configure(spec)
    try:
        w = Worker(a)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(2)
    w.client = client
    r = w.r
    try:
        if a.cpu is not None:
            affinity.pin_current_process(a.cpu)
        if a.initializer is not None:
            init = serialize.loads_frame(a.initializer, False)
            init(*a.initargs)
    except BaseException:
        print(f"stealer: the initializer failed in worker {a.index}:", file=sys.stderr)
        traceback.print_exc()
        sys.stderr.flush()
        r.store32(w.wbase + W_STATE, STATE_INIT_FAILED)
        os._exit(EXIT_INIT_FAILED)
    r.store32(w.wbase + W_PID, os.getpid())
    r.store32(w.wbase + W_CPU, 0 if a.cpu is None else a.cpu + 1)
    r.store32(w.wbase + W_IN_STEP, 0)  # a predecessor may have died inside a step
    r.store32(w.wbase + W_STATE, STATE_READY)
    r.add32(H_STARTED, 1)
    r.futex_wake(H_STARTED, 1 << 30)
    forkjoin._current = w
    state = STATE_EXITING
    try:
        state = w.loop()
    finally:
        forkjoin._current = None
        w.flush()
        if w.journal is not None:
            w.journal.close()
        r.store32(w.wbase + W_STATE, state)
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(0)
