"""A fork of the process that made an executor: the copy is not the child's to use.

The child's copy shares the parent's workers and shared memory but not its result thread.
Before the at-fork mark (stealer/client/pool.py, ``_forked_child``):

* a forked child that waited on, or cancelled, a future it inherited settled finished
  tasks itself (``_Pool.help``), taking completions from the parent, whose futures then
  waited forever; its calls and submits wrote to the parent's shared memory;
* a forked child that left (its ``with`` block's shutdown, or its exit handlers) told the
  parent's workers to stop their agents: the parent's agents were gone.

Now the child's every use raises BrokenExecutor saying why, its shutdown, cancel and stop
touch nothing shared, and the parent goes on.  Each case runs in a fresh interpreter
(its children fork from it, not from pytest's process).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="no fork here")

COMMON = textwrap.dedent("""
    import os, sys, time
    import multiprocessing as mp
    import stealer

    def spin(s, i):
        t = time.perf_counter()
        while time.perf_counter() - t < s:
            pass
        return i

    class Counter(stealer.Agent):
        def __init__(self):
            self.n = 0

        def add(self, k):
            self.n += k
            return self.n

    def attempt(name, fn, out):
        try:
            got = fn()
        except stealer.BrokenExecutor as e:
            ok = "is a fork of it" in str(e) and "Make an Executor in this process" in str(e)
            out.append(f"{name}:refused" if ok else f"{name}:other-message:{e}")
        except BaseException as e:
            out.append(f"{name}:{type(e).__name__}:{e}")
        else:
            out.append(f"{name}:ran:{got!r}")
""")

USE = COMMON + textwrap.dedent("""
    def child(ex, ref, fs, q):
        fut = fs[-1]
        done0 = {f._st_fid for f in fs if f.done()}
        out = []
        attempt("call", lambda: ref.call("add", 1).result(timeout=10), out)
        attempt("send", lambda: ref.send("add", 1), out)
        attempt("call_all", lambda: ex.call_all([ref], "add", [(1,)]), out)
        attempt("submit", lambda: ex.submit(spin, 0.001, 7).result(timeout=10), out)
        attempt("map", lambda: list(ex.map(spin, [0.001], [1])), out)
        attempt("spawn_agent", lambda: ex.spawn_agent(Counter), out)
        attempt("result", lambda: fut.result(timeout=10), out)
        attempt("stop", ref.stop, out)
        out.append(f"cancel:{ {f.cancel() for f in fs} }")
        out.append(f"settled-here:{len({f._st_fid for f in fs if f.done()} - done0)}")
        ex.shutdown(wait=False)  # touches nothing of the parent's
        q.put(out)

    if __name__ == "__main__":
        ex = stealer.Executor(2)
        ref = ex.spawn_agent(Counter)
        assert ref.call("add", 0).result(timeout=30) == 0
        fs = [ex.submit(spin, 0.004, i) for i in range(300)]
        ctx = mp.get_context("fork")
        q = ctx.Queue()
        p = ctx.Process(target=child, args=(ex, ref, fs, q))
        p.start()
        print("child", q.get(timeout=60))
        p.join(30)
        try:
            print("parent", [f.result(timeout=20) for f in fs] == list(range(300)))
        except TimeoutError:
            print("parent", "lost", sum(not f.done() for f in fs))
        print("agent", ref.call("add", 5).result(timeout=30))
        ex.shutdown()
""")

LEAVE = COMMON + textwrap.dedent("""
    if __name__ == "__main__":
        with stealer.Executor(2) as ex:
            ref = ex.spawn_agent(Counter)
            assert ref.call("add", 1).result(timeout=30) == 1
            pid = os.fork()
            if pid == 0:  # the child leaves the with block, then exits normally (atexit)
                os.dup2(os.open(os.devnull, os.O_WRONLY), 2)  # (multiprocessing's own
                # exit handler complains here that it cannot join its parent's children)
                sys.exit(0)
            os.waitpid(pid, 0)
            time.sleep(0.3)
            print("agent", ref.call("add", 1).result(timeout=30))
            print("tasks", [f.result(timeout=30) for f in [ex.submit(spin, 0.001, i)
                                                            for i in range(20)]] == list(range(20)))
""")


def _run(tmp_path: Path, body: str) -> str:
    script = tmp_path / "script.py"
    script.write_text(body)
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                       timeout=150, cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout


def test_a_forked_child_is_refused_and_the_parent_loses_nothing(tmp_path):
    out = _run(tmp_path, USE)
    lines = dict(line.split(" ", 1) for line in out.strip().splitlines())
    child = eval(lines["child"])  # (the list the child put on the queue)
    assert child == [f"{n}:refused" for n in ("call", "send", "call_all", "submit", "map",
                                              "spawn_agent", "result", "stop")] + [
        "cancel:{False}", "settled-here:0"], child
    assert lines["parent"] == "True"  # every one of its 300 results, none taken by the child
    assert lines["agent"] == "5"  # the child's calls, refused, changed nothing


def test_a_forked_child_leaving_does_not_stop_the_parents_agents(tmp_path):
    out = _run(tmp_path, LEAVE)
    assert out.split() == ["agent", "2", "tasks", "True"], out


def test_a_forked_copy_never_settles_the_parents_completions(monkeypatch):
    # A future's first condition (cancel, running, wait...) settles finished tasks first
    # (_Pool.help); in a forked child that took the parent's completions whenever the
    # consume lock was free at the fork (about one run in five of the script above, whose
    # parent then waited forever).  The copy's help() must not look at the rings at all.
    import stealer

    with stealer.Executor(1) as ex:
        pool = ex._pool
        looked: list[int] = []
        monkeypatch.setattr(pool, "help_complete", lambda *a: looked.append(1) or 0)
        pool.help()
        assert looked == [1]  # (the parent's own help does look)
        monkeypatch.setattr(pool, "forked", True)
        pool.help()
        assert looked == [1], "a fork's copy settled completions of its parent"
        monkeypatch.setattr(pool, "forked", False)
        assert ex.submit(abs, -3).result(timeout=60) == 3
