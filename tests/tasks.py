"""Task functions for the executor tests (importable by spawned workers)."""

from __future__ import annotations

import ctypes
import os
import signal
import threading
import time

import stealer

STATE: dict[str, object] = {}


def square(x):
    return x * x


def add(a, b=0, *, c=0):
    return a + b + c


def identity(x):
    return x


def pid(_=None):
    return os.getpid()


def sleep_then(seconds, value=None):
    time.sleep(seconds)
    return value


def busy(seconds):
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass
    return seconds


def raise_value_error(msg):
    raise ValueError(msg)


def exit_now(code):
    os._exit(code)


def kill_self(sig):
    os.kill(os.getpid(), sig)
    time.sleep(5)


def segfault():
    ctypes.string_at(0)


def return_lock():
    return threading.Lock()


def set_state(key, value):
    STATE[key] = value


def get_state(key):
    return STATE.get(key)


def failing_init():
    raise RuntimeError("init exploded")


class Unpicklable:
    def __reduce__(self):
        raise TypeError("this object refuses to be pickled")


def return_unpicklable():
    return Unpicklable()


class BadException(Exception):
    def __init__(self, a, b):  # cannot be rebuilt from args alone
        super().__init__(a)
        self.lock = threading.Lock()


def raise_bad_exception():
    raise BadException("x", "y")


def fib_seq(n):
    return n if n < 2 else fib_seq(n - 1) + fib_seq(n - 2)


def fib(n, cutoff):
    if n <= cutoff:
        return fib_seq(n)
    a = stealer.spawn(fib, n - 1, cutoff)
    b = stealer.spawn(fib, n - 2, cutoff)
    x, y = yield [a, b]
    return x + y


def fib_blocking(n, cutoff):
    """fib with blocking joins (stealer.join in a plain function, not a generator)."""
    if n <= cutoff:
        return fib_seq(n)
    a = stealer.spawn(fib_blocking, n - 1, cutoff)
    b = stealer.spawn(fib_blocking, n - 2, cutoff)
    return sum(stealer.join([a, b]))


def chain(depth):
    """A spawn chain ``depth`` deep: each task spawns one child and joins it."""
    if depth == 0:
        return 0
    c = stealer.spawn(chain, depth - 1)
    v = yield c
    return v + 1


def wide(n):
    kids = [stealer.spawn(square, i) for i in range(n)]
    results = yield kids
    return sum(results)


def child_fails():
    c = stealer.spawn(raise_value_error, "child broke")
    try:
        yield c
    except ValueError as exc:
        return f"caught: {exc}"
    return "not raised"


def child_fails_uncaught():
    c = stealer.spawn(raise_value_error, "child broke")
    yield c
    return "unreachable"


def unjoined_children(n):
    for i in range(n):
        stealer.spawn(square, i)
    return "parent done"


def plain_spawner(n):
    """A non-generator task that spawns: it completes after its children (implicit join)."""
    for _ in range(n):
        stealer.spawn(busy, 0.001)
    return n


def yields_garbage():
    yield 42


def join_twice():
    c = stealer.spawn(square, 5)
    a = yield c
    b = yield c
    return a + b


def spawn_outside():
    return stealer.spawn(square, 1)


def tree_sum(depth, fanout):
    if depth == 0:
        return 1
    kids = [stealer.spawn(tree_sum, depth - 1, fanout) for _ in range(fanout)]
    vals = yield kids
    return 1 + sum(vals)


def slow_tree(depth, fanout, leaf_s):
    """tree_sum whose leaves each busy-wait ``leaf_s``: frames wait on their children long
    enough for peers to steal some of them."""
    if depth == 0:
        busy(leaf_s)
        return 1
    kids = [stealer.spawn(slow_tree, depth - 1, fanout, leaf_s) for _ in range(fanout)]
    vals = yield kids
    return 1 + sum(vals)


def killer_tree(depth, victim_marker):
    """Fork-join tree whose leaf number 0 kills its own worker (SIGKILL) once."""
    if depth == 0:
        if not os.path.exists(victim_marker):
            open(victim_marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        busy(0.002)
        return 1
    kids = [stealer.spawn(killer_tree, depth - 1, victim_marker) for _ in range(2)]
    vals = yield kids
    return sum(vals)


def numpy_double(a):
    return a * 2


def nbytes_of(b):
    return len(b)


def make_bytes(n):
    return bytes(range(256)) * (n // 256)


def getenv(name):
    return os.environ.get(name)


def my_steal_order():
    """(worker index, deque offsets of its victims in the order it tries them)."""
    from stealer import forkjoin

    w = forkjoin._current
    return w.k, [d.offset for d in w.victims]


class ExitOnPickle:
    """A result whose pickling raises SystemExit (not an Exception)."""

    def __reduce__(self):
        raise SystemExit(3)


def return_exit_on_pickle():
    return ExitOnPickle()


def raise_keyboard_interrupt():
    raise KeyboardInterrupt


def sleep_in_body(seconds, marker=None):
    """Sleeps in small steps (a signal handler runs between them); creates ``marker`` first."""
    if marker:
        open(marker, "w").close()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(0.005)
    return seconds


def spawn_and_wait(n, seconds):
    """A fork-join parent whose children take a while (its frame stays suspended)."""
    kids = [stealer.spawn(sleep_then, seconds, i) for i in range(n)]
    vals = yield kids
    return sum(vals)


def pid_after(seconds):
    time.sleep(seconds)
    return os.getpid()


def uneven_kids(short, long):
    """Two children: the short one (spawned first, so a thief takes it) and the long one
    (the spawner's own next task); returns the pids that ran them."""
    kids = [stealer.spawn(pid_after, short), stealer.spawn(pid_after, long)]
    vals = yield kids
    return vals


def crash_tree(depth, kill=True):
    """A fork-join tree whose left-most leaf kills its own worker (every time it runs)."""
    if depth == 0:
        if kill:
            os.kill(os.getpid(), signal.SIGKILL)
        return 1
    kids = [stealer.spawn(crash_tree, depth - 1, kill and i == 0) for i in range(2)]
    vals = yield kids
    return sum(vals)


def tagged(i, blob=None, spin=0.0):
    """``(i, i*i)`` (and ``blob`` back): a result that names its argument, so a result
    delivered to the wrong future is caught.  ``spin`` busy-waits that many seconds first."""
    if spin:
        busy(spin)
    return (i, i * i) if blob is None else (i, i * i, blob)


def poison(run_dir):
    """Leave one file per run in ``run_dir``, then SIGKILL the worker: it dies every time."""
    name = os.path.join(run_dir, f"run-{os.getpid()}-{time.monotonic_ns()}")
    with open(name, "x"):
        pass
    os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(10)


def spawn_big(nbytes):
    """Spawn one child whose argument is ``nbytes`` long (its record's payload goes to an
    overflow file, which takes a while to write) and join it."""
    c = stealer.spawn(nbytes_of, b"x" * nbytes)
    n = yield c
    return n


def client_modules_loaded(_=None):
    """Which client-side modules this (worker) process has imported."""
    import sys

    return sorted(m for m in ("stealer.client.executor", "stealer.client.pool", "stealer.client.stats", "numpy",
                              "sqlite3") if m in sys.modules)


def wait_for_path(path, timeout=60.0):
    """Busy (sleeping in short steps) until ``path`` exists: a task that ends when told."""
    import os

    end = time.monotonic() + timeout
    while not os.path.exists(path) and time.monotonic() < end:
        time.sleep(0.005)
    return os.path.exists(path)


class UnhashableCallable:
    """A picklable callable that cannot be a dict key (the function table's)."""

    __hash__ = None  # type: ignore[assignment]

    def __eq__(self, other):
        return isinstance(other, UnhashableCallable)

    def __call__(self, x):
        return x + 1


def kwargs_of(*args, **kwargs):
    return args, kwargs


async def async_square(x: int) -> int:
    return x * x
