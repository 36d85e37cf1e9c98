"""A task calls an agent and waits for the reply (Ray's ``ray.get(actor.f.remote())`` in a
task): ``ref.call`` in a task returns a :class:`stealer.forkjoin.TaskCall`, a child of the
task that the agent completes.  A plain task blocks on ``result()`` (its worker runs its own
agents meanwhile: on one worker the agent called lives on the very worker that waits); a
generator task ``yield``s it, alone or with children.  Every test ends with every record
freed: a reply slot left behind would be a leak the size of a record per call.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import stealer
from stealer.forkjoin import TaskCall
from tests import agents_lib as L
from tests.probes import records_in_use

T = 60


def calls_in_plain_task(ref: stealer.AgentRef, n: int) -> list[int]:
    return [ref.call("add", 1).result(T) for _ in range(n)]


def relay_calls(ref: stealer.AgentRef, n: int) -> list[int]:
    return [ref.call("relay", 1).result(T) // 10 for _ in range(n)]


def calls_in_generator(ref: stealer.AgentRef, n: int):
    got = []
    for _ in range(n):
        got.append((yield ref.call("add", 1)))
    return got


def mixed_join(ref: stealer.AgentRef):
    kid, reply = yield [stealer.spawn(pow, 2, 10), ref.call("add", 5)]
    both = yield stealer.call_all([ref, ref], "add", [(1,), (2,)])
    return kid, reply, both


def error_of(ref: stealer.AgentRef, method: str, *args) -> str:
    try:
        ref.call(method, *args).result(T)
    except BaseException as exc:
        return type(exc).__name__
    return "no error"


def error_in_generator(ref: stealer.AgentRef):
    try:
        yield ref.call("boom")
    except ValueError as exc:
        return f"caught {exc}"
    return "no error"


def what_call_returns(ref: stealer.AgentRef) -> tuple[bool, str]:
    c = ref.call("get")
    return isinstance(c, TaskCall), c.result(T) and repr(c)


def times_out(ref: stealer.AgentRef) -> tuple[str, int]:
    c = ref.call("relay", 1)
    try:
        c.result(0.02)
    except TimeoutError:
        what = "timed out"
    else:
        what = "answered"
    return what, c.result(T)  # still answered, later


def stop(ref: stealer.AgentRef) -> None:
    ref.stop()


def stopped_then_called(ref: stealer.AgentRef) -> str:
    return error_of(ref, "get")


def _stop_all(ex: stealer.Executor, refs: list) -> None:
    for r in refs:
        r.stop()
    for r in refs:
        r.result(T)
    assert records_in_use(ex) == 0  # reply slots, messages: all freed


@pytest.mark.parametrize("workers", [1, 2])
def test_plain_and_generator_tasks_get_replies(workers):
    with stealer.Executor(workers) as ex:
        ref = ex.spawn_agent(L.Counter, 0)
        assert ex.submit(calls_in_plain_task, ref, 5).result(T) == [1, 2, 3, 4, 5]
        assert ex.submit(calls_in_generator, ref, 3).result(T) == [6, 7, 8]
        assert ex.submit(mixed_join, ref).result(T) == (1024, 13, [14, 16])
        isa, rep = ex.submit(what_call_returns, ref).result(T)
        assert isa and rep.startswith("<stealer.TaskCall") and rep.endswith("answered>")
        _stop_all(ex, [ref])


def test_many_tasks_call_one_agent_each_call_once():
    """Tasks on both workers call one agent at once: every add is applied exactly once and
    every caller sees its own reply (the n-th add answers n)."""
    with stealer.Executor(2) as ex:
        ref = ex.spawn_agent(L.Counter, 0)
        futs = [ex.submit(calls_in_plain_task, ref, 40) for _ in range(6)]
        futs += [ex.submit(calls_in_generator, ref, 40) for _ in range(6)]
        seen = sorted(v for f in futs for v in f.result(T))
        assert seen == list(range(1, 481))
        assert ref.call("get").result(T) == 480
        _stop_all(ex, [ref])


def test_calls_to_agents_on_the_waiting_worker_and_its_peer():
    """A plain task waits for replies from agents of both workers (one of them its own);
    the agents it calls may themselves call others (their generators are resumed on the
    worker that waits, between its looks at the reply)."""
    with stealer.Executor(2) as ex:
        counters = [ex.spawn_agent(L.Counter, 0) for _ in range(4)]
        relays = [ex.spawn_agent(L.Relay, c) for c in counters]
        fs = [ex.submit(relay_calls, r, 10) for r in relays]
        fs += [ex.submit(calls_in_plain_task, c, 10) for c in counters]
        for f in fs:
            got = f.result(T)
            assert got == sorted(got) and len(set(got)) == 10
        assert sorted(c.call("get").result(T) for c in counters) == [20] * 4
        _stop_all(ex, relays + counters)


def test_errors_reach_the_task():
    with stealer.Executor(1) as ex:
        ref = ex.spawn_agent(L.Counter, 0)
        assert ex.submit(error_of, ref, "boom").result(T) == "ValueError"
        assert ex.submit(error_in_generator, ref).result(T) == "caught boom in a handler"
        assert ex.submit(error_of, ref, "no_such_method").result(T) == "AttributeError"
        ref.stop()
        ref.result(T)
        assert ex.submit(stopped_then_called, ref).result(T) == "AgentStopped"
        assert records_in_use(ex) == 0


def test_calls_waiting_in_a_stopped_agents_mailbox_fail_with_agent_stopped():
    with stealer.Executor(2) as ex:
        ref = ex.spawn_agent(L.Counter, 0, 0.05)
        futs = [ex.submit(error_of, ref, "add", 1) for _ in range(6)]
        ex.submit(stop, ref).result(T)
        outcomes = [f.result(T) for f in futs]
        assert set(outcomes) <= {"no error", "AgentStopped"}
        assert ref.result(T) == f"stopped at {outcomes.count('no error')}"
        assert records_in_use(ex) == 0


def test_full_mailbox_holds_the_task_back_without_losing_a_call():
    """A mailbox of 2 and a slow handler: the tasks' calls wait for room (backpressure);
    none is dropped, none answered twice."""
    with stealer.Executor(2) as ex:
        ref = ex.spawn_agent(L.Counter, 0, 0.002, mailbox=2)
        futs = [ex.submit(calls_in_plain_task, ref, 15) for _ in range(4)]
        futs.append(ex.submit(calls_in_generator, ref, 15))
        assert sorted(v for f in futs for v in f.result(T)) == list(range(1, 76))
        _stop_all(ex, [ref])


def test_a_join_timeout_leaves_the_call_to_be_answered():
    """The relay's turn ends at once (it waits for the slow counter): the join's timeout
    is seen after the counter's 0.2 s turn, which this very worker runs (one worker); the
    reply still comes, and the task's later result() takes it."""
    with stealer.Executor(1) as ex:
        slow = ex.spawn_agent(L.Counter, 0, 0.2)
        ref = ex.spawn_agent(L.Relay, slow)
        assert ex.submit(times_out, ref).result(T) == ("timed out", 10)
        _stop_all(ex, [ref, slow])


def test_the_clients_call_is_a_future_not_a_task_call():
    with stealer.Executor(1) as ex:
        ref = ex.spawn_agent(L.Counter, 0)
        # the client's call: a Future, not a TaskCall
        assert not isinstance(ref.call("get"), TaskCall)
        _stop_all(ex, [ref])


@pytest.mark.kills_workers
@pytest.mark.parametrize("point", ["agent.task_call_before_send", "worker.in_join",
                                   "worker.join_after_nested"])
def test_caller_killed_while_calling(monkeypatch, tmp_path, point):
    """The task's worker dies between setting up the reply slot and sending (the message
    is never sent), or while the task waits for the reply (suspended in a generator, or
    in a blocking join after running an agent's turn): the task runs again and calls
    again (at least once), every task's result comes, and no reply slot is left behind."""
    monkeypatch.setenv("STEALER_FAILPOINTS", f"{point}=kill@3!once")
    monkeypatch.setenv("STEALER_FAILPOINTS_DIR", str(tmp_path))
    with stealer.Executor(2) as ex:
        ref = ex.spawn_agent(L.Counter, 0, 0.002)
        futs = [ex.submit(calls_in_generator, ref, 5) for _ in range(3)]
        futs += [ex.submit(calls_in_plain_task, ref, 5) for _ in range(3)]
        got = [f.result(T) for f in futs]
        assert os.path.exists(tmp_path / point), f"{point} was never reached"
        assert ex._pool.crashes >= 1
        for g in got:
            assert len(g) == 5 and g == sorted(g) and len(set(g)) == 5
        n = ref.call("get").result(T)
        assert 30 <= n <= 60  # each call at least once; a re-run task calls again
        _stop_all(ex, [ref])


def _kill_workers(ex: stealer.Executor, kills: int, every: float, stop: threading.Event,
                  done: list) -> None:
    rng = random.Random(7)
    while len(done) < kills and not stop.wait(every):
        pids = [p for p in ex.worker_pids() if p]
        if pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(rng.choice(pids), signal.SIGKILL)
                done.append(1)


def adds_round_robin(refs: list, n: int) -> list[tuple[int, int]]:
    return [(i % len(refs), refs[i % len(refs)].call("add", 1).result(T)) for i in range(n)]


def adds_round_robin_yielded(refs: list, n: int):
    got = []
    for i in range(n):
        got.append((i % len(refs), (yield refs[i % len(refs)].call("add", 1))))
    return got


@pytest.mark.kills_workers
def test_sigkill_chaos_while_tasks_call_agents():
    """Random SIGKILLs of both workers (one every 0.2 s, at least 3: rounds of 48 tasks
    go on until then) while the tasks call 4 agents: every task's result
    comes (retries are plenty), each task saw its replies from one agent increase (a
    re-run task starts over: at least once), no add an agent answered is lost from its
    count (checkpoint + replay: no reply exceeds the final count), and no reply slot or
    message is left behind."""
    with stealer.Executor(2, retries=20) as ex:
        refs = [ex.spawn_agent(L.Counter, 0, 0.002, checkpoint_every=5) for _ in range(4)]
        stop, killed = threading.Event(), []
        killer = threading.Thread(target=_kill_workers, args=(ex, 6, 0.2, stop, killed))
        killer.start()
        got: list = []
        deadline = time.monotonic() + T
        try:  # rounds of 48 tasks until the killer has killed 3 times at least
            while len(killed) < 3 or not got:
                assert time.monotonic() < deadline, f"{len(killed)} kills in {T} s"
                futs = [ex.submit(adds_round_robin if i % 2 else adds_round_robin_yielded,
                                  refs, 20) for i in range(48)]
                got += [f.result(T) for f in futs]
        finally:
            stop.set()
            killer.join()
        tasks = len(got)
        for g in got:
            assert len(g) == 20
            for k in range(4):
                mine = [v for j, v in g if j == k]
                assert mine == sorted(mine) and len(set(mine)) == len(mine), g
        counts = [r.call("get").result(T) for r in refs]
        # each agent got 5 adds per task run: at least once per task
        assert all(c >= 5 * tasks for c in counts), counts
        top = {k: max(v for g in got for j, v in g if j == k) for k in range(4)}
        assert all(top[k] <= counts[k] for k in range(4)), (top, counts)
        _stop_all(ex, refs)


def test_the_task_calls_benchmark_runs_and_checks_its_counts():
    """benchmarks/task_calls.py at a tiny size: every row, the agents' count checked."""
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "task_calls.py"
    out = subprocess.run([sys.executable, str(script), "--tasks", "2", "--calls", "20",
                          "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)["rows"]
    assert len(rows) == 4 and all(r["calls"] == 40 and r["calls_per_s"] > 0
                                  for r in rows.values()), rows


def forker_from_task(ref: stealer.AgentRef, x: int) -> int:
    return ref.call("work", x).result(T)


def deep_from_task(ref: stealer.AgentRef, x: int) -> int:
    return ref.call("deep", x).result(T)


def test_an_agent_that_forks_while_a_task_waits_for_it():
    """One worker: the task waits for an agent whose handler spawns a child and yields
    it; the child, on this very worker's deque, is run by the waiting join (an agent's
    child: nothing it runs waits for the task) instead of waiting there forever."""
    with stealer.Executor(1) as ex:
        ref = ex.spawn_agent(L.HandlerForker)
        assert ex.submit(forker_from_task, ref, 7).result(T) == 50
        assert ex.submit(calls_in_generator_to, ref, "work", 3).result(T) == [10, 10]
        # the child is a generator suspended on a grandchild: its frame is resumed by
        # the waiting join too (its ping was deferred to the join's end: a hang)
        assert ex.submit(deep_from_task, ref, 7).result(T) == 51
        _stop_all(ex, [ref])


def calls_in_generator_to(ref: stealer.AgentRef, method: str, x: int):
    return [(yield ref.call(method, x)), (yield ref.call(method, x))]


# -- a model: tasks' calls against a sequential oracle -----------------------------------
def run_ops(refs: list, ops: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """A plain task: each op calls agent ``i`` (``i == len(refs)``: all of them at once,
    then joined) to add ``k``; the (agent, k, reply) of every call, in order."""
    out = []
    for i, k in ops:
        targets = range(len(refs)) if i == len(refs) else (i,)
        calls = [refs[j].call("add", k) for j in targets]
        for j, v in zip(targets, stealer.join(calls, timeout=T)):
            out.append((j, k, v))
    return out


def run_ops_yielded(refs: list, ops: list[tuple[int, int]]):
    """:func:`run_ops` as a generator task (an op on all agents: one call_all)."""
    out = []
    for i, k in ops:
        if i == len(refs):
            got = yield stealer.call_all(refs, "add", [(k,)] * len(refs))
            out += [(j, k, v) for j, v in enumerate(got)]
        else:
            out.append((i, k, (yield refs[i].call("add", k))))
    return out


_op = st.tuples(st.integers(0, 3), st.integers(1, 5))
_task = st.tuples(st.booleans(), st.lists(_op, min_size=1, max_size=6))


def test_concurrent_tasks_calls_agree_with_a_sequential_counter():
    """Any mix of plain and generator tasks calling three counters at once (one at a time,
    or all three together) is linearizable: sorted by reply, each agent's replies are the
    running sums of the adds that produced them, from 0, ending at its final count, so
    every call ran exactly once and got its own reply."""

    with stealer.Executor(2) as ex:

        @settings(max_examples=25, deadline=None, derandomize=True,
                  suppress_health_check=[HealthCheck.too_slow])
        @given(st.lists(_task, min_size=1, max_size=5))
        def check(tasks):
            refs = [ex.spawn_agent(L.Counter, 0) for _ in range(3)]
            futs = [ex.submit(run_ops_yielded if gen else run_ops, refs, ops)
                    for gen, ops in tasks]
            got = [v for f in futs for v in f.result(T)]
            finals = [r.call("get").result(T) for r in refs]
            for r in refs:
                r.stop()
            for j in range(3):
                mine = sorted((v, k) for i, k, v in got if i == j)
                total = 0
                for v, k in mine:
                    total += k
                    assert v == total, (j, mine)
                assert finals[j] == total
            for r in refs:
                r.result(T)

        check()
        assert records_in_use(ex) == 0
