"""The executor on the pure-Python reference queues (STEALER_NO_EXTENSIONS=1, or no extension)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

HERE = os.path.dirname(__file__)

SCRIPT = textwrap.dedent(
    """
    import sys, warnings
    sys.path.insert(0, {here!r})
    {prelude}
    import stealer, tasks
    from stealer.shared.queues import impl
    print("impl", impl.__name__)
    if __name__ == "__main__":
        with stealer.Executor(2) as ex:
            assert [f.result(timeout=60) for f in [ex.submit(tasks.square, i) for i in range(300)]] \\
                == [i * i for i in range(300)]
            assert list(ex.map(tasks.square, range(50), chunksize=7)) == [i * i for i in range(50)]
            assert ex.submit(tasks.fib, 18, 8).result(timeout=60) == tasks.fib_seq(18)
            try:
                ex.submit(tasks.exit_now, 3).result(timeout=60)
                raise SystemExit("crash not reported")
            except stealer.WorkerCrashedError as exc:
                assert "code 3" in str(exc), exc
            assert ex.submit(tasks.square, 9).result(timeout=60) == 81
        print("ok")
    """
)

BLOCK_EXTENSION = textwrap.dedent(
    """
    import importlib.abc
    class _Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name == "stealer._cqueues":
                raise ImportError("simulated: extension not built")
            return None
    sys.meta_path.insert(0, _Block())
    """
)


def run(prelude: str = "", env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, **(env_extra or {}))
    code = SCRIPT.format(here=HERE, prelude=prelude)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env=env)


def test_env_var_forces_pure_python_queues():
    p = run(env_extra={"STEALER_NO_EXTENSIONS": "1"})
    assert p.returncode == 0, p.stderr
    assert "impl stealer.shared.pyqueues" in p.stdout
    assert p.stdout.strip().endswith("ok")
    assert "RuntimeWarning" not in p.stderr  # asked for explicitly: no warning


def test_missing_extension_falls_back_with_one_warning():
    prelude = "import warnings\nwarnings.simplefilter('always')\n" + BLOCK_EXTENSION
    p = run(prelude=prelude, env_extra={"STEALER_NO_EXTENSIONS": ""})
    assert p.returncode == 0, p.stderr
    assert "impl stealer.shared.pyqueues" in p.stdout
    assert p.stderr.count("exists but does not load") == 1, p.stderr


def test_executor_suites_on_the_reference_queues():
    """The executor, lifecycle, fork-join and agents suites again, on the pure-Python queues (less
    the tests that SIGKILL workers from outside: one lock guards every operation there, so
    a worker killed holding it stops the executor, with a clear error, by design)."""
    env = dict(os.environ, STEALER_NO_EXTENSIONS="1")
    suites = [os.path.join(HERE, f) for f in
              ("test_executor.py", "test_lifecycle.py", "test_forkjoin.py", "test_agents.py",
               "test_agents_faults.py")]
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:randomly", "-m", "not kills_workers",
         "-W", "ignore::RuntimeWarning", *suites],
        env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and " failed" not in r.stdout
