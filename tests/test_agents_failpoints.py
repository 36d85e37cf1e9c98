"""Every agent failpoint armed in turn (SIGKILL once, mid-run): every agent still reaches
the final state of a run without the crash, every call is answered, nothing hangs.

The load: a task that keeps one worker busy at first (so the other adopts every agent, and
publishes agents for the first once its task ends: migrations), a slow agent, 24 self-driven
agents whose state is a counter
and a numpy array, checkpointed every 3 events and poked with messages, counters taking
sends and calls (from the client and from tasks that wait for the replies), and agents
stopped at the end.
"""

from __future__ import annotations

import os

import pytest

import stealer
from stealer.shared import failpoints
from tests import agents_lib as L

# agent.inline_turn needs a control agent called during another's step: its own test
# (tests/test_inline_control.py)
AGENT_POINTS = [p for p in failpoints.POINTS
                if p.startswith("agent.") and p != "agent.inline_turn"]
T = 90


def _load(ex: stealer.Executor) -> None:
    hog = L.hog_one_worker(ex, 0.15)  # the other worker adopts every agent: migrations
    slow = ex.spawn_agent(L.Stepper, 6, 0.03, 10, checkpoint_every=2)
    steppers = [ex.spawn_agent(L.Stepper, 16, 0.002, 200, tier="bulk", checkpoint_every=3)
                for _ in range(24)]
    counters = [ex.spawn_agent(L.Counter, 0, checkpoint_every=3) for _ in range(4)]
    calls = []
    # tasks that call agents and wait (agent.task_call_before_send)
    tasks = [ex.submit(L.gets_from_task, counters[0], 3),
             ex.submit(L.gets_from_generator, counters[1], 3)]
    for _round in range(4):
        for s in steppers:
            s.send("poke", 1)
        for c in counters:
            c.send("add", 1)
            calls.append(c.call("add", 0))
    assert slow.result(T) == (6, 60.0, 0)
    assert [s.result(T) for s in steppers] == [(16, 16.0 * 200, 4)] * 24
    for f in calls:
        assert 1 <= f.result(T) <= 4
    for t in tasks:
        got = t.result(T)
        assert len(got) == 3 and got == sorted(got) and set(got) <= {0, 1, 2, 3, 4}
    assert [c.call("get").result(T) for c in counters] == [4] * 4
    for c in counters:
        c.stop()
    assert [c.result(T) for c in counters] == ["stopped at 4"] * 4
    hog.result(T)


@pytest.mark.kills_workers
@pytest.mark.parametrize("point", AGENT_POINTS)
def test_worker_killed_at_agent_failpoint(monkeypatch, tmp_path, point):
    monkeypatch.setenv("STEALER_FAILPOINTS", f"{point}=kill@2!once")
    monkeypatch.setenv("STEALER_FAILPOINTS_DIR", str(tmp_path))
    with stealer.Executor(2) as ex:
        _load(ex)
        assert os.path.exists(tmp_path / point), f"{point} was never reached"
        assert ex._pool.crashes >= 1
        assert ex.stats().client["stray_completions"] == 0
        _load(ex)  # still usable


@pytest.mark.kills_workers
def test_killed_while_stopping_an_agent_with_calls_waiting(monkeypatch, tmp_path):
    """Killed between closing a stopped agent's mailbox and failing the calls in it: the
    restarted agent stops again and every call still gets an answer (none hangs)."""
    point = "agent.finish_after_close"
    monkeypatch.setenv("STEALER_FAILPOINTS", f"{point}=kill!once")
    monkeypatch.setenv("STEALER_FAILPOINTS_DIR", str(tmp_path))
    with stealer.Executor(1) as ex:
        ref = ex.spawn_agent(L.Counter, 0, 0.05, checkpoint_every=1)
        ref.call("add", 1).result(T)
        calls = [ref.call("add", 1) for _ in range(10)]  # ~0.5 s of work queued
        ref.stop()
        outcomes = []
        for f in calls:
            try:
                outcomes.append(f.result(T))
            except stealer.AgentStopped:
                outcomes.append("stopped")
        assert "stopped" in outcomes
        assert isinstance(ref.result(T), str)
        assert os.path.exists(tmp_path / point)
