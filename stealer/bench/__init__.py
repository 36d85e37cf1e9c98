"""Yardstick benchmarks (README: Benchmarks): workloads, the ideal simulation, the command.

- :mod:`stealer.bench.workloads` -- module-level task functions (busy-wait CPU work, no-op,
  fork-join fib and a UTS-like binomial tree), importable by reference in worker processes.
- :mod:`stealer.bench.ideal` -- seeded trace generators (Poisson arrivals, capped Pareto
  durations), percentiles, and the zero-overhead greedy FIFO simulation every result is
  reported next to.
- :mod:`stealer.bench.cli` -- ``stealer bench``: runs each workload on each executor
  ("system") side by side and prints a table; ``python benchmarks/run.py --quick``.  The
  workloads are in :mod:`~stealer.bench.wl_tasks` (start, overhead, latency, skew),
  :mod:`~stealer.bench.wl_forkjoin`, :mod:`~stealer.bench.wl_agents` (agents, tiers,
  agent_overhead, lockstep, agent_scale) and :mod:`~stealer.bench.wl_user` (``--workload``),
  on what :mod:`~stealer.bench.harness` shares; the systems in :mod:`~stealer.bench.systems`
  (peers: :mod:`~stealer.bench.peers`); the table and JSON in :mod:`~stealer.bench.report`,
  the PNG plots in :mod:`~stealer.bench.plots`, the progress bar in
  :mod:`~stealer.bench.progress`.
- :mod:`stealer.bench.lockstep` -- the lockstep agents (also benchmarks/lockstep.py).
- :mod:`stealer.bench.teardown` -- closing an executor chaos left broken
  (benchmarks/chaos.py, the kill tests).

Called by ``stealer bench`` (stealer/cli.py), ``stealer tune`` (stealer/tune.py),
benchmarks/ and tests/.  Nothing here is imported by ``stealer`` itself; importing this
package does not import the executor.
"""
