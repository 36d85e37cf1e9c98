"""Helpers that look at executors from outside: records still in use, whether a pid lives,
and a client process to kill -9."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import stealer
from stealer.bench.teardown import force_close as _force_close
from stealer.shared.recovery import Recovery


def records_in_use(e: stealer.Executor, timeout: float = 10.0) -> int:
    """Records not FREE once the executor is idle (waits for stragglers to be freed)."""
    rec = Recovery(e._pool.arena, [], None, 0)
    deadline = time.monotonic() + timeout
    while True:
        n = sum(len(rec.held_by(w, (s,))) for w in range(e.max_workers + 1) for s in range(1, 6))
        if n == 0 or time.monotonic() > deadline:
            return n
        time.sleep(0.05)


def force_close(ex: stealer.Executor, wait: float = 30.0) -> bool:
    """Shut ``ex`` down without hanging on futures that can never resolve
    (:func:`stealer.bench.teardown.force_close`), waiting only 0.5 s if futures are
    pending.  Returns whether its result thread exited."""
    return _force_close(ex, 0.5 if ex._pool.futures else wait)


def alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie child of the dead client, reparented to init, counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@dataclass
class Client:
    """A client process running an executor of 2 workers, idle after starting it."""

    proc: subprocess.Popen
    segment: str  # the executor's segment name (in /dev/shm)
    pids: list[int]  # its workers

    def kill(self, timeout: float) -> None:
        """kill -9 the client, then wait up to ``timeout`` s for its segment and workers to go."""
        self.proc.kill()
        self.proc.wait(10)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and (
            os.path.exists(f"/dev/shm/{self.segment}") or any(alive(x) for x in self.pids)
        ):
            time.sleep(0.05)


@contextmanager
def client_process(tmp_path: Path, method: str | None = None,
                   run_task: bool = False) -> Iterator[Client]:
    """Start a client script (an Executor(2), with ``mp_context`` of ``method`` if given,
    first running one task if ``run_task``) and wait until its workers are ready.  The
    client is killed and reaped on the way out."""
    context = f", mp_context=mp.get_context({method!r})" if method else ""
    task = "    assert e.submit(tasks.square, 2).result(timeout=30) == 4\n" if run_task else ""
    script = tmp_path / "client.py"
    script.write_text(
        "import multiprocessing as mp, sys, time, stealer\n"
        f"sys.path.insert(0, {os.path.dirname(__file__)!r})\n"
        "import tasks\n"
        "if __name__ == '__main__':\n"
        f"    e = stealer.Executor(2{context})\n"
        f"{task}"
        "    e.wait_ready(30)\n"
        "    print(e.segment_name, *e.worker_pids(), flush=True)\n"
        "    time.sleep(60)\n"
    )
    p = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline().split()
        assert line, "the client script did not start its executor"
        yield Client(p, line[0], [int(x) for x in line[1:]])
    finally:
        p.kill()
        p.wait()
        p.stdout.close()
