"""The cluster executor on a real Ray cluster: ``ray.cluster_utils.Cluster`` on this machine.

Two nodes of 1 CPU each, dashboard off, fast health checks, disjoint cores (node k's
``STEALER_NODE_CPUS`` is ``k``, set in its raylet's environment and so in its node agent's
and its workers').  The driver connects to the head node before the second node is added,
so removing the second node never removes the driver's own raylet.  The tests run in file
order; the node-loss test removes a node, adds a new one and checks that it joins.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import os
import pickle
import sys
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install -e '.[test]' "
                          "(the test extra includes stealer[ray])")

import cluster_tasks as ct  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

import stealer  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240),
              pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::ResourceWarning"),
              pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")]

HEALTH = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 200,
          "health_check_failure_threshold": 3, "health_check_timeout_ms": 200}
TESTS = str(Path(__file__).resolve().parent)


def node_env(cpus: str) -> dict[str, str]:
    path = os.pathsep.join(p for p in (TESTS, os.environ.get("PYTHONPATH")) if p)
    return {"STEALER_NODE_CPUS": cpus, "PYTHONPATH": path}


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(initialize_head=True, connect=True, head_node_args={
        "num_cpus": 1, "include_dashboard": False, "_system_config": HEALTH,
        "env_vars": node_env("0")})
    try:
        c.add_node(num_cpus=1, env_vars=node_env("1"))
        c.wait_for_nodes()
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


_shared: dict[str, object] = {}


@pytest.fixture(scope="module")
def shared(cluster):
    try:
        yield _shared
    finally:
        if "ex" in _shared:
            _shared.pop("ex").shutdown()


@pytest.fixture
def ex(shared):
    """The executor most tests share (node agents take all of a node's CPUs: one cluster
    executor at a time)."""
    if "ex" not in shared:
        shared["ex"] = stealer.Executor(cluster=True, seed=1)
        note_segments(shared["ex"])
    return shared["ex"]


@pytest.fixture
def own(shared):
    """For a test that makes its own executor: the shared one shuts down first."""
    if "ex" in shared:
        shared.pop("ex").shutdown()


#: Segments the node executors of this module made (other processes on this machine have
#: their own: only these are checked for leaks).
MADE: set[str] = set()


def segments() -> set[str]:
    return set(os.listdir("/dev/shm")) & MADE


def note_segments(e) -> set[str]:
    names = {ray.get(e.node_handle(n).status.remote(), timeout=30)["segment"]
             for n in e.nodes}
    MADE.update(names)
    return names


def test_misuse_is_refused_with_what_to_do():
    # (first in the file: Ray is not initialised yet, the cluster fixture has not run)
    assert not ray.is_initialized()
    with pytest.raises(stealer.ClusterError, match=r"ray\.init\(\)"):
        stealer.Executor(cluster=True)
    with pytest.raises(ValueError, match="journal"):  # (journals: test_cluster_journal*)
        stealer.Executor(cluster=True, recover=True)
    with pytest.raises(stealer.ClusterError, match="Ray address"):
        stealer.Executor(cluster=42)
    with pytest.raises(TypeError, match="positional"):
        stealer.Executor(1, None, cluster=True)
    with stealer.Executor(1) as local:  # without cluster=: the local executor, as before
        assert type(local) is stealer.Executor and local.submit(ct.square, 3).result() == 9
    assert not ray.is_initialized()


def test_one_node_executor_per_node_on_disjoint_cores(ex):
    assert len(ex.nodes) == 2
    st = ex.stats()
    assert {n["workers"] for n in st.nodes.values()} == {1}
    pids = {n["pid"] for n in st.nodes.values()}
    assert len(pids) == 2 and os.getpid() not in pids
    got = [f.result(timeout=60) for f in [ex.submit(ct.where, i) for i in range(400)]]
    assert [x for _, _, x in got] == list(range(400))
    by_node = {(tag, tuple(cpus)) for tag, cpus, _ in got}
    assert by_node == {("0", (0,)), ("1", (1,))}  # both nodes, each pinned to its own core


def test_workers_get_their_own_thread_limits(ex):
    # Ray sets OMP_NUM_THREADS from num_cpus in the node agent; the workers reset it to 1
    env = ex.submit(ct.threads_env).result(timeout=30)
    assert env == {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
                   "MKL_NUM_THREADS": "1"}


def test_segments_do_not_collide_on_one_dev_shm(ex):
    names = note_segments(ex)
    assert len(names) == 2 and names <= set(os.listdir("/dev/shm"))


def test_futures_work_with_wait_and_as_completed(ex):
    fs = [ex.submit(ct.square, i) for i in range(1000)]
    done, not_done = cf.wait(fs, timeout=60)
    assert not not_done and sorted(f.result() for f in done) == [i * i for i in range(1000)]
    fs = [ex.submit(ct.spin, 0.001, i) for i in range(50)]
    assert sorted(f.result()[1] for f in cf.as_completed(fs, timeout=60)) == list(range(50))
    assert list(ex.map(ct.square, range(300))) == [i * i for i in range(300)]
    assert list(ex.map(ct.square, range(300), chunksize=16)) == [i * i for i in range(300)]
    assert list(ex.map(lambda a, b: a - b, range(5), range(5, 10))) == [-5] * 5  # by value
    counter = ex.spawn_agent(ct.Counter, 0)

    async def gathered():  # awaitable in asyncio code, as on one machine
        return await asyncio.gather(ex.submit(ct.square, 7), counter.call("add", 3))

    assert asyncio.run(gathered()) == [49, 3]
    counter.stop()
    counter.result(timeout=30)


def test_errors_come_back_with_the_remote_traceback(ex):
    f = ex.submit(ct.fail, "boom")
    with pytest.raises(ValueError, match="boom") as info:
        f.result(timeout=30)
    assert "fail" in str(info.value.__cause__)  # the worker's traceback text
    assert isinstance(f.exception(), ValueError)


def test_an_unpicklable_task_fails_alone(ex):
    import threading

    lock = threading.Lock()
    bad = ex.submit(ct.square, lock)
    good = [ex.submit(ct.square, i) for i in range(10)]
    with pytest.raises(stealer.SerializationError, match="could not be sent"):
        bad.result(timeout=30)
    assert [f.result(timeout=30) for f in good] == [i * i for i in range(10)]


def test_fork_join_runs_inside_the_nodes(ex):
    fs = [ex.submit(ct.fib, 18) for _ in range(4)]
    assert [f.result(timeout=60) for f in fs] == [ct.fib_seq(18)] * 4


def test_object_ref_arguments_are_fetched_on_the_node(ex):
    """As a Ray task's: an ObjectRef argument (top level, positional or keyword) reaches
    the task as its value; one that cannot be had fails its task alone, with Ray's error;
    one not ready holds back only its own task, and cancel() withdraws it (it was handed
    to the task as the ref itself)."""
    import numpy as np

    a = np.arange(1000.0)
    ref = ray.put(a)
    fs = [ex.submit_to(n, ct.total, ref, extra=ray.put(1.0)) for n in ex.nodes]
    assert [f.result(timeout=60) for f in fs] == [a.sum() + 1.0] * 2
    assert list(ex.map(ct.total, [ref] * 3)) == [a.sum()] * 3
    with pytest.raises(Exception, match="no value here"):
        ex.submit(ct.total, ct.no_value.remote()).result(timeout=60)
    never = ct.needs_a_cpu.remote()
    stuck = ex.submit(ct.total, never)
    assert [f.result(timeout=60) for f in [ex.submit(ct.square, i) for i in range(20)]] \
        == [i * i for i in range(20)]
    assert stuck.running() and not stuck.done()
    assert stuck.cancel() and stuck.cancelled()
    ray.cancel(never)


def test_a_fork_join_tree_started_on_one_node_is_shared_with_the_other(ex):
    # the idle node leaves a lifeline; the busy one's shallow spawns are exported, one is
    # shipped, runs there (forking there) and its result resumes its parent here
    first = ex.nodes[0]
    value, ran = ex.submit_to(first, ct.fib_where, 28).result(timeout=60)
    assert value == ct.fib_seq(28)
    kids = {n: s["children"] for n, s in ex.stats().nodes.items()}
    # (the module failed in 5 of 39 runs on the 2-core VM, 2026-12-05, all in the first
    # 19, and in 1 of 19 on the code before that day; cause not found: the counters say
    # whether the other node got no child, or its results came after the parent's node
    # had run those children itself)
    assert ran == ("0", "1"), f"the other node ran none of the tree's leaves: {kids}"
    assert kids[first]["returned"] > 0 and kids[first]["waiting"] == 0


def test_a_small_tree_s_children_stay_on_its_node(ex):
    # children move only once they waited two of the measured round trips of a moved
    # child: a tree of a few ms is claimed back by its own worker before then (with
    # child_age_rtts=0 nearly every such tree sent a child to the idle node's lifeline)
    first = ex.nodes[0]
    home = ex.submit_to(first, ct.where).result(timeout=60)[0]
    shipped0 = ex.stats().nodes[first]["children"]["shipped"]
    away = []
    for _ in range(10):
        value, ran = ex.submit_to(first, ct.fib_where, 17).result(timeout=60)
        assert value == ct.fib_seq(17)
        away.append(ran != (home,))
    shipped = ex.stats().nodes[first]["children"]["shipped"] - shipped0
    # (a stall of the shared VM longer than the age may still move one)
    assert sum(away) <= 2 and shipped <= 2, f"{sum(away)} trees ran away, {shipped} shipped"


def test_a_skew_submitted_to_one_node_is_stolen_by_the_other(ex):
    first = ex.nodes[0]
    fs = [ex.submit_to(first, ct.spin, 0.01, i) for i in range(120)]  # 1.2 s on one core
    got = [f.result(timeout=60) for f in fs]
    assert [x for _, x in got] == list(range(120))
    ran = {t for t, _ in got}
    assert len(ran) == 2, "the idle node never stole from the loaded one"
    st = ex.stats()
    assert st.moved > 0
    assert sum(s["steals"]["got"] + s["steals"]["pushed"] for s in st.nodes.values()) > 0


def test_a_bad_checkpoint_interval_is_refused(ex):
    with pytest.raises(ValueError, match="state_every"):
        ex.spawn_agent(ct.Counter, state_every=-1)


def test_agents_live_on_both_nodes_and_answer_through_them(ex):
    refs = [ex.spawn_agent(ct.Counter, 10 * i, name=f"c{i}") for i in range(8)]
    assert {r.call("where").result(timeout=60) for r in refs} == {"0", "1"}
    assert [r.call("add", 1).result(timeout=30) for r in refs] == [10 * i + 1
                                                                   for i in range(8)]
    for r in refs:
        r.send("add", 5)
    assert [r.call("get").result(timeout=30) for r in refs] == [10 * i + 6 for i in range(8)]
    assert ex.agent("c3").call("get").result(timeout=30) == 36
    assert sorted(ex.agents()) == [f"c{i}" for i in range(8)]
    with pytest.raises(stealer.AgentNotFound):
        ex.agent("nobody")
    futs = ex.call_all(refs, "add", [(100,)] * 8)
    assert [f.result(timeout=30) for f in futs] == [10 * i + 106 for i in range(8)]
    with pytest.raises(AttributeError):
        refs[0].call("no_such_handler").result(timeout=30)
    for r in refs:
        r.stop()
    assert [r.result(timeout=30) for r in refs] == [10 * i + 106 for i in range(8)]


def test_agents_call_agents_on_other_nodes_through_refs_they_were_given(ex):
    """A ref sent into an agent or a task reaches its agent wherever it lives: a call from a
    generator handler resumes it with the reply; sends from handlers and tasks arrive."""
    hops = [ex.spawn_agent(ct.Hop, node=ex.nodes[i % 2]) for i in range(4)]
    counter = ex.spawn_agent(ct.Counter, 0, node=ex.nodes[1])
    for i, h in enumerate(hops):
        h.call("link", hops[(i + 1) % 4]).result(timeout=30)
    path = hops[0].call("hop", 3).result(timeout=60)
    assert len(path) == 4 and set(path) == {"0", "1"}, path  # (agents may move later)
    assert hops[0].call("held").result(timeout=30) == hops[1]  # back as the driver's ref
    with pytest.raises(stealer.AgentDeadlock, match="form a cycle"):  # 0 -> 1 -> 2 -> 3 -> 0
        hops[0].call("hop", 4).result(timeout=60)  # refused at the client: no hang
    with pytest.raises(stealer.AgentDeadlock, match="form a cycle"):
        hops[0].call("ahop", 5).result(timeout=60)  # the same from coroutines
    fanned = hops[0].call("fan", hops[1:]).result(timeout=60)  # stealer.call_all, yielded
    assert len(fanned) == 3 and all(len(p) == 1 for p in fanned), fanned
    path = hops[0].call("ahop", 3).result(timeout=60)  # async def handlers, awaiting
    assert len(path) == 4 and set(path) == {"0", "1"}, path
    fanned = hops[0].call("afan", hops[1:]).result(timeout=60)  # awaited call_all
    assert len(fanned) == 3 and all(len(p) == 1 for p in fanned), fanned
    with pytest.raises(AttributeError, match="no_such_handler"):
        hops[1].call("broken").result(timeout=30)  # the callee's error, at the caller
    hops[0].call("link", counter).result(timeout=30)
    hops[0].call("tell", "add", 5).result(timeout=30)  # a send from a handler
    assert ex.submit(ct.send_to, counter, "add", 7).result(timeout=30) == "sent"  # a task's
    deadline = time.monotonic() + 30
    while counter.call("get").result(timeout=30) != 12:
        assert time.monotonic() < deadline, "the sends never arrived"
        time.sleep(0.05)
    for r in (*hops, counter):
        r.stop()
        r.result(timeout=30)


def test_tasks_call_agents_on_both_nodes_and_wait_for_the_replies(ex):
    """Ray's ray.get(actor.f.remote()) in a task: a task on either node calls agents on
    both (its own node's too, while its worker waits) and gets every reply once."""
    refs = [ex.spawn_agent(ct.Counter, 100 * i, node=ex.nodes[i % 2]) for i in range(4)]
    futs = [ex.submit_to(ex.nodes[i % 2], ct.adds_from_task, refs, 3) for i in range(2)]
    got = [f.result(timeout=60) for f in futs]
    for i in range(4):  # agent i's replies, from both tasks: each of 6 adds seen once
        mine = sorted(v for g in got for v in g[3 * i:3 * i + 3])
        assert mine == [100 * i + k for k in range(1, 7)], (i, got)
    replies, last = ex.submit_to(ex.nodes[1], ct.adds_from_generator, refs).result(timeout=60)
    assert replies == [100 * i + 7 for i in range(4)] and last == 7
    err = ex.submit(ct.error_from_task, refs[1]).result(timeout=60)
    assert err.startswith("AttributeError") and "no_such_handler" in err, err
    for r in refs:
        r.stop()
    assert [r.result(timeout=30) for r in refs] == [100 * i + 7 for i in range(4)]


DRIVER_ONLY = """
import stealer

class Echo(stealer.Agent):
    def echo(self, x):
        return x

def double(x):
    return 2 * x
"""


def test_code_the_nodes_cannot_import_fails_its_futures_not_the_nodes(ex, tmp_path,
                                                                       monkeypatch):
    """A function and an agent class of a module only the driver can import (on no
    node's path): their futures fail with what to do; the tasks batched with them run,
    and the nodes live on (this once made every node "lost", then hung the executor)."""
    (tmp_path / "driver_only_mod.py").write_text(DRIVER_ONLY)
    monkeypatch.syspath_prepend(str(tmp_path))
    import driver_only_mod as m

    before = [ex.submit(abs, -i) for i in range(40)]
    bad = ex.submit(m.double, 21)
    after = [ex.submit(abs, -i) for i in range(40)]
    with pytest.raises(stealer.SerializationError, match="importable on every node"):
        bad.result(timeout=60)
    assert [f.result(timeout=60) for f in before + after] == list(range(40)) * 2
    ref = ex.spawn_agent(m.Echo)
    with pytest.raises(stealer.SerializationError, match="No module named"):
        ref.call("echo", 1).result(timeout=60)
    assert ex.submit(abs, -3).result(timeout=60) == 3
    assert len(ex.nodes) == 2
    monkeypatch.delitem(sys.modules, "driver_only_mod")


BY_VALUE = """
import os
import stealer


class Oops(Exception):
    pass


def seq(n):
    return n if n < 2 else seq(n - 1) + seq(n - 2)


def fib_where(n):
    if n < 14:
        return seq(n), (os.environ.get("STEALER_NODE_CPUS", "?"),)
    (x, wx), (y, wy) = yield [stealer.spawn(fib_where, n - 1), stealer.spawn(fib_where, n - 2)]
    return x + y, tuple(sorted(set(wx) | set(wy)))


def fails_at(n, bad):
    if n == bad:
        raise Oops(f"leaf {n}")
    if n < 14:
        return seq(n)
    x, y = yield [stealer.spawn(fails_at, n - 1, bad), stealer.spawn(fails_at, n - 2, bad)]
    return x + y
"""


def test_a_tree_written_in_the_client_s_script_is_shared_between_the_nodes(
        ex, tmp_path, monkeypatch):
    """Code of the client's ``__main__`` (a user's script or notebook) reaches the nodes
    by value (cloudpickle), here a module registered so, as the error of the test above
    tells a user to do.  Its tree's spawns are exported
    and may run on the other node, and an exception of its own class comes back as itself
    (stdlib pickle cannot write such code again on a node: no child was ever exported,
    and the exception came back as a RemoteError)."""
    from ray import cloudpickle  # (Ray's own copy: it writes the batches)

    (tmp_path / "by_value_mod.py").write_text(BY_VALUE)
    monkeypatch.syspath_prepend(str(tmp_path))
    import by_value_mod as m

    cloudpickle.register_pickle_by_value(m)
    try:
        first = ex.nodes[0]

        def exported():  # (a child shipped early exports its own spawns on the other node)
            return sum(s["children"]["exported"] for s in ex.stats().nodes.values())

        before = exported()
        trees = []
        for _ in range(3):  # (the other node may be slow to ask on a busy machine)
            value, ran = ex.submit_to(first, m.fib_where, 28).result(timeout=60)
            assert value == ct.fib_seq(28)
            trees.append(ran)
            if len(ran) == 2:
                break
        assert exported() - before >= 14 * len(trees)  # each tree's spawns of depth 1-3
        kids = {n[:8]: s["children"] for n, s in ex.stats().nodes.items()}
        assert len(trees[-1]) == 2, f"the other node ran none of the trees: {trees}, {kids}"
        with pytest.raises(m.Oops, match="leaf 14"):
            ex.submit_to(first, m.fails_at, 24, 14).result(timeout=60)
        with pytest.raises(m.Oops, match="leaf 7"):
            ex.submit(m.fails_at, 7, 7).result(timeout=60)
    finally:
        cloudpickle.unregister_pickle_by_value(m)
        monkeypatch.delitem(sys.modules, "by_value_mod")


def test_ray_s_cloudpickle_and_the_package_name_a_class_by_value_alike():
    """What lets a class of the client's script cross two nodes and stay itself: in the
    client and the node agents, both copies of cloudpickle give a class written by value
    one id (without it, each its own: the exception above came back as a copy)."""
    import cloudpickle
    from ray import cloudpickle as rays

    from stealer.cluster.node import share_class_trackers

    share_class_trackers()
    cls = type("Made", (Exception,), {"__module__": "__main__"})
    ids = (rays.cloudpickle._get_or_create_tracker_id(cls),
           cloudpickle.cloudpickle._get_or_create_tracker_id(cls))
    assert ids[0] == ids[1]
    assert pickle.loads(cloudpickle.dumps(cls)) is pickle.loads(rays.dumps(cls)) is cls


def test_a_class_the_package_named_before_keeps_its_id(monkeypatch):
    # (a local executor in the same process may have sent it by value already)
    import threading
    import weakref

    import cloudpickle

    from stealer.cluster.node import share_class_trackers

    mine = cloudpickle.cloudpickle
    for name, fresh in (("_DYNAMIC_CLASS_TRACKER_BY_CLASS", weakref.WeakKeyDictionary()),
                        ("_DYNAMIC_CLASS_TRACKER_BY_ID", weakref.WeakValueDictionary()),
                        ("_DYNAMIC_CLASS_TRACKER_LOCK", threading.Lock())):
        monkeypatch.setattr(mine, name, fresh)  # (as before any sharing)
    cls = type("Before", (), {"__module__": "__main__"})
    cid = mine._get_or_create_tracker_id(cls)
    share_class_trackers()
    from ray import cloudpickle as rays

    assert rays.cloudpickle._get_or_create_tracker_id(cls) == cid


def test_a_batch_a_node_cannot_load_is_probed_task_by_task(ex, tmp_path, monkeypatch):
    """One batch of three tasks, the middle one of a module no node can import: the
    batch fails on the node, each task goes again alone (a probe; the first probe meets
    a transient ActorUnavailableError and goes again); the good two run, the bad one
    fails with what to do, and the node's later batches still run."""
    from ray.exceptions import ActorUnavailableError

    import stealer.cluster.client as cc

    (tmp_path / "driver_only_mod2.py").write_text(DRIVER_ONLY)
    monkeypatch.syspath_prepend(str(tmp_path))
    import driver_only_mod2 as m

    node = ex._nodes[ex.nodes[0]]
    real_get = cc.ray.get
    probes: set = set()
    hit: list = []

    class Waits(dict):  # notes the probes' refs as the client registers them
        def __setitem__(self, ref, v):
            if v[0] == "probe":
                probes.add(ref)
            super().__setitem__(ref, v)

    def flaky_get(ref, *a, **k):
        if ref in probes and not hit:
            hit.append(ref)
            raise ActorUnavailableError("injected by the test", None)
        return real_get(ref, *a, **k)

    with ex._lock:
        ex._waits = Waits(ex._waits)
        node.in_flight += 1  # as if a submit call were out: the three wait in one batch
    monkeypatch.setattr(cc.ray, "get", flaky_get)
    monkeypatch.setattr(ex, "_batch_s", 30.0)  # (no timer sends a part of the three)
    try:
        fs = [ex.submit_to(node.id, abs, -5), ex.submit_to(node.id, m.double, 21),
              ex.submit_to(node.id, abs, -7)]
        with ex._lock:
            node.in_flight -= 1
        ex._send(node)
        with pytest.raises(stealer.SerializationError, match="importable on every node"):
            fs[1].result(timeout=60)
        assert [fs[0].result(timeout=60), fs[2].result(timeout=60)] == [5, 7]
        # (the node ran the probe whose reply the test dropped: its task's result may come
        # before the probe is sent again, after a 50 ms backoff; seen once in CI)
        deadline = time.monotonic() + 10
        while len(probes) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        monkeypatch.setattr(cc.ray, "get", real_get)
        monkeypatch.setattr(ex, "_batch_s", 0.002)
        with ex._lock:
            ex._waits = dict(ex._waits)
    assert len(probes) >= 4 and len(hit) == 1  # three probes, the first one sent twice
    assert ex.submit_to(node.id, abs, -3).result(timeout=60) == 3
    monkeypatch.delitem(sys.modules, "driver_only_mod2")


def test_stealer_top_renders_a_running_cluster_executor(ex, capsys):
    """The client publishes its figures (owner-only, under ex.id in /dev/shm) about four
    times a second; `stealer top` lists it with the local executors and renders one row
    per node."""
    from stealer import top

    assert [f.result(timeout=60) for f in [ex.submit(ct.square, i) for i in range(300)]] \
        == [i * i for i in range(300)]
    path = os.path.join("/dev/shm", ex.id)
    st = os.stat(path)
    assert st.st_mode & 0o777 == 0o600 and st.st_uid == os.getuid()
    (mine,) = [e for e in top.list_executors() if e["id"] == ex.id]
    assert mine["kind"] == "cluster" and mine["workers"] == 2
    assert mine["client_pid"] == os.getpid()
    deadline = time.monotonic() + 10
    while True:  # (the nodes' counts ride on their next result batch, then a snapshot)
        capsys.readouterr()
        assert top.main([ex.id, "--once"]) == 0
        out = capsys.readouterr().out
        rows = {line.split()[0]: line.split() for line in out.splitlines()
                if line[:12] in {n[:12] for n in ex.nodes}}
        done = sum(int(r[5].replace(",", "")) for r in rows.values())
        if done >= 300 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert f"stealer top - {ex.id} (cluster)" in out and "nodes 2 alive of 2" in out
    assert len(rows) == 2 and all(r[1] == "1" and r[2] != "lost" for r in rows.values()), out
    assert done >= 300, out
    assert ex.stats().nodes[ex.nodes[0]]["latency_ms"]["n"] > 0


def test_a_transient_unavailable_node_is_retried_not_lost(ex, monkeypatch):
    """ActorUnavailableError (a node agent unreachable for a while) only retries the call:
    no loss, no re-run elsewhere, every result once."""
    from ray.exceptions import ActorUnavailableError

    import stealer.cluster.client as cc

    real_get = cc.ray.get
    hits = []

    def flaky_get(ref, *a, **k):
        if ref in ex._waits_seen and ref not in hits:
            hits.append(ref)
            raise ActorUnavailableError("injected by the test", None)
        return real_get(ref, *a, **k)

    before = ex.stats()
    ex._waits_seen = set()
    deadline = time.monotonic() + 10
    while len(ex._waits_seen) < 2 and time.monotonic() < deadline:  # one poll per node
        with ex._lock:  # (a node's next poll goes out just after its last one came back)
            ex._waits_seen = {r for r, (k, _n, _e) in ex._waits.items() if k == "results"}
    monkeypatch.setattr(cc.ray, "get", flaky_get)
    try:
        fs = [ex.submit(ct.square, i) for i in range(500)]
        deadline = time.monotonic() + 30
        while len(hits) < len(ex._waits_seen) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [f.result(timeout=60) for f in fs] == [i * i for i in range(500)]
    finally:
        monkeypatch.undo()
        del ex._waits_seen
    st = ex.stats()
    assert len(hits) == 2  # the one outstanding poll of each node failed once
    assert st.transient - before.transient == 2
    assert st.losses == before.losses and len(ex.nodes) == 2
    assert st.resubmitted == before.resubmitted


def test_a_lone_task_and_a_burst_s_tail_do_not_wait_for_the_batch_timer(cluster, own):
    """A task goes to its node at once when no submit call to that node is out, and what
    came while one was out goes when its answer comes: with a batch timer of an hour,
    neither a lone task nor the last partial batch of a burst waits for it (they did
    before: the results below then time out, no clock is read)."""
    e = stealer.Executor(cluster=True, seed=1, batch_s=3600.0)
    try:
        node = e.nodes[0]
        for k in range(3):  # lone tasks, one at a time
            assert e.submit_to(node, ct.square, k).result(timeout=60) == k * k
        fs = [e.submit(ct.square, i) for i in range(1000)]  # (256 a batch: a partial tail)
        assert [f.result(timeout=60) for f in fs] == [i * i for i in range(1000)]
    finally:
        e.shutdown(cancel_futures=True)


def test_submit_after_shutdown_is_refused(cluster, own):
    e = stealer.Executor(cluster=True)
    assert e.submit(ct.square, 3).result(timeout=30) == 9
    e.shutdown()
    with pytest.raises(stealer.ExecutorShutdownError):
        e.submit(ct.square, 3)
    with pytest.raises(RuntimeError):  # it is also the stdlib's error type
        e.submit(ct.square, 3)


def test_tasks_a_node_holds_are_cancelled_there_and_never_run(cluster, own, tmp_path):
    """A task's future is running at the client once its batch has left; cancel() then
    withdraws it from its node if no worker took it yet (it was refused: a task queued
    there always ran), and a map that ends early withdraws what is left, one call per
    node (the stdlib's map cancels future by future)."""
    log = str(tmp_path / "ran")
    e = stealer.Executor(cluster=True, steal=None)  # (no stealing: the tasks stay put)
    try:
        first = e.nodes[0]
        fs = [e.submit_to(first, ct.mark, log, i, 0.05) for i in range(30)]  # 1.5 s
        assert fs[0].result(timeout=60) == 0
        last = fs[-10:]
        assert all(f.running() for f in last)  # (sent: the stdlib's cancel would refuse)
        assert [f.cancel() for f in last] == [True] * 10
        assert all(f.cancelled() for f in last)
        with pytest.raises(cf.CancelledError):
            last[0].result()
        assert [f.result(timeout=60) for f in fs[:20]] == list(range(20))
        assert not fs[0].cancel()  # done
        assert sorted(ct.marked(log)) == list(range(20))
        assert e.stats().withdrawn == 10

        # the node's WITHDRAWN outcomes may reach the client before its answer to cancel():
        # the same futures, cancelled once, and nothing left waiting for an outcome
        import stealer.cluster.client as cc

        real_get = cc.ray.get

        def late_answer(ref, *a, **k):
            out = real_get(ref, *a, **k)
            if isinstance(out, list) and all(isinstance(x, int) for x in out):  # cancel's
                deadline = time.monotonic() + 10
                while any(t in e._ledger for t in out) and time.monotonic() < deadline:
                    time.sleep(0.01)
            return out

        more = [e.submit_to(first, ct.mark, log, i, 0.2) for i in range(100, 110)]  # 2 s
        assert more[0].result(timeout=60) == 100
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(cc.ray, "get", late_answer)
            assert [f.cancel() for f in more[-3:]] == [True] * 3
        assert [f.result(timeout=60) for f in more[:7]] == list(range(100, 107))
        assert all(f.cancelled() for f in more[-3:])
        assert not e._gone and e.stats().withdrawn == 13

        log2 = str(tmp_path / "ran2")
        it = e.map(ct.mark, [log2] * 40, range(40), [0.05] * 40, timeout=0.4)
        with pytest.raises(TimeoutError):
            list(it)
        withdrawn = e.stats().withdrawn - 13
        assert withdrawn > 0
    finally:
        e.shutdown()
    ran = ct.marked(log2)
    assert len(ran) == len(set(ran)) and len(ran) + withdrawn == 40


def test_ctrl_c_in_the_with_block_withdraws_what_the_nodes_hold(cluster, own, tmp_path):
    log = str(tmp_path / "ran")
    fs = []
    with pytest.raises(KeyboardInterrupt), stealer.Executor(cluster=True) as e:
        fs += [e.submit(ct.mark, log, i, 0.05) for i in range(60)]  # ~1.5 s on two
        fs[0].result(timeout=60)
        raise KeyboardInterrupt
    assert all(f.done() for f in fs)
    kept = sorted(f.result() for f in fs if not f.cancelled())
    assert len(kept) < 60 and sorted(ct.marked(log)) == kept


def test_each_node_knows_the_others_as_soon_as_the_executor_is_up(cluster, own):
    """The set of nodes reaches every node agent when it changes, not with that node's
    next long poll for results (up to 0.5 s later: until then it could neither steal from
    nor send children to a peer it did not know).  Each node knows the other while its
    first long poll is still out (``polls`` 1: the executor, idle, has nothing to report
    for 0.5 s); the node that became ready first learned it only from its second poll."""
    e = stealer.Executor(cluster=True)
    try:
        deadline = time.monotonic() + 5
        while True:
            st = {n: ray.get(e.node_handle(n).status.remote(), timeout=30) for n in e.nodes}
            if (all(len(s["peers"]) == len(e.nodes) - 1 for s in st.values())
                    or time.monotonic() > deadline):
                break
            time.sleep(0.005)
        assert len(e.nodes) == 2
        assert all(s["peers"] == sorted(set(e.nodes) - {n}) for n, s in st.items()), st
        # (0: its first poll, sent after the view at its ready, had not reached it yet:
        # seen once in ~40 runs of this file)
        assert all(s["polls"] <= 1 for s in st.values()), {n: s["polls"] for n, s in st.items()}
    finally:
        e.shutdown()


def test_without_stealing_the_skew_stays_on_its_node(cluster, own):
    e = stealer.Executor(cluster=True, steal=None)
    try:
        first = e.nodes[0]
        got = [f.result(timeout=60)
               for f in [e.submit_to(first, ct.spin, 0.002, i) for i in range(60)]]
        assert len({t for t, _ in got}) == 1
        assert e.stats().moved == 0
    finally:
        e.shutdown()


def test_a_node_whose_workers_are_busy_gets_no_fork_join_children(cluster, own):
    """A node whose one worker runs a long task asks ahead of running dry (its tasks were
    measured short), but it says it has no worker free: the fork-join children pending on
    the other node are not shipped to it, where they would wait behind that task (and
    their parent with them); the tree runs where it started."""
    e = stealer.Executor(cluster=True, seed=1, rebalance=None)
    try:
        a, b = e.nodes
        cpu = {n: e.submit_to(n, ct.where).result(timeout=60)[0] for n in (a, b)}
        # short tasks on both: a node with one task in flight then counts as running low
        [f.result(timeout=60) for f in [e.submit_to(n, ct.spin, 0.001, i)
                                        for n in (a, b) for i in range(40)]]
        long = e.submit_to(a, ct.spin, 3.0)
        time.sleep(0.2)
        value, ran = e.submit_to(b, ct.fib_where, 24).result(timeout=60)
        # (an order, not a time: a tree that waited on a child parked on the busy node
        # could only end after that node's 3 s task)
        assert not long.done(), "the tree ended after the busy node's task"
        assert value == ct.fib_seq(24)
        assert ran == (cpu[b],), f"the tree's leaves ran on {ran}; {a[:12]} was busy"
        assert e.stats().nodes[b]["children"]["shipped"] == 0
        # children that reach it anyway (a lifeline or a steal request older than its
        # work) go back at once, as many as it has no worker free for; once free it takes them
        ha, hb = e.node_handle(a), e.node_handle(b)
        kid = [(("test", 1), pickle.dumps((ct.square, (7,), {})))]

        def imported() -> int:
            return ray.get(ha.status.remote(), timeout=30)["children"]["imported"]

        before = imported()
        assert not long.done(), "the long task ended too soon for this check"  # (again)
        ray.get(ha.take_children.remote(kid, b, hb), timeout=30)
        assert imported() == before, "a node with no worker free took a child"
        assert long.result(timeout=60)[0] == cpu[a]
        ray.get(ha.take_children.remote(kid, b, hb), timeout=30)
        assert imported() == before + 1
    finally:
        e.shutdown()


def test_a_node_runs_the_clients_batches_in_their_order_and_each_once(cluster, own):
    """Ray keeps no order between one caller's calls to an async actor (seen on this
    machine: 4 batches early in 12 runs of 2,400 agent calls, and before the numbering an
    agent's messages of two rounds handled swapped), so the client numbers its batches
    and the node agent runs them in that order: one that comes early waits for its turn;
    one sent again (its reply lost) runs once."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from stealer.cluster.node import AgentOp, NodeAgent

    nid = ray.get_runtime_context().get_node_id()
    agent = NodeAgent.options(num_cpus=1, scheduling_strategy=NodeAffinitySchedulingStrategy(
        nid, soft=False)).remote(nid, stealer.Executor, 1, {}, 30.0, 0.005, None, 0)
    try:
        ray.get(agent.ping.remote(), timeout=60)

        def add(tid: int) -> tuple:
            return (tid, AgentOp("call", 7, ("add", (1,), {})), (), {}, 0)

        spawn = (1, AgentOp("spawn", 7, (ct.Counter, (0,), {}, {})), (), {}, 0)
        ray.get(agent.submit.remote([add(3)], 2), timeout=30)  # early: waits for #1
        ray.get(agent.submit.remote([spawn, add(2)], 1), timeout=30)
        ray.get(agent.submit.remote([spawn, add(2)], 1), timeout=30)  # again: runs once
        ray.get(agent.submit.remote([add(4)], 3), timeout=30)
        got: dict[int, object] = {}
        deadline = time.monotonic() + 30
        while len(got) < 4 and time.monotonic() < deadline:
            batches, _load = ray.get(agent.results.remote(0, 1.0, 0.0, None, None),
                                     timeout=30)
            got.update({tid: v for _seq, out, _moved, _asks in batches for tid, _ok, v in out})
        assert got == {1: None, 2: 1, 3: 2, 4: 3}
        st = ray.get(agent.status.remote(), timeout=30)
        assert st["reordered"] == 1 and st["agents"] == 1
    finally:
        ray.get(agent.stop.remote(), timeout=60)
        ray.kill(agent)


def test_a_node_cut_off_from_its_client_fences_itself(cluster, own):
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from stealer.cluster.node import NodeAgent

    nid = ray.get_runtime_context().get_node_id()
    agent = NodeAgent.options(num_cpus=1, scheduling_strategy=NodeAffinitySchedulingStrategy(
        nid, soft=False)).remote(nid, stealer.Executor, 1, {}, 1.0, 0.005, None, 0)
    try:
        st = ray.get(agent.ping.remote(), timeout=60)
        assert st.workers == 1
        pids = ray.get(agent.status.remote(), timeout=30)["worker_pids"]
        assert pids
        ray.get(agent.submit.remote([(0, ct.spin, (30.0,), {}, 0)]), timeout=30)
        deadline = time.monotonic() + 20  # no results(), no ping(): silence from the client
        while time.monotonic() < deadline:
            time.sleep(0.5)
            if all(not os.path.exists(f"/proc/{p}") for p in pids):
                break
        s = ray.get(agent.status.remote(), timeout=30)
        assert s["fenced"] and s["queued"] == 0
        assert all(not os.path.exists(f"/proc/{p}") for p in pids), "workers still run"
        with pytest.raises(ray.exceptions.RayTaskError, match="NodeFencedError"):
            ray.get(agent.submit.remote([(1, ct.square, (2,), {}, 0)]), timeout=30)
    finally:
        ray.kill(agent)


def test_busy_agents_move_to_an_idle_node_and_answer_in_order(cluster, own):
    """Eight counter agents all started on one node, each kept busy (calls of 2 ms, up to
    8 outstanding each), the other node idle: after the imbalance lasts, some move there
    by checkpoint + restore while calls keep coming.  Every reply is right and in order for
    each agent (its counter counts up by one: none missing, none twice), the final states
    are exact, the agents that keep no state (state_every=0) never move, and ex.agent(name)
    finds the moved ones."""
    e = stealer.Executor(cluster=True, seed=5)
    note_segments(e)
    try:
        first = e.nodes[0]
        every = [8] * 6 + [0] * 2
        refs = [e.spawn_agent(ct.Counter, 1000 * i, node=first, state_every=k, name=f"m{i}")
                for i, k in enumerate(every)]
        assert {r.node for r in refs} == {first}
        futs: list[list] = [[] for _ in refs]
        seen: list[list[int]] = [[] for _ in refs]  # replies in the order they came
        rounds, after = 0, None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            for i, r in enumerate(refs):
                f = r.call("spin_add", 1, 0.002)
                f.add_done_callback(lambda f, i=i: seen[i].append(f.result()))
                futs[i].append(f)
            rounds += 1
            if rounds > 8:  # at most 8 calls outstanding per agent
                for fs in futs:
                    fs[rounds - 9].result(timeout=60)
            if after is None and any(r.node != first for r in refs):
                after = rounds
            if after is not None and rounds >= after + 40:
                break
        assert after is not None, "no agent moved off the busy node"
        moved = [i for i, r in enumerate(refs) if r.node != first]
        assert 0 < len(moved) < len(refs)
        assert not set(moved) & {6, 7}  # state_every=0: no state kept, never moved
        for i, fs in enumerate(futs):
            got = [f.result(timeout=60) for f in fs]
            assert got == list(range(1000 * i + 1, 1000 * i + 1 + rounds)), i
            assert seen[i] == got, i  # and they came back in that order
        for i in moved:
            assert e.agent(f"m{i}").node == refs[i].node != first
            assert e.agent(f"m{i}").call("get").result(timeout=30) == 1000 * i + rounds
        # the node's count comes from its load reports (every 0.5 s), and one more agent may
        # have moved since `moved` was taken: wait (bounded) until a report agrees with the refs
        end = time.monotonic() + 15
        while True:
            st = e.stats()
            here = sum(1 for r in refs if r.node == first)
            if st.nodes[first]["agents"] == here or time.monotonic() > end:
                break
            time.sleep(0.1)
        assert st.agent_moves >= len(moved) and st.move_errors == 0
        assert st.resubmitted == 0 and st.replayed == 0 and not st.losses
        assert st.nodes[first]["agents"] == here, st.nodes
        for r in refs:
            r.stop()
        assert [r.result(timeout=30) for r in refs] == [1000 * i + rounds
                                                        for i in range(len(refs))]
    finally:
        e.shutdown()
    assert not os.path.exists(os.path.join("/dev/shm", e.id))  # its top snapshot too


def test_node_loss_resubmits_its_tasks_and_new_nodes_join(cluster, own):
    e = stealer.Executor(cluster=True, seed=3)
    note_segments(e)
    try:
        head = ray.get_runtime_context().get_node_id()
        (other,) = [n for n in e.nodes if n != head]
        # the client keeps each agent's state: every 32 messages (the default: none asked
        # yet after 5 adds, so all five are replayed), after every message (the state,
        # nothing to replay), or never (restarted from its spawn arguments)
        every = [32, 1, 0] * 2
        agents = [e.spawn_agent(ct.Counter, 1000 * i, state_every=k)
                  for i, k in enumerate(every)]
        for _ in range(5):
            got = [f.result(timeout=30) for f in e.call_all(agents, "add", [(1,)] * 6)]
        assert got == [1000 * i + 5 for i in range(6)]
        on_other = [r for r in agents if r.node == other]
        assert on_other, "no agent on the node to be removed"
        # an agent on the head calling, through a ref it holds, one on the node to be lost
        caller = e.spawn_agent(ct.Hop, node=head)
        callee = e.spawn_agent(ct.Hop, node=other, state_every=1)
        caller.call("link", callee).result(timeout=30)
        assert caller.call("hop", 1).result(timeout=60) == ["0", "1"]
        fs = [e.submit(ct.spin, 0.02, i) for i in range(150)]  # 3 s of work on 2 cores
        fs += [e.submit_to(other, ct.spin, 0.02, i) for i in range(150, 200)]
        tree = e.submit_to(head, ct.fib_where, 26)  # its children may be out on the other
        cf.wait(fs[:20], timeout=60)
        # some of the node's queued tasks withdrawn just before it goes: they must stay
        # cancelled (not run again elsewhere, no result, no error), the others all run
        # (every other one of its 50: those a thief took meanwhile, its move not yet
        # reported, are asked of the wrong node and refused; seen once for its newest 10)
        withdrawn = [f for f in fs[151::2] if f.cancel()]
        assert withdrawn, "none of the node's queued tasks could be withdrawn"
        victim = [n for n in cluster.worker_nodes if n.node_id == other]
        assert victim, "the second node is gone already"
        cluster.remove_node(victim[0])
        kept = [i for i, f in enumerate(fs) if f not in withdrawn]
        got = [fs[i].result(timeout=90) for i in kept]
        assert [x for _, x in got] == kept  # every future, each result once
        assert all(f.cancelled() for f in withdrawn)
        assert tree.result(timeout=90)[0] == ct.fib_seq(26)  # children lost there re-ran
        st = e.stats()
        (loss,) = st.losses
        assert loss["node"] == other and loss["tasks"] > 0 and loss["replaced"] == loss["tasks"]
        assert st.resubmitted >= loss["tasks"] and st.outstanding == 0
        assert st.withdrawn == len(withdrawn)
        assert e.nodes == [head]
        # the agents of the lost node started again on the head: from the state the client
        # kept and the messages since, or (state_every=0) from their spawn arguments
        assert all(r.node == head for r in agents)
        assert caller.call("hop", 1).result(timeout=60) == ["0", "0"]  # it follows
        got = [r.call("add", 1).result(timeout=60) for r in agents]
        assert [g % 1000 for g in got] == [
            1 if r in on_other and k == 0 else 6 for r, k in zip(agents, every)]
        lost_32 = sum(1 for r, k in zip(agents, every) if r in on_other and k == 32)
        # the answered adds since no state was kept (more if a state's reply was lost too)
        assert st.replayed >= 5 * lost_32, (st.replayed, lost_32)
        assert st.state_errors == 0
        # a node joins: it gets a node agent and takes work
        cluster.add_node(num_cpus=1, env_vars=node_env("1"))
        deadline = time.monotonic() + 60
        while len(e.nodes) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(e.nodes) == 2
        note_segments(e)
        got = [f.result(timeout=60) for f in [e.submit(ct.where, i) for i in range(400)]]
        assert {t for t, _, _ in got} == {"0", "1"}
    finally:
        e.shutdown()


def test_gymnasium_vector_env_on_the_cluster(ex):
    """stealer.gym.AgentVectorEnv on a cluster executor: its environments are agents
    spread over the nodes; every step equals SyncVectorEnv's."""
    gym = pytest.importorskip("gymnasium")
    import numpy as np
    from gymnasium.vector import SyncVectorEnv

    from stealer.gym import AgentVectorEnv

    fns = [lambda: gym.make("CartPole-v1")] * 4
    a, s = AgentVectorEnv(fns, executor=ex), SyncVectorEnv(fns)
    try:
        oa, _ = a.reset(seed=3)
        os_, _ = s.reset(seed=3)
        assert np.array_equal(oa, os_)
        ends = 0
        for t in range(80):
            act = np.array([(t + i) % 2 for i in range(4)])
            ra, rs = a.step(act), s.step(act)
            for x, y in zip(ra[:4], rs[:4]):
                assert np.array_equal(x, y), (t, x, y)
            ends += int((ra[2] | ra[3]).sum())
        assert ends > 0
    finally:
        a.close()
        s.close()


def test_nothing_is_left_behind(cluster, own):
    assert len(MADE) >= 4  # the shared executor's two, and the node-loss test's
    deadline = time.monotonic() + 10
    while segments() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not segments(), f"node executors left segments: {segments()}"

