"""Workers notice their client's death, and only that, under every start method.

An idle worker checks its client each time its park times out (worker.PARK_TIMEOUT).
With forkserver a worker's parent is the fork server, not the client, so a parent
check would tear down a healthy executor; stealer.shared.liveness watches the client itself.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
import time

import pytest
import tasks
from probes import alive, client_process

import stealer
from stealer.shared import liveness
from stealer.worker.loop import PARK_TIMEOUT

METHODS = ["spawn", "forkserver", "fork"]


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_idle_workers_keep_serving(method):
    """Idle for several park timeouts: same workers, same segment, still serving."""
    with stealer.Executor(2, mp_context=mp.get_context(method)) as e:
        assert e.submit(tasks.square, 3).result(timeout=30) == 9
        assert e.wait_ready(30)
        pids = e.worker_pids()
        time.sleep(3 * PARK_TIMEOUT)
        assert os.path.exists(f"/dev/shm/{e.segment_name}")
        assert e.submit(tasks.square, 4).result(timeout=30) == 16
        assert list(e.map(tasks.square, range(20))) == [i * i for i in range(20)]
        assert e.worker_pids() == pids  # nobody exited and was replaced
        assert e._pool.crashes == 0


@pytest.mark.parametrize("method", METHODS)
def test_killed_client_leaves_nothing_behind(tmp_path, method):
    """kill -9 the client: its workers notice, remove the segment and exit."""
    with client_process(tmp_path, method, run_task=True) as client:
        name, pids = client.segment, client.pids
        assert len(pids) == 2
        time.sleep(2 * PARK_TIMEOUT)  # idle workers went through park timeouts: still there
        assert os.path.exists(f"/dev/shm/{name}")
        assert all(alive(x) for x in pids)
        client.kill(timeout=20)
        assert not os.path.exists(f"/dev/shm/{name}")
        assert not any(alive(x) for x in pids)


# -- stealer.shared.liveness ------------------------------------------------------------


@pytest.fixture(params=["pidfd", "proc"])
def mode(request, monkeypatch):
    """Both ways of watching: a pidfd, and the fallback without pidfd_open."""
    if request.param == "pidfd":
        if not hasattr(os, "pidfd_open"):
            pytest.skip("no os.pidfd_open")
        try:
            os.close(os.pidfd_open(os.getpid()))
        except OSError:
            pytest.skip("pidfd_open not supported here")
    else:

        def no_pidfd(pid, flags=0):
            raise OSError(38, "Function not implemented")

        monkeypatch.setattr(os, "pidfd_open", no_pidfd)
    return request.param


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_watch_sees_a_process_exit(mode):
    p = _sleeper()
    try:
        w = liveness.ProcessWatch(p.pid, liveness.start_time(p.pid))
        assert (w.fd is not None) == (mode == "pidfd")
        assert not w.gone()
        p.kill()
        # Not reaped yet: a zombie is gone too (pidfd readable; /proc state Z).
        deadline = time.monotonic() + 10
        while not w.gone():
            assert time.monotonic() < deadline, "the watch never saw the exit"
            time.sleep(0.01)
        assert w.gone()  # stays gone
        w.close()
    finally:
        p.kill()
        p.wait()


def test_watch_of_a_reaped_pid_is_gone(mode):
    p = _sleeper()
    start = liveness.start_time(p.pid)
    p.kill()
    p.wait()
    w = liveness.ProcessWatch(p.pid, start)
    assert w.gone()
    w.close()


def test_watch_rejects_a_reused_pid(mode):
    """A live process at the pid with another start time is not the one we were given."""
    me = os.getpid()
    start = liveness.start_time(me)
    assert start is not None
    w = liveness.ProcessWatch(me, start + 1)
    assert w.gone()
    w.close()
    w = liveness.ProcessWatch(me, start)
    assert not w.gone()
    w.close()


def test_start_time_handles_odd_process_names(tmp_path):
    """comm may contain spaces and parentheses; the start time is still read right."""
    exe = tmp_path / "a b) (c"
    exe.symlink_to(sys.executable)
    p = subprocess.Popen([str(exe), "-c", "import time; time.sleep(60)"])
    try:
        ours = liveness.start_time(p.pid)
        with open(f"/proc/{p.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        assert ours == int(fields[19])
        w = liveness.ProcessWatch(p.pid, ours)
        assert not w.gone()
        w.close()
    finally:
        p.kill()
        p.wait()
