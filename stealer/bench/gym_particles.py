"""The lockstep workload's environment as a gymnasium environment (benchmarks/gym_vector.py).

:class:`ParticlesEnv` wraps :class:`stealer.bench.lockstep.Env` (64 particles, a few KB of
numpy state, ``act`` doing ``iters`` iterations of real numpy work): observation the
8 float32 of ``act``, action a float32 target point, reward ``act``'s, truncated after
``horizon`` steps.  Imports gymnasium (``pip install 'stealer[gym]'``); ``stealer bench``
never imports this module.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from stealer.bench.lockstep import Env

__all__ = ["ParticlesEnv", "make_particles"]


class ParticlesEnv(gym.Env):
    """One lockstep environment (see the module doc); ``cpu_ns``: CPU time in ``act``."""

    def __init__(self, index: int, iters: int, horizon: int = 200) -> None:
        self.observation_space = spaces.Box(-np.inf, np.inf, (8,), np.float32)
        self.action_space = spaces.Box(-0.9, 0.9, (2,), np.float32)
        self.index = index
        self.iters = iters
        self.horizon = horizon
        self.sim = Env(index)
        self.t = 0
        self.cpu_ns = 0  # handler time of the environments built before the last reset

    def reset(self, *, seed: int | None = None, options: dict | None = None
              ) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        self.cpu_ns += self.sim.cpu_ns
        self.sim = Env(self.index, int(self.np_random.integers(1 << 30)))
        self.t = 0
        return self.sim.obs.copy(), {}

    def step(self, action: np.ndarray) -> tuple[np.ndarray, float, bool, bool, dict]:
        obs, reward = self.sim.act(action, self.iters)
        self.t += 1
        return obs, reward, False, self.t >= self.horizon, {}

    @property
    def handler_ns(self) -> int:
        """CPU time spent in steps so far."""
        return self.cpu_ns + self.sim.cpu_ns


def make_particles(index: int, iters: int) -> Any:
    """An ``env_fn`` for the vector environments."""
    return lambda: ParticlesEnv(index, iters)
