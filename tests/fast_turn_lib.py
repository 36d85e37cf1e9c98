"""Agents for tests/test_fast_turn.py (importable by spawn-started workers)."""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

import stealer


class Mixed(stealer.Agent):
    """Message-only; its handlers return and raise what HotPath.serve hands back to Python."""

    def __init__(self) -> None:
        self.log: list[Any] = []

    def plain(self, x: Any) -> Any:
        self.log.append(("plain", x))
        return x

    def kw(self, x: int, *, y: int = 0) -> int:
        self.log.append(("kw", x, y))
        return x + y

    def array(self, n: int) -> np.ndarray:
        self.log.append(("array", n))
        return np.arange(n, dtype=np.float64)  # past the inline area: reported the long way

    def aset(self, n: int) -> set:
        self.log.append(("aset", n))
        return set(range(n))  # not a small pickle: the reply the long way

    def fail(self, why: str) -> None:
        self.log.append(("fail", why))
        raise ValueError(why)

    def gen(self, x: int) -> Any:
        self.log.append(("gen", x))
        if x < 0:  # (a generator that returns at once: driven the generator way all the same)
            yield None
        return x * 2

    def slow(self, started: str, release: str) -> str:
        """Runs until the client says so: the messages sent meanwhile queue behind it."""
        self.log.append(("slow",))
        open(started, "w").close()
        end = time.monotonic() + 60
        while not os.path.exists(release) and time.monotonic() < end:
            time.sleep(0.001)
        return "slow"

    def nap(self, ms: int) -> int:
        """Sleeps ``ms`` ms: the messages sent meanwhile pile up behind it."""
        self.log.append(("nap", ms))
        time.sleep(ms / 1000)
        return ms

    def echo(self, x: Any) -> Any:
        self.log.append(("echo", x))
        return x

    def ask(self, other: Any, x: Any) -> Any:  # an agent's call: its reply is K_REPLY
        self.log.append(("ask", x))
        v = yield other.call("echo", x)
        return v

    def history(self) -> list:
        return list(self.log)


def probe() -> list[bool]:
    """In a worker: whether its Host serves messages natively (HotPath.serve)."""
    import gc

    from stealer.worker.agents.host import Host

    return [h.serve is not None for h in gc.get_objects() if type(h) is Host]


def native_turns() -> list[int]:
    """In a worker: how many turns its Host ran natively (Turns.turn), -1 if it has none."""
    import gc

    from stealer.worker.agents.host import Host

    return [h.quick.turns if h.quick is not None else -1
            for h in gc.get_objects() if type(h) is Host]


class Stepper(stealer.Agent):
    """Steps on its own ``n`` times, then waits (ctx.wait) until a message asks for more;
    done after ``total`` steps, its value its log."""

    def __init__(self, n: int, total: int) -> None:
        self.n = n
        self.total = total
        self.log: list = []

    def step(self, ctx: Any) -> Any:
        self.log.append(("step", len(self.log)))
        steps = sum(1 for x in self.log if x[0] == "step")
        if steps >= self.total:
            return ctx.done(list(self.log))
        if steps % self.n == 0:
            return ctx.wait()
        return None

    def more(self, x: int) -> int:
        self.log.append(("more", x))
        return len(self.log)


def least_loaded_twins() -> list[list[tuple[int, int]]] | None:
    """In a worker (of 3): Balancer.least_loaded and its native twin (Turns.least_loaded)
    for several loads of ours, with the peers' W_RUNNABLE / W_STATE words set to a series
    of values (restored after; the peers run no agents, so nobody rewrites them
    meanwhile).  None if the worker has no native turn."""
    import gc

    from stealer.shared.shm import STATE_READY, W_RUNNABLE, W_STATE
    from stealer.worker.agents.host import Host

    host = next(h for h in gc.get_objects() if type(h) is Host)
    if host.quick is None:
        return None
    w, r = host.w, host.r
    peers = [j for j in range(w.n) if j != w.k]
    bases = {j: w.seg.layout.worker(j) for j in peers}
    saved = {j: (r.load32(b + W_RUNNABLE), r.load32(b + W_STATE)) for j, b in bases.items()}
    out = []
    try:
        for loads, states in (((0, 0), (STATE_READY, STATE_READY)), ((5, 2), (STATE_READY,) * 2),
                              ((2, 5), (STATE_READY, STATE_READY)), ((1, 1), (STATE_READY, 2)),
                              ((0, 3), (2, STATE_READY)), ((4, 4), (2, 2))):
            for j, v, s in zip(peers, loads, states):
                r.store32(bases[j] + W_RUNNABLE, v)
                r.store32(bases[j] + W_STATE, s)
            out.append([(tuple(host.bal.least_loaded(m)), tuple(host.quick.least_loaded(m)))
                        for m in (0, 1, 3, 10)])
    finally:
        for j, (v, s) in saved.items():
            r.store32(bases[j] + W_RUNNABLE, v)
            r.store32(bases[j] + W_STATE, s)
    return out
