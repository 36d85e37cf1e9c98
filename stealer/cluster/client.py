"""The cluster executor: the same submit/map/shutdown and futures, run by node executors.

``stealer.Executor(cluster=...)`` returns a :class:`ClusterExecutor` (the facade in
``stealer/client/executor.py`` imports this module lazily, only then).  It is its own class,
not a mode of the local ``Executor``: that one *is* a shared-memory pool (its ``submit`` is a
native call that writes a record into the segment), and a cluster client has no segment; a
flag tested in every method of the hot path would slow the local executor down for nothing.
The API is the same: a ``concurrent.futures.Executor`` whose futures are real
``concurrent.futures.Future`` objects (``wait``, ``as_completed``, ``asyncio.wrap_future``).

How a task travels::

  submit ─▶ place (power of two choices on load reports) ─▶ node's pending batch
         ─▶ NodeAgent.submit(batch): at once when no submit call to that node is out,
            else when that call's answer comes, it has batch_size tasks, or batch_s passed
  node agent queue ─▶ local stealer executor (a window) ─▶ result ─▶ node's out list
  collector thread ◀── NodeAgent.results (long poll; results + moved + load report,
                       each batch sent again until the next poll acknowledges it)

* **The ledger**: task id → (future, call, node, losses).  A node's results settle futures
  (the first result of a task wins; a later duplicate is dropped, so results are never
  duplicated); a victim's report of tasks a thief took moves them in the ledger.
* **Node loss**: an ``ActorDiedError`` from a node agent, or the node reported dead by Ray,
  is authoritative: every unfinished task of that node is placed again on the others, each
  loss counted against the executor's ``retries`` (as a worker death is on one machine:
  at-least-once; past it the future fails with :class:`~stealer.errors.NodeLostError`).  A
  transient ``ActorUnavailableError`` only retries the call with backoff.  A node agent that
  fenced itself (:class:`~stealer.errors.NodeFencedError`) counts as lost.
* **Nodes joining**: the membership thread looks at ``ray.nodes()`` every ``health_s`` and
  starts a node agent on each new alive node with CPUs; its cores join the placement when
  its executor is ready.  It also pings each node agent (their ``health`` concurrency group),
  which keeps them from fencing themselves.

* **Agents between live nodes**: each load report also goes to the rebalancing rule
  (``balance.py``), which may move agents from a busy node to an idle one by checkpoint +
  restore (``moves.py``).

Threads: the caller's (``submit`` appends to a batch; a full batch is sent from there), the
collector (waits on every outstanding Ray call, settles futures, re-places lost work, moves
agents), the membership/flush thread (time-bounded batches, pings, joins and deaths) and
the publisher of the figures ``stealer top`` reads (``snapshot.py``, four times a second).
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import random
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from concurrent.futures import _base as _fbase
from typing import Any

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError, RayTaskError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from stealer.cluster import asks, snapshot
from stealer.cluster.agents import AgentsOnCluster, ClusterAgentRef
from stealer.cluster.balance import BalanceConfig, Balancer
from stealer.cluster.journal import ClusterJournal, JournalOnCluster
from stealer.cluster.ledger import AgentRecord, ClusterStats, NodeView, Task
from stealer.cluster.moves import AgentMoves
from stealer.cluster.node import WITHDRAWN, AgentOp, NodeAgent, run_chunk, share_class_trackers
from stealer.cluster.policy import Load, StealConfig, place
from stealer.errors import (
    ClusterError,
    ExecutorShutdownError,
    NodeFencedError,
    NodeLostError,
    SerializationError,
    with_remote_tb,
)
from stealer.futures import AwaitableFuture, CancelOnInterrupt, notify_cancelled

__all__ = ["ClusterAgentRef", "ClusterExecutor", "ClusterStats"]

DEFAULT_STEAL = StealConfig()  # frozen: one instance serves every executor
DEFAULT_BALANCE = BalanceConfig()
START_S = 60.0  # node agents must be ready this long after Executor(cluster=...)
CANCEL_S = 5.0  # the longest Future.cancel() waits for its node's answer

#: Local executor options a node executor takes as they are.
LOCAL_OPTIONS = ("cpus", "thread_limit", "records", "metrics", "hang_timeout",
                 "max_tasks_per_child", "initializer", "initargs", "result_poll")


def _pct(sorted_s: list[float], q: float) -> float | None:
    """The q-th percentile of sorted seconds, in ms (None: no sample)."""
    if not sorted_s:
        return None
    return 1e3 * sorted_s[min(len(sorted_s) - 1, int(len(sorted_s) * q / 100))]


def _complain(who: str, exc: BaseException) -> None:
    import sys
    import traceback

    print(f"stealer.cluster: {who} caught {type(exc).__name__}: {exc} (going on)",
          file=sys.stderr)
    traceback.print_exc()


def _withdrawn(fut: Future) -> bool:
    """Settle as cancelled a task future its node dropped unstarted (NodeAgent.cancel); the
    future is RUNNING since its batch left, which the stdlib's cancel() refuses.  Does
    what cancel() and set_running_or_notify_cancel() together would.  False if the
    future has a result already."""
    with fut._condition:
        if fut._state in (_fbase.CANCELLED, _fbase.CANCELLED_AND_NOTIFIED):
            return True
        if fut._state == _fbase.FINISHED:
            return False
        notify_cancelled(fut)
    fut._invoke_callbacks()
    return True


class TaskFuture(AwaitableFuture):
    """A cluster task's future.  ``cancel()`` works as on a local executor: a task still in
    the client's batch is dropped there; one its node holds but has not started is
    withdrawn from the node (one Ray call, at most CANCEL_S), and cancel() says True only
    when the node confirms it will not run."""

    def __init__(self, ex: ClusterExecutor, tid: int) -> None:
        super().__init__()
        self._cx = weakref.ref(ex)
        self._tid = tid

    def cancel_local(self) -> bool:
        """The stdlib's cancel(): only a task still in the client's batch (or cancelled)."""
        return Future.cancel(self)

    def cancel(self) -> bool:
        if Future.cancel(self):
            return True
        ex = self._cx()
        if ex is None or self.done():
            return False
        return ex._withdraw([self._tid]) == [self._tid] and _withdrawn(self)


def _connect(cluster: Any) -> bool:
    """Connect to Ray; True if this executor called ray.init (and so shuts Ray down)."""
    if cluster is True or cluster is ray:
        if not ray.is_initialized():
            raise ClusterError("Executor(cluster=True) uses the Ray this process already "
                               "started, but ray.init() was not called; call it first or "
                               "pass the cluster's address: Executor(cluster='HOST:PORT')")
        return False
    if not isinstance(cluster, str):
        raise ClusterError(f"cluster= takes a Ray address ('auto', 'HOST:PORT', "
                           f"'ray://HOST:PORT') or True, not {cluster!r}")
    if ray.is_initialized():
        return False
    try:
        ray.init(address=cluster, include_dashboard=False, log_to_driver=False,
                 configure_logging=False)
    except Exception as exc:
        raise ClusterError(f"cannot connect to the Ray cluster at {cluster!r}: {exc}. Start "
                           "one (`ray start --head`) or pass its address") from exc
    return True


class ClusterExecutor(JournalOnCluster, AgentMoves, AgentsOnCluster, CancelOnInterrupt,
                      _fbase.Executor):
    """A ``concurrent.futures.Executor`` over one stealer executor per node of a Ray cluster.

    ``cluster``: a Ray address, or True for the Ray this process already initialised.
    ``max_workers``: worker processes per node at most (default: the node's CPUs).
    ``retries``: node losses (and worker deaths on a node) a task survives.  A task goes
    to its node at once when no submit call to that node is out; while one is, the tasks
    that come make a batch, which goes when that call's answer comes, when it has
    ``batch_size`` tasks, or ``batch_s`` after its first.  ``linger_s``: a node holds
    results back up to that long to batch them while it still runs work (never when it
    has nothing left).  ``fence_s``: a node agent that hears
    nothing from this client for that long stops
    its workers.  ``steal``: the steal rules between nodes (a StealConfig; None: no stealing
    between nodes).  ``rebalance``: when agents move between live nodes (a BalanceConfig,
    ``stealer/cluster/balance.py``; None: only when their node is lost).  ``top_s``: how
    often the figures ``stealer top`` shows are published (None: not published).  Other
    keyword arguments (``cpus``, ``thread_limit``, ``records``,
    ``metrics``, ``hang_timeout``, ``max_tasks_per_child``, ``initializer``, ``initargs``)
    go to each node's executor.  Agents: ``spawn_agent``, ``agent(name)``, ``agents()``,
    ``call_all`` (``stealer/cluster/agents.py``).  ``journal``, ``durability``,
    ``recover``: the agents' journal, as on one machine (``stealer/cluster/journal.py``:
    the client writes it; with ``recover=True`` the agents of an earlier client resume).
    """

    def __init__(self, cluster: Any, *, executor_cls: type, max_workers: int | None = None,
                 retries: int = 3, batch_size: int = 256, batch_s: float = 0.002,
                 fence_s: float = 10.0, health_s: float = 0.5, window_s: float = 0.005,
                 linger_s: float = 0.05,
                 steal: StealConfig | None = DEFAULT_STEAL,
                 rebalance: BalanceConfig | None = DEFAULT_BALANCE,
                 top_s: float | None = snapshot.INTERVAL_S, seed: int | None = None,
                 journal: Any = None, durability: str = "batch", recover: bool = False,
                 **local: Any) -> None:
        bad = sorted(set(local) - set(LOCAL_OPTIONS))
        if bad:
            raise ClusterError(f"Executor(cluster=...) does not take {', '.join(bad)}; "
                               "drop them or use a local Executor")
        if recover and journal is None:
            raise ValueError("recover=True needs the journal to recover: "
                             "Executor(cluster=..., journal=PATH, recover=True)")
        if not isinstance(retries, int) or not 0 <= retries <= 255:
            raise ValueError(f"retries must be an int from 0 to 255, not {retries!r}")
        self._owns_ray = _connect(cluster)
        share_class_trackers()  # (node.py: one set of ids for classes written by value)
        self._cls = executor_cls
        self._local = {"retries": retries, **local}
        self._max_workers = max_workers
        self._retries = retries
        self._batch_size = batch_size
        self._batch_s = batch_s
        self._fence_s = fence_s
        self._health_s = health_s
        self._window_s = window_s
        self._linger_s = linger_s
        self._steal = steal
        self._rng = random.Random(seed)
        self._lock = threading.RLock()
        self._wake = threading.Condition(self._lock)
        self._tids = itertools.count()
        self._ledger: dict[int, Task] = {}
        self._gone: set[int] = set()  # tasks withdrawn (NodeAgent.cancel), outcome not in yet
        self._agents: dict[int, AgentRecord] = {}
        self._waiting_for: dict[int, dict[int, int]] = {}  # (agents.py: _wait_edge)
        self._names: dict[str, AgentRecord] = {}
        self._nodes: dict[str, NodeView] = {}
        self._orphans: list[int] = []  # tasks with no alive node to go to
        self._waits: dict[Any, tuple] = {}  # ObjectRef -> (kind, node, extra)
        self._membership = 0  # bumped whenever a node becomes ready or is lost
        self._stats = ClusterStats()
        self._shutdown = False
        self._closing = False
        self._balancer = Balancer(rebalance) if rebalance is not None else None
        self._moving: set[int] = set()  # agents whose state is on its way (moves.py)
        self._id = snapshot.new_id()
        self._token = os.urandom(8).hex()  # names it to refs pickled into tasks (asks.py)
        asks.register(self._token, self)
        self._created = time.time()
        self._top: snapshot.Publisher | None = None
        if journal is not None:  # (locked before any node agent takes the nodes' CPUs)
            try:
                self._journal = ClusterJournal(journal, durability, len(ray.nodes()),
                                               recover, self._tids)
            except BaseException:
                if self._owns_ray:
                    ray.shutdown()
                raise
        self._start_nodes(wait=True)
        if not any(n.ready for n in self._nodes.values()):
            self._stop_nodes()
            raise ClusterError("no alive Ray node with a CPU to run a node executor on; "
                               "add nodes with `ray start --num-cpus=N`")
        self._threads = [threading.Thread(target=self._collect, name="stealer-cluster-results",
                                          daemon=True),
                         threading.Thread(target=self._tend, name="stealer-cluster-tend",
                                          daemon=True)]
        for t in self._threads:
            t.start()
        if self._journal is not None:
            self._recover_journal()
        if top_s:
            self._top = snapshot.Publisher(self._id, self._snapshot, top_s)

    # -- nodes -----------------------------------------------------------------------------

    def _start_nodes(self, wait: bool) -> None:
        """A node agent on every alive node with CPUs that has none yet."""
        starting = []
        for info in ray.nodes():
            nid = info["NodeID"]
            cpus = int(info.get("Resources", {}).get("CPU", 0))
            if not info.get("Alive") or cpus < 1 or nid in self._nodes:
                continue
            workers = min(cpus, self._max_workers or cpus)
            handle = NodeAgent.options(
                num_cpus=workers, max_restarts=0, max_task_retries=0,
                scheduling_strategy=NodeAffinitySchedulingStrategy(nid, soft=False),
            ).remote(nid, self._cls, workers, self._local, self._fence_s, self._window_s,
                     self._steal, self._rng.randrange(1 << 30))
            node = NodeView(nid, handle, workers)
            with self._lock:
                self._nodes[nid] = node
            starting.append((node, handle.ping.remote()))
        if not wait:
            with self._lock:
                for node, ref in starting:
                    self._waits[ref] = ("ready", node, None)
            return
        deadline = time.monotonic() + START_S
        for node, ref in starting:
            try:
                node.load = ray.get(ref, timeout=max(0.1, deadline - time.monotonic()))
                node.ready = True
                self._membership += 1
                self._share_view()
                self._poll(node)
            except Exception as exc:
                node.alive = False
                ray.kill(node.handle, no_restart=True)
                if isinstance(exc, RayTaskError):
                    self._stop_nodes()
                    raise ClusterError(f"the node executor on {node.id[:12]} failed to start: "
                                       f"{exc}") from exc
                if isinstance(exc, ray.exceptions.GetTimeoutError):
                    self._stop_nodes()
                    raise ClusterError(
                        f"no node agent started on node {node.id[:12]} in {START_S:.0f} s: "
                        f"a node agent takes a CPU per worker (num_cpus={node.workers}, all "
                        "of the node's unless max_workers= says fewer), so another cluster "
                        "executor, or Ray tasks and actors holding CPUs there, keep it from "
                        "being placed. Shut the other executor down, free the node's CPUs "
                        "or pass max_workers=") from exc

    def _poll(self, node: NodeView) -> None:
        """The node's next long poll for results (one outstanding per node), with the
        client's view of the nodes' loads (their handles go by :meth:`_share_view`)."""
        loads = {n.id: n.load for n in self._nodes.values() if n.alive and n.ready}
        ref = node.handle.results.remote(node.acked, 0.5, self._linger_s, loads, None)
        with self._lock:
            self._waits[ref] = ("results", node, None)

    def _share_view(self) -> None:
        """Send each live node the set of nodes (their handles) once it changed: a node
        became ready or was lost.  At once, not with the node's next long poll: that was
        up to 0.5 s away, and until then a node could not steal from or take children of
        a peer it did not know (measured: the first fib(33) tree after an executor
        started ran on one node, 0.52-0.56 s in 3 of 3 executors where the later ones
        took 0.32-0.46 s).  Only when the set changed since that node last got it
        (deserializing actor handles costs the node agent more than the rest of a call);
        the version orders the calls there."""
        with self._lock:  # (called by the results thread, a retry's timer, the start)
            version = self._membership
            nodes = [n for n in self._nodes.values() if n.alive and n.ready]
        peers = {n.id: n.handle for n in nodes}
        for node in nodes:
            if node.peers_seen != version:
                node.peers_seen = version
                ref = node.handle.view.remote(version, peers)
                with self._lock:
                    self._waits[ref] = ("view", node, None)

    def _alive(self) -> dict[str, Load]:
        return {n.id: n.load for n in self._nodes.values() if n.alive and n.ready}

    # -- submit ------------------------------------------------------------------------------

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        with self._lock:
            if self._shutdown:
                raise ExecutorShutdownError("cannot schedule new futures after shutdown")
            tid = next(self._tids)
            fut = TaskFuture(self, tid)
            t = Task(fut, (fn, args, kwargs), None)
            self._ledger[tid] = t
            self._stats.submitted += 1
            full = self._place(tid, t)
        if full is not None:
            self._send(full)
        return fut

    def submit_to(self, node_id: str, fn: Callable[..., Any], /, *args: Any,
                  **kwargs: Any) -> Future:
        """``submit`` to a chosen node (data already there, or a test of stealing): it is
        queued there, and idle nodes may still steal it."""
        with self._lock:
            if self._shutdown:
                raise ExecutorShutdownError("cannot schedule new futures after shutdown")
            node = self._nodes.get(node_id)
            if node is None or not node.alive:
                raise ClusterError(f"no node executor on node {node_id!r}; pick one of "
                                   "ex.nodes")
            tid = next(self._tids)
            fut = TaskFuture(self, tid)
            t = Task(fut, (fn, args, kwargs), node)
            self._ledger[tid] = t
            self._stats.submitted += 1
            full = self._enqueue(node, tid, t)
        if full is not None:
            self._send(full)
        return fut

    def _place(self, tid: int, t: Task) -> NodeView | None:
        """Put a task in a node's pending batch (under the lock); the node if that batch is
        to go now (:meth:`_enqueue`; the caller sends it, outside the lock)."""
        loads = self._alive()
        if not loads:
            t.node = None
            self._orphans.append(tid)
            return None
        return self._enqueue(self._nodes[place(loads, self._rng, self._sent(loads))], tid, t)

    def _enqueue(self, node: NodeView, tid: int, t: Task) -> NodeView | None:
        """A task to a node's pending batch (under the lock); the node if the batch is to
        go now (the caller sends it, outside the lock): when it is full, or when no
        submit call to that node is out (a lone task does not wait ``batch_s``: measured
        on the 2-node test cluster, a no-op's round trip 6.0-6.4 -> 2.6-4.4 ms; while a
        call is out, the tasks that come meanwhile make the next batch, so a burst is
        still sent in batches, clocked by the node's replies)."""
        t.node = node
        fn, args, kwargs = t.call
        if not node.pending:
            node.pending_since = time.monotonic()
            if node.in_flight:
                self._wake.notify()
        node.pending.append((tid, fn, args, kwargs, t.hops))
        return node if not node.in_flight or len(node.pending) >= self._batch_size else None

    def _send(self, node: NodeView) -> None:
        with self._lock:
            batch, node.pending = node.pending, []
            if not batch or not node.alive:
                return
            now = time.monotonic()
            batch = [b for b in batch if self._running(b[0], now)]
            node.sent += len(batch)
            if not batch:
                return
            # numbered as taken: the node runs its batches in this order, whichever call
            # reaches it first (two threads may send batches of one node; and an agent's
            # messages must be handled in the order they were sent)
            node.bseq += 1
            seq = node.bseq
            node.in_flight += 1  # (now: tasks enqueued from here on wait for its answer)
        try:
            try:
                ref = node.handle.submit.remote(batch, seq)
            except Exception as exc:  # Ray could not serialize the batch: find who, fail them
                try:
                    batch = self._unpicklable(batch, exc)
                except Exception:
                    node.handle.submit.remote([], seq)  # (the node's sequence stays whole)
                    raise
                ref = node.handle.submit.remote(batch, seq)  # (even empty: the same reason)
        except BaseException:
            with self._lock:
                node.in_flight -= 1
            raise
        with self._lock:
            self._waits[ref] = ("submit", node, (batch, seq))

    def _unpicklable(self, batch: list[tuple], exc: Exception) -> list[tuple]:
        """The tasks of ``batch`` that pickle; the others' futures fail with
        SerializationError (as a local executor's submit raises it)."""
        import cloudpickle

        good = []
        for b in batch:
            try:
                cloudpickle.dumps(b[1:4])
            except Exception as e:
                with self._lock:
                    t = self._ledger.pop(b[0], None)
                if t is not None:
                    t.fut.set_exception(SerializationError(
                        f"the task could not be sent to its node: {type(e).__name__}: {e}. "
                        "Pass picklable functions and arguments (module-level functions, "
                        "no locks, sockets or open files)"))
            else:
                good.append(b)
        if len(good) == len(batch):
            raise exc  # not a pickling problem after all
        return good

    def _unloadable(self, node: NodeView, extra: tuple, exc: RayTaskError) -> None:
        """Batch ``extra`` (batch, seq) failed on a live node: Ray could not load its
        arguments there (a function, class or argument of a module the node cannot
        import), so ``submit`` never ran.  The node's sequence gets the number, empty (the
        batches after it wait for it there); each task goes again alone and unnumbered
        (a probe): the ones that fail alone fail their futures (:meth:`_refused`), the
        others run.  (Not a node loss: that made every node "lost" in turn, each of the
        batch's tasks re-placed on the next, and then hung the executor.)"""
        batch, seq = extra
        with self._lock:
            node.in_flight += 1
        try:
            ref = node.handle.submit.remote([], seq)
        except BaseException:
            with self._lock:
                node.in_flight -= 1
            raise
        with self._lock:
            self._waits[ref] = ("submit", node, ([], seq))
        if len(batch) == 1:
            self._refused(batch[0], exc)
            return
        for b in batch:
            r = node.handle.submit.remote([b], None)
            with self._lock:
                self._waits[r] = ("probe", node, b)

    def _refused(self, b: tuple, exc: RayTaskError) -> None:
        """Batch item ``b`` could not be loaded on its node: its future fails, with what
        to do (an agent's spawn fails the agent: its calls fail with the same error)."""
        cause = exc.cause if getattr(exc, "cause", None) is not None else exc
        err = SerializationError(
            f"a node could not load this task or agent: {type(cause).__name__}: "
            f"{str(cause).strip().splitlines()[-1] if str(cause).strip() else ''}. On a "
            "cluster the code and arguments must be importable on every node: install its "
            "package there, ship it with ray.init(runtime_env={'py_modules': [module]}), "
            "or pickle the module by value (ray.cloudpickle.register_pickle_by_value(module): "
            "Ray has its own copy of cloudpickle)")
        with self._lock:
            t = self._ledger.pop(b[0], None)
            if t is not None and t.agent is not None and t.agent.failed is None \
                    and isinstance(b[1], AgentOp) and b[1].kind == "spawn":
                t.agent.failed = err
        if t is not None and not t.fut.done():
            t.fut.set_exception(err)

    def _running(self, tid: int, now: float) -> bool:
        """Mark a task's future running as its batch leaves (under the lock); False if the
        user cancelled it, which drops it."""
        t = self._ledger.get(tid)
        if t is None:
            return False
        t.at = now
        if t.fut.running() or t.fut.set_running_or_notify_cancel():
            return True
        del self._ledger[tid]
        return False

    def map(self, fn: Callable[..., Any], *iterables: Iterable[Any],
            timeout: float | None = None, chunksize: int = 1) -> Iterator[Any]:
        """As ``Executor.map``; ``chunksize`` inputs go to a node as one task."""
        if chunksize < 1:
            raise ValueError("chunksize must be >= 1")
        if chunksize == 1:
            return self._map(fn, zip(*iterables), timeout)
        items = iter(zip(*iterables))
        chunks = iter(lambda: list(itertools.islice(items, chunksize)), [])
        results = self._map(lambda c: run_chunk(fn, c), ((c,) for c in chunks), timeout)
        return itertools.chain.from_iterable(results)

    def _map(self, fn: Callable[..., Any], calls: Iterable[tuple],
             timeout: float | None) -> Iterator[Any]:
        """The stdlib's map, but what is left when it ends early (a timeout, an error, the
        iterator dropped) is cancelled in one call per node, not one per future."""
        end = None if timeout is None else time.monotonic() + timeout
        fs = [self.submit(fn, *args) for args in calls]

        def results() -> Iterator[Any]:
            try:
                fs.reverse()
                while fs:
                    f = fs[-1]
                    yield f.result(None if end is None else end - time.monotonic())
                    fs.pop()
            finally:
                self._cancel_all(fs)

        return results()

    def _cancel_all(self, fs: Iterable[Future]) -> None:
        """Cancel these futures: those in the client's batches at once, then those their
        nodes hold but have not started, one cancel call per node."""
        self._withdraw([f._tid for f in fs if isinstance(f, TaskFuture)
                        and not f.cancel_local() and not f.done()])

    def _withdraw(self, tids: list[int]) -> list[int]:
        """Withdraw tasks from the nodes that hold them (NodeAgent.cancel): returns those
        that will not run, their futures settled as cancelled."""
        by_node: dict[str, list[int]] = {}
        with self._lock:
            for tid in tids:
                t = self._ledger.get(tid)
                if t is not None and t.node is not None and t.node.alive and t.agent is None:
                    by_node.setdefault(t.node.id, []).append(tid)
            refs = {self._nodes[n].handle.cancel.remote(ts): n for n, ts in by_node.items()}
        gone: list[int] = []
        for ref in refs:
            try:
                gone += ray.get(ref, timeout=CANCEL_S)
            except Exception:  # (lost, or slow: its outcome still comes as WITHDRAWN)
                pass
        if gone:
            futs = []
            with self._lock:  # out of the ledger now: no loss of its node resubmits it
                for tid in gone:
                    t = self._ledger.pop(tid, None)
                    if t is not None:  # (else its WITHDRAWN outcome came first: settled)
                        futs.append(t.fut)
                        self._gone.add(tid)  # its outcome, still coming: no duplicate
                self._stats.withdrawn += len(futs)
            for f in futs:
                _withdrawn(f)
        return gone

    def _sent(self, loads: dict[str, Load]) -> dict[str, int]:
        return {n: self._nodes[n].sent + len(self._nodes[n].pending) for n in loads}

    # -- results, losses -----------------------------------------------------------------------

    def _collect(self) -> None:
        while True:
            if not ray.is_initialized():  # ray.shutdown() before ours: a Ray call from
                return  # this thread would start Ray again (and abort the process)
            with self._lock:
                refs = list(self._waits)
                if self._closing and not refs:
                    return
            if not refs:
                time.sleep(0.01)
                continue
            ready, _ = ray.wait(refs, num_returns=1, timeout=0.05)
            if ready:
                more, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
                ready = list(dict.fromkeys(ready + more))
            for ref in ready:
                with self._lock:
                    kind, node, extra = self._waits.pop(ref)
                    if kind == "submit":
                        node.in_flight -= 1
                try:
                    value = ray.get(ref)
                except ActorUnavailableError:
                    self._retry(kind, node, extra)
                    continue
                except (ActorDiedError, RayActorError) as exc:
                    self._lost(node, f"{type(exc).__name__}")
                    continue
                except RayTaskError as exc:
                    if isinstance(exc.cause, NodeFencedError) or "NodeFencedError" in str(exc):
                        self._lost(node, "fenced")
                    elif kind == "submit":  # the node is up; its batch did not load there
                        self._unloadable(node, extra, exc)
                    elif kind == "probe":
                        self._refused(extra, exc)
                    else:
                        self._lost(node, f"{type(exc).__name__}: {exc}")
                    continue
                except Exception as exc:  # anything else from Ray: treat the node as lost
                    self._lost(node, f"{type(exc).__name__}: {exc}")
                    continue
                try:
                    self._handle(kind, node, extra, value)
                except Exception as exc:  # a bug here must not strand every future
                    _complain("the results thread", exc)

    def _handle(self, kind: str, node: NodeView, extra: Any, value: Any) -> None:
        node.backoff = 0.0
        if kind == "ready":
            node.load, node.ready = value, True
            self._membership += 1
            self._share_view()
            with self._lock:
                orphans, self._orphans = self._orphans, []
                full = {self._place(tid, self._ledger[tid]) for tid in orphans
                        if tid in self._ledger} - {None}
            for n in full:
                self._send(n)
            self._poll(node)
        elif kind == "submit" or kind == "ping" or kind == "probe":
            node.load = value
            if kind == "submit" and not node.in_flight and node.pending:
                self._send(node)  # what came while the call was out: now, not at batch_s
        elif kind == "results":
            batches, load = value
            for seq, out, moved, asked in batches:
                if seq > node.acked:  # (a batch sent again after a lost reply: had it)
                    self._settle(node, out, moved)
                    node.acked = seq
                    if asked:  # its tasks' and agents' operations on agents (asks.py)
                        self._asked(node, asked)
            node.load, node.sent = load, 0
            node.heard = time.monotonic()
            if node.alive and not self._closed_down():
                self._poll(node)
            self._balance(node)  # agents between live nodes (moves.py)

    def _closed_down(self) -> bool:
        return self._closing and not self._ledger

    def _settle(self, node: NodeView, out: list, moved: list) -> None:
        st = self._stats
        dead = []
        with self._lock:
            for tid, thief, hops in moved:
                t = self._ledger.get(tid)
                if t is None or hops <= t.hops:
                    continue  # settled, or an older move than one already applied
                st.moved += 1
                to = self._nodes.get(thief)
                t.node, t.hops = to, hops
                if to is None or not to.alive:
                    dead.append(tid)
            done = []
            now, lat = time.monotonic(), node.lat
            withdrawn = []
            for tid, ok, value in out:
                t = self._ledger.pop(tid, None)
                if t is None:
                    if tid in self._gone:
                        self._gone.discard(tid)
                    else:
                        st.duplicates += 1
                    continue
                if not ok and isinstance(value[0], str) and value[0] == WITHDRAWN:
                    withdrawn.append(t.fut)  # (its cancel's answer was late, or lost)
                    continue
                if not ok and t.agent is not None and t.agent.failed is not None:
                    value = (t.agent.failed, "")  # (its spawn failed: that is the reason)
                done.append((t.fut, ok, value))
                lat.append(now - t.at)
            st.done += len(done)
            if dead:
                self._replace(dead, node)
        for fut in withdrawn:
            _withdrawn(fut)
        st.withdrawn += len(withdrawn)
        for fut, ok, value in done:
            if ok:
                fut.set_result(value)
            else:
                fut.set_exception(with_remote_tb(value))
        del done

    def _retry(self, kind: str, node: NodeView, extra: Any) -> None:
        """A transient ActorUnavailableError: the same call again after a backoff (50 ms,
        doubling to 1 s), from a timer: the results thread does not wait."""
        node.backoff = min(1.0, max(0.05, node.backoff * 2))
        self._stats.transient += 1
        timer = threading.Timer(node.backoff, self._reissue, (kind, node, extra))
        timer.daemon = True
        timer.start()

    def _reissue(self, kind: str, node: NodeView, extra: Any) -> None:
        if not node.alive:
            return
        if kind == "results":
            self._poll(node)
        elif kind == "submit":  # (the same seq: the node drops it if the first one ran)
            with self._lock:
                node.in_flight += 1
            try:
                ref = node.handle.submit.remote(*extra)
            except BaseException:
                with self._lock:
                    node.in_flight -= 1
                raise
            with self._lock:
                self._waits[ref] = ("submit", node, extra)
        elif kind == "probe":  # (one task of a batch that did not load: _unloadable)
            ref = node.handle.submit.remote([extra], None)
            with self._lock:
                self._waits[ref] = ("probe", node, extra)
        elif kind == "ready":
            ref = node.handle.ping.remote()
            with self._lock:
                self._waits[ref] = ("ready", node, None)
        elif kind == "view":
            node.peers_seen = -1
            self._share_view()
        elif kind == "answers":
            self._tell(node, extra)

    def _lost(self, node: NodeView, why: str) -> None:
        """The node is gone (authoritative): re-place every unfinished task it had."""
        t0 = time.monotonic()
        with self._lock:
            if not node.alive:
                return
            node.alive = False
            self._membership += 1
            if self._balancer is not None:
                self._balancer.forget(node.id)
            for ref in [r for r, (_k, n, _e) in self._waits.items() if n is node]:
                del self._waits[ref]
            tids = [tid for tid, t in self._ledger.items() if t.node is node]
            node.pending = []
            ops: dict[AgentRecord, list[int]] = {a: [] for a in self._agents.values()
                                            if a.node is node and a.failed is None
                                            and not a.over}
            for tid in tids:
                a = self._ledger[tid].agent
                if a is not None:
                    ops.setdefault(a, []).append(tid)
            n = self._replace([tid for tid in tids if self._ledger[tid].agent is None], node)
            for a, its in ops.items():
                self._restart(a, its, node)
            self._stats.losses.append({"node": node.id, "why": why, "tasks": len(tids),
                                       "replaced": n, "at": time.time(),
                                       "replace_s": time.monotonic() - t0})
        self._share_view()  # the others drop it now: its children run again at home
        try:
            ray.kill(node.handle, no_restart=True)
        except Exception:
            pass

    def _replace(self, tids: list[int], node: NodeView) -> int:
        """Place lost tasks again under the retries policy (under the lock); sends the
        batches that filled, and wakes the flush thread for the rest."""
        failed, full, n = [], set(), 0
        for tid in tids:
            t = self._ledger[tid]
            t.losses += 1
            if t.losses > self._retries:
                del self._ledger[tid]
                failed.append((t, node.id))
                continue
            n += 1
            t.hops += 1 << 16  # late move reports of the lost node's era are stale now
            full.add(self._place(tid, t))
        self._stats.resubmitted += n
        full.discard(None)
        for fut_node in full:
            threading.Thread(target=self._send, args=(fut_node,), daemon=True).start()
        for t, nid in failed:
            t.fut.set_exception(NodeLostError(
                f"the cluster node {nid[:12]} running this task was lost, and the task had "
                f"already been re-run {t.losses - 1} time(s) (retries={self._retries}); "
                "raise retries= or make the task shorter"))
        self._wake.notify()
        return n

    # -- the flush and membership thread ------------------------------------------------------

    def _tend(self) -> None:
        next_look = time.monotonic() + self._health_s
        while True:
            if not ray.is_initialized():  # (as in _collect)
                return
            with self._lock:
                if self._closing and not self._ledger and not any(
                        n.pending for n in self._nodes.values()):
                    return
                now = time.monotonic()
                due = [n for n in self._nodes.values()
                       if n.pending and now - n.pending_since >= self._batch_s]
                if not due and now < next_look:
                    soonest = min((n.pending_since + self._batch_s
                                   for n in self._nodes.values() if n.pending),
                                  default=next_look)
                    self._wake.wait(max(0.0, min(soonest, next_look) - now))
                    continue
            try:
                for n in due:
                    self._send(n)
                if time.monotonic() >= next_look:
                    next_look = time.monotonic() + self._health_s
                    self._look()
            except Exception as exc:  # never let the flush thread die: it would strand batches
                _complain("the flush and membership thread", exc)

    def _look(self) -> None:
        """Pings, deaths Ray reports, and new nodes."""
        try:
            infos = {i["NodeID"]: i for i in ray.nodes()}
        except Exception:
            return
        for node in list(self._nodes.values()):
            if not node.alive:
                continue
            info = infos.get(node.id)
            if info is None or not info.get("Alive"):
                self._lost(node, "node reported dead")
            elif node.ready and time.monotonic() - node.heard > self._health_s:
                ref = node.handle.ping.remote()
                with self._lock:
                    self._waits[ref] = ("ping", node, None)
        if not self._closing:
            self._start_nodes(wait=False)

    # -- shutdown, stats -------------------------------------------------------------------------

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self._suspend()  # journaled agents: their states, so a recovery replays nothing
        asks.unregister(self._token)  # (a ref loaded here from now on: another executor's)
        with self._lock:
            if self._shutdown and self._closing:
                return
            self._shutdown = True
            if cancel_futures:
                for node in self._nodes.values():
                    for b in node.pending:
                        t = self._ledger.pop(b[0], None)
                        if t is not None:
                            t.fut.cancel()
                    node.pending = []
                for tid in self._orphans:
                    t = self._ledger.pop(tid, None)
                    if t is not None:
                        t.fut.cancel()
                self._orphans = []
                held = [tid for tid, t in self._ledger.items() if t.agent is None]
            self._wake.notify()
        if cancel_futures:  # and those the nodes hold, not started (one call per node)
            self._withdraw(held)
        if wait:
            _fbase.wait([t.fut for t in list(self._ledger.values())])
        with self._lock:
            self._closing = True
            for tid in self._orphans:
                t = self._ledger.pop(tid, None)
                if t is not None:
                    t.fut.set_exception(NodeLostError("the executor shut down with no node "
                                                      "alive to run this task"))
            self._wake.notify()
        if wait:
            self._stop_nodes()
        else:  # the futures still complete (as in the stdlib); then the nodes stop
            threading.Thread(target=self._stop_when_done, daemon=True).start()

    def _stop_when_done(self) -> None:
        _fbase.wait([t.fut for t in list(self._ledger.values())])
        self._stop_nodes()

    def _stop_nodes(self) -> None:
        top, self._top = getattr(self, "_top", None), None
        if top is not None:
            top.stop()
        nodes = [n for n in self._nodes.values() if n.alive]
        refs = [n.handle.stop.remote() for n in nodes]
        try:
            ray.wait(refs, num_returns=len(refs), timeout=30)
        except Exception:
            pass
        for n in nodes:
            n.alive = False
            try:
                ray.kill(n.handle, no_restart=True)
            except Exception:
                pass
        for t in getattr(self, "_threads", ()):
            if t is not threading.current_thread():
                t.join(5)
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()
        self._close_journal()

    def stats(self) -> ClusterStats:
        """A snapshot: per node (alive, workers, queued, running, task_s, busy, agents,
        active agents, tasks done, steals, tasks got from / given to other nodes, the
        latency of its results at the client), the task counts, the agents' moves, and one
        entry per lost node (how many tasks it had, how fast they were re-placed).  Asks
        every node for its counters; :meth:`_snapshot` (``stealer top``) asks none."""
        alive = [n for n in self._nodes.values() if n.alive and n.ready]
        statuses = {}
        try:
            refs = [n.handle.status.remote() for n in alive]
            statuses = dict(zip([n.id for n in alive], ray.get(refs, timeout=10)))
        except Exception:
            pass
        return self._gather(statuses)

    def _gather(self, statuses: dict[str, dict]) -> ClusterStats:
        st = self._stats
        with self._lock:
            views = [(n, n.load, list(n.lat)) for n in self._nodes.values()]
            stats = ClusterStats({}, st.submitted, st.done, len(self._ledger),
                                 st.resubmitted, st.duplicates, st.moved, st.transient,
                                 list(st.losses), st.replayed, st.state_errors,
                                 st.agent_moves, st.move_s, st.move_errors, st.recovered,
                                 withdrawn=st.withdrawn)
        for n, ld, lat in views:
            s = statuses.get(n.id, {})
            lat.sort()
            stats.nodes[n.id] = {
                "alive": n.alive, "workers": n.workers, "queued": ld.queued,
                "running": ld.running, "task_s": ld.task_s, "busy": ld.busy,
                "agents": s.get("agents", ld.agents), "active": ld.active,
                "done": s.get("done", ld.done), "msgs": ld.msgs, "steals": s.get("steals"),
                "got": ld.got, "given": ld.given,
                "latency_ms": {"n": len(lat), "p50": _pct(lat, 50), "p99": _pct(lat, 99)},
                "pid": s.get("pid"), "children": s.get("children")}
        return stats

    def _snapshot(self) -> dict[str, Any]:
        """What ``stealer top`` shows (stealer/cluster/snapshot.py): the stats from the
        load reports the client has, no call to any node."""
        data = dataclasses.asdict(self._gather({}))
        now = time.time()
        data.update(id=self._id, pid=os.getpid(), created=self._created, time=now,
                    uptime_s=now - self._created, kind="cluster")
        return data

    @property
    def id(self) -> str:
        """Its id for ``stealer top`` (``stealer-<pid>-cluster-<hex>``): the name of the
        figures it publishes in /dev/shm (stealer/cluster/snapshot.py)."""
        return self._id

    @property
    def nodes(self) -> list[str]:
        """The ids of the alive nodes that run a node executor."""
        return [n.id for n in self._nodes.values() if n.alive and n.ready]

    def node_handle(self, node_id: str) -> Any:
        """The node agent of a node (a Ray actor handle), for tools and tests."""
        return self._nodes[node_id].handle

    def __reduce__(self) -> tuple:
        raise TypeError("a cluster executor cannot be sent to a task; a task's children "
                        "are spawned with stealer.spawn")

    def __repr__(self) -> str:
        alive = sum(1 for n in self._nodes.values() if n.alive)
        return f"<stealer ClusterExecutor: {alive} node(s), pid {os.getpid()}>"
