"""Journals on a cluster (stealer/cluster/journal.py): the client's side against fake
nodes, in this process, no Ray cluster (tests/test_cluster_journal_ray.py has the real one).

The cluster client is built as it is, Ray's calls stubbed out (as in
tests/test_cluster_moves.py, whose fake nodes these extend: counters that also stop and
give their final value).  A *crash* of the client is a child process running the same
client that dies by SIGKILL (``os._exit`` is not enough: it still runs no finaliser,
but a kill is what a crash is) with its journal open; a recovering client then starts on
fresh fake nodes, and what those nodes are sent shows what the recovery replays.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

pytest.importorskip("ray", reason="Ray is not installed: pip install -e '.[test]'")

from test_cluster_moves import Counter, FakeNode, deliver, fake_client, flush

import stealer.cluster.client as cc
from stealer.agents.journal import describe, open_for_client, plan
from stealer.errors import AgentStopped, JournalError

pytestmark = pytest.mark.timeout(60)


class Node(FakeNode):
    """A fake node agent whose counters also answer ``get``, stop, and give their final
    value (the counter) once stopped."""

    def __init__(self, nid: str) -> None:
        super().__init__(nid)
        self.stopped: set[int] = set()
        self.bad_state = False  # its agents' states do not pickle

    def _op(self, op):
        if op.kind == "stop":
            self.stopped.add(op.aid)
            return True, None
        if op.kind == "result":
            assert op.aid in self.stopped, "a result asked before the agent's stop"
            return True, self.agents[op.aid]
        if op.aid in self.stopped and op.kind in ("call", "send", "state"):
            return False, (AgentStopped(f"agent {op.aid} was stopped"), "")
        if op.kind == "state" and self.bad_state:
            return False, (TypeError("cannot pickle '_thread.lock' object"), "")
        if op.kind in ("call", "send") and op.a[0] == "get":
            return True, self.agents[op.aid]
        if op.kind in ("call", "send") and op.a[0] == "push":  # (not commutative)
            self.agents[op.aid] = 10 * self.agents[op.aid] + op.a[1][0]
            return True, self.agents[op.aid]
        return super()._op(op)


def client(setattr_, path: str, names=("a", "b"), on_start=lambda ex: None,
           **kw) -> tuple[cc.ClusterExecutor, dict]:
    """A cluster client with a journal at ``path`` on fake nodes ``names`` (``on_start``
    is called when it starts its node agents)."""
    return fake_client(setattr_, names, Node, on_start, rebalance=None, journal=path, **kw)


def run(ex, *nodes: Node, rounds: int = 3) -> None:
    """Send, run and answer everything (a few rounds: answers ask for more)."""
    for _ in range(rounds):
        flush(ex, *nodes)
        for n in nodes:
            deliver(ex, n)


def close(ex) -> None:
    ex._shutdown = ex._closing = True
    ex._stop_nodes()


@pytest.fixture
def make(monkeypatch, tmp_path):
    made = []

    def make_(path=None, **kw):
        ex, nodes = client(monkeypatch.setattr, str(path or tmp_path / "j"), **kw)
        made.append(ex)
        return ex, nodes

    yield make_
    for ex in made:
        close(ex)


def crashed_client(path, script: str) -> str:
    """Run ``script`` in a child process on a client with a journal at ``path`` (names in
    scope: ex, a, b, run, flush, deliver, Counter), and SIGKILL it at its end; its output."""
    r = subprocess.run([sys.executable, __file__, str(path), script], capture_output=True,
                       text=True, timeout=60, cwd=os.path.dirname(__file__))
    assert r.returncode == -signal.SIGKILL, r.stdout + r.stderr
    return r.stdout


def ops(node: Node, aid: int) -> list[tuple]:
    """What ``node`` was sent for agent ``aid``: (kind, argument) in order."""
    return [(op.kind, op.a if op.kind != "spawn" else op.a[1])
            for batch in node.inbox for _t, op, *_ in batch if op.aid == aid]


# -- the guarantees --------------------------------------------------------------------------

def test_a_crashed_clients_agents_resume_from_their_snapshots_each_message_once(make, tmp_path):
    # 3 agents, state kept every 4 messages; 10 adds each (calls and sends) of which the
    # nodes ran and answered the first 6 (the states after #4 were kept and journaled),
    # then 4 more logged that never reached a node: the client is killed there
    crashed_client(tmp_path / "j", """
refs = [ex.spawn_agent(Counter, 100 * i, node="ab"[i % 2], state_every=4, name=f"c{i}")
        for i in range(3)]
for k in range(6):
    for r in refs:
        (r.call if k % 2 else r.send)("add", 1)
run(ex, a, b)
for k in range(4):
    for r in refs:
        (r.call if k % 2 else r.send)("add", 1)
""")
    p = plan(str(tmp_path / "j"))
    assert sorted(x.name for x in p.agents.values() if x.live) == ["c0", "c1", "c2"]
    ex, nodes = make(recover=True)
    assert ex.stats().recovered == 3
    flush(ex, *nodes.values())
    sent = {}
    for name in ("c0", "c1", "c2"):
        a = ex._names[name]
        (fake,) = [n for n in nodes.values() if ops(n, a.aid)]
        sent[name] = ops(fake, a.aid)
    # each: its spawn, the state after its 4th add, then adds #5-#10 (two answered,
    # four never sent), in their order: nothing the snapshot covers runs again
    for i, name in enumerate(("c0", "c1", "c2")):
        assert sent[name] == [("spawn", (100 * i,)), ("set_state", {"n": 100 * i + 4})] + \
            [("send" if k % 2 == 0 else "call", ("add", (1,), {})) for k in range(4, 10)]
    run(ex, *nodes.values())
    got = [ex.agent(f"c{i}").call("get") for i in range(3)]
    run(ex, *nodes.values())
    assert [f.result(timeout=5) for f in got] == [100 * i + 10 for i in range(3)]
    assert ex.stats().replayed == 18


def test_senders_on_many_threads_are_replayed_in_the_order_the_node_ran_them(make, tmp_path):
    # 4 threads append digits to one agent's number (x -> 10 x + d: the order shows);
    # the node ran all 40 (a state kept after #16 and #32), then the client logs two more
    # and dies: the recovery must rebuild the very number the node had, then append 5, 6
    out = crashed_client(tmp_path / "j", """
import threading
r = ex.spawn_agent(Counter, 0, node="a", state_every=16, name="t")
def go(d):
    for _ in range(10):
        r.send("push", d)
ts = [threading.Thread(target=go, args=(d,)) for d in range(1, 5)]
[t.start() for t in ts]
[t.join() for t in ts]
run(ex, a, b)
print(a.agents[r.id], flush=True)
for d in (5, 6):
    r.send("push", d)
""")
    before = int(out.split()[-1])
    assert len(str(before)) == 40 and sorted(str(before)) == sorted("1234" * 10)
    ex, nodes = make(recover=True)
    flush(ex, *nodes.values())
    a = ex._names["t"]
    (fake,) = [n for n in nodes.values() if ops(n, a.aid)]
    assert [k for k, _ in ops(fake, a.aid)] == ["spawn", "set_state"] + ["send"] * 10
    run(ex, *nodes.values())
    f = ex.agent("t").call("get")
    run(ex, *nodes.values())
    assert f.result(timeout=5) == before * 100 + 56


def test_two_crashes_in_a_row_and_a_node_loss_between_apply_each_message_once(make, tmp_path):
    path = tmp_path / "j"
    crashed_client(path, """
r = ex.spawn_agent(Counter, 0, node="a", state_every=3, name="w")
for _ in range(7):
    r.call("add", 1)
run(ex, a, b)          # states after #3 and #6 kept
ex._lost(ex._nodes["a"], "test")  # restarted on b from #6, #7 replayed from memory
run(ex, a, b)
for _ in range(2):
    r.send("add", 10)  # #8, #9: logged, the client dies before they are sent
""")
    # the second client: recovers (from #6: replays #7-#9), adds #10-#11, answered, then
    # #12 logged and never sent; it dies too
    script = """
assert ex.stats().recovered == 1
r = ex.agent("w")
fs = [r.call("add", 100) for _ in range(2)]
run(ex, a, b)
assert [f.result(timeout=5) for f in fs] == [127, 227], [f.result(timeout=5) for f in fs]
r.send("add", 1000)
"""
    r = subprocess.run([sys.executable, __file__, str(path), script, "recover"],
                       capture_output=True, text=True, timeout=60,
                       cwd=os.path.dirname(__file__))
    assert r.returncode == -signal.SIGKILL, r.stdout + r.stderr
    ex, nodes = make(recover=True)
    run(ex, *nodes.values())
    f = ex.agent("w").call("get")
    run(ex, *nodes.values())
    assert f.result(timeout=5) == 7 + 20 + 200 + 1000


def test_the_state_a_move_takes_is_the_snapshot_a_recovery_starts_from(make, tmp_path):
    crashed_client(tmp_path / "j", """
r = ex.spawn_agent(Counter, 0, node="a", state_every=50, name="m")
for _ in range(3):
    r.call("add", 1)
with ex._lock:
    ex._evict(ex._agents[r.id], ex._nodes["b"])
r.call("add", 1)   # held while it moves, then run on b
run(ex, a, b)
assert r.node == "b" and ex.stats().agent_moves == 1
r.send("add", 5)   # logged, never sent
""")
    ex, nodes = make(recover=True)
    flush(ex, *nodes.values())
    a = ex._names["m"]
    (fake,) = [n for n in nodes.values() if ops(n, a.aid)]
    assert ops(fake, a.aid) == [("spawn", (0,)), ("set_state", {"n": 3}),
                                ("call", ("add", (1,), {})), ("send", ("add", (5,), {}))]
    run(ex, *nodes.values())
    f = ex.agent("m").call("get")
    run(ex, *nodes.values())
    assert f.result(timeout=5) == 9


def test_shutdown_keeps_every_agents_state_so_recovery_replays_nothing(make, tmp_path):
    ex, nodes = make()
    refs = [ex.spawn_agent(Counter, i, state_every=50, name=f"s{i}") for i in range(4)]
    for r in refs:
        for _ in range(3):
            r.send("add", 2)
    run(ex, *nodes.values())
    ex._suspend()  # (shutdown's first step; the fake nodes answer by hand)
    run(ex, *nodes.values())
    close(ex)
    ex, nodes = make(recover=True)
    flush(ex, *nodes.values())
    for r in refs:
        a = ex._names[r.name]
        (fake,) = [n for n in nodes.values() if ops(n, a.aid)]
        assert ops(fake, a.aid) == [("spawn", (a.spawn[1][0],)),
                                    ("set_state", {"n": a.spawn[1][0] + 6})]
    assert ex.stats().replayed == 0


def test_a_stopped_agent_stays_finished_with_its_final_value(make, tmp_path):
    ex, nodes = make()
    r = ex.spawn_agent(Counter, 5, name="done", state_every=8)
    r.call("add", 2)
    r.stop()
    run(ex, *nodes.values())
    assert r.result(timeout=5) == 7
    close(ex)
    ex, nodes = make(recover=True)
    assert ex.agent("done").result(timeout=0) == 7
    flush(ex, *nodes.values())
    assert ex.stats().recovered == 0 and not any(n.inbox for n in nodes.values())
    with pytest.raises(ValueError, match="agent named 'done'"):
        ex.spawn_agent(Counter, 0, name="done")
    with pytest.raises(AgentStopped, match="had finished before this recovery"):
        ex.agent("done").call("add", 1).result(timeout=0)
    assert "done" in describe(str(tmp_path / "j"))  # stealer journal PATH reads it too


def test_a_spawn_that_fails_leaves_nothing_in_the_journal(make, tmp_path):
    ex, _ = make()
    with pytest.raises(Exception, match="no node executor"):
        ex.spawn_agent(Counter, 0, node="nowhere", name="ghost")
    close(ex)
    assert not plan(str(tmp_path / "j")).agents


def test_a_stop_logged_before_the_crash_ends_the_agent_in_the_recovery(make, tmp_path):
    crashed_client(tmp_path / "j", """
r = ex.spawn_agent(Counter, 1, name="late", state_every=8)
r.call("add", 1)
run(ex, a, b)
r.stop()   # logged; the client dies before it is sent (or its final value comes)
""")
    ex, nodes = make(recover=True)
    run(ex, *nodes.values())
    assert ex.agent("late").result(timeout=5) == 2
    close(ex)
    assert plan(str(tmp_path / "j")).agents[ex._names["late"].uid].end is not None


def test_an_agent_whose_state_does_not_pickle_fails_with_a_journal_error(make):
    ex, nodes = make()
    r = ex.spawn_agent(Counter, 0, node="a", state_every=2, name="lock")
    nodes["a"].bad_state = True
    first = [r.call("add", 1) for _ in range(2)]
    run(ex, *nodes.values())
    assert [f.result(timeout=5) for f in first] == [1, 2]
    with pytest.raises(JournalError, match=r"'lock'.*must pickle"):
        r.call("add", 1).result(timeout=5)
    assert ("stop", r.id) in nodes["a"].seen
    close(ex)
    p = plan(ex._journal.path)
    assert p.agents[ex._names["lock"].uid].end[0] == 1  # over, with the error


# -- who may open it ---------------------------------------------------------------------

def test_a_journal_held_by_a_live_client_is_refused(make, tmp_path):
    ex, _ = make()
    ex.spawn_agent(Counter, 0)
    with pytest.raises(JournalError, match="held by another live executor"):
        make()


def test_live_agents_need_recover_true(make, tmp_path):
    crashed_client(tmp_path / "j", "ex.spawn_agent(Counter, 0)")
    with pytest.raises(JournalError, match=r"1 live agents.*recover=True"):
        make()


def test_a_journal_whose_agents_do_not_load_starts_no_node(make, tmp_path):
    mod = tmp_path / "mod"
    mod.mkdir()
    (mod / "gone_module.py").write_text("class Local:\n    pass\n")
    crashed_client(tmp_path / "j", f"""
sys.path.insert(0, {str(mod)!r})
import gone_module
ex.spawn_agent(gone_module.Local, name="x")
""")
    starts = []
    with pytest.raises(JournalError, match=r"cannot be recovered here.*gone_module"):
        make(recover=True, on_start=starts.append)
    assert not starts  # no node agent was started


def test_misuse_is_refused(make, tmp_path):
    ex, _ = make()
    with pytest.raises(ValueError, match="state_every=0 is refused with a journal"):
        ex.spawn_agent(Counter, 0, state_every=0)
    with pytest.raises(ValueError, match="recover=True needs the journal"):
        cc.ClusterExecutor(True, executor_cls=object, recover=True)


def test_the_local_and_the_cluster_journals_do_not_open_each_other(tmp_path):
    local = tmp_path / "local"
    cj, _ = open_for_client(str(local), "none", 1, False)
    cj.close()
    with pytest.raises(JournalError, match="written by a local executor"):
        open_for_client(str(local), "none", 1, False, kind="cluster")
    cluster = tmp_path / "cluster"
    cj, _ = open_for_client(str(cluster), "none", 1, False, kind="cluster")
    cj.close()
    with pytest.raises(JournalError, match=r"written by a cluster executor.*cluster=\.\.\."):
        open_for_client(str(cluster), "none", 1, False)


if __name__ == "__main__":  # a client that is killed at the end of its script
    path, script = sys.argv[1], sys.argv[2]
    ex, nodes = client(setattr, path, recover=len(sys.argv) > 3)
    a, b = nodes["a"], nodes["b"]
    exec(script)
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)
