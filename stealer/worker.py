"""Worker process: find a task, run it, report it.

::

    find_task (one worker)
      inbox[k]   continuations of this worker's suspended tasks, resumed first
      deque[k]   own Chase-Lev deque, newest first (children, injector batches)
      injector   client submissions, a batch at a time (also first every 61 tasks, for fairness)
      steal      half of a peer's deque, oldest first, peers in steal order
      spin       a few rounds, then park on the futex word (idle.py)

    run: CAS record QUEUED -> RUNNING (lost: the client cancelled it) ->
         unpickle (fn id | fn, args, kwargs) -> call -> a generator is driven
         as a fork-join continuation -> pickle the result into the record ->
         root: push to completion ring k, wake the client if parked;
         child: decrement the parent's join counter, the last child resumes it.

A generator task is pinned to its worker (generators do not pickle): while
it waits for children its frame lives in ``self.conts`` and the record says
which worker and incarnation hold it.  Every resume goes through the
worker's shared inbox, so a continuation is never lost silently: when a
worker dies, its successor finds the orphaned resumes and fails those tasks
with WorkerCrashedError instead of hanging them.
"""

from __future__ import annotations

import os
import pickle
import struct
import sys
import time
import traceback
from types import GeneratorType
from typing import Any

from stealer import forkjoin, metrics, serialize
from stealer.arena import (
    F_BUFFERS,
    K_CHILD,
    K_MASK,
    K_ROOT,
    R_OWNER,
    R_PENDING,
    ST_ERROR,
    ST_OK,
    Arena,
)
from stealer.errors import RemoteError, SerializationError, WorkerCrashedError
from stealer.forkjoin import Child, children_of
from stealer.idle import Idle
from stealer.shm import (
    H_SHUTDOWN,
    H_STARTED,
    W_CPU,
    W_CURRENT,
    W_PID,
    W_STATE,
    Layout,
    Segment,
    unlink_all,
)

__all__ = ["WorkerArgs", "main", "error_payload", "finish_child", "STATE_READY"]

STATE_STARTING, STATE_READY, STATE_EXITING, STATE_RETIRED, STATE_INIT_FAILED = range(5)
EXIT_INIT_FAILED = 3

_OWNER = struct.Struct("=III")  # owner, incarnation, cont id
_I64 = struct.Struct("=q")
_U64 = struct.Struct("=Q")

SPIN_ROUNDS = 64  # search rounds before parking
PARK_TIMEOUT = 0.5  # seconds; on timeout the worker checks that its client is alive
INJECTOR_BATCH = 16
STEAL_CAP = 32
FAIR_TICK = 61
FLUSH_MASK = 63  # publish counters every 64 steps (and before parking)
_COUNTERS = struct.Struct(f"={metrics.NCOUNTERS}Q")
(C_TASKS, C_STEALS, C_STEAL_ATTEMPTS, C_PARKS, C_WAKEUPS, C_INJECTOR_TAKES, C_SPAWNS, C_RESUMES,
 C_ERRORS, C_BUSY_NS) = range(len(metrics.COUNTERS))


class WorkerArgs:
    """Everything a worker process needs; pickled by multiprocessing at start."""

    def __init__(self, **kw: Any) -> None:
        self.__dict__.update(kw)


def error_payload(exc: BaseException) -> tuple:
    """(exception, formatted traceback) of a task that raised.

    A :class:`~stealer.serialize.ErrorPayload`: it pickles (and unpickles)
    whatever the exception, so the client always gets the traceback.
    """
    return serialize.ErrorPayload(
        exc, "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))


def stand_in(payload: tuple) -> tuple:
    """An error payload whose exception did not pickle: a RemoteError with its type and text."""
    exc, tb = payload
    return RemoteError(f"{type(exc).__qualname__}: {serialize.safe_str(exc)} (the original "
                       "exception could not be pickled)"), tb


def finish_child(arena: Arena, inboxes: list, idle: Idle, parent: int, me: int = -1) -> None:
    """A child's result is in its record: count it off its parent; the last one resumes it."""
    poff = arena.off(parent)
    old = arena.region.add64(poff + R_PENDING, -1)  # acq_rel: our result writes -> the resumer
    if old == 1:
        owner = _OWNER.unpack_from(arena.mm, poff + R_OWNER)[0]  # written before the parent's add64
        while not inboxes[owner].push(parent):
            time.sleep(0.0001)
        if owner != me:
            idle.notify_worker(owner)


class _Frame:
    """A running or suspended task on this worker (fork-join state)."""

    __slots__ = ("final", "gen", "h", "kids", "kind", "link", "off", "waiting")

    def __init__(self, h: int, off: int, kind: int, link: int) -> None:
        self.h = h
        self.off = off
        self.kind = kind
        self.link = link
        self.gen: Any = None
        self.kids: dict[int, Child] = {}  # spawned children not yet joined-and-read
        self.waiting: tuple[list[Child], bool] | None = None
        self.final: tuple[int, Any] | None = None  # result held until children finish


class Worker:
    def __init__(self, a: WorkerArgs) -> None:
        from stealer import _queues

        # The client chose the implementation; every process must use the same one.
        Q = _queues.load(force_python=not a.native)
        if a.native != Q.NATIVE:
            raise RuntimeError("this worker could not load the native queues its client uses")
        self.RETRY = Q.RETRY
        self.k = a.index
        self.incarnation = a.incarnation
        self.ppid = a.ppid
        self.max_tasks = a.max_tasks or 0
        self.name = a.name
        layout = Layout.from_args(a.layout)
        self.seg = seg = Segment.attach(a.name, layout, a.lock, Q)
        self.r = r = seg.region
        self.arena = Arena(seg)
        self.idle = Idle(r, layout)
        n = layout.nworkers
        self.n = n
        self.deques = [Q.Deque(r, layout.deque(i), layout.records) for i in range(n)]
        self.inboxes = [Q.MPMCRing(r, layout.inbox(i), layout.records) for i in range(n)]
        self.deque = self.deques[self.k]
        self.inbox = self.inboxes[self.k]
        self.injector = Q.MPMCRing(r, layout.offsets["injector"], layout.records)
        self.completions = Q.SPSCRing(r, layout.completion(self.k), layout.records)
        o = layout.offsets
        self.fns = serialize.FunctionTable(seg.mm, r, o["fn_table"], layout.fn_entries,
                                           o["fn_data"], layout.fn_data)
        self.wbase = layout.worker(self.k)
        self.cur_off = self.wbase + W_CURRENT
        order = a.steal_order or [(self.k + i) % n for i in range(1, n)]
        self.victims = [self.deques[i] for i in order]
        # Metrics (metrics.py): local counters flushed to the shared block every
        # FLUSH_EVERY steps and before parking; histograms recorded per step.
        self.c = [0] * metrics.NCOUNTERS
        self.mbase = layout.metrics(self.k)
        self.metrics_on = a.metrics
        t = metrics.DEFAULT_TIER
        self.wait_off = self.mbase + metrics.hist_offset(t, 0) if a.metrics else -1
        self.run_off = self.mbase + metrics.hist_offset(t, 1)
        self.conts: dict[int, _Frame] = {}
        self.next_cid = 1
        self.frame: _Frame | None = None
        self.cur: tuple[int, int, int] | None = None  # (handle, kind, link) of the running task
        self.tick = 0

    # -- main loop -----------------------------------------------------------
    def loop(self) -> int:
        inbox_pop = self.inbox.pop
        deque_pop = self.deque.pop
        while True:
            h = inbox_pop()
            if h >= 0:
                self.resume(h)
                continue
            self.tick += 1
            if self.tick % FAIR_TICK == 0:
                h = self.injector.pop()
                if h < 0:
                    h = deque_pop()
            else:
                h = deque_pop()
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
        if len(self.inbox) or len(self.injector) or len(self.deque):
            return True
        return any(len(d) for d in self.victims)

    def take_injector(self) -> int:
        inj = self.injector
        n = len(inj)
        if n <= 0:
            return -1
        want = max(1, min(INJECTOR_BATCH, n // self.n))
        items = inj.pop_many(want)
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
        for v in self.victims:
            for _attempt in range(2):
                self.c[C_STEAL_ATTEMPTS] += 1
                h = v.steal_half(mine, STEAL_CAP)
                if h >= 0:
                    self.c[C_STEALS] += 1
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
        searching = idle.try_search(self.k)
        rounds = 0
        while True:
            if len(self.inbox):
                if searching:
                    idle.stop_search(self.k, False)
                return -1
            h = self.take_injector()
            if h < 0:
                h = self.steal()
            if h >= 0:
                if searching:
                    idle.stop_search(self.k, True)
                return h
            if r.load32(H_SHUTDOWN) and not self.conts:
                if searching:
                    idle.stop_search(self.k, False)
                return None
            rounds += 1
            if rounds < SPIN_ROUNDS:
                # Yield every round: on a machine with few cores the client (or another
                # worker) may be waiting for this CPU; a pure spin would take half of it.
                os.sched_yield()
                continue
            if searching:
                idle.stop_search(self.k, False)
                searching = False
            self.c[C_PARKS] += 1
            self.flush()
            woke = idle.park(self.k, self.has_work, PARK_TIMEOUT)
            if woke:
                self.c[C_WAKEUPS] += 1
            if not woke and os.getppid() != self.ppid:
                self.orphaned()
            rounds = 0
            searching = idle.try_search(self.k)

    def flush(self) -> None:
        """Publish the local counters to this worker's metrics block (single writer)."""
        if self.metrics_on:
            _COUNTERS.pack_into(self.seg.mm, self.mbase, *self.c)

    def orphaned(self) -> None:
        """Our client died without shutting down: remove its files and exit."""
        unlink_all(self.name)
        os._exit(0)

    # -- running tasks -------------------------------------------------------
    def execute(self, h: int) -> None:
        a = self.arena
        t0 = time.monotonic_ns()
        t = a.start(h, self.cur_off, t0, self.wait_off)  # CAS QUEUED->RUNNING, set current
        if t is None:
            a.free(h)  # the client cancelled it before it started
            return
        kind, link, data = t
        c = self.c
        c[C_TASKS] += 1
        self.cur = (h, kind, link)
        status = ST_OK
        try:
            if data is None:
                fref, args, kwargs = a.take(a.off(h))
            elif kind & F_BUFFERS:
                fref, args, kwargs = serialize.loads_frame(data, True)
            else:
                fref, args, kwargs = pickle.loads(data)
            fn = self.fns.get(fref) if type(fref) is int else fref
            res = fn(*args, **kwargs) if kwargs else fn(*args)
        except BaseException as exc:
            status, res = ST_ERROR, exc
            c[C_ERRORS] += 1
        try:
            frame = self.frame  # created by spawn() if the task forked
            if status == ST_OK and type(res) is GeneratorType:
                if frame is None:
                    frame = _Frame(h, a.off(h), kind, link)
                frame.gen = res
                self.drive(frame, None, None)
            elif frame is not None:
                self.finish(frame, status, res)
            else:
                self.report(h, kind, link, status, res)
        finally:
            self.frame = None
            self.cur = None
            self.r.store64(self.cur_off, 0)  # release: nothing running now
            if self.metrics_on:
                dt = time.monotonic_ns() - t0
                c[C_BUSY_NS] += dt
                self.r.hist_record(self.run_off, dt)
                if c[C_TASKS] & FLUSH_MASK == 0:
                    self.flush()

    def drive(self, frame: _Frame, send: Any, exc: BaseException | None) -> None:
        gen = frame.gen
        self.frame = frame
        while True:
            try:
                y = gen.throw(exc) if exc is not None else gen.send(send)
            except StopIteration as stop:
                self.finish(frame, ST_OK, stop.value)
                return
            except BaseException as e:
                self.finish(frame, ST_ERROR, e)
                return
            exc = None
            try:
                kids, single = children_of(y)
                for c in kids:
                    if c.handle != -1 and not c.done and frame.kids.get(c.handle) is not c:
                        raise TypeError("a task can only join children it spawned itself")
            except TypeError as e:
                exc = e
                continue
            frame.waiting = (kids, single)
            if not all(c.done for c in kids) and not self.join(frame):
                return  # suspended; resume() continues it
            send, exc = self.collect(frame)

    def join(self, frame: _Frame) -> bool:
        """Drop the task's token; True if every child is already done (go on now)."""
        off = frame.off
        cid = self.next_cid
        self.next_cid = (cid + 1) & 0xFFFFFFFF or 1
        _OWNER.pack_into(self.seg.mm, off + R_OWNER, self.k, self.incarnation, cid)
        old = self.r.add64(off + R_PENDING, -1)  # acq_rel: publishes R_OWNER to the last child
        if old == 1:
            _I64.pack_into(self.seg.mm, off + R_PENDING, 1)  # take the token back
            return True
        self.conts[cid] = frame
        return False

    def collect(self, frame: _Frame) -> tuple[Any, BaseException | None]:
        assert frame.waiting is not None
        kids, single = frame.waiting
        frame.waiting = None
        a = self.arena
        for c in kids:
            if c.done:
                continue
            coff = a.off(c.handle)
            status = a.kind_link(coff)[1]
            try:
                value = a.take(coff)
            except BaseException as e:
                status, value = ST_ERROR, error_payload(e)
            a.free(c.handle)
            del frame.kids[c.handle]
            c.done = True
            if status == ST_OK:
                c.value = value
            else:
                c.exc = _with_remote_tb(value)
        for c in kids:
            if c.exc is not None:
                return None, c.exc
        return (kids[0].value if single else [c.value for c in kids]), None

    def resume(self, h: int) -> None:
        a = self.arena
        off = a.off(h)
        _owner, inc, cid = _OWNER.unpack_from(self.seg.mm, off + R_OWNER)
        frame = self.conts.pop(cid, None) if inc == self.incarnation else None
        if frame is None or frame.h != h:
            self.fail_orphan(h, off)
            return
        _I64.pack_into(self.seg.mm, off + R_PENDING, 1)  # token back: no child is outstanding
        r = self.r
        r.store64(self.cur_off, h + 1)
        c = self.c
        c[C_TASKS] += 1
        c[C_RESUMES] += 1
        t0 = time.monotonic_ns()
        try:
            if frame.final is not None:
                status, value = frame.final
                frame.final = None
                self.finish(frame, status, value)
            else:
                send, exc = self.collect(frame)
                self.drive(frame, send, exc)
        finally:
            self.frame = None
            r.store64(self.cur_off, 0)
            if self.metrics_on:
                dt = time.monotonic_ns() - t0
                c[C_BUSY_NS] += dt
                r.hist_record(self.run_off, dt)

    def fail_orphan(self, h: int, off: int) -> None:
        """A resume for a continuation a dead predecessor held: fail that task."""
        kind, _status, link = self.arena.kind_link(off)
        exc = WorkerCrashedError(
            f"the worker process holding this task's continuation (worker {self.k}, an "
            "earlier incarnation) died while the task waited for its children"
        )
        self.report(h, kind, link, ST_ERROR, exc)

    def finish(self, frame: _Frame, status: int, value: Any) -> None:
        """The task body is done; wait for outstanding children (implicit join), then report."""
        if frame.kids:
            frame.waiting = None
            frame.final = (status, value)
            if not self.join(frame):
                return
            frame.final = None
            a = self.arena
            for h in frame.kids:  # results never joined: drop them
                a.free(h)
            frame.kids.clear()
        self.report(frame.h, frame.kind, frame.link, status, value)

    def report(self, h: int, kind: int, link: int, status: int, value: Any) -> None:
        """Store the result in the record; complete a root task, count a child off its parent."""
        a = self.arena
        if status != ST_OK:
            value = error_payload(value)
        try:
            data, bufs = serialize.dumps(value, "task result")
        except SerializationError as exc:
            if status != ST_OK:  # the task's exception itself does not pickle
                data, bufs = serialize.dumps(stand_in(value))
            else:
                status = ST_ERROR
                data, bufs = serialize.dumps(error_payload(exc))
        if not bufs:
            done = a.finish_inline(h, status, data, self.completions)
            if done == 1:
                return
            if done == 2:
                finish_child(a, self.inboxes, self.idle, link, self.k)
                return
        off = a.off(h)
        a.put(off, data, bufs)
        a.set_status(off, status)
        if kind & K_MASK == K_ROOT:
            while not self.completions.push(h):  # capacity == records: cannot stay full
                time.sleep(0.0001)
            self.idle.wake_client()
        else:
            finish_child(a, self.inboxes, self.idle, link, self.k)

    # -- fork-join -----------------------------------------------------------
    def spawn(self, fn: Any, args: tuple, kwargs: dict) -> Child:
        a = self.arena
        frame = self.frame
        if frame is None:
            if self.cur is None:
                raise RuntimeError("spawn() outside a running task")
            h0, kind0, link0 = self.cur
            frame = self.frame = _Frame(h0, a.off(h0), kind0, link0)
        h = a.alloc()
        if h < 0:
            return forkjoin.inline_child(fn, args, kwargs)  # arena exhausted: run it here
        fid = self.fns.id_known(fn)
        try:
            data, bufs = serialize.dumps((fid if fid >= 0 else fn, args, kwargs or None),
                                         "spawned task")
        except BaseException:
            a.free(h)
            raise
        off = a.setup(h, K_CHILD, frame.h, time.monotonic_ns())
        a.put(off, data, bufs)
        self.r.add64(frame.off + R_PENDING, 1)  # before the push: the child may finish at once
        self.c[C_SPAWNS] += 1
        c = Child(h)
        frame.kids[h] = c
        if not self.deque.push(h):
            while not self.injector.push(h):
                time.sleep(0.0001)
        self.arena.notify_one()
        return c


def _with_remote_tb(payload: Any) -> BaseException:
    exc, tb = payload
    if tb:
        from stealer.errors import RemoteTraceback

        exc.__cause__ = RemoteTraceback(tb)
    return exc


def main(a: WorkerArgs) -> None:
    """Entry point of a worker process."""
    from stealer import affinity

    if a.thread_limit is not None:
        affinity.apply_thread_limits(a.thread_limit)
    try:
        w = Worker(a)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(2)
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
        r.store32(w.wbase + W_STATE, state)
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(0)
