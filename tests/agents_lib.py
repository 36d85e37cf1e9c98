"""Agent classes for the agent tests (importable by spawn-started workers)."""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

import stealer
from stealer.bench.workloads import BulkAgent


def busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def hog_one_worker(ex: Any, seconds: float = 0.3) -> Any:
    """Keep one worker in a plain task for ``seconds`` (its future is returned once the
    task runs): new agents then all start on the other worker (the client places none
    behind a task), and the first, idle once its task ends, takes a share of them from
    the loaded one: migrations, whatever the machine's speed."""
    from stealer.shared.shm import W_CURRENT

    f = ex.submit(busy, seconds)
    pool = ex._pool
    deadline = time.monotonic() + 30
    while not any(pool.region.load64(pool.layout.worker(k) + W_CURRENT)
                  for k in range(pool.n)):
        assert time.monotonic() < deadline and not f.done(), "the hog task never ran"
        time.sleep(0.001)
    return f


class Counter(stealer.Agent):
    """Message-only: add/get; records every (sender, seq) it saw."""

    def __init__(self, start: int = 0, delay: float = 0.0) -> None:
        self.n = start
        self.delay = delay
        self.seen: list[tuple[Any, int]] = []

    def add(self, k: int) -> int:
        if self.delay:
            busy(self.delay)
        self.n += k
        return self.n

    def note(self, sender: Any, seq: int) -> None:
        if self.delay:
            busy(self.delay)
        self.seen.append((sender, seq))

    def get(self) -> int:
        return self.n

    def log(self) -> list:
        return self.seen

    def boom(self) -> None:
        raise ValueError("boom in a handler")

    def on_stop(self) -> str:
        return f"stopped at {self.n}"


class HandlerForker(stealer.Agent):
    """A handler that spawns a child task and waits for it (fork-join from an agent)."""

    def work(self, x: int) -> Any:
        v = yield stealer.spawn(_square, x)
        return v + 1

    def deep(self, x: int) -> Any:
        """A child that is itself a generator waiting for a grandchild."""
        v = yield stealer.spawn(_square_plus_one, x)
        return v + 1


def _square_plus_one(x: int) -> Any:
    v = yield stealer.spawn(_square, x)
    return v + 1


def gets_from_task(ref: stealer.AgentRef, n: int) -> list[int]:
    """A plain task that calls an agent ``n`` times and waits for each reply."""
    return [ref.call("get").result(60) for _ in range(n)]


def gets_from_generator(ref: stealer.AgentRef, n: int) -> Any:
    """A generator task that calls an agent ``n`` times, yielding each call."""
    got = []
    for _ in range(n):
        got.append((yield ref.call("get")))
    return got


class Stepper(stealer.Agent):
    """Self-driven: ``steps`` steps of ``work`` seconds; its state is a counter and an array."""

    def __init__(self, steps: int, work: float = 0.0, size: int = 1000) -> None:
        self.left = steps
        self.count = 0
        self.arr = np.zeros(size)
        self.work = work
        self.got = 0

    def step(self, ctx: stealer.Ctx) -> Any:
        if not np.all(self.arr == self.count):
            raise AssertionError(f"state corrupted: arr != {self.count}")
        if self.work:
            busy(self.work)
        self.count += 1
        self.arr += 1
        self.left -= 1
        if self.left <= 0:
            return ctx.done((self.count, float(self.arr.sum()), self.got))
        return None

    def poke(self, k: int) -> None:
        self.got += k


class Sleeper(stealer.Agent):
    def __init__(self) -> None:
        self.phase = 0

    def step(self, ctx: stealer.Ctx) -> Any:
        self.phase += 1
        if self.phase == 1:
            return ctx.sleep(0.05)
        if self.phase == 2:
            return ctx.wait()
        return ctx.done(self.phase)

    def ping(self) -> str:
        return "pong"


class Caller(stealer.Agent):
    """Calls another agent from its step (yield) and adds the replies."""

    def __init__(self, other: stealer.AgentRef, n: int) -> None:
        self.other = other
        self.n = n
        self.total = 0

    def step(self, ctx: stealer.Ctx) -> Any:
        for i in range(self.n):
            self.total = yield self.other.call("add", i)
        return ctx.done(self.total)


class Relay(stealer.Agent):
    """A handler that calls another agent (a generator handler)."""

    def __init__(self, other: stealer.AgentRef) -> None:
        self.other = other

    def relay(self, k: int) -> Any:
        v = yield self.other.call("add", k)
        return v * 10


class Flaky(stealer.Agent):
    instances = 0

    def __init__(self, fail_at: int) -> None:
        self.fail_at = fail_at
        self.count = 0

    def step(self, ctx: stealer.Ctx) -> Any:
        self.count += 1
        if self.count == self.fail_at:
            raise RuntimeError(f"flaky at {self.count} (generation {ctx.generation})")
        if self.count >= self.fail_at + 3:
            return ctx.done((self.count, ctx.generation))
        return None


class Looper(stealer.Agent):
    """A step that never returns by itself (a Python loop)."""

    def step(self, ctx: stealer.Ctx) -> Any:
        while True:
            pass


# Steps of ``work`` seconds forever, counting them (count(), on_stop()): the bench's own.
Hog = BulkAgent


class Quick(stealer.Agent):
    """A light agent answering calls."""

    def __init__(self) -> None:
        self.calls = 0

    def hit(self, t_sent: float) -> float:
        self.calls += 1
        busy(0.0002)
        return time.monotonic() - t_sent


class Blocker(stealer.Agent):
    """Waits for a blocking call off the CPU path while returning its result."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def step(self, ctx: stealer.Ctx) -> Any:
        t0 = time.monotonic()
        v = yield ctx.run_blocking(_sleep_and_return, self.seconds, "slept")
        return ctx.done((v, time.monotonic() - t0, time.monotonic()))


def _sleep_and_return(seconds: float, value: Any) -> Any:
    time.sleep(seconds)
    return value


class Finisher(stealer.Agent):
    """Steps ``n`` times (``work`` each), then reports the time it finished."""

    def __init__(self, n: int, work: float) -> None:
        self.n = n
        self.work = work

    def step(self, ctx: stealer.Ctx) -> Any:
        busy(self.work)
        self.n -= 1
        if self.n <= 0:
            return ctx.done(time.monotonic())
        return None


class Forker(stealer.Agent):
    """A step that forks children with stealer.spawn and joins them by yield."""

    def step(self, ctx: stealer.Ctx) -> Any:
        kids = [stealer.spawn(_square, i) for i in range(10)]
        vals = yield kids
        return ctx.done(sum(vals))


def _square(x: int) -> int:
    return x * x


class Spawner(stealer.Agent):
    """Spawns child agents from its step and collects their replies."""

    def step(self, ctx: stealer.Ctx) -> Any:
        refs = [ctx.spawn_agent(Counter, i) for i in range(5)]
        total = 0
        for r in refs:
            total += yield r.call("add", 1)
        for r in refs:
            r.stop()
        return ctx.done(total)


class Unpicklable(stealer.Agent):
    def __init__(self) -> None:
        import threading

        self.lock = threading.Lock()
        self.n = 0

    def step(self, ctx: stealer.Ctx) -> Any:
        self.n += 1
        if self.n >= 100:
            return ctx.done(self.n)
        return None


class StuckInC(stealer.Agent):
    """A step stuck in C code: sum() over a huge iterator never checks for signals."""

    def step(self, ctx: stealer.Ctx) -> Any:
        import itertools

        return ctx.done(sum(itertools.repeat(1, 10**11)))


class GenReporter(stealer.Agent):
    """Steps ``n`` times; reports the generations it saw."""

    def __init__(self, n: int, work: float) -> None:
        self.n = n
        self.work = work
        self.gens: set[int] = set()

    def step(self, ctx: stealer.Ctx) -> Any:
        self.gens.add(ctx.generation)
        busy(self.work)
        self.n -= 1
        if self.n <= 0:
            return ctx.done(sorted(self.gens))
        return None


class LockedCounter(Counter):
    """A counter whose state holds a lock: it cannot be pickled."""

    def __init__(self, start: int = 0) -> None:
        import threading

        super().__init__(start)
        self.lock = threading.Lock()


class LongStepper(stealer.Agent):
    """Step 1 spawns ``n`` short agents (pushed on this worker's deque) and sleeps a little,
    so this worker adopts some of them; step 2 is long."""

    def __init__(self, n: int, long: float) -> None:
        self.n = n
        self.long = long
        self.kids: list = []
        self.phase = 0

    def step(self, ctx: stealer.Ctx) -> Any:
        self.phase += 1
        if self.phase == 1:
            self.kids = [ctx.spawn_agent(Finisher, 4, 0.03) for _ in range(self.n)]
            return ctx.sleep(0.02)  # meanwhile this worker adopts some of them
        busy(self.long)
        return ctx.done((self.kids, time.monotonic()))


class Marker(stealer.Agent):
    """Steps append their index to a log; ``mark(x)`` appends ("m", x) and replies its
    position: a replay that reorders steps and messages contradicts an earlier reply."""

    def __init__(self, steps: int, work: float) -> None:
        self.steps = steps
        self.work = work
        self.i = 0
        self.log: list = []

    def step(self, ctx: stealer.Ctx) -> Any:
        busy(self.work)
        self.log.append(self.i)
        self.i += 1
        if self.i >= self.steps:
            return ctx.done(self.log)
        return None

    def mark(self, x: int) -> int:
        self.log.append(("m", x))
        return len(self.log) - 1


def send_many(ref: stealer.AgentRef, n: int) -> int:
    """A plain task sending ``n`` messages (its agent may live on the same worker)."""
    for _ in range(n):
        ref.send("add", 1)
    return n


class Fanout(stealer.Agent):
    """Calls a group of agents at once from a handler (stealer.call_all, or a yielded list
    of ref.call results) and returns every reply."""

    def __init__(self, refs: list) -> None:
        self.refs = refs

    def all_add(self, k: int) -> Any:
        return (yield stealer.call_all(self.refs, "add", [(k,)] * len(self.refs)))

    def listed(self, k: int) -> Any:
        return (yield [r.call("add", k) for r in self.refs])


class Spans(stealer.Agent):
    """Steps ``steps`` times, each a busy ``long`` seconds; its final value is the
    (start, end) of every step (time.monotonic, one clock for all processes on Linux)."""

    def __init__(self, steps: int, long: float) -> None:
        self.left = steps
        self.long = long
        self.spans: list[tuple[float, float]] = []
        self.hits: list[float] = []

    def step(self, ctx: stealer.Ctx) -> Any:
        t0 = time.monotonic()
        busy(self.long)
        self.spans.append((t0, time.monotonic()))
        self.left -= 1
        return ctx.done(self.spans) if self.left <= 0 else None

    def hit(self) -> float:
        self.hits.append(time.monotonic())
        return self.hits[-1]


class Stamp(stealer.Agent):
    """Message-only: ``hit`` returns when it ran; ``add``/``get`` count."""

    def __init__(self) -> None:
        self.n = 0

    def hit(self) -> float:
        return time.monotonic()

    def add(self, k: int) -> int:
        self.n += k
        return self.n

    def get(self) -> int:
        return self.n

    def keep(self, _x: Any) -> None:
        """Takes any argument (SlowArg)."""


class SlowArg:
    """Takes ``seconds`` to pickle (time.sleep in ``__reduce__``): a send of it stays inside
    stealer's API that long."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __reduce__(self) -> tuple:
        time.sleep(self.seconds)
        return (SlowArg, (0.0,))


class SlowSender(stealer.Agent):
    """One step: ``target.send("keep", SlowArg(pickle_s))``, then ``after_s`` of busy work;
    the final value is the step's (start, end of the send, end)."""

    def __init__(self, target: Any, pickle_s: float, after_s: float) -> None:
        self.target = target
        self.pickle_s = pickle_s
        self.after_s = after_s

    def step(self, ctx: stealer.Ctx) -> Any:
        t0 = time.monotonic()
        self.target.send("keep", SlowArg(self.pickle_s))
        t1 = time.monotonic()
        busy(self.after_s)
        return ctx.done((t0, t1, time.monotonic()))


class Timed(stealer.Agent):
    """Message-only: ``work(seconds)`` keeps its worker busy that long, then returns when
    it ended (CLOCK_MONOTONIC, comparable across the processes of one machine)."""

    def work(self, seconds: float) -> float:
        busy(seconds)
        return time.monotonic()


class Gate(stealer.Agent):
    """``hold(started, release)`` and, with ``stepping``, its one step: create the file
    ``started``, then wait until the file ``release`` exists (so a test can look at the
    worker while a handler or a step runs)."""

    def __init__(self, stepping: tuple | None = None) -> None:
        self.stepping = stepping

    def step(self, ctx: stealer.Ctx) -> Any:
        if self.stepping is not None:
            self.hold(*self.stepping)
            self.stepping = None
        return ctx.wait()

    def hold(self, started: str, release: str) -> str:
        open(started, "w").close()
        end = time.monotonic() + 60
        while not os.path.exists(release) and time.monotonic() < end:
            time.sleep(0.001)
        return "held"


class Where(stealer.Agent):
    """Message-only: ``pid`` says which worker process holds it."""

    def pid(self) -> int:
        return os.getpid()


class GymEnv(stealer.Agent):
    """A gymnasium-style environment: ``step(action)`` is a message handler its client
    calls (``self_driven = False``), never the agent's own step."""

    self_driven = False

    def __init__(self) -> None:
        self.t = 0
        self.total = 0.0

    def reset(self) -> int:
        self.t, self.total = 0, 0.0
        return 0

    def step(self, action: float) -> tuple[float, int]:
        self.t += 1
        self.total += action
        return self.total, self.t


class GymEnvUnmarked(stealer.Agent):
    """The same without ``self_driven = False``: its ``step`` is taken for the agent's
    own, called by the worker with a Ctx, which it adds to a float."""

    def __init__(self) -> None:
        self.total = 0.0

    def step(self, action: Any) -> None:
        self.total = self.total + action


class Hop(stealer.Agent):
    """A call chain: ``hop(n)`` calls the next agent's ``hop(n - 1)`` from a generator
    handler and adds one; ``cycle_step`` is a self-driven agent's step that calls in."""

    def __init__(self, nxt: Any = None) -> None:
        self.nxt = nxt
        self.plain = 0

    def link(self, nxt: Any) -> None:
        self.nxt = nxt

    def hop(self, n: int) -> Any:
        if n == 0:
            return 0
        return (yield self.nxt.call("hop", n - 1)) + 1

    def fan(self, refs: list) -> Any:
        return (yield stealer.call_all(refs, "hop", [(0,)] * len(refs)))

    def caught(self, n: int) -> Any:
        try:
            return (yield self.nxt.call("hop", n))
        except stealer.AgentDeadlock as exc:
            return f"caught: {type(exc).__name__}"

    def poke(self) -> int:
        self.plain += 1
        return self.plain


class HopStep(stealer.Agent):
    """A self-driven agent whose step, once ``go(other)`` came, calls ``other.hop(1)``
    (``other`` calls back here)."""

    def __init__(self) -> None:
        self.other: Any = None

    def go(self, other: Any) -> None:
        self.other = other

    def step(self, ctx: stealer.Ctx) -> Any:
        if self.other is None:
            return ctx.wait()
        v = yield self.other.call("hop", 1)
        return ctx.done(v)

    def hop(self, n: int) -> int:
        return n


class GatedLog(Gate):
    """A Gate that also logs: ``note(x)`` appends x; ``log()``; ``pid()`` of its worker."""

    def __init__(self) -> None:
        super().__init__()
        self.notes: list[Any] = []

    def note(self, x: Any) -> int:
        self.notes.append(x)
        return len(self.notes)

    def log(self) -> list:
        return self.notes

    def pid(self) -> int:
        return os.getpid()


class Caller2(stealer.Agent):
    """``fire(other)``: a plain handler that calls ``other.back(me)`` without waiting and
    returns (so this agent is free when ``other`` calls back); ``got()``: the replies."""

    def __init__(self) -> None:
        self.got: list[Any] = []

    def fire(self, other: Any, me: Any) -> str:
        other.call("back", me)  # not yielded: nobody waits for it
        return "fired"

    def note(self, x: Any) -> str:
        self.got.append(x)
        return "noted"

    def seen(self) -> list:
        return self.got


class Backer(stealer.Agent):
    """``back(ref)``: calls ``ref.note("back")`` from a generator handler."""

    def back(self, ref: Any) -> Any:
        return (yield ref.call("note", "back"))


class AsyncRelay(stealer.Agent):
    """``async def`` handlers (a Ray async actor's habit): each awaits what a generator
    handler would yield."""

    self_driven = False

    def __init__(self, other: stealer.AgentRef) -> None:
        self.other = other

    async def relay(self, k: int) -> Any:
        a = await self.other.call("add", k)
        both = await stealer.call_all([self.other, self.other], "add", [(1,), (2,)])
        sq = await stealer.spawn(_square, k)
        return a, both, sq

    async def catch(self) -> str:
        try:
            await self.other.call("boom")
        except ValueError as e:  # the callee's error, raised at the await
            return f"caught {e}"
        return "not raised"

    async def gathered(self, k: int) -> Any:
        """Calls of two methods awaited together, then two children together."""
        added, got = await stealer.gather(self.other.call("add", k), self.other.call("get"))
        kids = await stealer.gather([stealer.spawn(_square, k), stealer.spawn(_square, k + 1)])
        return added, got, kids

    async def mixed(self) -> Any:
        return await stealer.gather(self.other.call("get"), stealer.spawn(_square, 2))

    def gathered_gen(self, k: int) -> Any:
        """stealer.gather yielded from a generator handler, replies and children."""
        added, got = yield stealer.gather(self.other.call("add", k), self.other.call("get"))
        kids = yield stealer.gather(stealer.spawn(_square, k), stealer.spawn(_square, k + 1))
        return added, got, kids

    async def uses_asyncio(self) -> None:
        import asyncio

        await asyncio.sleep(0.001)

    def blocks(self, k: int) -> Any:
        """Not a generator: blocking on a call here is refused (it says to yield)."""
        return self.other.call("add", k).result(5)

    def polls(self, k: int) -> Any:
        return self.other.call("add", k).done()


class AsyncWalker(stealer.Agent):
    """A self-driven agent whose ``step`` is ``async def``: awaits a blocking call and a
    call to another agent each step; done once the other's count passes ``until``."""

    def __init__(self, other: stealer.AgentRef, until: int) -> None:
        self.other = other
        self.until = until
        self.steps = 0

    async def step(self, ctx: stealer.Ctx) -> Any:
        self.steps += 1
        slept = await ctx.run_blocking(_sleep_and_return, 0.001, "slept")
        n = await self.other.call("add", 1)
        if n >= self.until:
            return ctx.done((self.steps, n, slept))
        return None


class AsyncLogger(stealer.Agent):
    """``relay(k)``: an ``async def`` handler that awaits ``other.add(1)`` and logs what it
    got; ``log()``: the replies it logged (one per relay handled, in order)."""

    self_driven = False

    def __init__(self, other: stealer.AgentRef) -> None:
        self.other = other
        self.got: list[int] = []

    async def relay(self, k: int) -> int:
        v = await self.other.call("add", 1)
        busy(0.002)
        self.got.append(v)
        return v

    def log(self) -> list[int]:
        return self.got


class AsyncStopper(stealer.Agent):
    """``async def on_stop`` (run to its end at the stop); ``waits``: one that awaits."""

    self_driven = False

    def __init__(self, other: Any = None) -> None:
        self.other = other
        self.n = 0

    def add(self, k: int) -> int:
        self.n += k
        return self.n

    async def yields_to_asyncio(self) -> None:
        import asyncio

        await asyncio.sleep(0)

    async def on_stop(self) -> Any:
        if self.other is not None:
            await self.other.call("get")
        return f"stopped at {self.n}"
