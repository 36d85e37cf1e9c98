"""Agents moving between live nodes: the rule (stealer/cluster/balance.py), without Ray.

Load reports are fed one by one, with made-up times, as the client feeds the reports that
ride on result batches; the plan is what the client would start.  The last test runs the
rule on a small model of nodes hosting agents, where a move takes effect only after it
took its time, and checks it settles instead of shuffling agents back and forth.
"""

from __future__ import annotations

import pytest

from stealer.cluster.balance import BalanceConfig, Balancer, Candidate
from stealer.cluster.policy import Load

CFG = BalanceConfig(reports=3, hold_s=0.5, max_per_s=100)
# the rule without its clear-evidence path (the tests of the streaks themselves)
SLOW = BalanceConfig(reports=3, hold_s=0.5, max_per_s=100, clear_idle=-1.0, clear_busy=2.0)


def busy(node: str = "b", active: int = 8, workers: int = 1) -> Load:
    return Load(node, workers, busy=1.0, active=active, agents=active)


def idle(node: str = "i", workers: int = 1) -> Load:
    return Load(node, workers, busy=0.0)


def agents(n: int, first: int = 0, **kw) -> list[Candidate]:
    return [Candidate(first + k, recent=10 + k, **kw) for k in range(n)]


def feed(bal: Balancer, times: list[float], *loads: Load) -> bool:
    lasting = False
    for t in times:
        for ld in loads:
            lasting = bal.report(t, ld) or lasting
    return lasting


def plan(bal: Balancer, now: float, *loads: Load, cands=None):
    cands = cands if cands is not None else {"b": agents(8)}
    return bal.plan(now, {ld.node: ld for ld in loads}, lambda n: cands.get(n, []))


def test_a_momentary_imbalance_moves_nothing():
    bal = Balancer(SLOW)
    b, i = busy(), idle()
    # two reports: not enough, however long apart
    assert not feed(bal, [0.0, 2.0], b, i)
    assert plan(bal, 2.0, b, i) == []
    # three reports, but within 0.3 s: not lasting either
    bal = Balancer(SLOW)
    assert not feed(bal, [0.0, 0.1, 0.3], b, i)
    assert plan(bal, 0.3, b, i) == []
    # a report in between that shows no imbalance starts the streak again
    bal = Balancer(SLOW)
    feed(bal, [0.0, 0.3], b, i)
    feed(bal, [0.4], Load("b", 1, busy=0.5, active=1), i)
    assert not feed(bal, [0.6, 0.8], b, i)
    assert plan(bal, 0.8, b, i) == []
    assert feed(bal, [1.0, 1.5], b, i)  # three in a row over 0.5 s from 0.6: it lasts now
    assert len(plan(bal, 1.5, b, i)) == 4


def test_a_lasting_imbalance_moves_about_half_the_gap():
    bal = Balancer(CFG)
    b, i = busy(active=8), idle()
    assert feed(bal, [0.0, 0.3, 0.6], b, i)
    moves = plan(bal, 0.6, b, i)
    assert len(moves) == 4  # 8 active agents against none, one worker each: half moves
    assert all(src == "b" and dst == "i" for _, src, dst in moves)
    # the busiest first (the most messages lately)
    assert [aid for aid, _, _ in moves] == [7, 6, 5, 4]
    # per worker: 9 active on 1 worker against 1 on 2 workers: 5 go (4 on the one worker,
    # 6 on the two: 4 against 3 per worker, as even as whole agents get)
    bal = Balancer(CFG)
    b, i2 = busy(active=9), Load("i", 2, busy=0.1, active=1)
    feed(bal, [0.0, 0.3, 0.6], b, i2)
    assert len(plan(bal, 0.6, b, i2, cands={"b": agents(9)})) == (9 * 2 - 1 * 1) // 3 == 5


def test_no_move_when_the_gain_is_below_the_cost():
    b, i = busy(active=8), idle()
    # states of 500 MB each: 5 s to fetch and send on at 200 MB/s, 2 s of gain at most
    bal = Balancer(CFG)
    feed(bal, [0.0, 0.3, 0.6], b, i)
    assert plan(bal, 0.6, b, i, cands={"b": agents(8, state_bytes=500 << 20)}) == []
    # the measured time of a move counts too: moves measured at 2 s each
    bal = Balancer(CFG)
    for _ in range(20):
        bal.moved(2.0)
    feed(bal, [0.0, 0.3, 0.6], b, i)
    assert plan(bal, 0.6, b, i) == []
    # and the same imbalance pays with small states and fast moves (the test can fail)
    bal = Balancer(CFG)
    feed(bal, [0.0, 0.3, 0.6], b, i)
    assert len(plan(bal, 0.6, b, i)) == 4


def test_when_the_idle_nodes_free_workers_cap_the_gain_fewer_agents_may_pay():
    cfg = BalanceConfig(reports=1, hold_s=0.0, max_per_s=100, horizon_s=1.0, idle=0.6,
                        default_move_s=0.1)
    b = busy(active=16, workers=4)  # each active agent had a quarter of a worker there
    i = Load("i", 1, busy=0.5)  # half a worker free here
    bal = Balancer(cfg)
    feed(bal, [0.0], b, i)
    # half the gap: (16 x 1 - 0 x 4) // 5 = 3 agents, 0.75 of a worker, but only 0.5 is
    # free: a gain of 1 s x 0.5 against 2 x 3 x 0.1 s does not pay; two agents do (0.4 s)
    assert len(plan(bal, 1.0, b, i, cands={"b": agents(16)})) == 2


def test_among_equally_busy_agents_the_cheaper_moves_go_first():
    bal = Balancer(CFG)
    b, i = busy(active=8), idle()
    feed(bal, [0.0, 0.3, 0.6], b, i)
    cands = [Candidate(k, recent=10, state_bytes=(1 << 20) if k < 4 else 100)
             for k in range(8)]
    assert sorted(aid for aid, _, _ in plan(bal, 0.6, b, i, cands={"b": cands})) == [
        4, 5, 6, 7]


def test_only_movable_agents_move():
    b, i = busy(active=8), idle()
    cands = {"b": [
        Candidate(0, recent=50, keeps_state=False),  # state_every=0: no state kept
        Candidate(1, recent=50, state_bytes=None),  # its state does not pickle
        Candidate(2, recent=50, awaited=True),  # somebody waits for its final value
        Candidate(3, recent=0),  # quiet: moving it gains nothing
        Candidate(4, recent=5), Candidate(5, recent=6),
    ]}
    bal = Balancer(CFG)
    feed(bal, [0.0, 0.3, 0.6], b, i)
    assert sorted(aid for aid, _, _ in plan(bal, 0.6, b, i, cands=cands)) == [4, 5]


def test_moves_per_second_are_capped_and_streaks_start_again():
    bal = Balancer(BalanceConfig(reports=3, hold_s=0.5, max_per_s=3))
    b, i = busy(active=8), idle()
    feed(bal, [0.0, 0.3, 0.6], b, i)
    assert len(plan(bal, 0.6, b, i)) == 3  # half the gap is 4: the cap leaves 3
    assert plan(bal, 0.6, b, i) == []  # both nodes start a new streak after a move
    assert not bal.lasting("b", "busy", 0.6) and not bal.lasting("i", "idle", 0.6)
    feed(bal, [0.7, 0.9, 1.2], b, i)  # lasting again, but 3 moves started within 1 s
    assert plan(bal, 1.2, b, i) == []
    feed(bal, [1.4, 1.6, 1.9], b, i)
    assert len(plan(bal, 1.9, b, i)) == 3  # a second later the cap allows 3 more
    assert bal.allowance(1.9) == 0 and bal.allowance(2.95) == 3


def test_what_counts_as_busy_and_idle():
    bal = Balancer(CFG)
    assert bal.kind(busy(active=8)) == "busy"
    assert bal.kind(Load("b", 2, busy=1.0, active=2)) == ""  # no agent waits for a worker
    assert bal.kind(Load("b", 1, busy=1.0, running=5)) == ""  # busy with tasks: stealing
    assert bal.kind(Load("b", 1, busy=0.5, active=4)) == ""  # its workers had time left
    assert bal.kind(idle()) == "idle"
    assert bal.kind(Load("i", 1, busy=0.0, queued=3)) == ""  # tasks queued: not idle
    # busy nodes only: nothing to pair with
    feed(bal, [0.0, 0.3, 0.6], busy("b"), busy("c"))
    assert plan(bal, 0.6, busy("b"), busy("c")) == []


def test_the_measured_move_time_is_a_moving_average():
    bal = Balancer(BalanceConfig(default_move_s=0.02))
    assert bal.cost(Candidate(0, 1)) == pytest.approx(0.02)
    bal.moved(0.1)
    assert bal.cost(Candidate(0, 1)) == pytest.approx(0.1)  # the first sample replaces it
    bal.moved(0.02)
    assert 0.02 < bal.cost(Candidate(0, 1)) < 0.1
    assert bal.cost(Candidate(0, 1, state_bytes=100_000_000)) > 1.0


def test_agents_on_nodes_settle_instead_of_shuffling():
    """A model: nodes of one worker, each agent demanding 30% of a worker while it has
    messages (all of them, all the time); a node's busy fraction is min(1, 0.3 x agents).
    Every agent starts on node a; reports come every 0.1 s; a move takes 50 ms before the
    agent counts on its new node.  The agents end spread so that no node is over-full
    while another idles, and no agent moves back and forth."""
    nodes = {"a": list(range(12)), "b": [], "c": []}
    bal = Balancer(BalanceConfig(reports=3, hold_s=0.3, max_per_s=4))
    transit: list[tuple[float, int, str]] = []
    hops: dict[int, int] = {}
    now = 0.0
    while now < 20.0:
        now += 0.1
        for t, aid, dst in [m for m in transit if m[0] <= now]:
            nodes[dst].append(aid)
            transit.remove((t, aid, dst))
        loads = {n: Load(n, 1, busy=min(1.0, 0.3 * len(ags)), active=len(ags))
                 for n, ags in nodes.items()}
        for ld in loads.values():
            bal.report(now, ld)
        if transit:
            continue  # (the client starts no new move while one is in transit)
        for aid, src, dst in bal.plan(now, loads, lambda n: [
                Candidate(a, recent=10) for a in nodes[n]]):
            nodes[src].remove(aid)
            hops[aid] = hops.get(aid, 0) + 1
            transit.append((now + 0.05, aid, dst))
    counts = sorted(len(v) for v in nodes.values())
    assert sum(counts) == 12 and not transit
    assert counts[0] >= 2, nodes  # nobody idles: every node got agents
    assert max(hops.values()) <= 2, hops  # no agent shuffled around
    assert sum(hops.values()) <= 12


# -- the clear-evidence path: a first move sooner, never on a momentary difference ---------


def test_a_clear_imbalance_moves_after_two_busy_reports_and_one_idle_one():
    bal = Balancer(CFG)
    b, i = busy(active=8), idle()
    assert not feed(bal, [0.0], b, i)  # one busy report: never enough
    assert plan(bal, 0.0, b, i) == []
    assert not feed(bal, [0.05], b)  # two, 0.05 s apart: not yet
    assert feed(bal, [0.1], b)  # two spanning 0.1 s, and the idle node's one report
    moves = plan(bal, 0.1, b, i)
    assert len(moves) == 4  # half the gap, as on the slow path (the gain counts 0.35 s more)
    assert [aid for aid, _, _ in moves] == [7, 6, 5, 4]


def test_unclear_reports_take_the_slow_path():
    # a busy node at 0.95 (not clear), or with active agents under twice its workers
    for b in (Load("b", 1, busy=0.95, active=8), Load("b", 2, busy=1.0, active=3)):
        bal = Balancer(CFG)
        assert not feed(bal, [0.0, 0.2, 0.4], b, idle())
        assert feed(bal, [0.5], b, idle())  # three over 0.5 s: the slow path still works
    # an idle node at 0.1 busy, or one that still runs a task, needs its three reports
    for i in (Load("i", 1, busy=0.1), Load("i", 1, busy=0.0, running=1)):
        bal = Balancer(CFG)
        assert not feed(bal, [0.0, 0.2, 0.4], busy(), i)
        assert feed(bal, [0.5], busy(), i)
    # an unclear busy report starts the count of clear ones again
    bal = Balancer(CFG)
    feed(bal, [0.0], busy(), idle())
    feed(bal, [0.1], Load("b", 1, busy=0.93, active=8))
    assert not feed(bal, [0.15, 0.2], busy())
    assert plan(bal, 0.2, busy(), idle()) == []
    assert feed(bal, [0.25], busy())  # 0.15 to 0.25: two clear ones spanning 0.1 s
    # a busy streak that began unclear (its fraction still rising) turns clear later
    bal = Balancer(CFG)
    feed(bal, [0.0, 0.05], Load("b", 1, busy=0.9, active=8), idle())
    assert not feed(bal, [0.1, 0.15], busy())
    assert feed(bal, [0.2], busy())


def test_a_stale_idle_report_is_no_clear_evidence():
    bal = Balancer(CFG)
    bal.report(0.0, idle())
    assert not feed(bal, [1.2, 1.3, 1.5], busy())  # its only report is 1.5 s old
    assert plan(bal, 1.5, busy(), idle()) == []
    bal.report(1.6, idle())
    assert bal.report(1.6, busy()) is True


def test_after_a_clear_move_the_next_waits_for_new_reports():
    bal = Balancer(CFG)
    b, i = busy(active=8), idle()
    feed(bal, [0.0, 0.1], b, i)
    assert len(plan(bal, 0.1, b, i)) == 4
    # the next reports: the busy node still full, the other now half busy (not idle)
    half = Load("i", 1, busy=0.5, active=4)
    assert not feed(bal, [0.3, 0.5, 0.8, 1.2], b, half)
    assert plan(bal, 1.2, b, half) == []
