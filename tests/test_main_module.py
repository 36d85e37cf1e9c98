"""What ``__main__`` defines, sent to workers: by value where workers cannot import it.

A worker imports the user's script as ``__mp_main__`` (spawn), so a class or function at
the script's top level is found there by name.  Two cases are not:

* ``python -c``, a REPL, a notebook: ``__main__`` has no file.  stdlib pickle writes its
  classes by name all the same and the worker fails to find them; stealer pickles them
  with cloudpickle (by value) instead (serialize.main_by_value).
* a class defined under the script's ``if __name__ == '__main__':``: the worker's import
  of the script never runs that block.  The agent (or task) fails with a message saying
  so, and the worker lives on (its class failing to load once killed the worker, four
  times, and said "a task called os._exit()").

Each case runs in a fresh interpreter (its own ``__main__``).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

BODY = textwrap.dedent("""
    import dataclasses, os
    import stealer

    @dataclasses.dataclass
    class P:
        x: int

    def double(p):
        return P(p.x * 2)

    class Keeper(stealer.Agent):
        def __init__(self, start):
            self.seen = [start]

        def get(self, p):
            self.seen.append(p)
            return P(p.x + len(self.seen))

    if __name__ == "__main__":
        with stealer.Executor(2) as ex:
            pids = ex.worker_pids()
            r = ex.submit(double, P(3)).result(60)
            assert r == P(6) and type(r) is P, r
            assert list(ex.map(double, [P(i) for i in range(5)], chunksize=2)) == [
                P(2 * i) for i in range(5)]
            a = ex.spawn_agent(Keeper, P(0))
            r = a.call("get", P(1)).result(60)
            assert r == P(3) and type(r) is P, r
            refs = [ex.spawn_agent(Keeper, P(i)) for i in range(4)]
            got = [f.result(60) for f in ex.call_all(refs, "get", [(P(i),) for i in range(4)])]
            assert got == [P(i + 2) for i in range(4)], got
            EXTRA
            assert ex.worker_pids() == pids, "a worker died"
            print("ok")
""")


def run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=180)


def test_what_a_main_without_a_file_defines_goes_by_value(tmp_path):
    """``python -c``: a dataclass argument, result, agent class and spawn argument from
    ``__main__`` reach the workers and come back as the caller's own class."""
    p = run(["-c", BODY.replace("EXTRA", "pass")], tmp_path)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-3000:]


def test_a_script_s_top_level_classes_still_go_by_name(tmp_path):
    """A script with a file: its top-level classes are found by name (the workers import
    it), and the same checks pass."""
    script = tmp_path / "user_script.py"
    script.write_text(BODY.replace("EXTRA", "pass"))
    p = run([str(script)], tmp_path)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-3000:]


def test_an_agent_class_under_the_main_guard_fails_the_agent_not_the_worker(tmp_path):
    """A class defined under ``if __name__ == '__main__':`` of a script cannot be loaded by
    a worker: its agent fails, the call says why and what to do, and the workers live on
    (the same pids; a task runs after)."""
    extra = textwrap.dedent("""
            class Local(stealer.Agent):
                def get(self):
                    return 1
            bad = ex.spawn_agent(Local)
            try:
                bad.call("get").result(60)
            except stealer.AgentStopped as exc:
                assert "top level" in str(exc) and "Local" in str(exc), str(exc)
            else:
                raise AssertionError("the call to an agent whose class cannot load returned")
            assert ex.submit(double, P(5)).result(60) == P(10)
    """)
    body = BODY.replace("EXTRA", textwrap.indent(extra, " " * 8).strip())
    script = tmp_path / "guarded.py"
    script.write_text(body)
    p = run([str(script)], tmp_path)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-3000:]
