"""What ``stealer bench`` reports: the medians of repeated runs (:func:`_median_dicts`), the
rows each workload shows and the aligned table (:func:`format_table`), and the JSON document
(:func:`_for_json`, :func:`_meta`, :func:`dumps_compact`), and what a run prints and writes
(:func:`print_summary`, :func:`write_json`).  Called by :mod:`stealer.bench.cli`;
:mod:`stealer.tune` uses the medians, ``_strip_samples`` and ``dumps_compact`` too.

The table has a row per metric of :data:`_ROWS` and a column per system, then the ideal
and ``ratio`` = first system / second system (stealer / process by default); a cell with
no value is ``—``.  The JSON keeps samples only in the medians and the ideal, not per run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

from stealer.bench import lockstep as _lockstep

__all__ = ["format_table", "dumps_compact", "print_summary", "write_json"]


def _median_dicts(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Key-wise median of numeric leaves across runs (nested dicts too); others from run 0."""
    out: dict[str, Any] = {}
    for key, first in runs[0].items():
        values = [r.get(key) for r in runs]
        if isinstance(first, dict):
            out[key] = _median_dicts([v for v in values if isinstance(v, dict)])
        elif isinstance(first, (int, float)) and not isinstance(first, bool):
            nums = [v for v in values if isinstance(v, (int, float))]
            out[key] = statistics.median(nums)
        else:
            out[key] = first
    return out


# What the table shows per workload: (key, label, format).
_ROWS: dict[str, list[tuple[str, str, str]]] = {
    "start": [("ready_s", "ready (s)", ".3f"), ("shutdown_s", "shutdown (s)", ".3f")],
    "overhead": [
        ("submit_us", "submit µs/task", ".1f"),
        ("submit_tasks_per_s", "submit tasks/s", ",.0f"),
        ("submit_call_us", "submit() call µs", ".1f"),
        ("map_us", "map µs/task", ".1f"),
        ("map_chunked_us", "map(chunk=64) µs/task", ".2f"),
    ],
    "latency": [
        ("p50_ms", "p50 ms", ".2f"),
        ("p90_ms", "p90 ms", ".2f"),
        ("p99_ms", "p99 ms", ".2f"),
        ("p99_9_ms", "p99.9 ms", ".2f"),
        ("max_ms", "max ms", ".2f"),
        ("start_p99_ms", "arrival→start p99 ms", ".2f"),
        ("client_lag_max_ms", "client lag max ms", ".2f"),
        ("gc0_per_100k", "client GC gen0 /100k tasks", ",.0f"),
        ("gc1_per_100k", "client GC gen1 /100k tasks", ",.0f"),
        ("gc2_per_100k", "client GC gen2 /100k tasks", ",.0f"),
        ("large_p99_ms", "large heap: p99 ms", ".2f"),
        ("large_p99_9_ms", "large heap: p99.9 ms", ".2f"),
        ("large_gc2_per_100k", "large heap: GC gen2 /100k", ",.0f"),
        ("frozen_p99_ms", "frozen heap: p99 ms", ".2f"),
        ("frozen_p99_9_ms", "frozen heap: p99.9 ms", ".2f"),
    ],
    "skew": [
        ("makespan_s", "makespan s", ".3f"),
        ("efficiency", "efficiency", ".3f"),
    ],
    "forkjoin": [
        ("fib_speedup", "fib speedup", ".2f"),
        ("fib_s", "fib s", ".3f"),
        ("uts_speedup", "uts speedup", ".2f"),
        ("uts_s", "uts s", ".3f"),
    ],
    "agents": [
        ("makespan_s", "makespan s", ".3f"),
        ("efficiency", "efficiency", ".3f"),
        ("step_p50_ms", "step p50 ms", ".1f"),
        ("step_p99_ms", "step p99 ms", ".1f"),
        ("step_p99_later_ms", "p99 without 1st steps", ".1f"),
    ],
    "tiers": [
        ("p50_ms", "reply p50 ms", ".2f"),
        ("p99_ms", "reply p99 ms", ".2f"),
        ("max_ms", "reply max ms", ".2f"),
        ("control_p50_ms", "control reply p50 ms", ".2f"),
        ("control_p99_ms", "control reply p99 ms", ".2f"),
        ("control_max_ms", "control reply max ms", ".2f"),
        ("bulk_busy", "bulk busy share", ".2f"),
    ],
    "agent_overhead": [
        ("step_us", "no-op step µs (1 worker)", ".2f"),
        ("turn_us", "of which in the turn µs", ".2f"),
        ("round_trip_us", "ping-pong µs/round trip", ".1f"),
        ("round_trips_per_s", "round trips/s", ",.0f"),
    ],
    "lockstep": _lockstep.table_rows(),
    "agent_scale": [
        ("agents", "idle agents", ",.0f"),
        ("create_s", "create s", ".2f"),
        ("create_us", "create µs/agent", ".1f"),
        ("spawn_us", "  spawn µs/agent", ".2f"),
        ("bytes_per_agent", "bytes/agent", ",.0f"),
        ("worker_bytes_per_agent", "  workers' heap", ",.0f"),
        ("client_bytes_per_agent", "  client (refs)", ",.0f"),
        ("segment_bytes_per_agent", "  shared memory", ",.0f"),
        ("overflow_files", "  overflow files", ",.0f"),
        ("shutdown_s", "shutdown s", ".2f"),
    ],
    "user": [
        ("tasks_per_s", "tasks/s", ",.0f"),
        ("p50_ms", "p50 ms", ".2f"),
        ("p90_ms", "p90 ms", ".2f"),
        ("p99_ms", "p99 ms", ".2f"),
        ("p99_9_ms", "p99.9 ms", ".2f"),
        ("max_ms", "max ms", ".2f"),
        ("wall_s", "wall s", ".3f"),
    ],
}


def _fmt(value: Any, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    return format(value, spec)


def format_table(results: dict[str, dict[str, Any]], system_names: Sequence[str]) -> str:
    """Aligned plain-text table of median results.

    ``results[workload]["systems"][name]`` holds each system's median dict and
    ``results[workload]["ideal"]`` the ideal.  ``ratio`` is first system / second system.
    """
    header = ["workload", "metric", *system_names, "ideal"]
    ratio_label = (
        f"ratio {system_names[0]}/{system_names[1]}" if len(system_names) >= 2 else "ratio"
    )
    header.append(ratio_label)
    rows: list[list[str]] = []
    for workload, res in results.items():
        per_system = res.get("systems", {})
        ideal = res.get("ideal", {})
        for key, label, spec in _ROWS.get(workload, []):
            vals = [per_system.get(name, {}).get(key) for name in system_names]
            if key.startswith("frozen_") and all(v is None for v in vals):
                continue  # the frozen-heap latency runs only with --frozen-latency
            row = [workload, label, *(_fmt(v, spec) for v in vals), _fmt(ideal.get(key), spec)]
            ratio = None
            if len(vals) >= 2 and isinstance(vals[0], (int, float)) and vals[1]:
                ratio = vals[0] / vals[1]
            row.append(_fmt(ratio, ".2f"))
            rows.append(row)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        first = [c.ljust(w) for c, w in zip(cells[:2], widths[:2])]
        rest = [c.rjust(w) for c, w in zip(cells[2:], widths[2:])]
        return "  ".join(first + rest).rstrip()

    out = [line(header), line(["-" * w for w in widths])]
    out.extend(line(r) for r in rows)
    return "\n".join(out)


def _strip_samples(value: Any) -> Any:
    """``value`` without its ``samples_ms`` entries (for the per-run copies in the JSON)."""
    if isinstance(value, dict):
        return {k: _strip_samples(v) for k, v in value.items() if k != "samples_ms"}
    if isinstance(value, list):
        return [_strip_samples(v) for v in value]
    return value


def _for_json(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Results as written to JSON: samples only in the medians and the ideal, not per run."""
    out: dict[str, dict[str, Any]] = {}
    for workload, res in results.items():
        entry = dict(res)
        entry["runs"] = _strip_samples(res.get("runs", {}))
        out[workload] = entry
    return out


_NUMBER_LIST = re.compile(r"\[\s*([-+0-9.eE,\s]*?)\s*\]")


def dumps_compact(doc: Any) -> str:
    """``json.dumps(doc, indent=1)`` with every list of plain numbers on one line."""
    text = json.dumps(doc, indent=1)
    return _NUMBER_LIST.sub(lambda m: "[" + "".join(m.group(1).split()) + "]", text)


def _meta(
    args: argparse.Namespace,
    skipped: dict[str, str],
    errors: dict[str, dict[str, str]],
    not_installed: Sequence[str],
    not_applicable: dict[str, dict[str, str]] | None = None,
) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "workers": args.workers,
        "size": args.size,
        "quick": args.size == "quick",
        "repeat": args.repeat,
        "workloads": args.workloads,
        "systems": args.systems,
        "skipped": skipped,
        "errors": errors,
        "not_applicable": not_applicable or {},
        "not_installed": list(not_installed),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    if args.user is not None:
        meta["user_workload"] = {
            "call": args.user.describe(limit=1000),
            "tasks": args.user.tasks,
            "inflight": args.user.inflight,
        }
    return meta



def _by_message(failed: dict[str, str]) -> dict[str, list[str]]:
    """``{workload: message}`` regrouped as ``{message: [workloads]}`` (one note per reason)."""
    by_msg: dict[str, list[str]] = {}
    for workload, msg in failed.items():
        by_msg.setdefault(msg, []).append(workload)
    return by_msg


def print_summary(
    args: argparse.Namespace,
    results: dict[str, dict[str, Any]],
    names: Sequence[str],
    skipped: dict[str, str],
    errors: dict[str, dict[str, str]],
    not_applicable: dict[str, dict[str, str]],
) -> None:
    """What a run prints on stdout: the run's settings, the user workload (if any), the table
    and a note per skipped system, n/a workload, failure and peer not installed."""
    print(
        f"workers={args.workers} size={args.size} repeat={args.repeat} "
        f"python={sys.version.split()[0]} cpus={os.cpu_count()}"
    )
    user = args.user
    if user is not None:
        print(f"user workload: {user.describe()} x {user.tasks:,}, inflight="
              f"{user.inflight or 'all'}, {user.task_s * 1e3:.3f} ms per call here")
    print(format_table(results, names))
    for name, reason in skipped.items():
        print(f"({name}: skipped — {reason})")
    for name, na in not_applicable.items():
        for msg, workloads in _by_message(na).items():
            print(f"({name}: {', '.join(workloads)} n/a — {msg})")
    for name, failed in errors.items():
        for msg, workloads in _by_message(failed).items():
            print(f"({name}: {', '.join(workloads)} skipped — failed: {msg})")
    if args.not_installed:
        print(f"(not installed: {', '.join(args.not_installed)})")


def write_json(
    json_path: str,
    args: argparse.Namespace,
    results: dict[str, dict[str, Any]],
    skipped: dict[str, str],
    errors: dict[str, dict[str, str]],
    not_applicable: dict[str, dict[str, str]],
) -> str:
    """Write the run's JSON document (``meta`` and ``results``) to ``json_path``, making its
    directory; returns the path."""
    os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
    doc = {
        "meta": _meta(args, skipped, errors, args.not_installed, not_applicable),
        "results": _for_json(results),
    }
    with open(json_path, "w", encoding="utf-8") as fh:
        fh.write(dumps_compact(doc))
        fh.write("\n")
    return json_path
