"""stealer.gym.AgentVectorEnv: gymnasium's vector API on agents, checked step for step
against gymnasium's own SyncVectorEnv (the sequential oracle), in every autoreset mode;
errors, worker deaths, async halves, wrappers on top, and what close() leaves."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Any

import pytest

gym = pytest.importorskip("gymnasium")

import gym_lib  # noqa: E402
import numpy as np  # noqa: E402
from gymnasium.vector import AutoresetMode, SyncVectorEnv  # noqa: E402

import stealer  # noqa: E402
from stealer.gym import AgentVectorEnv, ClosedEnvError  # noqa: E402


@pytest.fixture(scope="module")
def ex():
    with stealer.Executor(2) as e:
        yield e


def same(a: Any, b: Any) -> bool:
    """Equal all the way down: dicts, tuples, numeric and object arrays."""
    if isinstance(a, dict) or isinstance(b, dict):
        return (isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys()
                and all(same(a[k], b[k]) for k in a))
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        a, b = np.asarray(a), np.asarray(b)
        if a.dtype == object or b.dtype == object:
            return a.shape == b.shape and all(same(x, y) for x, y in zip(a.flat, b.flat))
        return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
    if isinstance(a, (tuple, list)):
        return (isinstance(b, (tuple, list)) and len(a) == len(b)
                and all(same(x, y) for x, y in zip(a, b)))
    return bool(a == b)


FNS = {
    "cartpole": [lambda: gym.make("CartPole-v1")] * 5,
    "dict": [gym_lib.make_dict_env] * 5,
}


@pytest.mark.parametrize("mode", list(AutoresetMode))
@pytest.mark.parametrize("kind", sorted(FNS))
def test_steps_equal_sync_vector_env(ex, kind: str, mode: AutoresetMode) -> None:
    """Same seeds, same actions: every observation, reward, flag and info (with its masks,
    final_obs and final_info) equals SyncVectorEnv's, over episodes that end by
    termination and by truncation; in the disabled mode the loop resets the finished
    environments itself (options["reset_mask"], with an option passed through)."""
    fns = FNS[kind]
    a = AgentVectorEnv(fns, executor=ex, autoreset_mode=mode)
    s = SyncVectorEnv(fns, autoreset_mode=mode)
    try:
        assert a.observation_space == s.observation_space
        assert a.action_space == s.action_space
        assert a.metadata["autoreset_mode"] is mode
        assert same(a.reset(seed=7), s.reset(seed=7))
        a.action_space.seed(3)
        ends = 0
        for t in range(120):
            act = a.action_space.sample()
            ra, rs = a.step(act), s.step(act)
            assert same(ra, rs), f"step {t}: {ra} != {rs}"
            done = ra[2] | ra[3]
            ends += int(done.sum())
            if mode is AutoresetMode.DISABLED and done.any():
                opts = {"reset_mask": done, "tag": t}
                assert same(a.reset(options=dict(opts)), s.reset(options=dict(opts)))
        assert ends >= 10  # episodes did end, in every environment's turn
    finally:
        a.close()
        s.close()


def test_discrete_actions_reach_the_environment_as_numpy_scalars(ex) -> None:
    """They travel as Python ints with their dtype (the fast path) and are numpy scalars
    again in the environment, as SyncVectorEnv gives them."""
    fns = [gym_lib.TypeEnv] * 3
    a, s = AgentVectorEnv(fns, executor=ex), SyncVectorEnv(fns)
    try:
        a.reset(seed=0)
        s.reset(seed=0)
        act = np.array([1, 2, 3], dtype=np.int64)
        ia, is_ = a.step(act)[4], s.step(act)[4]
        assert list(ia["atype"]) == list(is_["atype"]) == ["numpy.int64"] * 3
    finally:
        a.close()
        s.close()


def test_reset_seeds_list_and_none(ex) -> None:
    fns = [gym_lib.make_dict_env] * 3
    a, s = AgentVectorEnv(fns, executor=ex), SyncVectorEnv(fns)
    try:
        assert same(a.reset(seed=[5, None, 9])[0]["t"], s.reset(seed=[5, None, 9])[0]["t"])
        o1, _ = a.reset(seed=[5, 6, 7])
        o2, _ = s.reset(seed=[5, 6, 7])
        assert same(o1, o2)
        with pytest.raises(ValueError, match="one seed per environment"):
            a.reset(seed=[1, 2])
        with pytest.raises(TypeError, match="reset_mask"):
            a.reset(options={"reset_mask": [True, False, True]})
        with pytest.raises(ValueError, match="resets no environment"):
            a.reset(options={"reset_mask": np.zeros(3, dtype=bool)})
        a.step(a.action_space.sample())  # still usable after refused calls
    finally:
        a.close()
        s.close()


def test_call_get_attr_set_attr_render(ex) -> None:
    a = AgentVectorEnv([lambda: gym_lib.DictEnv("rgb_array")] * 3, executor=ex)
    try:
        a.reset(seed=0)
        assert a.render_mode == "rgb_array"
        assert a.get_attr("scale") == (1.0, 1.0, 1.0)
        a.set_attr("scale", [0.0, 1.0, 2.0])
        assert a.get_attr("scale") == (0.0, 1.0, 2.0)
        a.set_attr("scale", 0.5)
        assert a.call("_obs")[0].keys() == {"pos", "t"}
        assert a.call("np_random_seed") == (0, 1, 2)
        frames = a.render()
        assert len(frames) == 3 and frames[0].shape == (2, 2, 3)
        with pytest.raises(ValueError, match="one value per environment"):
            a.set_attr("scale", [1.0])
        with pytest.raises(AttributeError):
            a.get_attr("no_such_attribute")
    finally:
        a.close()


def test_an_environment_error_is_raised_and_the_vector_goes_on(ex) -> None:
    """The failing environment's error comes as itself, with the worker's traceback as
    its cause; the other environments' replies were taken: the next step works."""
    a = AgentVectorEnv([gym_lib.make_count_env()] * 4, executor=ex)
    try:
        a.reset()
        with pytest.raises(ValueError, match="out of bounds") as info:
            a.step(np.array([1, 99, 1, 1]))
        assert info.value.__cause__ is not None
        obs, *_ = a.step(np.array([1, 1, 1, 1]))
        assert obs[:, 0].tolist() == [2.0, 1.0, 2.0, 2.0]
    finally:
        a.close()


def test_async_halves_timeout_and_misuse(ex) -> None:
    a = AgentVectorEnv([gym_lib.make_count_env(slow=0.3)] * 2, executor=ex)
    try:
        a.reset()
        with pytest.raises(RuntimeError, match="without a step_async"):
            a.step_wait()
        a.step_async(np.array([1, 1]))
        with pytest.raises(RuntimeError, match="step_wait"):
            a.step_async(np.array([1, 1]))
        with pytest.raises(TimeoutError):
            a.step_wait(timeout=0.01)
        obs, rew, *_ = a.step_wait(timeout=30)  # the same step, still there
        assert obs[:, 0].tolist() == [1.0, 1.0] and rew.tolist() == [1.0, 1.0]
        a.reset_async(seed=1)
        assert a.reset_wait()[0][:, 0].tolist() == [0.0, 0.0]
    finally:
        a.close()


def test_gymnasium_vector_wrappers_on_top(ex) -> None:
    """RecordEpisodeStatistics over AgentVectorEnv reports the episodes SyncVectorEnv's
    does."""
    from gymnasium.wrappers.vector import RecordEpisodeStatistics

    fns = [lambda: gym.make("CartPole-v1")] * 3
    a = RecordEpisodeStatistics(AgentVectorEnv(fns, executor=ex))
    s = RecordEpisodeStatistics(SyncVectorEnv(fns))
    try:
        a.reset(seed=11)
        s.reset(seed=11)
        for t in range(150):
            act = np.array([(t * 7 + i) % 2 for i in range(3)])
            _, _, _, _, ia = a.step(act)
            _, _, _, _, is_ = s.step(act)
            assert same(ia.get("episode", {}).get("r"), is_.get("episode", {}).get("r"))
        assert list(a.return_queue) == list(s.return_queue) and len(a.return_queue) > 3
    finally:
        a.close()
        s.close()


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="at least one"):
        AgentVectorEnv([])
    with pytest.raises(TypeError, match="callables"):
        AgentVectorEnv([gym_lib.DictEnv()])
    with stealer.Executor(1) as e:
        with pytest.raises(ValueError, match="not both"):
            AgentVectorEnv([gym_lib.make_dict_env], executor=e, workers=2)
        with pytest.raises(RuntimeError, match="action space"):
            AgentVectorEnv([gym_lib.make_dict_env, gym_lib.make_wide_dict_env], executor=e)
        with pytest.raises(RuntimeError, match="observation space"):
            AgentVectorEnv([gym_lib.make_dict_env, lambda: gym.make("CartPole-v1")],
                           executor=e)
        # the refused constructions stopped their agents: the executor has none left
        deadline = time.monotonic() + 10
        while e.stats().agents_live and time.monotonic() < deadline:
            time.sleep(0.05)
        assert e.stats().agents_live == 0
        assert e.submit(abs, -3).result(10) == 3


def test_close_stops_agents_own_executor_and_refuses_use() -> None:
    a = AgentVectorEnv([gym_lib.make_count_env()] * 3, workers=2)
    own = a.executor
    a.reset()
    a.step(np.array([1, 2, 3]))
    refs = list(a.agents)
    a.close()
    a.close()  # twice: nothing more
    with pytest.raises(ClosedEnvError, match="closed"):
        a.step(np.array([1, 2, 3]))
    with pytest.raises(RuntimeError):  # its own executor is shut down
        own.submit(abs, 1)
    assert len(refs) == 3


def test_a_with_block_closes_it_even_on_ctrl_c() -> None:
    with AgentVectorEnv([gym_lib.make_count_env()] * 2, workers=2) as a:
        a.reset()
        assert a.step(np.array([1, 1]))[0][:, 0].tolist() == [1.0, 1.0]
    assert a.closed
    with pytest.raises(ClosedEnvError, match="closed"):
        a.step(np.array([1, 1]))
    with pytest.raises(KeyboardInterrupt), AgentVectorEnv([gym_lib.make_count_env()] * 2,
                                                          workers=2) as b:
        b.reset()
        raise KeyboardInterrupt
    assert b.closed
    with pytest.raises(RuntimeError):  # its own executor is shut down
        b.executor.submit(abs, 1)


def test_shared_executor_outlives_the_vector(ex) -> None:
    a = AgentVectorEnv([gym_lib.make_count_env()] * 2, executor=ex)
    b = AgentVectorEnv([gym_lib.make_count_env()] * 2, executor=ex)
    a.reset()
    b.reset()
    a.close()
    assert b.step(np.array([0, 0]))[0][:, 0].tolist() == [1.0, 1.0]
    b.close()
    assert ex.submit(abs, -1).result(10) == 1


def _kill(e: stealer.Executor, k: int, killed: set[int]) -> None:
    """SIGKILL worker k, once it is not one killed before (its replacement started)."""
    deadline = time.monotonic() + 30
    while (pid := e.worker_pids()[k]) is None or pid in killed:
        assert time.monotonic() < deadline, "no worker came back"
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    killed.add(pid)


def _steps_under_kills(make: Any, n_envs: int = 6) -> tuple[int, set[int]]:
    """60 steps of ``n_envs`` counting environments (10 ms a step) on 2 workers, one worker
    SIGKILLed in the middle of every tenth step.  Checks every reply: an environment cut
    (``stealer_restarted``) reports one truncated step of reward 0 and observation 0, then
    the reset step (next_step mode), then counts from 1 again; every other reply counts
    on by one.  Returns (cuts, the pids killed)."""
    with stealer.Executor(2, retries=50) as e:
        a = AgentVectorEnv([make(slow=0.01)] * n_envs, executor=e, checkpoint_every=4)
        try:
            a.reset()
            expect = np.zeros(n_envs)
            cuts = 0
            killed: set[int] = set()
            pending = np.zeros(n_envs, dtype=bool)  # next_step: a cut's next step resets
            for t in range(60):
                a.step_async(np.ones(n_envs, dtype=np.int64))
                if t % 10 == 5:  # mid-step: the worker's agents are running or queued
                    time.sleep(0.015)
                    _kill(e, t // 10 % 2, killed)
                obs, rew, term, trunc, info = a.step_wait(60)
                cut = info.get("_stealer_restarted", np.zeros(n_envs, dtype=bool))
                for i in range(n_envs):
                    if cut[i]:
                        assert trunc[i] and rew[i] == 0.0 and obs[i, 0] == 0.0
                        expect[i] = 0.0
                        pending[i] = True
                        cuts += 1
                    elif pending[i]:  # the reset step after the cut
                        assert obs[i, 0] == 0.0 and rew[i] == 0.0 and not trunc[i]
                        pending[i] = False
                    else:
                        expect[i] += 1
                        assert obs[i, 0] == expect[i] and rew[i] == 1.0 and not trunc[i], \
                            (t, i, obs[:, 0], expect)
                assert not term.any()
            return cuts, killed
        finally:
            a.close()


def test_a_killed_worker_loses_no_step_of_a_picklable_environment() -> None:
    """Its environments come back from their checkpoints and replay the steps since
    (stealer's agents do): each counts on as if no worker had died, never cut."""
    cuts, killed = _steps_under_kills(gym_lib.make_count_env)
    assert len(killed) == 6 and cuts == 0


def test_a_killed_worker_cuts_the_episodes_of_unpicklable_environments() -> None:
    """An environment whose state does not pickle restarts from its env_fn: its step
    after the death ends its episode (truncated, stealer_restarted), and it goes on."""
    cuts, killed = _steps_under_kills(gym_lib.make_locked_count_env)
    assert len(killed) == 6 and cuts >= 3


def test_the_gym_vector_benchmark_runs_and_checks_the_observations() -> None:
    """benchmarks/gym_vector.py at a tiny size (CartPole: no calibration): every system's
    row, their final observations checked equal by the script (it exits 1 otherwise)."""
    import json
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "benchmarks" / "gym_vector.py"
    out = subprocess.run([sys.executable, str(script), "--steps", "8", "--blocks", "2",
                          "--workers", "2", "--only", "cartpole", "--json"],
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads(out.stdout)["CartPole-v1 x32"]
    assert len(rows) == 3 and all(r["env_steps_per_s"] > 0 for r in rows.values()), rows


def test_import_stealer_does_not_import_gymnasium() -> None:
    code = ("import sys, stealer, stealer.client.executor\n"
            "assert 'gymnasium' not in sys.modules, 'imported by stealer'\n"
            "import stealer.gym\n"
            "assert 'gymnasium' in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
