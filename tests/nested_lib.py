"""Tasks for tests/test_nested.py (importable by the workers)."""

from __future__ import annotations

import os
import signal
import time

import stealer


def busy_pid(ms: float) -> int:
    end = time.perf_counter() + ms / 1000
    while time.perf_counter() < end:
        pass
    return os.getpid()


def square(x: int) -> int:
    return x * x


def divide(x: int) -> float:
    return 1 / x


def fan_out(n: int, ms: float) -> tuple[int, list[int]]:
    """A plain task: n children joined with stealer.join (where each ran)."""
    kids = [stealer.spawn(busy_pid, ms) for _ in range(n)]
    return os.getpid(), stealer.join(kids)


def tree(depth: int) -> int:
    """A plain task that blocks on its two children, recursively: 2**depth leaves."""
    if depth == 0:
        return 1
    a = stealer.spawn(tree, depth - 1)
    b = stealer.spawn(tree, depth - 1)
    return a.result() + stealer.join(b)


def fib_ex(ex, n: int) -> int:
    """Recursive fib through the executor the task itself captured (ex.submit inside)."""
    if n < 2:
        return n
    a = ex.submit(fib_ex, ex, n - 1)
    b = ex.submit(fib_ex, ex, n - 2)
    return a.result() + b.result()


def map_inside(ex, n: int, chunksize: int) -> list[int]:
    return list(ex.map(square, range(n), chunksize=chunksize))


def failing_child(i: int) -> float:
    kids = [stealer.spawn(divide, j - i) for j in range(4)]
    return sum(stealer.join(kids))


def gen_child(n: int):
    """A generator task (joins by yield): run as a child of a blocking join, its own
    frame is suspended and resumed by its children's pings during that join."""
    kids = [stealer.spawn(square, i) for i in range(n)]
    vals = yield kids
    return sum(vals)


def joins_gen_children(n: int) -> list[int]:
    kids = [stealer.spawn(gen_child, k) for k in range(1, n + 1)]
    return stealer.join(kids)


def started_then_busy(marker: str, ms: float) -> int:
    with open(marker, "w"):
        pass
    return busy_pid(ms)


def slow_join(marker: str, timeout: float) -> str:
    c = stealer.spawn(started_then_busy, marker, 300)
    while not os.path.exists(marker):  # running on the other worker (ours is busy here)
        time.sleep(0.001)
    try:
        stealer.join(c, timeout)
    except TimeoutError:
        return f"timed out, then {c.result() > 0}"
    return "no timeout"


def join_others(child: object) -> None:
    stealer.join(child)  # a Child from another task: refused


def spawn_and_return(n: int) -> int:
    for i in range(n):
        stealer.spawn(square, i)  # never joined: the task's end waits for them
    return n


def kill_once(marker: str, ms: float) -> int:
    """SIGKILLs its worker the first time (marker file), mid-way through a nested run."""
    if not os.path.exists(marker):
        with open(marker, "w"):
            pass
        os.kill(os.getpid(), signal.SIGKILL)
    return busy_pid(ms)


def fan_out_with_a_kill(marker: str, n: int) -> int:
    kids = [stealer.spawn(kill_once, marker, 2) if i == n // 2 else stealer.spawn(busy_pid, 2)
            for i in range(n)]
    return len(stealer.join(kids))


class Blocker(stealer.Agent):
    """An agent that tries a blocking join (refused: it must yield)."""

    def step(self, ctx):
        c = stealer.spawn(square, 3)
        try:
            stealer.join(c)
        except RuntimeError as exc:
            got = str(exc)
        v = yield c
        return ctx.done((got, v))


class SubmitsInside(stealer.Agent):
    def __init__(self, ex) -> None:
        self.ex = ex

    def step(self, ctx):
        try:
            self.ex.submit(square, 2)
        except RuntimeError as exc:
            return ctx.done(str(exc))
        return ctx.done("submitted")


# -- random trees for the property test: ("b"|"g"|"x", [subtrees]) or an int leaf ----------
def evaluate(tree, ex=None):
    """Sum of the leaves, each node fanning out its subtrees as children and joining them
    its own way: "b" blocking join (stealer.join), "x" through the executor captured
    (ex.submit / result), "g" a generator task (yield).  Returns the sum, or raises the
    first failing leaf's error (a negative leaf fails)."""
    if isinstance(tree, int):
        if tree < 0:
            raise ValueError(f"leaf {tree}")
        return tree
    how, kids = tree
    if how == "g":
        return _evaluate_gen(kids, ex)
    if how == "x" and ex is not None:
        fs = [ex.submit(evaluate, k, ex) for k in kids]
        return sum(f.result() for f in fs)
    return sum(stealer.join([stealer.spawn(evaluate, k, ex) for k in kids]))


def _evaluate_gen(kids, ex):
    vals = yield [stealer.spawn(evaluate, k, ex) for k in kids]
    return sum(vals)


def join_two_as_arguments() -> None:
    a, b = stealer.spawn(square, 2), stealer.spawn(square, 3)
    stealer.join(a, b)  # wrong: a list joins several, the second argument is a timeout
