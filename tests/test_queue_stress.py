"""Multi-process stress tests of the shared-memory queues (fork + anonymous shared mmap).

Each test maps one anonymous ``MAP_SHARED`` mmap, builds the structures and the
bookkeeping in it, and forks worker processes that inherit the mapping (and the
Region / queue objects pointing into it).  Every process records the values it
took into its own slice of the mapping; after joining, the parent checks that
each value was taken exactly once (no loss, no duplicate) and, for the rings,
that ordering guarantees held.

The native implementation runs with about 200k values; the pure-Python
reference runs with a ``multiprocessing`` lock shared by all processes and 5k
values.  Every process has a deadline and a shared abort flag, and the parent
terminates and joins everything in ``finally``, so a bug shows up as a failure
with a message rather than a hang.
"""

from __future__ import annotations

import collections
import mmap
import multiprocessing as mp
import os
import random
import sys
import time
from types import ModuleType

import pytest

from stealer.shared import pyqueues as _pyqueues

try:
    from stealer import _cqueues
except ImportError:  # pragma: no cover - depends on the build
    _cqueues = None

pytestmark = pytest.mark.stress

CTX = mp.get_context("fork")
LINE = 64
BUDGET_S = 30.0  # per test, generous: a healthy run takes a few seconds
EXIT_ABORTED = 3  # a child that stopped because a sibling failed

# Control words, each on its own cache line at the start of the mapping.
ABORT, READY, DONE, PDONE = (i * LINE for i in range(4))
CONTROL_BYTES = 4 * LINE

N_NATIVE = 200_000
N_PYTHON = 5_000


class Aborted(Exception):
    """Raised in a child when a sibling failed or the deadline passed."""


def _round_line(n: int) -> int:
    return (n + LINE - 1) // LINE * LINE


class Shm:
    """An anonymous shared mapping carved into 64-byte-aligned pieces."""

    def __init__(self, impl: ModuleType, size: int) -> None:
        self.mm = mmap.mmap(-1, _round_line(size) + CONTROL_BYTES)  # MAP_SHARED, inherited by fork
        self.lock = None if impl.NATIVE else CTX.Lock()
        self.region = impl.Region(self.mm, self.lock)
        self.impl = impl
        self.next = CONTROL_BYTES
        self.deadline = 0.0

    def alloc(self, nbytes: int) -> int:
        off = self.next
        self.next += _round_line(nbytes)
        assert self.next <= len(self.mm), "Shm too small"
        return off

    def structure(self, kind: str, capacity: int):
        cls = getattr(self.impl, kind)
        q = cls(self.region, self.alloc(cls.nbytes(capacity)), capacity)
        q.init()
        return q

    def recorder(self, capacity: int) -> int:
        """Room for a count word (own line) and ``capacity`` uint64 values."""
        return self.alloc(LINE + 8 * capacity)

    def check(self) -> None:
        """Called periodically by children: stop on abort or deadline."""
        if self.region.load32(ABORT):
            raise Aborted("a sibling process failed")
        if time.monotonic() > self.deadline:
            raise Aborted(f"deadline passed in pid {os.getpid()}")

    def values(self, rec: int) -> list[int]:
        """In the parent, after join: the values a recorder holds."""
        n = self.region.load64(rec)
        mv = memoryview(self.mm)[rec + LINE : rec + LINE + 8 * n].cast("Q")
        try:
            return mv.tolist()
        finally:
            mv.release()


class Recorder:
    """In a child: append values to its slice of the mapping."""

    def __init__(self, shm: Shm, off: int, capacity: int) -> None:
        self.shm, self.off = shm, off
        self.mv = memoryview(shm.mm)[off + LINE : off + LINE + 8 * capacity].cast("Q")
        self.n = 0

    def add(self, v: int) -> None:
        if self.n >= len(self.mv):
            raise AssertionError(f"recorder overflow after {self.n} values: duplicates were taken")
        self.mv[self.n] = v
        self.n += 1

    def extend(self, vs: list[int]) -> None:
        for v in vs:
            self.add(v)

    def publish(self) -> None:
        self.shm.region.store64(self.off, self.n)


def _child_main(shm: Shm, fn, args) -> None:
    try:
        fn(*args)
    except Aborted as exc:
        print(f"stress child {mp.current_process().name} stopped: {exc}", file=sys.stderr)
        shm.region.store32(ABORT, 1)
        sys.exit(EXIT_ABORTED)
    except BaseException:
        shm.region.store32(ABORT, 1)
        raise


def _run(shm: Shm, jobs: list[tuple[str, object, tuple]]) -> None:
    """Fork one process per job, wait for all under the budget, fail with a message otherwise."""
    shm.deadline = time.monotonic() + BUDGET_S - 3.0  # children give up first, with a message
    procs = [
        CTX.Process(target=_child_main, args=(shm, fn, args), name=name, daemon=True)
        for name, fn, args in jobs
    ]
    deadline = time.monotonic() + BUDGET_S
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [p.name for p in procs if p.is_alive()]
        if hung:
            pytest.fail(f"stress processes still running after {BUDGET_S:.0f}s: {hung}")
        failed = {p.name: p.exitcode for p in procs if p.exitcode != 0}
        if failed:
            pytest.fail(f"stress processes failed (exit codes; see captured stderr): {failed}")
    finally:
        for p in procs:
            if p.pid is not None and p.is_alive():
                p.terminate()
        for p in procs:
            if p.pid is not None:
                p.join(5.0)
                if p.is_alive():
                    p.kill()
                    p.join(5.0)


def _wait_ready(shm: Shm, n: int) -> None:
    while shm.region.load32(READY) < n:
        shm.check()
        time.sleep(0.0005)


def _exactly_once(taken: list[int], n: int, what: str) -> None:
    if len(taken) == n and sorted(taken) == list(range(n)):
        return
    counts = collections.Counter(taken)
    dups = sorted(v for v, c in counts.items() if c > 1)
    missing = sorted(set(range(n)) - counts.keys())
    alien = sorted(v for v in counts if not 0 <= v < n)
    pytest.fail(
        f"{what}: {len(taken)} values taken for {n} pushed; {len(dups)} duplicated "
        f"(first {dups[:10]}), {len(missing)} lost (first {missing[:10]}), "
        f"{len(alien)} never pushed (first {alien[:10]})"
    )


def _impl(name: str) -> tuple[ModuleType, int]:
    if name == "native":
        if _cqueues is None:
            pytest.skip("native extension not built")
        return _cqueues, N_NATIVE
    return _pyqueues, N_PYTHON


IMPL_PARAMS = pytest.mark.parametrize("impl_name", ["native", "python"])


# --------------------------------------------------------------------------- Deque


@IMPL_PARAMS
@pytest.mark.parametrize(
    ("owner_cap", "thief_cap", "seed"),
    [(256, 64, 1), (64, 8, 4), (16, 4, 2), (4, 1, 3), (2, 1, 5)],
    ids=["roomy", "medium", "small", "tiny", "minimal"],
)
def test_deque_owner_and_thieves_exactly_once(impl_name, owner_cap, thief_cap, seed):
    """One owner pushes/pops n unique handles; 3 thieves steal/steal_half (also from each other)."""
    impl, n = _impl(impl_name)
    n_thieves = 3
    shm = Shm(impl, 2 * (n_thieves + 1) * (LINE + 8 * n) + 4 * (1 << 16) + (1 << 16))
    victim = shm.structure("Deque", owner_cap)
    own = [shm.structure("Deque", thief_cap) for _ in range(n_thieves)]
    recs = [shm.recorder(n) for _ in range(n_thieves + 1)]  # recs[0]: owner
    stats = shm.alloc(LINE * n_thieves)  # per thief: steals, steal_half batches seen, retries
    EMPTY, RETRY = impl.EMPTY, impl.RETRY

    def owner() -> None:
        rec = Recorder(shm, recs[0], n)
        rng = random.Random(seed)
        _wait_ready(shm, n_thieves)
        nxt = it = 0
        phase_end, pop_prob = 0, 0.0
        while nxt < n:
            it += 1
            if not it & 1023:
                shm.check()
            if it >= phase_end:
                # Phases: push-heavy (the deque fills and thieves feast), balanced, and
                # pop-heavy (it runs dry, so the owner races thieves for the last item).
                phase_end = it + rng.randrange(100, 3000)
                pop_prob = rng.choice((0.05, 0.3, 0.5, 0.7))
            if rng.random() < pop_prob:
                h = victim.pop()
                if h != EMPTY:
                    rec.add(h)
            elif victim.push(nxt):
                nxt += 1
            else:  # full: take one ourselves
                h = victim.pop()
                if h != EMPTY:
                    rec.add(h)
        while (h := victim.pop()) != EMPTY:
            rec.add(h)
        rec.publish()
        shm.region.store32(DONE, 1)  # the victim is empty and stays empty

    def thief(i: int) -> None:
        rec = Recorder(shm, recs[i + 1], n)
        mine = own[i]
        others = [own[j] for j in range(n_thieves) if j != i]
        rng = random.Random(seed * 100 + i)
        steals = batch = retries = it = 0
        shm.region.add32(READY, 1)
        while True:
            it += 1
            if not it & 255:
                shm.check()
            h = mine.pop()
            if h != EMPTY:
                rec.add(h)
                continue
            done = shm.region.load32(DONE)  # read before looking at the victim
            v = victim if rng.random() < 0.85 else rng.choice(others)
            if rng.random() < 0.5:
                h = v.steal()
            else:
                before = len(mine)
                h = v.steal_half(mine, rng.choice((1, 2, 4, 16, 32, 100)))
                batch += len(mine) > before  # others may steal from mine meanwhile: a hint only
            if h >= 0:
                rec.add(h)
                steals += 1
            elif h == RETRY:
                retries += 1
            elif v is victim:
                if done:
                    break  # our own deque and the (finished) victim are both empty
                if not it & 7:
                    os.sched_yield()
        rec.publish()
        for k, val in enumerate((steals, batch, retries)):
            shm.region.store64(stats + LINE * i + 8 * k, val)

    jobs = [(f"thief{i}", thief, (i,)) for i in range(n_thieves)] + [("owner", owner, ())]
    _run(shm, jobs)

    taken = [shm.values(r) for r in recs]
    _exactly_once([h for t in taken for h in t], n, f"Deque ({impl_name}, {n} handles)")
    thief_total = sum(len(t) for t in taken[1:])
    assert thief_total > 0, (
        "the thieves never stole anything: the test did not exercise concurrency"
    )
    assert len(taken[0]) > 0
    assert len(victim) == 0
    assert all(len(d) == 0 for d in own)
    st = [[shm.region.load64(stats + LINE * i + 8 * k) for k in range(3)] for i in range(n_thieves)]
    assert sum(s[0] for s in st) > 0
    if owner_cap >= 16:
        assert sum(s[1] for s in st) > 0, "steal_half never moved more than one item"


# --------------------------------------------------------------------------- MPMCRing


@IMPL_PARAMS
@pytest.mark.parametrize("capacity", [128, 2])
def test_mpmc_producers_consumers_exactly_once(impl_name, capacity):
    """3 producers push disjoint ranges (retrying when full); 3 consumers pop / pop_many."""
    impl, n = _impl(impl_name)
    n_prod = n_cons = 3
    per = n // n_prod
    n = per * n_prod
    shm = Shm(impl, 2 * n_cons * (LINE + 8 * n) + (1 << 16))
    ring = shm.structure("MPMCRing", capacity)
    recs = [shm.recorder(n) for _ in range(n_cons)]
    EMPTY = impl.EMPTY

    def producer(p: int) -> None:
        rng = random.Random(p)
        it = 0
        for v in range(p * per, (p + 1) * per):
            while not ring.push(v):  # full: retry
                it += 1
                if not it & 255:
                    shm.check()
                if rng.random() < 0.5:
                    os.sched_yield()
            it += 1
            if not it & 1023:
                shm.check()
        shm.region.add32(PDONE, 1)

    def consumer(c: int) -> None:
        rec = Recorder(shm, recs[c], n)
        rng = random.Random(10 + c)
        last = [-1] * n_prod
        it = 0

        def take(v: int) -> None:
            p = v // per
            if not 0 <= p < n_prod or v <= last[p]:
                raise AssertionError(
                    f"consumer {c}: got {v} after {last[p] if 0 <= p < n_prod else '?'} "
                    f"from producer {p}: per-producer FIFO order broken"
                )
            last[p] = v
            rec.add(v)

        while True:
            it += 1
            if not it & 255:
                shm.check()
            finished = shm.region.load32(PDONE) == n_prod  # read before popping
            if rng.random() < 0.5:
                v = ring.pop()
                got = [] if v == EMPTY else [v]
            else:
                got = ring.pop_many(rng.randrange(1, 20))
            for v in got:
                take(v)
            if got:
                continue
            if finished:
                break
            os.sched_yield()
        rec.publish()

    jobs = [(f"consumer{c}", consumer, (c,)) for c in range(n_cons)]
    jobs += [(f"producer{p}", producer, (p,)) for p in range(n_prod)]
    _run(shm, jobs)

    taken = [shm.values(r) for r in recs]
    _exactly_once([v for t in taken for v in t], n, f"MPMCRing ({impl_name}, {n} values)")
    assert len(ring) == 0
    assert ring.pop() == EMPTY


# --------------------------------------------------------------------------- SPSCRing


@IMPL_PARAMS
@pytest.mark.parametrize("capacity", [64, 2])
def test_spsc_order_preserved(impl_name, capacity):
    """One producer, one consumer: every value arrives once, in order."""
    impl, n = _impl(impl_name)
    shm = Shm(impl, LINE + 8 * n + (1 << 16))
    ring = shm.structure("SPSCRing", capacity)
    rec_off = shm.recorder(n)
    EMPTY = impl.EMPTY

    def producer() -> None:
        rng = random.Random(7)
        it = 0
        for v in range(n):
            while not ring.push(v):
                it += 1
                if not it & 255:
                    shm.check()
                if rng.random() < 0.3:
                    os.sched_yield()
            it += 1
            if not it & 1023:
                shm.check()

    def consumer() -> None:
        rec = Recorder(shm, rec_off, n)
        rng = random.Random(8)
        expect = it = 0
        while expect < n:
            it += 1
            if not it & 255:
                shm.check()
            if rng.random() < 0.5:
                v = ring.pop()
                got = [] if v == EMPTY else [v]
            else:
                got = ring.pop_many(rng.randrange(1, 40))
            if not got:
                os.sched_yield()
                continue
            for v in got:
                if v != expect:
                    raise AssertionError(f"SPSC order broken: expected {expect}, got {v}")
                rec.add(v)
                expect += 1
        if ring.pop() != EMPTY:
            raise AssertionError("SPSC ring not empty after all values were consumed")
        rec.publish()

    _run(shm, [("consumer", consumer, ()), ("producer", producer, ())])

    taken = shm.values(rec_off)
    assert taken == list(range(n))
    assert len(ring) == 0
