"""Agents moving between live nodes: the client's side (stealer/cluster/moves.py) against
fake nodes, in this process, no Ray cluster.

The cluster client is built as it is (its module imports Ray, so Ray must be installed),
with Ray's calls replaced by a stub: each node agent is a :class:`FakeNode` that records
the batches sent to it and runs them, when the test says, on counter agents of its own;
their results go back through the client's own results path (``_settle``), in the order
the test chooses.  So the orderings that are hard to provoke on a real cluster are made
on purpose: messages sent while the agent is in transit, its old node lost before the
state comes back, a state that cannot be taken.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

pytest.importorskip("ray", reason="Ray is not installed: pip install -e '.[test]'")

import stealer.cluster.client as cc
from stealer.cluster.balance import BalanceConfig
from stealer.cluster.ledger import NodeView
from stealer.cluster.node import AgentOp
from stealer.cluster.policy import Load


class Counter:
    """Stands for the agent class (the fake nodes run their own counters)."""


class _Method:
    def __init__(self, node: FakeNode, name: str) -> None:
        self.node, self.name = node, name

    def remote(self, *args):
        if self.name == "submit":
            self.node.inbox.append(list(args[0]))
        return object()


class FakeNode:
    """A node agent: batches in (``inbox``), run by :meth:`run`, results out."""

    def __init__(self, nid: str) -> None:
        self.id = nid
        self.inbox: list[list[tuple]] = []
        self.agents: dict[int, int] = {}  # aid -> its counter
        self.seen: list[tuple[str, int]] = []  # (kind, aid) of every operation it ran
        self.fail_state = False
        for name in ("submit", "results", "ping", "stop", "status", "view"):
            setattr(self, name, _Method(self, name))

    def run(self) -> list[tuple]:
        """Every batch received so far, in order: [(tid, ok, value)]."""
        out = []
        batches, self.inbox = self.inbox, []
        for batch in batches:
            for tid, op, _args, _kwargs, _hops in batch:
                assert isinstance(op, AgentOp)
                self.seen.append((op.kind, op.aid))
                out.append((tid, *self._op(op)))
        return out

    def _op(self, op: AgentOp) -> tuple[bool, object]:
        if op.kind == "spawn":
            self.agents[op.aid] = op.a[1][0]
            return True, None
        if op.aid not in self.agents:
            return False, (KeyError(op.aid), "")
        if op.kind in ("call", "send"):
            method, args, _kw = op.a
            assert method == "add"
            self.agents[op.aid] += args[0]
            return True, self.agents[op.aid]
        if op.kind in ("state", "evict"):
            if self.fail_state:
                return False, (TypeError("cannot pickle '_thread.lock' object"), "")
            state = {"n": self.agents[op.aid]}
            if op.kind == "evict":
                del self.agents[op.aid]
            return True, state
        if op.kind == "set_state":
            self.agents[op.aid] = op.a["n"]
            return True, None
        if op.kind == "stop":
            return True, None
        raise AssertionError(op.kind)


def fake_client(setattr_, names=("a", "b"), node=None, on_start=lambda ex: None,
                **kw) -> tuple[cc.ClusterExecutor, dict]:
    """A cluster client on fake nodes ``names`` (``node``: their class, FakeNode by
    default), Ray's calls stubbed out with ``setattr_`` (monkeypatch.setattr); ``kw``: the
    executor's options; ``on_start`` is called when it starts its node agents."""
    nodes = {n: (node or FakeNode)(n) for n in names}

    def start_nodes(self, wait):
        on_start(self)
        for nid, fake in nodes.items():
            if nid not in self._nodes:
                v = NodeView(nid, fake, 1)
                v.ready = True
                self._nodes[nid] = v

    def kill(*_a, **_k):
        raise RuntimeError("a fake node")

    stub = SimpleNamespace(wait=lambda refs, **k: (refs, []), kill=kill,
                           get=lambda *a, **k: [], is_initialized=lambda: False,
                           nodes=list)
    setattr_(cc, "ray", stub)
    setattr_(cc, "_connect", lambda cluster: False)
    setattr_(cc.ClusterExecutor, "_start_nodes", start_nodes)
    setattr_(cc.ClusterExecutor, "_collect", lambda self: None)
    setattr_(cc.ClusterExecutor, "_tend", lambda self: None)
    ex = cc.ClusterExecutor(True, executor_cls=object, top_s=None, seed=1, **kw)
    return ex, nodes


@pytest.fixture
def cluster(monkeypatch):
    """A cluster client on two fake nodes "a" and "b" (Ray's calls stubbed out)."""
    ex, nodes = fake_client(monkeypatch.setattr,
                            rebalance=BalanceConfig(reports=2, hold_s=0.0, default_move_s=1e-6))
    yield ex, nodes
    ex._shutdown = ex._closing = True
    ex._stop_nodes()


def flush(ex, *nodes: FakeNode) -> None:
    """Send every pending batch to its node (the flush thread's job)."""
    for f in nodes:
        ex._send(ex._nodes[f.id])


def deliver(ex, fake: FakeNode) -> None:
    """Run what ``fake`` received and bring its results back (the results thread)."""
    ex._settle(ex._nodes[fake.id], fake.run(), [])


def test_messages_sent_during_a_move_wait_and_follow_in_order(cluster):
    ex, (a, b) = cluster[0], cluster[1].values()
    ref = ex.spawn_agent(Counter, 0, node="a", state_every=4, name="c")
    first = [ref.call("add", 1) for _ in range(5)]
    flush(ex, a)
    with ex._lock:  # what the rule would start: a move to b
        ex._evict(ex._agents[ref.id], ex._nodes["b"])
    during = [ref.call("add", 1) for _ in range(3)]
    flush(ex, a, b)
    assert not b.inbox and sum(map(len, a.inbox)) == 1 + 5 + 1 + 1  # spawn, 5 adds,
    # the client's state call after the 4th, the evict: nothing of the held ones
    deliver(ex, a)  # the old node answers; its last answer is the evict's state
    rec = ex._agents[ref.id]
    assert (rec.state, rec.state_seq) == ({"n": 5}, 5)  # kept: it covers the 5 adds
    later = [ref.call("add", 1) for _ in range(2)]
    flush(ex, a, b)
    assert not a.inbox and ref.id not in a.agents
    # the new node: the agent, its state, then the held messages in their order (and the
    # client's state call after the 8th), then the later ones
    assert [k for k, _ in b.seen] == [] and [op[1].kind for op in b.inbox[0]] == [
        "spawn", "set_state", "call", "call", "call", "state"]
    deliver(ex, b)
    deliver(ex, b)
    assert [f.result(timeout=0) for f in first + during + later] == list(range(1, 11))
    assert ref.node == "b" and ex.agent("c").node == "b"
    assert a.seen.count(("call", ref.id)) == 5 and b.seen.count(("call", ref.id)) == 5
    st = ex.stats()
    assert st.agent_moves == 1 and st.move_errors == 0 and st.outstanding == 0
    assert (rec.state, rec.state_seq) == ({"n": 8}, 8)  # the next kept, from b


def test_the_old_node_lost_mid_move_restarts_the_agent_with_the_held_messages(cluster):
    ex, (a, b) = cluster[0], cluster[1].values()
    ref = ex.spawn_agent(Counter, 100, node="a", state_every=4)
    first = [ref.call("add", 1) for _ in range(6)]
    flush(ex, a)
    deliver(ex, a)  # answered, and the state after the 4th kept
    assert [f.result(timeout=0) for f in first] == list(range(101, 107))
    more = [ref.call("add", 1) for _ in range(2)]
    with ex._lock:
        ex._evict(ex._agents[ref.id], ex._nodes["b"])
    held = [ref.call("add", 1) for _ in range(3)]
    flush(ex, a)
    a.run()  # it ran them all, but its answers are lost with it
    ex._lost(ex._nodes["a"], "test")
    flush(ex, b)
    deliver(ex, b)
    # from the state after the 4th (104): the 5th and 6th again for their effect (their
    # replies had come), then the unanswered ones, held ones last, each to its caller
    assert [f.result(timeout=5) for f in more + held] == list(range(107, 112))
    assert ref.node == "b" and not ex._agents[ref.id].moving and not ex._moving
    assert ex.stats().replayed == 2 and ex.stats().agent_moves == 0
    assert [k for k, _ in b.seen].count("evict") == 0


def test_a_state_that_cannot_be_taken_keeps_the_agent_where_it_is(cluster):
    ex, (a, b) = cluster[0], cluster[1].values()
    ref = ex.spawn_agent(Counter, 0, node="a", state_every=50)
    first = [ref.call("add", 1) for _ in range(3)]
    with ex._lock:
        ex._evict(ex._agents[ref.id], ex._nodes["b"])
    held = [ref.call("add", 1) for _ in range(2)]
    a.fail_state = True
    flush(ex, a, b)
    deliver(ex, a)
    flush(ex, a, b)
    deliver(ex, a)
    assert [f.result(timeout=0) for f in first + held] == [1, 2, 3, 4, 5]
    assert ref.node == "a" and not b.seen
    rec = ex._agents[ref.id]
    assert rec.pinned and ex.stats().move_errors == 1
    assert ex._candidates("a")[0].keeps_state is False  # never again


def test_the_rule_moves_busy_agents_from_the_load_reports(cluster):
    """Reports of node a busy with 4 active agents on its worker and of b idle: the
    client starts two moves (half the gap), of movable agents only."""
    ex, (a, b) = cluster[0], cluster[1].values()
    refs = [ex.spawn_agent(Counter, 0, node="a", state_every=2 if k else 0)
            for k in range(4)]
    for r in refs:
        for _ in range(3):
            r.call("add", 1)
    flush(ex, a)
    deliver(ex, a)
    for _ in range(3):
        ex._nodes["a"].load = Load("a", 1, busy=1.0, active=4)
        ex._balance(ex._nodes["a"])
        ex._nodes["b"].load = Load("b", 1, busy=0.0)
        ex._balance(ex._nodes["b"])
        ex._plan_at = 0.0
        time.sleep(0.01)  # (the gain counts the imbalance's age)
    moving = sorted(ex._moving)
    assert len(moving) == 2 and refs[0].id not in moving  # state_every=0 stays
    flush(ex, a)
    deliver(ex, a)
    flush(ex, b)
    deliver(ex, b)
    assert sorted(r.id for r in refs if r.node == "b") == moving
    futs = [r.call("add", 1) for r in refs]
    flush(ex, a, b)
    deliver(ex, a)
    deliver(ex, b)
    assert [f.result(timeout=0) for f in futs] == [4, 4, 4, 4]
    assert ex.stats().agent_moves == 2 and not ex._moving
