"""Fork-join children across nodes (stealer/cluster/children.py), without Ray.

The table's rules one by one, then a fake transport between two tables that loses the
thief with results still in flight (each child's value must reach its parent exactly once,
and be right), then the real thing inside one node executor: its workers' spawn hook, the
proxies, and a fake peer in this process that takes the shipped children and answers them
(or dies with them), so the proxies wait, help and re-run as they would across nodes.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import threading
from collections import deque

import pytest

import stealer
from stealer.cluster import children
from stealer.cluster.children import ChildServer, ChildTable, hungry, room
from stealer.cluster.policy import Load

# -- the table -------------------------------------------------------------------------------


def test_a_child_nobody_took_runs_where_it_was_spawned():
    t = ChildTable()
    t.add("k", b"call")
    assert t.pending() == 1
    assert t.claim("k") == ("run",)
    assert t.pending() == 0 and not t.exports
    assert t.ship("b", 5) == []  # claimed: never shipped after
    assert t.result("k", True, 1) is False  # a result for it is dropped


def test_the_oldest_children_ship_first_and_their_proxies_wait_for_the_result():
    t = ChildTable()
    for i in range(4):
        t.add(i, b"c%d" % i)
    assert t.ship("b", 2) == [(0, b"c0"), (1, b"c1")]
    assert t.shipped() == {"b": 2} and t.pending() == 2
    assert t.claim(0) == ("wait",)
    assert t.result(0, True, "v0") is True
    assert t.result(0, True, "again") is False  # a result sent twice counts once
    assert t.claim(0) == ("done", True, "v0")
    assert t.claim(1) == ("wait",)
    assert t.result(1, False, ("boom", "")) is True
    assert t.claim(1) == ("done", False, ("boom", ""))
    assert t.n["dropped"] == 1


def test_a_lost_thief_gives_its_children_back_and_their_late_results_are_dropped():
    t = ChildTable()
    for i in range(3):
        t.add(i, b"x")
    t.ship("b", 3)
    assert t.result(0, True, "from b") is True  # came back before b was lost
    assert t.lost("b") == 2
    assert t.pending() == 2 and t.shipped() == {}
    assert t.claim(1) == ("run",)  # its proxy runs it itself (at-least-once)
    assert t.result(1, True, "late from b") is False  # claimed again here: dropped
    assert t.claim(0) == ("done", True, "from b")
    # a result that comes after the loss but before anyone claimed it is as good
    assert t.result(2, True, "late but first") is True
    assert t.claim(2) == ("done", True, "late but first")


def test_only_children_pending_long_enough_ship_oldest_first():
    # (the node agent's age rule: children exported at born_by or before may move)
    t = ChildTable()
    for i in range(4):
        t.add(i, b"c%d" % i, now=10.0 + i)
    assert t.pending() == 4 and t.pending(born_by=11.5) == 2 and t.pending(9.0) == 0
    assert t.oldest_pending() == 10.0 and t.oldest_pending(after=11.5) == 12.0
    assert t.ship("b", 5, born_by=9.0, now=20.0) == []
    assert t.ship("b", 5, born_by=11.5, now=20.0) == [(0, b"c0"), (1, b"c1")]
    assert t.sent_at(0) == 20.0 and t.sent_at(2) is None  # (2: pending, not shipped)
    assert t.oldest_pending() == 12.0 and t.pending(born_by=11.5) == 0
    assert t.claim(3) == ("run",)  # a young one its own proxy claims never ships
    assert t.ship("b", 5, born_by=99.0, now=21.0) == [(2, b"c2")]
    assert t.result(0, True, "v") is True and t.sent_at(0) is None  # (back: no trip left)
    # a child given back keeps its age: it may ship again at once
    assert t.unship([1], declined=True) == 1
    assert t.pending(born_by=11.5) == 1 and t.ship("c", 1, born_by=11.5, now=22.0) == [(1, b"c1")]
    assert t.sent_at(1) == 22.0


def test_the_age_rule_is_validated():
    from stealer.cluster.policy import StealConfig

    with pytest.raises(ValueError, match="child_age_rtts"):
        StealConfig(child_age_rtts=-1)
    with pytest.raises(ValueError, match="child_age_rtts"):
        StealConfig(child_age_rtts=float("nan"))
    assert StealConfig(child_age_rtts=0).child_age_rtts == 0


def test_a_claim_before_its_export_arrives_runs_it_and_the_export_is_ignored():
    t = ChildTable()
    assert t.claim("k") == ("run",)  # the export came on another worker's connection
    t.add("k", b"x")
    assert t.pending() == 0 and t.ship("b", 1) == []


def test_a_failed_push_makes_the_children_pending_again():
    t = ChildTable()
    t.add(1, b"x")
    t.ship("b", 1)
    assert t.unship([1]) == 1
    assert t.ship("c", 1) == [(1, b"x")]
    # declined by a thief with no worker free: pending again, counted apart; a claim by
    # its own proxy then runs it here
    assert t.unship([1], declined=True) == 1
    assert t.unship([1], declined=True) == 0  # (pending already: nothing to undo)
    assert (t.n["rerun"], t.n["declined"]) == (1, 1)
    assert t.claim(1) == ("run",)


def test_imports_run_once_and_a_lost_origin_drops_those_not_started():
    t = ChildTable()
    ks = t.add_imports("a", [(1, b"p1"), (2, b"p2")])
    t.add_imports("c", [(9, b"p9")])
    assert ks == [("a", 1), ("a", 2)]
    assert t.take_import(("a", 2)) == (("a", 2), b"p2")
    assert t.take_import(("a", 2)) is None  # a waiting proxy took it: the task finds none
    t.lost("a")
    assert t.take_import() == (("c", 9), b"p9")
    assert t.take_import() is None


def test_children_are_exported_only_for_peers_with_free_workers():
    busy = Load("b", 2, queued=3, running=2)
    idle = Load("i", 2, queued=0, running=0)
    half = Load("h", 2, queued=0, running=1)
    waiting = Load("w", 1, queued=0, running=1, waiting=1)  # its one worker waits on us
    assert hungry([busy], [], {}) == {}
    assert hungry([idle, half, waiting], [], {}) == {"i": 2, "h": 1, "w": 1}
    assert hungry([idle], [], {"i": 2}) == {}  # what was shipped to it fills it
    assert hungry([busy], ["b"], {}) == {"b": 1}  # a lifeline is fresher than its report
    # a lifeline says it has a free worker now, whatever was shipped to it before (its
    # worker may be blocked in a shipped child, waiting on one of ours)
    assert hungry([busy], ["b"], {"b": 1}) == {"b": 1}
    assert hungry([idle], ["i"], {"i": 5}, cap=2) == {"i": 2}
    assert room([idle, half], [], {"i": 1}, cap=2) == 3 + 2


# -- a fake transport: the parent's node, a thief, and the thief lost ----------------------


def test_each_child_reaches_its_parent_once_when_the_thief_dies_with_results_in_flight():
    rng = random.Random(7)
    for trial in range(50):
        home = ChildTable()
        n = rng.randint(1, 12)
        for i in range(n):
            home.add(i, b"%d" % i)
        wire: deque = deque()  # results on their way home from the thief
        shipped = home.ship("thief", rng.randint(1, n))
        for key, payload in shipped:  # the thief runs some of them
            if rng.random() < 0.7:
                wire.append((key, True, int(payload) * 10))
        got: dict[int, list[int]] = {i: [] for i in range(n)}
        proxies = list(range(n))
        rng.shuffle(proxies)

        def deliver(k: int, home=home, wire=wire) -> None:
            for _ in range(k):
                if wire:
                    home.result(*wire.popleft())

        lost_at = rng.randint(0, n)
        for step, key in enumerate(proxies):
            deliver(rng.randint(0, 2))
            if step == lost_at:
                home.lost("thief")
            ans = home.claim(key)
            for _ in range(2 * n + 2):  # a waiting proxy: results arrive, or the loss does
                if ans != ("wait",):
                    break
                if wire:
                    deliver(1)
                else:
                    home.lost("thief")
                ans = home.claim(key)
            assert ans != ("wait",), "a proxy waits for a child nobody will answer"
            if ans == ("run",):
                got[key].append(key * 10)
            else:
                assert ans[1] is True
                got[key].append(ans[2])
        deliver(len(wire))  # the late ones: dropped, nobody waits for them
        assert got == {i: [i * 10] for i in range(n)}, trial
        assert not home.exports


# -- the real hook inside one node executor, with a fake peer in this process ----------------

class FakePeer:
    """A node in this process: takes every child the server has pending (as a lifeline
    thief would), runs it here sequentially and answers it, unless it is 'dead' (it then
    drops them and the server is told it was lost, after a few)."""

    def __init__(self, die_after: int | None = None) -> None:
        self.srv: ChildServer | None = None
        self.die_after = die_after
        self.ran = 0
        self.dead = False
        self.lock = threading.Lock()

    def hook(self) -> None:
        srv = self.srv
        if self.dead:
            return
        with srv.lock:
            items = srv.table.ship("peer", srv.table.pending())
        for key, payload in items:
            threading.Thread(target=self.run, args=(key, payload), daemon=True).start()

    def run(self, key, payload) -> None:
        import pickle

        with self.lock:
            self.ran += 1
            dies = self.die_after is not None and self.ran > self.die_after
        if dies:
            self.dead = True
            srv = self.srv
            with srv.cv:  # the client's new peers leave it out: its children come back
                srv.table.lost("peer")
                srv.cv.notify_all()
            return
        fn_bytes, call = payload
        fn = pickle.loads(fn_bytes)
        args, kwargs = pickle.loads(call)
        value = stealer.run_inline(fn, *args, **kwargs)
        with self.srv.cv:
            self.srv.table.result(key, True, value)
            self.srv.cv.notify_all()


def _node(peer: FakePeer, want_depth: int | None = None):
    d = children.make_dir()
    srv = ChildServer(d, lambda *a: None, peer.hook, lambda node: None)
    peer.srv = srv
    ex = stealer.Executor(1, initializer=children.install,
                          initargs=(srv.path, srv.want_path, srv.authkey, 3, None, (),
                                    want_depth))
    return srv, ex


def _fib_spawns(n: int, cutoff: int, upto: int, depth: int = 1) -> int:
    """The spawns of workloads.fib(n, cutoff) at depths 1 to ``upto`` below its root."""
    if n < max(cutoff, 2) or depth > upto:
        return 0
    return 2 + sum(_fib_spawns(m, cutoff, upto, depth + 1) for m in (n - 1, n - 2))


@pytest.mark.parametrize("die_after", [None, 0])
def test_proxies_wait_for_children_run_elsewhere_and_rerun_those_lost(die_after):
    from stealer.bench.workloads import fib, fib_seq

    peer = FakePeer(die_after)
    srv, ex = _node(peer)
    try:
        assert ex.submit(fib, 22, 14).result(timeout=60) == fib_seq(22)
        n = srv.table.n
        assert n["shipped"] > 0
        if die_after is None:
            assert n["exported"] == n["shipped"] + n["local"]
            assert n["returned"] == n["shipped"] and n["rerun"] == 0
        else:
            assert n["rerun"] > 0  # the lost peer's children ran again here
        assert not srv.table.exports  # every entry was taken by its proxy
    finally:
        ex.shutdown()
        srv.close()
        shutil.rmtree(os.path.dirname(srv.path), ignore_errors=True)


def test_the_workers_export_nothing_deeper_than_the_depth_unless_wanted():
    from stealer.bench.workloads import fib, fib_seq

    srv, ex = _node(FakePeer())
    srv.hook = lambda: None  # nobody takes anything: every proxy claims its own child
    try:
        assert ex.submit(fib, 22, 14).result(timeout=60) == fib_seq(22)
        assert srv.table.n["exported"] == 2 + 4 + 8  # depths 1 to 3 of a binary tree
        assert srv.table.n["local"] == 14 and srv.table.n["shipped"] == 0
        srv.set_want(True)  # a hungry peer: every spawn is exported
        assert ex.submit(fib, 18, 14).result(timeout=60) == fib_seq(18)
        assert srv.table.n["exported"] - 14 == _fib_spawns(18, 14, 99) > 2 + 4 + 8
    finally:
        ex.shutdown()
        srv.close()
        shutil.rmtree(os.path.dirname(srv.path), ignore_errors=True)
    assert not os.path.exists(srv.path)


def test_a_wanted_node_exports_nothing_deeper_than_the_want_depth():
    """StealConfig.want_depth: the want flag exports spawns down to that depth, no deeper
    (the small children that cost more to move than to run)."""
    from stealer.bench.workloads import fib, fib_seq

    srv, ex = _node(FakePeer(), want_depth=5)
    srv.hook = lambda: None  # nobody takes anything: every proxy claims its own child
    try:
        srv.set_want(True)
        assert ex.submit(fib, 24, 14).result(timeout=60) == fib_seq(24)
        assert _fib_spawns(24, 14, 5) < _fib_spawns(24, 14, 99)  # (the tree is deeper)
        assert srv.table.n["exported"] == _fib_spawns(24, 14, 5) == srv.table.n["local"]
        srv.set_want(False)  # no hungry peer: down to child_depth (3) only
        before = srv.table.n["exported"]
        assert ex.submit(fib, 24, 14).result(timeout=60) == fib_seq(24)
        assert srv.table.n["exported"] - before == _fib_spawns(24, 14, 3)
    finally:
        ex.shutdown()
        srv.close()
        shutil.rmtree(os.path.dirname(srv.path), ignore_errors=True)


def test_the_want_depth_is_checked():
    from stealer.cluster.policy import StealConfig

    assert StealConfig().want_depth == 5
    assert StealConfig(want_depth=None).want_depth is None
    assert StealConfig(child_depth=4, want_depth=40).want_depth == 40
    for bad in ({"want_depth": 2}, {"child_depth": -1}, {"child_depth": 6}):
        with pytest.raises(ValueError, match="depth"):
            StealConfig(**bad)


def test_the_directories_of_dead_node_agents_are_removed_by_the_next():
    # a process that made one and died without cleaning up (SIGKILL: a node removed)
    code = "from stealer.cluster import children; print(children.make_dir())"
    left = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip()
    assert os.path.isdir(left)
    mine = children.make_dir()
    try:
        assert not os.path.exists(left) and os.path.isdir(mine)
        other = children.make_dir()
        assert os.path.isdir(mine) and os.path.isdir(other)
        shutil.rmtree(other)
    finally:
        shutil.rmtree(mine, ignore_errors=True)


def test_an_imported_child_names_its_function_by_id_registered_once():
    """The node agent registers an imported child's function in its node executor's
    function table at its first import and sends the workers its id; a function that
    does not unpickle here goes on as its pickle (the worker reports what fails)."""
    from stealer.bench.workloads import fib

    seen = []

    def fid_of(fn):
        seen.append(fn)
        return 7

    d = children.make_dir()
    srv = ChildServer(d, lambda *a: None, lambda: None, lambda node: None, fid_of)
    try:
        call = children._pack(((5, 2), {}))
        payload = (children._fn_bytes(fib), call)
        assert children._fn_bytes(fib) is payload[0]  # made once per function
        assert srv._local(payload) == (7, None, call)
        assert srv._local(payload) == (7, None, call)
        assert seen == [fib]
        assert srv._local((b"no pickle", call)) == (-1, b"no pickle", call)
        assert children._call_of((-1, payload[0], call)) == (fib, (5, 2), {})
    finally:
        srv.close()
        shutil.rmtree(d, ignore_errors=True)
