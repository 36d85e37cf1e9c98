"""A turn's messages handled natively (Turns.turn around HotPath.serve, Turns.ping)
against the Python it replaces (Host.turn, deliver_batch with Messages.deliver,
after_turn; ForkJoinHandling.on_ping), the same script run both ways.

The script sends one agent every kind of message the native loop takes or hands back:
plain calls, keyword arguments, one-way sends, a reply too large to sit inline, one that
is not a small pickle, a handler that raises, a generator handler, an unknown method, the
built-in ``state``, a call with a deadline, a payload too large to sit inline, a call
cancelled while it waits, an agent's call (its reply goes to an agent), a stop behind
queued messages, then rounds of ``call_all`` over an agent that checkpoints every two
messages (Turns.turn's checkpoint, HotPath.free_chain), a control-tier one and the first,
and an agent that steps, waits for a message, and steps again until it is done.  Every reply, the agent's own log of what it ran and in what order, and
the stop's outcome must be the same; the native run must have used the native loop.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(
    os.environ.get("STEALER_NO_EXTENSIONS", "") not in ("", "0"),
    reason="the native loop needs the extension")

SCRIPT = textwrap.dedent("""
    import json, os, sys, tempfile, time
    import numpy as np
    sys.path.insert(0, sys.argv[1])
    tmp = tempfile.mkdtemp()

    def mark(name):
        return os.path.join(tmp, name)

    def wait_for(name):
        end = time.monotonic() + 60
        while not os.path.exists(mark(name)):
            assert time.monotonic() < end, name
            time.sleep(0.001)
    import stealer
    import fast_turn_lib as L

    import stealer

    def show(f):
        try:
            v = f.result(30)
        except BaseException as exc:
            return ["err", type(exc).__name__, str(exc)[:60]]
        if isinstance(v, np.ndarray):
            return ["array", v.dtype.str, list(v.shape), float(v.sum())]
        if isinstance(v, set):
            return ["set", sorted(v)]
        return ["ok", repr(v)]

    out = {}
    with stealer.Executor(1) as ex:
        out["probe"] = ex.submit(L.probe).result(30)
        a = ex.spawn_agent(L.Mixed)
        b = ex.spawn_agent(L.Mixed)
        futs = []
        futs.append(a.call("slow", mark("a0"), mark("a1")))  # the rest queue behind it
        futs.append(a.call("plain", 1))
        cancelled = a.call("plain", "cancelled")
        futs.append(a.call("plain", (1, 2.5, "x", None, [3])))
        futs.append(a.call("kw", 2, y=3))
        a.send("plain", "one-way")
        futs.append(a.call("array", 1000))
        futs.append(a.call("aset", 3))
        futs.append(a.call("fail", "boom"))
        futs.append(a.call("gen", 21))
        futs.append(a.call("nope", 1))
        futs.append(a.call("state"))
        futs.append(a.options(deadline=30).call("plain", "deadline"))
        futs.append(a.call("plain", b"x" * 500))
        futs.append(b.call("ask", a, "via b"))
        futs.extend(ex.call_all([a, b], "plain", [("all-a",), ("all-b",)]))
        wait_for("a0")
        out["cancel"] = cancelled.cancel()  # still queued: a runs "slow" until a1
        open(mark("a1"), "w").close()
        out["replies"] = [show(f) for f in futs]
        out["log_a"] = [repr(x) for x in a.call("history").result(30)]
        out["log_b"] = [repr(x) for x in b.call("history").result(30)]
        # a stop behind queued messages: the ones before it run, its outcome is the same
        c = ex.spawn_agent(L.Mixed)
        c.call("plain", -1).result(30)  # adopted and idle
        cf = [c.call("slow", mark("c0"), mark("c1"))] + [c.call("plain", i) for i in range(20)]
        wait_for("c0")  # the slow one runs; the others wait in its turn's batch
        c.stop()
        open(mark("c1"), "w").close()
        out["stopped"] = [show(f)[0] for f in cf]
        try:
            out["stop_result"] = ["ok", repr(c.result(30))]
        except BaseException as exc:
            out["stop_result"] = ["err", type(exc).__name__]
        # checkpoints every 2 messages (the handled ones freed by the native walk), a
        # control-tier agent, rounds of call_all between them; then their logs
        d = ex.spawn_agent(L.Mixed, checkpoint_every=2)
        e = ex.spawn_agent(L.Mixed, tier="control")
        rounds = []
        for i in range(40):
            rounds.append([show(f) for f in ex.call_all([d, e, a], "plain", [(i,), (-i,), (i,)])])
        out["rounds"] = rounds
        out["log_d"] = [repr(x) for x in d.call("history").result(30)]
        out["log_e"] = [repr(x) for x in e.call("history").result(30)]
        # an agent that steps, waits for a message, steps again, then finishes
        # (messages until it is done: how many depends on timing, so only the steps'
        # count and each message's presence are compared)
        st = ex.spawn_agent(L.Stepper, 5, 30)
        sent = 0
        while True:
            st.call("more", sent).result(30)
            sent += 1
            try:
                log = st.result(0.05)
                break
            except TimeoutError:
                assert sent < 2000
        out["stepper"] = [sum(1 for x in log if x[0] == "step"),
                          sorted(x[1] for x in log if x[0] == "more") == list(range(sent))]
        out["native_turns"] = ex.submit(L.native_turns).result(30)
    print(json.dumps(out))
""")


def _run(fast: bool) -> dict:
    import json

    env = dict(os.environ)
    env.pop("STEALER_NO_FAST_TURN", None)
    if not fast:
        env["STEALER_NO_FAST_TURN"] = "1"
    here = os.path.dirname(os.path.abspath(__file__))
    p = subprocess.run([sys.executable, "-c", SCRIPT, here], env=env, capture_output=True,
                       text=True, timeout=180)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_the_native_loop_does_what_the_python_loop_does():
    fast, slow = _run(True), _run(False)
    assert fast["probe"] == [True] and slow["probe"] == [False]
    for key in ("cancel", "replies", "log_a", "log_b", "stopped", "stop_result", "rounds",
                "log_d", "log_e", "stepper"):
        assert fast[key] == slow[key], (key, fast[key], slow[key])
    r = fast["replies"]
    # the script's own oracle: what each reply must be, whichever loop ran it
    assert r[0] == ["ok", "'slow'"] and r[1] == ["ok", "1"]
    assert r[3] == ["ok", "5"] and r[4][0] == "array" and r[5] == ["set", [0, 1, 2]]
    assert r[6][:2] == ["err", "ValueError"] and r[7] == ["ok", "42"]
    assert r[8][:2] == ["err", "AttributeError"] and r[12] == ["ok", "'via b'"]
    # cancelled while queued: never run (its reply slot is claimed when a handler starts)
    assert fast["cancel"] is True and "('plain', 'cancelled')" not in fast["log_a"]
    assert "('plain', 'one-way')" in fast["log_a"]
    assert fast["stopped"] == ["ok"] + ["err"] * 20  # the batch ends at the stop
    assert fast["rounds"][39] == [["ok", "39"], ["ok", "-39"], ["ok", "39"]]
    assert fast["log_d"] == [repr(("plain", i)) for i in range(40)]
    assert fast["stepper"] == [30, True]
    # the native turn ran (most of the rounds' turns), the Python run had none
    assert fast["native_turns"][0] > 60 and slow["native_turns"] == [-1]


def test_an_entry_keeps_its_fields_where_the_native_turn_reads_them():
    """_Entry's base is the extension's Entry: the same field names as entry.py's list, each
    a member descriptor (as a __slots__ class's: CPython specializes access to those, not to
    the properties Cython makes), no __dict__, every field at its own offset.  (The native
    turn's reads of what Python wrote are the test above: a loop that read the wrong field
    would not give the Python loop's replies.)"""
    from stealer import _cqueues
    from stealer.worker.agents import entry

    assert entry._Entry.__mro__[1] is _cqueues.Entry
    assert _cqueues.ENTRY_FIELDS == entry.ENTRY_FIELDS
    slot_kind = type(type("S", (), {"__slots__": ("x",)}).__dict__["x"])
    for name in entry.ENTRY_FIELDS:
        assert type(_cqueues.Entry.__dict__[name]) is slot_kind, name
    e = entry._Entry(7, 3)
    assert not hasattr(e, "__dict__")
    with pytest.raises(AttributeError):
        e.not_a_field = 1
    # every field at its own offset: distinct values written, each read back (the 64-bit
    # int fields hold ints, the full range; the others any object)
    ints = set(_cqueues.ENTRY_INTS)
    assert ints < set(entry.ENTRY_FIELDS)

    def value(i: int, name: str) -> object:
        return (-1) ** i * ((1 << 62) + i) if name in ints else ("v", i)

    for i, name in enumerate(entry.ENTRY_FIELDS):
        setattr(e, name, value(i, name))
    assert [getattr(e, name) for name in entry.ENTRY_FIELDS] == [
        value(i, name) for i, name in enumerate(entry.ENTRY_FIELDS)]
    with pytest.raises(TypeError):
        e.cpu_ns = None


def test_the_balancer_s_native_look_finds_the_peer_the_python_look_finds():
    """Turns.least_loaded (run_next's balance, natively) against Balancer.least_loaded, in
    a worker, over peers' loads and states that make each answer: none shorter, the
    first, the second, a peer left out for not being ready."""
    import fast_turn_lib as L

    import stealer

    with stealer.Executor(3) as ex:
        got = ex.submit(L.least_loaded_twins).result(60)
    if got is None:
        pytest.skip("no native turn in this build (the Python look is the only one)")
    answers = set()
    for row in got:
        for py, native in row:
            assert tuple(native) == tuple(py), got
            answers.add(py[0] >= 0)
    assert answers == {True, False}  # both a peer found and none
