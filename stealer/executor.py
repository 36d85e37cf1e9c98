"""stealer.Executor: a work-stealing process pool behind the concurrent.futures API.

Data flow::

  client process                                 shared segment (/dev/shm, 0600)
  ──────────────                                 ───────────────────────────────
  submit(fn, *args) ─ pickle (fn id | fn, args) ─▶ record + payload (arena)
       │                                              │ handle
       └─ Future ◀─┐                                  ▼
                   │                            injector (MPMC ring) ─▶ worker k: find_task
                   │                            deque[k] (Chase-Lev) ◀─ spawn() / batches / steals
                   │                            inbox[k] ◀─ resumes of k's suspended tasks
  result thread ───┘◀── completion ring[k] (SPSC) ◀── worker k: result in the record
      │  also: watches worker sentinels; a dead worker's running task fails with
      │  WorkerCrashedError naming the exit code or signal, a replacement starts,
      │  the rest goes on; moves backlog tasks in when records free up.
      └─ parks on a futex word when idle; workers wake it only when it is parked.

Futures are real ``concurrent.futures.Future`` objects, so ``wait``,
``as_completed``, ``asyncio.wrap_future`` and ``loop.run_in_executor`` work.
A task's exception is re-raised in the caller with the worker-side
traceback chained as ``__cause__`` (as in CPython's ProcessPoolExecutor).
"""

from __future__ import annotations

import atexit
import collections
import itertools
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import signal
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from concurrent.futures import _base as _fbase
from pickle import dumps as _pickle_dumps
from typing import Any

from stealer import affinity, serialize
from stealer._queues import impl as _default_queues
from stealer.arena import (
    F_BUFFERS,
    INLINE,
    K_ROOT,
    R_PENDING,
    S_CANCELLED,
    S_QUEUED,
    S_RUNNING,
    ST_ERROR,
    ST_OK,
    Arena,
)
from stealer.errors import (
    BrokenExecutor,
    ExecutorShutdownError,
    RemoteTraceback,
    SerializationError,
    WorkerCrashedError,
)
from stealer.idle import NOTIFIED, Idle
from stealer.shm import (
    H_CLIENT_PARK,
    H_SHUTDOWN,
    H_STARTED,
    W_CURRENT,
    W_STATE,
    Layout,
    Segment,
    cleanup_stale,
)
from stealer.stats import Stats, collect
from stealer.worker import (
    STATE_EXITING,
    STATE_INIT_FAILED,
    STATE_RETIRED,
    STATE_STARTING,
    WorkerArgs,
    finish_child,
)
from stealer.worker import main as worker_main

__all__ = ["Executor"]

MONITOR_INTERVAL = 0.05  # seconds between checks of worker liveness
MAX_EARLY_DEATHS = 3  # a worker slot that dies this many times before starting breaks the pool

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


_SETTLED = frozenset((_fbase.CANCELLED, _fbase.CANCELLED_AND_NOTIFIED, _fbase.FINISHED))
_SETTLED_COND = threading.Condition()  # RLock-based: one thread may hold it for many futures


class _Future(Future):
    """A Future that withdraws its queued task on cancel() and is cheap to create.

    ``concurrent.futures.Future`` builds a ``threading.Condition`` per future
    (most of the cost of creating one) and takes it on every transition.
    Here the condition is created on first use (``_condition`` is a
    property), and the result thread resolves a future that nobody waits on
    yet without any lock:

    * resolver: store the result, publish ``_state = FINISHED``, *then* look
      for a condition; if one exists, take it, notify waiters and wake
      sleepers, as the stdlib does;
    * anyone who blocks (``result``, ``wait``, ``as_completed``,
      ``add_done_callback``, ``cancel``) first creates the condition, then
      reads ``_state`` under it.

    Under the GIL these steps are sequentially consistent, so either the
    reader sees FINISHED or the resolver sees the condition (a Dekker
    handshake): nothing is missed.  A future that is already settled when
    someone first asks for its condition gets a shared one (``wait`` and
    ``as_completed`` over many finished futures then create nothing).
    Every other method is the stdlib's.
    """

    _result: Any = None
    _exception: BaseException | None = None
    _st_handle: int | None = None

    def __init__(self, pool: _Pool, fid: int, fn: Any) -> None:
        # Future.__init__ without the Condition (created lazily, see _condition);
        # _result, _exception and _st_handle start as the class-level None.
        self._state = _fbase.PENDING
        self._waiters: list[Any] = []
        self._done_callbacks: list[Any] = []
        self._st_pool = pool
        self._st_fid = fid
        self._st_fn = fn  # for messages only (see _st_name)

    @property
    def _st_name(self) -> str:
        fn = self._st_fn
        return getattr(fn, "__qualname__", None) or repr(fn)

    @property
    def _condition(self) -> threading.Condition:  # type: ignore[override]
        d = self.__dict__
        cond = d.get("_st_cond")
        if cond is None:
            if self._state in _SETTLED:
                # A settled future never changes again and is never notified: every
                # settled future can share one (reentrant) condition. Waiters check
                # the state under it before they would wait, and find it settled.
                return _SETTLED_COND
            cond = d.setdefault("_st_cond", threading.Condition())  # atomic under the GIL
        return cond

    def _st_resolve(self, result: Any, exc: BaseException | None) -> None:
        """Result thread: set the outcome (raises InvalidStateError if already set)."""
        d = self.__dict__
        if "_st_cond" in d:  # somebody is (or was) waiting: the stdlib's locked path
            if exc is None:
                Future.set_result(self, result)
            else:
                Future.set_exception(self, exc)
            return
        if self._state != _fbase.PENDING:
            raise _fbase.InvalidStateError(f"{self._state}: {self!r}")
        self._result = result
        if exc is not None:
            self._exception = exc
        self._state = _fbase.FINISHED  # publish first ...
        cond = d.get("_st_cond")  # ... then look for a waiter that came meanwhile
        if cond is not None:
            with cond:
                for waiter in self._waiters:
                    if exc is None:
                        waiter.add_result(self)
                    else:
                        waiter.add_exception(self)
                cond.notify_all()
        if self._done_callbacks:
            self._invoke_callbacks()

    def result(self, timeout: float | None = None) -> Any:
        if self._state == _fbase.FINISHED and self._exception is None:
            return self._result  # fast path: no lock needed once finished
        return super().result(timeout)

    def done(self) -> bool:
        return self._state in (_fbase.CANCELLED, _fbase.CANCELLED_AND_NOTIFIED, _fbase.FINISHED)

    def cancel(self) -> bool:
        with self._condition:
            if self._state == _fbase.PENDING:
                h = self._st_handle
                if h is not None:
                    pool = self._st_pool
                    # generation-checked CAS, pairs with the worker's start CAS
                    if not pool.arena.cas_state(h, S_QUEUED, S_CANCELLED):
                        return False  # a worker started it, or it is already done
                self._st_pool.futures.pop(self._st_fid, None)
            return super().cancel()

    def running(self) -> bool:
        with self._condition:
            if self._state == _fbase.PENDING and self._st_handle is not None:
                pool = self._st_pool
                h = self._st_handle
                word = pool.region.load64(pool.arena.off(h))  # gen | state << 32
                return word == (h >> 32) | (S_RUNNING << 32)
            return super().running()


def _run_chunk(fref: Any, chunk: list[tuple]) -> list:
    """Worker side of map(chunksize>1): run fn over a chunk of argument tuples."""
    from stealer import forkjoin

    fn = forkjoin._current.fns.get(fref) if type(fref) is int else fref
    return [fn(*args) for args in chunk]


def describe_exit(k: int, pid: int | None, code: int | None) -> str:
    who = f"worker {k} (pid {pid})"
    if code is None:
        return f"{who} stopped"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        hint = {
            "SIGKILL": "killed from outside: the kernel's OOM killer (check `dmesg`), a "
            "timeout, or kill -9",
            "SIGSEGV": "a crash in native code (a C extension, ctypes, or a stack overflow)",
            "SIGBUS": "a crash in native code, or /dev/shm ran out of space",
            "SIGABRT": "the interpreter or a C library aborted (see the worker's stderr)",
        }.get(name, "a signal from the task or from outside")
        return f"{who} was killed by {name} ({hint})"
    return (f"{who} exited with code {code} while running it (a task called os._exit() or "
            "the interpreter aborted; see the worker's stderr)")


def describe_start_failure(k: int, pid: int | None, code: int | None) -> str:
    how = describe_exit(k, pid, code).split(" while running it")[0]
    return (f"{how} before it was ready (see its traceback on stderr). With the 'spawn' and "
            "'forkserver' start methods the main module is re-imported in each worker: run "
            "from a file (not stdin) and guard the entry point with "
            "`if __name__ == '__main__':`")


class _Pool:
    """Client-side state shared by the Executor facade and its result thread."""

    def __init__(self, n: int, ctx: Any, cpus: list[int | None], steal: list[list[int]],
                 initializer: bytes | None, initargs: tuple, max_tasks: int | None,
                 thread_limit: int | None, records: int, metrics: bool = True) -> None:
        self.n = n
        self.ctx = ctx
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
        layout = Layout(n, records=records)
        self.layout = layout
        self.seg = seg = Segment.create(layout, self.lock, Q)
        self.name = seg.name
        self.procs: list[Any] = [None] * n
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
        self.injector = Q.MPMCRing(r, layout.offsets["injector"], layout.records)
        self.injector.init()
        self.arena = Arena(seg, self.injector)
        self.arena.init()
        for k in range(n):
            Q.Deque(r, layout.deque(k), layout.records).init()
            Q.MPMCRing(r, layout.inbox(k), layout.records).init()
        self.inboxes = [Q.MPMCRing(r, layout.inbox(k), layout.records) for k in range(n)]
        self.completions = [Q.SPSCRing(r, layout.completion(k), layout.records) for k in range(n)]
        for ring in self.completions:
            ring.init()
        o = layout.offsets
        self.fns = serialize.FunctionTable(seg.mm, r, o["fn_table"], layout.fn_entries,
                                           o["fn_data"], layout.fn_data)
        self.idle = Idle(r, layout)
        self.futures: dict[int, _Future] = {}
        self.ids = itertools.count()
        self.backlog: collections.deque[tuple[_Future, bytes, list]] = collections.deque()
        self.shutdown_lock = threading.Lock()
        self.shutdown = False
        self.broken: str | None = None
        self.incarnations = [0] * n
        self.early_deaths = [0] * n
        self.crashes = 0
        self.closed = False
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
        r.store64(base + W_CURRENT, 0)
        r.store32(base + W_STATE, STATE_STARTING)
        args = WorkerArgs(
            index=k, incarnation=self.incarnations[k], name=self.name,
            layout=self.layout.to_args(), lock=self.lock, native=self.native, cpu=self.cpus[k],
            metrics=self.metrics,
            steal_order=self.steal[k] if self.steal else None,
            initializer=self.initializer, initargs=self.initargs,
            max_tasks=self.max_tasks, ppid=os.getpid(), thread_limit=self.thread_limit,
        )
        p = self.ctx.Process(target=worker_main, args=(args,), name=f"stealer-worker-{k}")
        p.start()
        self.procs[k] = p

    def check_workers(self) -> None:
        procs = [p for p in self.procs if p is not None]
        if not procs:
            return
        dead = mp.connection.wait([p.sentinel for p in procs], timeout=0)
        for k, p in enumerate(self.procs):
            if p is not None and p.sentinel in dead:
                self.on_death(k, p)

    def on_death(self, k: int, p: Any) -> None:
        p.join(1.0)
        code = p.exitcode
        self.procs[k] = None
        r = self.region
        base = self.layout.worker(k)
        state = r.load32(base + W_STATE)
        cur = r.load64(base + W_CURRENT)
        self.idle.forget(k)
        if state == STATE_INIT_FAILED:  # the worker says so; its exit code alone proves nothing
            self.set_broken("the initializer raised an exception in a worker process (its "
                            "traceback is on stderr); the executor cannot start workers")
            return
        if state == STATE_EXITING and r.load32(H_SHUTDOWN):
            return
        if state == STATE_RETIRED and cur == 0 and code == 0:
            self.start_worker(k)  # max_tasks_per_child reached: a planned replacement
            return
        if state == STATE_STARTING:
            desc = describe_start_failure(k, p.pid, code)
        else:
            desc = describe_exit(k, p.pid, code)
        self.crashes += 1
        if cur:
            self.fail_running(cur - 1, desc)
        if state == STATE_STARTING:
            self.early_deaths[k] += 1
            if self.early_deaths[k] >= MAX_EARLY_DEATHS:
                self.set_broken(f"{desc}, {MAX_EARLY_DEATHS} times in a row; the executor "
                                "cannot start workers")
                return
        else:
            self.early_deaths[k] = 0
        if not r.load32(H_SHUTDOWN):
            self.start_worker(k)

    def fail_running(self, h: int, desc: str) -> None:
        """The worker died while running record ``h``: fail that task, not the pool."""
        a = self.arena
        off = a.off(h)
        kind, _status, link = a.kind_link(off)
        root = (kind & 0xFF) == K_ROOT
        f = self.futures.pop(link, None) if root else None
        name = getattr(f, "_st_name", "a spawned child task")
        exc = WorkerCrashedError(f"{desc}; the task was {name}. Other tasks go on; a "
                                 "replacement worker is starting.")
        if f is not None:
            self.resolve(f, ST_ERROR, (exc, ""))
        old = self.region.add64(off + R_PENDING, -1)  # take the dead task's token
        if old != 1:
            # Children are still out there; the last one will resume this task on the
            # replacement worker, which reports it as orphaned (and the client drops it).
            return
        if root:
            a.free(h)
        else:
            a.drop_payload(off)
            a.put(off, *serialize.dumps((exc, "")))
            a.set_status(off, ST_ERROR)
            finish_child(a, self.inboxes, self.idle, link)

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
        pop = self.futures.pop
        loads = pickle.loads
        for h in hs:
            kind, status, fid, data = take(h)
            if data is None or status != ST_OK or kind & F_BUFFERS:
                self.complete_taken(h, kind, status, fid, data)
                continue
            try:
                value = loads(data)
            except BaseException:
                self.complete_taken(h, kind, status, fid, data)
                continue
            f = pop(fid, None)
            if f is not None:
                try:
                    f._st_resolve(value, None)
                except _fbase.InvalidStateError:
                    pass  # cancelled meanwhile

    def complete_taken(self, h: int, kind: int, status: int, fid: int, data: Any) -> None:
        """Finish a completion whose record header was read by complete_take."""
        a = self.arena
        try:
            if data is None:
                try:
                    value = a.take(a.off(h))
                finally:
                    a.free(h)
            elif kind & F_BUFFERS:
                value = serialize.loads_frame(data, True)
            else:
                value = pickle.loads(data)
        except BaseException as exc:
            status = ST_ERROR
            value = (SerializationError(
                f"could not unpickle the task result in the client ({type(exc).__name__}: "
                f"{exc})"), "")
        f = self.futures.pop(fid, None)
        if f is not None:
            if status == ST_OK:
                try:
                    f._st_resolve(value, None)
                except _fbase.InvalidStateError:
                    pass  # cancelled meanwhile
            else:
                self.resolve(f, status, value)

    def drain_backlog(self) -> None:
        a = self.arena
        moved = 0
        while self.backlog:
            h = a.alloc()
            if h < 0:
                break
            f, data, bufs = self.backlog.popleft()
            with f._condition:
                if f._state != _fbase.PENDING:
                    a.free(h)
                    continue
                off = a.setup(h, K_ROOT, f._st_fid, time.monotonic_ns())
                a.put(off, data, bufs)
                f._st_handle = h
                self.injector.push(h)
                moved += 1
        if moved:
            self.idle.notify_one()

    def has_completions(self) -> bool:
        return any(len(c) for c in self.completions)

    def run(self) -> None:
        """The result thread."""
        try:
            self._run()
        finally:
            self.close()

    def _run(self) -> None:
        rings = self.completions
        last_check = 0.0
        while True:
            got = 0
            for ring in rings:
                hs = ring.pop_many(1024)
                if hs:
                    got += len(hs)
                    self.complete_batch(hs)
            if self.backlog:
                self.drain_backlog()
            now = time.monotonic()
            if not got or now - last_check > MONITOR_INTERVAL:
                last_check = now
                self.check_workers()
            if self.shutdown and not self.futures and not self.backlog:
                return
            if not got:
                self.idle.client_park(self.has_completions, MONITOR_INTERVAL)

    def begin_shutdown(self) -> None:
        with self.shutdown_lock:
            self.shutdown = True
        self.wake()

    def wake(self) -> None:
        """Wake the result thread (from the API side: shutdown, backlog)."""
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
        self.seg.unlink()
        _live.discard(self)


class Executor(_fbase.Executor):
    """A ``concurrent.futures.Executor`` of worker processes that steal work from each other.

    Drop-in for :class:`~concurrent.futures.ProcessPoolExecutor`: the same
    constructor arguments, ``submit``/``map``/``shutdown``, context manager and
    exception types.  Beyond it:

    * ``cpus``: where to pin workers: ``"auto"`` (default: ``"compact"`` when
      there are enough allowed CPUs, else unpinned), ``"compact"``,
      ``"scatter"``, ``"physical"``, ``"none"``, or an explicit list of CPU ids.
    * ``thread_limit``: BLAS/OpenMP threads per worker (default 1; None leaves
      the environment alone).
    * ``records``: how many tasks may be alive at once in shared memory (more
      wait in a client-side backlog).
    * ``metrics``: keep per-worker counters and latency histograms in shared
      memory (default on; see :meth:`stats` and ``stealer top``).
    * tasks may :func:`stealer.spawn` children and join them by ``yield``.
    """

    def __init__(
        self,
        max_workers: int | None = None,
        mp_context: Any = None,
        initializer: Callable[..., object] | None = None,
        initargs: tuple = (),
        *,
        max_tasks_per_child: int | None = None,
        cpus: str | Iterable[int] | None = "auto",
        thread_limit: int | None = 1,
        records: int = 16384,
        metrics: bool = True,
    ) -> None:
        topo = affinity.read_topology()
        if max_workers is None:
            max_workers = max(1, topo.usable_count)
        elif max_workers <= 0:
            raise ValueError("max_workers must be greater than 0")
        if mp_context is None:
            mp_context = mp.get_context("spawn")
        if max_tasks_per_child is not None:
            if not isinstance(max_tasks_per_child, int) or max_tasks_per_child <= 0:
                raise ValueError("max_tasks_per_child must be >= 1")
            if mp_context.get_start_method(allow_none=False) == "fork":
                raise ValueError("max_tasks_per_child is incompatible with the 'fork' "
                                 "multiprocessing start method; supply a different mp_context.")
        if initializer is not None and not callable(initializer):
            raise TypeError("initializer must be a callable")
        if records < 2:
            raise ValueError("records must be >= 2")
        policy: Any = cpus
        if cpus == "auto":
            policy = "compact" if max_workers <= topo.usable_count else "none"
        plan = affinity.plan(max_workers, policy, topo)
        steal = affinity.steal_order(plan, topo)
        init_bytes = None
        if initializer is not None:
            data, bufs = serialize.dumps(initializer, "initializer")
            if bufs:
                raise SerializationError("the initializer must not carry out-of-band buffers")
            init_bytes = data
        self._max_workers = max_workers
        self._cpus = plan
        self._pool = _Pool(max_workers, mp_context, plan, steal, init_bytes, tuple(initargs),
                           max_tasks_per_child, thread_limit, records, metrics)
        weakref.finalize(self, self._pool.begin_shutdown)

    # -- concurrent.futures API ----------------------------------------------
    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        pool = self._pool
        if pool.shutdown or pool.broken or _exiting:
            self._refuse()
        fid = next(pool.ids)
        f = _Future(pool, fid, fn)
        try:
            fref = pool.fns._ids[fn]  # the fast path of FunctionTable.id_of
        except (KeyError, TypeError):
            fref = pool.fns.id_of(fn)
        payload = (fref if fref >= 0 else fn, args, kwargs or None)
        bufs: list = []
        try:
            data = _pickle_dumps(payload, 5, buffer_callback=bufs.append)
        except Exception:
            try:
                data, bufs = serialize.dumps(payload, "task (function and arguments)")
            except SerializationError as exc:
                f.set_exception(exc)
                return f
        # Register first, then re-check: the result thread exits only once it sees
        # shutdown set *and* no futures left, so (under the GIL) a future registered
        # here is either seen by it or refused here; no lock needed per submit.
        pool.futures[fid] = f
        if pool.shutdown or pool.broken:
            del pool.futures[fid]
            self._refuse()
        a = pool.arena
        if not bufs and len(data) <= INLINE:
            h = a.submit_inline(K_ROOT, fid, data)  # also wakes a worker if needed
            if h >= 0:
                f._st_handle = h
                return f
        h = a.alloc()
        if h < 0:
            pool.backlog.append((f, data, bufs))
            pool.wake()
            return f
        off = a.setup(h, K_ROOT, fid, time.monotonic_ns())
        try:
            a.put(off, data, bufs)
        except BaseException:
            pool.futures.pop(fid, None)
            a.free(h)
            raise
        f._st_handle = h
        pool.injector.push(h)  # capacity == records: never full
        pool.idle.notify_one()
        return f

    def _refuse(self) -> None:
        pool = self._pool
        if pool.broken:
            raise BrokenExecutor(pool.broken)
        if _exiting:
            raise ExecutorShutdownError("cannot schedule new futures after interpreter shutdown")
        raise ExecutorShutdownError("cannot schedule new futures after shutdown")

    def map(self, fn: Callable[..., Any], *iterables: Iterable[Any], timeout: float | None = None,
            chunksize: int = 1, buffersize: int | None = None) -> Iterator[Any]:
        """Like ``Executor.map``, but lazy: at most ``buffersize`` tasks are in flight.

        The first ``buffersize`` tasks (default: 4 per worker per chunk, at
        least 64) are submitted at once; each result consumed submits the
        next, so an endless input is fine.  Results come in input order.
        """
        if chunksize < 1:
            raise ValueError("chunksize must be >= 1.")
        if buffersize is None:
            buffersize = max(64, 4 * self._max_workers)
        elif buffersize < 1:
            raise ValueError("buffersize must be >= 1.")
        end_time = None if timeout is None else timeout + time.monotonic()
        args_iter = zip(*iterables)
        if chunksize > 1:
            fref = self._pool.fns.id_of(fn)
            fn_ref: Any = fref if fref >= 0 else fn
            it = iter(lambda: list(itertools.islice(args_iter, chunksize)), [])

            def submit_next() -> Future | None:
                chunk = next(it, None)
                return None if chunk is None else self.submit(_run_chunk, fn_ref, chunk)
        else:
            def submit_next() -> Future | None:
                args = next(args_iter, None)
                return None if args is None else self.submit(fn, *args)

        pending: collections.deque[Future] = collections.deque()
        while len(pending) < buffersize:
            f = submit_next()
            if f is None:
                break
            pending.append(f)

        def results() -> Iterator[Any]:
            try:
                while pending:
                    f = pending.popleft()
                    if end_time is None:
                        res = f.result()
                    else:
                        res = f.result(end_time - time.monotonic())
                    nxt = submit_next()
                    if nxt is not None:
                        pending.append(nxt)
                    if chunksize > 1:
                        yield from res
                    else:
                        yield res
            finally:
                for f in pending:
                    f.cancel()

        return results()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        pool = self._pool
        with pool.shutdown_lock:
            pool.shutdown = True
        if cancel_futures:
            for f in list(pool.futures.values()):
                f.cancel()
            while pool.backlog:
                try:
                    f = pool.backlog.popleft()[0]
                except IndexError:
                    break
                pool.futures.pop(f._st_fid, None)
                f.cancel()
        pool.wake()
        t = pool.thread
        if wait and t is not None and t is not threading.current_thread():
            t.join()

    # -- extras --------------------------------------------------------------
    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until every worker has started (and run its initializer)."""
        pool = self._pool
        r = pool.region
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            started = r.load32(H_STARTED)
            if started >= pool.n:
                return True
            if pool.broken:
                raise BrokenExecutor(pool.broken)
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            r.futex_wait(H_STARTED, started, min(0.05, left) if left is not None else 0.05)

    def stats(self) -> Stats:
        """A snapshot of counters, queue depths and latency histograms (see stealer.stats)."""
        pool = self._pool
        s = collect(pool.seg)
        s.client = {
            "pending": len(pool.futures),
            "backlog": len(pool.backlog),
            "crashes": pool.crashes,
            "replacements": sum(pool.incarnations) - pool.n,
        }
        return s

    def serve_metrics(self, port: int = 0, addr: str = "127.0.0.1") -> Any:
        """Expose :meth:`stats` as a Prometheus endpoint (needs ``prometheus-client``).

        Returns the server (``.port``, ``.url``, ``.shutdown()``); port 0 picks a
        free one.  Binds to loopback unless ``addr`` says otherwise.
        """
        from stealer import prometheus

        server, _port = prometheus.serve(self, port, addr)
        return server

    @property
    def id(self) -> str:
        """The executor's id for ``stealer top <id>`` (its shared segment's name)."""
        return self._pool.name

    @property
    def max_workers(self) -> int:
        return self._max_workers

    @property
    def cpus(self) -> list[int | None]:
        """The CPU each worker is pinned to (None: not pinned)."""
        return list(self._cpus)

    @property
    def segment_name(self) -> str:
        """Name of this executor's shared-memory segment in /dev/shm."""
        return self._pool.name

    def worker_pids(self) -> list[int | None]:
        return [p.pid if p is not None else None for p in self._pool.procs]
