"""Agents: the user-facing contract (stealer/agents/), tried as a user would and attacked."""

from __future__ import annotations

import os
import pickle
import threading
import time
from typing import Any

import pytest

import stealer
from stealer.worker.agents.runqueue import RunQueue
from tests import agents_lib as L

T = 60  # seconds: only to turn a hang into a failure


def _started(e: stealer.Executor) -> stealer.Executor:
    """Every worker up: timing tests measure agents, not a worker start on a loaded
    machine (seen: a 0.4 s window in which four hogs ran no step at all)."""
    from stealer.shared.shm import STATE_READY, W_STATE

    pool = e._pool
    deadline = time.monotonic() + T
    while any(pool.region.load32(pool.layout.worker(k) + W_STATE) != STATE_READY
              for k in range(pool.n)):
        assert time.monotonic() < deadline, "the workers never started"
        time.sleep(0.005)
    return e


@pytest.fixture(scope="module")
def ex():
    with stealer.Executor(2) as e:
        yield _started(e)


@pytest.fixture
def ex1():
    with stealer.Executor(1) as e:
        yield _started(e)


# -- the contract ------------------------------------------------------------------
def test_call_send_result_stop(ex):
    ref = ex.spawn_agent(L.Counter, 10)
    assert ref.call("add", 5).result(T) == 15
    for _ in range(50):
        ref.send("add", 1)
    assert ref.call("get").result(T) == 65
    ref.stop()
    assert ref.result(T) == "stopped at 65"
    with pytest.raises(stealer.AgentStopped) as ei:
        ref.send("add", 1)
    assert ei.value.agent_id == ref.id
    with pytest.raises(stealer.AgentStopped):
        ref.call("get").result(T)


def test_every_agent_gives_and_takes_its_state(ex):
    """STATE / SET_STATE (stealer/agents/message.py): what the cluster executor's client
    keeps of an agent, and puts back into a new one after its node was lost."""
    from stealer.agents.message import SET_STATE, STATE

    a = ex.spawn_agent(L.Counter, 10)
    a.call("add", 5).result(T)
    state = a.call(STATE).result(T)
    assert state["n"] == 15 and state["delay"] == 0.0
    b = ex.spawn_agent(L.Counter, 0)
    assert b.call(SET_STATE, state).result(T) is None
    assert b.call("add", 1).result(T) == 16
    assert a.call("add", 1).result(T) == 16  # a's own state was not given away
    c = ex.spawn_agent(L.LockedCounter, 1)  # a state that does not pickle: the call fails
    with pytest.raises(stealer.StealerError):
        c.call(STATE).result(T)
    assert c.call("add", 1).result(T) == 2  # the agent lives on
    for r in (a, b, c):
        r.stop()


def test_stop_reaches_an_agent_in_the_middle_of_a_batch_of_calls(ex1):
    """stop() acts at the next step boundary even while the agent works through a batch
    of queued calls (its turn handles up to MSG_BATCH of them; the stop's ping would wait
    in the worker's inbox until the turn ended): the calls after the current one fail."""
    ref = ex1.spawn_agent(L.Counter, 0, 0.05)  # each call: 50 ms of CPU
    calls = [ref.call("add", 1) for _ in range(10)]  # the first turn takes the first one;
    assert calls[2].result(T) == 3                  # calls 1-9 come as one batch
    ref.stop()
    outcomes = []
    for f in calls[3:]:
        try:
            outcomes.append(f.result(T))
        except stealer.AgentStopped:
            outcomes.append("stopped")
    assert outcomes[2:] == ["stopped"] * 5, outcomes  # at most the call running then ends
    assert ref.result(T).startswith("stopped at ")


def test_self_driven_agents_finish_with_their_value(ex):
    refs = [ex.spawn_agent(L.Stepper, 25) for _ in range(30)]
    assert [r.result(T) for r in refs] == [(25, 25000.0, 0)] * 30


def test_a_step_is_a_message_handler_when_the_class_says_self_driven_false(ex):
    # the reinforcement-learning pattern: env.step(action) called by the client; such an
    # agent is message-only (never stepped by the worker, dormant until a message)
    refs = [ex.spawn_agent(L.GymEnv) for _ in range(40)]
    time.sleep(0.2)  # (a self-driven agent would have stepped meanwhile)
    for k in range(1, 4):
        got = [f.result(T) for f in ex.call_all(refs, "step", [(1.0,)] * len(refs))]
        assert got == [(float(k), k)] * len(refs)
    assert refs[0].call("reset").result(T) == 0
    refs[0].send("step", 2.5)
    assert refs[0].call("step", 0.5).result(T) == (3.0, 2)
    assert [r.call("step", 0.0).result(T)[1] for r in refs[1:]] == [4] * (len(refs) - 1)
    assert stealer.Agent.self_driven is None and L.GymEnv.self_driven is False
    for r in refs:
        r.stop()
    assert refs[1].result(T) is None


def test_a_step_meant_as_a_handler_says_what_to_do(ex):
    # without self_driven = False the worker calls step(ctx): the agent fails at once, and
    # (3.11+) its error carries a note saying what to set
    ref = ex.spawn_agent(L.GymEnvUnmarked)
    with pytest.raises(TypeError, match="Ctx") as ei:
        ref.result(T)
    if hasattr(ei.value, "add_note"):
        assert any("self_driven = False" in n for n in getattr(ei.value, "__notes__", ()))
    with pytest.raises(stealer.AgentStopped, match="result"):
        ref.call("step", 1.0).result(T)
    # a self-driven agent's step is no message: the call says why and what to set
    live = ex.spawn_agent(L.Stepper, 10**6, 0.0005)
    with pytest.raises(AttributeError, match=r"own step.*self_driven = False"):
        live.call("step", 1).result(T)
    with pytest.raises(AttributeError, match="on_stop gives the value"):
        live.call("on_stop").result(T)
    live.stop()
    live.result(T)


def test_handler_exception_goes_to_the_caller_and_the_agent_lives(ex):
    ref = ex.spawn_agent(L.Counter, 1)
    with pytest.raises(ValueError, match="boom in a handler"):
        ref.call("boom").result(T)
    assert ref.call("add", 1).result(T) == 2
    with pytest.raises(AttributeError, match="no message handler 'nope'"):
        ref.call("nope").result(T)
    with pytest.raises(ValueError, match="public method"):
        ref.send("_private")
    ref.stop()
    ref.result(T)


def test_sleep_wait_done(ex):
    ref = ex.spawn_agent(L.Sleeper)
    time.sleep(0.2)  # it sleeps 50 ms, then waits for a message
    assert not ref.future.done()
    # ctx.wait() waits for a message handled after it began: one handled during the sleep
    # (a slow start) does not count, so ping until it has stepped on
    for _ in range(100):
        try:
            assert ref.call("ping").result(T) == "pong"
        except stealer.AgentStopped:
            break  # done meanwhile
        if ref.future.done():
            break
        time.sleep(0.05)
    assert ref.result(T) == 3


def test_errors_carry_agent_and_generation_through_pickle():
    for cls in (stealer.MailboxFull, stealer.StepTimeout, stealer.AgentStopped,
                stealer.DeadlineExceeded):
        e = pickle.loads(pickle.dumps(cls("msg", 0x1234, 7)))
        assert type(e) is cls and str(e) == "msg"
        assert (e.agent_id, e.generation) == (0x1234, 7)
        assert isinstance(e, stealer.AgentError) and isinstance(e, stealer.StealerError)


def test_bad_options_are_clear(ex):
    with pytest.raises(ValueError, match="tier must be one of"):
        ex.spawn_agent(L.Counter, tier="urgent")
    with pytest.raises(ValueError, match="mailbox must be"):
        ex.spawn_agent(L.Counter, mailbox=0)
    with pytest.raises(TypeError, match="unknown options: colour"):
        ex.spawn_agent(L.Counter, colour="red")
    with pytest.raises(TypeError, match="agent class"):
        ex.spawn_agent(lambda: None)


def test_refs_pickle_and_equal(ex):
    ref = ex.spawn_agent(L.Counter)
    ref2 = pickle.loads(pickle.dumps(ref))
    assert ref2 == ref and hash(ref2) == hash(ref)
    assert ref2.call("add", 2).result(T) == 2
    ref.stop()
    ref.result(T)


# -- messages: order, backpressure ---------------------------------------------------------
def test_order_per_sender(ex):
    ref = ex.spawn_agent(L.Counter, mailbox=8)
    senders = 3
    n = 150

    def produce(s: int) -> None:
        for i in range(n):
            ref.send("note", s, i)

    ts = [threading.Thread(target=produce, args=(s,)) for s in range(senders)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(T)
    log = ref.call("log").result(T)
    assert len(log) == senders * n
    for s in range(senders):
        assert [i for (who, i) in log if who == s] == list(range(n))
    ref.stop()
    ref.result(T)


def test_backpressure_bounded_and_nothing_lost(ex):
    cap = 4
    ref = ex.spawn_agent(L.Counter, 0, 0.001, mailbox=cap)
    d = ex._pool.agents.dir
    peak = 0
    for _ in range(200):
        ref.send("add", 1)  # blocks while full
        peak = max(peak, d.count(ref.id)[0])
    assert peak <= cap
    assert ref.call("get").result(T) == 200
    ref.stop()
    ref.result(T)


def test_mailbox_full_nonblocking_and_timeout(ex1):
    ref = ex1.spawn_agent(L.Counter, 0, 0.2, mailbox=2)
    ref.send("add", 1)
    ref.send("add", 1)
    ref.send("add", 1)  # the first may have been taken already: fill it for sure
    with pytest.raises(stealer.MailboxFull) as ei:
        for _ in range(5):
            ref.send("add", 1, block=False)
    assert ei.value.agent_id == ref.id
    with pytest.raises(stealer.MailboxFull, match="stayed full"):
        for _ in range(5):
            ref.send("add", 1, timeout=0.01)
    ref.stop()
    ref.result(T)


# -- agents talking to agents --------------------------------------------------------------
def test_call_between_agents_by_yield(ex):
    counter = ex.spawn_agent(L.Counter, 0)
    caller = ex.spawn_agent(L.Caller, counter, 20)
    assert caller.result(T) == sum(range(20))
    relay = ex.spawn_agent(L.Relay, counter)
    assert relay.call("relay", 5).result(T) == (sum(range(20)) + 5) * 10
    for r in (counter, relay):
        r.stop()
        r.result(T)


def test_a_call_that_closes_a_cycle_is_refused_and_says_the_cycle(ex):
    """A generator handler (or step) waiting on a call cannot handle messages: a call back
    into the chain would wait forever; it raises AgentDeadlock at the call instead."""
    a, b, c = (ex.spawn_agent(L.Hop) for _ in range(3))
    a.call("link", b).result(T)
    b.call("link", a).result(T)
    assert a.call("hop", 1).result(T) == 1  # a -> b: no cycle
    with pytest.raises(stealer.AgentDeadlock) as info:
        a.call("hop", 2).result(T)  # a -> b -> a
    assert f"the calls {a.id:#x} -> {b.id:#x} -> {a.id:#x} form a cycle" \
        in str(info.value)
    assert info.value.agent_id == b.id  # raised in b, at its call
    with pytest.raises(stealer.AgentDeadlock, match="called itself"):
        a.call("fan", [c, a]).result(T)  # call_all with itself among the targets
    assert c.call("poke").result(T) == 1  # ... refused before any was sent (c got no hop)
    # a three-agent chain works, and its cycle is refused at its third call
    b.call("link", c).result(T)
    c.call("link", a).result(T)
    assert a.call("hop", 2).result(T) == 2  # a -> b -> c
    with pytest.raises(stealer.AgentDeadlock, match="form a cycle"):
        a.call("hop", 3).result(T)  # a -> b -> c -> a
    assert b.call("caught", 2).result(T) == "caught: AgentDeadlock"  # b -> c -> a -> b
    for r in (a, b, c):  # every agent lives on and answers
        assert r.call("poke").result(T) >= 1
        r.stop()
        r.result(T)


def test_a_call_back_to_an_agent_that_did_not_wait_is_no_cycle(ex):
    """A plain handler's call (not yielded) leaves its agent free: the callee may call it
    back (it is not in the callee's chain)."""
    a, b = ex.spawn_agent(L.Caller2), ex.spawn_agent(L.Backer)
    assert a.call("fire", b, a).result(T) == "fired"
    end = time.monotonic() + T
    while a.call("seen").result(T) != ["back"]:
        assert time.monotonic() < end, "the call back never came"
        time.sleep(0.01)


def test_a_step_waiting_on_a_call_is_in_the_chain(ex):
    other = ex.spawn_agent(L.Hop)
    stepper = ex.spawn_agent(L.HopStep)
    other.call("link", stepper).result(T)
    stepper.send("go", other)
    with pytest.raises(stealer.AgentDeadlock, match="form a cycle"):
        stepper.result(T)  # its step's call reached other, whose call back was refused
    assert other.call("poke").result(T) == 1
    other.stop()
    other.result(T)


def _wait_file(path: str) -> None:
    end = time.monotonic() + T
    while not os.path.exists(path):
        assert time.monotonic() < end, f"{path} never came"
        time.sleep(0.002)


def test_a_cancelled_call_never_runs_and_a_started_one_cannot_be_cancelled(ex, tmp_path):
    """A Future's contract: cancel() is True only for a call that will not run (it ran
    anyway, its reply dropped), False once its handler started (it said True)."""
    gate = ex.spawn_agent(L.GatedLog)
    started, release = str(tmp_path / "started"), str(tmp_path / "release")
    held = gate.call("hold", started, release)
    _wait_file(started)
    assert not held.cancel() and not held.cancelled()  # its handler runs
    queued = [gate.call("note", i) for i in range(5)]
    assert [f.cancel() for f in queued[1::2]] == [True, True]  # 1 and 3
    open(release, "w").close()
    assert held.result(T) == "held"
    assert [queued[i].result(T) for i in (0, 2, 4)] == [1, 2, 3]
    assert gate.call("log").result(T) == [0, 2, 4]  # the cancelled ones never ran
    gate.stop()
    gate.result(T)


def test_a_journaled_call_cannot_be_cancelled_and_runs(tmp_path):
    """The journal holds a call from the start (a recovery would run it): cancel() says
    False and the reply comes."""
    with stealer.Executor(1, journal=str(tmp_path / "j")) as ex:
        gate = ex.spawn_agent(L.GatedLog, name="g")
        started, release = str(tmp_path / "started"), str(tmp_path / "release")
        held = gate.call("hold", started, release)
        _wait_file(started)
        queued = gate.call("note", 7)
        assert not queued.cancel() and not held.cancel()
        open(release, "w").close()
        assert held.result(T) == "held" and queued.result(T) == 1
        assert gate.call("log").result(T) == [7]


def test_spawn_agents_and_children_from_inside(ex):
    assert ex.spawn_agent(L.Spawner).result(T) == sum(i + 1 for i in range(5))
    assert ex.spawn_agent(L.Forker).result(T) == sum(i * i for i in range(10))


# -- supervision and time ----------------------------------------------------------------------
def test_restart_on_failure_and_never(ex):
    ok = ex.spawn_agent(L.Flaky, 3, restart="on-failure")
    # the restarted agent starts from scratch (generation 1) and fails no more at count 3?
    # It does fail again at 3: max_restarts bounds it.
    with pytest.raises(RuntimeError, match="flaky at 3"):
        ok.result(T)
    never = ex.spawn_agent(L.Flaky, 2)
    with pytest.raises(RuntimeError, match=r"flaky at 2 \(generation 0\)"):
        never.result(T)


def test_restart_intensity_allows_max_restarts(ex):
    ref = ex.spawn_agent(L.Flaky, 2, restart="on-failure", max_restarts=2)
    with pytest.raises(RuntimeError, match=r"generation 2\)"):  # 2 restarts, then failed
        ref.result(T)


def test_step_timeout_in_python_code(ex):
    ref = ex.spawn_agent(L.Looper, step_timeout=0.2)
    with pytest.raises(stealer.StepTimeout) as ei:
        ref.result(T)
    assert ei.value.agent_id == ref.id
    # the worker survived and runs others
    assert ex.submit(sum, [1, 2]).result(T) == 3


def test_deadline_exceeded(ex):
    ref = ex.spawn_agent(L.Hog, 0.01, deadline=0.2)
    with pytest.raises(stealer.DeadlineExceeded):
        ref.result(T)
    q = ex.spawn_agent(L.Counter, 0, 0.3)
    q.send("add", 1)  # 0.3 s of work ahead of the call
    f = q.options(deadline=0.05).call("add", 1)
    with pytest.raises(stealer.DeadlineExceeded):
        f.result(T)
    q.stop()
    q.result(T)


# -- scheduling: tiers, fairness, blocking -----------------------------------------------------
def test_runqueue_tiers_edf_round_robin():
    class E:
        def __init__(self, name, deadline=None):
            self.name = name
            self.deadline = deadline

    rq = RunQueue()
    b1, b2 = E("b1"), E("b2")
    i1, i2 = E("i1"), E("i2")
    d_late, d_soon = E("late", 20.0), E("soon", 10.0)
    c1 = E("c1")
    for e, t in ((b1, 2), (i1, 1), (b2, 2), (d_late, 1), (i2, 1), (d_soon, 1), (c1, 0)):
        rq.push(e, t)
    order = []
    while rq.n:
        e = rq.pop()
        order.append(e.name)
        if e.name == "i1" and order.count("i1") < 2:
            rq.push(e, 1)  # wants another turn: to the back of its tier
    assert order == ["c1", "soon", "late", "i1", "i2", "i1", "b1", "b2"]


def test_control_call_overtakes_bulk_flood(ex1):
    hogs = [ex1.spawn_agent(L.Hog, 0.005, tier="bulk") for _ in range(6)]
    quick = ex1.spawn_agent(L.Quick, tier="control")
    quick.call("hit", time.monotonic()).result(T)  # the worker is up and the hogs spawned
    deadline = time.monotonic() + T
    while min(h.call("count").result(T) for h in hogs) < 1:  # every hog has stepped
        assert time.monotonic() < deadline
    waits = [quick.call("hit", time.monotonic()).result(T) for _ in range(11)]
    counts = [h.call("count").result(T) for h in hogs]
    for h in [*hogs, quick]:
        h.stop()
    for h in [*hogs, quick]:
        h.result(T)
    # a FIFO would wait behind every hog's step (6 x 5 ms) each time; tiers wait at most
    # for the step in progress (5 ms). The median, so that one stall of a shared machine
    # does not decide it.
    assert sorted(waits)[5] < 3 * 0.005, (waits, counts)


def test_no_starvation_within_a_tier(ex1):
    hogs = [ex1.spawn_agent(L.Hog, 0.002, tier="bulk") for _ in range(4)]
    time.sleep(0.4)
    for h in hogs:
        h.stop()
    counts = [h.result(T) for h in hogs]
    assert min(counts) > 0
    assert max(counts) - min(counts) <= 2, counts  # round-robin: one turn each per round


def test_async_def_handlers_and_steps_await_what_generators_yield(ex):
    counter = ex.spawn_agent(L.Counter)
    relay = ex.spawn_agent(L.AsyncRelay, counter)
    assert relay.call("relay", 5).result(T) == (5, [6, 8], 25)  # call, call_all, spawn
    assert relay.call("catch").result(T) == "caught boom in a handler"
    with pytest.raises(RuntimeError, match="no running event loop") as ei:
        relay.call("uses_asyncio").result(T)
    if hasattr(ei.value, "add_note"):  # 3.11+: the note says where it runs and what to do
        assert "not in an asyncio event loop" in "".join(ei.value.__notes__)
    # stealer.gather: what `yield [p1, p2]` does, for a coroutine (a mailbox is in order:
    # add's reply, then get's, which sees the add)
    assert relay.call("gathered", 3).result(T) == (8 + 3, 8 + 3, [9, 16])
    assert relay.call("gathered_gen", 0).result(T) == (11, 11, [0, 1])  # (yielded too)
    with pytest.raises(TypeError, match="not both"):
        relay.call("mixed").result(T)
    walker = ex.spawn_agent(L.AsyncWalker, counter, 20)
    assert walker.result(T) == (9, 20, "slept")  # 11 + 9 steps of +1 each
    assert relay.call("relay", 1).result(T) == (21, [22, 24], 1)  # it lived on
    for r in (relay, counter):
        r.stop()
    for r in (relay, counter):
        r.result(T)


def test_an_async_on_stop_gives_the_final_value_and_may_not_wait(ex):
    plain = ex.spawn_agent(L.AsyncStopper)
    assert plain.call("add", 2).result(T) == 2
    with pytest.raises(TypeError, match="not NoneType") as ei:
        plain.call("yields_to_asyncio").result(T)  # asyncio.sleep(0)'s bare yield
    if hasattr(ei.value, "add_note"):
        assert "return from the step" in "".join(ei.value.__notes__)
    plain.stop()
    assert plain.result(T) == "stopped at 2"
    counter = ex.spawn_agent(L.Counter)
    waits = ex.spawn_agent(L.AsyncStopper, counter)
    waits.stop()
    with pytest.raises(TypeError, match="on_stop is `async def` and awaited"):
        waits.result(T)
    counter.stop()
    counter.result(T)


def test_a_pending_call_inside_an_agent_is_not_a_future(ex):
    counter = ex.spawn_agent(L.Counter)
    relay = ex.spawn_agent(L.AsyncRelay, counter)
    for method in ("blocks", "polls"):
        with pytest.raises(stealer.AgentError, match=r"not a Future.*yield ref\.call"):
            relay.call(method, 1).result(T)
    assert relay.call("relay", 0).result(T)[1][1] > 0  # the agent goes on
    relay.stop()
    counter.stop()
    relay.result(T)
    counter.result(T)


def test_named_agents_without_a_journal_are_found_by_name(ex):
    """As Ray's named actors: ``name=`` without a journal names the agent while it lives;
    ``ex.agent(name)`` finds it, a second live agent of that name is refused, an ended
    one's name is free again, and the names of ended agents do not pile up."""
    a = ex.spawn_agent(L.Counter, 5, name="counter-a")
    assert ex.agent("counter-a") == a
    assert ex.agent("counter-a").call("add", 1).result(T) == 6
    with pytest.raises(ValueError, match="already has an agent named 'counter-a'"):
        ex.spawn_agent(L.Counter, name="counter-a")
    for bad in ("", 7):
        with pytest.raises(ValueError, match="name"):
            ex.spawn_agent(L.Counter, name=bad)
    assert "counter-a" in ex.agents()
    with pytest.raises(stealer.AgentNotFound, match=r"'nope' in this executor.*counter-a"):
        ex.agent("nope")
    with pytest.raises(TypeError, match="init_kwargs"):
        ex.spawn_agent(L.Counter, start=3)  # (the agent's keywords: init_kwargs)
    ex.agent("counter-a").stop()
    assert a.result(T) == "stopped at 6"
    assert ex.agent("counter-a").result(T) == "stopped at 6"  # a finished agent's value
    b = ex.spawn_agent(L.Counter, 1, name="counter-a")  # an ended agent's name is free
    assert ex.agent("counter-a") == b != a and b.call("get").result(T) == 1
    c = ex._pool.agents  # (white box: the names of ended agents are dropped)
    many = [ex.spawn_agent(L.Counter, name=f"n{i}") for i in range(70)]
    for r in many:
        r.stop()
    for r in many:
        r.result(T)
    more = [ex.spawn_agent(L.Counter, name=f"m{i}")  # up to the size that prunes the names
            for i in range(c.names_prune_at - len(c.live_names))]
    assert not any(n.startswith("n") for n in c.live_names), sorted(c.live_names)
    assert {"counter-a", *(f"m{i}" for i in range(len(more)))} == set(c.live_names)
    for r in (b, *more):
        r.stop()


def test_run_blocking_does_not_stall_the_worker(ex1):
    blocker = ex1.spawn_agent(L.Blocker, 0.5)
    time.sleep(0.05)
    fast = ex1.spawn_agent(L.Finisher, 10, 0.001)
    t_fast = fast.result(T)
    value, took, t_block = blocker.result(T)
    assert value == "slept" and took >= 0.5
    assert t_fast < t_block  # ran while the blocker waited for its thread


def test_throttling_keeps_a_light_agent_ahead_of_a_hog(ex1):
    hog = ex1.spawn_agent(L.Hog, 0.005, cpu_share=0.2)  # interactive, but over its share
    time.sleep(0.3)
    light = ex1.spawn_agent(L.Quick)  # interactive too
    others = [ex1.spawn_agent(L.Hog, 0.005, tier="bulk") for _ in range(2)]
    time.sleep(0.1)
    waits = [light.call("hit", time.monotonic()).result(T) for _ in range(10)]
    assert ex1.stats().totals()["throttled"] > 0
    for a in [hog, light, *others]:
        a.stop()
    for a in [hog, light, *others]:
        a.result(T)
    assert max(waits) < 0.2


def test_a_long_batch_of_messages_lets_the_other_agents_in(ex1):
    """An agent with 16 slow messages waiting does not hold its worker for all 16: past
    MSG_SLICE_NS its batch ends at a message boundary and the other runnable agents get
    their turn (16 handlers of 3 s each once held a worker for 48 s)."""
    hold, a, b = (ex1.spawn_agent(L.Timed), ex1.spawn_agent(L.Timed),
                  ex1.spawn_agent(L.Stamp))
    for r in (hold, a):
        r.call("work", 0).result(T)
    b.call("hit").result(T)
    busy = hold.call("work", 0.2)  # the one worker is inside this handler for 200 ms...
    time.sleep(0.05)
    fa = [a.call("work", 0.02) for _ in range(16)]  # ...while a's 16 and b's 1 arrive
    fb = b.call("hit")
    tb = fb.result(T)
    ta = [f.result(T) for f in fa]
    assert busy.result(T) < ta[0]
    assert tb < ta[2], (tb, ta)  # b ran after a's first message or two, not after 16
    for r in (hold, a, b):
        r.stop()


def test_an_agent_notified_during_a_long_batch_gets_its_turn(ex1):
    """As above, but the other agent's message comes while the batch already runs (its
    notification waits in the worker's inbox, read only between turns): the batch still
    ends at a message boundary past MSG_SLICE_NS."""
    hold, a, b = (ex1.spawn_agent(L.Timed), ex1.spawn_agent(L.Timed),
                  ex1.spawn_agent(L.Stamp))
    for r in (hold, a):
        r.call("work", 0).result(T)
    b.call("hit").result(T)
    busy = hold.call("work", 0.2)
    time.sleep(0.05)
    fa = [a.call("work", 0.02) for _ in range(16)]  # pending when a's turn starts
    busy.result(T)
    time.sleep(0.03)  # a's batch is running now
    tb = b.call("hit").result(T)
    ta = [f.result(T) for f in fa]
    assert tb < ta[8], (tb, ta)  # not after all 16 (320 ms)
    for r in (hold, a, b):
        r.stop()


def test_unpicklable_state_stays_put_and_works(ex):
    ref = ex.spawn_agent(L.Unpicklable, checkpoint_every=10)
    assert ref.result(T) == 100


def test_shutdown_stops_agents():
    with stealer.Executor(2) as ex:
        hogs = [ex.spawn_agent(L.Hog, 0.001) for _ in range(3)]
        counter = ex.spawn_agent(L.Counter, 7)
    assert [isinstance(h.result(T), int) for h in hogs] == [True] * 3
    assert counter.result(T) == "stopped at 7"


def test_stats_and_top_show_agents(ex):
    from stealer import top

    busy = ex.spawn_agent(L.Hog, 0.002)
    idle = ex.spawn_agent(L.Counter, 0)
    idle.call("add", 1).result(T)
    time.sleep(0.2)
    st = ex.stats()
    assert st.agents_live >= 2
    assert st.busiest_agents[0].id == busy.id and st.busiest_agents[0].steps > 0
    assert st.busiest_agents[0].cpu_ms > 0
    ids = {a.id: a for a in st.busiest_agents}
    assert ids[idle.id].messages == 1 and ids[idle.id].worker in (0, 1)
    assert st.totals()["agent_steps"] > 0
    frame = top.render(None, st, width=200)
    assert "busiest agents" in frame and f"{busy.id:#018x}" in frame
    assert st.as_dict()["busiest_agents"][0]["id"] == busy.id
    for r in (busy, idle):
        r.stop()
        r.result(T)


def test_unpicklable_agent_frees_its_handled_messages():
    # a stateless checkpoint covers the handled messages: 2,000 messages through 256 records
    with stealer.Executor(1, records=256) as ex:
        ref = ex.spawn_agent(L.LockedCounter, 0, checkpoint_every=16)
        for _ in range(2000):
            ref.send("add", 1)
        assert ref.call("get").result(T) == 2000
        ref.stop()
        assert ref.result(T) == "stopped at 2000"


def test_stopping_a_suspended_agent_leaves_no_record_behind():
    from tests.probes import records_in_use

    with stealer.Executor(2) as ex:
        slow = ex.spawn_agent(L.Counter, 0, 0.3)
        caller = ex.spawn_agent(L.Caller, slow, 3)  # suspended in `yield slow.call(...)`
        time.sleep(0.1)
        caller.stop()
        assert caller.result(T) is None  # Caller has no on_stop
        assert slow.call("get").result(T) >= 0  # the callee goes on
        slow.stop()
        slow.result(T)
        assert records_in_use(ex) == 0  # reply slots, messages, checkpoints: all freed


def test_a_mixed_agent_workload_frees_every_record():
    from tests.probes import records_in_use

    with stealer.Executor(2) as ex:
        counter = ex.spawn_agent(L.Counter, 0, checkpoint_every=2)
        refs = [ex.spawn_agent(L.Stepper, 10, 0.0005, 100, checkpoint_every=3)
                for _ in range(10)]
        refs += [ex.spawn_agent(L.Caller, counter, 5), ex.spawn_agent(L.Spawner),
                 ex.spawn_agent(L.Forker), ex.spawn_agent(L.Sleeper),
                 ex.spawn_agent(L.Flaky, 2, restart="on-failure")]
        for r in refs[:10]:
            r.send("poke", 2)
        while not refs[-2].future.done():  # ping the Sleeper until it has stepped on
            try:
                refs[-2].call("ping").result(T)
            except stealer.AgentStopped:
                break
            time.sleep(0.05)
        for r in refs:
            try:
                r.result(T)
            except RuntimeError:
                pass  # Flaky, out of restarts
        counter.stop()
        counter.result(T)
        assert records_in_use(ex) == 0


def test_an_idle_worker_never_waits_for_a_long_step_to_get_waiting_agents(ex):
    if not ex._pool.native:
        pytest.skip("preemptive publication needs the native queues")
    # The long stepper's worker adopts one of the agents it spawned before its 1.5 s step;
    # the others are stolen as records. The idle peer asks for the adopted one by signal
    # and runs it: every spawned agent ends before the long step does.
    ref = ex.spawn_agent(L.LongStepper, 6, 1.5)
    kids, long_end = ref.result(T)
    ends = [k.result(T) for k in kids]
    assert max(ends) < long_end, (ends, long_end)


def test_a_worker_says_it_runs_a_step_only_while_one_runs(ex, tmp_path):
    """Idle peers ask a worker for a waiting agent (SIGUSR1, Host.poke_peers) only while its
    W_IN_STEP word says a step runs there: a message handler never takes the request, and a
    poke at the end of each lockstep round only interrupted handlers."""
    from stealer.shared.shm import W_IN_STEP

    pool = ex._pool

    def in_step() -> list[int]:
        return [pool.region.load32(pool.layout.worker(k) + W_IN_STEP) for k in range(2)]

    def hold(ref: Any, how: str) -> list[int]:
        started, release = str(tmp_path / f"{how}0"), str(tmp_path / f"{how}1")
        if how == "step":
            ref = ex.spawn_agent(L.Gate, (started, release))
            f = None
        else:
            f = ref.call("hold", started, release)
        end = time.monotonic() + T
        while not os.path.exists(started):
            assert time.monotonic() < end
            time.sleep(0.001)
        seen = in_step()
        open(release, "w").close()
        if f is not None:
            assert f.result(T) == "held"
        return seen

    a = ex.spawn_agent(L.Gate)
    assert hold(a, "call") == [0, 0]  # a handler runs: no step
    assert sorted(hold(None, "step")) == [0, 1]  # the step's worker says so, the other not
    end = time.monotonic() + T
    while in_step() != [0, 0]:  # and says so no more once it ended
        assert time.monotonic() < end
        time.sleep(0.001)


def test_a_stale_ref_never_reaches_the_agent_that_reuses_its_slot():
    with stealer.Executor(1, records=16) as ex:
        old = ex.spawn_agent(L.Counter, 0)
        old.stop()
        old.result(T)
        new = None
        for _ in range(50):  # find the agent that got the old one's record slot
            r = ex.spawn_agent(L.Counter, 100)
            if r.id & 0xFFFFFFFF == old.id & 0xFFFFFFFF:
                new = r
                break
            r.stop()
            r.result(T)
        assert new is not None and new.id != old.id  # same slot, next generation
        with pytest.raises(stealer.AgentStopped):
            old.send("add", 1)
        with pytest.raises(stealer.AgentStopped):
            old.call("add", 1).result(T)
        assert new.call("get").result(T) == 100  # nothing of the old ref's arrived
        new.stop()
        new.result(T)


def test_an_idle_agent_fits_its_record(ex):
    """A default spawn names its class by id: its payload stays in the record's inline
    bytes, so a million idle agents need no payload blocks (and no overflow files)."""
    import struct

    from stealer.shared._layout import R_PCLASS

    ref = ex.spawn_agent(L.Counter, 12345)
    ref.call("get").result(T)
    a = ex._pool.arena
    assert struct.unpack_from("=I", a.mm, a.off(ref.id) + R_PCLASS)[0] == 0  # inline
    ref.stop()
    ref.result(T)


def test_runqueue_counts_control_tier():
    class E:
        deadline = None

    rq = RunQueue()
    a, b, c = E(), E(), E()
    rq.push(a, 0)
    rq.push(b, 2)
    rq.push(c, 0)
    assert (rq.n, rq.n0) == (3, 2)
    rq.remove(c)
    assert (rq.n, rq.n0) == (2, 1)
    assert rq.pop() is a and rq.n0 == 0
    assert rq.pop() is b and rq.n == 0


def test_a_task_sending_to_a_full_mailbox_on_its_own_worker_does_not_hang(ex1):
    ref = ex1.spawn_agent(L.Counter, 0, 0.001, mailbox=2)
    ref.call("get").result(T)  # it lives on the only worker
    assert ex1.submit(L.send_many, ref, 30).result(T) == 30  # queued, not waited for
    deadline = time.monotonic() + T
    while ref.call("get").result(T) < 30 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ref.call("get").result(T) == 30
    ref.stop()
    ref.result(T)


def test_sleeping_agents_that_migrate_are_not_rescheduled_by_a_stale_timer():
    """A sleeping agent woken by a message and then handed to a peer left its timer on the
    old worker; the timer rescheduled it there and publish_one crashed that worker ("its
    record left RUNNING").  A ring of stepping, sleeping, messaging, calling agents (no
    journal) must end in its crash-free states with no worker replaced."""
    from tests import journal_lib as J

    n = 60
    with stealer.Executor(2) as ex:
        refs = [ex.spawn_agent(J.RingAgent, i, mailbox=256) for i in range(n)]
        for i, r in enumerate(refs):
            r.send("link", refs[(i + 1) % n])
        end = time.monotonic() + 60
        while True:
            st = {i: refs[i].call("state").result(30) for i in range(n)}
            if all(s[1] == J.K and s[3] >= J.K for s in st.values()) or time.monotonic() > end:
                break
            time.sleep(0.05)
        assert ex.stats().client["replacements"] == 0
    assert st == J.expected(n)
