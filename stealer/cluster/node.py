"""The node agent: one async Ray actor per node, running that node's local stealer executor.

Created by the cluster client (``stealer/cluster/client.py``) on every alive node, with hard
node affinity (``NodeAffinitySchedulingStrategy(node_id, soft=False)``) and ``num_cpus``
equal to the cores it owns; called by the client (batches in, results out, pings) and by
the other node agents (steals, lifelines, pushes).

What lives here:

* **The local executor**: ``Executor(workers, cpus=...)`` of the class the client hands over
  (the core's ``stealer.Executor``; handed, not imported, so the cluster layer and the core
  never import each other in a circle).  Its workers are spawned by the core's own entry
  point (``stealer.worker.loop.main``), never from the driver's ``__main__``; each worker
  sets its BLAS/OpenMP limits itself (``thread_limit``, default 1), whatever Ray put in the
  actor's environment (Ray sets ``OMP_NUM_THREADS`` from ``num_cpus``).  The cores: the
  node's ``STEALER_NODE_CPUS`` (a list such as ``0,1`` or ``0-3``, set in the environment of
  ``ray start``), else the core's ``"auto"`` pinning within the allowed CPUs.  Shared-memory
  segments are named ``stealer-<pid>-<128-bit random token>`` by the core, and their
  cleanup of the dead is judged by an ``flock`` the creator holds, so node executors of
  test nodes sharing one ``/dev/shm`` neither collide nor clean up each other's segments.
* **The node's queue**: tasks accepted from the client and not yet handed to the local
  executor.  The local executor holds a small window (a few tasks per worker, sized so the
  window covers about ``window_s`` of work, and 8 per worker while the length of the
  current function's tasks is not measured yet: a workload of long tasks after one of
  no-ops must not fill the window with seconds of unstealable work) where its workers
  steal from each other in
  shared memory (local stealing first); the rest waits here, and this queue is the steal
  end for other nodes: a thief takes from its back, the node's own workers from its front.
  The window refills from the local futures' done callbacks (the local executor's result
  thread), so the hot path never goes through the event loop.
* **Results** go back to the client in batches, when it asks (``results``: a long poll, at
  most one outstanding per node), with the node's load report riding on them; tasks that a
  thief took are reported as moved, so the client's ledger follows them.
* **Stealing between nodes**: a :class:`~stealer.cluster.policy.Thief` polled while the node
  idles (one outstanding request), a :class:`~stealer.cluster.policy.Victim` answering peers
  and pushing surplus to lifelines.  The peers' load reports come from the client (it
  forwards the table it has with each ``results`` call).  Steals and pings run in their own
  concurrency groups (their own threads and event loops), so they never wait behind work.
* **Fork-join children across nodes** (``stealer/cluster/children.py``): a
  :class:`~stealer.cluster.children.ChildServer` serves this node's workers (exports,
  claims, waits); pending children ship to a hungry peer's lifeline (or in a steal reply
  with no surplus), children of other nodes run here as tasks (``take_children``) and their
  results go back to their parent's node (``child_results``).
* **Fencing**: a node agent that hears nothing from the client (no ``results``, no ping) for
  ``fence_s`` shuts its local executor down, drops its queue and refuses further work with
  :class:`~stealer.errors.NodeFencedError`; the client has by then re-run its tasks
  elsewhere, so duplicates never run on indefinitely.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import os
import random
import shutil
import signal
import threading
import time
from collections import deque
from typing import Any

import ray

from stealer.agents.message import SET_STATE, STATE
from stealer.cluster import children
from stealer.cluster.asks import AskServer
from stealer.cluster.policy import Load, RoundTrip, StealConfig, Thief, Victim, linger_for
from stealer.errors import AgentStopped, NodeFencedError, RemoteError, RemoteTraceback

__all__ = ["AgentOp", "NodeAgent", "node_cpus", "run_chunk"]

WINDOW_MIN, WINDOW_MAX = 8, 256  # tasks per worker in the local executor's window (8: its
# result thread then batches completions instead of being woken for each)
BATCH_OUT = 512  # results that end a results() call's linger
LIFELINE_POLL_S = 0.05  # an idle node on lifelines looks again this often
LIFELINE_RENEW_S = 0.25  # and registers its lifelines again this often
CHILD_RTT_S = 0.004  # a child's round trip to another node, until one was measured
CHILD_RTT_MAX_S = 0.025  # ... and at most, as the age rule reads it (a stall of the VM
# or of Ray must not hold children back for long: the rule waits two of these)
BUSY_TAU_S = 0.1  # the time constant of the occupied fraction a load report carries
RESULT_POLL_S = 0.01  # the local executor's result thread, in throughput mode, looks this
# often (the core's default, 2 ms, cost each node ~0.1 ms of CPU per 2 ms task: results
# leave a node in batches every linger_s anyway; a worker about to idle still wakes it)


def node_cpus(default: Any = "auto") -> Any:
    """The cores of this node's executor: ``$STEALER_NODE_CPUS`` ("0,2" or "0-3,6"), else
    ``default`` (the core's pinning policy)."""
    spec = os.environ.get("STEALER_NODE_CPUS", "").strip()
    if not spec:
        return default
    out: list[int] = []
    for part in spec.split(","):
        lo, _, hi = part.strip().partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


class AgentOp:
    """An operation on an agent, travelling in a task batch in place of a function: the
    node agent runs it on its local executor's agent at once (agents never wait in the
    node's queue, so thieves never take them).  ``kind``: spawn (``a``: cls, args,
    init_kwargs, options), call / send (method, args, kwargs), stop, result, state and
    set_state (``a``: the state; the client keeps agents' states), evict (the agent's
    state, then the agent leaves this node: stopped here, its final value dropped; the
    client moves it to another live node, stealer/cluster/moves.py)."""

    __slots__ = ("a", "aid", "kind")

    def __init__(self, kind: str, aid: int, a: Any = None) -> None:
        self.kind = kind
        self.aid = aid
        self.a = a

    def __reduce__(self) -> tuple:
        return (AgentOp, (self.kind, self.aid, self.a))


def run_chunk(fn: Any, chunk: list[tuple]) -> list[Any]:
    """One task of ``map(chunksize=N)``: every input of the chunk, in order."""
    return [fn(*args) for args in chunk]


def _approx_size(args: tuple, kwargs: dict) -> int:
    """A cheap estimate of a task's payload bytes, for the steal batch's bytes cap."""
    n = 64
    for v in (*args, *kwargs.values()):
        nbytes = getattr(v, "nbytes", None)
        if isinstance(nbytes, int):
            n += nbytes
        elif isinstance(v, (bytes, bytearray, str, list, tuple, dict)):
            n += len(v) * (1 if isinstance(v, (bytes, bytearray, str)) else 16)
        else:
            n += 16
    return n


def _has_refs(b: tuple) -> bool:
    """Whether task ``b`` (tid, fn, args, kwargs, hops) has an ObjectRef argument."""
    if isinstance(b[1], AgentOp):
        return False
    for a in b[2]:
        if isinstance(a, ray.ObjectRef):
            return True
    return bool(b[3]) and any(isinstance(v, ray.ObjectRef) for v in b[3].values())


def share_class_trackers() -> None:
    """Make Ray's copy of cloudpickle and the cloudpickle package name the classes they
    write by value (those of the client's ``__main__``) with one set of ids in this
    process.  A class written by value carries an id, and a process that reads it back
    with an id it knows gets the class it already has.  The client writes with Ray's
    copy and the workers of a node executor with the package (they never import Ray),
    each keeping its own ids, so an exception or result of such a class that crossed two
    nodes came back to the client as a copy: ``except MyError`` missed it.  The client and
    every node agent call this once; a cloudpickle without the registries is left as it
    is."""
    try:
        import cloudpickle.cloudpickle as mine
        from ray.cloudpickle import cloudpickle as rays
    except ImportError:
        return
    names = ("_DYNAMIC_CLASS_TRACKER_BY_CLASS", "_DYNAMIC_CLASS_TRACKER_BY_ID",
             "_DYNAMIC_CLASS_TRACKER_LOCK")
    if not all(hasattr(rays, n) and hasattr(mine, n) for n in names):
        return
    by_class, by_id = rays._DYNAMIC_CLASS_TRACKER_BY_CLASS, rays._DYNAMIC_CLASS_TRACKER_BY_ID
    if mine._DYNAMIC_CLASS_TRACKER_BY_CLASS is by_class:
        return  # (shared already)
    with rays._DYNAMIC_CLASS_TRACKER_LOCK, mine._DYNAMIC_CLASS_TRACKER_LOCK:
        for cls, cid in list(mine._DYNAMIC_CLASS_TRACKER_BY_CLASS.items()):  # (a local
            if cls not in by_class and cid not in by_id:  # executor's, before: kept)
                by_class[cls] = cid
                by_id[cid] = cls
        for n in names:
            setattr(mine, n, getattr(rays, n))


#: The outcome ``(False, (WITHDRAWN, ""))`` of a task the client withdrew before it started
#: (NodeAgent.cancel): its future is cancelled, not failed.
WITHDRAWN = "stealer: withdrawn by the client"


def _outcome(f: Any) -> tuple[bool, Any]:
    """A finished local future as (ok, value) for the client: an error is (exc, traceback
    text), and an exception that cannot be pickled back becomes a RemoteError.  A local
    future is cancelled only by NodeAgent.cancel: WITHDRAWN."""
    if f.cancelled():
        return False, (WITHDRAWN, "")
    exc = f.exception()
    if exc is None:
        return True, f.result()
    cause = exc.__cause__
    tb = cause.tb if isinstance(cause, RemoteTraceback) else ""
    exc.__cause__ = None
    try:  # as Ray will: by value where it must (a class of the client's __main__)
        children._pack(exc)
    except Exception:
        exc = RemoteError(f"{type(exc).__name__}: {exc}")
    return False, (exc, tb)


@ray.remote(concurrency_groups={"steal": 2, "health": 1})
class NodeAgent:
    def __init__(self, node_id: str, executor_cls: type, workers: int, local: dict,
                 fence_s: float, window_s: float, steal: StealConfig | None,
                 seed: int) -> None:
        share_class_trackers()
        self.node = node_id
        self.workers = workers
        local = dict(local)
        local["cpus"] = node_cpus(local.get("cpus", "auto"))
        local.setdefault("result_poll", RESULT_POLL_S)
        # fork-join children other nodes may run (stealer/cluster/children.py): the
        # workers' spawn hook comes with their initializer (the user's runs after it)
        self.kids: children.ChildServer | None = None
        self.kids_dir = ""
        self.me = ray.get_runtime_context().current_actor  # sent with the children we ship
        self.origins: dict[str, Any] = {}  # node -> its handle, for its children's results
        if steal is not None and steal.children > 0:
            self.kids_dir = children.make_dir()
            self.kids = children.ChildServer(self.kids_dir, self._child_back,
                                             self._kids_changed, self._kids_hungry,
                                             lambda fn: self.ex._pool.fns.id_of(fn))
            local["initargs"] = (self.kids.path, self.kids.want_path, self.kids.authkey,
                                 steal.child_depth, local.pop("initializer", None),
                                 tuple(local.pop("initargs", ()) or ()), steal.want_depth)
            local["initializer"] = children.install
        # agents and tasks here reaching agents anywhere (cluster/asks.py): their operations
        # come on this socket (its path and key in the workers' environment) and go to the
        # client with our results; the replies come back by answers()
        # (key, op, payload, caller) not yet sent; caller: the client's id of the agent here
        # that waits for the call's reply, or None
        self.asks: list[tuple[int, str, bytes, int | None]] = []
        self.asks_dir = children.make_dir()
        self.asker = AskServer(self.asks_dir, self._asked)
        os.environ.update(self.asker.env())
        self.ex = executor_cls(workers, **local)
        self.ex.wait_ready(60)
        self.lock = threading.Lock()
        self.queue: deque[tuple] = deque()  # (tid, fn, args, kwargs, hops)
        self.inflight = 0
        self.local_f: dict[int, Any] = {}  # tid -> its local future, while in flight
        self.out: list[tuple] = []  # (tid, ok, value) not yet sent to the client
        self.moved: list[tuple[int, str, int]] = []  # (tid, thief, hops) not yet reported
        self.done_n = 0
        self.task_s = 0.0  # measured mean task duration (0: unknown)
        self.last_fn: tuple = ()  # the function of the last task handed to the window
        self._busy_mark = (time.monotonic(), 0)  # (when, done_n) while continuously busy
        self.window_s = window_s
        self.fence_s = fence_s
        self.fenced = False
        self.last_contact = time.monotonic()
        self.waiter: tuple[asyncio.AbstractEventLoop, asyncio.Event, int] | None = None
        self.cfg = steal
        self.peers: dict[str, Any] = {}
        self.view_version = -1  # the client's last set of nodes applied (view())
        self.peer_loads: dict[str, Load] = {}
        self.thief = Thief(node_id, steal or StealConfig(), random.Random(seed))
        # the round trip of a child moved to another node and back, less its time there
        # (child_results' samples): children wait StealConfig.child_age_rtts of them (at
        # most CHILD_RTT_MAX_S each) before they move (_ripe_by)
        self.child_rtt = RoundTrip(CHILD_RTT_S)
        self._kids_timer = False  # a look (_kids_changed) is due by timer (_recheck_at)
        self.import_at: dict[tuple, float] = {}  # imported child -> when it came
        self.victim = Victim(node_id, steal or StealConfig())
        self.steals = {"asked": 0, "got": 0, "given": 0, "pushed": 0, "took": 0}
        self.ll_epochs: dict[str, int] = {}  # thief -> the epoch of its last (un)lifeline
        # lifeline thieves that had a worker free when they registered: only they get
        # fork-join children (a node stealing ahead, every worker busy, gets task pushes
        # only: measured, a node running a fib(33) root got a sibling of its size that way)
        self.ll_free: set[str] = set()
        self.epoch = 0  # of our own lifeline calls
        self.agents: dict[int, Any] = {}  # client's agent id -> local AgentRef
        self.aid_by_h: dict[int, int] = {}  # local agent handle -> client's id (_asked)
        # agent id -> its operations handed to its local agent and not answered yet: an
        # agent with some holds a worker (the occupied fraction, and Load.active)
        self.agent_out: dict[int, int] = {}
        # tid -> the fetch of its ObjectRef arguments (on the default group's loop)
        self.fetching: dict[int, asyncio.Task] = {}
        self.next_in = 1  # the client's next batch to run (submit's seq)
        self.early: dict[int, list[tuple]] = {}  # batches that came before their turn
        self.reordered = 0  # batches that came before their turn (held until it)
        self.evicted = 0  # agents that left for another live node
        self.msgs_n = 0  # agent operations answered (messages, and the client's state calls)
        self._occ_t = time.monotonic()  # the last change of what occupies the workers
        self.busy_frac = 0.0  # occupied fraction of the workers, time-weighted (BUSY_TAU_S)
        self.polls = 0  # results() calls answered
        self.seq = 0  # the last result batch made
        self.unacked: dict[int, tuple[list, list, list]] = {}  # seq -> (results, moved, asks)
        self._stealer: asyncio.Task | None = None
        self.loop: asyncio.AbstractEventLoop | None = None  # the default group's loop
        self.idle_ev: asyncio.Event | None = None  # set (in that loop) when the node idles
        # or runs low (nothing queued, at most _low_water() tasks in flight: it steals ahead)
        threading.Thread(target=self._watch, name="stealer-node-fence", daemon=True).start()

    # -- the client's calls --------------------------------------------------------------

    async def submit(self, batch: list[tuple], seq: int | None = None) -> Load:
        """Tasks from the client: (tid, fn, args, kwargs, hops) each.  Returns the load.

        ``seq``: the batch's number, from 1 up: batches run in that order whatever order
        the calls arrive in (Ray keeps no order between the calls of one caller to an
        async actor, and two client threads may send batches of this node), so an
        agent's messages are handled in the order they were sent; a batch sent again
        after a lost reply runs once.  None: at once (a caller that numbers nothing)."""
        self._contact()
        if any(_has_refs(b) for b in batch):  # (no agent operation has: they keep order)
            loop = asyncio.get_running_loop()
            for b in batch:
                if _has_refs(b):
                    t = self.fetching[b[0]] = loop.create_task(self._fetch(b))
                    t.add_done_callback(functools.partial(self._fetched, b[0]))
            batch = [b for b in batch if not _has_refs(b)]
        if seq is None:
            self._accept(batch)
        elif seq >= self.next_in and seq not in self.early:
            self.early[seq] = batch
            self.reordered += seq > self.next_in
            while self.next_in in self.early:
                b = self.early.pop(self.next_in)
                self.next_in += 1
                self._accept(b)
        return self.load()

    async def _fetch(self, b: tuple) -> None:
        """Task ``b`` once its ObjectRef arguments (top level, as Ray resolves a task's)
        are replaced by their values, fetched to this node; the tasks sent with it do not
        wait for them.  A task whose argument cannot be had fails alone with Ray's error,
        as a Ray task would."""
        tid, fn, args, kwargs, hops = b
        try:
            args = tuple([await a if isinstance(a, ray.ObjectRef) else a for a in args])
            if kwargs:
                kwargs = {k: (await v if isinstance(v, ray.ObjectRef) else v)
                          for k, v in kwargs.items()}
        except Exception as exc:
            self._finished(tid, False, (children._picklable(exc), ""))
            return
        with contextlib.suppress(NodeFencedError):  # (fenced: the client runs it elsewhere)
            self._accept([(tid, fn, args, kwargs, hops)])

    def _fetched(self, tid: int, t: asyncio.Task) -> None:
        self.fetching.pop(tid, None)
        if t.cancelled():  # withdrawn by the client (cancel), maybe before it began
            self._finished(tid, False, (WITHDRAWN, ""))

    async def results(self, ack: int, wait_s: float, linger_s: float,
                      loads: dict[str, Load] | None,
                      peers: dict[str, Any] | None) -> tuple[list[tuple], Load]:
        """The long poll: waits up to ``wait_s`` for results, then up to ``linger_s`` more
        (longer with much work queued: policy.linger_for)
        while work is still running here and fewer than ``BATCH_OUT`` results wait (a node
        with nothing left to run answers at once: a lone task's result is not held back);
        returns ([(seq, results, moved), ...], load): every batch the client has not
        acknowledged yet (``ack``: the last seq it processed), so a reply lost on the way
        (an ActorUnavailableError, when the call may or may not have run) is sent again by
        the next call, and the client drops what it had.  ``loads``/``peers``: the client's
        view of the other nodes, for stealing.  Every Ray call costs the client and this
        process one to two ms of CPU, so results of short tasks must travel in batches."""
        self._contact()
        self.polls += 1
        self.loop = asyncio.get_running_loop()
        if peers is not None:  # (the client sends them by view(); a caller may here)
            self._set_peers(peers)
        if loads is not None:
            self.peer_loads = loads
            self._kids_changed()
        if self.cfg is not None and self._stealer is None:
            self._stealer = asyncio.get_running_loop().create_task(self._steal_loop())
        if not self.out and not self.moved and not self.asks and wait_s > 0:
            await self._wait(1, wait_s)
        if linger_s > 0:
            await self._wait(BATCH_OUT, linger_for(linger_s, len(self.queue), self.task_s,
                                                   self.workers))
        with self.lock:
            for seq in [q for q in self.unacked if q <= ack]:
                del self.unacked[seq]
            if self.out or self.moved or self.asks:
                self.seq += 1
                self.unacked[self.seq] = (self.out, self.moved, self.asks)
                self.out, self.moved, self.asks = [], [], []
            batches = [(q, o, m, a) for q, (o, m, a) in sorted(self.unacked.items())]
        return batches, self.load()

    async def _wait(self, need: int, timeout: float) -> None:
        """Until ``need`` results wait (1: or a move to report; more: or the node has
        nothing left to run), at most ``timeout``.  Woken once, by :meth:`_notify`."""
        ev = asyncio.Event()
        self.waiter = (asyncio.get_running_loop(), ev, need)
        self._notify()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(ev.wait(), timeout)
        self.waiter = None

    def _notify(self) -> None:
        """Wake the results() call waiting if what it waits for is there (any thread)."""
        w = self.waiter
        if w is None:
            return
        loop, ev, need = w
        if need == 1:
            ready = bool(self.out or self.moved or self.asks)
        else:
            ready = (len(self.out) >= need or not (self.inflight or self.queue) or self.fenced
                     or bool(self.asks))
        if ready:
            self.waiter = None
            loop.call_soon_threadsafe(ev.set)

    @ray.method(concurrency_group="steal")
    def view(self, version: int, peers: dict[str, Any]) -> None:
        """The client's set of live nodes (their handles), sent as soon as it changes (a
        node ready or lost: ClusterExecutor._share_view).  ``version`` orders the calls
        (the steal group's threads may run two out of order): an older one than the last
        applied is ignored."""
        self._contact()
        with self.lock:
            if version <= self.view_version:
                return
            self.view_version = version
        self._set_peers(peers)
        self._kids_changed()

    def _set_peers(self, peers: dict[str, Any]) -> None:
        new = {n: h for n, h in peers.items() if n != self.node}
        gone = set(self.peers) - set(new)
        self.peers = new
        if gone and self.kids is not None:
            with self.kids.cv:
                for n in gone:  # its children not back run again here (at-least-once)
                    self.kids.table.lost(n)
                    self.origins.pop(n, None)
                    for ik in [ik for ik in self.import_at if ik[0] == n]:
                        del self.import_at[ik]
                self.kids.cv.notify_all()

    @ray.method(concurrency_group="health")
    def ping(self) -> Load:
        self._contact()
        return self.load()

    @ray.method(concurrency_group="health")
    def status(self) -> dict:
        """For tests and stats: the node's counters, fenced or not."""
        return {"node": self.node, "fenced": self.fenced, "queued": len(self.queue),
                "inflight": self.inflight, "done": self.done_n, "steals": dict(self.steals),
                "agents": len(self.agents), "evicted": self.evicted, "polls": self.polls,
                "asks": self.asker.asked,
                "reordered": self.reordered, "peers": sorted(self.peers),
                "children": (dict(self.kids.table.n, waiting=self.kids.waiting,
                                  rtt_ms=round(self.child_rtt.s * 1e3, 2),
                                  rtt_samples=self.child_rtt.samples)
                             if self.kids is not None else None),
                "worker_pids": [p for p in self.ex.worker_pids() if p] if not self.fenced else [],
                "segment": self.ex.segment_name, "pid": os.getpid()}

    @ray.method(concurrency_group="steal")
    def answers(self, items: list[tuple[int, bool, bytes]]) -> None:
        """The client's replies to calls our workers' agents made (``(key, ok, body)``,
        body pickled: cluster/asks.py); each goes to the thread waiting for it."""
        self._contact()
        for key, ok, body in items:
            self.asker.answer(key, ok, body)

    def _asked(self, key: int, op: str, payload: bytes, who: int | None = None) -> None:
        """An operation from a worker here on an agent of the executor (AskServer): sent to
        the client with the next results (at once: a waiting results() call returns).
        ``who``: the local handle of the agent that waits for the call's reply, sent as the
        client's id of that agent (None: a task, an agent the client did not spawn here)."""
        with self.lock:
            self.asks.append((key, op, payload, None if who is None else self.aid_by_h.get(who)))
        self._notify()

    @ray.method(concurrency_group="health")
    def stop(self) -> None:
        """Shut the local executor down (the client's shutdown)."""
        self._fence(reason=None)

    # -- other nodes' calls ---------------------------------------------------------------

    @ray.method(concurrency_group="steal")
    def steal(self, thief: str, free: bool = True) -> tuple[list[tuple], Load, list[tuple],
                                                           Any]:
        """A thief's request: up to half the surplus from the back of the queue, one batch;
        with no surplus, half the exported fork-join children (oldest first), if it has a
        worker ``free`` (not only asking ahead: a child as large as what it runs would
        wait there behind it)."""
        batch = self._give(thief, lambda q, sizes: self.victim.grant(q, sizes))
        self.steals["given"] += len(batch)
        kids: list[tuple] = []
        if not batch and self.kids is not None and free:
            born_by = self._ripe_by()
            with self.kids.lock:
                t = self.kids.table
                ripe = t.pending(born_by)
                kids = (t.ship(thief, max(1, ripe // 2), born_by, time.monotonic())
                        if ripe else [])
        return batch, self.load(), kids, self.me

    @ray.method(concurrency_group="steal")
    def take_children(self, items: list[tuple], source: str, handle: Any) -> None:
        """Fork-join children of ``source``'s tasks, (key, payload) each: each runs here as
        a task (stealer/cluster/children.py's ``imported``), unless a proxy of ours that
        waits takes it first; the results go back to ``source``."""
        if self.fenced or self.kids is None:
            raise NodeFencedError(f"node {self.node[:12]} takes no children")
        self._take_children(items, source, handle)

    @ray.method(concurrency_group="steal")
    def decline_children(self, keys: list) -> None:
        """Children we shipped that the thief had no worker free for when they came: they
        are PENDING here again (our own proxies run them, or a hungry peer gets them)."""
        if self.kids is None:
            return
        with self.kids.cv:
            self.kids.table.unship(keys, declined=True)
            self.kids.cv.notify_all()
        self._kids_changed()

    @ray.method(concurrency_group="steal")
    def child_results(self, items: list[tuple]) -> None:
        """Results of our exported children, (key, ok, value, held_s) each, from the node
        that ran them (``held_s``: from their arrival there to their result); one for a
        child claimed again here (its node was thought lost), or settled already, is
        dropped.  Each one returned is a sample of the children's round trip (the time
        out less the time held there: the two calls and their hand-offs)."""
        if self.kids is None:
            return
        now = time.monotonic()
        with self.kids.cv:
            for key, ok, value, held_s in items:
                sent = self.kids.table.sent_at(key)
                if self.kids.table.result(key, ok, value) and sent is not None:
                    self.child_rtt.add(now - sent - held_s)
            self.kids.cv.notify_all()
        self._kids_changed()

    @ray.method(concurrency_group="steal")
    def lifeline(self, thief: str, epoch: int, free: bool = True) -> None:
        """A thief that gave up asking: push to it when this node has surplus.  ``epoch``
        orders a thief's lifeline and unlifeline calls (they may run out of order in the
        steal group's threads): an older one than the last seen is ignored.  ``free``:
        it had a worker free (not only stealing ahead): fork-join children go only to
        such thieves, tasks to all."""
        with self.lock:
            if epoch <= self.ll_epochs.get(thief, -1):
                return
            self.ll_epochs[thief] = epoch
            self.victim.register(thief)
            if free:
                self.ll_free.add(thief)
            else:
                self.ll_free.discard(thief)
        self._push()
        self._kids_changed()

    @ray.method(concurrency_group="steal")
    def unlifeline(self, thief: str, epoch: int) -> None:
        """The thief got work by other ways: its lifeline here is dropped."""
        with self.lock:
            if epoch <= self.ll_epochs.get(thief, -1):
                return
            self.ll_epochs[thief] = epoch
            self.victim.forget(thief)

    @ray.method(concurrency_group="steal")
    def take(self, batch: list[tuple], source: str) -> None:
        """A lifeline push from ``source`` (it reports the move to the client)."""
        self._accept(batch)
        self.steals["took"] += len(batch)

    # -- the queue and the window ---------------------------------------------------------

    def _accept(self, batch: list[tuple]) -> None:
        if self.fenced:
            raise NodeFencedError(f"node {self.node[:12]} fenced itself (no word from the "
                                  "client for fence_s); its tasks run elsewhere")
        if not batch:
            return
        if any(isinstance(b[1], AgentOp) for b in batch):
            for b in batch:
                if isinstance(b[1], AgentOp):
                    self._agent_op(b[0], b[1])
            batch = [b for b in batch if not isinstance(b[1], AgentOp)]
            if not batch:
                return
        self.queue.extend(batch)
        self._kids_changed()
        self.thief.on_work()
        self._fill()
        if self.victim.lifelines:
            self._push()

    def _window(self) -> int:
        if self.task_s <= 0:
            per = 8
        else:
            per = min(WINDOW_MAX, max(WINDOW_MIN, math.ceil(self.window_s / self.task_s)))
        return per * self.workers

    def _fill(self) -> None:
        """Hand queued tasks to the local executor up to the window (any thread)."""
        window = self._window()
        while True:
            with self.lock:
                if self.inflight >= window or not self.queue or self.fenced:
                    return
                tid, fn, args, kwargs, _hops = self.queue.popleft()
                self._occupy()
                self.inflight += 1
                key = (getattr(fn, "__module__", None), getattr(fn, "__qualname__", None))
                if key != self.last_fn:  # another workload: its tasks' length is unknown
                    self.last_fn = key
                    self.task_s = 0.0
                    self._busy_mark = (time.monotonic(), self.done_n)
                    window = self._window()
            try:
                f = self.ex.submit(fn, *args, **kwargs)
            except BaseException as exc:  # unpicklable, or the executor broke
                with self.lock:
                    self._occupy()
                    self.inflight -= 1
                self._finished(tid, False, (exc, ""))
                continue
            self.local_f[tid] = f
            f.add_done_callback(functools.partial(self._done, tid))

    def _done(self, tid: int, f: Any) -> None:
        self.local_f.pop(tid, None)
        ok, value = _outcome(f)
        with self.lock:
            self._occupy()
            self.inflight -= 1
            self.done_n += 1
            self._measure()
        self._finished(tid, ok, value)
        self._fill()
        if not self.queue and self.inflight <= self._low_water():
            if not self.inflight:
                self._notify()  # a linger ends: nothing more is coming soon
            ev, loop = self.idle_ev, self.loop  # the thief: idle, or running low
            if ev is not None and loop is not None and not ev.is_set():
                loop.call_soon_threadsafe(ev.set)

    def _free_workers(self) -> int:
        """Workers with nothing to run now: not holding a task or an agent's messages, or
        holding a fork-join proxy that waits on another node with nothing to help with."""
        held = min(self.workers, self.inflight + len(self.agent_out))
        waiting = self.kids.waiting if self.kids is not None else 0
        return self.workers - held + waiting

    def _low_water(self) -> int:
        """Tasks in flight at or below which this node, with nothing queued, steals ahead
        (policy.Thief.low_water; 0 without stealing: only once idle)."""
        if self.cfg is None:
            return 0
        return self.thief.low_water(self.workers, self.task_s)

    def _occupy(self) -> None:
        """Account the time since the last change of what occupies the workers (tasks
        handed to them, agents with messages: each holds one) in the occupied fraction,
        an exponentially weighted mean over time (time constant BUSY_TAU_S: a node busy
        from idle shows 0.9 after 0.23 s), under self.lock, before every such change and
        every report."""
        now = time.monotonic()
        dt = now - self._occ_t
        if dt > 0:
            held = min(self.workers, self.inflight + len(self.agent_out)) / self.workers
            self.busy_frac += (held - self.busy_frac) * (1.0 - math.exp(-dt / BUSY_TAU_S))
        self._occ_t = now

    def _measure(self) -> None:
        """Mean task duration: completions per worker over a span the node stayed busy
        (under self.lock)."""
        now = time.monotonic()
        when, n0 = self._busy_mark
        if self.inflight < self.workers:  # not every worker busy: restart the span
            self._busy_mark = (now, self.done_n)
            return
        n = self.done_n - n0
        if n >= 4 * self.workers or now - when > 0.05:
            sample = (now - when) * self.workers / max(1, n)
            self.task_s = sample if self.task_s <= 0 else 0.7 * self.task_s + 0.3 * sample
            self._busy_mark = (now, self.done_n)

    async def cancel(self, tids: list[int]) -> list[int]:
        """The client withdraws tasks (``Future.cancel``, ``shutdown(cancel_futures=True)``,
        a map that ended early): those not started here, queued on this node or in its
        executor, never run and go back as WITHDRAWN; returns their ids.  A task started,
        done, or not here (moved to a thief; its batch not in yet) is left alone."""
        self._contact()
        want = set(tids)
        gone: list[int] = []
        with self.lock:
            if want and self.queue:
                keep = [b for b in self.queue if b[0] not in want]
                if len(keep) < len(self.queue):
                    gone = [b[0] for b in self.queue if b[0] in want]
                    self.queue.clear()
                    self.queue.extend(keep)
            local = [(t, self.local_f.get(t)) for t in want.difference(gone)]
        for tid in gone:
            self._finished(tid, False, (WITHDRAWN, ""))
        for tid in want.difference(gone):  # (its _fetch reports it WITHDRAWN)
            fetch = self.fetching.get(tid)
            if fetch is not None and fetch.cancel():
                gone.append(tid)
        for tid, f in local:  # (fails once a worker took it; else _done reports WITHDRAWN)
            if f is not None and f.cancel():
                gone.append(tid)
        return gone

    def _finished(self, tid: int, ok: bool, value: Any) -> None:
        with self.lock:
            self.out.append((tid, ok, value))
        self._notify()

    def _agent_op(self, tid: int, op: AgentOp) -> None:
        """Run an agent operation on the local executor; its outcome goes out as tid's."""
        try:
            if op.kind == "spawn":
                if op.aid in self.agents:  # a batch sent again (a lost reply): started
                    self._finished(tid, True, None)
                    return
                cls, args, init_kwargs, options = op.a
                ref = self.agents[op.aid] = self.ex.spawn_agent(cls, *args,
                                                                init_kwargs=init_kwargs, **options)
                self.aid_by_h[ref.id] = op.aid  # (handles carry their generation: not reused)
                self._finished(tid, True, None)
                return
            ref = self.agents.get(op.aid)
            if ref is None:  # (its spawn could not be loaded here: the client says why)
                raise AgentStopped(f"agent {op.aid} is not on node {self.node[:12]}: its "
                                   "spawn failed there, or it has left", op.aid)
            if op.kind in ("call", "send"):
                method, args, kwargs = op.a
                f = ref.call(method, *args, **kwargs)
            elif op.kind in ("state", "evict"):  # the client keeps it (agents.py, moves.py)
                f = ref.call(STATE)
            elif op.kind == "set_state":
                f = ref.call(SET_STATE, op.a)
            elif op.kind == "result":
                f = ref.future
                f.add_done_callback(functools.partial(self._agent_done, tid, None, False))
                return
            else:  # stop
                ref.stop()
                self._finished(tid, True, None)
                return
            with self.lock:
                self._occupy()
                self.agent_out[op.aid] = self.agent_out.get(op.aid, 0) + 1
            f.add_done_callback(functools.partial(
                self._agent_done, tid, op.aid, op.kind == "evict"))
        except BaseException as exc:
            self._finished(tid, False, (exc, ""))

    def _agent_done(self, tid: int, aid: int | None, evict: bool, f: Any) -> None:
        ok, value = _outcome(f)
        if aid is not None:
            with self.lock:
                self._occupy()
                self.msgs_n += 1
                n = self.agent_out.get(aid, 0) - 1
                if n > 0:
                    self.agent_out[aid] = n
                else:
                    self.agent_out.pop(aid, None)
        if evict and ok:  # its state is the client's now: the agent leaves this node
            ref = self.agents.pop(aid, None)
            if ref is not None:
                self.aid_by_h.pop(ref.id, None)
                self.evicted += 1
                with contextlib.suppress(Exception):
                    ref.stop()  # (no message of its is left here: the client holds them)
        self._finished(tid, ok, value)

    def load(self) -> Load:
        with self.lock:
            self._occupy()
            st = self.steals
            return Load(self.node, self.workers, queued=len(self.queue),
                        running=self.inflight, task_s=self.task_s, at=time.monotonic(),
                        busy=self.busy_frac, agents=len(self.agents),
                        active=len(self.agent_out), done=self.done_n, msgs=self.msgs_n,
                        got=st["got"] + st["took"],
                        given=st["given"] + st["pushed"],
                        waiting=self.kids.waiting if self.kids is not None else 0)

    # -- stealing between nodes -------------------------------------------------------------

    def _give(self, thief: str, count: Any) -> list[tuple]:
        with self.lock:
            q = len(self.queue)
            look = min(q, self.victim.cfg.max_count)
            sizes = [_approx_size(self.queue[-1 - i][2], self.queue[-1 - i][3])
                     for i in range(look)]
            # (at most what is queued now: a push counts before it gives, unlocked between)
            n = min(count(q, sizes), q)
            batch = [(*t[:4], t[4] + 1) for t in (self.queue.pop() for _ in range(n))]
            # hops: the client applies a move only if it is newer than the last it applied
            # (the reports of a task pushed on twice may reach it in either order)
            self.moved.extend((t[0], thief, t[4]) for t in batch)
        if batch:
            self._notify()
        return batch

    def _push(self) -> None:
        """A lifeline push, if this node has surplus and a thief waits (one batch)."""
        with self.lock:
            q = len(self.queue)
            push = self.victim.pushes(q, [64] * q, alive=lambda n: n in self.peers)
        if push is None:
            return
        thief, n = push
        batch = self._give(thief, lambda _q, _s: n)
        if batch:
            self.steals["pushed"] += len(batch)
            ref = self.peers[thief].take.remote(batch, self.node)
            ref.future().add_done_callback(functools.partial(self._pushed, batch))

    def _pushed(self, batch: list[tuple], f: Any) -> None:
        """A push that failed (the thief unreachable, or gone): the batch comes back here,
        reported as moved back, so no task stays where nobody runs it.  (If the thief did
        get it, both run it: at-least-once, and the client keeps one result.)"""
        if f.exception() is None or self.fenced:
            return
        back = [(*t[:4], t[4] + 1) for t in batch]
        with self.lock:
            self.moved.extend((t[0], self.node, t[4]) for t in back)
        self._accept(back)

    async def _steal_loop(self) -> None:
        """The thief: sleeps while the node is busy (woken when it idles), asks while it
        idles, and waits on its lifelines once it gave up."""
        cfg = self.thief.cfg
        registered: list[str] = []
        registered_at = 0.0
        registered_fed = 0
        self.idle_ev = ev = asyncio.Event()
        while not self.fenced:
            low = self._low_water()
            if self.queue or self.inflight > low:
                if registered:  # busy again: the buddies must not push to us now
                    self.epoch += 1
                    for b in registered:
                        if b in self.peers:
                            self.peers[b].unlifeline.remote(self.node, self.epoch)
                registered = []
                ev.clear()
                if self.queue or self.inflight > self._low_water():
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(ev.wait(), 1.0)
                continue
            now = time.monotonic()
            self.thief.idle(now, low=self.inflight > 0)  # (low: it asks ahead)
            loads = {n: ld for n, ld in self.peer_loads.items() if n in self.peers}
            loads[self.node] = self.load()
            victim = self.thief.poll(now, loads)
            if victim is None:
                lines = self.thief.registrations()
                # (again every LIFELINE_RENEW_S: a buddy that lost it, or had no surplus
                # when it came and gets none by a new batch, looks again when it comes)
                # (and at once after work came: a buddy that pushed to us dropped ours, and
                # the busy spell between may have been too short for this loop to see)
                if lines and (lines != registered or registered_fed != self.thief.fed
                              or now - registered_at > LIFELINE_RENEW_S):
                    self.epoch += 1
                    free = self._free_workers() > 0
                    for b in lines:
                        if b in self.peers:
                            self.peers[b].lifeline.remote(self.node, self.epoch, free)
                    registered, registered_at = lines, now
                    registered_fed = self.thief.fed
                await asyncio.sleep(LIFELINE_POLL_S if lines else cfg.idle_s)
                continue
            self.steals["asked"] += 1
            got: list[tuple] = []
            fut = asyncio.wrap_future(self.peers[victim].steal.remote(
                self.node, self._free_workers() > 0).future())
            done, _ = await asyncio.wait({fut}, timeout=max(1.0, 20 * self.thief.rtt.s))
            kids: list[tuple] = []
            if fut in done and fut.exception() is None:
                got, vload, kids, vhandle = fut.result()
                self.peer_loads[victim] = vload
            elif fut not in done:  # slow: its tasks are ours when they come (the victim
                fut.add_done_callback(functools.partial(self._late_steal, victim))
            self.thief.on_reply(time.monotonic(), victim, len(got) + len(kids), loads)
            if got:
                self.steals["got"] += len(got)
                self._accept(got)
            if kids:
                self._take_children(kids, victim, vhandle)

    def _late_steal(self, victim: str, fut: Any) -> None:
        if not self.fenced and not fut.cancelled() and fut.exception() is None:
            got, _load, kids, vhandle = fut.result()
            self.steals["got"] += len(got)
            self._accept(got)
            if kids:
                self._take_children(kids, victim, vhandle)

    # -- fork-join children across nodes (stealer/cluster/children.py) -------------------------

    def _kids_changed(self) -> None:
        """Raise or lower the workers' export flag (the hungry peers' room against the
        children pending here), and ship pending children to the hungriest peer (lifeline
        thieves first).  Any thread; after anything that changes either side."""
        kids = self.kids
        if kids is None or self.fenced:
            return
        peers = [ld for n, ld in self.peer_loads.items() if n in self.peers]
        with self.lock:
            lines = [t for t in self.victim.lifelines if t in self.ll_free]
        cap = self.thief.cfg.children
        born_by = self._ripe_by()
        with kids.lock:
            t = kids.table
            pending = t.pending()
            want = children.hungry(peers, lines, t.shipped(), cap)
            kids.set_want(not self.queue and pending < sum(want.values()))
            # shipped only to a thief that says it is hungry now (a lifeline): the load
            # reports reach us through the client, late, and children pushed on them went
            # to nodes busy by then (and came back: measured, a fib tree bounced between two)
            node = next((n for n in lines if n in want), None)
            if not pending or node is None:
                return
            ripe = t.pending(born_by)
            if ripe < min(pending, want[node]):  # young ones it could take later
                self._recheck_at(t.oldest_pending(born_by))
            if not ripe:
                return
            items = t.ship(node, min(ripe, want[node]), born_by, time.monotonic())
        if node in lines:
            with self.lock:
                self.victim.forget(node)  # (it registers again if it runs dry again)
        handle = self.peers.get(node)
        if handle is None:
            with kids.cv:
                kids.table.unship(k for k, _ in items)
            return
        self.steals["pushed_children"] = self.steals.get("pushed_children", 0) + len(items)
        ref = handle.take_children.remote(items, self.node, self.me)
        ref.future().add_done_callback(functools.partial(self._children_pushed, items))

    def _ripe_by(self) -> float:
        """Children exported at this time or before may move to another node: those
        pending for ``StealConfig.child_age_rtts`` round trips of a child moved, so a
        small tree's children are claimed back by its own workers before they could pay
        for the trip (stealer/cluster/children.py: the measurements)."""
        rtt = min(self.child_rtt.s, CHILD_RTT_MAX_S)
        return time.monotonic() - self.thief.cfg.child_age_rtts * rtt

    def _recheck_at(self, born: float | None) -> None:
        """Look again (``_kids_changed``) when the oldest pending child, exported at
        ``born``, is old enough to move; one timer at a time."""
        if born is None or self._kids_timer:
            return
        self._kids_timer = True
        delay = max(0.0, born - self._ripe_by()) + 0.0005

        def fire() -> None:
            self._kids_timer = False
            self._kids_changed()

        timer = threading.Timer(delay, fire)
        timer.daemon = True
        timer.start()

    def _kids_hungry(self, node: str) -> None:
        """A proxy of ours waits on ``node`` with nothing to do: a lifeline there, so it
        sends us children at once (its view of our load comes late, through the client)."""
        handle = self.peers.get(node) or self.origins.get(node)
        if handle is None or self.fenced:
            return
        self.epoch += 1
        with contextlib.suppress(Exception):
            handle.lifeline.remote(self.node, self.epoch)

    def _children_pushed(self, items: list[tuple], f: Any) -> None:
        """A push of children that failed (the thief unreachable, or gone): they are
        PENDING here again, so a waiting proxy runs them itself (at-least-once)."""
        if f.exception() is None or self.kids is None:
            return
        with self.kids.cv:
            self.kids.table.unship(k for k, _ in items)
            self.kids.cv.notify_all()
        self._kids_changed()

    def _take_children(self, items: list[tuple], source: str, handle: Any) -> None:
        kids = self.kids
        if kids is None or self.fenced:
            return
        # (its handle comes with them: our peers, from the client, may not list it yet)
        self.origins[source] = handle
        # As many as we have workers free now, the others back at once: a lifeline or a
        # steal request may be older than the work that came since (traced: a node got
        # work 10 ms before a child as large as a root's half came on its lifeline; its
        # worker ran it only after its own roots, and the parent's worker, waiting on it,
        # ran the first node's pieces one by one: 8 fib(30) roots over two nodes took
        # 2.2 s where one node takes 2.4).
        free = max(0, self._free_workers())
        if free < len(items):
            with contextlib.suppress(Exception):
                handle.decline_children.remote([k for k, _ in items[free:]])
            items = items[:free]
            if not items:
                return
        now = time.monotonic()
        for key, _ in items:  # (before a waiting proxy may run one and report it)
            self.import_at[(source, key)] = now
        with kids.cv:
            ikeys = kids.table.add_imports(source, items)
            kids.cv.notify_all()  # a waiting proxy may run one inline
        self.thief.on_work()
        for ik in ikeys:
            self._run_import(ik)

    def _run_import(self, ikey: tuple) -> None:
        """An imported child as a task of the local executor (not in the queue: thieves
        never take it on, and it is not the client's)."""
        with self.lock:
            self._occupy()
            self.inflight += 1
        try:
            f = self.ex.submit(children.imported, ikey)
        except BaseException as exc:
            with self.lock:
                self._occupy()
                self.inflight -= 1
            self._child_back(ikey, False, (RemoteError(f"{type(exc).__name__}: {exc}"), ""))
            return
        f.add_done_callback(functools.partial(self._import_done, ikey))

    def _import_done(self, ikey: tuple, f: Any) -> None:
        ok, value = _outcome(f)
        with self.lock:
            self._occupy()
            self.inflight -= 1
        if not (ok and value == children.TAKEN):
            self._child_back(ikey, ok, value)
        self._fill()
        if not self.inflight and not self.queue:
            self._notify()
            ev, loop = self.idle_ev, self.loop
            if ev is not None and loop is not None:
                loop.call_soon_threadsafe(ev.set)

    def _child_back(self, ikey: tuple, ok: bool, value: Any) -> None:
        """An imported child's result, to the node of its parent (if it is still there)."""
        origin, key = ikey
        handle = self.origins.get(origin)
        if handle is None or self.fenced:
            return  # its parent's node is gone: its root runs again elsewhere
        held_s = time.monotonic() - self.import_at.pop(ikey, time.monotonic())
        ref = handle.child_results.remote([(key, ok, value, held_s)])
        ref.future().add_done_callback(functools.partial(self._back_done, ikey, ok, value, 0))

    def _back_done(self, ikey: tuple, ok: bool, value: Any, tries: int, f: Any) -> None:
        """A result that did not reach its parent's node: again (up to 5 times, 0.1 s
        apart) unless that node is gone (its proxy would wait for it until then)."""
        exc = f.exception()
        if exc is None or isinstance(exc, ray.exceptions.ActorDiedError) or tries >= 5:
            return
        if ikey[0] in self.origins and not self.fenced:
            t = threading.Timer(0.1, self._resend, (ikey, ok, value, tries + 1))
            t.daemon = True
            t.start()

    def _resend(self, ikey: tuple, ok: bool, value: Any, tries: int) -> None:
        handle = self.origins.get(ikey[0])
        if handle is None or self.fenced:
            return
        ref = handle.child_results.remote([(ikey[1], ok, value, math.inf)])  # (no sample)
        ref.future().add_done_callback(functools.partial(self._back_done, ikey, ok, value,
                                                         tries))

    # -- fencing -----------------------------------------------------------------------------

    def _contact(self) -> None:
        self.last_contact = time.monotonic()

    def _watch(self) -> None:
        while not self.fenced:
            time.sleep(min(0.25, self.fence_s / 4))
            if time.monotonic() - self.last_contact > self.fence_s:
                self._fence("no word from the client")

    def _fence(self, reason: str | None) -> None:
        """Stop: queued tasks dropped, the local executor shut down.  Cut off from the client
        (``reason``), running tasks are killed too (their workers, and the replacements that
        re-run them under ``retries``), since the client runs them elsewhere by now."""
        with self.lock:
            if self.fenced:
                return
            self.fenced = True
            self.queue.clear()
        if self.kids is not None:
            self.kids.close()  # (its waiting proxies end with the workers)
        self.asker.close()  # (calls waiting on it fail: their agents see it at the yield)
        if reason is None:
            self.ex.shutdown(wait=True, cancel_futures=True)
            if self.kids is not None:
                shutil.rmtree(self.kids_dir, ignore_errors=True)
            shutil.rmtree(self.asks_dir, ignore_errors=True)
            return
        stopper = threading.Thread(target=self.ex.shutdown, kwargs={"cancel_futures": True},
                                   name="stealer-node-fence-stop", daemon=True)
        stopper.start()
        deadline = time.monotonic() + 30
        while stopper.is_alive() and time.monotonic() < deadline:
            for pid in self.ex.worker_pids():
                if pid:
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGKILL)
            stopper.join(0.05)
        if self.kids is not None and not stopper.is_alive():
            shutil.rmtree(self.kids_dir, ignore_errors=True)
        if not stopper.is_alive():
            shutil.rmtree(self.asks_dir, ignore_errors=True)
