"""gymnasium vector environments side by side: SyncVectorEnv, AsyncVectorEnv and stealer's
AgentVectorEnv, stepping the same environments with the same policy, in one run.

A user's RL loop (``obs = envs.step(policy(obs))``) with gymnasium's own vector classes as
the peers, not a client written here: the lockstep yardstick (issue 19) driven the way
reinforcement-learning code drives it.  Configurations:

- ``particles 32x0.5ms`` and ``particles 256x0.05ms``: the lockstep environment
  (:mod:`stealer.bench.gym_particles`, numpy work calibrated to the handler time), 200-step
  episodes (next_step autoreset);
- ``CartPole-v1 x32``: gymnasium's own environment, a few µs a step (overhead only).

All systems are built first, then take turns in ``--blocks`` blocks of steps (A B C, C B A...)
so that a change of the shared machine's load weighs on all alike.  Per system: env-steps/s,
the share of the W cores' time spent in the environments' steps (their CPU time measured in
that run; the sync system's share is of one core's work spread over W), step p50/p99, and
the ratio to AsyncVectorEnv.  Every system's observations must equal SyncVectorEnv's at the
end of the run (same seeds, same actions: the script exits 1 otherwise).

    PYTHONPATH=$PWD python benchmarks/gym_vector.py [--workers 2] [--steps 400] [--blocks 4]
        [--only particles-32|particles-256|cartpole] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.vector import AsyncVectorEnv, SyncVectorEnv

from stealer.bench.gym_particles import make_particles
from stealer.bench.lockstep import calibrate
from stealer.gym import AgentVectorEnv


def policy(obs: np.ndarray, t: int) -> np.ndarray:
    """A cheap batched policy (numpy on the whole observation array)."""
    if obs.ndim == 2 and obs.shape[1] == 8:  # particles: aim near the drifting point
        phase = 0.05 * t
        drift = np.array([np.cos(phase), np.sin(phase)])
        act = np.clip(0.6 * drift - 0.3 * obs[:, 0:2] - 0.1 * obs[:, 2:4], -0.9, 0.9)
        return act.astype(np.float32)
    return (obs[:, 2] + 0.5 * obs[:, 3] > 0).astype(np.int64)  # CartPole: lean-follow


def configs(only: str | None) -> list[tuple[str, list, int]]:
    """(name, env_fns, iters or 0)."""
    out = []
    for n, ms in ((32, 0.5), (256, 0.05)):
        name = f"particles-{n}"
        if only in (None, name):
            iters = calibrate(ms * 1e-3).iters
            out.append((f"particles {n}x{ms:g}ms", [make_particles(i, iters) for i in range(n)],
                        iters))
    if only in (None, "cartpole"):
        out.append(("CartPole-v1 x32", [lambda: gym.make("CartPole-v1")] * 32, 0))
    return out


def handler_s(vec: Any, timed: bool) -> float:
    """The environments' step CPU so far (particles only: ``timed``; asking another
    environment would fail, and an error shuts AsyncVectorEnv's workers down)."""
    return sum(vec.get_attr("handler_ns")) / 1e9 if timed else 0.0


def run_config(name: str, fns: list, workers: int, steps: int, blocks: int,
               timed: bool) -> dict:
    systems: dict[str, Any] = {
        "SyncVectorEnv (one process)": SyncVectorEnv(fns),
        "AsyncVectorEnv (a process per env)": AsyncVectorEnv(fns),
        "stealer AgentVectorEnv": AgentVectorEnv(fns, workers=workers),
    }
    obs: dict[str, np.ndarray] = {}
    t_of: dict[str, int] = {}
    times: dict[str, list[float]] = {k: [] for k in systems}
    h0: dict[str, float] = {}
    try:
        for k, v in systems.items():
            obs[k], _ = v.reset(seed=0)
            t_of[k] = 0
            for _ in range(10):  # warm-up
                obs[k] = v.step(policy(obs[k], t_of[k]))[0]
                t_of[k] += 1
            h0[k] = handler_s(v, timed)
        per = steps // blocks
        names = list(systems)
        for b in range(blocks):
            for k in (names if b % 2 == 0 else names[::-1]):
                v = systems[k]
                for _ in range(per):
                    t0 = time.perf_counter()
                    obs[k] = v.step(policy(obs[k], t_of[k]))[0]
                    times[k].append(time.perf_counter() - t0)
                    t_of[k] += 1
        ref = obs[names[0]]
        for k in names[1:]:
            if not np.array_equal(obs[k], ref):
                print(f"{name}: {k}'s observations differ from SyncVectorEnv's", file=sys.stderr)
                sys.exit(1)
        out: dict[str, Any] = {}
        n = len(fns)
        for k, v in systems.items():
            wall = sum(times[k])
            h = handler_s(v, timed) - h0[k]
            out[k] = {"env_steps_per_s": n * len(times[k]) / wall,
                      "share_in_steps": h / (workers * wall) if h else None,
                      "step_p50_ms": statistics.median(times[k]) * 1e3,
                      "step_p99_ms": sorted(times[k])[int(0.99 * (len(times[k]) - 1))] * 1e3}
        base = out["AsyncVectorEnv (a process per env)"]["env_steps_per_s"]
        for k in out:
            out[k]["vs_async"] = out[k]["env_steps_per_s"] / base
        return out
    finally:
        for v in systems.values():
            v.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--only", choices=["particles-32", "particles-256", "cartpole"])
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    res = {}
    for name, fns, iters in configs(a.only):
        res[name] = r = run_config(name, fns, a.workers, a.steps, a.blocks, iters > 0)
        if a.json:
            continue
        print(f"\n{name}: {len(fns)} envs, {a.workers} workers, {a.steps} steps "
              f"in {a.blocks} alternated blocks")
        print(f"{'':38}{'env-steps/s':>12}{'in steps':>10}{'p50 ms':>9}{'p99 ms':>9}"
              f"{'vs Async':>10}")
        for k, v in r.items():
            share = "—" if v["share_in_steps"] is None else f"{v['share_in_steps']:.2f}"
            print(f"{k:38}{v['env_steps_per_s']:>12,.0f}{share:>10}{v['step_p50_ms']:>9.2f}"
                  f"{v['step_p99_ms']:>9.2f}{v['vs_async']:>9.2f}x")
    if a.json:
        json.dump(res, sys.stdout, indent=1)
        print()


if __name__ == "__main__":
    main()
