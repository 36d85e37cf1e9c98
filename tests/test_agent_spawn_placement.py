"""Where new agents start: spread over the workers in turn (stealer/client/agents.py
``AgentClient.place``), skipping only a worker whose task still runs."""

from __future__ import annotations

import collections
import os

import stealer
from tests import agents_lib as L

T = 60


def test_agents_spawned_as_a_result_arrives_spread_over_both_workers(monkeypatch):
    """A worker clears its current word only after it published a task's result; the
    client, woken by that result, spawned agents at once and read the word as "a task
    runs there": all 256 lockstep agents went to the other worker in half of the runs,
    and their 50 us calls never paid for a move back.  The failpoint holds the worker
    in that window for 0.4 s while 8 agents are spawned."""
    monkeypatch.setenv("STEALER_FAILPOINTS", "worker.after_publish=sleep400")
    with stealer.Executor(2) as ex:
        pids = set(ex.worker_pids())
        assert ex.submit(os.getpid).result(T) in pids
        refs = [ex.spawn_agent(L.Where) for _ in range(8)]
        where = collections.Counter(f.result(T) for f in [r.call("pid") for r in refs])
        for r in refs:
            r.stop()
    # in turn: 4 each (5 and 3 seen once in 9 runs: a worker's word read in another
    # short window); the bug put all 8 on one
    assert set(where) == pids and min(where.values()) >= 3, where


def test_a_worker_running_a_task_gets_no_new_agent():
    """The other side of the rule: while a task really runs on a worker, the agents
    spawned meanwhile go to the other one (they would wait for the task to end)."""
    with stealer.Executor(2) as ex:
        pids = set(ex.worker_pids())
        hog = L.hog_one_worker(ex, 0.5)
        refs = [ex.spawn_agent(L.Where) for _ in range(8)]
        where = collections.Counter(f.result(T) for f in [r.call("pid") for r in refs])
        hog.result(T)
        for r in refs:
            r.stop()
    assert len(where) == 1 and sum(where.values()) == 8 and set(where) <= pids
