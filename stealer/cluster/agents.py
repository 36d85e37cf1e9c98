"""Agents on a cluster executor: the ref users hold and the executor's agent methods.

Owns placing an agent on a node, sending its operations (spawn, call, send, stop, result:
:class:`~stealer.cluster.node.AgentOp` in the node's task batches, run at once by the node
agent on its local executor) and starting it again elsewhere when its node is lost.  Mixed
into :class:`~stealer.cluster.client.ClusterExecutor`, whose lock, ledger and batches it
uses; users call it through ``ex.spawn_agent`` and :class:`ClusterAgentRef`.
"""

from __future__ import annotations

import functools
import pickle
import threading
from collections.abc import Iterable
from concurrent.futures import Future
from typing import Any

from stealer.cluster import asks
from stealer.cluster.ledger import AgentRecord, NodeView, Task
from stealer.cluster.node import AgentOp
from stealer.cluster.policy import Load, place
from stealer.errors import (
    AgentDeadlock,
    AgentNotFound,
    AgentStopped,
    ClusterError,
    ExecutorShutdownError,
    NodeLostError,
    SerializationError,
)
from stealer.futures import AwaitableFuture

__all__ = ["AgentsOnCluster", "STATE_EVERY", "ClusterAgentRef"]

STATE_EVERY = 32  # messages between two states of an agent kept by the client


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
        """The node it lives on now (it moves when its node is lost, or to even out busy
        and idle nodes: stealer/cluster/moves.py)."""
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
        if self._ex._journal is not None:
            _ = self.future  # its final value goes into the journal when it comes

    @property
    def future(self) -> Future:
        """The Future of the agent's final value."""
        a = self._a
        with self._ex._lock:
            if a.result is None:
                self._ex._ask_result(a)
            return a.result

    def result(self, timeout: float | None = None) -> Any:
        """The agent's final value (``ctx.done(value)``, or ``on_stop()`` after stop)."""
        return self.future.result(timeout)

    def __repr__(self) -> str:
        return f"<stealer ClusterAgentRef {self._a.aid} on {str(self.node)[:12]}>"

    def __reduce__(self) -> tuple:
        # sent to a task or an agent: a RemoteAgentRef there (cluster/asks.py), this
        # executor's ref again if it comes back to this process
        return (asks.rebuild, (self._a.aid, self._a.name, self._ex._token, self._a.uid))

    def __eq__(self, other: object) -> bool:
        return (getattr(other, "id", None) == self._a.aid
                and getattr(other, "_token", None) == self._ex._token)

    def __hash__(self) -> int:
        return hash((self._a.aid, self._ex._token))

    @property
    def _token(self) -> str:
        return self._ex._token


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
    _journal: Any  # a ClusterJournal (stealer/cluster/journal.py), or None
    _waits: dict[Any, tuple]
    _token: str
    # agent id -> {agent id it waits for: calls outstanding} (cluster/asks.py's calls made
    # from generators and coroutines, under _lock): the cycle check's graph (_wait_edge)
    _waiting_for: dict[int, dict[int, int]]

    def spawn_agent(self, cls: type, /, *args: Any, init_kwargs: dict | None = None,
                    retries: int | None = None, name: str | None = None,
                    state_every: int = STATE_EVERY, node: str | None = None,
                    **options: Any) -> ClusterAgentRef:
        """Start an agent on a node (power of two choices): ``cls(*args, **init_kwargs)``
        lives in that node's executor (options as :meth:`stealer.Executor.spawn_agent`).

        The client keeps the agent's state: after every ``state_every`` messages
        (calls and sends) it asks the agent for it (its ``__getstate__()``, else its
        ``__dict__``: it must pickle) and keeps the messages sent since.  When the node is
        lost the agent starts again on another (at most ``retries`` times, default the
        executor's): built from its spawn arguments, given the state kept (``__setstate__``,
        else ``__dict__`` updated), then every message since, in their order: those it
        had answered for their effect (their replies dropped), the others to their
        callers.  A deterministic agent so ends as if its node had never been lost; one
        with effects outside its state repeats them (at-least-once).  ``state_every=0``:
        no state kept (it starts again from its spawn arguments, with only the messages it
        had not answered), and it never moves between live nodes.  ``node``: start it on
        that node (one of ``ex.nodes``) instead of placing it; it may still move later
        (stealer/cluster/moves.py).  With a journal (``Executor(cluster=...,
        journal=PATH)``, stealer/cluster/journal.py) the spawn, every message and each
        state kept go to disk first, ``name`` is unique per journal and ``state_every``
        must be at least 1."""
        if not isinstance(state_every, int) or state_every < 0:
            raise ValueError(f"state_every is a number of messages >= 0 (0: keep no "
                             f"state), not {state_every!r}")
        if state_every == 0 and self._journal is not None:
            # (restarted after a node loss from its spawn with only its unanswered
            # messages, it would hold another state than the journal recovers)
            raise ValueError("a journaled agent keeps its state: state_every=0 is refused "
                             "with a journal (Executor(cluster=..., journal=PATH))")
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
            a.every = state_every
            if node is None:
                a.node = self._place_agent()
            else:
                a.node = self._nodes.get(node)
                if a.node is None or not a.node.alive or not a.node.ready:
                    raise ClusterError(f"no node executor on node {node!r}; pick one of "
                                       "ex.nodes")
            if self._journal is not None:  # (before the agent exists anywhere)
                self._journal.spawn(a)
            self._agents[a.aid] = a
            if name is not None:
                self._names[name] = a
            self._agent_op(a, "spawn", a.spawn)
        return ClusterAgentRef(self, a)

    def agent(self, name: str) -> ClusterAgentRef:
        """The agent spawned with ``name`` (wherever it lives now)."""
        a = self._names.get(name)
        if a is None:
            where = ("this cluster executor" if self._journal is None
                     else f"the journal {self._journal.path}")
            raise AgentNotFound(f"no agent named {name!r} in {where}; "
                                "spawn_agent(..., name=NAME) names one")
        return ClusterAgentRef(self, a)

    def _ref_of(self, aid: int) -> ClusterAgentRef | None:
        """This executor's ref of agent ``aid`` (a pickled ref loaded here: asks.rebuild)."""
        a = self._agents.get(aid)
        return None if a is None else ClusterAgentRef(self, a)

    def _ref_of_uid(self, uid: str) -> ClusterAgentRef | None:
        """This executor's ref of the journaled agent ``uid`` (asks.rebuild)."""
        a = self._by_uid(uid)
        return None if a is None else ClusterAgentRef(self, a)

    def _by_uid(self, uid: str) -> AgentRecord | None:
        for a in list(self._agents.values()):  # (refs from before a recovery only: rare)
            if a.uid == uid:
                return a
        return None

    def _asked(self, node: NodeView, asks: list[tuple[int, str, bytes, int | None]]) -> None:
        """Operations that tasks and agents on ``node`` made on agents of this executor
        (cluster/asks.py): each runs as the client's own; a call's reply goes back to
        ``node`` (:meth:`_answer`).  A ref made by another executor (its token: one whose
        journal this one recovered, held in an agent's state) names its agent by its
        journal id, never by the id, which another agent may have here.  A call whose
        caller waits for it (``caller``: that agent's id) is refused with AgentDeadlock
        when it closes a cycle of waiting agents (:meth:`_wait_edge`)."""
        for key, op, payload, caller in asks:
            edge = None
            try:
                aid, _op, method, args, kwargs, token, uid = pickle.loads(payload)
                a = self._agents.get(aid) if token == self._token else None
                if a is None and uid is not None:
                    a = self._by_uid(uid)
                if a is None:
                    raise AgentStopped(f"agent {aid} is not an agent of this executor (it "
                                       "was never spawned here, or is gone)", aid)
                if op == "stop":
                    ClusterAgentRef(self, a).stop()
                    continue
                if op == "call" and caller is not None:
                    edge = self._wait_edge(caller, a, method)
                fut = self._agent_op(a, op, (method, args, kwargs or {}))
            except BaseException as exc:  # (a send's error has nobody to go to)
                if op == "call":
                    self._answer(node, key, None, exc, edge)
                continue
            if op == "call":
                fut.add_done_callback(functools.partial(self._answer, node, key, edge=edge))

    def _wait_edge(self, caller: int, a: AgentRecord, method: str) -> tuple[int, int]:
        """Agent ``caller`` waits for ``a``'s reply: the edge (caller, a.aid) added to the
        graph of waiting agents (until the reply goes out, :meth:`_answer`), or
        AgentDeadlock when ``a`` already waits for ``caller`` through other calls (or is
        it): such a call would never be handled."""
        callee = a.aid
        with self._lock:
            waits = self._waiting_for
            path = self._wait_path(waits, callee, caller)
            if path is None:
                edges = waits.setdefault(caller, {})
                edges[callee] = edges.get(callee, 0) + 1
                return (caller, callee)
        cycle = " -> ".join(str(x) for x in (caller, *path))
        what = (f"agent {caller} called agent {callee} ({method!r}), which "
                + ("is the caller itself" if callee == caller else
                   f"waits for the caller's reply: the calls {cycle} form a cycle"))
        raise AgentDeadlock(
            f"{what}; an agent handles messages only between its steps and handlers, so "
            "this call would wait forever. Call the method directly when it is the same "
            "agent, send (ref.send) what needs no reply, or return and let the other agent "
            "call back later", caller)

    @staticmethod
    def _wait_path(waits: dict[int, dict[int, int]], start: int, goal: int
                   ) -> list[int] | None:
        """A path of waiting agents from ``start`` to ``goal`` (both included), or None."""
        if start == goal:
            return [start]
        seen = {start}
        stack = [(start, [start])]
        while stack:
            x, path = stack.pop()
            for y in waits.get(x, ()):
                if y == goal:
                    return [*path, y]
                if y not in seen:
                    seen.add(y)
                    stack.append((y, [*path, y]))
        return None

    def _answer(self, node: NodeView, key: int, fut: Future | None,
                exc: BaseException | None = None, edge: tuple[int, int] | None = None
                ) -> None:
        """A call's reply (or ``exc``) to the node whose worker made it (lost: dropped);
        ``edge``: the caller no longer waits for the callee."""
        if edge is not None:
            with self._lock:
                edges = self._waiting_for.get(edge[0])
                if edges is not None:
                    n = edges.get(edge[1], 0) - 1
                    if n > 0:
                        edges[edge[1]] = n
                    else:
                        edges.pop(edge[1], None)
                        if not edges:
                            del self._waiting_for[edge[0]]
        if fut is not None:
            exc = fut.exception()
        ok = exc is None
        try:
            body = asks.dumps(fut.result() if ok else exc)
        except BaseException as err:  # the reply does not pickle: the caller gets why
            ok, body = False, asks.dumps(SerializationError(
                f"the reply could not be pickled for the calling agent ({err!r})"))
        if node.alive:
            self._tell(node, [(key, ok, body)])

    def _tell(self, node: NodeView, items: list[tuple[int, bool, bytes]]) -> None:
        """Replies to ``node``'s asks (NodeAgent.answers), watched by the results thread as
        every call to a node: a transient error sends them again, a death loses the node."""
        ref = node.handle.answers.remote(items)
        with self._lock:
            self._waits[ref] = ("answers", node, items)

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
        fut: Future = AwaitableFuture()
        with self._lock:
            if self._shutdown and kind in ("call", "send"):
                raise ExecutorShutdownError("cannot message agents after shutdown")
            if a.failed is not None:
                fut.set_exception(a.failed)
                return fut
            # numbered: calls and sends (and, journaled, stops: replayed after a loss)
            logged = kind in ("call", "send") or (kind == "stop" and a.uid is not None)
            if logged:
                if a.uid is not None:  # write-ahead: on disk before it can reach the node
                    self._journal.msg(a, a.seq + 1, kind, arg)
                a.seq += 1
            tid = next(self._tids)
            t = Task(fut, (AgentOp(kind, a.aid, arg), (), {}), a.node, a)
            self._ledger[tid] = t
            full = self._deliver(a, tid, t)  # (held while the agent moves)
            more = None
            if a.every and logged:
                a.log.append([a.seq, tid, kind, arg])
                if kind != "stop" and a.seq % a.every == 0:
                    more = self._ask_state(a)
        # (sent outside the lock, as every batch)
        if full is not None:
            self._send(full)
        if more is not None and more is not full:
            self._send(more)
        return fut

    def _ask_state(self, a: AgentRecord) -> NodeView | None:
        """A STATE call after message #a.seq (under the lock); its reply replaces the
        state kept and the messages it covers leave the log (:meth:`_kept`)."""
        covers = a.seq
        fut: Future = Future()
        tid = next(self._tids)
        t = Task(fut, (AgentOp("state", a.aid, None), (), {}), a.node, a)
        self._ledger[tid] = t
        a.log.append([covers, tid, "state", None])
        fut.add_done_callback(functools.partial(self._kept, a, covers))
        return self._deliver(a, tid, t)

    def _kept(self, a: AgentRecord, covers: int, fut: Future) -> None:
        if fut.cancelled():  # (shutdown(cancel_futures=True)): nothing to keep
            return
        exc = fut.exception()
        with self._lock:
            if exc is not None:  # (a state that does not pickle): keep no state from now
                a.every, a.log, a.state, a.has_state = 0, [], None, False
                self._stats.state_errors += 1
                if a.uid is not None:
                    self._unkept(a, exc)  # (stealer/cluster/journal.py)
                return
            if not a.every or covers <= a.state_seq:
                return  # an older reply than the state kept (a restart asked it again)
            a.state, a.has_state, a.state_seq = fut.result(), True, covers
            a.log = [e for e in a.log if e[0] > covers]
            if a.uid is not None:
                self._journal_state(a, covers)

    def _restart(self, a: AgentRecord, tids: list[int], lost: NodeView) -> None:
        """An agent whose node was lost: spawned again elsewhere, then its unanswered
        operations in their first order (under the lock).  One that was moving: its
        held operations (never sent) are unanswered ones too."""
        tids = tids + self._abort_move(a)
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
        self._start_again(a, tids)

    def _start_again(self, a: AgentRecord, tids: list[int]) -> None:
        """Start ``a`` on a node (under the lock): its spawn, its state kept, then the
        messages of ``a.log`` in their order (those among ``tids``, its unanswered
        operations, to their callers; the others for their effect, replies dropped), then
        the rest of ``tids``.  After a node loss, and for an agent recovered from the
        journal (stealer/cluster/journal.py: ``tids`` empty)."""
        a.node = self._place_agent()
        full = set()
        first = [("spawn", a.spawn)]
        if a.has_state:
            first.append(("set_state", a.state))
        for kind, arg in first:
            tid = next(self._tids)
            t = Task(Future(), (AgentOp(kind, a.aid, arg), (), {}), a.node, a)
            self._ledger[tid] = t
            full.add(self._enqueue(a.node, tid, t))
        lost_ops = set(tids)
        # the messages since the state kept, in their order: an answered one again for
        # its effect (a fresh task: its reply dropped), an unanswered one to its caller
        for e in a.log:
            _seq, tid, kind, arg = e
            if tid in lost_ops:
                lost_ops.discard(tid)
                t = self._ledger[tid]
                t.hops += 1 << 16
                full.add(self._enqueue(a.node, tid, t))
            elif kind != "state":  # (a recovered agent's: every message after its state)
                e[1] = tid = next(self._tids)
                t = Task(Future(), (AgentOp(kind, a.aid, arg), (), {}), a.node, a)
                self._ledger[tid] = t
                full.add(self._enqueue(a.node, tid, t))
                self._stats.replayed += 1
        for tid in sorted(lost_ops):  # the rest: unlogged operations (no state kept, result)
            t = self._ledger[tid]
            if t.call[0].kind in ("spawn", "set_state", "evict"):
                del self._ledger[tid]  # the old start's ack (the new one replaces it), or
                continue  # a move's evict: the restart is the move now
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

