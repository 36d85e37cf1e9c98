"""The path of a cluster agent ref used inside a task or an agent (stealer/cluster/asks.py),
without Ray: the node agent's AskServer with a fake node agent behind it, the workers' end
(``_ask``, RemoteAgentRef), and how a pickled ref is loaded back."""

from __future__ import annotations

import pickle
import threading

import pytest

from stealer.cluster import asks
from stealer.cluster.agents import AgentsOnCluster
from stealer.cluster.ledger import AgentRecord, NodeView
from stealer.errors import AgentDeadlock, ClusterError, NotInTaskError


class FakeNode:
    """What NodeAgent does with an ask: keeps it; ``reply`` answers a call."""

    def __init__(self) -> None:
        self.got: list[tuple[int, str, tuple]] = []
        self.who: list[int | None] = []
        self.server: asks.AskServer | None = None
        self.came = threading.Event()

    def ask(self, key: int, op: str, payload: bytes, who: int | None) -> None:
        self.got.append((key, op, pickle.loads(payload)))
        self.who.append(who)
        self.came.set()


@pytest.fixture
def node(tmp_path, monkeypatch):
    fake = FakeNode()
    fake.server = asks.AskServer(str(tmp_path), fake.ask)
    for k, v in fake.server.env().items():
        monkeypatch.setenv(k, v)
    yield fake
    fake.server.close()
    asks._drop()  # (this thread's connection to it, if any)


def test_a_send_and_a_stop_reach_the_node_agent_in_order(node):
    ref = asks.RemoteAgentRef(7, "seven", "tok", "u7")
    ref.send("add", 1, k=2)
    ref.send("add", 3)
    ref.stop()
    assert [(op, p) for _k, op, p in node.got] == [
        ("send", (7, "send", "add", (1,), {"k": 2}, "tok", "u7")),
        ("send", (7, "send", "add", (3,), {}, "tok", "u7")),
        ("stop", (7, "stop", None, (), {}, "tok", "u7"))]
    with pytest.raises(ValueError, match="public method"):
        ref.send("_private")
    assert len(node.got) == 3  # refused before anything was sent


def test_a_call_waits_for_its_answer_and_raises_its_error(node):
    out: list = []

    def call(x: int) -> None:
        try:
            out.append(asks._ask("call", asks.dumps((1, "call", "m", (x,), {}, "t", None))))
        except BaseException as exc:  # the answer's error, raised at the caller
            out.append(exc)

    t = threading.Thread(target=call, args=(5,))
    t.start()
    assert node.came.wait(10)
    key = node.got[0][0]
    node.server.answer(key, True, asks.dumps(50))
    t.join(10)
    node.came.clear()
    t = threading.Thread(target=call, args=(6,))
    t.start()
    assert node.came.wait(10)
    node.server.answer(node.got[1][0], False, asks.dumps(KeyError("no such thing")))
    t.join(10)
    assert out[0] == 50 and isinstance(out[1], KeyError)
    node.server.answer(12345, True, asks.dumps(None))  # a caller gone: dropped


def test_a_waiting_call_fails_when_the_node_agent_stops(node):
    out: list = []
    t = threading.Thread(target=lambda: out.append(_raised(
        lambda: asks._ask("call", asks.dumps((1, "call", "m", (), {}, "t", None))))))
    t.start()
    assert node.came.wait(10)
    node.server.close()
    t.join(10)
    assert isinstance(out[0], ClusterError) and "stopped" in str(out[0])
    with pytest.raises(ClusterError, match="node agent is gone"):
        asks.RemoteAgentRef(1, None, "t").send("m")  # nobody listens any more


def test_outside_a_node_a_ref_says_where_to_use_it(monkeypatch):
    monkeypatch.delenv(asks.ENV_PATH, raising=False)
    with pytest.raises(ClusterError, match="outside the nodes"):
        asks.RemoteAgentRef(1, None, "t").send("m")
    with pytest.raises(NotInTaskError, match="in a task or an agent of its executor"):
        asks.RemoteAgentRef(1, None, "t").call("m")  # (not from a process of no node)
    with pytest.raises(ClusterError, match="driver"):
        asks.RemoteAgentRef(1, None, "t").result()


def test_a_pickled_ref_loads_as_its_executors_own_ref_or_by_its_journal_id():
    class FakeEx:
        def __init__(self, agents: dict[int, str], uids: dict[str, str]) -> None:
            self.agents, self.uids = agents, uids

        def _ref_of(self, aid: int) -> str | None:
            return self.agents.get(aid)

        def _ref_of_uid(self, uid: str) -> str | None:
            return self.uids.get(uid)

    old = asks.RemoteAgentRef(3, "b", "old-token", "u-b")
    data = pickle.dumps(old)
    assert isinstance(pickle.loads(data), asks.RemoteAgentRef)  # no executor here
    live = FakeEx({3: "the agent with id 3 now"}, {"u-b": "b, recovered"})
    asks.register("new-token", live)
    try:  # another executor's ref: by its journal id, never by the id
        assert pickle.loads(data) == "b, recovered"
        asks.register("old-token", live)
        assert pickle.loads(data) == "the agent with id 3 now"  # its own executor
    finally:
        asks.unregister("new-token")
        asks.unregister("old-token")
    back = pickle.loads(data)
    assert back == old and hash(back) == hash(old) and back.id == 3 and back.name == "b"


def _raised(fn):
    try:
        return fn()
    except BaseException as exc:
        return exc


def test_a_call_names_the_agent_that_waits_for_it(node):
    """The waiting agent's handle rides with the call to the node agent (which sends the
    client's id of it): the client's cycle check needs to know who waits."""
    t = threading.Thread(target=lambda: asks._ask(
        "call", asks.dumps((1, "call", "m", (), {}, "t", None)), 0x5))
    t.start()
    assert node.came.wait(10)
    asks._ask("send", asks.dumps((1, "send", "m", (), {}, "t", None)))
    assert node.who == [0x5, None]
    node.server.answer(node.got[0][0], True, asks.dumps(None))
    t.join(10)


class Graph(AgentsOnCluster):
    """The cycle check of AgentsOnCluster alone (its lock and graph), without a cluster."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._waiting_for: dict[int, dict[int, int]] = {}

    def wait(self, caller: int, a: AgentRecord, method: str) -> tuple[int, int]:
        return self._wait_edge(caller, a, method)

    def done(self, edge: tuple[int, int]) -> None:  # what _answer does first
        self._answer(NodeView("n", None, 1), 0, None, None, edge)

    def _tell(self, node, items) -> None:  # (_answer's reply: not under test here)
        pass


def _rec(aid: int) -> AgentRecord:
    return AgentRecord(aid, (), None, 0)


def test_the_cluster_cycle_check_refuses_the_call_that_closes_a_cycle_and_no_other():
    g = Graph()
    e01 = g.wait(0, _rec(1), "m")
    e12 = g.wait(1, _rec(2), "m")
    with pytest.raises(AgentDeadlock, match=r"agent 2 called agent 0 \('m'\).*2 -> 0 -> 1 -> 2"):
        g.wait(2, _rec(0), "m")  # 0 waits for 1, which waits for 2: 2 -> 0 closes it
    with pytest.raises(AgentDeadlock, match="is the caller itself"):
        g.wait(3, _rec(3), "m")
    e23 = g.wait(2, _rec(3), "m")  # a chain, no cycle
    with pytest.raises(AgentDeadlock):
        g.wait(2, _rec(1), "m")  # 1 waits for 2
    assert g._waiting_for == {0: {1: 1}, 1: {2: 1}, 2: {3: 1}}  # (refused: not added)
    g.done(e12)  # 2 answered 1, which waits no more: now 2 may call it
    e21 = g.wait(2, _rec(1), "m")
    g.done(e21)
    g.done(e23)
    e01b = g.wait(0, _rec(1), "m")  # two calls of 0 to 1 at once (a call_all)
    g.done(e01)
    with pytest.raises(AgentDeadlock):
        g.wait(1, _rec(0), "m")  # 0 still waits for 1 (its second call)
    g.done(e01b)
    assert g._waiting_for == {}


def test_a_thread_keeps_its_connection_and_an_interrupted_exchange_opens_a_new_one(node):
    """Each worker thread keeps one connection to its node agent (a new one per operation
    cost ~0.7 ms); an exception in the middle of an exchange (a signal's, here a
    KeyboardInterrupt in recv) may leave its reply unread, so that connection is dropped
    and the next operation opens another.  Closing the server wakes the threads serving
    idle connections (shut down: a close() would leave them in recv())."""
    ref = asks.RemoteAgentRef(1, None, "t")
    ref.send("a")
    conn = asks._local.held[2]
    ref.send("b")
    assert asks._local.held[2] is conn  # the same connection
    real = conn.recv

    def interrupted() -> object:
        real()  # (the answer arrives, then the signal's exception)
        raise KeyboardInterrupt

    conn.recv = interrupted
    with pytest.raises(KeyboardInterrupt):
        ref.send("c")
    assert asks._local.held is None and conn.closed
    ref.send("d")  # a new connection, in step: its own answer, not c's
    assert asks._local.held[2] is not conn
    assert [p[2] for _k, _op, p in node.got] == ["a", "b", "c", "d"]
    serving = [t for t in threading.enumerate() if t.name == "stealer-asks"]
    assert serving  # (the new connection's thread, idle in recv())
    node.server.close()
    for t in serving:
        t.join(10)
        assert not t.is_alive(), "a serving thread stayed in recv() after close()"
    with pytest.raises(ClusterError, match="node agent is gone"):
        ref.send("e")
    asks._drop()
