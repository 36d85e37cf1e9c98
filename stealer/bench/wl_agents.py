"""The agent workloads of ``stealer bench``: ``agents``, ``tiers``, ``agent_overhead``,
``lockstep`` (a wrapper over :mod:`stealer.bench.lockstep`) and ``agent_scale``, with their
sizes, the client-driven stand-ins a plain pool runs, and the helpers that read the workers'
counters.  Registered in :data:`stealer.bench.cli.WORKLOADS`; benchmarks/journal.py runs
:func:`run_agents` directly.

Workloads (``--quick`` sizes in brackets):

- ``agents``: 200 [50] self-driven agents x 25 [10] steps of 0.5 ms busy work, each carrying
  a counter and a 1,000-float numpy array from step to step (:class:`~stealer.bench.
  workloads.StepState`; checked at every step and at the end).  stealer runs them as agents
  (``spawn_agent(StepAgent, state)``); a plain executor runs each step as a task that takes
  the state and returns it, the client resubmitting an agent's next step when its result
  arrives.  Makespan (run start to the client holding every final state), efficiency
  ``(sum of work / W) / makespan``, and the per-step latency p50/p99/max: the end of a step
  minus the end of the agent's previous step (the run's start for its first), both read in
  the worker with ``time.monotonic`` (one clock across processes on Linux).  The ideal is
  the zero-overhead round-robin schedule (:func:`stealer.bench.ideal.round_robin_steps`):
  step latency ~ agents x 0.5 ms / W (50 ms for 200 agents on 2 workers), efficiency 1.
  ``step_p99_later_ms`` leaves out every agent's first step (the start-up ramp: agents are
  spawned, adopted and spread over the workers while the first ones already step).
- ``tiers``: 8 bulk agents with 5 ms steps saturate every worker while one interactive agent
  gets a call every 10 ms (0.2 ms of work), 100 [30] calls after a 0.1 s warm-up and one
  unmeasured call; p50/p99/max of the reply time (client send to the future done, read in a
  done callback).  Plain executors run it client-driven: 8 chains of 5 ms tasks, each
  resubmitted by a client thread when the previous completes, and each call a task submitted
  in between (so a FIFO pool queues it behind the bulk tasks).  ``bulk_busy`` is the share of
  the workers' time in bulk steps while the calls ran (about 1 when saturated).  The ideal
  (:func:`stealer.bench.ideal.step_boundary_replies`) waits for the first bulk step of any
  worker to end, then runs the call: never more than ``bound_ms`` = 5.2 ms.
- ``agent_overhead`` (stealer only; n/a on plain pools): (a) 20 agents x 5,000 [500] steps
  that do nothing, on one worker: ``step_us`` = wall time / steps (spawn to the last final
  value, nothing subtracted) and ``turn_us`` the part inside the agents' turns (the worker's
  ``busy_ns`` counter: the step call and its bookkeeping, a checkpoint every 64 steps);
  (b) ping-pong: two agents bounce a counter 20,000 [2,000] times with ``v = yield
  other.call("ping", v)``, timed inside the caller; µs per round trip and round trips/s.
  Placement is not an API: the pair is respawned (up to 8 times) until the two live on
  different workers (``same_worker`` says if that failed; ``info`` has the tries and the
  workers' park/wake-up counts during the run).
- ``lockstep``: a client steps 32 agents x 0.5 ms and 256 x 0.05 ms in rounds, one call each
  per round (the RL vector environment); plain pools ship the state with each call; the
  one-process and process-per-agent pipe peers run in the stealer row (:mod:`stealer.bench.
  lockstep`).
- ``agent_scale`` (stealer only, and only when named in ``--workloads``: heavy):
  1,000,000 [20,000] idle message-only agents, started by one ``spawn_agents`` call, in one
  executor made with ``records=1 << 20`` [``1 << 15``] (the smallest power of two with room
  for every agent's record and the probes' messages).  ``create_s`` runs from the first spawn until nothing is left on the
  injector or any deque and a call to the last agent and to 100 others answered;
  ``bytes_per_agent`` = (growth of the client's and the workers' private resident memory,
  psutil ``rss - shared``, + the shared segment's whole size + what the overflow files that
  appeared hold in /dev/shm) / agents, also split into workers' heap, client (the refs it
  holds) and shared memory (segment and overflow files; ``overflow_files`` counts them: a
  spawn payload that fits neither a record's inline bytes nor a free block lives in one).
  Shared pages count once, by size, not in every process that maps them.  ``shutdown_s`` stops them all.
"""

from __future__ import annotations

import concurrent.futures as cf
import gc
import itertools
import math
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from stealer.bench import ideal as _ideal
from stealer.bench import lockstep as _lockstep
from stealer.bench import workloads as _wl
from stealer.bench.harness import (
    WAIT_TIMEOUT_S,
    _open,
    _report,
    _size,
    _wait_all,
    downsample,
    precise_sleep_until,
)
from stealer.bench.systems import NotApplicable, System

__all__ = [
    "AGENTS_SIZES",
    "AGENT_STEP_S",
    "TIERS_CALLS",
    "NOOP_AGENT_SIZES",
    "PINGPONG_ROUNDS",
    "SCALE_SIZES",
    "run_agents",
    "run_tiers",
    "ideal_tiers",
    "run_agent_overhead",
    "run_lockstep",
    "run_agent_scale",
]

#: (agents, steps per agent) of the ``agents`` workload.
AGENTS_SIZES = {"full": (200, 25), "quick": (50, 10), "tiny": (6, 3)}
AGENT_STEP_S = 0.5e-3
AGENT_STATE_FLOATS = 1_000


def _needs_native_agents(system: System) -> None:
    if system.agents != "native":
        raise NotApplicable(
            "agents run natively on stealer only (a plain pool has no agents to measure)"
        )


def _agent_totals(ex: cf.Executor) -> dict[str, int] | None:
    """The workers' summed counters (``stats().totals()``) of a native agent system."""
    stats = getattr(ex, "stats", None)
    return None if stats is None else dict(stats().totals())


def _settled_totals(
    ex: cf.Executor, key: str, at_least: int, before: dict[str, int], timeout: float = 2.0
) -> dict[str, int]:
    """Totals once counter ``key`` grew by ``at_least`` since ``before`` (workers publish
    their counters every 64 turns and when they park), or after ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while True:
        now = _agent_totals(ex) or {}
        if now.get(key, 0) - before.get(key, 0) >= at_least or time.monotonic() > end:
            return now
        time.sleep(0.005)


def _delta(after: dict[str, int] | None, before: dict[str, int] | None) -> dict[str, int]:
    if not after or not before:
        return {}
    return {k: after[k] - before.get(k, 0) for k in after}


def run_agents(system: System, workers: int, quick: bool | str) -> dict[str, Any]:
    """Self-driven agents carrying a counter and a numpy array through their steps."""
    import numpy as np

    n, steps = AGENTS_SIZES[_size(quick)]
    native = system.agents == "native"
    states = [
        _wl.StepState(i, steps, AGENT_STEP_S, np.zeros(AGENT_STATE_FLOATS), 0.0) for i in range(n)
    ]
    ex, ready = _open(system, workers)
    try:
        _wait_all([ex.submit(_wl.hold_numpy, 0.02) for _ in range(2 * workers)])
        before = _agent_totals(ex) if native else None
        gc.collect()
        t0 = time.monotonic()
        for s in states:
            s.last = t0
        if native:
            last = [t0]

            def record(_f: cf.Future[Any]) -> None:
                t = time.monotonic()
                if t > last[0]:
                    last[0] = t

            spawn = ex.spawn_agent  # type: ignore[attr-defined]
            futures = [spawn(_wl.StepAgent, s).future for s in states]
            for f in futures:
                f.add_done_callback(record)
            _wait_all(futures)
            finals = [f.result() for f in futures]
            end = last[0]
            after = _settled_totals(ex, "agent_steps", n * steps, before or {})
        else:
            finals, end = _agents_client_driven(ex, states, n * steps)
            after = None
    finally:
        ex.shutdown(wait=True)
    finals.sort(key=lambda s: s.index)
    for s in finals:
        if s.count != steps or len(s.lats) != steps or not bool(np.all(s.arr == steps)):
            raise RuntimeError(
                f"{system.name}: agent {s.index} ended with count {s.count}, {len(s.lats)} "
                f"latencies, array at {s.arr[0]} (expected {steps})"
            )
    if [s.index for s in finals] != list(range(n)):
        raise RuntimeError(f"{system.name}: {n - len(finals)} agents did not finish")
    lats = [x for s in finals for x in s.lats]
    later = [x for s in finals for x in s.lats[1:]]  # without each agent's first step
    work = n * steps * AGENT_STEP_S
    makespan = end - t0
    counters = _delta(after, before)
    ideal_lat, ideal_makespan = _ideal.round_robin_steps(n, steps, AGENT_STEP_S, workers)
    ideal_later = ideal_lat[n:]  # in start order: the first n are the first steps
    return {
        "agents": n,
        "steps": steps,
        "step_ms": AGENT_STEP_S * 1e3,
        "work_s": work,
        "makespan_s": makespan,
        "efficiency": work / workers / makespan,
        "step_p50_ms": _ideal.percentile(lats, 50) * 1e3,
        "step_p99_ms": _ideal.percentile(lats, 99) * 1e3,
        "step_max_ms": max(lats) * 1e3,
        "step_p99_later_ms": _ideal.percentile(later, 99) * 1e3 if later else None,
        "ready_s": ready,
        "info": {
            "mode": "native" if native else "client-driven",
            "agent_steps": counters.get("agent_steps"),
            "migrations": counters.get("migrations"),
        },
        "ideal": {
            "makespan_s": ideal_makespan,
            "efficiency": work / workers / ideal_makespan,
            "step_p50_ms": _ideal.percentile(ideal_lat, 50) * 1e3,
            "step_p99_ms": _ideal.percentile(ideal_lat, 99) * 1e3,
            "step_max_ms": max(ideal_lat) * 1e3,
            "step_p99_later_ms": _ideal.percentile(ideal_later, 99) * 1e3 if ideal_later else None,
        },
    }


def _agents_client_driven(
    ex: cf.Executor, states: Sequence[_wl.StepState], total: int
) -> tuple[list[_wl.StepState], float]:
    """The agents on a plain executor: each step is a task taking the agent's state and
    returning it; the client resubmits an agent's next step the moment its previous step's
    result arrives (FIFO: round-robin).  Returns the final states and when the client had the
    last one (``time.monotonic``)."""
    done_q: queue.SimpleQueue[tuple[cf.Future[Any], float]] = queue.SimpleQueue()

    def on_done(f: cf.Future[Any]) -> None:
        done_q.put((f, time.monotonic()))

    def submit(s: _wl.StepState) -> None:
        ex.submit(_wl.state_step, s).add_done_callback(on_done)

    for s in states:
        submit(s)
    finals: list[_wl.StepState] = []
    end = 0.0
    outstanding = len(states)
    finished_steps = 0
    while outstanding:
        try:
            f, t = done_q.get(timeout=WAIT_TIMEOUT_S)
        except queue.Empty:
            raise TimeoutError(f"no agent step finished in {WAIT_TIMEOUT_S:.0f} s") from None
        s = f.result()
        finished_steps += 1
        if not finished_steps & 255:
            _report(finished_steps / total)
        if s.count >= s.steps:
            finals.append(s)
            outstanding -= 1
            end = max(end, t)
        else:
            submit(s)
    return finals, end


TIERS_CALLS = {"full": 100, "quick": 30, "tiny": 5}
TIERS_BULK = 8
TIERS_BULK_STEP_S = 5e-3
TIERS_INTERVAL_S = 10e-3
TIERS_CALL_S = 0.2e-3
TIERS_WARMUP_S = 0.1
TIERS_IDEAL_SAMPLES = 10_000
TIERS_SEED = 13


def run_tiers(system: System, workers: int, quick: bool | str) -> dict[str, Any]:
    """Bulk agents saturate every worker; an interactive agent gets a call every 10 ms,
    and (stealer's agents) a control-tier agent one every 10 ms too, 5 ms after each
    interactive call: a control message is handled inside the running bulk step
    (stealer/worker/agents/inline.py), an interactive one at the step's end."""
    n = TIERS_CALLS[_size(quick)]
    native = system.agents == "native"
    sent = [0.0] * n
    done_at = [math.nan] * n
    csent = [0.0] * n
    cdone_at = [math.nan] * n

    def on_done(i: int, into: list[float] = done_at) -> Callable[[cf.Future[Any]], None]:
        def record(_f: cf.Future[Any]) -> None:
            into[i] = time.perf_counter()

        return record

    ex, ready = _open(system, workers)
    gc.collect()
    gc.freeze()  # as in run_latency: client GC pauses scan only what the run makes
    bulk_refs: list[Any] = []
    stop = threading.Event()
    feeder: threading.Thread | None = None
    bulk_ends: list[float] = []
    try:
        if native:
            spawn = ex.spawn_agent  # type: ignore[attr-defined]
            bulk_refs = [
                spawn(_wl.BulkAgent, TIERS_BULK_STEP_S, tier="bulk") for _ in range(TIERS_BULK)
            ]
            inter = spawn(_wl.InteractiveAgent, TIERS_CALL_S, tier="interactive")
            ctrl = spawn(_wl.InteractiveAgent, TIERS_CALL_S, tier="control")

            def call(i: int) -> cf.Future[Any]:
                return inter.call("hit", i)

            def control(i: int) -> cf.Future[Any] | None:
                return ctrl.call("hit", i)

        else:
            feeder = _bulk_feeder(ex, stop, bulk_ends)

            def call(i: int) -> cf.Future[Any]:
                return ex.submit(_wl.tier_call, i, TIERS_CALL_S)

            def control(i: int) -> cf.Future[Any] | None:
                return None  # no control tier: tasks are all one tier

        time.sleep(TIERS_WARMUP_S)  # the bulk work spreads over every worker
        if call(-1).result(WAIT_TIMEOUT_S)[0] != -1:  # warm: the agent is adopted
            raise RuntimeError(f"{system.name}: the warm-up call returned a wrong result")
        warm = control(-1)
        if warm is not None and warm.result(WAIT_TIMEOUT_S)[0] != -1:
            raise RuntimeError(f"{system.name}: the control warm-up call returned a wrong "
                               "result")
        if native:
            counts0 = [f.result(WAIT_TIMEOUT_S) for f in [r.call("count") for r in bulk_refs]]
        futures: list[cf.Future[Any]] = []
        cfutures: list[cf.Future[Any]] = []
        t_start = time.perf_counter() + 0.005
        w0 = time.perf_counter()
        for i in range(n):
            if not i & 15:
                _report(i / n)
            precise_sleep_until(t_start + i * TIERS_INTERVAL_S)
            sent[i] = time.perf_counter()
            f = call(i)
            f.add_done_callback(on_done(i))
            futures.append(f)
            precise_sleep_until(t_start + (i + 0.5) * TIERS_INTERVAL_S)
            csent[i] = time.perf_counter()
            c = control(i)
            if c is not None:
                c.add_done_callback(on_done(i, cdone_at))
                cfutures.append(c)
        _wait_all(futures + cfutures)
        w1 = time.perf_counter()
        got = [f.result() for f in futures]
        cgot = [f.result() for f in cfutures]
        if native:
            counts1 = [f.result(WAIT_TIMEOUT_S) for f in [r.call("count") for r in bulk_refs]]
            for r in bulk_refs:
                r.stop()
            bulk_steps = [r.result(WAIT_TIMEOUT_S) for r in bulk_refs]
            inter.stop()
            calls_seen = inter.result(WAIT_TIMEOUT_S)
            ctrl.stop()
            if ctrl.result(WAIT_TIMEOUT_S) != n + 1:
                raise RuntimeError(f"{system.name}: the control agent lost calls")
            window_steps = sum(counts1) - sum(counts0)
        else:
            stop.set()
            assert feeder is not None
            feeder.join(WAIT_TIMEOUT_S)
            bulk_steps = [len(bulk_ends)]
            calls_seen = n + 1
            window_steps = sum(1 for t in bulk_ends if w0 <= t <= w1)
    finally:
        stop.set()
        gc.unfreeze()
        ex.shutdown(wait=True, cancel_futures=True)
    if [g[0] for g in got] != list(range(n)) or calls_seen != n + 1:
        raise RuntimeError(f"{system.name}: wrong replies ({calls_seen} calls handled)")
    if cgot and [g[0] for g in cgot] != list(range(n)):
        raise RuntimeError(f"{system.name}: wrong control replies")
    if not all(bulk_steps):
        raise RuntimeError(f"{system.name}: a bulk agent never stepped: {bulk_steps}")
    reply = [d - s for d, s in zip(done_at, sent)]
    start = [g[1] - s for g, s in zip(got, sent)]
    result: dict[str, Any] = {"calls": n, "bulk": TIERS_BULK, "bulk_step_ms": TIERS_BULK_STEP_S * 1e3}
    result.update({f"{k}_ms": v for k, v in _ideal.latency_summary(reply).items()})
    result["start_p99_ms"] = _ideal.percentile(start, 99) * 1e3
    if cgot:  # the control tier: handled inside the bulk step running on its worker
        creply = [d - s for d, s in zip(cdone_at, csent)]
        result.update({f"control_{k}_ms": v
                       for k, v in _ideal.latency_summary(creply).items()})
    # Share of the workers' time spent in bulk steps while the calls ran (~1: saturated): the
    # bulk agents' step counts asked before and after (native; each answered at the agent's
    # next turn, so the window is fuzzy by a step) or the bulk tasks that completed in it.
    result["bulk_busy"] = window_steps * TIERS_BULK_STEP_S / (workers * (w1 - w0))
    result["samples_ms"] = downsample([x * 1e3 for x in reply])
    result["ready_s"] = ready
    result["info"] = {"mode": "native" if native else "client-driven",
                      "bulk_steps": sum(bulk_steps)}
    result["ideal"] = ideal_tiers(workers)
    return result


def _bulk_feeder(
    ex: cf.Executor, stop: threading.Event, ends: list[float]
) -> threading.Thread:
    """Start the client-driven bulk agents: TIERS_BULK chains of ``busy(5 ms)`` tasks, each
    resubmitted by a client thread as soon as its previous one completes, until ``stop``."""
    done_q: queue.SimpleQueue[cf.Future[Any]] = queue.SimpleQueue()

    def on_done(f: cf.Future[Any]) -> None:
        ends.append(time.perf_counter())
        done_q.put(f)

    def loop() -> None:
        outstanding = TIERS_BULK
        while outstanding:
            try:
                f = done_q.get(timeout=WAIT_TIMEOUT_S)
            except queue.Empty:
                return
            outstanding -= 1
            if f.exception() is None and not stop.is_set():
                try:
                    ex.submit(_wl.busy, TIERS_BULK_STEP_S).add_done_callback(on_done)
                except RuntimeError:  # shut down
                    continue
                outstanding += 1

    for _ in range(TIERS_BULK):
        ex.submit(_wl.busy, TIERS_BULK_STEP_S).add_done_callback(on_done)
    t = threading.Thread(target=loop, name="bench-bulk-feeder", daemon=True)
    t.start()
    return t


def ideal_tiers(workers: int) -> dict[str, Any]:
    """Reply times under preemption at bulk step boundaries (:func:`stealer.bench.ideal.
    step_boundary_replies`, 10,000 seeded calls); ``bound_ms`` = one bulk step + the call."""
    reply = _ideal.step_boundary_replies(
        TIERS_IDEAL_SAMPLES, TIERS_BULK_STEP_S, TIERS_CALL_S, workers, TIERS_SEED
    )
    out: dict[str, Any] = {f"{k}_ms": v for k, v in _ideal.latency_summary(reply).items()}
    out["bound_ms"] = (TIERS_BULK_STEP_S + TIERS_CALL_S) * 1e3
    for k in ("p50", "p99", "max"):  # a control call runs at once, inside the bulk step
        out[f"control_{k}_ms"] = TIERS_CALL_S * 1e3
    out["bulk_busy"] = 1.0
    out["samples_ms"] = downsample([x * 1e3 for x in reply])
    return out


#: (agents, steps each) of the no-op step part of ``agent_overhead``.
NOOP_AGENT_SIZES = {"full": (20, 5_000), "quick": (20, 500), "tiny": (4, 50)}
PINGPONG_ROUNDS = {"full": 20_000, "quick": 2_000, "tiny": 50}
PLACEMENT_TRIES = 8


def run_agent_overhead(system: System, workers: int, quick: bool | str) -> dict[str, Any]:
    """Scheduler cost of a no-op step on one worker; ping-pong between two agents."""
    _needs_native_agents(system)
    size = _size(quick)
    n, steps = NOOP_AGENT_SIZES[size]
    total = n * steps
    ex, ready = _open(system, 1)
    try:
        spawn = ex.spawn_agent  # type: ignore[attr-defined]
        before = _agent_totals(ex) or {}
        t0 = time.perf_counter()
        refs = [spawn(_wl.NoopAgent, steps) for _ in range(n)]
        values = [r.result(WAIT_TIMEOUT_S) for r in refs]
        wall = time.perf_counter() - t0
        counters = _delta(_settled_totals(ex, "agent_steps", total, before), before)
    finally:
        ex.shutdown(wait=True)
    if values != [steps] * n:
        raise RuntimeError(f"{system.name}: no-op agents returned {values[:4]}..., not {steps}")
    _report(0.5)
    result: dict[str, Any] = {
        "noop_agents": n,
        "noop_steps": steps,
        "step_us": wall / total * 1e6,
        "steps_per_s": total / wall,
        # Time inside the agents' turns (step call and its bookkeeping, checkpoints every 64
        # steps), from the worker's busy_ns counter: the rest of step_us is the worker loop.
        "turn_us": counters["busy_ns"] / counters["agent_steps"] / 1e3
        if counters.get("agent_steps") else None,
        "ready_s": ready,
    }
    result.update(_ping_pong(system, workers, PINGPONG_ROUNDS[size]))
    result["info"]["noop_counted_steps"] = counters.get("agent_steps")
    result["ideal"] = {}
    return result


def _ping_pong(system: System, workers: int, rounds: int) -> dict[str, Any]:
    """Two agents on different workers (when the executor places them so; respawned up to
    PLACEMENT_TRIES times otherwise) bouncing a counter by ``yield other.call("ping", v)``."""
    ex, _ready = _open(system, workers)
    try:
        spawn = ex.spawn_agent  # type: ignore[attr-defined]
        for attempt in range(1, PLACEMENT_TRIES + 1):
            pong = spawn(_wl.PongAgent)
            ping = spawn(_wl.PingAgent, pong, rounds)
            pids = (ping.call("where").result(WAIT_TIMEOUT_S),
                    pong.call("where").result(WAIT_TIMEOUT_S))
            if pids[0] != pids[1] or workers < 2 or attempt == PLACEMENT_TRIES:
                break
            for r in (ping, pong):
                r.stop()
                r.result(WAIT_TIMEOUT_S)
        before = _agent_totals(ex) or {}
        t0 = time.perf_counter()
        ping.send("start")
        value, seconds = ping.result(WAIT_TIMEOUT_S)
        wall = time.perf_counter() - t0
        pong_pid = pong.call("where").result(WAIT_TIMEOUT_S)
        counters = _delta(_agent_totals(ex), before)
        pong.stop()
        pong.result(WAIT_TIMEOUT_S)
    finally:
        ex.shutdown(wait=True)
    if value != rounds:
        raise RuntimeError(f"{system.name}: ping-pong ended at {value}, expected {rounds}")
    return {
        "round_trips": rounds,
        "round_trip_us": seconds / rounds * 1e6,
        "round_trips_per_s": rounds / seconds,
        "same_worker": pids[0] == pids[1],
        "info": {
            "placement_tries": attempt,
            "pong_moved": pong_pid != pids[1],
            "pingpong_wall_s": wall,
            "pingpong_parks": counters.get("parks"),
            "pingpong_wakeups": counters.get("wakeups"),
        },
    }


def run_lockstep(system: System, workers: int, quick: bool | str) -> dict[str, Any]:
    """Agents stepped in lockstep rounds by the client (:func:`stealer.bench.lockstep.run`)."""
    return _lockstep.run(system, workers, _size(quick), _open, _report)


#: (agents, records) of ``agent_scale``: every idle agent holds one record.
SCALE_SIZES = {"full": (1_000_000, 1 << 20), "quick": (20_000, 1 << 15), "tiny": (300, 1 << 12)}
SCALE_PROBES = 100


def _private_bytes(procs: Sequence[Any]) -> list[int]:
    """Each process's resident memory that is not shared (psutil ``rss - shared``: anonymous
    memory; the shared segment's pages are ``shared`` and are counted by its size instead)."""
    out = []
    for p in procs:
        m = p.memory_info()
        out.append(m.rss - getattr(m, "shared", 0))
    return out


def _shm_files(ex: cf.Executor) -> tuple[int | None, int, int]:
    """``(segment size, overflow files, their bytes)`` of the executor in /dev/shm.

    Payloads too big for a record's inline bytes and for the free size-class blocks go to
    overflow files ``<segment>-x<id>`` beside the segment (stealer/shared/arena.py); an agent's spawn
    payload stays while it lives, so they count.  Their bytes are what tmpfs allocated
    (``st_blocks * 512``: a page each at least), not their length."""
    name = getattr(ex, "segment_name", None)
    if not name:
        return None, 0, 0
    try:
        size = os.stat(os.path.join("/dev/shm", name)).st_size
    except OSError:
        return None, 0, 0
    files = used = 0
    prefix = name + "-x"
    with os.scandir("/dev/shm") as it:
        for entry in it:
            if entry.name.startswith(prefix):
                try:
                    used += entry.stat(follow_symlinks=False).st_blocks * 512
                except OSError:  # freed meanwhile
                    continue
                files += 1
    return size, files, used


def run_agent_scale(system: System, workers: int, quick: bool | str) -> dict[str, Any]:
    """Many idle agents in one executor: creation time and memory per agent."""
    _needs_native_agents(system)
    import psutil

    n, records = SCALE_SIZES[_size(quick)]
    ex, ready = _open(system, workers, records=records)
    try:
        pids = [p for p in ex.worker_pids() if p is not None]  # type: ignore[attr-defined]
        procs = [psutil.Process(), *(psutil.Process(p) for p in pids)]
        segment, ov_files0, ov_bytes0 = _shm_files(ex)
        gc.collect()
        mem0 = _private_bytes(procs)
        spawn = ex.spawn_agents  # type: ignore[attr-defined]
        t0 = time.perf_counter()
        refs: Any = spawn(_wl.IdleAgent, itertools.repeat((), n))
        t_spawned = time.perf_counter()
        _report(0.8)
        # Every agent adopted: nothing left on the injector, any deque or inbox, then a call to the
        # last one spawned and to SCALE_PROBES others answers.
        end = time.monotonic() + WAIT_TIMEOUT_S
        while True:
            # (agents=False: the scan of every agent's record, ~30 ms at 2M records, would
            # take a core from the workers being measured at every look)
            st = ex.stats(agents=False)  # type: ignore[attr-defined]
            if st.injector_depth == 0 and not any(w.deque_depth or w.inbox_depth
                                                  for w in st.workers):
                break
            if time.monotonic() > end:
                raise TimeoutError("agents still waiting to be adopted")
            time.sleep(0.005)
        probes = [*refs[:: max(1, n // SCALE_PROBES)], refs[-1]]
        answers = [r.call("ping", k) for k, r in enumerate(probes)]
        ok = [f.result(WAIT_TIMEOUT_S) for f in answers] == list(range(len(probes)))
        t1 = time.perf_counter()
        gc.collect()
        mem1 = _private_bytes(procs)
        _seg, ov_files1, ov_bytes1 = _shm_files(ex)
        live_pids = [p for p in ex.worker_pids() if p is not None]  # type: ignore[attr-defined]
        _report(0.9)
        del refs, probes, answers
    finally:
        t2 = time.perf_counter()
        ex.shutdown(wait=True)  # stops every agent: their final values reach the client
        shutdown_s = time.perf_counter() - t2
    if not ok:
        raise RuntimeError(f"{system.name}: an idle agent did not answer its call")
    if live_pids != pids:
        raise RuntimeError(f"{system.name}: a worker was replaced during the run ({pids} -> "
                           f"{live_pids}); the memory numbers would be wrong")
    client = mem1[0] - mem0[0]
    worker = sum(mem1[1:]) - sum(mem0[1:])
    overflow = ov_bytes1 - ov_bytes0
    seg = (segment or 0) + overflow
    return {
        "agents": n,
        "records": records,
        "create_s": t1 - t0,
        "create_us": (t1 - t0) / n * 1e6,
        "spawn_us": (t_spawned - t0) / n * 1e6,
        "bytes_per_agent": (client + worker + seg) / n,
        "client_bytes_per_agent": client / n,
        "worker_bytes_per_agent": worker / n,
        "segment_bytes_per_agent": seg / n,
        "segment_bytes": segment,
        "overflow_files": ov_files1 - ov_files0,
        "overflow_bytes": overflow,
        "shutdown_s": shutdown_s,
        "ready_s": ready,
        "ideal": {},
    }
