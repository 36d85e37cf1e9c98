"""The cluster's placement and steal rules (stealer/cluster/policy.py), without Ray.

The rules are checked one by one on the policy objects, then together on a small
discrete-event simulation of nodes joined by a fake transport (``Net``): messages take half
a round trip each way, the victim decides when the request arrives, and the transport
itself fails the test if a thief ever has two requests out at once.
"""

from __future__ import annotations

import heapq
import itertools
import random
import subprocess
import sys
from collections import Counter, deque

import pytest

from stealer.cluster.policy import (
    Load,
    RoundTrip,
    StealConfig,
    Thief,
    Victim,
    backlog_s,
    buddies_of,
    grant_count,
    linger_for,
    place,
)

# -- placement ------------------------------------------------------------------------


def test_place_takes_the_less_loaded_of_two():
    loads = {"a": Load("a", 2, queued=10), "b": Load("b", 2, queued=2)}
    rng = random.Random(1)
    assert {place(loads, rng) for _ in range(50)} == {"b"}
    # what was sent since the report counts: b is now the busier one
    assert {place(loads, rng, sent={"b": 30}) for _ in range(50)} == {"a"}
    assert place({"only": Load("only", 1, queued=99)}, rng) == "only"
    with pytest.raises(ValueError):
        place({}, rng)


def test_place_per_worker_not_per_node():
    loads = {"big": Load("big", 8, queued=16), "small": Load("small", 1, queued=4)}
    assert place(loads, random.Random(0)) == "big"  # 2 per worker against 4


def test_power_of_two_choices_balances_better_than_one():
    """10,000 placements on 20 equal nodes, the client counting what it sent: two choices
    keep the maximum within a few tasks of the mean; a single random choice does not."""
    nodes = [f"n{i}" for i in range(20)]
    loads = {n: Load(n, 1) for n in nodes}
    rng = random.Random(7)
    sent: Counter[str] = Counter()
    for _ in range(10_000):
        sent[place(loads, rng, sent)] += 1
    one: Counter[str] = Counter(rng.choice(nodes) for _ in range(10_000))
    assert max(sent.values()) - 500 <= 3
    assert max(one.values()) - 500 > 3 * (max(sent.values()) - 500)


# -- the victim's grant ----------------------------------------------------------------


def test_grant_is_half_the_surplus_capped_by_count_and_bytes():
    cfg = StealConfig(max_count=100, max_bytes=1000)
    assert grant_count(0, [], cfg) == 0
    assert grant_count(1, [10], cfg) == 0  # its own worker will take the one it has
    assert grant_count(9, [10] * 9, cfg) == 4
    assert grant_count(1000, [1] * 1000, cfg) == 100  # count cap
    assert grant_count(40, [100] * 40, cfg) == 10  # bytes cap: 10 x 100 = 1000
    assert grant_count(40, [5000] + [1] * 39, cfg) == 1  # one big task still moves alone
    assert Victim("v", cfg).grant(9, [10] * 9) == 4


# -- the thief's rules ------------------------------------------------------------------


def loads_of(**queued: int) -> dict[str, Load]:
    return {n: Load(n, 1, queued=q, task_s=0.001) for n, q in queued.items()}


def test_a_thief_waits_for_the_idle_threshold():
    t = Thief("me", StealConfig(idle_s=0.01), random.Random(0))
    loads = loads_of(me=0, v=100)
    assert t.poll(0.0, loads) is None  # not idle yet
    t.idle(1.0)
    assert t.poll(1.005, loads) is None
    assert t.poll(1.011, loads) == "v"


def test_a_thief_running_low_asks_ahead_once_then_waits_the_threshold():
    """Nothing queued and less than ``ahead`` round trips of work in flight per worker: the
    first attempt goes at once (its reply comes about when the last task ends); after a
    failed one the thief waits ``idle_s`` again, as an idle one does."""
    t = Thief("me", StealConfig(idle_s=0.01, ahead=2.0), random.Random(0))
    t.rtt.add(0.003)
    assert t.low_water(1, 0.002) == 3  # 2 x 3 ms of work: 3 tasks of 2 ms
    assert t.low_water(2, 0.002) == 6
    assert t.low_water(1, 0.0) == 0  # not measured yet: only once idle
    assert t.low_water(1, 0.1) == 0  # a task holds more than two round trips
    assert Thief("x", StealConfig(ahead=0.0)).low_water(4, 0.001) == 0
    loads = loads_of(me=0, v=100)
    t.idle(1.0, low=True)
    assert t.poll(1.0, loads) == "v"  # at once
    t.on_reply(1.003, "v", 0, loads)  # nothing there
    t.idle(1.004, low=True)
    assert t.poll(1.005, loads) is None  # a failed attempt: the threshold again
    assert t.poll(1.0135, loads) == "v"
    t.on_reply(1.016, "v", 7, loads)  # work: the next time it runs low it asks at once
    assert (t.idle_since, t.low, t.failed) == (None, False, 0)
    t.idle(2.0, low=True)
    assert t.poll(2.0, loads) == "v"


def test_one_outstanding_request_at_a_time():
    t = Thief("me", StealConfig(idle_s=0.0), random.Random(0))
    loads = loads_of(me=0, a=100, b=100)
    t.idle(0.0)
    first = t.poll(0.0, loads)
    assert first in ("a", "b")
    assert all(t.poll(0.00001 * i, loads) is None for i in range(1, 100))
    t.on_reply(0.001, "zz", 5, loads)  # not the one we asked: ignored
    assert t.outstanding == first
    t.on_reply(0.001, first, 0, loads)
    assert t.poll(0.002, loads) in ("a", "b")


def test_the_victim_is_drawn_among_the_most_loaded():
    loads = loads_of(me=0, a=500, b=400, c=20, d=10, e=0)
    seen = Counter()
    for seed in range(200):
        t = Thief("me", StealConfig(idle_s=0.0, most_loaded=2), random.Random(seed))
        t.idle(0.0)
        seen[t.poll(0.0, loads)] += 1
    assert set(seen) == {"a", "b"}  # both, at random, never a lighter one
    assert min(seen.values()) > 50


def test_steal_only_when_the_saving_beats_twice_the_round_trip():
    cfg = StealConfig(idle_s=0.0, rtt_factor=2.0)
    t = Thief("me", cfg, random.Random(0), RoundTrip(initial_s=0.001))
    v = Load("v", 1, queued=10, task_s=0.001)  # half = 5 tasks = 5 ms of victim time
    assert t.worth(v)  # 5 ms > 2 x 1 ms
    t.rtt = RoundTrip(initial_s=0.003)
    assert not t.worth(v)  # 5 ms < 2 x 3 ms
    t.idle(0.0)
    assert t.poll(1.0, {"me": Load("me", 1), "v": v}) is None
    # the measured round trip is what counts: a slow reply makes the next steal unworthy
    t2 = Thief("me", cfg, random.Random(0), RoundTrip(initial_s=0.0001))
    loads = {"me": Load("me", 1), "v": v}
    t2.idle(0.0)
    assert t2.poll(0.0, loads) == "v"
    t2.on_reply(0.004, "v", 5, loads)  # 4 ms round trip
    t2.idle(0.004)
    assert t2.rtt.s == pytest.approx(0.004)
    assert not t2.worth(v)
    # more workers on the victim: less victim-side time saved
    assert not Thief("me", cfg, rtt=RoundTrip(0.001)).worth(Load("v", 4, queued=10,
                                                                   task_s=0.001))
    assert backlog_s(v, cfg) == pytest.approx(0.010)


def test_lifelines_after_failed_attempts_and_pushes_revive_the_thief():
    cfg = StealConfig(idle_s=0.0, max_failed=3, buddies=2)
    nodes = ["n0", "n1", "n2", "n3"]
    t = Thief("n1", cfg, random.Random(0))
    loads = {n: Load(n, 1, queued=50, task_s=0.001) for n in nodes}
    t.idle(0.0)
    now = 0.0
    for attempt in range(3):
        assert t.registrations() == []
        victim = t.poll(now, loads)
        assert victim is not None, attempt
        now += 0.001
        t.on_reply(now, victim, 0, loads)  # empty: the surplus was gone when it arrived
    assert t.registrations() == ["n2", "n3"] == buddies_of("n1", nodes, 2)
    assert t.poll(now + 1, loads) is None  # quiescent: waits for a push
    # the buddies take the lifeline and push when they have surplus
    v = Victim("n2", cfg)
    v.register("n1")
    v.register("n1")
    v.register("n2")  # never itself
    assert v.lifelines == ["n1"]
    assert v.pushes(1, [10]) is None  # no surplus: keeps the lifeline
    assert v.lifelines == ["n1"]
    assert v.pushes(20, [10] * 20) == ("n1", 10)
    assert v.lifelines == []  # one push per lifeline
    t.on_work()
    assert t.registrations() == [] and t.failed == 0
    t.idle(now + 1)
    assert t.poll(now + 1, loads) is not None  # active again


def test_no_peer_worth_asking_counts_as_a_failure():
    t = Thief("a", StealConfig(idle_s=0.0, max_failed=2, buddies=1), random.Random(0))
    loads = loads_of(a=0, b=0, c=1)
    t.idle(0.0)
    assert t.poll(0.0, loads) is None
    assert t.failed == 1 and t.registrations() == []
    assert t.poll(0.0, loads) is None
    assert t.registrations() == ["b"]


def test_pushes_skip_dead_thieves_and_go_in_registration_order():
    v = Victim("v", StealConfig())
    for t in ("x", "y", "z"):
        v.register(t)
    assert v.pushes(8, [1] * 8, alive=lambda n: n != "x") == ("y", 4)
    assert v.pushes(4, [1] * 4) == ("z", 2)
    assert v.pushes(100, [1] * 100) is None


def test_buddies_ring():
    assert buddies_of("c", ["a", "b", "c"], 2) == ["a", "b"]
    assert buddies_of("a", ["a"], 2) == []
    assert buddies_of("x", ["a", "b"], 5) == ["a", "b"]  # a node not in the list yet


# -- the rules together: nodes on a fake transport ---------------------------------------


class Net:
    """An in-process transport with a fixed round trip: a discrete-event simulation of
    nodes that run tasks (durations) on ``workers`` each and steal by the policy."""

    def __init__(self, tasks: dict[str, list[float]], workers: int = 1, rtt: float = 0.001,
                 cfg: StealConfig | None = None, seed: int = 0, steal: bool = True) -> None:
        self.cfg = cfg or StealConfig()
        self.rtt = rtt
        self.steal = steal
        self.now = 0.0
        self.events: list[tuple[float, int, object]] = []
        self.seq = itertools.count()
        self.nodes = sorted(tasks)
        self.queue = {n: deque(tasks[n]) for n in self.nodes}
        self.free = dict.fromkeys(self.nodes, workers)
        self.workers = workers
        self.done: Counter[str] = Counter()
        self.ran: Counter[float] = Counter()
        self.measured = dict.fromkeys(self.nodes, 0.0)
        rng = random.Random(seed)
        self.thief = {n: Thief(n, self.cfg, random.Random(rng.random()), RoundTrip(rtt))
                      for n in self.nodes}
        self.victim = {n: Victim(n, self.cfg) for n in self.nodes}
        self.requests = self.stolen = self.pushed = 0
        self.finished_at = 0.0

    def at(self, t: float, what: object) -> None:
        heapq.heappush(self.events, (t, next(self.seq), what))

    def load(self, n: str) -> Load:  # what a peer knows of n: exact here (reports are fresh)
        return Load(n, self.workers, queued=len(self.queue[n]),
                    running=self.workers - self.free[n], task_s=self.measured[n] or 0.001)

    def loads(self) -> dict[str, Load]:
        return {n: self.load(n) for n in self.nodes}

    def start(self, n: str) -> None:
        while self.free[n] and self.queue[n]:
            d = self.queue[n].popleft()  # own work from the front; thieves take the back
            self.free[n] -= 1
            self.at(self.now + d, ("end", n, d))
        if self.queue[n] or self.free[n] < self.workers:
            self.thief[n].on_work()
            push = self.victim[n].pushes(len(self.queue[n]), [1] * len(self.queue[n]))
            if push:
                self.give(n, *push, kind="push")
        else:
            self.thief[n].idle(self.now)
            self.try_steal(n)

    def give(self, victim: str, thief: str, count: int, kind: str) -> None:
        batch = [self.queue[victim].pop() for _ in range(count)]
        self.pushed += kind == "push"
        self.at(self.now + self.rtt / 2, ("batch", thief, victim, batch, kind))

    def try_steal(self, n: str) -> None:
        if not self.steal:
            return
        t = self.thief[n]
        victim = t.poll(self.now, self.loads())
        if victim is not None:
            self.requests += 1
            self.at(self.now + self.rtt / 2, ("request", victim, n))
        elif t.registrations():
            for b in t.registrations():
                self.at(self.now + self.rtt / 2, ("lifeline", b, n))
        elif t.idle_since is not None:
            self.at(self.now + self.cfg.idle_s, ("poll", n))

    def run(self) -> float:
        for n in self.nodes:
            self.start(n)
        while self.events:
            self.now, _, ev = heapq.heappop(self.events)
            kind, n, *rest = ev
            if kind == "end":
                (d,) = rest
                self.free[n] += 1
                self.done[n] += 1
                self.ran[d] += 1
                self.measured[n] = d if not self.measured[n] else 0.8 * self.measured[n] + 0.2 * d
                self.finished_at = self.now
                self.start(n)
            elif kind == "request":  # at the victim: it decides now
                (thief,) = rest
                q = len(self.queue[n])
                g = self.victim[n].grant(q, [1] * q)
                self.give(n, thief, g, "steal") if g else self.at(
                    self.now + self.rtt / 2, ("batch", thief, n, [], "steal"))
            elif kind == "batch":
                victim, batch, how = rest
                self.queue[n].extend(batch)
                self.stolen += len(batch)
                if how == "steal":
                    self.thief[n].on_reply(self.now, victim, len(batch), self.loads())
                self.start(n)
                if how == "steal" and not batch:
                    self.try_steal(n)
            elif kind == "lifeline":
                (thief,) = rest
                self.victim[n].register(thief)
                q = len(self.queue[n])
                push = self.victim[n].pushes(q, [1] * q)
                if push:
                    self.give(n, *push, kind="push")
            elif kind == "poll" and self.free[n] == self.workers and not self.queue[n]:
                self.try_steal(n)
            outstanding = [t for t in self.thief.values() if t.outstanding]
            assert all(self.requests_out(t.node) <= 1 for t in outstanding)
        return self.finished_at

    def requests_out(self, thief: str) -> int:
        return sum(1 for _, _, ev in self.events
                   if ev[0] == "request" and ev[2] == thief) + sum(
            1 for _, _, ev in self.events if ev[0] == "batch" and ev[1] == thief
            and ev[4] == "steal")


def pareto(n: int, seed: int, mean: float = 0.002) -> list[float]:
    rng = random.Random(seed)
    shape = 1.5
    scale = mean * (shape - 1) / shape
    return [min(0.2, scale / (rng.random() ** (1 / shape))) for _ in range(n)]


def test_skewed_work_on_one_node_spreads_to_every_node():
    work = pareto(2000, 1)
    net = Net({"n0": work, "n1": [], "n2": [], "n3": []})
    makespan = net.run()
    ideal = sum(work) / 4
    assert sum(net.done.values()) == 2000 and net.ran == Counter(work)  # none lost, none twice
    assert min(net.done.values()) > 200  # every node ran a share
    assert ideal / makespan > 0.85, (ideal, makespan)
    assert net.stolen > 0


def test_without_stealing_the_skew_stays_where_it_was_put():
    """The baseline the test above beats (so it can fail): one node runs everything."""
    work = pareto(2000, 1)
    net = Net({"n0": work, "n1": [], "n2": [], "n3": []}, steal=False)
    makespan = net.run()
    assert net.done["n0"] == 2000
    assert makespan == pytest.approx(sum(work))


def test_a_slow_transport_makes_small_work_stay_home():
    """1,000 tasks of 10 us (10 ms in all) and a 50 ms round trip: no steal is worth it,
    nobody asks, and every thief ends up on a lifeline instead of flooding the victim."""
    net = Net({"a": [1e-5] * 1000, "b": [], "c": []}, rtt=0.05,
              cfg=StealConfig(idle_s=0.001))
    net.run()
    assert net.done["a"] == 1000 and net.requests == 0
    assert net.thief["b"].registrations() and net.thief["c"].registrations()


def test_thieves_on_lifelines_get_work_pushed_later():
    """The only work arrives after every thief has given up: lifeline pushes spread it."""
    cfg = StealConfig(idle_s=0.001, max_failed=2, buddies=2)
    net = Net({"a": [], "b": [], "c": []}, cfg=cfg)
    net.run()
    assert all(t.registrations() for t in net.thief.values())
    for n in net.nodes:  # their lifelines reach the buddies
        for b in net.thief[n].registrations():
            net.victim[b].register(n)
    net.queue["a"].extend([0.002] * 300)
    net.start("a")
    net.run()
    assert net.pushed >= 1
    assert net.done["b"] > 0 and net.done["c"] > 0
    assert sum(net.done.values()) == 300


# -- the extra stays optional -------------------------------------------------------------


def test_import_stealer_never_imports_ray_or_the_cluster():
    code = ("import sys, stealer, stealer.client.executor, stealer.cluster.policy\n"
            "stealer.Executor\n"
            "assert 'ray' not in sys.modules, 'import stealer imported ray'\n"
            "assert 'stealer.cluster.client' not in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_without_ray_the_cluster_executor_says_what_to_install(tmp_path):
    """Ray hidden (a stub that fails to import): Executor(cluster=...) raises ClusterError
    naming the extra; a local Executor is not affected."""
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "__init__.py").write_text("raise ImportError('no ray here')\n")
    code = ("import stealer\n"
            "try:\n"
            "    stealer.Executor(cluster='auto')\n"
            "except stealer.ClusterError as e:\n"
            "    assert \"pip install 'stealer[ray]'\" in str(e), e\n"
            "    assert isinstance(e, stealer.StealerError)\n"
            "else:\n"
            "    raise SystemExit('no ClusterError')\n")
    env = {**__import__("os").environ, "PYTHONPATH": str(tmp_path)}
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, env=env)


def test_a_node_lingers_longer_only_with_much_work_queued():
    """linger_for: the client's linger_s when little is queued or the tasks' length is not
    measured yet; a quarter of the queued work per worker beyond it; capped at 0.25 s,
    unless the client asked for longer; linger_s=0 (no lingering) stays 0 only when the
    node has nothing queued."""
    assert linger_for(0.05, 0, 0.01, 2) == 0.05  # nothing queued
    assert linger_for(0.05, 1000, 0.0, 2) == 0.05  # tasks not measured yet
    assert linger_for(0.05, 10, 0.002, 1) == 0.05  # 20 ms queued: a quarter is 5 ms
    assert linger_for(0.05, 400, 0.002, 2) == pytest.approx(0.1)  # 0.4 s per worker
    assert linger_for(0.05, 400, 0.002, 1) == pytest.approx(0.2)
    assert linger_for(0.05, 100_000, 0.002, 1) == 0.25  # capped
    assert linger_for(0.5, 100_000, 0.002, 1) == 0.5  # the client asked for longer
    assert linger_for(0.0, 0, 0.002, 1) == 0.0
    assert linger_for(0.05, 400, -1.0, 1) == 0.05  # a bad measure is no measure


def test_a_node_never_gives_more_tasks_than_it_has_queued():
    """A lifeline push counts its batch, then gives it with the node's lock released in
    between; tasks handed to the local executor meanwhile left fewer queued (seen once
    in a 100 s run: IndexError, pop from an empty deque, raised in the node agent)."""
    pytest.importorskip("ray")
    import threading
    from types import SimpleNamespace

    from stealer.cluster.node import NodeAgent

    give = NodeAgent.__ray_metadata__.modified_class._give
    node = SimpleNamespace(lock=threading.Lock(), queue=deque((t, abs, (t,), {}, 0)
                                                               for t in range(2)),
                           victim=SimpleNamespace(cfg=SimpleNamespace(max_count=1024)),
                           moved=[], _notify=lambda: None)
    batch = give(node, "thief", lambda _q, _sizes: 5)  # counted when 5 were queued
    assert [t[0] for t in batch] == [1, 0] and not node.queue
    assert node.moved == [(1, "thief", 1), (0, "thief", 1)]
