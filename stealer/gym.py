"""gymnasium vector environments on stealer agents: :class:`AgentVectorEnv`.

::

    import gymnasium as gym
    from stealer.gym import AgentVectorEnv

    envs = AgentVectorEnv([lambda: gym.make("MyEnv-v0")] * 32)   # was gym.vector.AsyncVectorEnv
    obs, infos = envs.reset(seed=42)
    for _ in range(1000):
        obs, rewards, terminations, truncations, infos = envs.step(policy(obs))
    envs.close()

A drop-in for gymnasium's ``AsyncVectorEnv`` (and ``SyncVectorEnv``): a
``gymnasium.vector.VectorEnv`` whose sub-environments live in stealer agents (one agent
per environment, built by its ``env_fn`` on a worker), stepped in lockstep: one
``Executor.call_all`` per ``step`` (one message to each agent, each worker woken once),
then every reply.  What it gives over one process per environment (AsyncVectorEnv):
as many processes as cores, not as environments, each pinned to its core; and the
per-call costs of stealer's agents (README, "Agents under a lockstep client").

Semantics are gymnasium's own, checked step for step against ``SyncVectorEnv`` in
``tests/test_gym.py``: ``reset(seed=, options=)`` (an int seed gives ``seed + i``; a list,
one per environment; ``options["reset_mask"]`` resets some), ``step`` with the three
autoreset modes (``next_step``, the default, ``same_step`` with ``final_obs`` and
``final_info``, ``disabled``), ``observation_mode`` ("same", "different" or a pair of
spaces), ``copy``, infos merged as gymnasium merges them (``_add_info``), ``call``,
``get_attr``, ``set_attr``, ``render``, ``step_async``/``step_wait`` (with a ``timeout``)
and ``reset_async``/``reset_wait``.  gymnasium's vector wrappers work on top
(``RecordEpisodeStatistics``, ``NormalizeObservation``...).

Where stealer differs, and why:

* **An environment's error** is raised by ``step`` (or ``reset``...) as itself, the
  worker's traceback chained as ``__cause__``; the other environments' replies of that
  step are taken first, so the vector stays usable (AsyncVectorEnv marks itself broken).
* **A worker that dies** (SIGKILL, the OOM killer, a segfault): its environments come
  back on a live worker from their last checkpoint (every ``checkpoint_every`` steps,
  default 64) and replay the steps since, as any stealer agent does; a gymnasium
  environment is deterministic given its state (its seeded ``np_random`` is part of it),
  so it goes on exactly where it was, and the step that was running is answered once.
  An environment whose state does not pickle is built again from its ``env_fn``: its
  next step ends the episode instead, ``truncated=True``, reward 0.0,
  ``info["stealer_restarted"] = True`` and the observation of a fresh ``reset()`` (in
  ``next_step`` mode the step after it is then the reset step, as after any episode end;
  in ``same_step`` mode ``final_obs`` is that observation too, the true last one being
  lost): the trajectory is cut there, as a time limit cuts it.
* **Executor**: ``executor=ex`` runs the environments on an executor of yours (several
  vector environments may share one; a cluster executor, ``Executor(cluster=...)``,
  spreads them over the nodes); else the vector environment starts its own
  (``workers``, default every usable core) and shuts it down on ``close()``.  Other
  keyword arguments are agent options (``spawn_agents``): ``mailbox``, ``tier``,
  ``checkpoint_every``...

Needs ``pip install 'stealer[gym]'`` (gymnasium >= 1.1).  ``import stealer`` never
imports gymnasium; this module does.
"""

from __future__ import annotations

import concurrent.futures
import random
import time
from collections.abc import Callable, Sequence
from copy import deepcopy
from typing import Any

import numpy as np
from gymnasium import Env, Space
from gymnasium.spaces.utils import is_space_dtype_shape_equiv
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.vector.utils import (
    batch_differing_spaces,
    batch_space,
    concatenate,
    create_empty_array,
    iterate,
)

import stealer
from stealer.errors import StealerError

__all__ = ["AgentVectorEnv", "EnvAgent", "ClosedEnvError"]

# (one class from Python 3.11 on; two before)
_TIMEOUTS = (TimeoutError, concurrent.futures.TimeoutError)


class ClosedEnvError(StealerError, RuntimeError):
    """A closed :class:`AgentVectorEnv` was used."""


class EnvAgent(stealer.Agent):
    """One sub-environment as an agent: ``env_fn()`` built on its worker; its handlers are
    called by :class:`AgentVectorEnv`, which keeps the autoreset logic of gymnasium's
    vector environments here, next to the environment (one message per step).

    ``life``: a random number drawn when the agent is built.  A checkpoint keeps it (the
    agent comes back from one with its environment as it was, and replays the steps
    since); a restart from ``env_fn`` (a state that does not pickle, after a worker death)
    draws another.  Each step carries the life its client knows: a step for another life
    (the first one after a restart, the replayed ones included) ends the episode instead,
    and its reply tells the client the new life."""

    self_driven = False  # ``step`` is a message handler, never the agent's own step

    def __init__(self, env_fn: Callable[[], Env], autoreset: str) -> None:
        self.env = env_fn()
        self.mode = AutoresetMode(autoreset)
        self.pending = False  # next_step mode: the last step ended an episode
        self.life = random.getrandbits(62)

    # -- what the client reads once -------------------------------------------------------
    def spaces(self) -> tuple[Space, Space, dict, str | None, int]:
        e = self.env
        return e.observation_space, e.action_space, dict(e.metadata), e.render_mode, self.life

    # -- the lockstep handlers --------------------------------------------------------------
    def reset(self, seed: int | None, options: dict | None) -> tuple[Any, dict]:
        obs, info = self.env.reset(seed=seed, options=options)
        self.pending = False
        return obs, info

    def step(self, action: Any, life: int, scalar: str | None = None) -> tuple:
        if scalar is not None:  # a numpy scalar sent as a Python one (see step_async)
            action = np.dtype(scalar).type(action)
        if life != self.life:  # built again from env_fn since the client's last reply
            return self._cut()
        env = self.env
        mode = self.mode
        if mode is AutoresetMode.NEXT_STEP and self.pending:
            self.pending = False
            obs, info = env.reset()
            return obs, 0.0, False, False, info
        obs, reward, term, trunc, info = env.step(action)
        # plain Python scalars: numpy's bool_/float64 would leave the fast pickle path
        term, trunc = bool(term), bool(trunc)
        if mode is AutoresetMode.NEXT_STEP:
            self.pending = term or trunc
        elif mode is AutoresetMode.SAME_STEP and (term or trunc):
            final = {"final_obs": obs, "final_info": info}
            obs, info = env.reset()
            return obs, float(reward), term, trunc, (final, info)
        return obs, float(reward), term, trunc, info

    def _cut(self) -> tuple:
        """The step of an environment built again from its env_fn: its episode ends here,
        truncated, as each autoreset mode ends one (next_step: the next step is the reset
        step, its action ignored; same_step: the final observation is the reset's, the
        true one being lost).  The reply's sixth item is this agent's life."""
        obs, info = self.env.reset()
        info = dict(info)
        info["stealer_restarted"] = True
        self.pending = self.mode is AutoresetMode.NEXT_STEP
        if self.mode is AutoresetMode.SAME_STEP:
            return obs, 0.0, False, True, ({"final_obs": obs, "final_info": info}, info), \
                self.life
        return obs, 0.0, False, True, info, self.life

    # -- the rest of the VectorEnv API ---------------------------------------------------
    def call_env(self, name: str, args: tuple, kwargs: dict) -> Any:
        what = self.env.get_wrapper_attr(name)
        return what(*args, **kwargs) if callable(what) else what

    def set_env_attr(self, name: str, value: Any) -> None:
        self.env.set_wrapper_attr(name, value)

    def render(self) -> Any:
        return self.env.render()

    def on_stop(self) -> None:
        self.env.close()


def _batch_of(futs: Sequence[Any], timeout: float | None) -> list[Any]:
    """Every future's value in order, within ``timeout`` seconds in all; the first error
    raised once all have settled (so the replies of the others are taken and the next step
    finds the agents ready).  A timeout, or Ctrl-C, is raised at once."""
    out: list[Any] = []
    err: BaseException | None = None
    end = None if timeout is None else time.monotonic() + timeout
    for f in futs:
        try:
            out.append(f.result(None if end is None else max(0.0, end - time.monotonic())))
        except _TIMEOUTS:
            raise
        except Exception as exc:  # the environment's own error, or AgentStopped...
            if err is None:
                err = exc
            out.append(None)
    if err is not None:
        raise err
    return out


class AgentVectorEnv(VectorEnv):
    """A gymnasium vector environment whose sub-environments are stealer agents (see the
    module doc): ``AgentVectorEnv(env_fns, executor=None, workers=None, copy=True,
    observation_mode="same", autoreset_mode=AutoresetMode.NEXT_STEP, **agent_options)``."""

    def __init__(self, env_fns: Sequence[Callable[[], Env]], *,
                 executor: stealer.Executor | None = None, workers: int | None = None,
                 copy: bool = True, observation_mode: str | tuple[Space, Space] = "same",
                 autoreset_mode: str | AutoresetMode = AutoresetMode.NEXT_STEP,
                 **agent_options: Any) -> None:
        super().__init__()
        env_fns = list(env_fns)
        if not env_fns:
            raise ValueError("AgentVectorEnv needs at least one env_fn")
        if not all(callable(fn) for fn in env_fns):
            raise TypeError("env_fns must be callables that make an environment "
                            "(e.g. lambda: gymnasium.make('CartPole-v1'))")
        self.autoreset_mode = (autoreset_mode if isinstance(autoreset_mode, AutoresetMode)
                               else AutoresetMode(autoreset_mode))
        self.copy = copy
        self.observation_mode = observation_mode
        self.num_envs = len(env_fns)
        if executor is not None and workers is not None:
            raise ValueError("give executor= or workers=, not both")
        self._own = executor is None
        self._ex = stealer.Executor(workers) if executor is None else executor
        self._refs: Sequence[Any] = ()
        self._state: str | None = None  # "step" or "reset" between *_async and *_wait
        self._futs: list[Any] = []
        try:
            args = [(fn, self.autoreset_mode.value) for fn in env_fns]
            many = getattr(self._ex, "spawn_agents", None)
            if many is not None:
                self._refs = many(EnvAgent, args, **agent_options)
            else:  # a cluster executor: one spawn each (placed over the nodes)
                self._refs = refs = []
                for a in args:
                    refs.append(self._ex.spawn_agent(EnvAgent, *a, **agent_options))
            spaces = _batch_of(self._ex.call_all(self._refs, "spaces"), None)
            self._setup(spaces, observation_mode)
        except BaseException:
            self._teardown()
            raise
        # each environment's life (EnvAgent.life), sent with its steps
        self._life = [sp[4] for sp in spaces]
        self._observations = create_empty_array(self.single_observation_space,
                                                n=self.num_envs, fn=np.zeros)
        self._env_obs: list[Any] = [None] * self.num_envs
        self._rewards = np.zeros((self.num_envs,), dtype=np.float64)
        self._terminations = np.zeros((self.num_envs,), dtype=np.bool_)
        self._truncations = np.zeros((self.num_envs,), dtype=np.bool_)

    def _setup(self, spaces: list[tuple], observation_mode: Any) -> None:
        """The spaces, metadata and checks of SyncVectorEnv.__init__, from every
        environment's ``spaces()``."""
        obs0, act0, meta, render_mode, _ = spaces[0]
        self.metadata = dict(meta)
        self.metadata["autoreset_mode"] = self.autoreset_mode
        self.render_mode = render_mode
        self.single_action_space = act0
        self.action_space = batch_space(act0, self.num_envs)
        if isinstance(observation_mode, tuple) and len(observation_mode) == 2:
            if not all(isinstance(s, Space) for s in observation_mode):
                raise TypeError("observation_mode's pair must be two Spaces (the batched "
                                "space, the single one)")
            self.observation_space, self.single_observation_space = observation_mode
        elif observation_mode == "same":
            self.single_observation_space = obs0
            self.observation_space = batch_space(obs0, self.num_envs)
        elif observation_mode == "different":
            self.single_observation_space = obs0
            self.observation_space = batch_differing_spaces([s[0] for s in spaces])
        else:
            raise ValueError(f"observation_mode must be 'same', 'different' or a pair of "
                             f"spaces, not {observation_mode!r}")
        for i, (obs_s, act_s, *_) in enumerate(spaces):
            if observation_mode == "same":
                if obs_s != self.single_observation_space:
                    raise RuntimeError(
                        f"environment {i}'s observation space {obs_s} is not environment "
                        f"0's {self.single_observation_space}; if that is meant, use "
                        "observation_mode='different'")
            elif not is_space_dtype_shape_equiv(obs_s, self.single_observation_space):
                raise RuntimeError(f"environment {i}'s observation space {obs_s} does not "
                                   "share a shape and dtype with the others")
            if act_s != self.single_action_space:
                raise RuntimeError(f"environment {i}'s action space {act_s} is not "
                                   f"environment 0's {self.single_action_space}")

    # -- reset -------------------------------------------------------------------------------
    def reset(self, *, seed: int | list[int | None] | None = None,
              options: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
        """Reset every environment (or those of ``options["reset_mask"]``): as
        ``SyncVectorEnv.reset``."""
        self.reset_async(seed=seed, options=options)
        return self.reset_wait()

    def reset_async(self, seed: int | list[int | None] | None = None,
                    options: dict[str, Any] | None = None) -> None:
        """Send the resets (:meth:`reset_wait` takes the replies)."""
        self._idle("reset_async")
        if seed is None:
            seeds: list[int | None] = [None] * self.num_envs
        elif isinstance(seed, (int, np.integer)) and not isinstance(seed, bool):
            seeds = [int(seed) + i for i in range(self.num_envs)]
        else:
            seeds = list(seed)
        if len(seeds) != self.num_envs:
            raise ValueError(f"reset(seed=[...]) takes one seed per environment "
                             f"({self.num_envs}), not {len(seeds)}")
        mask = None
        if options is not None and "reset_mask" in options:
            options = dict(options)
            mask = options.pop("reset_mask")
            if not isinstance(mask, np.ndarray) or mask.dtype != np.bool_ or \
                    mask.shape != (self.num_envs,):
                raise TypeError(f"options['reset_mask'] must be a numpy bool array of shape "
                                f"({self.num_envs},), not {mask!r}")
            if not mask.any():
                raise ValueError("options['reset_mask'] resets no environment")
        which = range(self.num_envs) if mask is None else np.flatnonzero(mask).tolist()
        self._which = list(which)
        self._futs = self._ex.call_all([self._refs[i] for i in self._which], "reset",
                                       [(seeds[i], options) for i in self._which])
        self._state = "reset"

    def reset_wait(self, timeout: float | None = None) -> tuple[Any, dict[str, Any]]:
        """The replies of :meth:`reset_async`: (observations, infos)."""
        replies = self._replies("reset", timeout)
        infos: dict[str, Any] = {}
        for i, (obs, info) in zip(self._which, replies):
            self._env_obs[i] = obs
            self._terminations[i] = self._truncations[i] = False
            infos = self._add_info(infos, info, i)
        self._observations = concatenate(self.single_observation_space, self._env_obs,
                                         self._observations)
        return (deepcopy(self._observations) if self.copy else self._observations), infos

    # -- step --------------------------------------------------------------------------------
    def step(self, actions: Any) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray,
                                          dict[str, Any]]:
        """One step of every environment: as ``SyncVectorEnv.step``."""
        self.step_async(actions)
        return self.step_wait()

    def step_async(self, actions: Any) -> None:
        """Send one step to every environment (:meth:`step_wait` takes the replies)."""
        self._idle("step_async")
        acts = list(iterate(self.action_space, actions))
        if len(acts) != self.num_envs:
            raise ValueError(f"step() takes one action per environment ({self.num_envs}), "
                             f"not {len(acts)}")
        if acts and isinstance(acts[0], np.generic):
            # numpy scalars (a Discrete or MultiDiscrete space's actions) travel as Python
            # ones with their dtype: the call then stays on the fast pickle path (27 µs of
            # client CPU per call less, measured on CartPole), and the environment gets
            # the same numpy scalar SyncVectorEnv would give it
            args = [(a.item(), life, a.dtype.str) if isinstance(a, np.generic) else (a, life)
                    for a, life in zip(acts, self._life)]
        else:
            args = list(zip(acts, self._life))
        self._futs = self._ex.call_all(self._refs, "step", args)
        self._state = "step"

    def step_wait(self, timeout: float | None = None
                  ) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        """The replies of :meth:`step_async`: (observations, rewards, terminations,
        truncations, infos)."""
        replies = self._replies("step", timeout)
        same = self.autoreset_mode is AutoresetMode.SAME_STEP
        infos: dict[str, Any] = {}
        rew, term, trunc, env_obs = self._rewards, self._terminations, self._truncations, \
            self._env_obs
        for i, reply in enumerate(replies):
            obs, r, te, tr, info = reply[:5]
            if len(reply) == 6:  # the environment was built again: its new life
                self._life[i] = reply[5]
            env_obs[i] = obs
            rew[i] = r
            term[i] = te
            trunc[i] = tr
            if same and type(info) is tuple:  # (final, the reset's info)
                infos = self._add_info(infos, info[0], i)
                info = info[1]
            infos = self._add_info(infos, info, i)
        self._observations = concatenate(self.single_observation_space, env_obs,
                                         self._observations)
        return ((deepcopy(self._observations) if self.copy else self._observations),
                np.copy(rew), np.copy(term), np.copy(trunc), infos)

    # -- the rest ----------------------------------------------------------------------------
    def call(self, name: str, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        """``name`` of every environment (``get_wrapper_attr``), called with the arguments
        if it is callable."""
        self._idle("call")
        return tuple(_batch_of(self._ex.call_all(
            self._refs, "call_env", [(name, args, kwargs)] * self.num_envs), None))

    def get_attr(self, name: str) -> tuple[Any, ...]:
        """Attribute ``name`` of every environment."""
        return self.call(name)

    def set_attr(self, name: str, values: list[Any] | tuple[Any, ...] | Any) -> None:
        """Set ``name`` on every environment: ``values`` one per environment (a list or
        tuple), or one value for all."""
        self._idle("set_attr")
        if not isinstance(values, (list, tuple)):
            values = [values] * self.num_envs
        if len(values) != self.num_envs:
            raise ValueError(f"set_attr takes one value per environment ({self.num_envs}), "
                             f"not {len(values)}")
        _batch_of(self._ex.call_all(self._refs, "set_env_attr",
                                    [(name, v) for v in values]), None)

    def render(self) -> tuple[Any, ...]:
        """Every environment's ``render()``."""
        self._idle("render")
        return tuple(_batch_of(self._ex.call_all(self._refs, "render"), None))

    @property
    def executor(self) -> stealer.Executor:
        """The executor the environments run on."""
        return self._ex

    @property
    def agents(self) -> Sequence[Any]:
        """The environments' agents (``AgentRef``), in order."""
        return self._refs

    def close_extras(self, **kwargs: Any) -> None:
        """Stop the agents (each environment's ``close()`` runs on its worker); shut the
        executor down if this vector environment started it."""
        self._teardown()

    def _teardown(self) -> None:
        refs, self._refs = self._refs, ()
        self._state = None
        try:
            stopped = []
            for r in refs:
                try:
                    r.stop()
                except Exception:  # the executor is down already (a user's may be)
                    break
                stopped.append(r)
            for r in stopped:
                try:
                    r.result(60)
                except Exception:  # an environment whose close() raised: stopped anyway
                    pass
        finally:
            if self._own:
                self._ex.shutdown()

    def __enter__(self) -> AgentVectorEnv:
        """``with AgentVectorEnv(...) as envs:`` closes it at the end, as ``with env:`` does
        for a gymnasium Env (gymnasium's vector environments have no ``with``)."""
        return self

    def __exit__(self, *exc: Any) -> bool:
        self.close()
        return False

    def __del__(self) -> None:
        # as AsyncVectorEnv: an environment dropped without close() still stops its agents
        if not getattr(self, "closed", True) and getattr(self, "_refs", ()):
            try:
                self.close()
            except Exception:  # (at interpreter exit the executor may be gone already)
                pass

    def _replies(self, state: str, timeout: float | None) -> list[Any]:
        """The replies of the ``state`` sent (reset or step), the vector idle again after
        them, or after an error; a timeout leaves it waiting (*_wait may be called again)."""
        self._waiting(state, f"{state}_wait")
        try:
            replies = _batch_of(self._futs, timeout)
        except _TIMEOUTS:
            raise
        except BaseException:
            self._state = None
            raise
        self._state = None
        return replies

    # -- state checks ------------------------------------------------------------------------
    def _idle(self, what: str) -> None:
        if self.closed or not self._refs:
            raise ClosedEnvError(f"{what}() on a closed AgentVectorEnv")
        if self._state is not None:
            raise RuntimeError(f"{what}() while a {self._state} is waiting: call "
                               f"{self._state}_wait() first")

    def _waiting(self, state: str, what: str) -> None:
        if self.closed or not self._refs:
            raise ClosedEnvError(f"{what}() on a closed AgentVectorEnv")
        if self._state != state:
            raise RuntimeError(f"{what}() without a {state}_async() before it")

    def __repr__(self) -> str:
        return f"AgentVectorEnv(num_envs={self.num_envs})"
