"""gymnasium environments for tests/test_gym.py (importable by the workers)."""

from __future__ import annotations

import time
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces


class DictEnv(gym.Env):
    """A Dict observation, a Box action, episodes of random length that end by
    termination or truncation, infos whose keys come and go (gymnasium merges them with
    masks): what the vector environments must batch and merge exactly alike."""

    metadata = {"render_modes": ["rgb_array"]}

    def __init__(self, render_mode: str | None = None) -> None:
        self.observation_space = spaces.Dict({
            "pos": spaces.Box(-10.0, 10.0, (3,), np.float64),
            "t": spaces.Discrete(64),
        })
        self.action_space = spaces.Box(-1.0, 1.0, (3,), np.float64)
        self.render_mode = render_mode
        self.pos = np.zeros(3)
        self.t = 0
        self.limit = 10
        self.scale = 1.0  # set_attr's target

    def reset(self, *, seed: int | None = None, options: dict | None = None
              ) -> tuple[dict, dict]:
        super().reset(seed=seed)
        self.pos = self.np_random.uniform(-1, 1, 3)
        self.t = 0
        self.limit = int(self.np_random.integers(3, 12))
        info: dict[str, Any] = {"start": float(self.pos[0])}
        if options and "tag" in options:
            info["tag"] = options["tag"]
        return self._obs(), info

    def _obs(self) -> dict:
        return {"pos": self.pos.copy(), "t": self.t}

    def step(self, action: np.ndarray) -> tuple[dict, float, bool, bool, dict]:
        self.pos = np.clip(self.pos + self.scale * np.asarray(action), -10, 10)
        self.t += 1
        reward = float(-np.abs(self.pos).sum())
        terminated = bool(np.abs(self.pos).max() > 2.5)
        truncated = self.t >= self.limit
        info: dict[str, Any] = {}
        if self.t % 3 == 0:
            info["third"] = self.t
        if self.np_random.random() < 0.3:
            info["lucky"] = True
        return self._obs(), reward, terminated, truncated, info

    def render(self) -> np.ndarray:
        return np.full((2, 2, 3), self.t, dtype=np.uint8)


class CountEnv(gym.Env):
    """Observation: the steps since the last reset (never ends by itself); ``slow`` s of
    sleep per step; action 99 raises ValueError."""

    def __init__(self, slow: float = 0.0) -> None:
        self.observation_space = spaces.Box(0, 1e9, (1,), np.float64)
        self.action_space = spaces.Discrete(100)
        self.slow = slow
        self.t = 0
        self.resets = 0

    def reset(self, *, seed: int | None = None, options: dict | None = None
              ) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        self.t = 0
        self.resets += 1
        return np.array([0.0]), {}

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict]:
        if action == 99:
            raise ValueError("action 99 is out of bounds for this test environment")
        if self.slow:
            time.sleep(self.slow)
        self.t += 1
        return np.array([float(self.t)]), 1.0, False, False, {}


def make_dict_env() -> DictEnv:
    return DictEnv()


def make_count_env(slow: float = 0.0) -> Any:
    return lambda: CountEnv(slow)


def make_wide_dict_env() -> DictEnv:
    """DictEnv with another action space (bounds -2..2)."""
    env = DictEnv()
    env.action_space = spaces.Box(-2.0, 2.0, (3,), np.float64)
    return env


class LockedCountEnv(CountEnv):
    """CountEnv holding a lock: its state does not pickle (no checkpoint: a worker death
    restarts it from its env_fn)."""

    def __init__(self, slow: float = 0.0) -> None:
        super().__init__(slow)
        import threading

        self.lock = threading.Lock()


def make_locked_count_env(slow: float = 0.0) -> Any:
    return lambda: LockedCountEnv(slow)


class TypeEnv(CountEnv):
    """CountEnv whose info names the type of the action it got (a Discrete space's
    actions are numpy scalars in gymnasium's vector environments)."""

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict]:
        obs, r, te, tr, _ = super().step(action)
        return obs, r, te, tr, {"atype": f"{type(action).__module__}.{type(action).__name__}"}
