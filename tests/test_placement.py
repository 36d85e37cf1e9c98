"""The placement rule on its own (stealer/worker/agents/placement.py): an agent moves only when
the expected gain beats twice the measured cost of moving it; no processes here."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from stealer.worker.agents import placement as P

US = 1_000


def test_the_cost_grows_with_the_state_and_has_a_floor():
    assert P.move_cost_ns(0) == P.MOVE_FIXED_NS + 2 * P.DEFAULT_CKPT_NS
    assert P.move_cost_ns(10 * US) < P.move_cost_ns(1000 * US)
    assert P.move_cost_ns(500 * US) == P.MOVE_FIXED_NS + 1000 * US


def test_no_move_to_an_idle_peer_when_the_gain_is_below_the_cost():
    # the lockstep round's tail: one more 0.5 ms call queued behind the running one
    cost = P.move_cost_ns(40 * US)
    assert not P.pays_to_idle(backlog_ns=1000 * US, work_ns=500 * US, cost_ns=cost * 3)
    # a state that takes longer to move than the call takes to run: never
    assert not P.pays_to_idle(backlog_ns=10_000 * US, work_ns=100 * US, cost_ns=200 * US)
    # one agent alone in the backlog: moving it only delays it
    assert not P.pays_to_idle(backlog_ns=500 * US, work_ns=500 * US, cost_ns=cost)


def test_a_real_backlog_moves_to_an_idle_peer():
    cost = P.move_cost_ns(20 * US)  # a small state: 90 us
    assert P.pays_to_idle(backlog_ns=8_000 * US, work_ns=500 * US, cost_ns=cost)


def test_busy_peers_take_half_the_difference_only_when_it_pays():
    cost = P.move_cost_ns(20 * US)
    assert P.moves_to_busy(mine=20, theirs=10, avg_ns=500 * US, cost_ns=cost) == 5
    assert P.moves_to_busy(mine=200, theirs=10, avg_ns=500 * US, cost_ns=cost) == P.MAX_BATCH
    # one apart: nothing to even out
    assert P.moves_to_busy(mine=11, theirs=10, avg_ns=500 * US, cost_ns=cost) == 0
    # short turns, an expensive state: the move costs more than the imbalance
    assert P.moves_to_busy(mine=13, theirs=10, avg_ns=20 * US, cost_ns=P.move_cost_ns(
        400 * US)) == 0


@given(st.integers(0, 10**9), st.integers(1, 10**8), st.integers(1, 10**8))
def test_a_move_to_an_idle_peer_never_lengthens_the_backlog(backlog, work, cost):
    """Whenever the rule says move, the backlog's makespan with the move (the rest here,
    the agent there after the move's cost) is shorter by more than twice the cost."""
    work = min(work, backlog) if backlog else work
    if P.pays_to_idle(backlog, work, cost):
        after = max(backlog - work, cost + work)
        assert backlog - after > 2 * cost


@given(st.integers(0, 500), st.integers(0, 500), st.integers(1, 10**7), st.integers(1, 10**7))
def test_busy_moves_only_from_the_longer_backlog_and_never_overshoot(mine, theirs, avg, cost):
    n = P.moves_to_busy(mine, theirs, avg, cost)
    assert 0 <= n <= P.MAX_BATCH
    if n:
        assert mine > theirs and mine - n >= theirs + n  # never past even
        assert P.gain_to_busy(mine * avg, theirs * avg, avg, cost) > 2 * cost
