"""Agents moving between live nodes: the client's side of a move (checkpoint + restore).

Mixed into :class:`~stealer.cluster.client.ClusterExecutor` (whose lock, ledger, batches
and agent records it uses), beside the agents' methods (``stealer/cluster/agents.py``).
The rule of when and which (``stealer/cluster/balance.py``) sees every load report that
rides on a node's result batch (:meth:`AgentMoves._balance`, on the results thread); this
module does what it decides:

1. **Evict**: an ``evict`` operation goes to the agent's node, after every message already
   sent there: the node asks the agent for its state (its STATE handler, run after those
   messages) and, once it has it, stops the agent there (its final value dropped; no
   message of its is left there).  From this point every operation for the agent (calls,
   sends, the client's own STATE calls, stop, result) waits at the client, in ``held``.
2. **Restore**: when the state comes back (:meth:`AgentMoves._evicted`), the client keeps
   it as the agent's checkpoint (it covers every message sent before the move), and sends
   the new node the agent's spawn, SET_STATE(state), then the held operations in their
   order, in one batch; later operations go there (``ex.agent(name)`` finds it, the
   records are the same).  The replies of the messages sent before the move came from the
   old node before the state did (the agent answered them first), so each caller's replies
   still come back in their order, none lost, none twice.
3. **Failures**: the old node lost before the state came: the agent restarts elsewhere
   from its kept checkpoint, as for any lost node, with the held operations (never run) as
   its unanswered ones.  The state call failed (it did not pickle): the agent stays where
   it is, its held operations go there, and it is never moved again.  The new node lost
   later: the usual restart, from the state this move kept.

The time of a move (from the state's arrival at the client to the restore's answer) is
measured and fed back to the rule as the cost of the next ones.
"""

from __future__ import annotations

import functools
import pickle
import time
from concurrent.futures import Future
from typing import Any

from stealer.cluster.balance import Balancer, Candidate
from stealer.cluster.ledger import AgentRecord, NodeView, Task
from stealer.cluster.node import AgentOp

__all__ = ["AgentMoves"]

PLAN_EVERY_S = 0.1  # the client weighs a node's agents at most this often


class AgentMoves:
    """The moving of agents between live nodes (a mixin: ``self`` is the executor)."""

    _lock: Any
    _tids: Any
    _ledger: dict[int, Task]
    _agents: dict[int, AgentRecord]
    _nodes: dict[str, NodeView]
    _shutdown: bool
    _stats: Any
    _balancer: Balancer | None
    _moving: set[int]
    _plan_at = 0.0  # (the next time a plan may run)

    def _deliver(self, a: AgentRecord, tid: int, t: Task) -> NodeView | None:
        """An agent operation to its node's batch, or held while the agent moves (under
        the lock); the node if its batch is to go now (ClusterExecutor._enqueue)."""
        if a.moving is not None:
            t.node = None
            a.held.append(tid)
            return None
        return self._enqueue(a.node, tid, t)  # type: ignore[attr-defined]

    def _balance(self, node: NodeView) -> None:
        """A node's load report came (the results thread): moves, if the rule says so."""
        bal = self._balancer
        now = time.monotonic()
        if bal is None or self._shutdown or not bal.report(now, node.load):
            return
        if now < self._plan_at:  # (a plan walks the node's agents: not at every report)
            return
        self._plan_at = now + PLAN_EVERY_S
        full: set[NodeView | None] = set()
        with self._lock:
            if self._moving:  # one round of moves at a time: the next sees their effect
                return
            for aid, _src, dst in bal.plan(now, self._alive(),  # type: ignore[attr-defined]
                                           self._candidates):
                full.add(self._evict(self._agents[aid], self._nodes[dst]))
        full.discard(None)
        for n in full:
            self._send(n)  # type: ignore[attr-defined]

    def _candidates(self, node_id: str) -> list[Candidate]:
        """The agents of a node, as the rule weighs them (under the lock)."""
        out = []
        for a in self._agents.values():
            n = a.node
            if n is None or n.id != node_id or a.failed is not None or a.over or a.moving:
                continue
            recent, a.looked = a.seq - a.looked, a.seq
            keeps = a.every > 0 and not a.pinned
            out.append(Candidate(a.aid, recent, keeps,
                                 self._state_bytes(a) if keeps and recent else 0,
                                 a.result is not None))
        return out

    def _state_bytes(self, a: AgentRecord) -> int | None:
        """The pickled size of the state kept of ``a`` (None: it does not pickle), once
        per state kept."""
        if not a.has_state:
            return 0
        if a.sized[0] != a.state_seq:
            try:
                n: int | None = len(pickle.dumps(a.state, protocol=5))
            except Exception:
                n = None
                a.pinned = True
            a.sized = (a.state_seq, n)
        return a.sized[1]

    def _evict(self, a: AgentRecord, dst: NodeView) -> NodeView | None:
        """Start moving ``a`` to ``dst`` (under the lock): its evict op goes to its node;
        from now its operations wait at the client."""
        tid = next(self._tids)
        fut: Future = Future()
        t = Task(fut, (AgentOp("evict", a.aid, None), (), {}), a.node, a)
        self._ledger[tid] = t
        a.moving = (tid, dst, a.seq)
        self._moving.add(a.aid)
        fut.add_done_callback(functools.partial(self._evicted, a, tid))
        return self._enqueue(a.node, tid, t)  # type: ignore[attr-defined]

    def _evicted(self, a: AgentRecord, tid: int, fut: Future) -> None:
        """The evict op's answer (the results thread): restore on the new node, or stay."""
        arrived = time.monotonic()
        full: set[NodeView | None] = set()
        with self._lock:
            if a.moving is None or a.moving[0] != tid:
                return  # its node was lost meanwhile: the restart took the agent over
            _tid, dst, covers = a.moving
            a.moving = None
            self._moving.discard(a.aid)
            held, a.held = a.held, []
            exc = None if fut.cancelled() else fut.exception()
            if fut.cancelled() or exc is not None:  # it stays where it is
                if exc is not None:
                    a.pinned = True
                    self._stats.move_errors += 1
            else:
                state = fut.result()
                if a.every and covers > a.state_seq:  # the freshest checkpoint there is
                    a.state, a.has_state, a.state_seq = state, True, covers
                    a.log = [e for e in a.log if e[0] > covers]
                    if a.uid is not None:
                        self._journal_state(a, covers)  # type: ignore[attr-defined]
                if dst is None or not dst.alive or not dst.ready:
                    dst = self._place_agent()  # type: ignore[attr-defined]
                a.node = dst
                a.moves += 1
                self._stats.agent_moves += 1
                for kind, arg in (("spawn", a.spawn), ("set_state", state)):
                    f: Future = Future()
                    if kind == "set_state":
                        f.add_done_callback(functools.partial(self._restored, arrived))
                    t = Task(f, (AgentOp(kind, a.aid, arg), (), {}), dst, a)
                    self._ledger[new := next(self._tids)] = t
                    full.add(self._enqueue(dst, new, t))  # type: ignore[attr-defined]
            for h in held:
                t = self._ledger.get(h)
                if t is not None:
                    full.add(self._enqueue(a.node, h, t))  # type: ignore[attr-defined]
            if a.node is not None:
                full.add(a.node)  # sent now, not after batch_s: the agent waits for it
        full.discard(None)
        for n in full:
            self._send(n)  # type: ignore[attr-defined]

    def _restored(self, arrived: float, fut: Future) -> None:
        if self._balancer is not None and not fut.cancelled() and fut.exception() is None:
            self._balancer.moved(time.monotonic() - arrived)
            self._stats.move_s = self._balancer.move.s

    def _abort_move(self, a: AgentRecord) -> list[int]:
        """The agent's node was lost while it moved (under the lock): the move is off, and
        its held operations (never sent) join its unanswered ones for the restart."""
        held, a.held = a.held, []
        if a.moving is not None:
            a.moving = None
            self._moving.discard(a.aid)
        return held
