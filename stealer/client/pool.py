"""The client side of an executor: its workers, its result thread, its supervision.

:class:`_Pool` owns the shared segment, starts and replaces worker processes,
and runs the *result thread*: it pops completions and resolves futures,
moves backlog tasks in as records free up, and watches worker sentinels (a
dead worker's running task fails with WorkerCrashedError naming the exit
code or signal; a replacement starts; the rest goes on).  The facade
(stealer/client/executor.py) is the public API over it; stealer/client/futures.py's futures and
stealer/client/agents.py call back into it.  What a worker's death means and the
recovery of what it held are stealer/client/deaths.py's (WorkerDeaths, a mixin of
``_Pool``); the worker processes run stealer/worker/loop.py's ``main``.
"""

from __future__ import annotations

import atexit
import collections
import functools
import itertools
import multiprocessing as mp
import os
import select
import threading
import time
import weakref
from concurrent.futures import _base as _fbase
from typing import Any

from stealer.client.deaths import (
    WorkerDeaths,
    describe_exit,
    describe_start_failure,
    exited_by_itself,
)
from stealer.client.futures import _Future
from stealer.client.hang import HangWatch, hang_message
from stealer.client.waiting import Settling
from stealer.errors import (
    BrokenExecutor,
    RemoteTraceback,
    SerializationError,
)
from stealer.shared import failpoints as FP
from stealer.shared import liveness, serialize
from stealer.shared._layout import (
    F_RBUFFERS,
    K_ROOT,
    ST_ERROR,
    ST_OK,
)
from stealer.shared.arena import Arena
from stealer.shared.idle import BATCH_POLL, NOTIFIED, Idle, ResultPolicy
from stealer.shared.queues import impl as _default_queues
from stealer.shared.recovery import Pings, Recovery
from stealer.shared.shm import (
    H_CLIENT_PARK,
    H_JOURNAL,
    H_JOURNAL_MODE,
    H_SHUTDOWN,
    H_STOP_AGENTS,
    JOURNAL_MODES,
    LEASE_SLOTS,
    STATE_READY,
    STATE_STARTING,
    W_ALLOC,
    W_BUSY_AT,
    W_BUSY_AVG,
    W_CURRENT,
    W_LEASE,
    W_RING_OP,
    W_STATE,
    W_STEP_DEADLINE,
    Layout,
    Segment,
    cleanup_stale,
)
from stealer.worker.loop import WorkerArgs, result_value
from stealer.worker.loop import main as worker_main

__all__ = ["_Pool", "describe_exit", "describe_start_failure", "exited_by_itself"]

MONITOR_INTERVAL = 0.05  # seconds between checks of worker liveness

_live: weakref.WeakSet[_Pool] = weakref.WeakSet()
_exiting = False


def _python_exit() -> None:
    global _exiting
    _exiting = True
    for pool in list(_live):
        pool.begin_shutdown()
    for pool in list(_live):
        if pool.thread is not None and pool.thread is not threading.current_thread():
            pool.thread.join()


atexit.register(_python_exit)


def _forked_child() -> None:
    """``os.register_at_fork(after_in_child=...)``: this process is a fork of one that made
    executors.  Their copies here share that process's workers and shared memory, but
    not its result thread: a result popped here would be lost to that process (seen: a
    forked child's calls left the parent's 300 futures waiting forever), and a shutdown
    here (a child leaving a ``with`` block, or its exit handlers) stopped the parent's
    agents.  So each copy is marked: the API raises BrokenExecutor saying why, and its
    shutdown, cancel and stop touch nothing shared."""
    for pool in list(_live):
        pool.forked = True
        pool.broken = (f"this executor belongs to process {pool.owner}, and this process "
                       f"({os.getpid()}) is a fork of it: a forked process cannot use its "
                       "parent's executor (its workers, futures and agents answer that "
                       "process). Make an Executor in this process, or send the work back "
                       "to the parent")


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked_child)


#: Imported by the forkserver that starts replacement workers, before it forks them.
FORKSERVER_PRELOAD = ("stealer.worker.loop", "stealer.worker.agents.host")


def _forkserver() -> Any:
    """The 'forkserver' context, with the worker's modules added to the server's preload
    list if the server has not started yet (it is shared with every forkserver user of
    the process: modules they preload stay, ours are added)."""
    from multiprocessing import forkserver

    fs = getattr(forkserver, "_forkserver", None)
    mods = list(getattr(fs, "_preload_modules", None) or ["__main__"])
    want = [m for m in FORKSERVER_PRELOAD if m not in mods]
    if want and fs is not None and getattr(fs, "_forkserver_pid", 0) is None:
        forkserver.set_forkserver_preload(mods + want)
    return mp.get_context("forkserver")


class _Pool(Settling, WorkerDeaths):
    """Client-side state shared by the Executor facade and its result thread.

    Over 400 lines: the result thread's loop, the settling of completions (with the
    reference twins of the native HotPath calls), worker start and watch, and the
    backlogs all read and write the same futures, rings and records, under the rules
    of one thread; the death handling and the waiter are already mixins
    (client/deaths.py, client/waiting.py).
    """

    def __init__(self, n: int, ctx: Any, cpus: list[int | None], steal: list[list[int]],
                 initializer: bytes | None, initargs: tuple, max_tasks: int | None,
                 thread_limit: int | None, records: int, metrics: bool = True,
                 retries: int = 3, journal: Any = None,
                 hang_timeout: float | None = None, result_poll: float = BATCH_POLL) -> None:
        self.n = n
        self.journal = journal  # agents.journal.opening.ClientJournal or None
        self.retries = retries
        self.ctx = ctx
        # Replacements start from the result thread, while the other workers run. Forking
        # a process that runs other threads can copy a lock some thread holds (a deadlock
        # in the child), and a spawned interpreter imports stealer again (150-350 ms on a
        # loaded 2-core VM: most of a kill's recovery time), so with 'fork' and 'spawn'
        # replacements come from a forkserver that has the worker's modules imported
        # (not with the pure-Python queues: their fork-context lock cannot travel to it).
        # Its children inherit the server's environment: the client's travels in the
        # WorkerArgs (env), as a spawned process would have inherited it.
        self.replace_ctx = (_forkserver()
                            if ctx.get_start_method() in ("fork", "spawn")
                            and _default_queues.NATIVE else ctx)
        self.cpus = cpus
        self.steal = steal
        self.initializer = initializer
        self.initargs = initargs
        self.max_tasks = max_tasks
        self.thread_limit = thread_limit
        self.metrics = metrics
        cleanup_stale()
        Q = _default_queues
        self.native = Q.NATIVE
        self.lock = None if Q.NATIVE else ctx.Lock()  # the reference queues need one shared lock
        # STEALER_TEST_INBOX_CAP: tests only (tests/test_storm.py), a small inbox per worker
        layout = Layout(n, records=records,
                        inbox_cap=int(os.environ.get("STEALER_TEST_INBOX_CAP") or 0))
        self.layout = layout
        self.seg = seg = Segment.create(layout, self.lock, Q)
        seg.populate()
        self.hangs = HangWatch(seg, hang_timeout)  # check_hangs: frozen workers
        self.result_poll = result_poll  # throughput mode: the result thread looks this often
        self.hung: dict[int, str] = {}  # worker -> why we killed it (check_hangs, on_death)
        self.name = seg.name
        self.procs: list[Any] = [None] * n
        self.live_poll = select.poll()  # the workers' sentinels (check_workers)
        self.live_fds: dict[int, int] = {}  # sentinel fd -> worker index
        try:
            self._setup(Q)
        except BaseException:
            for p in self.procs:  # nothing may outlive a failed constructor
                if p is not None:
                    p.kill()
                    p.join(1.0)
            seg.unlink()
            raise
        _live.add(self)

    def _setup(self, Q: Any) -> None:
        seg = self.seg
        layout = self.layout
        n = self.n
        self.region = r = seg.region
        if self.journal is not None:  # its lag, for stats (shm.py H_JOURNAL_MODE, H_JOURNAL)
            r.store32(H_JOURNAL_MODE, JOURNAL_MODES.index(self.journal.mode))
            self.journal.shard.publish_to(r, H_JOURNAL)
        self.injector = Q.MPMCRing(r, layout.offsets["injector"], layout.injector_cap)
        self.injector.init()
        self.arena = Arena(seg, self.injector)
        self.arena.init()
        for k in range(n):
            Q.Deque(r, layout.deque(k), layout.records).init()
            Q.MPMCRing(r, layout.inbox(k), layout.inbox_cap).init()
        self.inboxes = [Q.MPMCRing(r, layout.inbox(k), layout.inbox_cap) for k in range(n)]
        self.completions = [Q.SPSCRing(r, layout.completion(k), layout.records) for k in range(n)]
        for ring in self.completions:
            ring.init()
        o = layout.offsets
        self.fns = serialize.FunctionTable(seg.mm, r, o["fn_table"], layout.fn_entries,
                                           o["fn_data"], layout.fn_data)
        self.idle = Idle(r, layout)
        # Pings that found an inbox full: pushed by the result thread as room appears (it
        # never waits on a worker's inbox: a worker still starting does not drain it)
        self.ping_backlog: collections.deque[tuple[int, int]] = collections.deque()
        self.pings = Pings(self.arena, self.inboxes, self.idle, -1, -1, self.defer_ping)
        self.rec = Recovery(self.arena, self.inboxes, self.idle, 0, self.push, self.pings)
        from stealer.client.agents import AgentClient

        self.agents = AgentClient(self)  # spawn/send/call/stop and agents' final values
        self.agents.j = self.journal
        # Handles set up (QUEUED) that found the injector full: pushed by the result thread
        # as room appears (deque append/popleft are atomic under the GIL).
        self.requeue: collections.deque[int] = collections.deque()
        # Completions are popped and settled under this lock, by the result thread and by a
        # client thread waiting on a future (wait_for), so a recovery that drains a dead
        # worker's ring sees every completion either on the ring or settled; the reference's
        # help() pops under it too (its look at a ring head and its pop are two calls; the
        # native help is one call under the GIL alone, with no lock)
        self.consume_lock = threading.Lock()
        # Done callbacks of futures settled under consume_lock run after it is released
        # (user code never runs under it): the holder's thread id, and the futures waiting
        # for their callbacks (_Future._invoke_callbacks defers to it)
        self.cb_owner = 0
        self.cb_later: collections.deque[_Future] = collections.deque()
        # held by the one client thread that waits on a future and settles completions
        # itself meanwhile (wait_for); the others wait on their futures' conditions
        self.waiter_role = threading.Lock()
        self.futures: dict[int, _Future] = {}
        self.rpolicy: ResultPolicy | None = None  # the result thread's, made when it starts
        self.ids = itertools.count()
        self.backlog: collections.deque[tuple[_Future, bytes, list, int]] = collections.deque()
        self.shutdown_lock = threading.Lock()
        self.shutdown = False
        self.broken: str | None = None
        self.owner = os.getpid()  # the process that made it (the only one that may use it)
        self.forked = False  # True in a fork of that process (_forked_child)
        self.incarnations = [0] * n
        self.early_deaths = [0] * n
        self.crashes = 0
        self.step_killed: dict[int, int] = {}  # worker -> agent killed for a stuck step
        self.stray = 0  # completions that found no pending future (must stay 0)
        self.closed = False
        hot = self.arena.hot
        if hot is not None:  # complete_batch in one native call (the method is its reference)
            self.complete_batch = functools.partial(  # type: ignore[method-assign]
                hot.complete_batch, futures=self.futures, loads=serialize.fast_loads,
                slow=self.complete_taken, other=self.settle_others)
            self.help_complete = hot.help_complete  # type: ignore[method-assign]
        # every MPMC ring (offset -> capacity) and the claims a dead worker left that a live
        # one's intent also names (ringfix.py): asked again at each check_workers
        self.ring_caps = {**self.arena.ring_caps, **{q.offset: q.capacity for q in self.inboxes}}
        self.ring_fill = self.arena.free_ring_offsets()  # dead pushes finished, not skipped
        self.ring_pending: list[tuple[int, int, int]] = []
        self.rings_repaired = 0
        for k in range(n):
            self.start_worker(k)
        self.thread: threading.Thread | None = threading.Thread(
            target=self.run, name=f"stealer-results-{seg.name[-8:]}", daemon=True)
        self.thread.start()

    # -- workers -------------------------------------------------------------
    def start_worker(self, k: int) -> None:
        r = self.region
        base = self.layout.worker(k)
        self.incarnations[k] += 1
        # The slot's words start empty for the new process (its predecessor, if any, was
        # recovered); release stores, read by the worker after it starts (process start
        # orders them) and by recover() after its death.
        r.store64(base + W_CURRENT, 0)
        for i in range(LEASE_SLOTS):
            r.store64(base + W_LEASE + 8 * i, 0)
        r.store64(base + W_RING_OP, 0)  # no claim named (ringfix.py)
        r.store64(base + W_ALLOC, 0)  # no record taken off the free ring (recovery.py)
        r.store64(base + W_BUSY_AT, 0)  # no busy share yet: peers see it idle (placement.py)
        r.store64(base + W_BUSY_AVG, 0)  # relaxed, as W_BUSY_AT: peers read both as a hint
        r.store32(base + W_STATE, STATE_STARTING)
        args = WorkerArgs(
            index=k, incarnation=self.incarnations[k], name=self.name,
            layout=self.layout.to_args(), lock=self.lock, native=self.native, cpu=self.cpus[k],
            metrics=self.metrics,
            steal_order=self.steal[k] if self.steal else None,
            initializer=self.initializer, initargs=self.initargs,
            max_tasks=self.max_tasks, ppid=os.getpid(), thread_limit=self.thread_limit,
            client_start=liveness.start_time(os.getpid()),  # with ppid, names this client
            # failpoints travel explicitly: a forkserver's children inherit *its* environment
            failpoints=(os.environ.get("STEALER_FAILPOINTS"),
                        os.environ.get("STEALER_FAILPOINTS_DIR")),
            journal=(None if self.journal is None else
                     (self.journal.path, self.journal.mode, self.journal.epoch)),
        )
        in_thread = threading.current_thread() is getattr(self, "thread", None)
        if in_thread and self.rpolicy is not None:
            self.rpolicy.restore()  # the new process inherits this thread's CPUs
        ctx = self.replace_ctx if in_thread else self.ctx
        if ctx is not self.ctx:
            args.env = dict(os.environ)  # what the worker would have inherited
        p = ctx.Process(target=worker_main, args=(args,), name=f"stealer-worker-{k}")
        p.start()
        self.procs[k] = p
        self.watch(k, p)

    def check_workers(self) -> None:
        """Result thread: handle every worker that exited.  One poll(2) over the workers'
        sentinels, registered once each (the thread checks whenever it goes idle: with
        multiprocessing.connection.wait that was a selector built per call, ~25 us taken
        from a worker's CPU per completion on a machine with as many workers as cores)."""
        if self.ring_pending:
            self.repair_rings()
        if not self.live_fds:
            return
        for fd, events in self.live_poll.poll(0):
            if events & select.POLLNVAL:  # closed under us (cannot happen): stop watching it
                self.live_fds.pop(fd, None)
                self.live_poll.unregister(fd)
                continue
            k = self.live_fds.get(fd)
            p = self.procs[k] if k is not None else None
            if p is not None and p.sentinel == fd:
                self.on_death(k, p)

    def watch(self, k: int, p: Any) -> None:
        """Register worker ``k``'s sentinel for check_workers."""
        self.live_poll.register(p.sentinel, select.POLLIN)
        self.live_fds[p.sentinel] = k

    def unwatch(self, p: Any) -> None:
        """Unregister a worker's sentinel (before the process object may close it)."""
        if self.live_fds.pop(p.sentinel, None) is not None:
            self.live_poll.unregister(p.sentinel)

    def set_broken(self, msg: str) -> None:
        self.broken = msg
        self.shutdown = True
        exc = BrokenExecutor(msg)
        for fid in list(self.futures):
            f = self.futures.pop(fid, None)
            if f is not None:
                self.resolve(f, ST_ERROR, (exc, ""))
        while self.backlog:
            f = self.backlog.popleft()[0]
            self.resolve(f, ST_ERROR, (exc, ""))
        self.idle.poke_waiter()

    # -- results -------------------------------------------------------------
    def resolve(self, f: _Future, status: int, value: Any) -> None:
        try:
            if status == ST_OK:
                f._st_resolve(value, None)
            else:
                exc, tb = value
                if tb:
                    exc.__cause__ = RemoteTraceback(tb)
                f._st_resolve(None, exc)
        except _fbase.InvalidStateError:
            pass  # cancelled meanwhile

    def complete_batch(self, hs: list[int]) -> None:
        """complete() for a batch, with the common case (a small pickled result) inline."""
        take = self.arena.complete_take  # frees the record if the result is inline
        loads = serialize.load_value
        futures = self.futures
        others: list[tuple[int, Any]] = []  # plain results for no future: agents', at the end
        for h in hs:
            kind, status, fid, data = take(h)
            if data is None or status != ST_OK or kind & F_RBUFFERS:
                self.complete_taken(h, kind, status, fid, data)
                continue
            try:
                value = loads(data)
            except BaseException:
                self.complete_taken(h, kind, status, fid, data)
                continue
            if fid in futures:
                self.settle(fid, value)
            else:
                others.append((fid, value))
        if others:
            self.settle_others(others)

    def settle(self, fid: int, value: Any) -> None:
        """Result thread: the plain result of task ``fid`` (or an agent's reply)."""
        f = self.futures.pop(fid, None)
        if f is None:
            self.settle_other(fid, value)
            return
        try:
            f._st_resolve(value, None)
        except _fbase.InvalidStateError:
            pass  # cancelled meanwhile

    def help(self) -> None:
        """A thread about to wait on a future of this pool (its condition was asked for:
        ``result()``, ``wait``, ``as_completed``): settle, here and now, the finished
        tasks at the head of the completion rings whose futures need no Python code (a
        small result stored inline, no waiter, no callback), instead of waiting for the
        result thread.  That thread needs the GIL the waiter holds and gets it at the
        interpreter's 5 ms switch interval, so a burst of submits followed by ``wait``
        found thousands of finished tasks unresolved and made each of them a condition
        and a waiter (20,000 no-op tasks then ``wait``: 1.2-2.9 µs per task across
        runs, now 1.2-1.5).  It stops at the first other completion, which the result
        thread takes in ring order as before: callbacks still run there, and its
        recovery of a dead worker (drain, then read the worker's words) sees every
        other completion.  (HotPath.help_complete, one native call; its reference is
        :meth:`help_complete`.)  Never in a fork of the process that made the pool: the
        completions are that process's (found: a forked child's ``cancel()`` of an
        inherited future took one, and the parent's future waited forever)."""
        if self.forked:
            return
        self.help_complete(self.completions, self.futures)  # (cheap on empty rings)

    def help_complete(self, rings: list, futures: dict) -> int:
        """Reference of HotPath.help_complete (native/_cqueues.pyx)."""
        peek = self.arena.peek_result
        taken = []
        # Never wait for the lock: its holder may be settling a future whose condition this
        # thread holds (cf.wait takes every future's condition in turn, and asks for the
        # next one's here); helping is an optimization, the holder settles them anyway.
        if not self.consume_lock.acquire(blocking=False):
            return 0
        try:
            for ring in rings:
                while True:
                    h = ring.peek()
                    if h < 0:
                        break
                    try:
                        kind, status, fid, data = peek(h)
                    except (ValueError, IndexError):
                        break  # corrupt: the result thread reports it
                    if (data is None or status != ST_OK or kind & F_RBUFFERS or not len(data)
                            or data[0] != serialize.SMALL):
                        break
                    try:
                        value = serialize.load_value(data)
                    except ValueError:
                        break
                    f = futures.get(fid)
                    if (f is None or f._st_cond is not None or f._st_cb is not None
                            or f._state != _fbase.PENDING):
                        break
                    ring.pop()
                    self.arena.free(h)
                    del futures[fid]
                    taken.append((f, value))
        finally:
            self.consume_lock.release()
        # Outside the lock: Python may switch threads between the checks above and here
        # (the native twin cannot), so _st_resolve publishes the state, then serves a
        # waiter or a callback that came meanwhile (a callback then runs in this thread)
        for f, value in taken:
            try:
                f._st_resolve(value, None)
            except _fbase.InvalidStateError:
                pass  # cancelled meanwhile
        return len(taken)

    def settle_other(self, fid: int, value: Any) -> None:
        """A result for no pending future: an agent's (or a stray: a delivery bug)."""
        if not self.agents.settle(fid, ST_OK, value) and not self.broken:
            self.stray += 1

    def settle_others(self, pairs: list[tuple[int, Any]]) -> None:
        """:meth:`settle_other` of a batch's plain results that found no future, at the
        batch's end (complete_batch and its native twin): agents' final values, one lock
        section for all of them (AgentClient.settle_many)."""
        stray = self.agents.settle_many(pairs)
        if stray and not self.broken:
            self.stray += stray

    def complete_taken(self, h: int, kind: int, status: int, fid: int, data: Any) -> None:
        """Finish a completion whose record header was read by complete_take."""
        a = self.arena
        try:
            if data is None:
                try:
                    value = a.take(a.off(h))
                finally:
                    a.free(h)
            elif kind & F_RBUFFERS:
                value = serialize.loads_frame(data, True)
            else:
                value = serialize.load_value(data)
            status, value = result_value(status, value)
        except SerializationError as exc:  # e.g. a result that could not be stored
            status, value = ST_ERROR, (exc, "")
        except BaseException as exc:
            status = ST_ERROR
            value = (SerializationError(
                f"could not unpickle the task result in the client ({type(exc).__name__}: "
                f"{exc})"), "")
        f = self.futures.pop(fid, None)
        if f is None:
            if not self.agents.settle(fid, status, value) and not self.broken:
                self.stray += 1  # a completion for no pending future: a delivery bug
        elif status == ST_OK:
            try:
                f._st_resolve(value, None)
            except _fbase.InvalidStateError:
                pass  # cancelled meanwhile
        else:
            self.resolve(f, status, value)

    def push(self, h: int) -> None:
        """Put a QUEUED handle on the injector, or on the requeue list if it is full."""
        if self.requeue or not self.injector.push(h):
            self.requeue.append(h)

    def drain_requeue(self) -> None:
        q = self.requeue
        push = self.injector.push
        moved = 0
        while q and push(q[0]):
            q.popleft()
            moved += 1
        if moved:
            self.idle.notify_one()

    def defer_ping(self, owner: int, h: int) -> None:
        """A ping or an agent's notification found worker ``owner``'s inbox full: the
        result thread pushes it later (any thread; deque append is atomic)."""
        self.ping_backlog.append((owner, h))
        if threading.current_thread() is not getattr(self, "thread", None):
            self.wake()

    def drain_pings(self) -> None:
        """Push the pings that found an inbox full (each owner's in order)."""
        q = self.ping_backlog
        for _ in range(len(q)):
            owner, h = q.popleft()
            if self.inboxes[owner].push(h):
                self.idle.notify_worker(owner)
            else:
                q.append((owner, h))

    def drain_backlog(self) -> None:
        a = self.arena
        moved = 0
        while self.backlog:
            h = a.alloc()
            if h < 0:
                break
            f, data, bufs, retries = self.backlog.popleft()
            with f._condition:
                if f._state != _fbase.PENDING:
                    a.free(h)
                    continue
                off = a.setup(h, K_ROOT, f._st_fid, time.monotonic_ns(), retries)
                a.put(off, data, bufs)
                f._st_handle = h
                f._st_backlog = False
                self.push(h)
                moved += 1
        if moved:
            self.idle.notify_one()

    def has_completions(self) -> bool:
        for c in self.completions:  # noqa: SIM110 (any() over a generator: 0.5 µs a look)
            if len(c):
                return True
        return False

    def has_result_work(self) -> bool:
        """Whether the result thread must not park: completions, or done callbacks that a
        thread in :meth:`wait_for` left to it."""
        return bool(self.cb_later) or any(len(c) for c in self.completions)

    def run(self) -> None:
        """The result thread, supervised: whatever goes wrong in it, no future hangs."""
        try:
            self._run()
        except BaseException as exc:
            self.internal_error(exc)
        finally:
            self.close()

    def internal_error(self, exc: BaseException) -> None:
        """A bug (or an injected fault) in the result thread: fail everything, clearly."""
        import sys
        import traceback

        print("stealer: internal error in the result thread:", file=sys.stderr)
        traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
        msg = (f"internal error in stealer's result thread ({type(exc).__name__}: {exc}); "
               "the executor cannot run more tasks (its traceback is on stderr; please "
               "report it). Create a new Executor.")
        for _attempt in range(3):  # resolving runs done-callbacks: keep going past them
            try:
                self.set_broken(msg)
                return
            except BaseException:
                continue

    def _run(self) -> None:
        self.rpolicy = policy = ResultPolicy(self.n, self.region, self.cpus)
        try:
            self._loop(policy)
        finally:
            policy.close()

    def _loop(self, policy: ResultPolicy) -> None:
        rings = self.completions
        last_check = 0.0
        while True:
            if FP.ON:
                FP.hit("client.result_thread")
            policy.unmove()
            if self.cb_later:  # callbacks of futures a thread in wait_for settled
                self.run_callbacks()
            got = 0
            for ring in rings:
                got += self.consume(ring, 1024)
            if self.requeue:
                self.drain_requeue()
            if self.ping_backlog:
                self.drain_pings()
            if self.backlog:
                self.drain_backlog()
            now = time.monotonic()
            if now - last_check > MONITOR_INTERVAL:
                last_check = now
                self.check_workers()
                self.check_steps()  # (a stuck step is killed "far past" its timeout: 50 ms do)
                self.check_hangs()
            elif not got:
                self.check_workers()  # a death is handled before parking: one poll(2)
            # a thread in wait_for may have parked after we popped its completion, or wait
            # on a future recovery settled here: it looks again (one load if none parks)
            self.idle.poke_waiter()
            # (the scan of every record only once the rings are empty: while a million
            # agents' final values stream in it would cost more than reading them)
            if (self.shutdown and not got and not self.futures and not self.backlog
                    and not self.agents.alive()):
                return
            if not got:
                batch = policy.update(len(self.futures))
                # in throughput mode a thread in wait_for polls every BATCH_POLL itself:
                # both polling doubled the wake-ups (a lockstep client's CPU per call)
                poll = (self.result_poll if batch and not self.waiter_role.locked()
                        else MONITOR_INTERVAL)
                self.idle.client_park(self.has_result_work, poll, batch)

    def check_steps(self) -> None:
        """Kill a worker whose agent step ran far past its step_timeout (stuck in C code,
        deaf to the StepTimeout signal): its agents restart elsewhere from checkpoints."""
        now = time.monotonic_ns()
        r = self.region
        for k, p in enumerate(self.procs):
            if p is None:
                continue
            dl = r.load64(self.layout.worker(k) + W_STEP_DEADLINE)  # pairs with Host.arm's store
            if dl and now > dl:
                import sys

                print(f"stealer: an agent step on worker {k} (pid {p.pid}) ignored its "
                      "step_timeout (stuck in C code?); killing the worker, its agents "
                      "restart from their checkpoints", file=sys.stderr)
                r.store64(self.layout.worker(k) + W_STEP_DEADLINE, 0)
                cur = r.load64(self.layout.worker(k) + W_CURRENT)
                if cur:
                    self.step_killed[k] = cur - 1  # recover() fails it with StepTimeout
                p.kill()

    def check_hangs(self) -> None:
        """Look at every worker's progress (stealer/client/hang.py); with ``hang_timeout`` set,
        kill one frozen past it: the death path (on_death -> recover) re-runs its tasks
        under the retry policy, with hang_message as the reason, and replaces it."""
        hw = self.hangs
        r = self.region
        now = time.monotonic()
        for k, p in enumerate(self.procs):
            if p is None or k in self.hung:
                continue
            # W_STATE: the worker's store32 once started (ready), read as on_death does
            ready = r.load32(self.layout.worker(k) + W_STATE) == STATE_READY
            frozen = hw.look(k, self.incarnations[k], ready, self.inboxes[k], now)
            if hw.timeout is not None and frozen > hw.timeout:
                import sys

                self.hung[k] = why = hang_message(k, p.pid, frozen, hw.timeout)
                print(f"stealer: {why}; its tasks run again elsewhere (retries permitting)",
                      file=sys.stderr)
                p.kill()  # SIGKILL also ends a stopped process; its sentinel fires next

    def check_open(self) -> None:
        """Raise if the executor takes no more work (agents' sends, spawns)."""
        if self.broken:
            raise BrokenExecutor(self.broken)
        if self.shutdown or _exiting:
            from stealer.errors import ExecutorShutdownError

            raise ExecutorShutdownError("the executor is shut down; it takes no more agents "
                                        "or messages")

    def begin_shutdown(self) -> None:
        with self.shutdown_lock:
            self.shutdown = True
        if self.forked:
            return  # (the parent's workers and agents are not ours to stop)
        self.region.store32(H_STOP_AGENTS, 1)  # seq_cst: workers stop their agents
        self.idle.notify_all()
        self.wake()

    def wake(self) -> None:
        """Wake the result thread (from the API side: shutdown, backlog)."""
        if self.forked:
            return  # (that thread is the parent's)
        r = self.region
        r.store32(H_CLIENT_PARK, NOTIFIED)  # seq_cst; its park re-checks after storing PARKED
        r.futex_wake(H_CLIENT_PARK, 1)

    def close(self) -> None:
        """Stop the workers and remove the segment (result thread, at the end)."""
        if self.closed:
            return
        self.closed = True
        r = self.region
        r.store32(H_SHUTDOWN, 1)  # seq_cst: workers exit once they find no work
        self.idle.notify_all()
        deadline = time.monotonic() + 5.0
        for p in self.procs:
            if p is None:
                continue
            p.join(max(0.0, deadline - time.monotonic()))
            if p.exitcode is None:
                p.kill()
                p.join(1.0)
        self.agents.close()
        self.seg.unlink()
        _live.discard(self)
