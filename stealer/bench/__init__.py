"""Yardstick benchmarks of DESIGN.md section 7: workloads, the ideal simulation, the runner.

- :mod:`stealer.bench.workloads` -- module-level task functions (busy-wait CPU work, no-op,
  fork-join fib and a UTS-like binomial tree), importable by reference in worker processes.
- :mod:`stealer.bench.ideal` -- seeded trace generators (Poisson arrivals, capped Pareto
  durations), percentiles, and the zero-overhead greedy FIFO simulation every result is
  reported next to.
- :mod:`stealer.bench.runner` -- runs each workload on each executor ("system") side by side
  and prints a table; ``python benchmarks/run.py --quick``.

Nothing here is imported by ``stealer`` itself; importing this package does not import the
executor.
"""
