"""Task functions for the yardstick workloads (README: Benchmarks).

Every function is defined at module level so a worker process imports it by reference
(``stealer.bench.workloads.busy``) instead of receiving pickled code.  Imported by the
workload modules (wl_tasks, wl_forkjoin, wl_agents), the harness, ``stealer demo``
(stealer/cli.py) and tests.

CPU work is a busy-wait on :func:`time.perf_counter`, so a task of 1 ms takes 1 ms of wall
time on any core speed; the results measure the scheduler, not the CPU.

Fork-join tasks (:func:`fib`, :func:`uts`, :func:`uts_bag`) are *generator functions* in the
form ``stealer`` runs: a task creates children with ``stealer.spawn(fn, *args)`` and joins them
by yielding a handle (``x = yield child``) or a list of handles (``x, y = yield [a, b]``); the
generator's return value is the task's result.  ``stealer`` is imported lazily inside those
functions, so this module imports (and its plain functions run) without the executor.

The non-generator counterparts run the same work without fork-join:

- :func:`fib_seq` is the one-process fib; :func:`fib_leaves` lists the leaf sub-problems that
  :func:`fib` computes sequentially, so a plain executor can run the same decomposition
  flat (``sum(map(fib_seq, fib_leaves(n, cutoff)))``).
- :func:`uts_seq` counts the tree in one process; :func:`uts_expand` is one task's worth of
  the tree search (at most ``budget`` nodes, returning the unexplored frontier), the unit both
  the fork-join version and a client-driven loop on a plain executor use.

Agents (the ``agents``, ``tiers`` and ``agent_*`` workloads) are subclasses of
``stealer.Agent`` (:class:`StepAgent`, :class:`BulkAgent`, :class:`InteractiveAgent`,
:class:`NoopAgent`, :class:`PingAgent`, :class:`PongAgent`, :class:`IdleAgent`).  Their work is
done by plain functions a client-driven executor runs as tasks too: :func:`state_step` is one
step of a :class:`StepState` (the state travels with the task), :func:`busy` one bulk step and
:func:`tier_call` one interactive call.  When ``stealer`` does not import, the agent classes
derive from ``object`` (and no system runs them natively).

UTS (Unbalanced Tree Search, Olivier et al., LCPC 2006) binomial tree: the root has ``b0``
children; every other node has ``m`` children with probability ``q`` and none otherwise.
With ``q * m < 1`` the tree is finite, of expected size ``1 + b0 / (1 - q*m)``, and very
unbalanced: most subtrees are a single node, a few are thousands deep-ish.  A node's child
count and its children's ids come from a SplitMix64 stream seeded by the node id, so the tree
is the same in every process and every run.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

try:  # the agents subclass stealer.Agent; this module still imports without stealer
    from stealer.agents import Agent as _AgentBase
except Exception:  # a package under construction
    _AgentBase = object  # type: ignore[assignment,misc]

__all__ = [
    "UTSParams",
    "UTS_QUICK",
    "UTS_DEFAULT",
    "UTS_ROOT_SEED",
    "busy",
    "noop",
    "timed_busy",
    "fib_seq",
    "fib",
    "fib_leaves",
    "fib_task_count",
    "splitmix64",
    "uts_num_children",
    "uts_child_seed",
    "uts_expand",
    "uts_split",
    "uts_seq",
    "uts_stats",
    "uts_bag",
    "uts",
    "StepState",
    "state_step",
    "tier_call",
    "StepAgent",
    "BulkAgent",
    "InteractiveAgent",
    "NoopAgent",
    "PingAgent",
    "PongAgent",
    "IdleAgent",
]

# --------------------------------------------------------------------------- plain tasks


def busy(seconds: float) -> None:
    """Spin on :func:`time.perf_counter` for ``seconds`` of wall time (CPU-bound, no sleep)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def noop(x: Any = None) -> Any:
    """Return ``x`` unchanged: a task whose cost is all scheduling and serialization."""
    return x


def hold_numpy(seconds: float) -> None:
    """Import numpy in this worker and hold it ``seconds`` (so each worker gets one): the
    warm-up of workloads whose payloads carry arrays.  Workers import numpy at the first
    payload that needs one (about 30 ms once); the workloads time steady state."""
    import numpy  # noqa: F401

    busy(seconds)


def timed_busy(seconds: float) -> tuple[int, int]:
    """Busy-wait like :func:`busy`; return ``(start_ns, end_ns)`` of :func:`time.perf_counter_ns`.

    On Linux ``perf_counter`` is ``CLOCK_MONOTONIC``, one clock for all processes, so the client
    can split a task's latency into waiting-to-start, running, and result-return delay.
    """
    start = time.perf_counter_ns()
    end = start + int(seconds * 1e9)
    now = start
    while now < end:
        now = time.perf_counter_ns()
    return start, now


# --------------------------------------------------------------------------- fib


def fib_seq(n: int) -> int:
    """Naive doubly recursive Fibonacci, ``fib_seq(0) == 0``, ``fib_seq(1) == 1``."""
    if n < 2:
        return n
    return fib_seq(n - 1) + fib_seq(n - 2)


def fib(n: int, cutoff: int = 20) -> Generator[Any, Any, int]:
    """Fork-join Fibonacci: spawn ``fib(n-1)`` and ``fib(n-2)`` until ``n < cutoff``.

    Below the cutoff the sub-problem runs sequentially (:func:`fib_seq`).  Runs as a stealer
    task (``executor.submit(fib, 30, 20)``) or inline (``stealer.run_inline(fib, 30, 20)``).
    """
    if n < max(cutoff, 2):
        return fib_seq(n)
    import stealer

    x, y = yield [stealer.spawn(fib, n - 1, cutoff), stealer.spawn(fib, n - 2, cutoff)]
    return x + y


def fib_leaves(n: int, cutoff: int = 20) -> list[int]:
    """The sequential sub-problems :func:`fib` runs, left to right; they sum (by fib_seq) to fib(n)."""
    leaves: list[int] = []
    stack = [n]
    limit = max(cutoff, 2)
    while stack:
        k = stack.pop()
        if k < limit:
            leaves.append(k)
        else:
            stack.append(k - 2)
            stack.append(k - 1)
    return leaves


def fib_task_count(n: int, cutoff: int = 20) -> int:
    """How many tasks :func:`fib` creates in all (internal nodes plus leaves)."""
    leaves = len(fib_leaves(n, cutoff))
    return 2 * leaves - 1  # a full binary tree


# --------------------------------------------------------------------------- UTS

_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15
_TWO_M53 = 2.0**-53

UTS_ROOT_SEED = 15


@dataclass(frozen=True)
class UTSParams:
    """Shape and grain of a binomial UTS tree.

    ``b0`` children at the root; ``m`` children with probability ``q`` at every other node;
    ``node_seconds`` of busy work per node; a task explores at most ``budget`` nodes before it
    hands the rest of its frontier to child tasks.
    """

    b0: int = 1000
    m: int = 4
    q: float = 0.2375
    node_seconds: float = 20e-6
    budget: int = 64

    def __post_init__(self) -> None:
        if not self.q * self.m < 1.0:
            raise ValueError(f"q*m must be < 1 for a finite tree, got {self.q * self.m}")
        if self.budget < 1:
            raise ValueError("budget must be >= 1")

    @property
    def expected_nodes(self) -> float:
        """Expected tree size ``1 + b0 / (1 - q*m)``."""
        return 1.0 + self.b0 / (1.0 - self.q * self.m)


# Node counts (with UTS_ROOT_SEED): quick 21,201 nodes, depth 66 (~0.45 s of work); default
# 106,333 nodes, depth 104 (~2.2 s); checked in tests/test_bench_ideal.py.
UTS_QUICK = UTSParams(b0=1000)
UTS_DEFAULT = UTSParams(b0=5000)


def splitmix64(x: int) -> int:
    """One step of SplitMix64 (Steele, Lea, Flood 2014): a well-mixed 64-bit hash of ``x``."""
    z = (x + _GAMMA) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def uts_num_children(seed: int, depth: int, params: UTSParams) -> int:
    """Child count of node ``seed`` at ``depth``: ``b0`` at the root, else ``m`` w.p. ``q``."""
    if depth == 0:
        return params.b0
    return params.m if (splitmix64(seed) >> 11) * _TWO_M53 < params.q else 0


def uts_child_seed(seed: int, i: int) -> int:
    """Id of child ``i``: output ``i + 1`` of the SplitMix64 stream started at ``seed``."""
    return splitmix64((seed + (i + 1) * _GAMMA) & _MASK64)


def uts_expand(
    bag: Sequence[tuple[int, int]], params: UTSParams
) -> tuple[int, list[tuple[int, int]]]:
    """Explore up to ``params.budget`` nodes depth-first from the nodes in ``bag``.

    Each node costs ``params.node_seconds`` of busy work.  Returns ``(nodes_visited,
    frontier)``, where ``frontier`` lists the ``(seed, depth)`` nodes not yet visited (empty
    when the bag's subtrees are done).  A plain function, so a plain executor can run it too.
    """
    stack = list(bag)
    count = 0
    budget = params.budget
    node_s = params.node_seconds
    while stack and count < budget:
        seed, depth = stack.pop()
        if node_s > 0.0:
            busy(node_s)
        count += 1
        for i in range(uts_num_children(seed, depth, params)):
            stack.append((uts_child_seed(seed, i), depth + 1))
    return count, stack


def uts_split(frontier: list[tuple[int, int]], parts: int = 2) -> list[list[tuple[int, int]]]:
    """Deal a frontier into at most ``parts`` non-empty bags (interleaved, so each bag gets
    both shallow and deep nodes)."""
    k = max(1, min(parts, len(frontier)))
    return [frontier[i::k] for i in range(k)] if frontier else []


def uts_seq(node_seed: int = UTS_ROOT_SEED, depth: int = 0, params: UTSParams = UTS_QUICK) -> int:
    """Count the nodes of the subtree at ``(node_seed, depth)`` in one process (with busy work):
    :func:`uts_expand` with no budget."""
    count, _frontier = uts_expand(((node_seed, depth),), replace(params, budget=sys.maxsize))
    return count


def uts_stats(
    node_seed: int = UTS_ROOT_SEED, depth: int = 0, params: UTSParams = UTS_QUICK
) -> tuple[int, int]:
    """``(node_count, max_depth)`` of the subtree, without busy work (for the ideal bound)."""
    stack = [(node_seed, depth)]
    count = 0
    deepest = depth
    while stack:
        seed, d = stack.pop()
        count += 1
        if d > deepest:
            deepest = d
        for i in range(uts_num_children(seed, d, params)):
            stack.append((uts_child_seed(seed, i), d + 1))
    return count, deepest


def uts_bag(
    bag: Sequence[tuple[int, int]], params: UTSParams = UTS_QUICK
) -> Generator[Any, Any, int]:
    """Fork-join UTS task over a bag of nodes: explore ``budget`` nodes, then spawn one child
    task per part of the remaining frontier, join them, and return the total node count."""
    count, frontier = uts_expand(bag, params)
    if not frontier:
        return count
    import stealer

    children = [stealer.spawn(uts_bag, part, params) for part in uts_split(frontier)]
    counts = yield children
    return count + sum(counts)


def uts(
    node_seed: int = UTS_ROOT_SEED, depth: int = 0, params: UTSParams = UTS_QUICK
) -> Generator[Any, Any, int]:
    """Fork-join UTS from one node: the node count of its subtree (equals :func:`uts_seq`)."""
    return (yield from uts_bag(((node_seed, depth),), params))


# --------------------------------------------------------------------------- agents


@dataclass
class StepState:
    """The state one agent of the ``agents`` workload carries from step to step.

    ``arr`` is a numpy array (1,000 floats in the workload), every element ``count`` after
    ``count`` steps; ``last`` is the :func:`time.monotonic` at which the previous step ended
    (the run's start before the first step) and ``lats`` the per-step latencies so far.  On a
    plain executor the whole state is a task's argument and its result.
    """

    index: int
    steps: int
    work: float
    arr: Any
    last: float
    count: int = 0
    lats: list[float] = field(default_factory=list)


def state_step(s: StepState) -> StepState:
    """One step: check the state came through intact, busy-wait ``s.work``, add 1 to the
    counter and to every element of the array, record the step's latency.  Returns ``s``."""
    if s.arr[0] != s.count or s.arr[-1] != s.count:
        raise RuntimeError(f"agent {s.index}: state lost (array at {s.arr[0]}, count {s.count})")
    busy(s.work)
    s.count += 1
    s.arr += 1.0
    now = time.monotonic()
    s.lats.append(now - s.last)
    s.last = now
    return s


def tier_call(i: int, work: float) -> tuple[int, float]:
    """The interactive call of the ``tiers`` workload: ``work`` seconds of busy work; returns
    ``(i, perf_counter at its start)``."""
    t = time.perf_counter()
    busy(work)
    return i, t


class StepAgent(_AgentBase):
    """Self-driven: :func:`state_step` until ``steps`` steps are done; the final value is the
    :class:`StepState`."""

    def __init__(self, state: StepState) -> None:
        self.s = state

    def step(self, ctx: Any) -> Any:
        s = state_step(self.s)
        if s.count >= s.steps:
            return ctx.done(s)
        return None


class BulkAgent(_AgentBase):
    """Steps of ``work`` seconds of busy work forever; stopped, its value is its step count."""

    def __init__(self, work: float) -> None:
        self.work = work
        self.steps = 0

    def step(self, ctx: Any) -> Any:
        busy(self.work)
        self.steps += 1
        return None

    def count(self) -> int:
        """Steps so far (a bulk-tier message: answered at its next turn)."""
        return self.steps

    def on_stop(self) -> int:
        return self.steps


class InteractiveAgent(_AgentBase):
    """Message-only: :meth:`hit` is :func:`tier_call`."""

    def __init__(self, work: float) -> None:
        self.work = work
        self.calls = 0

    def hit(self, i: int) -> tuple[int, float]:
        self.calls += 1
        return tier_call(i, self.work)

    def on_stop(self) -> int:
        return self.calls


class NoopAgent(_AgentBase):
    """``steps`` steps that do nothing but count; the final value is the count."""

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self.n = 0

    def step(self, ctx: Any) -> Any:
        self.n += 1
        if self.n >= self.steps:
            return ctx.done(self.n)
        return None


class PongAgent(_AgentBase):
    """Message-only: ``ping(i)`` answers ``i + 1``."""

    def ping(self, i: int) -> int:
        return i + 1

    def where(self) -> int:
        """The pid of the worker it lives on."""
        return os.getpid()


class PingAgent(_AgentBase):
    """Waits for :meth:`start`, then calls ``other.ping`` ``rounds`` times, each with the
    previous reply (``v = yield other.call("ping", v)``); the final value is ``(v, seconds)``
    measured in its worker (``v == rounds`` when every reply came back)."""

    def __init__(self, other: Any, rounds: int) -> None:
        self.other = other
        self.rounds = rounds
        self.go = False

    def where(self) -> int:
        """The pid of the worker it lives on."""
        return os.getpid()

    def start(self) -> None:
        self.go = True

    def step(self, ctx: Any) -> Any:
        if not self.go:
            return ctx.wait()  # the generator's return value is the step's outcome
        t0 = time.perf_counter()
        v = 0
        for _ in range(self.rounds):
            v = yield self.other.call("ping", v)
        return ctx.done((v, time.perf_counter() - t0))


class IdleAgent(_AgentBase):
    """Message-only, no state, no step: what a million idle agents are."""

    def ping(self, x: Any = None) -> Any:
        return x
