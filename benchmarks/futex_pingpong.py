"""What one futex wake and sleep costs on this machine: the price of every completion that
wakes a parked result thread (and of every submit that wakes a parked worker).

Two threads hand a token back and forth through two futex words of a stealer Region (the
same calls the executor makes); prints the round trip and each thread's CPU per round.
On the 2-core development VM: about 50 µs per round trip, 20 µs of CPU per side.

    python benchmarks/futex_pingpong.py [--rounds 3000]
"""

from __future__ import annotations

import argparse
import mmap
import threading
import time

from stealer.shared import queues as _queues

Q = _queues.impl


def pingpong(rounds: int) -> tuple[float, float, float]:
    """(round trip µs, CPU µs per round of the waiter thread, of the main thread)."""
    mm = mmap.mmap(-1, 4096)
    r = Q.Region(mm)
    cpu: dict[str, float] = {}

    def other() -> None:
        t = time.thread_time_ns()
        for _ in range(rounds):
            while r.load32(0) != 1:
                r.futex_wait(0, 0, 1.0)
            r.store32(0, 0)
            r.store32(64, 1)
            r.futex_wake(64, 1)
        cpu["other"] = (time.thread_time_ns() - t) / rounds / 1e3

    th = threading.Thread(target=other)
    th.start()
    t = time.thread_time_ns()
    t0 = time.perf_counter()
    for _ in range(rounds):
        r.store32(0, 1)
        r.futex_wake(0, 1)
        while r.load32(64) != 1:
            r.futex_wait(64, 0, 1.0)
        r.store32(64, 0)
    wall = (time.perf_counter() - t0) / rounds * 1e6
    cpu["main"] = (time.thread_time_ns() - t) / rounds / 1e3
    th.join()
    return wall, cpu["other"], cpu["main"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3000)
    args = ap.parse_args()
    wall, a, b = pingpong(args.rounds)
    print(f"futex ping-pong ({Q.__name__}): {wall:.1f} µs per round trip; "
          f"CPU per round: {a:.1f} µs in one thread, {b:.1f} µs in the other")


if __name__ == "__main__":
    main()
