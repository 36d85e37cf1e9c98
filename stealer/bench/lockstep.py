"""The ``lockstep`` workload (issue 19): a client steps N stateful agents in rounds.

This is the reinforcement-learning "vector environment" (gymnasium's ``AsyncVectorEnv``,
Stable-Baselines3's ``SubprocVecEnv``): every round the client sends each agent a small numpy
action, gathers every reply (a small float32 observation and a float reward), computes the next
actions from the observations (a little numpy in the client), and starts the next round.

The environment (:class:`Env`) is plain Python: 64 particles (positions, velocities, masses:
about 2.5 KB of numpy arrays) plus a small dict and list.  ``act(action, iters)`` runs
``iters`` iterations of real numpy work (forces toward the action's target, integration,
bounces off the walls) and returns ``(obs, reward)``; it also counts its own CPU time
(``time.thread_time_ns``) and chains a CRC of every action it got, so a lost, repeated or
misdelivered call shows.  It is seeded and uses only element-wise arithmetic and axis-0
reductions, so every system's final states and observations equal those of the sequential
loop bit for bit.

:func:`calibrate` measures once per process, in the client, how many iterations take the
target handler CPU time (0.5 ms by default), on scratch environments stepped by the same
policy, and what one call then costs (the median); every system gets that iteration count,
and the ideal is computed from that handler time.  An iteration costs 8-12 µs and a call's
fixed part about 20 µs here (both up to 1.7x more under load), so the 0.05 ms handlers are
2-4 iterations, within 10-25% of the target.

Systems, each driven by the same round loop (:func:`drive`):

- **stealer**: one agent per environment (:class:`LockstepAgent`, handler ``act``); a round is
  :func:`stealer_round`: ``ref.call("act", a)`` per agent, then every future's result (or
  ``ex.call_all`` when the executor has that batch API).
- **one process** (:func:`run_sequential`): a loop over the environments in the client.  It
  is also the oracle every other system is checked against.
- **pipes** (:func:`run_pipes`): what the vector-environment libraries do: one process per
  environment (``multiprocessing``, forked as gymnasium's AsyncVectorEnv does on Linux) and
  a ``Pipe`` each; a round sends every action, then receives every reply.
- **shipped state** (:func:`run_shipped`, any ``concurrent.futures`` executor, e.g.
  ProcessPoolExecutor): a task takes ``(env, action)`` and returns ``(env, obs, reward)``.

Reported per system (over the measured rounds, after warm-up rounds): ``calls_per_s``,
``of_ideal`` (calls/s over the ideal's), round time p50/p99 (ms), ``client_us`` (the client
process's CPU time, ``getrusage(RUSAGE_SELF)``, all its threads, result thread included,
minus any handler time it ran itself, per call), ``worker_us`` (the worker processes' CPU
time, psutil, minus the handlers' own CPU time, per call: what running a call costs beyond
its handler), for stealer ``spin_us`` (the part of ``worker_us`` spent in the workers' idle
search rounds before they park, sched_yield loops while they wait for the next round: the
``spin_ns`` counter) and ``busy_us`` (``worker_us`` less it: what a call itself costs a
worker), ``handler_us`` (handler CPU per call as measured where it ran),
``handler_share`` (the handlers' CPU time over W x the wall time: the share of the W cores
spent in handlers, 1 at best; unlike ``of_ideal`` it does not move when the machine's load
makes every handler slower or faster than at calibration, which on the shared 2-core VM
moves 1.5x within a minute) and, for stealer, ``migrations_per_1k`` (the workers'
``migrations`` counter per 1,000 calls).

The ideal on W workers: each round takes ``ceil(N / W)`` handler times, so
``N / (ceil(N / W) * handler)`` calls/s (about W / handler), no client cost.

Two configurations (:data:`CONFIGS`): 32 agents x 0.5 ms ("default") and 256 agents x 0.05 ms
("overhead-bound": what a call costs beyond its handler decides it); 200 rounds after 20
warm-up rounds, 30 after 5 with ``--quick``, and 4 after 2 with 6 and 12 agents at the
"tiny" size of the tests (:data:`ROUNDS`, :func:`config_for`).

In ``stealer bench --workloads lockstep`` (:func:`run`; not in the default set: 10-20 s even
at ``--quick`` on 2 cores, mostly the 256 agents' and 256 pipe processes' calls) each
configuration is a block of rows.  A system with native agents (stealer) runs its agents and,
in the same run, the one-process and pipe peers: they are not executors, so they get no
column of their own but rows of the stealer column ("one process: of ideal", "pipes: of
ideal", the pipes' client and worker µs, "calls/s / pipes'"), so stealer and the design it
must beat by 1.5x sit side by side; then both run again interleaved (:func:`interleave`, row
"calls/s / pipes', interleaved": the ratio that a change of the machine's load during the
run does not bias).  A plain executor's column (ProcessPoolExecutor, loky,
...) runs the shipped-state design, the natural way to step stateful environments on a pool.
Every system is checked against the one-process run (measured once per process and
configuration).  ``benchmarks/lockstep.py`` runs all four systems side by side in a table of
their own, with the sizes as options.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import resource
import statistics
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import cache
from typing import Any

from stealer._lazy import lazy_numpy
from stealer.agents import Agent
from stealer.bench.ideal import percentile

__all__ = [
    "Config",
    "Calibration",
    "CONFIGS",
    "ROUNDS",
    "Env",
    "LockstepAgent",
    "calibrate",
    "config_for",
    "initial_actions",
    "next_actions",
    "drive",
    "interleave",
    "stealer_vs_pipes",
    "pipes_system",
    "agents_system",
    "stealer_round",
    "run_sequential",
    "run_pipes",
    "run_shipped",
    "run_agents",
    "ideal",
    "check",
    "run",
]

WAIT_S = 600.0  # upper bound on any one reply, so a broken system cannot hang the bench
PARTICLES = 64
DT = 0.01
STIFFNESS = 4.0
DAMPING = 0.5
HISTORY = 8  # rewards an env keeps
SEED = 7

np: Any = lazy_numpy(globals())  # numpy, imported at first use (``stealer bench`` imports this)

Summary = tuple[int, int, int, bytes]  # (steps, action CRC, state CRC, last obs bytes)


# --------------------------------------------------------------------------- environment


class Env:
    """One agent's simulation: 64 particles pulled toward the target the action names.

    State: ``pos``, ``vel`` (64 x 2 float64), ``pull``, ``drag`` (64 x 1: from each
    particle's mass), ``info`` (a dict of
    counters), ``recent`` (the last rewards), ``crc`` (of every action received, in order),
    ``cpu_ns`` (CPU time spent in :meth:`act`).
    """

    def __init__(self, index: int, seed: int = SEED) -> None:
        rng = np.random.default_rng([seed, index])
        self.index = index
        self.pos = rng.uniform(-1.0, 1.0, (PARTICLES, 2))
        self.vel = rng.normal(0.0, 0.1, (PARTICLES, 2))
        mass = rng.uniform(0.5, 2.0, (PARTICLES, 1))
        self.pull = DT * STIFFNESS / mass  # velocity gained per unit of distance to the target
        self.drag = DT * DAMPING / mass  # share of the velocity lost per iteration
        self.info: dict[str, Any] = {"steps": 0, "bounces": 0, "reward_sum": 0.0}
        self.recent: list[float] = []
        self.crc = 0
        self.obs = np.zeros(8, np.float32)
        self.cpu_ns = 0

    def act(self, action: np.ndarray, iters: int) -> tuple[np.ndarray, float]:
        """``iters`` iterations toward ``action`` (a target point); ``(obs, reward)``."""
        t0 = time.thread_time_ns()
        target = np.asarray(action, dtype=np.float64)
        self.crc = zlib.crc32(target.tobytes(), self.crc)
        pos, vel, pull, drag = self.pos, self.vel, self.pull, self.drag
        for _ in range(iters):
            vel += pull * (target - pos) - drag * vel
            pos += DT * vel
            out = np.abs(pos) > 1.0
            np.negative(vel, out=vel, where=out)  # bounce off the walls
            np.minimum(pos, 1.0, out=pos)
            np.maximum(pos, -1.0, out=pos)
        bounces = int(np.count_nonzero(out)) if iters else 0
        centroid = pos.mean(axis=0)
        cx, cy = centroid.tolist()
        tx, ty = target.tolist()
        dist = math.hypot(cx - tx, cy - ty)
        reward = -dist - 0.001 * bounces
        info = self.info
        info["steps"] += 1
        info["bounces"] += bounces
        info["reward_sum"] += reward
        recent = self.recent
        recent.append(reward)
        del recent[:-HISTORY]
        obs = np.empty(8, np.float32)
        obs[0:2] = centroid
        obs[2:4] = vel.mean(axis=0)
        obs[4:6] = pos.max(axis=0)
        obs[6] = dist
        obs[7] = sum(recent) / len(recent)
        self.obs = obs
        self.cpu_ns += time.thread_time_ns() - t0
        return obs, reward

    def summary(self) -> Summary:
        """What must equal the oracle's: steps, the action CRC, a CRC of the state, last obs."""
        state = zlib.crc32(self.pos.tobytes(), zlib.crc32(self.vel.tobytes()))
        return (self.info["steps"], self.crc, state, self.obs.tobytes())


def initial_actions(n: int) -> list[np.ndarray]:
    """Round 0's actions: agent ``i`` aims at a point on a circle."""
    angles = np.arange(n, dtype=np.float64) * (2.0 * math.pi / max(n, 1))
    targets = 0.5 * np.stack([np.cos(angles), np.sin(angles)], axis=1)
    return list(targets.astype(np.float32))


def next_actions(obs: Sequence[np.ndarray], round_index: int) -> list[np.ndarray]:
    """The client's policy: the next targets from every observation at once (cheap numpy,
    as a vector-env client batches its observations)."""
    o = np.stack(obs).astype(np.float64)
    phase = 0.05 * round_index
    drift = np.array([math.cos(phase), math.sin(phase)])
    targets = np.clip(0.6 * drift - 0.3 * o[:, 0:2] - 0.1 * o[:, 2:4], -0.9, 0.9)
    return list(targets.astype(np.float32))


def env_step(env: Env, action: np.ndarray, iters: int) -> tuple[Env, np.ndarray, float]:
    """The shipped-state task: the state travels to the worker and back with each call."""
    obs, reward = env.act(action, iters)
    return env, obs, reward


# --------------------------------------------------------------------------- calibration


@dataclass(frozen=True)
class Calibration:
    """``iters`` iterations per call take ``handler_s`` of CPU here (target ``target_s``)."""

    target_s: float
    iters: int
    handler_s: float


def _time_act(iters: int, rounds: int, agents: int = 8) -> float:
    """Median CPU seconds of one ``act`` with ``iters`` iterations: scratch environments
    stepped as the workload steps them (the same policy), timed here."""
    envs = [Env(10**6 + i) for i in range(agents)]
    actions = initial_actions(agents)
    times = []
    for r in range(rounds):
        obs = []
        for env, a in zip(envs, actions):
            t0 = time.thread_time_ns()
            obs.append(env.act(a, iters)[0])
            times.append(time.thread_time_ns() - t0)
        actions = next_actions(obs, r)
    return statistics.median(times) / 1e9


@cache
def calibrate(target_s: float) -> Calibration:
    """How many iterations make one call cost ``target_s`` of CPU here (once per process:
    every system of a run gets the same count), and what one call then costs.

    A call costs ``t(1) + (k - 1) * b`` with ``k`` iterations: ``t(1)`` and ``t(16)`` give
    a first guess; then, while the call at the guess is more than 10% off the target (the
    shared machine's load moves the cost per iteration by up to 1.7x between seconds), the
    guess is scaled by target / measured, at most four times."""
    _time_act(4, 3)  # warm the code paths
    t1 = _time_act(1, 8)
    per_iter = max((_time_act(16, 8) - t1) / 15, 1e-9)
    iters = max(1, 1 + round((target_s - t1) / per_iter))
    handler_s = _time_act(iters, 8)
    for _ in range(4):
        if abs(handler_s / target_s - 1.0) <= 0.1:
            break
        guess = max(1, round(iters * target_s / handler_s))
        if guess == iters:
            break
        iters = guess
        handler_s = _time_act(iters, 8)
    return Calibration(target_s, iters, _time_act(iters, 20))

# --------------------------------------------------------------------------- configurations


@dataclass(frozen=True)
class Config:
    """``agents`` environments of ``work_s`` handlers, ``warmup`` + ``rounds`` rounds."""

    name: str
    agents: int
    work_s: float
    rounds: int
    warmup: int
    seed: int = SEED

    @property
    def label(self) -> str:
        return f"{self.agents}x{self.work_s * 1e3:g}ms"


#: The two configurations at full size: the default and the overhead-bound one.
CONFIGS = (
    Config("default", 32, 0.5e-3, 200, 20),
    Config("overhead_bound", 256, 0.05e-3, 200, 20),
)
#: (rounds, warm-up rounds) per size; "tiny" (tests) also has fewer agents (:data:`TINY_AGENTS`).
ROUNDS = {"full": (200, 20), "quick": (30, 5), "tiny": (4, 2)}
TINY_AGENTS = {"default": 6, "overhead_bound": 12}


def config_for(base: Config, size: str) -> Config:
    """``base`` at a size of ``stealer bench`` (``full``, ``quick``, ``tiny``)."""
    rounds, warmup = ROUNDS[size]
    agents = TINY_AGENTS[base.name] if size == "tiny" else base.agents
    return replace(base, agents=agents, rounds=rounds, warmup=warmup)


def ideal(cfg: Config, cal: Calibration, workers: int) -> dict[str, Any]:
    """Zero-overhead lockstep on ``workers`` workers: each round ``ceil(N / W)`` handlers."""
    round_s = math.ceil(cfg.agents / workers) * cal.handler_s
    return {
        "calls_per_s": cfg.agents / round_s,
        "of_ideal": 1.0,
        "round_p50_ms": round_s * 1e3,
        "round_p99_ms": round_s * 1e3,
        "client_us": 0.0,
        "worker_us": 0.0,
        "handler_us": cal.handler_s * 1e6,
        "handler_share": cfg.agents / workers / math.ceil(cfg.agents / workers),
    }


# --------------------------------------------------------------------------- the round loop


def _client_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _procs_cpu_s(procs: Sequence[Any]) -> float | None:
    """Summed user + system CPU of psutil processes; None when one is gone."""
    total = 0.0
    try:
        for p in procs:
            t = p.cpu_times()
            total += t.user + t.system
    except Exception:  # psutil.NoSuchProcess: a worker was replaced, the sum means nothing
        return None
    return total


def _psutil_procs(pids: Sequence[int | None]) -> list[Any]:
    try:
        import psutil
    except ImportError:
        return []
    return [psutil.Process(p) for p in pids if p is not None]


@dataclass
class System:
    """How :func:`drive` steps one system: ``step(actions) -> [(obs, reward)]`` in agent
    order; ``summaries()`` (each env's :meth:`Env.summary` and ``cpu_ns``); ``workers()``:
    the worker processes (psutil) whose CPU counts as worker time, asked after the warm-up
    (a plain pool starts its processes lazily); ``handlers_in_client``: the
    handlers run in the client (one process), so their time is not client overhead."""

    step: Callable[[list[np.ndarray]], list[tuple[np.ndarray, float]]]
    summaries: Callable[[], list[tuple[Summary, int]]]
    workers: Callable[[], Sequence[Any]] = tuple
    handlers_in_client: bool = False
    counters: Callable[[], dict[str, int]] | None = None  # stealer's summed worker counters


def drive(cfg: Config, cal: Calibration, sysm: System, workers: int,
          report: Callable[[float], None] | None = None) -> dict[str, Any]:
    """Warm-up rounds, then ``cfg.rounds`` measured rounds; the numbers and the finals."""
    actions = initial_actions(cfg.agents)
    for r in range(cfg.warmup):
        replies = sysm.step(actions)
        actions = next_actions([o for o, _ in replies], r)
    procs = sysm.workers()
    h0 = sum(ns for _, ns in sysm.summaries())
    c0 = _settled(sysm.counters, {}, cfg.agents * (cfg.warmup + 1)) if sysm.counters else {}
    w0 = _procs_cpu_s(procs) if procs else None
    cpu0 = _client_cpu_s()
    t0 = time.perf_counter()
    rounds: list[float] = []
    for r in range(cfg.warmup, cfg.warmup + cfg.rounds):
        ts = time.perf_counter()
        replies = sysm.step(actions)
        actions = next_actions([o for o, _ in replies], r)
        rounds.append(time.perf_counter() - ts)
        if report is not None and not r & 15:
            report((r - cfg.warmup) / cfg.rounds)
    wall = time.perf_counter() - t0
    cpu = _client_cpu_s() - cpu0
    w1 = _procs_cpu_s(procs) if procs else None
    finals = sysm.summaries()
    c1 = _settled(sysm.counters, c0, cfg.agents * (cfg.rounds + 1)) if sysm.counters else {}
    handler_s = (sum(ns for _, ns in finals) - h0) / 1e9
    calls = cfg.agents * cfg.rounds
    out: dict[str, Any] = {
        "calls": calls,
        "calls_per_s": calls / wall,
        "of_ideal": calls / wall / ideal(cfg, cal, workers)["calls_per_s"],
        "round_p50_ms": percentile(rounds, 50) * 1e3,
        "round_p99_ms": percentile(rounds, 99) * 1e3,
        "client_us": (cpu - (handler_s if sysm.handlers_in_client else 0.0)) / calls * 1e6,
        "worker_us": None if w0 is None or w1 is None else (w1 - w0 - handler_s) / calls * 1e6,
        "handler_us": handler_s / calls * 1e6,
        "handler_share": handler_s / (workers * wall),
        "wall_s": wall,
        "finals": [s for s, _ in finals],
        "last_obs": [o.tobytes() for o, _ in replies],
    }
    if sysm.counters:
        moved = c1.get("migrations", 0) - c0.get("migrations", 0)
        out["migrations"] = moved
        out["migrations_per_1k"] = moved / calls * 1e3
        spun = c1.get("spin_ns", 0) - c0.get("spin_ns", 0)
        out["spin_us"] = spun / calls / 1e3
        if out["worker_us"] is not None:
            out["busy_us"] = out["worker_us"] - out["spin_us"]
    return out


def _settled(counters: Callable[[], dict[str, int]], before: dict[str, int], calls: int,
             timeout: float = 2.0) -> dict[str, int]:
    """The counters once ``agent_messages`` grew by ``calls`` (workers publish them every
    64 turns and when they park), or after ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while True:
        now = counters()
        if now.get("agent_messages", 0) - before.get("agent_messages", 0) >= calls:
            return now
        if time.monotonic() > end:
            return now
        time.sleep(0.005)


def interleave(cfg: Config, systems: dict[str, System], blocks: int = 8
               ) -> dict[str, dict[str, Any]]:
    """Several systems measured over the same stretch of time: each runs ``cfg.warmup``
    rounds, then ``cfg.rounds`` split into ``blocks`` blocks, the systems taking turns
    block by block, in one order and then the reverse (A B, B A, A B...), so a load change
    on the machine (the shared VM moves a handler's cost 1.5x within a minute) falls on
    both alike; :func:`drive` runs one system after another.  Each system steps its own
    environments from round 0 (its actions follow its own observations).  Per system:
    ``calls_per_s`` over its blocks' wall time, ``block_calls_per_s`` (each block),
    ``rounds``, ``wall_s``, ``last_obs``."""
    if blocks < 1 or not systems:
        raise ValueError(f"interleave() needs systems and at least one block, not {blocks}")
    names = list(systems)
    per = max(1, cfg.rounds // blocks)
    actions = {n: initial_actions(cfg.agents) for n in names}
    done = dict.fromkeys(names, 0)
    wall = dict.fromkeys(names, 0.0)
    per_block: dict[str, list[float]] = {n: [] for n in names}
    last: dict[str, list[Any]] = {}

    def run_rounds(n: str, k: int) -> float:
        sysm, acts = systems[n], actions[n]
        t0 = time.perf_counter()
        for _ in range(k):
            replies = sysm.step(acts)
            acts = next_actions([o for o, _ in replies], done[n])
            done[n] += 1
            last[n] = replies
        actions[n] = acts
        return time.perf_counter() - t0

    for n in names:
        run_rounds(n, cfg.warmup)
    for b in range(blocks):
        for n in (names if b % 2 == 0 else names[::-1]):
            dt = run_rounds(n, per)
            wall[n] += dt
            per_block[n].append(cfg.agents * per / dt)
    return {n: {"calls_per_s": cfg.agents * per * blocks / wall[n], "wall_s": wall[n],
                "rounds": per * blocks, "block_calls_per_s": per_block[n],
                "last_obs": [o.tobytes() for o, _ in last[n]]} for n in names}


# --------------------------------------------------------------------------- the systems


def run_sequential(cfg: Config, cal: Calibration, workers: int,
                   report: Callable[[float], None] | None = None) -> dict[str, Any]:
    """One process: a loop over the environments (the oracle)."""
    envs = [Env(i, cfg.seed) for i in range(cfg.agents)]
    iters = cal.iters

    def step(actions: list[np.ndarray]) -> list[tuple[np.ndarray, float]]:
        return [e.act(a, iters) for e, a in zip(envs, actions)]

    def summaries() -> list[tuple[Summary, int]]:
        return [(e.summary(), e.cpu_ns) for e in envs]

    out = drive(cfg, cal, System(step, summaries, handlers_in_client=True), workers, report)
    out["worker_us"] = None  # no workers
    return out


def _pipe_worker(remote: Any, parent_remote: Any, index: int, seed: int, iters: int) -> None:
    """One environment's process (as SubprocVecEnv's worker): commands over a pipe."""
    parent_remote.close()
    env = Env(index, seed)
    try:
        while True:
            cmd, data = remote.recv()
            if cmd == "act":
                remote.send(env.act(data, iters))
            elif cmd == "summary":
                remote.send((env.summary(), env.cpu_ns))
            elif cmd == "close":
                break
    except (EOFError, KeyboardInterrupt):
        pass
    finally:
        remote.close()


def run_pipes(cfg: Config, cal: Calibration, workers: int,
              report: Callable[[float], None] | None = None,
              start_method: str = "fork") -> dict[str, Any]:
    """One process per environment and a pipe each; a round sends every action, then
    receives every reply.  The processes are forked (gymnasium's AsyncVectorEnv default on
    Linux; SubprocVecEnv's forkserver starts them 2-3 times slower here, and runs the same),
    so each starts with numpy imported; call it while no executor of this process runs."""
    with pipes_system(cfg, cal, start_method) as sysm:
        return drive(cfg, cal, sysm, workers, report)


@contextmanager
def pipes_system(cfg: Config, cal: Calibration, start_method: str = "fork"
                 ) -> Iterator[System]:
    """:func:`run_pipes`' processes and pipes as a :class:`System` (closed on exit)."""
    ctx = mp.get_context(start_method)
    remotes, procs = [], []
    try:
        for i in range(cfg.agents):
            remote, work_remote = ctx.Pipe()
            p = ctx.Process(target=_pipe_worker, args=(work_remote, remote, i, cfg.seed,
                                                       cal.iters), daemon=True)
            p.start()
            work_remote.close()
            remotes.append(remote)
            procs.append(p)

        def step(actions: list[np.ndarray]) -> list[tuple[np.ndarray, float]]:
            for remote, a in zip(remotes, actions):
                remote.send(("act", a))
            return [_recv(remote) for remote in remotes]

        def summaries() -> list[tuple[Summary, int]]:
            for remote in remotes:
                remote.send(("summary", None))
            return [_recv(remote) for remote in remotes]

        yield System(step, summaries, lambda: _psutil_procs([p.pid for p in procs]))
    finally:
        for remote in remotes:
            try:
                remote.send(("close", None))
            except OSError:  # that process is gone already
                pass
            remote.close()
        for p in procs:
            p.join(5.0)
            if p.is_alive():
                p.kill()
                p.join()


def _recv(remote: Any) -> Any:
    if not remote.poll(WAIT_S):
        raise TimeoutError(f"an environment process did not reply in {WAIT_S:.0f} s")
    return remote.recv()


def run_shipped(ex: Any, cfg: Config, cal: Calibration, workers: int,
                report: Callable[[float], None] | None = None) -> dict[str, Any]:
    """Any ``concurrent.futures`` executor: each call is a task carrying the env there and
    back (:func:`env_step`).  Its workers: ``ex.worker_pids()`` when it has that, else this
    process's children after the warm-up rounds (a pool's helper processes count too)."""
    envs = [Env(i, cfg.seed) for i in range(cfg.agents)]
    iters = cal.iters

    def step(actions: list[np.ndarray]) -> list[tuple[np.ndarray, float]]:
        futs = [ex.submit(env_step, e, a, iters) for e, a in zip(envs, actions)]
        out = []
        for k, f in enumerate(futs):
            env, obs, reward = f.result(WAIT_S)
            envs[k] = env
            out.append((obs, reward))
        return out

    def summaries() -> list[tuple[Summary, int]]:
        return [(e.summary(), e.cpu_ns) for e in envs]

    def procs() -> list[Any]:
        pids = ex.worker_pids() if hasattr(ex, "worker_pids") else _children()
        return _psutil_procs(pids)

    sysm = System(step, summaries, procs)
    return drive(cfg, cal, sysm, workers, report)


class LockstepAgent(Agent):
    """One environment as a stealer agent: message-only, handler ``act``."""

    def __init__(self, index: int, seed: int, iters: int) -> None:
        self.env = Env(index, seed)
        self.iters = iters

    def act(self, action: np.ndarray) -> tuple[np.ndarray, float]:
        return self.env.act(action, self.iters)

    def summary(self) -> tuple[Summary, int]:
        return self.env.summary(), self.env.cpu_ns


def stealer_round(ex: Any, refs: Sequence[Any], method: str,
                  actions: Sequence[Any]) -> list[Any]:
    """One lockstep round on stealer agents: one call per agent (``actions[i]`` to
    ``refs[i]``), then every reply, in agent order.  Uses the executor's batch call
    ``ex.call_all(refs, method, [(a,), ...])`` (a list of futures in order) when it has one,
    else ``ref.call(method, a)`` per agent."""
    call_all = getattr(ex, "call_all", None)
    if call_all is not None:
        futs = call_all(refs, method, [(a,) for a in actions])
    else:
        futs = [ref.call(method, a) for ref, a in zip(refs, actions)]
    return [f.result(WAIT_S) for f in futs]


def run_agents(ex: Any, cfg: Config, cal: Calibration, workers: int,
               report: Callable[[float], None] | None = None) -> dict[str, Any]:
    """stealer: one :class:`LockstepAgent` per environment, stepped by :func:`stealer_round`."""
    with agents_system(ex, cfg, cal) as sysm:
        return drive(cfg, cal, sysm, workers, report)


@contextmanager
def agents_system(ex: Any, cfg: Config, cal: Calibration) -> Iterator[System]:
    """:func:`run_agents`' agents on ``ex`` as a :class:`System` (stopped on exit)."""
    refs = [ex.spawn_agent(LockstepAgent, i, cfg.seed, cal.iters) for i in range(cfg.agents)]
    try:

        def step(actions: list[np.ndarray]) -> list[tuple[np.ndarray, float]]:
            return stealer_round(ex, refs, "act", actions)

        def summaries() -> list[tuple[Summary, int]]:
            return [f.result(WAIT_S) for f in [r.call("summary") for r in refs]]

        def counters() -> dict[str, int]:
            return dict(ex.stats().totals())

        yield System(step, summaries, lambda: _psutil_procs(ex.worker_pids()),
                     counters=counters)
    finally:
        for r in refs:
            r.stop()
        for r in refs:
            r.result(WAIT_S)


# --------------------------------------------------------------------------- checks


def check(name: str, got: dict[str, Any], oracle: dict[str, Any]) -> None:
    """Raise RuntimeError unless ``got``'s finals and last observations equal the oracle's."""
    for key in ("finals", "last_obs"):
        a, b = got[key], oracle[key]
        if a != b:
            bad = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
            raise RuntimeError(
                f"{name}: {key} differ from the one-process oracle's for agents {bad[:8]} "
                f"({len(a)} vs {len(b)} agents): a call was lost, repeated or answered out "
                f"of order")


# --------------------------------------------------------------------------- stealer bench


#: What ``stealer bench`` keeps of each configuration's result, and of the peers'.
FIELDS = ("calls_per_s", "of_ideal", "handler_share", "round_p50_ms", "round_p99_ms",
          "client_us", "worker_us", "busy_us", "spin_us", "handler_us", "migrations_per_1k")
PEER_FIELDS = ("calls_per_s", "of_ideal", "handler_share", "client_us", "worker_us",
               "handler_us")
#: Key prefix of each configuration in a ``stealer bench`` result.
PREFIXES = {"default": "", "overhead_bound": "ob_"}
_ROW_FORMATS = [
    ("calls_per_s", "calls/s", ",.0f"),
    ("of_ideal", "of ideal", ".2f"),
    ("handler_share", "share of W cores in handlers", ".2f"),
    ("round_p50_ms", "round p50 ms", ".2f"),
    ("round_p99_ms", "round p99 ms", ".2f"),
    ("client_us", "client µs/call", ".1f"),
    ("worker_us", "worker overhead µs/call", ".1f"),
    ("busy_us", "worker overhead µs/call, less idle spin", ".1f"),
    ("spin_us", "worker idle spin µs/call", ".1f"),
    ("handler_us", "handler µs/call", ".0f"),
    ("migrations_per_1k", "migrations /1k calls", ".1f"),
    ("seq_of_ideal", "one process: of ideal", ".2f"),
    ("pipes_of_ideal", "pipes: of ideal", ".2f"),
    ("pipes_client_us", "pipes: client µs/call", ".1f"),
    ("pipes_worker_us", "pipes: worker µs/call", ".1f"),
    ("vs_pipes", "calls/s / pipes'", ".2f"),
    ("vs_pipes_il", "calls/s / pipes', interleaved", ".2f"),
]
#: Blocks of the interleaved stealer / pipes run (:func:`interleave`) in ``stealer bench``.
IL_BLOCKS = 8


def table_rows() -> list[tuple[str, str, str]]:
    """The ``stealer bench`` table's rows: ``(key, label, format)``, both configurations."""
    return [(PREFIXES[c.name] + key, f"{c.label}: {label}", spec)
            for c in CONFIGS for key, label, spec in _ROW_FORMATS]


def _flat(prefix: str, res: dict[str, Any], fields: Sequence[str]) -> dict[str, Any]:
    return {prefix + k: res.get(k) for k in fields}


@cache
def _oracle(cfg: Config, cal: Calibration, workers: int) -> dict[str, Any]:
    """The one-process run: measured once per process and configuration, the oracle of
    every system of a ``stealer bench`` run."""
    return run_sequential(cfg, cal, workers)


def run(system: Any, workers: int, size: str, opener: Callable[..., tuple[Any, float]],
        report: Callable[[float], None] | None = None) -> dict[str, Any]:
    """The ``lockstep`` workload of ``stealer bench`` for one system (see the module doc),
    both configurations: ``opener(system, workers)`` gives a warm executor and its ready
    time.  A native-agent system (``system.agents == "native"``) runs :func:`run_agents`,
    then the pipe peer, and reports the one-process peer too (keys ``seq_*``, ``pipes_*``,
    ``vs_pipes``), then both again interleaved (``vs_pipes_il``: :func:`interleave`, the
    ratio a change of the machine's load during the run does not bias); any other runs
    :func:`run_shipped`.  Keys of the overhead-bound
    configuration start with ``ob_``.  RuntimeError when a system's finals are not the
    one-process oracle's."""
    native = getattr(system, "agents", "flat") == "native"
    out: dict[str, Any] = {"info": {}, "ideal": {}}
    for k, base in enumerate(CONFIGS):
        cfg = config_for(base, size)
        cal = calibrate(cfg.work_s)
        prefix = PREFIXES[cfg.name]

        def part(frac: float, k: int = k) -> None:
            if report is not None:
                report((k + frac) / len(CONFIGS))

        oracle = _oracle(cfg, cal, workers)
        ex, ready = opener(system, workers)
        try:
            if native:
                res = run_agents(ex, cfg, cal, workers, lambda f: part(f / 2))
            else:
                res = run_shipped(ex, cfg, cal, workers, part)
        finally:
            ex.shutdown(wait=True)
        check(f"{system.name} ({cfg.label})", res, oracle)
        out.update(_flat(prefix, res, FIELDS))
        out.setdefault("ready_s", ready)
        out["ideal"].update(_flat(prefix, ideal(cfg, cal, workers), FIELDS))
        out["info"][cfg.name] = {
            "agents": cfg.agents, "rounds": cfg.rounds, "warmup": cfg.warmup,
            "iters": cal.iters, "handler_ms": cal.handler_s * 1e3, "wall_s": res["wall_s"],
            "migrations": res.get("migrations"), "mode": "agents" if native else "shipped state"}
        if native:  # the peers, in the same run (after the executor is shut down: fork)
            pipes = run_pipes(cfg, cal, workers, lambda f: part(0.5 + f / 2))
            check(f"pipes ({cfg.label})", pipes, oracle)
            out.update(_flat(prefix + "seq_", oracle, PEER_FIELDS))
            out.update(_flat(prefix + "pipes_", pipes, PEER_FIELDS))
            out[prefix + "vs_pipes"] = res["calls_per_s"] / pipes["calls_per_s"]
            il = stealer_vs_pipes(cfg, cal, lambda: opener(system, workers)[0], IL_BLOCKS,
                                  f"{system.name} ({cfg.label})")
            out[prefix + "vs_pipes_il"] = il["stealer_vs_pipes"]
    return out


def stealer_vs_pipes(cfg: Config, cal: Calibration, open_executor: Callable[[], Any],
                     blocks: int, name: str = "stealer") -> dict[str, Any]:
    """Stealer's agents (on the executor ``open_executor()`` returns, shut down after) and
    the pipes, both alive, calls/s over the same stretch of time (:func:`interleave`); the
    pipes fork before the executor starts.  RuntimeError if their last observations differ
    (they stepped the same rounds).  ``stealer_vs_pipes``: the ratio; ``block_ratios``:
    each block's."""
    with pipes_system(cfg, cal) as pipes:
        ex = open_executor()
        try:
            with agents_system(ex, cfg, cal) as agents:
                got = interleave(cfg, {"stealer": agents, "pipes": pipes}, blocks)
        finally:
            ex.shutdown(wait=True)
    s, p = got["stealer"], got["pipes"]
    if s["last_obs"] != p["last_obs"]:
        raise RuntimeError(f"{name}, interleaved with the pipes: the last observations "
                           "differ (a call was lost, repeated or misrouted)")
    return {"blocks": blocks, "rounds": s["rounds"],
            "stealer_calls_per_s": s["calls_per_s"], "pipes_calls_per_s": p["calls_per_s"],
            "stealer_vs_pipes": s["calls_per_s"] / p["calls_per_s"],
            "block_ratios": [a / b for a, b in zip(s["block_calls_per_s"],
                                                   p["block_calls_per_s"])]}


def _children() -> list[int]:
    """The pids of this process's children (a plain pool's workers, and its helpers)."""
    try:
        import psutil
    except ImportError:
        return []
    return [p.pid for p in psutil.Process().children(recursive=True)]
