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
         ─▶ (batch_size tasks, or batch_s after its first) NodeAgent.submit(batch)
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

Threads: the caller's (``submit`` appends to a batch; a full batch is sent from there), the
collector (waits on every outstanding Ray call, settles futures, re-places lost work) and
the membership/flush thread (time-bounded batches, pings, joins and deaths).
"""

from __future__ import annotations

import itertools
import os
import random
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from concurrent.futures import _base as _fbase
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError, RayTaskError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from stealer.cluster.node import AgentOp, NodeAgent, run_chunk
from stealer.cluster.policy import Load, StealConfig, place
from stealer.errors import (
    AgentNotFound,
    ClusterError,
    ExecutorShutdownError,
    NodeFencedError,
    NodeLostError,
    with_remote_tb,
)

__all__ = ["ClusterAgentRef", "ClusterExecutor", "ClusterStats"]

DEFAULT_STEAL = StealConfig()  # frozen: one instance serves every executor
START_S = 60.0  # node agents must be ready this long after Executor(cluster=...)

#: Local executor options a node executor takes as they are.
LOCAL_OPTIONS = ("cpus", "thread_limit", "records", "metrics", "hang_timeout",
                 "max_tasks_per_child", "initializer", "initargs")


class _Task:
    __slots__ = ("agent", "call", "fut", "hops", "losses", "node")

    def __init__(self, fut: Future, call: tuple, node: _Node | None,
                 agent: _Agent | None = None) -> None:
        self.fut = fut
        self.call = call  # (fn, args, kwargs); an agent's operation: (AgentOp, (), {})
        self.node = node
        self.losses = 0
        self.hops = 0  # moves between nodes so far: a move report with fewer is stale
        self.agent = agent


class _Agent:
    """The client's record of one agent: where it lives and how to start it again."""

    def __init__(self, aid: int, spawn: tuple, name: str | None, retries: int) -> None:
        self.aid = aid
        self.spawn = spawn  # (cls, args, init_kwargs, options)
        self.name = name
        self.retries = retries
        self.node: _Node | None = None
        self.losses = 0
        self.result: Future | None = None  # the final value, once somebody asked
        self.failed: BaseException | None = None
        self.over = False  # stopped, or its final value came: never restarted


class ClusterAgentRef:
    """A handle on an agent of a cluster executor: ``call`` (a Future), ``send``, ``stop``,
    ``result``, as :class:`stealer.AgentRef`.  Its messages go through the node agent of
    the node it lives on, batched with that node's tasks."""

    __slots__ = ("_a", "_ex")

    def __init__(self, ex: ClusterExecutor, agent: _Agent) -> None:
        self._ex = ex
        self._a = agent

    @property
    def id(self) -> int:
        return self._a.aid

    @property
    def name(self) -> str | None:
        return self._a.name

    @property
    def node(self) -> str | None:
        """The node it lives on now (it moves when its node is lost)."""
        n = self._a.node
        return None if n is None else n.id

    def call(self, method: str, /, *args: Any, **kwargs: Any) -> Future:
        """Request/reply: a Future of handler ``method``'s return value."""
        return self._ex._agent_op(self._a, "call", (method, args, kwargs))

    def send(self, method: str, /, *args: Any, **kwargs: Any) -> None:
        """One-way message (its handler's errors are not reported back)."""
        self._ex._agent_op(self._a, "send", (method, args, kwargs))

    def stop(self) -> None:
        """Stop the agent at its next step boundary."""
        self._ex._agent_op(self._a, "stop", None)
        self._a.over = True

    @property
    def future(self) -> Future:
        """The Future of the agent's final value."""
        a = self._a
        with self._ex._lock:
            if a.result is None:
                a.result = self._ex._agent_op(a, "result", None)
                a.result.add_done_callback(lambda _f: setattr(a, "over", True))
            return a.result

    def result(self, timeout: float | None = None) -> Any:
        """The agent's final value (``ctx.done(value)``, or ``on_stop()`` after stop)."""
        return self.future.result(timeout)

    def __repr__(self) -> str:
        return f"<stealer ClusterAgentRef {self._a.aid} on {str(self.node)[:12]}>"


class _Node:
    """The client's view of one node agent."""

    def __init__(self, node_id: str, handle: Any, workers: int) -> None:
        self.id = node_id
        self.handle = handle
        self.workers = workers
        self.load = Load(node_id, workers)
        self.sent = 0  # tasks sent since its last load report
        self.pending: list[tuple] = []  # (tid, fn, args, kwargs, hops) not sent yet
        self.pending_since = 0.0
        self.ready = False
        self.alive = True
        self.backoff = 0.0
        self.peers_seen = -1  # the membership version whose peers it was sent
        self.acked = 0  # the last result batch processed (the node drops it and those before)


@dataclass
class ClusterStats:
    """``ClusterExecutor.stats()``: what the client knows of each node and of its tasks."""

    nodes: dict[str, dict[str, Any]] = field(default_factory=dict)
    submitted: int = 0
    done: int = 0
    outstanding: int = 0
    resubmitted: int = 0  # tasks placed again after their node was lost
    duplicates: int = 0  # results dropped because the task was already settled
    moved: int = 0  # tasks that thieves took from other nodes (reported by the victims)
    transient: int = 0  # calls retried after an ActorUnavailableError
    losses: list[dict[str, Any]] = field(default_factory=list)  # one per lost node


def _complain(who: str, exc: BaseException) -> None:
    import sys
    import traceback

    print(f"stealer.cluster: {who} caught {type(exc).__name__}: {exc} (going on)",
          file=sys.stderr)
    traceback.print_exc()


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


class ClusterExecutor(_fbase.Executor):
    """A ``concurrent.futures.Executor`` over one stealer executor per node of a Ray cluster.

    ``cluster``: a Ray address, or True for the Ray this process already initialised.
    ``max_workers``: worker processes per node at most (default: the node's CPUs).
    ``retries``: node losses (and worker deaths on a node) a task survives.  ``batch_size``
    and ``batch_s``: a batch to a node goes when it has that many tasks or that long after its
    first.  ``linger_s``: a node holds results back up to that long to batch them while it
    still runs work (never when it has nothing left).  ``fence_s``: a node agent that hears
    nothing from this client for that long stops
    its workers.  ``steal``: the steal rules between nodes (a StealConfig; None: no stealing
    between nodes).  Other keyword arguments (``cpus``, ``thread_limit``, ``records``,
    ``metrics``, ``hang_timeout``, ``max_tasks_per_child``, ``initializer``, ``initargs``)
    go to each node's executor.
    """

    def __init__(self, cluster: Any, *, executor_cls: type, max_workers: int | None = None,
                 retries: int = 3, batch_size: int = 256, batch_s: float = 0.002,
                 fence_s: float = 10.0, health_s: float = 0.5, window_s: float = 0.005,
                 linger_s: float = 0.05,
                 steal: StealConfig | None = DEFAULT_STEAL, seed: int | None = None,
                 **local: Any) -> None:
        bad = sorted(set(local) - set(LOCAL_OPTIONS))
        if bad:
            raise ClusterError(f"Executor(cluster=...) does not take {', '.join(bad)} yet "
                               "(journals and agents stay on one machine for now); drop "
                               "them or use a local Executor")
        if not isinstance(retries, int) or not 0 <= retries <= 255:
            raise ValueError(f"retries must be an int from 0 to 255, not {retries!r}")
        self._owns_ray = _connect(cluster)
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
        self._ledger: dict[int, _Task] = {}
        self._agents: dict[int, _Agent] = {}
        self._names: dict[str, _Agent] = {}
        self._nodes: dict[str, _Node] = {}
        self._orphans: list[int] = []  # tasks with no alive node to go to
        self._waits: dict[Any, tuple] = {}  # ObjectRef -> (kind, node, extra)
        self._membership = 0  # bumped whenever a node becomes ready or is lost
        self._stats = ClusterStats()
        self._shutdown = False
        self._closing = False
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
            node = _Node(nid, handle, workers)
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
                        f"a node agent takes all of its node's CPUs (num_cpus={node.workers}), "
                        "so another cluster executor, or Ray tasks and actors holding CPUs "
                        "there, keep it from being placed. Shut the other executor down or "
                        "free the node's CPUs") from exc

    def _poll(self, node: _Node) -> None:
        """The node's next long poll for results (one outstanding per node).  The peers'
        handles go only when the set of nodes changed since this node last got them
        (deserializing actor handles costs the node agent more than the rest of a call)."""
        loads = {n.id: n.load for n in self._nodes.values() if n.alive and n.ready}
        peers = None
        if node.peers_seen != self._membership:
            peers = {n.id: n.handle for n in self._nodes.values() if n.alive and n.ready}
            node.peers_seen = self._membership
        ref = node.handle.results.remote(node.acked, 0.5, self._linger_s, loads, peers)
        with self._lock:
            self._waits[ref] = ("results", node, None)

    def _alive(self) -> dict[str, Load]:
        return {n.id: n.load for n in self._nodes.values() if n.alive and n.ready}

    # -- submit ------------------------------------------------------------------------------

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        fut: Future = Future()
        with self._lock:
            if self._shutdown:
                raise ExecutorShutdownError("cannot schedule new futures after shutdown")
            tid = next(self._tids)
            t = _Task(fut, (fn, args, kwargs), None)
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
        fut: Future = Future()
        with self._lock:
            if self._shutdown:
                raise ExecutorShutdownError("cannot schedule new futures after shutdown")
            node = self._nodes.get(node_id)
            if node is None or not node.alive:
                raise ClusterError(f"no node executor on node {node_id!r}; pick one of "
                                   "ex.nodes")
            tid = next(self._tids)
            t = _Task(fut, (fn, args, kwargs), node)
            self._ledger[tid] = t
            self._stats.submitted += 1
            full = self._enqueue(node, tid, t)
        if full is not None:
            self._send(full)
        return fut

    def _place(self, tid: int, t: _Task) -> _Node | None:
        """Put a task in a node's pending batch (under the lock); the node if that batch is
        full now (the caller sends it, outside the lock)."""
        loads = self._alive()
        if not loads:
            t.node = None
            self._orphans.append(tid)
            return None
        return self._enqueue(self._nodes[place(loads, self._rng, self._sent(loads))], tid, t)

    def _enqueue(self, node: _Node, tid: int, t: _Task) -> _Node | None:
        t.node = node
        fn, args, kwargs = t.call
        if not node.pending:
            node.pending_since = time.monotonic()
            self._wake.notify()
        node.pending.append((tid, fn, args, kwargs, t.hops))
        return node if len(node.pending) >= self._batch_size else None

    def _send(self, node: _Node) -> None:
        with self._lock:
            batch, node.pending = node.pending, []
            if not batch or not node.alive:
                return
            batch = [b for b in batch if self._running(b[0])]
            node.sent += len(batch)
        if batch:
            ref = node.handle.submit.remote(batch)
            with self._lock:
                self._waits[ref] = ("submit", node, batch)

    def _running(self, tid: int) -> bool:
        """Mark a task's future running as its batch leaves (under the lock); False if the
        user cancelled it, which drops it."""
        t = self._ledger.get(tid)
        if t is None:
            return False
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
            return super().map(fn, *iterables, timeout=timeout)
        items = iter(zip(*iterables))
        chunks = iter(lambda: list(itertools.islice(items, chunksize)), [])
        results = super().map(lambda c: run_chunk(fn, c), chunks, timeout=timeout)
        return itertools.chain.from_iterable(results)

    # -- agents ---------------------------------------------------------------------------------

    def spawn_agent(self, cls: type, /, *args: Any, init_kwargs: dict | None = None,
                    retries: int | None = None, name: str | None = None,
                    **options: Any) -> ClusterAgentRef:
        """Start an agent on a node (power of two choices): ``cls(*args, **init_kwargs)``
        lives in that node's executor (options as :meth:`stealer.Executor.spawn_agent`).
        When its node is lost it starts again on another from its spawn arguments (its
        state since is lost; at most ``retries`` times, default the executor's) and the
        calls it had not answered go to it there (at-least-once)."""
        r = self._retries if retries is None else retries
        with self._lock:
            if self._shutdown:
                raise ExecutorShutdownError("cannot spawn agents after shutdown")
            if name is not None and name in self._names:
                raise ValueError(f"an agent named {name!r} exists already in this executor")
            a = _Agent(next(self._tids), (cls, args, init_kwargs or {}, options), name, r)
            loads = self._alive()
            if not loads:
                raise ClusterError("no alive node to spawn the agent on")
            a.node = self._place_agent()
            self._agents[a.aid] = a
            if name is not None:
                self._names[name] = a
            self._agent_op(a, "spawn", a.spawn)
        return ClusterAgentRef(self, a)

    def agent(self, name: str) -> ClusterAgentRef:
        """The agent spawned with ``name`` (wherever it lives now)."""
        a = self._names.get(name)
        if a is None:
            raise AgentNotFound(f"no agent named {name!r} in this cluster executor; "
                                "spawn_agent(..., name=NAME) names one")
        return ClusterAgentRef(self, a)

    def agents(self) -> dict[str, ClusterAgentRef]:
        """The named agents, by name."""
        return {n: ClusterAgentRef(self, a) for n, a in sorted(self._names.items())}

    def call_all(self, refs: Iterable[ClusterAgentRef], method: str,
                 args: Iterable[tuple] | None = None) -> list[Future]:
        """One call per agent, the i-th with the i-th tuple of arguments (batched per node)."""
        refs = list(refs)
        args = [()] * len(refs) if args is None else list(args)
        return [r.call(method, *a) for r, a in zip(refs, args)]

    def _agent_op(self, a: _Agent, kind: str, arg: Any) -> Future:
        fut: Future = Future()
        with self._lock:
            if self._shutdown and kind in ("call", "send"):
                raise ExecutorShutdownError("cannot message agents after shutdown")
            if a.failed is not None:
                fut.set_exception(a.failed)
                return fut
            tid = next(self._tids)
            t = _Task(fut, (AgentOp(kind, a.aid, arg), (), {}), a.node, a)
            self._ledger[tid] = t
            full = self._enqueue(a.node, tid, t)
        if full is not None:
            self._send(full)
        return fut

    def _restart(self, a: _Agent, tids: list[int], lost: _Node) -> None:
        """An agent whose node was lost: spawned again elsewhere, then its unanswered
        operations in their first order (under the lock)."""
        a.losses += 1
        loads = self._alive()
        if a.losses > a.retries or not loads:
            why = ("no node is left" if not loads
                   else f"it had been restarted {a.losses - 1} time(s) (retries={a.retries})")
            a.failed = NodeLostError(f"the agent's node {lost.id[:12]} was lost and {why}; "
                                     "its calls fail")
            for tid in tids:
                t = self._ledger.pop(tid)
                t.fut.set_exception(a.failed)
            return
        a.node = self._place_agent()
        tid = next(self._tids)
        t = _Task(Future(), (AgentOp("spawn", a.aid, a.spawn), (), {}), a.node, a)
        self._ledger[tid] = t
        full = {self._enqueue(a.node, tid, t)}
        for tid in sorted(tids):
            t = self._ledger[tid]
            if t.call[0].kind == "spawn":
                del self._ledger[tid]  # the old start's ack: the new one replaces it
                continue
            t.hops += 1 << 16
            full.add(self._enqueue(a.node, tid, t))
        self._stats.resubmitted += len(tids)
        full.discard(None)
        for n in full:
            threading.Thread(target=self._send, args=(n,), daemon=True).start()

    def _place_agent(self) -> _Node:
        """Power of two choices on the live agents per worker this client put on each node
        (exact, where task load reports may be half a second old)."""
        count: dict[str, int] = {n.id: 0 for n in self._nodes.values() if n.alive and n.ready}
        for a in self._agents.values():
            if a.node is not None and a.node.id in count and a.failed is None and not a.over:
                count[a.node.id] += 1
        loads = {n: Load(n, self._nodes[n].workers, queued=c) for n, c in count.items()}
        return self._nodes[place(loads, self._rng)]

    def _sent(self, loads: dict[str, Load]) -> dict[str, int]:
        return {n: self._nodes[n].sent + len(self._nodes[n].pending) for n in loads}

    # -- results, losses -----------------------------------------------------------------------

    def _collect(self) -> None:
        while True:
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

    def _handle(self, kind: str, node: _Node, extra: Any, value: Any) -> None:
        node.backoff = 0.0
        if kind == "ready":
            node.load, node.ready = value, True
            self._membership += 1
            with self._lock:
                orphans, self._orphans = self._orphans, []
                full = {self._place(tid, self._ledger[tid]) for tid in orphans
                        if tid in self._ledger} - {None}
            for n in full:
                self._send(n)
            self._poll(node)
        elif kind == "submit" or kind == "ping":
            node.load = value
        elif kind == "results":
            batches, load = value
            for seq, out, moved in batches:
                if seq > node.acked:  # (a batch sent again after a lost reply: had it)
                    self._settle(node, out, moved)
                    node.acked = seq
            node.load, node.sent = load, 0
            if node.alive and not self._closed_down():
                self._poll(node)

    def _closed_down(self) -> bool:
        return self._closing and not self._ledger

    def _settle(self, node: _Node, out: list, moved: list) -> None:
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
            for tid, ok, value in out:
                t = self._ledger.pop(tid, None)
                if t is None:
                    st.duplicates += 1
                    continue
                done.append((t.fut, ok, value))
            st.done += len(done)
            if dead:
                self._replace(dead, node)
        for fut, ok, value in done:
            if ok:
                fut.set_result(value)
            else:
                fut.set_exception(with_remote_tb(value))
        del done

    def _retry(self, kind: str, node: _Node, extra: Any) -> None:
        """A transient ActorUnavailableError: the same call again after a backoff (50 ms,
        doubling to 1 s), from a timer: the results thread does not wait."""
        node.backoff = min(1.0, max(0.05, node.backoff * 2))
        self._stats.transient += 1
        timer = threading.Timer(node.backoff, self._reissue, (kind, node, extra))
        timer.daemon = True
        timer.start()

    def _reissue(self, kind: str, node: _Node, extra: Any) -> None:
        if not node.alive:
            return
        if kind == "results":
            self._poll(node)
        elif kind == "submit":
            ref = node.handle.submit.remote(extra)
            with self._lock:
                self._waits[ref] = ("submit", node, extra)
        elif kind == "ready":
            ref = node.handle.ping.remote()
            with self._lock:
                self._waits[ref] = ("ready", node, None)

    def _lost(self, node: _Node, why: str) -> None:
        """The node is gone (authoritative): re-place every unfinished task it had."""
        t0 = time.monotonic()
        with self._lock:
            if not node.alive:
                return
            node.alive = False
            self._membership += 1
            for ref in [r for r, (_k, n, _e) in self._waits.items() if n is node]:
                del self._waits[ref]
            tids = [tid for tid, t in self._ledger.items() if t.node is node]
            node.pending = []
            ops: dict[_Agent, list[int]] = {a: [] for a in self._agents.values()
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
        try:
            ray.kill(node.handle, no_restart=True)
        except Exception:
            pass

    def _replace(self, tids: list[int], node: _Node) -> int:
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
            elif node.ready:
                ref = node.handle.ping.remote()
                with self._lock:
                    self._waits[ref] = ("ping", node, None)
        if not self._closing:
            self._start_nodes(wait=False)

    # -- shutdown, stats -------------------------------------------------------------------------

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
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
            self._wake.notify()
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

    def stats(self) -> ClusterStats:
        """A snapshot: per node (workers, queued, running, task_s, steals), the task counts,
        and one entry per lost node (how many tasks it had, how fast they were re-placed)."""
        st = self._stats
        alive = [n for n in self._nodes.values() if n.alive and n.ready]
        statuses = {}
        try:
            refs = [n.handle.status.remote() for n in alive]
            statuses = dict(zip([n.id for n in alive], ray.get(refs, timeout=10)))
        except Exception:
            pass
        with self._lock:
            nodes = {}
            for n in self._nodes.values():
                s = statuses.get(n.id, {})
                nodes[n.id] = {"alive": n.alive, "workers": n.workers, "queued": n.load.queued,
                               "running": n.load.running, "task_s": n.load.task_s,
                               "done": s.get("done"), "steals": s.get("steals"),
                               "pid": s.get("pid")}
            return ClusterStats(nodes, st.submitted, st.done, len(self._ledger),
                                st.resubmitted, st.duplicates, st.moved, st.transient,
                                list(st.losses))

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
