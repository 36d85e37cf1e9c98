"""pytest-benchmark entries for the yardstick workloads, each executor side by side.

Every (workload, system) pair is one benchmark, run once at the ``--quick`` size with
``benchmark.pedantic(rounds=1, iterations=1)``; the timing pytest-benchmark records is the
whole workload, and the metrics that matter (µs per task, latency percentiles, efficiency,
speedup, and the ideal of the same trace) are stored in ``benchmark.extra_info`` so they land
in ``--benchmark-json`` output (the latency samples kept for the CDF plots are left out).  A
system that is not available (``stealer`` when it does not import; loky, mpire, dask and ray
when not installed) is skipped with the reason, and so is a stealer-only agent workload
(``agent_overhead``, ``agent_scale``) on a plain pool.

    pytest benchmarks/ --benchmark-enable [--benchmark-json out.json]

For the full-size table and the plots use ``stealer bench`` (or ``python benchmarks/run.py``)
instead.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from stealer.bench.cli import WORKLOADS
from stealer.bench.report import _strip_samples
from stealer.bench.systems import NotApplicable, load_systems

WORKERS = 2
SYSTEMS = ("stealer", "process", "loky", "mpire", "dask", "ray")


def _system(name: str) -> Any:
    systems, skipped = load_systems([name])
    if not systems:
        pytest.skip(f"{name}: {skipped[name]}")
    return systems[0]


def _flatten(prefix: str, value: Any, out: dict[str, Any]) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _flatten(f"{prefix}.{k}" if prefix else k, v, out)
    else:
        out[prefix] = value


@pytest.mark.parametrize("system_name", SYSTEMS)
@pytest.mark.parametrize("workload", list(WORKLOADS))
def test_workload(benchmark: Any, workload: str, system_name: str) -> None:
    system = _system(system_name)
    benchmark.group = workload
    try:
        result = benchmark.pedantic(
            WORKLOADS[workload], args=(system, WORKERS, True), rounds=1, iterations=1
        )
    except NotApplicable as exc:  # agent_overhead, agent_scale on a plain pool
        pytest.skip(f"{workload} on {system_name}: {exc}")
    flat: dict[str, Any] = {}
    _flatten("", _strip_samples(result), flat)
    benchmark.extra_info.update(flat)
    benchmark.extra_info["system"] = system.name
    benchmark.extra_info["workers"] = WORKERS
    json.dumps(benchmark.extra_info)  # plain JSON-able numbers only
