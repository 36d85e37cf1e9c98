"""Replacement workers come from a forkserver that has stealer imported (stealer/client/pool.py).

A worker that dies is replaced from the result thread.  A spawned interpreter would import
stealer again (most of a kill's recovery time on a loaded machine), so with 'spawn' (and
'fork') the replacement is forked from a forkserver that preloaded the worker's modules.
Its children inherit the *server's* environment, started once: the client's own travels
with the worker's arguments, as a spawned process would have inherited it.
"""

from __future__ import annotations

import os
import signal
import time
import uuid

import psutil
import pytest
import tasks

import stealer
from stealer.client import pool as pool_mod

pytestmark = pytest.mark.kills_workers


def _replaced(ex: stealer.Executor, old: int, seen: set[int], timeout: float = 30.0) -> int:
    """Kill worker pid ``old``; its replacement's pid (not in ``seen``) once it runs tasks."""
    os.kill(old, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = ex.worker_pids()
        if old not in pids and all(pids) and ex.wait_ready(0.05):
            return next(p for p in pids if p not in seen)
        time.sleep(0.01)
    raise AssertionError("no replacement started")


def test_a_replacement_is_forked_by_a_forkserver_with_the_clients_environment(monkeypatch):
    pytest.importorskip("stealer._cqueues")  # (the reference queues' lock cannot travel)
    with stealer.Executor(1, retries=5) as ex:
        assert ex.wait_ready(30)
        (first,) = ex.worker_pids()
        assert psutil.Process(first).ppid() == os.getpid()  # started workers: spawned here
        seen = {first}
        second = _replaced(ex, first, seen)
        server = psutil.Process(second).ppid()
        assert server != os.getpid(), "the replacement was not forked by a forkserver"
        # set after the server started: only the arguments can carry it to the next one
        mark = uuid.uuid4().hex
        monkeypatch.setenv("STEALER_TEST_REPLACEMENT_MARK", mark)
        seen.add(second)
        third = _replaced(ex, second, seen)
        assert psutil.Process(third).ppid() == server  # the same server, started once
        assert ex.submit(tasks.getenv, "STEALER_TEST_REPLACEMENT_MARK").result(30) == mark
        monkeypatch.delenv("STEALER_TEST_REPLACEMENT_MARK")
        assert ex.submit(tasks.square, 7).result(30) == 49


def test_the_forkserver_preloads_the_workers_modules_and_keeps_the_users(monkeypatch):
    from multiprocessing import forkserver

    fs = forkserver._forkserver
    monkeypatch.setattr(fs, "_forkserver_pid", None)  # as before the server's start
    monkeypatch.setattr(fs, "_preload_modules", ["__main__", "json"])  # a user's own list
    pool_mod._forkserver()
    assert fs._preload_modules == ["__main__", "json", *pool_mod.FORKSERVER_PRELOAD]
    pool_mod._forkserver()  # once only
    assert fs._preload_modules.count("stealer.worker.loop") == 1
    monkeypatch.setattr(fs, "_forkserver_pid", 12345)  # running: its list is fixed
    monkeypatch.setattr(fs, "_preload_modules", ["__main__"])
    pool_mod._forkserver()
    assert fs._preload_modules == ["__main__"]
