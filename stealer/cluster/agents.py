"""Agents on a cluster executor: the ref users hold and the executor's agent methods.

Owns placing an agent on a node, sending its operations (spawn, call, send, stop, result:
:class:`~stealer.cluster.node.AgentOp` in the node's task batches, run at once by the node
agent on its local executor) and starting it again elsewhere when its node is lost.  Mixed
into :class:`~stealer.cluster.client.ClusterExecutor`, whose lock, ledger and batches it
uses; users call it through ``ex.spawn_agent`` and :class:`ClusterAgentRef`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from concurrent.futures import Future
from typing import Any

from stealer.cluster.ledger import AgentRecord, NodeView, Task
from stealer.cluster.node import AgentOp
from stealer.cluster.policy import Load, place
from stealer.errors import AgentNotFound, ClusterError, ExecutorShutdownError, NodeLostError

__all__ = ["AgentsOnCluster", "ClusterAgentRef"]


class ClusterAgentRef:
    """A handle on an agent of a cluster executor: ``call`` (a Future), ``send``, ``stop``,
    ``result``, as :class:`stealer.AgentRef`.  Its messages go through the node agent of
    the node it lives on, batched with that node's tasks."""

    __slots__ = ("_a", "_ex")

    def __init__(self, ex: Any, agent: AgentRecord) -> None:
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


class AgentsOnCluster:
    """The agent methods of the cluster executor (a mixin: ``self`` is the executor)."""

    _lock: Any
    _tids: Any
    _ledger: dict[int, Task]
    _agents: dict[int, AgentRecord]
    _names: dict[str, AgentRecord]
    _nodes: dict[str, NodeView]
    _retries: int
    _shutdown: bool
    _stats: Any
    _rng: Any

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
            a = AgentRecord(next(self._tids), (cls, args, init_kwargs or {}, options), name, r)
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

    def _agent_op(self, a: AgentRecord, kind: str, arg: Any) -> Future:
        fut: Future = Future()
        with self._lock:
            if self._shutdown and kind in ("call", "send"):
                raise ExecutorShutdownError("cannot message agents after shutdown")
            if a.failed is not None:
                fut.set_exception(a.failed)
                return fut
            tid = next(self._tids)
            t = Task(fut, (AgentOp(kind, a.aid, arg), (), {}), a.node, a)
            self._ledger[tid] = t
            full = self._enqueue(a.node, tid, t)
        if full is not None:
            self._send(full)
        return fut

    def _restart(self, a: AgentRecord, tids: list[int], lost: NodeView) -> None:
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
        t = Task(Future(), (AgentOp("spawn", a.aid, a.spawn), (), {}), a.node, a)
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

    def _place_agent(self) -> NodeView:
        """Power of two choices on the live agents per worker this client put on each node
        (exact, where task load reports may be half a second old)."""
        count: dict[str, int] = {n.id: 0 for n in self._nodes.values() if n.alive and n.ready}
        for a in self._agents.values():
            if a.node is not None and a.node.id in count and a.failed is None and not a.over:
                count[a.node.id] += 1
        loads = {n: Load(n, self._nodes[n].workers, queued=c) for n, c in count.items()}
        return self._nodes[place(loads, self._rng)]

