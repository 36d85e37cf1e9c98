"""Journals on a real Ray cluster (``ray.cluster_utils.Cluster`` on this machine, two nodes
of 1 CPU): journaled agents survive the loss of their node and then of their client.

A client in a child process (its driver on the head node) spawns agents on both nodes with a journal; the test removes
the second node under it (its agents start again on the head from the states the client
kept); the child goes on, then sends more and is SIGKILLed.  A client in this process
recovers the journal on the head alone: every agent answers with the state of every
message applied once, and after a clean shutdown a second recovery replays nothing.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install -e '.[test]'")

from ray.cluster_utils import Cluster  # noqa: E402
from test_cluster_ray import HEALTH, TESTS, node_env  # noqa: E402

import stealer  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180),
              pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::ResourceWarning"),
              pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")]

AGENTS = 6

CHILD = """
import json, os, signal, sys
import ray, stealer, cluster_tasks as ct
address, path = sys.argv[1], sys.argv[2]
ray.init(address=address, include_dashboard=False, log_to_driver=False)
print("connected", flush=True)
assert sys.stdin.readline().strip() == "added"   # the second node joined
ex = stealer.Executor(cluster=True, journal=path, seed=5, top_s=None)
nodes = sorted(ex.nodes)
refs = [ex.spawn_agent(ct.Counter, 1000 * i, name=f"a{i}", state_every=4,
                       node=nodes[i % 2]) for i in range(N_AGENTS)]
got1 = [[f.result(timeout=60) for f in ex.call_all(refs, "add", [(1,)] * len(refs))]
        for _ in range(6)]
print(json.dumps({"nodes": [r.node for r in refs]}), flush=True)
assert sys.stdin.readline().strip() == "go"   # the test removed the second node
got2 = [[f.result(timeout=90) for f in ex.call_all(refs, "add", [(10,)] * len(refs))]
        for _ in range(5)]
for r in refs:
    r.send("add", 100)   # logged; some may not reach a node before the kill
print(json.dumps({"got1": got1, "got2": got2, "after": [r.node for r in refs],
                  "losses": len(ex.stats().losses)}), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.fixture(scope="module")
def cluster():
    """The head node alone: the second joins once the child client is connected (a driver
    is connected to one node's raylet, and dies with it: the child must be on the head)."""
    c = Cluster(initialize_head=True, connect=True, head_node_args={
        "num_cpus": 1, "include_dashboard": False, "_system_config": HEALTH,
        "env_vars": node_env("0")})
    try:
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


def test_agents_survive_their_node_and_their_client(cluster, tmp_path):
    path = str(tmp_path / "journal")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (TESTS, os.environ.get("PYTHONPATH")) if p))
    child = subprocess.Popen([sys.executable, "-c", CHILD.replace("N_AGENTS", str(AGENTS)), cluster.address,
                              path], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, env=env)
    try:
        assert child.stdout.readline().strip() == "connected"
        cluster.add_node(num_cpus=1, env_vars=node_env("1"))
        cluster.wait_for_nodes()
        child.stdin.write("added\n")
        child.stdin.flush()
        first = json.loads(child.stdout.readline() or "{}")
        assert "nodes" in first, "the child client did not start"
        head = ray.get_runtime_context().get_node_id()
        (other,) = [n for n in set(first["nodes"]) if n != head]
        cluster.remove_node(next(n for n in cluster.worker_nodes if n.node_id == other))
        child.stdin.write("go\n")
        child.stdin.flush()
        second = json.loads(child.stdout.readline() or "{}")
        assert child.wait(60) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
    # in the child: each reply once and in order, through the node loss
    assert second["got1"] == [[1000 * i + k for i in range(AGENTS)] for k in range(1, 7)]
    assert second["got2"] == [[1000 * i + 6 + 10 * k for i in range(AGENTS)]
                              for k in range(1, 6)]
    assert second["losses"] == 1 and set(second["after"]) == {head}
    # the child is dead: its node agent goes with it (Ray kills a dead driver's actors),
    # so a new client gets the head's CPU within START_S
    t0 = time.monotonic()
    ex = stealer.Executor(cluster=True, journal=path, recover=True, top_s=None)
    try:
        start_s = time.monotonic() - t0
        assert ex.nodes == [head] and ex.stats().recovered == AGENTS
        want = [1000 * i + 6 + 50 + 100 for i in range(AGENTS)]
        got = [ex.agent(f"a{i}").call("get") for i in range(AGENTS)]
        assert [f.result(timeout=60) for f in got] == want
        replayed = ex.stats().replayed
    finally:
        ex.shutdown()  # (the agents' states are kept: the next recovery replays nothing)
    ex = stealer.Executor(cluster=True, journal=path, recover=True, top_s=None)
    try:
        got = [ex.agent(f"a{i}").call("add", 1) for i in range(AGENTS)]
        assert [f.result(timeout=60) for f in got] == [w + 1 for w in want]
        assert ex.stats().replayed == 0 and ex.stats().recovered == AGENTS
        r = ex.agent("a0")
        r.stop()
        assert r.result(timeout=60) == want[0] + 1
    finally:
        ex.shutdown()
    print(f"\nrecovery: new client ready {start_s:.2f} s after the old one's death, "
          f"{replayed} messages replayed")
    ex = stealer.Executor(cluster=True, journal=path, recover=True, top_s=None)
    try:  # the stopped one stays finished
        assert ex.agent("a0").result(timeout=0) == want[0] + 1
        assert ex.stats().recovered == AGENTS - 1
    finally:
        ex.shutdown()


def test_a_ref_kept_in_an_agents_state_finds_its_agent_after_a_recovery(cluster, tmp_path):
    """A ref is its executor's agent id; another executor recovering the journal gives its
    agents other ids: a ref from before (kept in an agent's state) reaches its agent by
    its journal id, and never an agent that has that id now."""
    import cluster_tasks as ct

    path = str(tmp_path / "journal")
    ex = stealer.Executor(cluster=True, journal=path, top_s=None)
    try:
        # (spawned second: b's id here is another agent's id in the recovering executor,
        # which numbers its agents afresh; checked below)
        others = [ex.spawn_agent(ct.Counter, 0, name="o0")]
        b = ex.spawn_agent(ct.Counter, 5, name="b")
        others += [ex.spawn_agent(ct.Counter, 0, name=f"o{i}") for i in (1, 2)]
        a = ex.spawn_agent(ct.Hop, name="a")
        old_b = b.id
        a.call("link", b).result(timeout=60)
        a.call("tell", "add", 1).result(timeout=60)
        deadline = time.monotonic() + 60
        while b.call("get").result(timeout=60) != 6:
            assert time.monotonic() < deadline, "the send never arrived"
            time.sleep(0.05)
        assert [o.call("get").result(timeout=60) for o in others] == [0, 0, 0]
    finally:
        ex.shutdown()
    ex = stealer.Executor(cluster=True, journal=path, recover=True, top_s=None)
    try:
        assert old_b != ex.agent("b").id
        assert old_b in {ex.agent(f"o{i}").id for i in range(3)}  # (what the test is about)
        ex.agent("a").call("tell", "add", 2).result(timeout=60)  # through the kept ref
        deadline = time.monotonic() + 60
        while ex.agent("b").call("get").result(timeout=60) != 8:
            assert time.monotonic() < deadline, "the send never reached b"
            time.sleep(0.05)
        assert [ex.agent(f"o{i}").call("get").result(timeout=60) for i in range(3)] == [0] * 3
        held = ex.agent("a").call("held").result(timeout=60)
        assert held == ex.agent("b")  # loaded in the driver: this executor's ref of b
    finally:
        ex.shutdown()
