"""The cluster client's records: one per task, per agent and per node, and the stats.

Plain data, no Ray: owned by the cluster executor (``stealer/cluster/client.py``), which
keeps a ledger of :class:`Task` by task id, and by its agents' side
(``stealer/cluster/agents.py``).
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from stealer.cluster.policy import Load

__all__ = ["AgentRecord", "ClusterStats", "NodeView", "Task"]


class Task:
    """One unfinished task (or agent operation) of the ledger: its future, its call, the
    node the client last knew it on."""

    __slots__ = ("agent", "at", "call", "fut", "hops", "losses", "node")

    def __init__(self, fut: Future, call: tuple, node: NodeView | None,
                 agent: AgentRecord | None = None) -> None:
        self.fut = fut
        self.call = call  # (fn, args, kwargs); an agent's operation: (AgentOp, (), {})
        self.node = node
        self.losses = 0
        self.hops = 0  # moves between nodes so far: a move report with fewer is stale
        self.agent = agent
        self.at = 0.0  # when its batch left for its node (the node's latency, at the client)


class AgentRecord:
    """The client's record of one agent: where it lives and how to start it again."""

    def __init__(self, aid: int, spawn: tuple, name: str | None, retries: int) -> None:
        self.aid = aid
        self.spawn = spawn  # (cls, args, init_kwargs, options)
        self.name = name
        self.retries = retries
        self.node: NodeView | None = None
        self.losses = 0
        self.result: Future | None = None  # the final value, once somebody asked
        self.failed: BaseException | None = None
        self.over = False  # stopped, or its final value came: never restarted
        # Its state kept by the client (stealer/cluster/agents.py): every ``every``
        # messages a STATE call; ``state`` the latest reply (None: none yet), ``log`` the
        # messages sent since the one it covers, [seq, tid, kind, arg] in their order
        # (a STATE call among them with the seq it covers), ``seq`` the last message's.
        self.every = 0
        self.state: Any = None
        self.has_state = False
        self.state_seq = 0  # the message the state kept covers
        self.log: list[list] = []
        self.seq = 0
        # Moving between live nodes (stealer/cluster/moves.py): ``moving`` while its state
        # is fetched and it is stopped on its node, (the evict op's task id, the node it
        # goes to, the message its state covers); its operations meanwhile wait in
        # ``held`` (task ids, in their order) and go to the new node after its restore.
        self.moving: tuple[int, NodeView | None, int] | None = None
        self.held: list[int] = []
        self.pinned = False  # a move failed (its state could not be taken): it stays
        self.looked = 0  # its seq when the client last looked for agents to move
        self.sized: tuple[int, int | None] = (-1, 0)  # (state_seq, the kept state's bytes)
        self.moves = 0
        # its durable id in the journal (Executor(cluster=..., journal=PATH),
        # stealer/cluster/journal.py): "<epoch>.<n>"; None without a journal
        self.uid: str | None = None


class NodeView:
    """The client's view of one node agent."""

    def __init__(self, node_id: str, handle: Any, workers: int) -> None:
        self.id = node_id
        self.handle = handle
        self.workers = workers
        self.load = Load(node_id, workers)
        self.sent = 0  # tasks sent since its last load report
        self.pending: list[tuple] = []  # (tid, fn, args, kwargs, hops) not sent yet
        self.pending_since = 0.0
        self.bseq = 0  # the last batch sent (the node runs them in this order, once each)
        self.in_flight = 0  # submit calls to it not answered yet (0: a task goes at once)
        self.ready = False
        self.alive = True
        self.backoff = 0.0
        self.peers_seen = -1  # the membership version whose peers it was sent
        self.acked = 0  # the last result batch processed (the node drops it and those before)
        self.heard = 0.0  # time.monotonic() of its last results() reply (a ping is skipped
        # while it answers polls: a reply says the same as a ping, and both cost CPU)
        self.lat: deque[float] = deque(maxlen=2048)  # seconds from batch out to result in


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
    replayed: int = 0  # answered agent messages run again after a restart (for their effect)
    state_errors: int = 0  # agents whose state could not be kept (it stopped being asked)
    agent_moves: int = 0  # agents moved between live nodes (stealer/cluster/moves.py)
    move_s: float = 0.0  # the measured time of a move (from its state in to its restore)
    move_errors: int = 0  # moves given up (the state could not be taken): the agent stayed
    recovered: int = 0  # live agents resumed from the journal (recover=True)
    withdrawn: int = 0  # tasks cancelled on their node before they started (Future.cancel)
