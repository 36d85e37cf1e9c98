"""The native turn (Turns: the notification, run_next, turn and after_turn around
HotPath.serve) and its Python twin, both against a sequential oracle, on random programs.

Hypothesis draws a program: three agents of ``fast_turn_lib.Mixed`` with random options
(``checkpoint_every`` 1, 2 or 64, tier control, interactive or bulk), then up to 40
operations: a call of a plain, keyword, raising, generator or array-returning handler, one
that sleeps up to 20 ms (the messages after it pile up: a turn then takes several), a
one-way send, a ``call_all`` over some of the agents, a cancelled call, a wait for every
reply so far.  The agents answer once before the program starts (adopted and idle: its
messages reach them through their owners' inboxes).  The program runs on
a 2-worker executor with the native turn, then on one with the Python turn
(``STEALER_NO_FAST_TURN=1``, read by the workers as they start).  Each agent handles one
client's messages in the order they were sent, so the oracle is that order applied to a
model of the agent: every reply and every agent's log must equal the model's, on both paths.
Not the bytes, the outcomes: a reply's value or exception type.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import stealer
from tests import fast_turn_lib as L

pytestmark = pytest.mark.skipif(
    os.environ.get("STEALER_NO_EXTENSIONS", "") not in ("", "0"),
    reason="the native turn needs the extension")

T = 60  # seconds: only to turn a hang into a failure

KINDS = ("plain", "kw", "fail", "gen", "array", "send", "all", "cancel", "nap", "sync")

agent_opts = st.tuples(st.sampled_from([1, 2, 64]),
                       st.sampled_from(["control", "interactive", "bulk"]))
op = st.tuples(st.sampled_from(KINDS), st.integers(0, 2), st.integers(-5, 50),
               st.lists(st.integers(0, 2), min_size=1, max_size=3))
program = st.tuples(st.lists(agent_opts, min_size=3, max_size=3),
                    st.lists(op, min_size=1, max_size=40))


def _outcome(f: object) -> tuple:
    try:
        v = f.result(T)  # type: ignore[attr-defined]
    except BaseException as exc:  # the outcome is compared, not raised
        return ("err", type(exc).__name__)
    if isinstance(v, np.ndarray):
        return ("array", v.dtype.str, v.shape, float(v.sum()))
    return ("ok", v)


def _model(opts: list, ops: list, cancels: list[bool]) -> tuple[list, list]:
    """What a sequential run gives: each call's outcome, and each agent's log.  A
    cancelled call ran iff its ``cancel()`` said False (``cancels``, in order, from the
    run: its handler had started); said True, it never runs."""
    cancels = list(cancels)
    logs: list[list] = [[("echo", "ready")] for _ in opts]
    out: list = []

    def handle(i: int, kind: str, x: int) -> tuple:
        if kind == "plain":
            logs[i].append(("plain", x))
            return ("ok", x)
        if kind == "kw":
            logs[i].append(("kw", x, 1))
            return ("ok", x + 1)
        if kind == "fail":
            logs[i].append(("fail", str(x)))
            return ("err", "ValueError")
        if kind == "gen":
            logs[i].append(("gen", abs(x)))
            return ("ok", 2 * abs(x))
        if kind == "nap":
            logs[i].append(("nap", x % 20))
            return ("ok", x % 20)
        n = abs(x)
        logs[i].append(("array", n))
        return ("array", "<f8", (n,), float(n * (n - 1) / 2))

    for kind, i, x, some in ops:
        if kind == "sync":
            continue
        if kind == "send":
            handle(i, "plain", x)
        elif kind == "all":
            out.extend(handle(j, "plain", x + j) for j in some)
        elif kind == "cancel":
            if not cancels.pop(0):  # too late: it had started, and runs to its end
                handle(i, "plain", x)
        else:
            out.append(handle(i, kind, x))
    return out, [[tuple(e) for e in log] for log in logs]


def _run(opts: list, ops: list, fast: bool) -> tuple[tuple[list, list], list[bool]]:
    old = os.environ.pop("STEALER_NO_FAST_TURN", None)
    if not fast:
        os.environ["STEALER_NO_FAST_TURN"] = "1"
    try:
        with stealer.Executor(2) as ex:
            refs = [ex.spawn_agent(L.Mixed, checkpoint_every=ck, tier=tier)
                    for ck, tier in opts]
            # adopted and idle: the program's messages then reach them through their
            # owners' inboxes (Turns.ping), not all at once at the adoption
            for r in refs:
                r.call("echo", "ready").result(T)
            futs: list = []
            cancels: list[bool] = []
            for kind, i, x, some in ops:
                ref = refs[i]
                if kind == "sync":  # every reply so far: the agents idle again
                    for f in futs:
                        f.exception(T)
                elif kind == "plain":
                    futs.append(ref.call("plain", x))
                elif kind == "kw":
                    futs.append(ref.call("kw", x, y=1))
                elif kind == "fail":
                    futs.append(ref.call("fail", str(x)))
                elif kind == "gen":
                    futs.append(ref.call("gen", abs(x)))  # (x < 0 yields None: a TypeError)
                elif kind == "array":
                    futs.append(ref.call("array", abs(x)))
                elif kind == "nap":  # the messages after it pile up in its mailbox
                    futs.append(ref.call("nap", x % 20))
                elif kind == "send":
                    ref.send("plain", x)
                elif kind == "all":
                    futs.extend(ex.call_all([refs[j] for j in some], "plain",
                                            [(x + j,) for j in some]))
                else:  # cancel: True while it waits in the mailbox (then never run)
                    cancels.append(ref.call("plain", x).cancel())
            out = [_outcome(f) for f in futs]
            logs = [[tuple(e) for e in r.call("history").result(T)] for r in refs]
            probe = ex.submit(L.native_turns).result(T)
        assert (probe[0] >= 0) == fast, probe  # the path asked for is the one that ran
        return (out, logs), cancels
    finally:
        os.environ.pop("STEALER_NO_FAST_TURN", None)
        if old is not None:
            os.environ["STEALER_NO_FAST_TURN"] = old


@settings(max_examples=5, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(program)
def test_both_turns_give_what_a_sequential_run_gives(prog):
    opts, ops = prog
    for fast in (True, False):
        got, cancels = _run(opts, ops, fast)
        assert got == _model(opts, ops, cancels)
