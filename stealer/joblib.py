"""joblib backend: ``import stealer.joblib`` registers ``"stealer"`` with joblib.

::

    import joblib, stealer.joblib
    with joblib.parallel_config(backend="stealer", n_jobs=-1):
        scores = cross_val_score(model, X, y, cv=5)       # scikit-learn's n_jobs, too
        out = joblib.Parallel()(joblib.delayed(f)(i) for i in range(1000))

What joblib users get, and how:

* One executor, created on first use and reused by every ``Parallel`` call
  after it (as loky's reusable executor is); it is re-created when a call
  asks for another number of workers (or other executor options) or when it
  broke.  :func:`shutdown` stops it (it also stops at interpreter exit).
* ``n_jobs=-1`` is every usable CPU (``stealer topo``: affinity mask and cgroup
  quota), ``-2`` one fewer, and so on; ``n_jobs=None`` under this backend means
  ``-1`` (as with Dask's backend); ``n_jobs=1`` runs sequentially in the caller.
* joblib's auto-batching (:class:`joblib.parallel.AutoBatchingMixin`): batches
  grow until one takes ``MIN_IDEAL_BATCH_DURATION`` (0.05 s; loky's is 0.2 s).
* A task's exception is raised as itself, with the worker's traceback chained
  as ``__cause__`` (what loky shows).  ``return_as="generator"`` (and
  ``"generator_unordered"``) and ``timeout`` work.
* A worker process that dies under a batch (SIGKILL, the OOM killer, a
  segfault) fails the call with :class:`TerminatedWorkerError`, which is both
  joblib's (loky's) ``TerminatedWorkerError`` and stealer's
  ``WorkerCrashedError``; the executor replaces the worker and the next call
  runs as usual.  ``parallel_config(backend="stealer", retries=3)`` re-runs such
  a batch instead (at-least-once), as stealer's own tasks do by default; the
  backend's default is 0 because joblib users expect a crash (often the OOM
  killer) to fail fast, not to run three more times.
* On error or when a generator is dropped, batches not yet started are
  withdrawn (cancelled); running ones finish (their workers are not killed).
* ``inner_max_num_threads`` sets the executor's ``thread_limit`` (BLAS/OpenMP
  threads per worker; stealer's default is 1).  Other backend parameters:
  ``cpus`` (pinning policy) and ``retries``.

Nested parallelism: a ``Parallel`` call made inside a task (scikit-learn's
``GridSearchCV(RandomForestClassifier(n_jobs=-1), n_jobs=-1)``: the forest's
own ``Parallel`` inside each fit) runs its batches as *children* of that
task on the same workers (:func:`stealer.spawn`): they go to the worker's own
deque, idle workers steal them, and the waiting worker runs its own children
while it waits (:func:`stealer.join`, a helping join that only runs the
waiting task's descendants from its own deque, so no nesting depth can
deadlock).  The whole
nest uses exactly the executor's N worker processes and keeps them all busy
even when the outer level has fewer items than workers.  Inside an agent
(which must not block its turn) a nested call runs sequentially.

``import stealer`` never imports this module or joblib; joblib is the
optional extra ``stealer[joblib]``.
"""

from __future__ import annotations

import functools
import threading
from concurrent.futures import Future
from typing import Any

from joblib.externals.loky.process_executor import (
    TerminatedWorkerError as _LokyTerminatedWorkerError,
)
from joblib.parallel import (
    AutoBatchingMixin,
    FallbackToBackend,
    ParallelBackendBase,
    SequentialBackend,
    register_parallel_backend,
)

from stealer import affinity, forkjoin
from stealer.client.executor import Executor
from stealer.errors import ExecutorShutdownError, WorkerCrashedError

__all__ = ["NestedBackend", "StealerBackend", "TerminatedWorkerError", "get_executor", "register",
           "shutdown"]

NAME = "stealer"


class TerminatedWorkerError(WorkerCrashedError, _LokyTerminatedWorkerError):
    """A worker process died while it ran a batch of this ``Parallel`` call.

    Caught by ``except joblib.externals.loky.process_executor.TerminatedWorkerError``
    (what loky raises) and by ``except stealer.WorkerCrashedError``; stealer's own
    description of the death is chained as ``__cause__``.
    """


@functools.lru_cache(maxsize=1)
def usable_cpus() -> int:
    """CPUs this process may use (affinity mask, cgroup quota): what ``n_jobs=-1`` means."""
    return max(1, affinity.read_topology().usable_count)


def in_worker() -> bool:
    """Whether this process is a stealer worker (a ``Parallel`` call here is nested)."""
    cur = forkjoin._current
    return cur is not None and cur is not forkjoin._INLINE


def _nested_n_jobs() -> int:
    """Jobs for a Parallel call inside a task: the executor's workers, as children of the
    running plain task; 1 (sequential) inside an agent, which must not block its turn."""
    w = forkjoin._current
    if w is None or w is forkjoin._INLINE or w.cur is None or w.host.current is not None:
        return 1
    return w.n


# -- the executor shared by every Parallel call ---------------------------------------


class _Shared:
    """The reusable executor, and how many backends hold it (a retired one stops at 0)."""

    def __init__(self, key: tuple, executor: Executor) -> None:
        self.key = key
        self.executor = executor
        self.users = 0
        self.retired = False


_lock = threading.Lock()
_current: _Shared | None = None


def _usable(ex: Executor) -> bool:
    pool = ex._pool
    return not (pool.shutdown or pool.broken)


def _acquire(key: tuple) -> _Shared:
    """The shared executor for ``key`` (workers, cpus, thread_limit), started if needed."""
    global _current
    retire = None
    with _lock:
        cur = _current
        if cur is not None and (cur.key != key or not _usable(cur.executor)):
            cur.retired = True
            _current = None
            if cur.users == 0:
                retire = cur
            cur = None
        if cur is None:
            n, cpus, thread_limit = key
            cur = _current = _Shared(key, Executor(n, cpus=cpus, thread_limit=thread_limit))
        cur.users += 1
    if retire is not None:
        retire.executor.shutdown(wait=True)
    return cur


def _release(shared: _Shared) -> None:
    with _lock:
        shared.users -= 1
        stop = shared.retired and shared.users == 0
    if stop:
        shared.executor.shutdown(wait=True)


def get_executor() -> Executor | None:
    """The executor the backend runs ``Parallel`` calls on now (None before the first)."""
    cur = _current
    return cur.executor if cur is not None else None


def shutdown(wait: bool = True) -> None:
    """Stop the backend's executor (the next ``Parallel`` call starts a new one).

    Calls still running on it fail with ``ExecutorShutdownError``.
    """
    global _current
    with _lock:
        cur, _current = _current, None
    if cur is not None:
        cur.retired = True
        cur.executor.shutdown(wait=wait, cancel_futures=True)


# -- the backend ---------------------------------------------------------------------


class _Options(AutoBatchingMixin, ParallelBackendBase):
    """What both backends share: their options, batching, and how they travel."""

    # joblib grows batches until one takes this long.  A task costs microseconds here,
    # not loky's milliseconds, so a smaller target loses nothing and leaves smaller
    # stragglers at the end (measured on 2 cores: 20,000 no-op items and 400 items of
    # 1-9 ms take the same time with 0.2, 0.05 or 0.01 s).
    MIN_IDEAL_BATCH_DURATION = 0.05
    MAX_IDEAL_BATCH_DURATION = 1.0

    supports_inner_max_num_threads = True
    supports_sharedmem = False
    uses_threads = False

    def __init__(self, nesting_level: int | None = None,
                 inner_max_num_threads: int | None = None, *, retries: int = 0,
                 cpus: Any = "auto", **backend_kwargs: Any) -> None:
        super().__init__(nesting_level=nesting_level,
                         inner_max_num_threads=inner_max_num_threads, **backend_kwargs)
        if not isinstance(retries, int) or isinstance(retries, bool) or not 0 <= retries <= 255:
            raise ValueError(f"retries must be an int from 0 to 255, not {retries!r}")
        self.retries = retries
        self.cpus = cpus

    def __reduce__(self) -> tuple:
        # Travels with every batch as the nested backend: options only, no executor.
        return (_rebuild, (self.nesting_level, self.inner_max_num_threads, self.retries,
                           self.cpus))

    def get_nested_backend(self) -> tuple[ParallelBackendBase, int | None]:
        # Unpickled in the worker, where StealerBackend.configure() falls back to
        # NestedBackend.
        level = (self.nesting_level or 0) + 1
        return StealerBackend(nesting_level=level, inner_max_num_threads=self.inner_max_num_threads,
                              retries=self.retries, cpus=self.cpus), None


class StealerBackend(_Options):
    """joblib ``ParallelBackendBase`` running batches on a reusable :class:`stealer.Executor`."""

    default_n_jobs = -1
    supports_retrieve_callback = True  # futures call joblib back: generators and timeouts

    def __init__(self, nesting_level: int | None = None,
                 inner_max_num_threads: int | None = None, *, retries: int = 0,
                 cpus: Any = "auto", **backend_kwargs: Any) -> None:
        super().__init__(nesting_level, inner_max_num_threads, retries=retries, cpus=cpus,
                         **backend_kwargs)
        self._shared: _Shared | None = None  # the executor leased from configure to terminate
        self._submit: Any = None  # its submit (kept after terminate: see there)
        # Futures not done yet, by the Parallel call that submitted them (BatchCompletionCallBack
        # .parallel): joblib shares one backend instance between the calls of a parallel_config
        # block, so an abort must withdraw only the aborting call's batches.
        self._pending: dict[Any, set[Future]] = {}
        self._pending_lock = threading.Lock()

    def effective_n_jobs(self, n_jobs: int | None) -> int:
        if n_jobs == 0:
            raise ValueError("n_jobs == 0 in Parallel has no meaning")
        if in_worker():  # nested inside a stealer task: its children, on the same workers
            return _nested_n_jobs()
        if n_jobs is None:
            n_jobs = self.default_n_jobs
        if n_jobs < 0:
            n_jobs = max(usable_cpus() + 1 + n_jobs, 1)
        return n_jobs

    def configure(self, n_jobs: int = 1, parallel: Any = None, prefer: Any = None,
                  require: Any = None, **backend_kwargs: Any) -> int:
        n = self.effective_n_jobs(n_jobs)
        if n == 1:
            raise FallbackToBackend(SequentialBackend(nesting_level=self.nesting_level))
        if in_worker():
            raise FallbackToBackend(NestedBackend(
                nesting_level=self.nesting_level,
                inner_max_num_threads=self.inner_max_num_threads, retries=self.retries,
                cpus=self.cpus))
        self._release()
        thread_limit = self.inner_max_num_threads
        if thread_limit is None:
            thread_limit = 1
        self._shared = _acquire((n, self.cpus, thread_limit))
        ex = self._shared.executor
        view = ex if self.retries == ex._retries else ex.options(retries=self.retries)
        self._submit = view.submit
        self.parallel = parallel
        return n

    def submit(self, func: Any, callback: Any = None) -> Future:
        if self._submit is None:
            raise RuntimeError("the stealer backend was not configured (or was terminated)")
        f = self._submit(func)
        owner = getattr(callback, "parallel", None)
        with self._pending_lock:
            self._pending.setdefault(owner, set()).add(f)
        f.add_done_callback(functools.partial(self._settled, owner))  # (before joblib's)
        if callback is not None:
            f.add_done_callback(callback)
        return f

    def _settled(self, owner: Any, f: Future) -> None:
        with self._pending_lock:
            fs = self._pending.get(owner)
            if fs is not None:
                fs.discard(f)
                if not fs:
                    del self._pending[owner]

    def retrieve_result_callback(self, future: Future) -> Any:
        try:
            return future.result()
        except WorkerCrashedError as exc:
            raise TerminatedWorkerError(
                f"A worker process of the stealer executor was unexpectedly terminated while "
                f"it ran a batch of this Parallel call: {exc}. It may have been a crash in "
                "native code or excessive memory use (the OOM killer). The executor replaced "
                "the worker; to re-run such a batch instead of failing, use "
                "parallel_config(backend='stealer', retries=3) (at-least-once).") from exc
        except ExecutorShutdownError as exc:
            raise RuntimeError(
                "The stealer executor under this Parallel call was shut down "
                "(stealer.joblib.shutdown(), or the interpreter is exiting) before the batch "
                "ran. Run Parallel calls before shutting it down; the next call starts a new "
                "executor.") from exc

    def abort_everything(self, ensure_ready: bool = True) -> None:
        """Withdraw the aborting call's batches not yet started; running ones finish.

        (joblib marks the call ``_aborting`` before it calls this; loky kills its workers
        here instead, which stops every call on them.)
        """
        with self._pending_lock:
            owners = [o for o in self._pending if o is None or getattr(o, "_aborting", True)]
            victims = [self._pending.pop(o) for o in owners]
        for fs in victims:
            for f in fs:
                f.cancel()  # runs _settled: the lock is not held here

    def terminate(self) -> None:
        """End of a call: the executor stays for the next one.

        The lease ends, but ``submit`` keeps working: a ``return_as="generator"`` call of the
        same parallel_config block may still be dispatching on this instance (loky fails
        there).  If the executor was replaced meanwhile, such a submit raises
        ExecutorShutdownError.
        """
        self._release()
        self.reset_batch_stats()

    def _release(self) -> None:
        shared, self._shared = self._shared, None
        if shared is not None:
            _release(shared)


class NestedBackend(_Options):
    """A ``Parallel`` call inside a stealer task: its batches are children of that task.

    Each batch is :func:`stealer.spawn`-ed (the worker's own deque, stealable);
    joblib's retrieval loop joins them in order with :func:`stealer.join`, during
    which this worker runs them (and their own nested batches) itself.  No executor,
    thread or process of its own.
    """

    supports_retrieve_callback = False  # results are joined in the task's own thread
    supports_timeout = True

    def effective_n_jobs(self, n_jobs: int | None) -> int:
        if n_jobs == 0:
            raise ValueError("n_jobs == 0 in Parallel has no meaning")
        return _nested_n_jobs()

    def configure(self, n_jobs: int = 1, parallel: Any = None, prefer: Any = None,
                  require: Any = None, **backend_kwargs: Any) -> int:
        n = self.effective_n_jobs(n_jobs)
        if n == 1:
            raise FallbackToBackend(SequentialBackend(nesting_level=self.nesting_level))
        self.parallel = parallel
        return n

    def submit(self, func: Any, callback: Any = None) -> _ChildJob:
        return _ChildJob(forkjoin.spawn(func), callback)

    def abort_everything(self, ensure_ready: bool = True) -> None:
        """Nothing to withdraw: children not joined finish, and the task's end waits for
        them (a child cannot be cancelled once spawned)."""


class _ChildJob:
    """What :meth:`NestedBackend.submit` returns: joblib calls ``get`` to retrieve it."""

    __slots__ = ("callback", "child")

    def __init__(self, child: forkjoin.Child, callback: Any) -> None:
        self.child = child
        self.callback = callback

    def get(self, timeout: float | None = None) -> Any:
        out = self.child.result(timeout)  # a blocking, helping join (stealer.join)
        cb, self.callback = self.callback, None
        if cb is not None:
            cb(out)  # joblib's batch bookkeeping: counts it done, dispatches the next batch
        return out


def _rebuild(nesting_level: int | None, inner: int | None, retries: int,
             cpus: Any) -> StealerBackend:
    return StealerBackend(nesting_level=nesting_level, inner_max_num_threads=inner,
                          retries=retries, cpus=cpus)


def register() -> None:
    """Register ``"stealer"`` with joblib (done on import; again is harmless)."""
    register_parallel_backend(NAME, StealerBackend)


register()
