"""How fast a task whose worker dies is reported, and how fast the pool recovers.

For each way of dying (os._exit, SIGKILL, SIGSEGV): submit the fatal task,
time until its future raises WorkerCrashedError, then time until a fresh
task submitted afterwards returns (a replacement worker has started).

    python benchmarks/crash_latency.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import statistics
import time

import stealer


def _exit() -> None:
    os._exit(3)


def _kill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _segv() -> None:
    ctypes.string_at(0)


def _ok(x: int) -> int:
    return x


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args()
    with stealer.Executor(2) as ex:
        ex.wait_ready(60)
        for name, fn in (("os._exit", _exit), ("SIGKILL", _kill), ("SIGSEGV", _segv)):
            fail, back = [], []
            for i in range(a.rounds):
                t = time.perf_counter()
                try:
                    ex.submit(fn).result(timeout=60)
                except stealer.WorkerCrashedError:
                    fail.append(time.perf_counter() - t)
                t = time.perf_counter()
                assert ex.submit(_ok, i).result(timeout=60) == i
                back.append(time.perf_counter() - t)
            print(f"{name:9s} failed after median {statistics.median(fail) * 1e3:6.1f} ms "
                  f"(max {max(fail) * 1e3:6.1f}); next task done after median "
                  f"{statistics.median(back) * 1e3:6.1f} ms")


if __name__ == "__main__":
    main()
