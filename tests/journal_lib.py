"""Agents and a client script for the journal tests (importable by the workers)."""

from __future__ import annotations

import sys

import stealer

K = 40  # steps of each ring agent
CALL_EVERY = 8  # every 8th step is a call (request/reply) instead of a send


def value(i: int, k: int) -> int:
    return i * 1000 + k


class RingAgent(stealer.Agent):
    """Steps K times; each step sends (or calls) its successor with a value; then waits.
    Its final state does not depend on how steps and messages interleave."""

    def __init__(self, i: int) -> None:
        self.i = i
        self.k = 0
        self.peer = None
        self.got = 0  # sum of the values received
        self.msgs = 0
        self.echo = 0  # sum of the replies to its calls

    def link(self, peer: stealer.AgentRef) -> None:
        self.peer = peer

    def step(self, ctx: stealer.Ctx):
        if self.peer is None:
            return ctx.wait()
        if self.k >= K:
            return ctx.wait()
        self.k += 1
        v = value(self.i, self.k)
        if self.k % CALL_EVERY == 0:
            return self._call(v)
        self.peer.send("add", v)
        return ctx.sleep(0.002)

    def _call(self, v: int):
        r = yield self.peer.call("add", v)
        self.echo += r
        return None

    def add(self, v: int) -> int:
        self.got += v
        self.msgs += 1
        return 2 * v

    def state(self) -> tuple:
        return (self.i, self.k, self.got, self.msgs, self.echo)


def expected(n: int) -> dict[int, tuple]:
    out = {}
    for i in range(n):
        p = (i - 1) % n
        got = sum(value(p, k) for k in range(1, K + 1))
        echo = sum(2 * value(i, k) for k in range(1, K + 1) if k % CALL_EVERY == 0)
        out[i] = (i, K, got, K, echo)
    return out


def run_ring(path: str, n: int, mode: str) -> None:
    """The client a test kills: spawn a ring of n named agents, link them, run."""
    ex = stealer.Executor(2, journal=path, durability=mode)
    refs = [ex.spawn_agent(RingAgent, i, name=f"a{i}", mailbox=256) for i in range(n)]
    for i, r in enumerate(refs):
        r.send("link", refs[(i + 1) % n])
    print("linked", flush=True)
    import time

    time.sleep(600)


def final_states(ex: stealer.Executor, n: int, timeout: float = 60.0) -> dict[int, tuple]:
    """Poll every agent until all have stepped K times and received K messages."""
    import time

    end = time.monotonic() + timeout
    while True:
        states = {}
        for i in range(n):
            states[i] = ex.agent(f"a{i}").call("state").result(timeout)
        if all(s[1] == K and s[3] >= K for s in states.values()) or time.monotonic() > end:
            return states
        time.sleep(0.1)


class Sink(stealer.Agent):
    """Keeps every sequence number it is sent (a message applied twice shows twice)."""

    def __init__(self) -> None:
        self.got: list[int] = []

    def put(self, seq: int) -> None:
        self.got.append(seq)

    def received(self) -> list[int]:
        return self.got


def run_sender(path: str, mode: str) -> None:
    """The client a test kills: send 1, 2, 3... to a sink, printing each once send returned
    (acknowledged)."""
    ex = stealer.Executor(2, journal=path, durability=mode)
    sink = ex.spawn_agent(Sink, name="sink", mailbox=4096)
    print("ready", flush=True)
    seq = 0
    while True:
        seq += 1
        sink.send("put", seq)
        print(seq, flush=True)


class Squarer(stealer.Agent):
    """Finishes at its first step with n*n, or fails for a negative n."""

    def __init__(self, n: int) -> None:
        self.n = n

    def step(self, ctx: stealer.Ctx):
        if self.n < 0:
            raise ValueError("negative n")
        return ctx.done(self.n * self.n)

    def state(self) -> int:
        return self.n


KIDS = 12


class Kid(stealer.Agent):
    def __init__(self, v: int) -> None:
        self.v = v

    def value(self) -> int:
        return self.v


class Parent(stealer.Agent):
    """Spawns a child per step (KIDS in all) and calls it; sums the answers."""

    def __init__(self, i: int) -> None:
        self.i = i
        self.n = 0
        self.total = 0

    def step(self, ctx: stealer.Ctx):
        if self.n >= KIDS:
            return ctx.wait()
        return self._grow(ctx)

    def _grow(self, ctx: stealer.Ctx):
        kid = ctx.spawn_agent(Kid, 100 * self.i + self.n + 1)
        v = yield kid.call("value")
        self.n += 1
        self.total += v
        return ctx.sleep(0.01)

    def state(self) -> tuple[int, int]:
        return (self.n, self.total)


def run_parents(path: str, n: int) -> None:
    ex = stealer.Executor(2, journal=path)
    for i in range(n):
        ex.spawn_agent(Parent, i, name=f"p{i}", checkpoint_every=4)
    print("ready", flush=True)
    import time

    time.sleep(600)


# -- small agents for tests/test_journal_misuse.py -----------------------------------------
class Acc(stealer.Agent):
    """Message-only: ``add(v)`` appends v (so a lost, repeated or reordered message shows);
    ``forward(ref, v)`` sends ``add(v)`` on to another agent (a message logged by a worker)."""

    def __init__(self, tag: str = "") -> None:
        self.tag = tag
        self.vals: list = []

    def add(self, v: object) -> int:
        self.vals.append(v)
        return len(self.vals)

    def forward(self, ref: stealer.AgentRef, v: object) -> None:
        ref.send("add", v)

    def get(self) -> list:
        return list(self.vals)


class Caller(stealer.Agent):
    """Calls ``peer.add`` with each of ``vals`` in turn; after the last reply, the first
    time only (a marker file), it SIGKILLs its own worker before any checkpoint: its
    restart makes every call again, and each must get its first reply, not run twice."""

    def __init__(self, peer: stealer.AgentRef, vals: list, marker: str) -> None:
        self.peer = peer
        self.vals = vals
        self.marker = marker

    def step(self, ctx: stealer.Ctx):
        import os
        import signal

        got = []
        for v in self.vals:
            got.append((yield self.peer.call("add", v)))
        if not os.path.exists(self.marker):
            with open(self.marker, "w"):
                pass
            os.kill(os.getpid(), signal.SIGKILL)
        return ctx.done(got)


class Finisher(stealer.Agent):
    """Finishes at its first step: with ``value``, or failing with ValueError(value)."""

    def __init__(self, value: object, fail: bool = False) -> None:
        self.value = value
        self.fail = fail

    def step(self, ctx: stealer.Ctx):
        if self.fail:
            raise ValueError(self.value)
        return ctx.done(self.value)


class Locky(stealer.Agent):
    """Keeps a lock in an attribute: its state does not pickle, so it cannot be journaled."""

    def __init__(self) -> None:
        self.n = 0
        self.guard = None

    def step(self, ctx: stealer.Ctx):
        import threading

        self.guard = threading.Lock()
        self.n += 1
        return ctx.sleep(0.001) if self.n < 100 else ctx.done(self.n)


if __name__ == "__main__":
    run_ring(sys.argv[1], int(sys.argv[2]), sys.argv[3])
