"""The cluster executor beside plain Ray on a 2-node local test cluster (issue 22's targets).

One ``ray.cluster_utils.Cluster`` on this machine: 2 nodes x 1 CPU, dashboard off, fast
health checks (the settings are printed), node k's executor pinned to CPU k.  One run:

1. submit throughput: ``--tasks`` no-op tasks through ``Executor(cluster=True)`` (submit
   all, then every result), against plain Ray tasks (``f.remote`` for each, then one
   ``ray.get``); ``--tasks`` calls to 8 agents (placed over both nodes) against calls to
   one Ray actor per node (``--ray-tasks``), pipelined both;
2. skew: 2,000 tasks of Pareto durations (shape 1.5, mean 2 ms, cap 200 ms, busy-waits):
   makespan and efficiency (sum of work / 2 CPUs / makespan) for the three;
3. fork-join roots: 8 fib(30) trees (cutoff 18, children by stealer.spawn) on both nodes
   against the same on one node (``steal=None``, every tree submitted to one node); and
   one fib(33) tree at a time (the median of 5) submitted to one node of the two (its
   children may be stolen across nodes) against the same on one node alone, and (with
   ``--forkjoin-only``) one UTS tree at a time likewise (UTS_QUICK: 21,201 nodes of
   20 µs, unbalanced); ``--forkjoin-only`` alternates ``--blocks`` blocks of each side
   (fresh executors: two nodes, one node, one node, two nodes...), its one tree fib(N)
   with ``--tree-n N`` (a larger tree weighs the first steal's round trips less);
4. node death: ``--death-tasks`` tasks of 20 ms, the second node removed mid-run; the time
   from the removal to the client's re-placing of that node's tasks, and a check that every
   result came back exactly once;
5. agents between live nodes: 8 agents all started on one node, each call busy 2 ms,
   ``--agent-rounds`` rounds of one call to each (8 outstanding per agent at most): the
   makespan with the rebalancing on (some agents move to the idle node) against the same
   with ``rebalance=None`` (they all stay), and the moves made.

    python benchmarks/cluster.py [--tasks 20000] [--ray-tasks 2000] [--agent-rounds 300]
                                 [--json] [--forkjoin-only] [--skew-only [--reps N]]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import ray
from ray.cluster_utils import Cluster
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

import stealer
from stealer.bench.ideal import pareto_durations
from stealer.bench.workloads import (
    UTS_QUICK,
    UTS_ROOT_SEED,
    busy,
    fib,
    fib_seq,
    noop,
    uts,
    uts_seq,
)

HEALTH = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 200,
          "health_check_failure_threshold": 3, "health_check_timeout_ms": 200}


class Echo(stealer.Agent):
    """A message-only agent: ``echo`` returns its argument."""

    def echo(self, x):
        return x


class BusyCounter(stealer.Agent):
    """An agent whose calls keep its worker busy: ``work(s)`` busy-waits, counts one."""

    def __init__(self):
        self.n = 0

    def work(self, s):
        busy(s)
        self.n += 1
        return self.n


def busy_agents(ex, node: str, rounds: int, seconds: float = 0.002,
                agents: int = 8, window: int = 8) -> tuple[float, int]:
    """``rounds`` rounds of one ``work(seconds)`` call to each of ``agents`` agents started
    on ``node``: (makespan, agents that ended on another node)."""
    refs = [ex.spawn_agent(BusyCounter, node=node) for _ in range(agents)]
    assert [r.call("work", 0.0).result() for r in refs] == [1] * agents
    futs: list[list] = []
    t = time.perf_counter()
    for k in range(rounds):
        futs.append([r.call("work", seconds) for r in refs])
        if k >= window:
            [f.result() for f in futs[k - window]]
    got = [[f.result() for f in fs] for fs in futs]
    dt = time.perf_counter() - t
    assert got == [[k + 2] * agents for k in range(rounds)], "a reply was wrong"
    moved = sum(r.node != node for r in refs)
    for r in refs:
        r.stop()
    return dt, moved


@ray.remote(num_cpus=1)
def ray_noop(x):
    return x


@ray.remote(num_cpus=1)
def ray_busy(s):
    busy(s)
    return s


@ray.remote(num_cpus=1)
class RayWorker:
    def noop(self, x):
        return x

    def busy(self, s):
        busy(s)
        return s


def ray_actors() -> list:
    nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
    actors = [RayWorker.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
        n, soft=False)).remote() for n in nodes]
    ray.get([a.noop.remote(0) for a in actors])
    return actors


def one_tree(ex, node: str, n: int = 33, cutoff: int = 18, repeat: int = 5) -> list[float]:
    """The seconds of ``repeat`` fib(n) trees, one at a time, each submitted to ``node``
    (results checked against fib_seq(n), computed before the first one)."""
    return _tree_times(ex, node, repeat, fib_seq(n), fib, n, cutoff)


def one_uts(ex, node: str, repeat: int = 5) -> list[float]:
    """The seconds of ``repeat`` UTS trees (UTS_QUICK: 21,201 nodes of 20 µs, an
    unbalanced binomial tree whose tasks split their frontier in two), one at a time,
    each submitted to ``node`` (counts checked against the sequential one)."""
    return _tree_times(ex, node, repeat, uts_seq(UTS_ROOT_SEED, 0, UTS_QUICK),
                       uts, UTS_ROOT_SEED, 0, UTS_QUICK)


def _tree_times(ex, node: str, repeat: int, want, fn, *args) -> list[float]:
    """The seconds of ``repeat`` runs of ``fn(*args)`` submitted to ``node`` one at a
    time; every result must be ``want``."""
    times, got = [], []
    for _ in range(repeat):
        t = time.perf_counter()
        got.append(ex.submit_to(node, fn, *args).result())
        times.append(time.perf_counter() - t)
    assert got == [want] * repeat
    return times


def forkjoin_block(two: bool, children: bool, repeat: int, tree_n: int = 33) -> dict:
    """One block of section 3 on a fresh executor: over both nodes (``two``: stealing on;
    ``children``: fork-join children may move between nodes) or on the first node alone
    (``steal=None``).  The seconds of the 8 fib(30) roots, and of ``repeat`` fib(33) trees
    and ``repeat`` UTS trees one at a time, each submitted to the first node."""
    from stealer.cluster.policy import StealConfig

    if two:
        ex = stealer.Executor(cluster=True, seed=1, rebalance=None,
                              steal=StealConfig(children=1 if children else 0))
        node = ex.nodes[0]
        ex.submit(fib, 20, 16).result()
        roots = timed(lambda: [f.result() for f in
                               [ex.submit(fib, 30, 18) for _ in range(8)]])
    else:
        ex, node, roots = roots_on_one_node()
    try:
        out = {"roots": [roots], "fib": one_tree(ex, node, n=tree_n, repeat=repeat),
               "uts": one_uts(ex, node, repeat=repeat)}
        if two:
            out["children"] = {n[:12]: v.get("children") for n, v in ex.stats().nodes.items()}
        return out
    finally:
        ex.shutdown()


def forkjoin_only(out: dict, children: bool = True, blocks: int = 4, repeat: int = 3,
                  tree_n: int = 33) -> None:
    """Section 3 alone, on a fresh cluster (already up): ``blocks`` blocks on two nodes
    and as many on one node, alternated (two, one, one, two, two, one...), so that a
    slower spell of the shared machine weighs on both sides alike (one after the other,
    the speedup of one fib tree read 1.90 in one run and 1.50-1.62 in others).  Each row: the
    median seconds of its runs on each side and their ratio, and the range of the
    ratios of the blocks paired in time (block k on two nodes beside block k on one).
    ``children`` False: no fork-join child moves between nodes (a tree stays on its
    node)."""
    import statistics

    sides: dict[bool, list[dict]] = {True: [], False: []}
    for k in range(blocks):
        for two in ((True, False) if k % 2 == 0 else (False, True)):
            sides[two].append(forkjoin_block(two, children, repeat, tree_n))
    for row, key in (("forkjoin_roots", "roots"), ("forkjoin_one_tree", "fib"),
                     ("forkjoin_one_uts", "uts")):
        def runs(two: bool, key=key) -> list[float]:
            return [t for b in sides[two] for t in b[key]]

        one, two = statistics.median(runs(False)), statistics.median(runs(True))
        paired = [statistics.median(b1[key]) / statistics.median(b2[key])
                  for b1, b2 in zip(sides[False], sides[True])]
        out[row] = {"one_node_s": round(one, 4), "two_nodes_s": round(two, 4),
                    "speedup": round(one / two, 3), "runs_per_side": len(runs(True)),
                    "paired_blocks": f"{min(paired):.2f}-{max(paired):.2f}"}
    out["forkjoin_one_tree"]["children"] = sides[True][-1]["children"]


def skew_runs(ex, work: list[float], reps: int) -> list[dict]:
    """``reps`` runs of the skew workload on ``ex`` (one after the other): each run's
    makespan, efficiency (sum of work / 2 CPUs / makespan) and tasks moved between nodes."""
    ideal = sum(work) / 2
    runs = []
    for _ in range(reps):
        moved0 = ex.stats().moved
        dt = timed(lambda: [f.result() for f in [ex.submit(busy, s) for s in work]])
        runs.append({"makespan_s": round(dt, 3), "efficiency": round(ideal / dt, 3),
                     "moved": ex.stats().moved - moved0})
    return runs


def skew_only(out: dict, reps: int) -> None:
    """Section 2's stealer row alone, ``reps`` times on one executor (after the no-op
    warm-up the full run has before it), with the median efficiency."""
    import statistics

    ex = stealer.Executor(cluster=True, seed=1)
    try:
        ex.submit(noop, 1).result()
        [f.result() for f in [ex.submit(noop, i) for i in range(2000)]]
        runs = skew_runs(ex, pareto_durations(2000, 1.5, 0.002, 0.2, seed=1), reps)
    finally:
        ex.shutdown()
    out["skew_stealer_runs"] = runs
    out["skew_stealer_median_efficiency"] = statistics.median(r["efficiency"] for r in runs)


def first_move(out: dict, trials: int = 3) -> None:
    """The time from the first call of 8 busy agents all started on one node (each call
    busy 2 ms, 8 calls out per agent) to the client's first move of one of them; each trial
    with new agents, after 1 s of quiet (the rule's streaks start again)."""
    ex = stealer.Executor(cluster=True, seed=1)
    node = ex.nodes[0]
    got = []
    try:
        for _ in range(trials):
            time.sleep(1.0)
            refs = [ex.spawn_agent(BusyCounter, node=node) for _ in range(8)]
            [r.call("work", 0.0).result() for r in refs]
            moves0 = ex._stats.agent_moves
            outstanding: list = []
            t0 = time.perf_counter()
            seen = None
            while time.perf_counter() - t0 < 5.0:
                outstanding += [r.call("work", 0.002) for r in refs]
                while len(outstanding) > 64:
                    outstanding.pop(0).result()
                if seen is None and ex._stats.agent_moves > moves0:
                    seen = time.perf_counter() - t0
                    break
            [f.result() for f in outstanding]
            got.append(seen)
            for r in refs:
                r.stop()
    finally:
        ex.shutdown()
    out["first_move_s"] = got


def roots_on_one_node():
    """A cluster executor that neither steals nor moves agents, and the seconds 8 fib(30)
    roots take on its first node alone (after one warm-up tree): ``(ex, node, seconds)``;
    the caller shuts it down."""
    ex = stealer.Executor(cluster=True, steal=None, rebalance=None)
    node = ex.nodes[0]
    ex.submit_to(node, fib, 20, 16).result()
    one = timed(lambda: [f.result() for f in
                         [ex.submit_to(node, fib, 30, 18) for _ in range(8)]])
    return ex, node, one


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tasks", type=int, default=20000)
    ap.add_argument("--ray-tasks", type=int, default=2000)
    ap.add_argument("--death-tasks", type=int, default=200)
    ap.add_argument("--agent-rounds", type=int, default=300)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--first-move", action="store_true",
                    help="only the time from 8 busy agents' first calls on one node to "
                         "the first move of one to the idle node (3 trials)")
    ap.add_argument("--no-children", action="store_true",
                    help="with --forkjoin-only: no fork-join child moves between nodes")
    ap.add_argument("--skew-only", action="store_true",
                    help="only the stealer's skew row (2,000 Pareto tasks), --reps times")
    ap.add_argument("--reps", type=int, default=5, help="runs of --skew-only")
    ap.add_argument("--forkjoin-only", action="store_true",
                    help="only the fork-join rows (8 trees over two nodes, one tree "
                         "started on one node), each beside one node alone")
    ap.add_argument("--tree-n", type=int, default=33,
                    help="with --forkjoin-only: the one tree is fib(N) (cutoff 18); 33 "
                         "takes about 0.4 s on one node, 35 about 1.2 s")
    ap.add_argument("--blocks", type=int, default=4,
                    help="with --forkjoin-only: alternated blocks per side (3 trees "
                         "of each kind a block)")
    a = ap.parse_args()
    env = lambda k: {"STEALER_NODE_CPUS": str(k)}  # noqa: E731
    c = Cluster(initialize_head=True, connect=True, head_node_args={
        "num_cpus": 1, "include_dashboard": False, "_system_config": HEALTH,
        "env_vars": env(0)})
    out: dict = {"health_checks": HEALTH}
    try:
        second = c.add_node(num_cpus=1, env_vars=env(1))
        c.wait_for_nodes()
        if a.first_move:
            first_move(out)
            for k, v in out.items():
                print(f"{k}: {v}")
            return
        if a.skew_only:
            skew_only(out, a.reps)
            for k, v in out.items():
                print(f"{k}: {v}")
            return
        if a.forkjoin_only:
            forkjoin_only(out, not a.no_children, a.blocks, tree_n=a.tree_n)
            for k, v in out.items():
                print(f"{k}: {v}")
            return
        work = pareto_durations(2000, 1.5, 0.002, 0.2, seed=1)
        ideal = sum(work) / 2

        # -- plain Ray first (stealer's node agents take every CPU while they live)
        n = a.ray_tasks
        ray.get([ray_noop.remote(i) for i in range(100)])  # warm the worker pool
        dt = timed(lambda: ray.get([ray_noop.remote(i) for i in range(n)]))
        out["ray_tasks_per_s"] = n / dt
        dt = timed(lambda: ray.get([ray_busy.remote(s) for s in work]))
        out["skew_ray_tasks"] = {"makespan_s": dt, "efficiency": ideal / dt}
        actors = ray_actors()  # (they hold the CPUs: after the tasks)
        dt = timed(lambda: ray.get([actors[i % 2].noop.remote(i) for i in range(n)]))
        out["ray_actor_calls_per_s"] = n / dt
        dt = timed(lambda: ray.get([actors[i % 2].busy.remote(s) for i, s in enumerate(work)]))
        out["skew_ray_actors"] = {"makespan_s": dt, "efficiency": ideal / dt}
        for x in actors:
            ray.kill(x)
        time.sleep(1.0)

        # -- stealer
        ex = stealer.Executor(cluster=True, seed=1)
        ex.submit(noop, 1).result()
        fs = []
        t = time.perf_counter()
        fs = [ex.submit(noop, i) for i in range(a.tasks)]
        submit_s = time.perf_counter() - t
        assert [f.result() for f in fs] == list(range(a.tasks))
        dt = time.perf_counter() - t
        out["stealer_tasks_per_s"] = a.tasks / dt
        out["stealer_submit_us_per_task"] = submit_s / a.tasks * 1e6
        t = time.perf_counter()
        assert len(list(ex.map(noop, range(a.tasks), chunksize=64))) == a.tasks
        out["stealer_map_chunk64_per_s"] = a.tasks / (time.perf_counter() - t)
        (out["skew_stealer"],) = skew_runs(ex, work, 1)
        refs = [ex.spawn_agent(Echo) for _ in range(8)]
        assert [r.call("echo", i).result() for i, r in enumerate(refs)] == list(range(8))
        on = {r.node for r in refs}
        dt = timed(lambda: [f.result() for f in [refs[i % 8].call("echo", i)
                                                 for i in range(a.tasks)]])
        out["stealer_agent_calls_per_s"] = a.tasks / dt
        out["stealer_agent_nodes"] = len(on)
        for r in refs:
            r.stop()
        ex.submit(fib, 20, 16).result()
        two = timed(lambda: [f.result() for f in [ex.submit(fib, 30, 18) for _ in range(8)]])
        moving, moved = busy_agents(ex, ex.nodes[0], a.agent_rounds)
        st = ex.stats()
        ex.shutdown()
        ex1, one_node, one = roots_on_one_node()
        staying, stayed_moved = busy_agents(ex1, one_node, a.agent_rounds)
        ex1.shutdown()
        out["forkjoin_roots"] = {"one_node_s": one, "two_nodes_s": two, "speedup": one / two}
        out["busy_agents_on_one_node"] = {
            "rounds": a.agent_rounds, "work_s": a.agent_rounds * 8 * 0.002,
            "rebalanced_s": moving, "agents_moved": moved, "moves": st.agent_moves,
            "move_ms": st.move_s * 1e3, "without_rebalancing_s": staying,
            "moved_without": stayed_moved, "speedup": staying / moving}

        # -- a node dies mid-run
        ex = stealer.Executor(cluster=True, seed=2)
        head = ray.get_runtime_context().get_node_id()
        fs = [ex.submit(busy, 0.02) for _ in range(a.death_tasks)]
        time.sleep(0.8)
        t_remove = time.time()
        c.remove_node(second)
        t_removed = time.time()
        [f.result(timeout=120) for f in fs]
        t_done = time.time()
        st = ex.stats()
        (loss,) = st.losses
        out["node_death"] = {
            "remove_node_s": t_removed - t_remove,
            "detected_after_removal_began_s": loss["at"] - t_remove,
            "replace_s": loss["replace_s"], "tasks_replaced": loss["replaced"],
            "why": loss["why"], "all_done_after_removal_s": t_done - t_remove,
            "results": len(fs), "duplicates_dropped": st.duplicates,
            "nodes_left": [n == head for n in ex.nodes]}
        ex.shutdown()
    except BaseException:  # (printed before Ray goes: an executor left running may abort)
        import traceback

        traceback.print_exc()
        raise
    finally:
        ray.shutdown()
        c.shutdown()
    out["submit_ratio_vs_ray_tasks"] = out["stealer_tasks_per_s"] / out["ray_tasks_per_s"]
    out["agent_call_ratio_vs_ray_actors"] = (out["stealer_agent_calls_per_s"]
                                             / out["ray_actor_calls_per_s"])
    if a.json:
        json.dump(out, sys.stdout, indent=1)
        print()
        return
    for k, v in out.items():
        print(f"{k}: {v}")
    print(f"(one run, {os.cpu_count()} CPUs, Ray {ray.__version__})")


if __name__ == "__main__":
    main()
