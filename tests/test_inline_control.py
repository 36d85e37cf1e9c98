"""Control-tier messages handled inside a running step of another agent (agents/inline.py):
the handler runs between two bytecodes of the step; never for the agent that is mid-step;
a kill inside the nested turn loses and duplicates nothing; the interrupted step's
step_timeout still fires."""

from __future__ import annotations

import os
import time

import pytest

import stealer
from stealer.shared import queues as _queues
from tests import agents_lib as L

T = 60  # seconds: only to turn a hang into a failure

pytestmark = pytest.mark.skipif(not _queues.impl.NATIVE,
                                reason="inline control turns need the native queues")


def _inline_turns(ex) -> int:
    """The workers' inline_controls counter, once published (a worker publishes its
    counters when it parks, or every 50 ms of agent turns)."""
    end = time.monotonic() + 10
    while True:
        n = ex.stats().totals()["inline_controls"]
        if n or time.monotonic() > end:
            return n
        time.sleep(0.02)


def _adopted(ref) -> None:
    ref.call("get").result(T)  # adopted: it lives on a worker now


def test_a_control_call_is_answered_inside_another_agents_step():
    with stealer.Executor(1) as ex:
        ctl = ex.spawn_agent(L.Stamp, tier="control")
        _adopted(ctl)
        bulk = ex.spawn_agent(L.Spans, 2, 0.6, tier="bulk")
        time.sleep(0.2)  # the bulk agent is in its first step (0.6 s)
        ran = ctl.call("hit").result(T)
        spans = bulk.result(T)
        assert any(s < ran < e for s, e in spans), (ran, spans)
        assert _inline_turns(ex) >= 1
        ctl.stop()


def test_a_control_signal_that_lands_before_a_steps_user_code_is_not_kept_for_the_step(
        monkeypatch, tmp_path):
    """The sender signals once, when it sees the owner in a turn.  A signal that lands
    while that turn is still being set up (W_IN_STEP set, the step's user code not
    running yet: inline.on_signal ignores it there) must not leave the control message
    waiting for the whole step: it is handled when the step's user code starts.  A
    failpoint holds the worker 0.8 s in that window, where the client sends the call."""
    from stealer.shared.shm import W_IN_STEP

    monkeypatch.setenv("STEALER_FAILPOINTS", "agent.step_enter=sleep800")
    monkeypatch.setenv("STEALER_FAILPOINTS_DIR", str(tmp_path))
    with stealer.Executor(1) as ex:
        pool = ex._pool
        ctl = ex.spawn_agent(L.Stamp, tier="control")
        _adopted(ctl)
        bulk = ex.spawn_agent(L.Spans, 1, 1.0, tier="bulk")
        word = pool.layout.worker(0) + W_IN_STEP
        end = time.monotonic() + T
        while not pool.region.load32(word):  # the bulk step's turn began: held 0.8 s
            assert time.monotonic() < end, "the bulk agent never stepped"
            time.sleep(0.001)
        sent = time.monotonic()
        ran = ctl.call("hit").result(T)
        ((start, stop),) = bulk.result(T)
        assert sent < start, "the call was not sent inside the held window"
        assert ran < stop, (sent, ran, start, stop)  # not after the whole step
        ctl.stop()


def test_a_control_message_sent_before_a_turn_marks_itself_is_not_kept_for_the_step(
        monkeypatch, tmp_path):
    """The sender signals only if it sees the owner in a turn (W_CURRENT).  A control
    message pushed after the worker loop last looked at its inbox, but before the next
    turn stores W_CURRENT, gets no signal: the owner itself must see it when that turn's
    step starts, not after the whole step.  A failpoint holds the worker 0.8 s at the
    bulk agent's first turn, before it stores W_CURRENT; the client sends the call there."""
    monkeypatch.setenv("STEALER_FAILPOINTS", "agent.turn_enter=sleep800@2!once")
    monkeypatch.setenv("STEALER_FAILPOINTS_DIR", str(tmp_path))
    with stealer.Executor(1) as ex:
        ctl = ex.spawn_agent(L.Stamp, tier="control")
        _adopted(ctl)  # its turn is the failpoint's first hit
        bulk = ex.spawn_agent(L.Spans, 1, 1.0, tier="bulk")
        fired = tmp_path / "agent.turn_enter"
        end = time.monotonic() + T
        while not fired.exists():  # the bulk agent's first turn is held (second hit)
            assert time.monotonic() < end, "the bulk agent's turn never began"
            time.sleep(0.001)
        sent = time.monotonic()
        ran = ctl.call("hit").result(T)
        ((start, stop),) = bulk.result(T)
        assert sent < start, "the call was not sent inside the held window"
        assert ran < stop, (sent, ran, start, stop)  # not after the whole step
        ctl.stop()


def test_a_control_signal_during_a_steps_api_call_is_handled_when_the_call_returns():
    """A signal that lands while the running step is inside stealer's API (here a send
    whose argument takes 0.8 s to pickle) is held back there (in_api), and handled as soon
    as that call returns to the step's user code, not at the step's end."""
    from stealer.shared.shm import W_IN_STEP

    with stealer.Executor(1) as ex:
        pool = ex._pool
        ctl = ex.spawn_agent(L.Stamp, tier="control")
        _adopted(ctl)
        sink = ex.spawn_agent(L.Stamp)
        _adopted(sink)
        snd = ex.spawn_agent(L.SlowSender, sink, 0.8, 1.0, tier="bulk")
        word = pool.layout.worker(0) + W_IN_STEP
        end = time.monotonic() + T
        while not pool.region.load32(word):  # the step began: it is in its 0.8 s send
            assert time.monotonic() < end, "the sender never stepped"
            time.sleep(0.001)
        time.sleep(0.2)
        sent = time.monotonic()
        ran = ctl.call("hit").result(T)
        start, sent_end, stop = snd.result(T)
        assert start < sent < sent_end, "the call was not sent during the step's send"
        # not inside the send (its pickling had ~0.6 s left), nor at the step's end: as the
        # send returned (in stealer's code on its way out, just before sent_end is read)
        assert sent + 0.3 < ran < stop and ran < sent_end + 0.3, (
            sent, ran, start, sent_end, stop)
        ctl.stop()
        sink.stop()


def test_a_second_control_call_in_the_same_step_is_answered_inside_it_too():
    """The first call's notification stays queued in the worker's inbox until the step
    ends (its handler ran nested, the loop has not popped it).  A second call must not find
    that notification still pending, send none (and so no signal), and wait for the step's
    end: both run inside the one bulk step."""
    with stealer.Executor(1) as ex:
        ctl = ex.spawn_agent(L.Stamp, tier="control")
        _adopted(ctl)
        bulk = ex.spawn_agent(L.Spans, 1, 1.5, tier="bulk")
        time.sleep(0.2)  # the bulk agent is in its one step (1.5 s)
        first = ctl.call("hit").result(T)
        time.sleep(0.1)
        second = ctl.call("hit").result(T)
        ((start, stop),) = bulk.result(T)
        assert start < first < second < stop, (start, first, second, stop)
        ctl.stop()


def test_the_agent_mid_step_gets_its_message_after_the_step():
    with stealer.Executor(1) as ex:
        ctl = ex.spawn_agent(L.Spans, 3, 0.5, tier="control")
        first = ctl.call("hit").result(T)  # adopted; its turn handles messages, then steps
        time.sleep(0.2)  # in a step now
        ran = ctl.call("hit").result(T)
        spans = ctl.result(T)
        assert not any(s < ran < e for s, e in spans), (first, ran, spans)
        assert any(e <= ran for _s, e in spans)  # it was called during a step: after it


def test_a_step_timeout_fires_through_nested_control_turns():
    """A 0.5 s control handler nested in a step whose step_timeout (0.3 s) falls inside
    it: the alarm is raised in the step once the nested turn ends, and the worker lives
    (no hard kill of a step deaf to its timer)."""
    with stealer.Executor(1) as ex:
        ctl = ex.spawn_agent(L.Counter, 0, 0.5, tier="control")
        ctl.call("get").result(T)  # adopted
        bulk = ex.spawn_agent(L.Spans, 1, 3.0, tier="bulk", step_timeout=0.3)
        time.sleep(0.1)  # the step runs
        assert ctl.call("add", 1).result(T) == 1
        with pytest.raises(stealer.StepTimeout):
            bulk.result(T)
        assert ex._pool.crashes == 0
        assert _inline_turns(ex) >= 1
        ctl.stop()


@pytest.mark.kills_workers
def test_killed_inside_a_nested_control_turn(monkeypatch, tmp_path):
    """SIGKILL at the start of the nested turn: the replacement restarts both agents;
    the call is answered once and applied once; the bulk agent still finishes."""
    point = "agent.inline_turn"
    monkeypatch.setenv("STEALER_FAILPOINTS", f"{point}=kill!once")
    monkeypatch.setenv("STEALER_FAILPOINTS_DIR", str(tmp_path))
    with stealer.Executor(1) as ex:
        ctl = ex.spawn_agent(L.Stamp, tier="control")
        _adopted(ctl)
        bulk = ex.spawn_agent(L.Spans, 3, 0.3, tier="bulk")
        time.sleep(0.1)
        assert ctl.call("add", 5).result(T) == 5
        assert os.path.exists(tmp_path / point), "the nested turn was never reached"
        assert ex._pool.crashes == 1
        assert ctl.call("get").result(T) == 5  # applied once
        assert len(bulk.result(T)) == 3
        ctl.stop()
