"""Tasks of tests/test_hang.py, in a module of their own: a worker imports it at its
first task, and importing the test module (pytest, stealer.top...) in a worker would be a
task longer than the hang_timeout under test."""

from __future__ import annotations

import os
import time


def first_run_stalls(dirname, value, first_secs=60.0):
    """Leave a file named after this process; the first run (no file yet) then sleeps
    ``first_secs`` (the test stops it meanwhile), a later run returns at once."""
    first = not os.listdir(dirname)
    pid = os.getpid()
    tmp = os.path.join(dirname, f".{pid}.{time.monotonic_ns()}")
    with open(tmp, "w"):
        pass
    os.replace(tmp, os.path.join(dirname, f"run.{pid}.{time.monotonic_ns()}"))
    if first:
        time.sleep(first_secs)
    return value, pid


def sleep_pid(secs):
    time.sleep(secs)
    return os.getpid()


def parent_of_stalling_child(dirname):
    """A fork-join task whose child is first_run_stalls (joined by yield)."""
    from stealer import spawn

    value = yield spawn(first_run_stalls, dirname, "child")
    return value
