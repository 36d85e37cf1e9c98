"""Agents under faults: migration with numpy state, worker SIGKILLs under 200 agents."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

import stealer
from tests import agents_lib as L

T = 120  # seconds: only to turn a hang into a failure


def _run_steppers(ex, n: int, steps: int, work: float, pokes: int, kill: bool):
    refs = [ex.spawn_agent(L.Stepper, steps, work, 500, tier="bulk", checkpoint_every=4)
            for _ in range(n)]
    killed = 0
    for r in range(pokes):
        for ref in refs:
            ref.send("poke", 1)  # accepted messages: each must be applied exactly once
        if kill and r == pokes // 2:
            time.sleep(0.05)
            pid = ex.worker_pids()[0]
            if pid:
                os.kill(pid, signal.SIGKILL)
                killed += 1
    return refs, killed


def test_agents_migrate_with_numpy_state_intact():
    with stealer.Executor(2) as ex:
        migrations = 0
        for _attempt in range(3):  # thieves appear when one worker runs out first
            hog = L.hog_one_worker(ex)
            refs, _ = _run_steppers(ex, 60, 20, 0.001, 2, kill=False)
            hog.result(T)
            assert [r.result(T) for r in refs] == [(20, 20.0 * 500, 2)] * 60
            migrations = ex.stats().totals()["migrations"]
            if migrations:
                break
        assert migrations > 0


@pytest.mark.kills_workers
def test_worker_sigkill_under_200_agents_every_final_state_right():
    with stealer.Executor(2) as ex:
        refs, killed = _run_steppers(ex, 200, 30, 0.0005, 3, kill=True)
        results = [r.result(T) for r in refs]
        assert killed == 1
        assert ex._pool.crashes >= 1
    # Every agent restarted from its checkpoint and replayed its messages: the same final
    # state as a run without a crash (steps are deterministic here).
    assert results == [(30, 30.0 * 500, 3)] * 200


@pytest.mark.kills_workers
def test_message_only_agents_lose_no_accepted_message_when_killed():
    with stealer.Executor(2) as ex:
        refs = [ex.spawn_agent(L.Counter, 0, 0.0002, checkpoint_every=8) for _ in range(20)]
        for r in range(50):
            for ref in refs:
                ref.send("add", 1)
            if r == 25:
                os.kill(ex.worker_pids()[1], signal.SIGKILL)
        assert [ref.call("get").result(T) for ref in refs] == [50] * 20
        for ref in refs:
            ref.stop()
        assert [ref.result(T) for ref in refs] == ["stopped at 50"] * 20


def test_numpy_state_checkpoint_roundtrip_shapes():
    # the checkpoint path pickles numpy out-of-band; a 2-D float32 array survives it
    with stealer.Executor(1) as ex:
        ref = ex.spawn_agent(L.Counter, 0, checkpoint_every=1)
        for _ in range(5):
            ref.send("add", 1)
        assert ref.call("get").result(T) == 5
        ref.stop()
        ref.result(T)
    assert np.float32  # (numpy is a dependency of the agents' state in these tests)


@pytest.mark.kills_workers
def test_step_stuck_in_c_gets_its_worker_killed_and_fails_with_step_timeout():
    with stealer.Executor(2) as ex:
        ok = ex.spawn_agent(L.Counter, 0, checkpoint_every=1)
        ok.call("add", 1).result(T)
        ref = ex.spawn_agent(L.StuckInC, step_timeout=0.1)
        with pytest.raises(stealer.StepTimeout, match="ignored its step_timeout") as ei:
            ref.result(T)
        assert ei.value.agent_id == ref.id
        assert ok.call("add", 1).result(T) == 2  # the other agents go on
        assert ex.submit(sum, [1, 2]).result(T) == 3


@pytest.mark.kills_workers
def test_agent_out_of_retries_fails_its_waiting_calls_instead_of_hanging():
    with stealer.Executor(1) as ex:
        ref = ex.spawn_agent(L.Counter, 0, 0.05, retries=0)
        ref.call("add", 1).result(T)
        futs = [ref.call("add", 1) for _ in range(20)]  # ~1 s of work queued
        time.sleep(0.1)
        os.kill(ex.worker_pids()[0], signal.SIGKILL)
        with pytest.raises(stealer.WorkerCrashedError):
            ref.result(T)
        outcomes = []
        for f in futs:
            try:
                outcomes.append(f.result(T))
            except stealer.AgentStopped:
                outcomes.append("stopped")
            except stealer.WorkerCrashedError:
                outcomes.append("crashed")  # its reply was being stored when the kill came
        assert "stopped" in outcomes  # the ones still queued were failed, none hangs
        with pytest.raises(stealer.AgentStopped):
            ref.send("add", 1)


def test_migration_keeps_the_generation():
    with stealer.Executor(2) as ex:
        for _attempt in range(3):
            hog = L.hog_one_worker(ex)
            refs = [ex.spawn_agent(L.GenReporter, 20, 0.001, checkpoint_every=2)
                    for _ in range(40)]
            assert [r.result(T) for r in refs] == [[0]] * 40
            hog.result(T)
            if ex.stats().totals()["migrations"]:
                break
        assert ex.stats().totals()["migrations"] > 0


@pytest.mark.kills_workers
def test_replay_agrees_with_every_reply_given_before_the_crash():
    """After a worker death, agents replay their messages at the same points between
    steps as the first time: each mark's position, replied before the crash, still holds."""
    with stealer.Executor(2) as ex:
        refs = [ex.spawn_agent(L.Marker, 80, 0.001, checkpoint_every=7) for _ in range(12)]
        replies: list[list[tuple[int, int]]] = [[] for _ in refs]
        for r in range(8):
            futs = [ref.call("mark", r) for ref in refs]
            for i, f in enumerate(futs):
                try:
                    replies[i].append((r, f.result(T)))
                except stealer.AgentStopped:
                    pass  # the agent finished its steps first
            if r == 3:
                os.kill(ex.worker_pids()[0], signal.SIGKILL)
            time.sleep(0.01)
        logs = [ref.result(T) for ref in refs]
        assert ex._pool.crashes >= 1
    for log, reps in zip(logs, replies):
        assert [x for x in log if not isinstance(x, tuple)] == list(range(80))
        for r, pos in reps:
            assert log[pos] == ("m", r), (pos, log)


@pytest.mark.kills_workers
def test_a_call_cancelled_before_it_ran_is_not_run_by_the_replay_either(tmp_path):
    """A cancelled call is skipped, and its message record says so: the agent restarted
    after its worker's death replays what it handled since its checkpoint without it."""
    with stealer.Executor(2) as ex:
        gate = ex.spawn_agent(L.GatedLog, checkpoint_every=1000, checkpoint_seconds=1000)
        started, release = str(tmp_path / "started"), str(tmp_path / "release")
        held = gate.call("hold", started, release)
        end = time.monotonic() + T
        while not os.path.exists(started):
            assert time.monotonic() < end
            time.sleep(0.002)
        queued = [gate.call("note", i) for i in range(4)]
        assert queued[1].cancel() and queued[2].cancel()
        open(release, "w").close()
        assert held.result(T) == "held" and queued[3].result(T) == 2
        pid = gate.call("pid").result(T)
        os.kill(pid, signal.SIGKILL)  # its messages since the spawn are replayed elsewhere
        end = time.monotonic() + T
        while gate.call("pid").result(T) == pid:
            assert time.monotonic() < end, "the agent never restarted"
            time.sleep(0.01)
        assert gate.call("log").result(T) == [0, 3]
        assert ex._pool.crashes >= 1


@pytest.mark.kills_workers
def test_a_worker_killed_while_async_handlers_await_replays_each_effect_once(tmp_path):
    """``async def`` handlers suspended at an ``await`` when their worker is SIGKILLed are
    replayed from the journal as generator handlers are: every call answered, and the
    callee's count and the caller's log each have every relay exactly once."""
    with stealer.Executor(2, journal=str(tmp_path / "j")) as ex:
        counter = ex.spawn_agent(L.Counter)
        relay = ex.spawn_agent(L.AsyncLogger, counter)
        futs = [relay.call("relay", k) for k in range(60)]
        time.sleep(0.03)
        os.kill(ex.worker_pids()[0], signal.SIGKILL)
        got = sorted(f.result(T) for f in futs)
        assert got == list(range(1, 61))
        assert counter.call("get").result(T) == 60
        assert relay.call("log").result(T) == got
        assert ex._pool.crashes >= 1
