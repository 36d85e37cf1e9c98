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

Owns :class:`Executor` (submit, map, the agents' entry points, shutdown) and
:func:`recover`, both re-exported by ``stealer``; users, stealer.joblib and the tools call
them.  The result thread, the workers and their supervision are stealer/client/pool.py's
``_Pool``; the agents' client is stealer/client/agents.py; the journal is opened here
(stealer/agents/journal/opening.py).
"""

from __future__ import annotations

import collections
import copy
import itertools
import multiprocessing as mp
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from concurrent.futures import _base as _fbase
from pickle import dumps as _pickle_dumps
from typing import Any

from stealer import affinity
from stealer.agents.api import AgentRef
from stealer.client import pool as _poolmod
from stealer.client.futures import _Future
from stealer.client.hang import check_hang_timeout
from stealer.client.pool import _Pool
from stealer.client.progress import Counted, map_progress
from stealer.client.stats import Stats, collect
from stealer.errors import (
    BrokenExecutor,
    ClusterError,
    ExecutorShutdownError,
    RemoteTraceback,
    SerializationError,
)
from stealer.forkjoin import NestedExecutor, run_chunk, run_items
from stealer.futures import CancelOnInterrupt
from stealer.shared import serialize
from stealer.shared._layout import S_CANCELLED, S_QUEUED
from stealer.shared.arena import INLINE, K_ROOT
from stealer.shared.idle import BATCH_POLL
from stealer.shared.records import Outcome as _Outcome
from stealer.shared.shm import H_STARTED

__all__ = ["Executor"]


AUTO_CHUNK_MAX = 64  # map's automatic chunksize grows 1, 2, 4... up to this


def _auto_chunks(args_iter: Iterator[tuple], cap: int) -> Iterator[list[tuple]]:
    """Chunks of 1, 2, 4... inputs up to ``cap``: the first results come at once, the
    rest pay the per-task cost once per chunk."""
    k = 1
    while True:
        chunk = list(itertools.islice(args_iter, k))
        if not chunk:
            return
        yield chunk
        if k < cap:
            k = min(cap, 2 * k)


class _MapToken:
    """The record a map's chunks read between inputs (forkjoin.run_items): QUEUED on no
    queue while the map runs; cancel() (closed, timed out, failed) moves it to CANCELLED;
    freed once every chunk's future is done (a chunk may read it until then)."""

    __slots__ = ("a", "h", "left", "lock")

    def __init__(self, a: Any, h: int) -> None:
        self.a = a
        self.h = h
        self.left = 0
        self.lock = threading.Lock()

    def watch(self, fs: collections.deque[Future]) -> None:
        if not fs:
            self._free()
            return
        with self.lock:
            self.left = len(fs)
        for f in list(fs):
            f.add_done_callback(self._one_done)

    def _one_done(self, _f: Future) -> None:
        with self.lock:
            self.left -= 1
            last = self.left == 0
        if last:
            self._free()

    def _free(self) -> None:
        a = self.a
        if a.release(self.h, S_QUEUED, 0, 0) is not _Outcome.OK:
            a.release(self.h, S_CANCELLED, 0, 0)  # cancelled first: still ours to free

    def cancel(self) -> None:
        self.a.tr.cancel(self.h)  # generation-checked CAS QUEUED -> CANCELLED; once


def _check_retries(retries: Any) -> None:
    if not isinstance(retries, int) or isinstance(retries, bool) or not 0 <= retries <= 255:
        raise ValueError(f"retries must be an int from 0 to 255, not {retries!r}")


class _MapFeed:
    """The lazy input of ``map(buffersize=N)``: submits one more task on request."""

    __slots__ = ("buffersize", "call", "executor", "items", "refused")

    def __init__(self, executor: Executor, call: Callable[..., Any], items: Iterator[tuple],
                 buffersize: int) -> None:
        # The iterator must not keep the executor alive; a view made by options() is
        # usually a temporary, so the map holds it (and through it, the executor).
        self.executor = ((lambda: executor) if executor._parent is not None
                         else weakref.ref(executor))
        self.call = call
        self.items: Iterator[tuple] | None = items  # None once exhausted or refused
        self.buffersize = buffersize
        self.refused: BaseException | None = None

    def top_up(self, fs: collections.deque[Future]) -> None:
        items = self.items
        if items is None:
            return
        ex = self.executor()
        try:
            if ex is None:
                raise ExecutorShutdownError("the executor was garbage-collected")
            if ex._pool.shutdown:
                ex._refuse()  # raises: shut down, or broken
            args = next(items, None)
            if args is None:
                self.items = None
                return
            fs.append(ex.submit(self.call, *args))
        except (ExecutorShutdownError, BrokenExecutor) as exc:
            self.items = None
            self.refused = exc

    def raise_refused(self) -> None:
        exc = self.refused
        if exc is None:
            return
        self.refused = None
        if isinstance(exc, BrokenExecutor):
            raise exc
        raise ExecutorShutdownError(
            f"map(buffersize={self.buffersize}) could not submit the rest of its input: {exc}. "
            "It has yielded the results of every task it had submitted. Iterate the map "
            "before the executor shuts down, or leave buffersize=None to submit every task "
            "up front.") from exc


def _result_or_cancel(f: Future, end_time: float | None) -> Any:
    try:
        return f.result() if end_time is None else f.result(end_time - time.monotonic())
    except BaseException:
        f.cancel()  # a timeout: withdraw it unless it has started
        raise
    finally:
        del f  # no cycle through the exception's traceback


def _raise_outcome(status: int, value: Any) -> None:
    """Raise the failed outcome of one input of an automatic chunk (forkjoin.run_items):
    1, (exception, traceback) it raised; 2, not run because the map was closed."""
    if status == 2:
        raise _fbase.CancelledError()
    exc, tb = value
    if tb:
        exc.__cause__ = RemoteTraceback(tb)
    try:
        raise exc
    finally:
        del exc, value  # no cycle through the exception's traceback and this frame


def _map_results(fs: collections.deque[Future], end_time: float | None, chunked: bool,
                 feed: _MapFeed | None, token: _MapToken | None = None) -> Iterator[Any]:
    """The iterator of map(): no local holds a result across a yield (CPython issue 14406).
    ``token``: the chunks are per-input outcomes (forkjoin.run_items)."""
    try:
        while fs:
            if feed is not None:
                feed.top_up(fs)  # before waiting: nothing in hand is lost if it is refused
            if token is not None:
                chunk = _result_or_cancel(fs.popleft(), end_time)
                chunk.reverse()
                while chunk:
                    if chunk[-1][0]:  # (status, value): the status of the next input
                        _raise_outcome(*chunk.pop())
                    # popped and indexed in one expression: no local (nor the chunk, nor
                    # the pair) holds the value while the caller has it
                    yield chunk.pop()[1]
            elif chunked:
                chunk = _result_or_cancel(fs.popleft(), end_time)
                chunk.reverse()
                while chunk:
                    yield chunk.pop()
            else:
                yield _result_or_cancel(fs.popleft(), end_time)
        if feed is not None:
            feed.raise_refused()
    finally:
        if token is not None:
            token.cancel()  # inputs of running chunks not started yet: not run
        for f in fs:
            f.cancel()



def _refuse(pool: _Pool) -> None:
    if pool.broken:
        raise BrokenExecutor(pool.broken)
    if _poolmod._exiting:
        raise ExecutorShutdownError("cannot schedule new futures after interpreter shutdown")
    raise ExecutorShutdownError("cannot schedule new futures after shutdown")


def _submit(pool: _Pool, retries: int, fn: Callable[..., Any], args: tuple,
            kwargs: dict[str, Any]) -> _Future:
    """``Executor.submit``: the reference path (stealer._cqueues.ClientSubmit is its native
    fast path for the common case and comes here for everything else)."""
    if pool.shutdown or pool.broken or _poolmod._exiting:
        _refuse(pool)
    fid = next(pool.ids)
    f = _Future(pool, fid, fn)
    try:
        fref = pool.fns._ids[fn]  # the fast path of FunctionTable.id_of
    except (KeyError, TypeError):
        fref = pool.fns.id_of(fn)
    payload = (fref if fref >= 0 else fn, args, kwargs or None)
    bufs: list = []
    data = None
    if not serialize.main_by_value():  # (else serialize.dumps: cloudpickle, by value)
        try:
            data = _pickle_dumps(payload, 5, buffer_callback=serialize.keep_large(bufs))
        except Exception:
            pass
    if data is None:
        try:
            data, bufs = serialize.dumps(payload, "task (function and arguments)")
        except SerializationError as exc:
            f.set_exception(exc)
            return f
    return _submit_data(pool, retries, f, data, bufs)


def _submit_data(pool: _Pool, retries: int, f: _Future, data: bytes, bufs: list) -> _Future:
    """The rest of :func:`_submit`, from the pickled call on."""
    fid = f._st_fid
    # Register first, then re-check: the result thread exits only once it sees
    # shutdown set *and* no futures left, so (under the GIL) a future registered
    # here is either seen by it or refused here; no lock needed per submit.
    pool.futures[fid] = f
    if pool.shutdown or pool.broken:
        del pool.futures[fid]
        _refuse(pool)
    a = pool.arena
    if not bufs and len(data) <= INLINE:
        try:
            h = a.submit_inline(K_ROOT, fid, data, retries)  # also wakes a worker
        except BaseException:  # a corrupt free ring: no future left registered for nothing
            pool.futures.pop(fid, None)
            raise
        if h >= 0:
            f._st_handle = h
            return f
        if h < -1:  # set up, but the injector is full: the result thread pushes it
            f._st_handle = h = -2 - h
            pool.requeue.append(h)
            pool.wake()
            return f
    h = a.alloc()
    if h < 0:
        f._st_backlog = True  # (before it is visible there: cancel() may withdraw it)
        pool.backlog.append((f, data, bufs, retries))
        pool.wake()
        return f
    off = a.setup(h, K_ROOT, fid, time.monotonic_ns(), retries)
    try:
        a.put(off, data, bufs)
    except BaseException:
        pool.futures.pop(fid, None)
        a.free(h)
        raise
    f._st_handle = h
    if pool.requeue or not pool.injector.push(h):
        pool.requeue.append(h)  # full (duplicates from a recovery): pushed when there is room
        pool.wake()
    pool.idle.notify_one()
    return f


class Executor(CancelOnInterrupt, _fbase.Executor):
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
    * ``retries``: how many times a task whose worker process died under it
      (SIGKILL, the OOM killer, a segfault) is run again before its future
      fails with :class:`~stealer.WorkerCrashedError` (default 3, as Ray and
      Dask do; 0 fails at once).  A re-run starts the task from the beginning:
      side effects are *at-least-once*.  Per call: ``ex.options(retries=0)``.
    * ``hang_timeout``: seconds (default None: off).  A worker that holds work
      (a task or an agent step runs on it, or pings wait for it) and makes no
      progress (no task or step starts or ends, no counter moves) for that
      long is frozen: stopped by SIGSTOP or a debugger, or stuck in code that
      never returns.  It is killed (SIGKILL) and replaced, and its tasks run
      again under ``retries``; when they are used up the future fails with
      :class:`~stealer.WorkerCrashedError` saying it hung.  A task that runs
      longer is killed too: ``hang_timeout`` must exceed your longest task
      (a blocking join counts as the time its children take).  See
      stealer/client/hang.py; ``stealer top`` shows a frozen worker as "frozen Ns".
    * ``result_poll``: seconds (default 0.002).  While many tasks are outstanding (at
      least 8 per worker: a backlog that waits several task-times anyway) the result
      thread is not woken for each completion; it looks every ``result_poll`` seconds,
      and a worker about to idle wakes it.  Each look costs the client tens of
      microseconds of CPU, so a client that takes results in batches anyway may raise it
      (a cluster's node agent uses 0.01: see README "Running on a cluster").
    * ``cluster``: a Ray address (or True: the Ray this process initialised) returns a
      :class:`stealer.cluster.client.ClusterExecutor` instead: the same ``submit``/``map``/
      ``shutdown`` over one executor per node, ``max_workers`` per node (README "Running
      on a cluster"; needs ``pip install 'stealer[ray]'``).
    * tasks may :func:`stealer.spawn` children and join them by ``yield``.

    Over 400 lines: it is the whole public API of an executor, and more than a quarter of
    it is the documentation users read (``help(stealer.Executor)``); each method is the
    checks and the hand-off of one call, the work being elsewhere (stealer/client/pool.py's
    ``_Pool``, the agents' client in stealer/client/agents.py, ``map``'s feed and results in
    this module's functions).
    """

    def __new__(cls, *args: Any, cluster: Any = None, **kwargs: Any) -> Any:
        # Executor(cluster=ADDRESS): the same API over one executor per node of a Ray
        # cluster, a class of its own (stealer/cluster/client.py says why).  The one import
        # of the cluster integration from the core, lazily here (tests/test_layers.py).
        if cluster is None:
            return super().__new__(cls)
        try:
            from stealer.cluster.client import ClusterExecutor
        except ImportError as exc:
            raise ClusterError(
                f"Executor(cluster=...) needs Ray ({exc}); install the extra: "
                "pip install 'stealer[ray]'") from exc
        if args:
            kwargs["max_workers"] = args[0]
            if len(args) > 1:
                raise TypeError("Executor(cluster=...) takes max_workers (per node) as its "
                                "only positional argument")
        return ClusterExecutor(cluster, executor_cls=cls, **kwargs)

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
        retries: int = 3,
        journal: str | os.PathLike[str] | None = None,
        durability: str = "batch",
        recover: bool = False,
        hang_timeout: float | None = None,
        result_poll: float = BATCH_POLL,
        cluster: None = None,
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
        _check_retries(retries)
        hang_timeout = check_hang_timeout(hang_timeout)
        if (isinstance(result_poll, bool) or not isinstance(result_poll, (int, float))
                or not BATCH_POLL <= result_poll <= 1.0):
            raise ValueError(f"result_poll must be seconds from {BATCH_POLL} to 1.0, not "
                             f"{result_poll!r}")
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
        self._maps: weakref.WeakSet = weakref.WeakSet()  # running map(progress=True) calls
        self._cpus = plan
        self._retries = retries
        self._parent: Executor | None = None
        cj = jplan = None
        if journal is not None:
            from stealer.agents.journal.opening import open_for_client

            cj, jplan = open_for_client(journal, durability, max_workers, recover)
        elif recover:
            raise ValueError("recover=True needs the journal to recover: "
                             "Executor(journal=PATH, recover=True)")
        try:
            self._pool = _Pool(max_workers, mp_context, plan, steal, init_bytes,
                               tuple(initargs), max_tasks_per_child, thread_limit, records,
                               metrics, retries, cj, hang_timeout, float(result_poll))
        except BaseException:
            if cj is not None:
                cj.close()
            raise
        weakref.finalize(self, self._pool.begin_shutdown)
        self._bind_submit()
        self.recovered = 0  # agents restarted from the journal (recover=True)
        if jplan is not None:
            try:
                self.recovered = self._pool.agents.recover(jplan)
            except BaseException:
                self.shutdown(wait=True)
                raise

    def options(self, *, retries: int | None = None) -> Executor:
        """A view of this executor whose ``submit``/``map`` use other per-task options.

        ``ex.options(retries=0).submit(fn, x)`` fails that task at once if its
        worker dies, instead of running it again.  The view shares the workers
        (shutting it down shuts down the executor).
        """
        view = copy.copy(self)
        view._parent = self  # keeps the executor (and its finalizer) alive with the view
        if retries is not None:
            _check_retries(retries)
            view._retries = retries
        view._bind_submit()
        return view

    def __copy__(self) -> Executor:  # (options() views: not the __reduce__ below)
        view = object.__new__(type(self))
        view.__dict__.update(self.__dict__)
        return view

    def __reduce__(self) -> tuple:
        # An executor captured by one of its own tasks: there it spawns children of the
        # running task on the same workers (forkjoin.NestedExecutor), not new processes.
        return (NestedExecutor, (self._pool.name,))

    # -- concurrent.futures API ----------------------------------------------
    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        # With the native extension, ``self.submit`` is a ClientSubmit (_bind_submit): this
        # method runs only for the pure-Python build, a subclass, or a caller that goes
        # through the class (Executor.submit(ex, ...)).
        return _submit(self._pool, self._retries, fn, args, kwargs)

    def _bind_submit(self) -> None:
        """``self.submit``: the native fast path (stealer._cqueues.ClientSubmit) when the
        extension is loaded and ``submit`` is not overridden; the method otherwise."""
        hot = self._pool.arena.hot
        if hot is None or type(self).submit is not Executor.submit:
            self.__dict__.pop("submit", None)
            return
        Q = self._pool.seg.Q
        # (where __main__ cannot be imported by the workers, the native path's stdlib
        # pickle refuses at once: _submit then pickles with cloudpickle)
        dumps = serialize.refuse_dumps if serialize.main_by_value() else _pickle_dumps
        self.submit = Q.ClientSubmit(hot, self._pool, _Future, dumps,
                                     _submit, _submit_data, self._retries)

    def _refuse(self) -> None:
        _refuse(self._pool)

    def map(self, fn: Callable[..., Any], *iterables: Iterable[Any], timeout: float | None = None,
            chunksize: int | None = None, buffersize: int | None = None,
            progress: bool = False) -> Iterator[Any]:
        """Like ``ProcessPoolExecutor.map``, with Python 3.14's ``buffersize``.

        ``chunksize`` (inputs per task) is chosen as the map goes by default:
        1, 2, 4... up to 64, and at most a quarter of the inputs per worker
        when they have a length (as ``multiprocessing.Pool.map`` does).  The
        results are the same as with one task per input: every input runs, an
        input's exception is raised at that input after the results before it,
        and closing the iterator (or a timeout) withdraws every input not
        started, also inside a running chunk.  ``chunksize=1`` gives one task
        per input; with ``buffersize`` the default is 1 (the buffer then bounds
        the inputs read ahead).

        By default every task (one per ``chunksize`` inputs) is submitted
        before ``map`` returns, as in the stdlib: the tasks run even if nobody
        iterates, and the results can be read after the executor is shut down.

        ``buffersize=N`` reads the input lazily (an endless input is fine):
        N tasks are submitted at first, then one more each time a result is
        asked for.  If the executor is shut down (or garbage-collected: the
        iterator holds it only weakly) before all the input is submitted, the
        iterator still yields the results of every task it submitted, then
        raises ExecutorShutdownError.

        Results come in input order, and the iterator keeps no reference to
        one it has yielded.  A task's exception, a TimeoutError (``timeout``
        seconds after the call to ``map``), or closing the iterator ends the
        iteration and cancels every task of the map not yet started, the one
        that timed out included.

        ``progress=True`` draws a progress bar with the rate and the time left
        on stderr while the results are read, when stderr is a terminal (tqdm's
        if tqdm is installed, else a plain one; see stealer.client.progress).
        """
        if chunksize is not None and chunksize < 1:
            raise ValueError("chunksize must be >= 1.")
        if buffersize is not None:
            if not isinstance(buffersize, int):
                raise TypeError("buffersize must be an integer or None")
            if buffersize < 1:
                raise ValueError("buffersize must be None or > 0")
        end_time = None if timeout is None else timeout + time.monotonic()
        args_iter: Iterator[tuple] = zip(*iterables)
        if progress:
            args_iter = counted = Counted(args_iter)  # the total: how many inputs were read
        call: Callable[..., Any] = fn
        items: Iterator[tuple] = args_iter
        token: _MapToken | None = None
        if chunksize is None:
            chunksize = 1
            if buffersize is None:
                token = self._map_token()
        if token is not None:
            cap = AUTO_CHUNK_MAX
            try:
                n = min(len(it) for it in iterables)  # type: ignore[arg-type]
                cap = max(1, min(cap, -(-n // (4 * self._max_workers))))
            except (TypeError, ValueError):  # an input without a length, or no input
                pass
            fref = self._pool.fns.id_of(fn)
            fn_item: Any = fref if fref >= 0 else fn
            call = run_items
            tok = token.h
            items = ((fn_item, tok, chunk) for chunk in _auto_chunks(args_iter, cap))
        elif chunksize > 1:
            fref = self._pool.fns.id_of(fn)
            fn_ref: Any = fref if fref >= 0 else fn
            call = run_chunk
            chunks = iter(lambda: list(itertools.islice(args_iter, chunksize)), [])
            items = ((fn_ref, chunk) for chunk in chunks)
        fs: collections.deque[Future] = collections.deque()
        try:
            for args in (items if buffersize is None else itertools.islice(items, buffersize)):
                fs.append(self.submit(call, *args))
        except BaseException:
            if token is not None:
                token.cancel()
                token.watch(fs)  # freed once the chunks submitted so far are done
            for f in fs:
                f.cancel()
            raise
        if token is not None:
            token.watch(fs)
        feed = None if buffersize is None else _MapFeed(self, call, items, buffersize)
        results = _map_results(fs, end_time, chunksize > 1, feed, token)
        if progress:
            return map_progress(results, counted, iterables, read_all=buffersize is None,
                                running=self._maps,
                                name=f"map({getattr(fn, '__qualname__', type(fn).__name__)})")
        return results

    def _map_token(self) -> _MapToken | None:
        """A fresh token record for a map (None if no record is free: one task per input)."""
        pool = self._pool
        if pool.shutdown or pool.broken:
            return None  # submit() refuses anyway
        a = pool.arena
        h = a.alloc()
        if h < 0:
            return None
        a.setup(h, K_ROOT, 0, time.monotonic_ns())  # QUEUED on no queue, like a reply slot
        return _MapToken(a, h)

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
        pool.begin_shutdown()  # also: agents stop at their next step boundary
        t = pool.thread
        if wait and t is not None and t is not threading.current_thread():
            t.join()

    # -- agents ----------------------------------------------------------------
    def spawn_agent(self, cls: type, /, *args: Any, init_kwargs: dict | None = None,
                    retries: int | None = None, name: str | None = None,
                    **options: Any) -> AgentRef:
        """Start an agent: ``cls(*args, **init_kwargs)`` is built on a worker, where it lives.

        Options: ``tier`` ("control" > "interactive" > "bulk", default
        "interactive"), ``mailbox`` (capacity, default 64), ``deadline``
        (seconds from now; earliest deadline first within the tier; missed:
        the agent fails with DeadlineExceeded), ``step_timeout`` (seconds;
        a longer step raises StepTimeout inside it; one stuck in C gets its
        worker killed and replaced), ``restart`` ("never" or "on-failure",
        with ``max_restarts`` per ``restart_window`` seconds),
        ``checkpoint_every`` (steps + messages) and ``checkpoint_seconds``
        between in-memory checkpoints, ``cpu_share`` (fraction of one worker
        before the agent is demoted to bulk), ``retries`` (restarts after
        worker deaths, default the executor's).  ``name`` names the agent,
        unique among the executor's live agents (with a journal,
        ``Executor(journal=PATH)``, unique in the journal, never reused):
        ``ex.agent(name)`` finds it (with a journal, also after a recovery), as
        Ray's named actors.
        Returns an :class:`~stealer.AgentRef`.  See stealer/agents/ and README.md.
        """
        r, opts = self._spawn_checks("spawn_agent", cls, retries, options)
        return self._pool.agents.spawn(cls, args, init_kwargs or {}, opts, r, name)

    def _spawn_checks(self, what: str, cls: type, retries: int | None,
                      options: dict[str, Any]) -> tuple[int, Any]:
        """spawn_agent's and spawn_agents' argument checks: (retries, AgentOptions)."""
        from stealer.agents.options import AgentOptions

        pool = self._pool
        if pool.shutdown or pool.broken or _poolmod._exiting:
            self._refuse()
        if not isinstance(cls, type) or not hasattr(cls, "__init__"):
            raise TypeError(f"{what}() takes an agent class, not {cls!r}")
        r = self._retries if retries is None else retries
        _check_retries(r)
        return r, AgentOptions.parse(options)

    def spawn_agents(self, cls: type, args_list: Iterable[tuple], /, *,
                     init_kwargs: dict | None = None, retries: int | None = None,
                     **options: Any) -> Sequence[AgentRef]:
        """Start one agent per tuple of ``args_list``: ``cls(*args, **init_kwargs)`` each,
        with the same options (those of :meth:`spawn_agent`, checked once).  Returns their
        refs in the order of ``args_list``: an :class:`~stealer.AgentRefs` (8 bytes per
        agent; ``refs[i]`` is an AgentRef).  Much cheaper per agent than a loop of
        ``spawn_agent`` (one native call and one wake-up per few thousand agents).  All or
        nothing: on an error part-way (an argument that does not pickle, no free record)
        the agents already started are stopped and the error is raised.  Named agents
        (``name=``) are spawned one by one with :meth:`spawn_agent`."""
        from stealer.client.agents_batch import spawn_many

        r, opts = self._spawn_checks("spawn_agents", cls, retries, options)
        return spawn_many(self._pool.agents, cls, args_list, init_kwargs, opts, r)

    def call_all(self, refs: Iterable[AgentRef], method: str,
                 args: Iterable[tuple] | None = None) -> list[Future[Any]]:
        """Call ``method`` on every agent in ``refs``, the i-th with the i-th tuple of
        positional arguments (``None``: none): a list of Futures in the order of
        ``refs``, from one Python call, each worker woken once for the batch (the
        lockstep pattern: ``futs = ex.call_all(envs, "step", [(a,) for a in actions])``,
        with environments whose ``step`` is a handler: ``self_driven = False``, see Agent).
        Backpressure as ``ref.call``: a full mailbox blocks until it has room.  Inside an
        agent use :func:`stealer.call_all` and ``yield`` it."""
        from stealer.agents.api import call_all

        return call_all(refs, method, args, self._pool.name)

    def agent(self, name: str) -> AgentRef:
        """The agent spawned with ``name`` (``spawn_agent(..., name=...)``) in this executor
        or its journal (in this run or, after ``recover=True``, in an earlier one); a
        finished agent's ref gives its final value (without a journal: until another agent
        takes its name).  Raises :class:`~stealer.AgentNotFound` if there is none."""
        return self._pool.agents.ref(name)

    def agents(self) -> dict[str, AgentRef]:
        """The named agents of this executor (and its journal), by name."""
        c = self._pool.agents
        return {name: c.ref(name) for name in sorted({*c.names, *c.live_names})}

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

    def stats(self, agents: bool = True) -> Stats:
        """A snapshot of counters, queue depths and latency histograms (see stealer.client.stats).

        ``agents=False`` leaves out the live agents' count and lists (a scan of every record).
        """
        pool = self._pool
        s = collect(pool.seg, agents=agents)
        for w in s.workers:  # as the result thread's last look saw it (check_hangs)
            w.frozen_s = pool.hangs.frozen(w.index)
        s.client = {
            "pending": len(pool.futures),
            "backlog": len(pool.backlog),
            "crashes": pool.crashes,
            "stray_completions": pool.stray,
            "replacements": sum(pool.incarnations) - pool.n,
            "rings_repaired": pool.rings_repaired,  # cells a dead worker left half-done
        }
        now = time.monotonic()
        s.maps = sorted((m.as_dict(now) for m in list(self._maps)),
                        key=lambda m: -m["elapsed_s"])
        return s

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


def recover(journal: str | os.PathLike[str], max_workers: int | None = None,
            **kwargs: Any) -> Executor:
    """An executor that resumes the agents of ``journal`` (written by an executor that
    died): each from its newest snapshot plus the messages it had not applied.  Same as
    ``Executor(max_workers, journal=journal, recover=True, **kwargs)``; find named
    agents with ``ex.agent(name)``."""
    return Executor(max_workers, journal=journal, recover=True, **kwargs)
