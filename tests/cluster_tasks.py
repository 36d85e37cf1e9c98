"""Task functions for tests/test_cluster_ray.py, importable on every node of the test
cluster (the test module itself is the driver's; node executors pickle these by name)."""

from __future__ import annotations

import os
import time
from typing import Any

import ray

import stealer


def where(x: int = 0) -> tuple[str, list[int], int]:
    """Which test node ran this (its STEALER_NODE_CPUS), its CPUs, and x back."""
    return os.environ.get("STEALER_NODE_CPUS", "?"), sorted(os.sched_getaffinity(0)), x


def spin(seconds: float, x: int = 0) -> tuple[str, int]:
    """Busy for ``seconds`` of wall time, then which node ran it and x back."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass
    return os.environ.get("STEALER_NODE_CPUS", "?"), x


def square(x: int) -> int:
    return x * x


def fail(msg: str) -> None:
    raise ValueError(msg)


def fib(n: int):
    """Fork-join on a node: children by stealer.spawn, joined by yield."""
    if n < 12:
        return fib_seq(n)
    a = stealer.spawn(fib, n - 1)
    b = stealer.spawn(fib, n - 2)
    x, y = yield [a, b]
    return x + y


def fib_seq(n: int) -> int:
    return n if n < 2 else fib_seq(n - 1) + fib_seq(n - 2)


def fib_where(n: int):
    """fib(n) by fork-join, and the test nodes (STEALER_NODE_CPUS) its leaves ran on."""
    if n < 14:
        return fib_seq(n), (os.environ.get("STEALER_NODE_CPUS", "?"),)
    (x, wx), (y, wy) = yield [stealer.spawn(fib_where, n - 1), stealer.spawn(fib_where, n - 2)]
    return x + y, tuple(sorted(set(wx) | set(wy)))


def threads_env() -> dict[str, str | None]:
    return {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                                           "MKL_NUM_THREADS")}


class Counter(stealer.Agent):
    """A message-only agent: its state is a counter."""

    def __init__(self, start: int = 0) -> None:
        self.n = start

    def add(self, k: int) -> int:
        self.n += k
        return self.n

    def get(self) -> int:
        return self.n

    def spin_add(self, k: int, seconds: float) -> int:
        """Busy for ``seconds`` (an agent that keeps its worker busy), then add ``k``."""
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass
        self.n += k
        return self.n

    def where(self) -> str:
        return os.environ.get("STEALER_NODE_CPUS", "?")

    def on_stop(self) -> int:
        return self.n


class Hop(stealer.Agent):
    """Holds a ref of another agent of the executor (``link``): ``hop(n)`` calls its
    ``hop(n - 1)`` from a generator handler and returns the nodes the chain ran on."""

    def __init__(self) -> None:
        self.nxt: Any = None

    def link(self, nxt: Any) -> None:
        self.nxt = nxt

    def hop(self, n: int) -> Any:
        here = os.environ.get("STEALER_NODE_CPUS", "?")
        if n == 0:
            return [here]
        return [here, *(yield self.nxt.call("hop", n - 1))]

    def fan(self, refs: list) -> Any:
        return (yield stealer.call_all(refs, "hop", [(0,)] * len(refs)))

    async def ahop(self, n: int) -> Any:
        """``hop`` as an ``async def`` handler (awaits the next hop's ``ahop``)."""
        here = os.environ.get("STEALER_NODE_CPUS", "?")
        if n == 0:
            return [here]
        return [here, *(await self.nxt.call("ahop", n - 1))]

    async def afan(self, refs: list) -> Any:
        return await stealer.call_all(refs, "hop", [(0,)] * len(refs))

    def tell(self, method: str, *args: Any) -> None:
        self.nxt.send(method, *args)

    def held(self) -> Any:
        return self.nxt

    def broken(self) -> Any:
        return (yield self.nxt.call("no_such_handler"))


def adds_from_task(refs: list, n: int) -> list:
    """A plain task that calls each agent ``n`` times and waits for every reply."""
    return [r.call("add", 1).result(timeout=60) for r in refs for _ in range(n)]


def adds_from_generator(refs: list) -> Any:
    """A generator task: one call to every agent at once (yielded), then one more."""
    got = yield stealer.call_all(refs, "add", [(1,)] * len(refs))
    last = yield refs[0].call("get")
    return got, last


def error_from_task(ref: Any) -> str:
    try:
        ref.call("no_such_handler").result(timeout=60)
    except AttributeError as exc:
        return f"AttributeError: {exc}"
    return "no error"


def send_to(ref: Any, method: str, *args: Any) -> str:
    """A plain task that sends to an agent it was given."""
    ref.send(method, *args)
    return "sent"


def mark(path: str, x: int, seconds: float) -> int:
    """Busy for ``seconds``, then append ``x`` to the file ``path`` (which tasks ran)."""
    spin(seconds)
    with open(path, "a") as f:
        f.write(f"{x}\n")
    return x


def marked(path: str) -> list[int]:
    try:
        with open(path) as f:
            return [int(line) for line in f]
    except FileNotFoundError:
        return []


def total(a, extra: float = 0.0) -> float:
    return float(a.sum()) + extra


@ray.remote(num_cpus=0)
def no_value() -> None:
    raise ValueError("no value here")


@ray.remote(num_cpus=1)
def needs_a_cpu() -> int:  # (the node agents hold every CPU of the test cluster: it waits)
    return 1
