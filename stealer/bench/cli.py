"""``stealer bench``: the workload registry (:data:`WORKLOADS`, :data:`DEFAULT_WORKLOADS`),
argument parsing and :func:`main`, which runs every (workload, system) pair and hands the
results to :mod:`stealer.bench.report` and :mod:`stealer.bench.plots`.  Called by
:mod:`stealer.cli` (``stealer bench ...``) and benchmarks/run.py; benchmarks/test_bench.py
runs :data:`WORKLOADS` one by one.

All workloads but ``agent_scale`` and ``lockstep`` together finish in seconds on 2 cores at
``--quick``; the default run leaves those two out.  ``main(argv)`` prints an aligned table
(workload, metric, one column per system, ideal, ratio = first system / second system, i.e.
stealer / process by default), writes JSON (``--json``, default ``bench-out/bench.json``)
and PNG plots (``--plots DIR``, see :mod:`stealer.bench.plots`).  With ``--repeat N`` each
(workload, system) runs N times, systems interleaved, and the table shows medians.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from stealer.bench.harness import _progress_to
from stealer.bench.progress import Progress
from stealer.bench.report import _median_dicts, print_summary, write_json
from stealer.bench.systems import _LOADERS, NotApplicable, System, auto_systems, load_systems
from stealer.bench.wl_agents import (
    run_agent_overhead,
    run_agent_scale,
    run_agents,
    run_lockstep,
    run_tiers,
)
from stealer.bench.wl_forkjoin import run_forkjoin
from stealer.bench.wl_tasks import LATENCY_HEAPS, run_latency, run_overhead, run_skew, run_start
from stealer.bench.wl_user import (
    USER_TASKS,
    UserWorkload,
    _json_value,
    calibrate,
    resolve_function,
    run_user,
)

__all__ = ["WORKLOADS", "DEFAULT_WORKLOADS", "main"]


WORKLOADS: dict[str, Callable[[System, int, bool | str], dict[str, Any]]] = {
    "start": run_start,
    "overhead": run_overhead,
    "latency": run_latency,
    "skew": run_skew,
    "forkjoin": run_forkjoin,
    "agents": run_agents,
    "tiers": run_tiers,
    "agent_overhead": run_agent_overhead,
    "lockstep": run_lockstep,
    "agent_scale": run_agent_scale,
}

#: What runs when ``--workloads`` is not given: all but ``agent_scale`` (a million agents:
#: a minute and several GiB) and ``lockstep`` (10-20 s even at --quick: 256 agents and 256
#: pipe processes); run them by name.
DEFAULT_WORKLOADS = tuple(w for w in WORKLOADS if w not in ("agent_scale", "lockstep"))


_EPILOG = """\
your own workload:
  --workload MODULE:FUNCTION runs FUNCTION(*ARGS, **KWARGS) --tasks times through every
  system (the built-in workloads are then left out unless --workloads names them), e.g.

      stealer bench --workload stealer.bench.workloads:busy --args '[0.001]' --tasks 2000

  The function must be importable by the worker processes (a module on sys.path; the current
  directory is tried too).  --args is a JSON list, --kwargs a JSON object.  All tasks are
  submitted at once, or at most --inflight at a time (the next submitted as one completes).
  Reported: throughput (tasks / (last done - first submit)) and the latency percentiles of
  each task from submit to done.  The ideal assumes every task takes as long as one call of
  the function in this process (timed a few times before the runs).

output:
  The table goes to stdout; --json PATH (default bench-out/bench.json) gets every number and
  run, with latency distributions downsampled to <= 2,000 points; PNG plots (latency
  percentiles and CDF per system, efficiency and speedup bars, overhead) go to --plots DIR
  (default: the directory of --json, or bench-out/).  A progress bar is drawn on stderr when
  it is a terminal (--progress forces it).

peers:
  --systems auto (default) runs stealer, ProcessPoolExecutor ('process') and each installed
  peer of loky, mpire, dask (distributed.LocalCluster, 1 thread per worker process) and ray.
  A system that fails is reported and the run goes on.
"""


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="stealer bench",
        description="Yardstick workloads side by side with peers and the ideal.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--workloads",
        default=None,
        help=f"comma-separated subset of {','.join(WORKLOADS)} (default: all but agent_scale "
        "and lockstep, "
        "or none when --workload is given)",
    )
    p.add_argument(
        "--systems",
        default="auto",
        help=f"comma-separated executors to compare, of {','.join(_LOADERS)}, or 'auto' "
        "(stealer, process and the installed peers); the ratio column is first/second "
        "(default: auto)",
    )
    p.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    p.add_argument("--quick", action="store_true", help="small sizes (seconds per system)")
    p.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # tests
    p.add_argument("--repeat", type=int, default=1, help="runs per workload; medians shown")
    p.add_argument("--json", metavar="PATH", help="write all results and runs as JSON here")
    p.add_argument("--plots", metavar="DIR", help="write PNG plots here")
    p.add_argument("--no-plots", action="store_true", help="do not draw plots")
    p.add_argument("--frozen-latency", action="store_true",
                   help="latency also with the client heap frozen (gc.freeze) first")
    p.add_argument(
        "--progress", action=argparse.BooleanOptionalAction, default=None,
        help="progress bar on stderr (default: when stderr is a terminal)",
    )
    g = p.add_argument_group("your own workload (see below)")
    g.add_argument("--workload", metavar="MODULE:FUNCTION", help="a function to benchmark")
    g.add_argument("--args", default="[]", metavar="JSON", help="its arguments (a JSON list)")
    g.add_argument("--kwargs", default="{}", metavar="JSON", help="its keyword arguments")
    g.add_argument(
        "--tasks", type=int, default=None,
        help=f"calls per system (default {USER_TASKS['full']}, --quick {USER_TASKS['quick']})",
    )
    g.add_argument(
        "--inflight", type=int, default=0, metavar="K",
        help="keep at most K tasks outstanding (default 0: submit all at once)",
    )
    args = p.parse_args(argv)
    args.size = "tiny" if args.tiny else "quick" if args.quick else "full"
    if args.workloads is None:
        args.workloads = [] if args.workload else list(DEFAULT_WORKLOADS)
    else:
        args.workloads = [w for w in args.workloads.split(",") if w]
    unknown = [w for w in args.workloads if w not in WORKLOADS]
    if unknown:
        p.error(f"unknown workload(s): {', '.join(unknown)}")
    args.systems = [s for s in args.systems.split(",") if s]
    args.not_installed = []
    if args.systems == ["auto"]:
        args.systems, args.not_installed = auto_systems()
    if args.workers < 1 or args.repeat < 1:
        p.error("--workers and --repeat must be >= 1")
    args.user = None
    if args.workload:
        tasks = USER_TASKS[args.size] if args.tasks is None else args.tasks
        if tasks < 1 or args.inflight < 0:
            p.error("--tasks must be >= 1 and --inflight >= 0")
        try:
            fn = resolve_function(args.workload)
            fargs = _json_value(args.args, "--args", list)
            fkwargs = _json_value(args.kwargs, "--kwargs", dict)
        except ValueError as exc:
            p.error(str(exc))
        args.user = UserWorkload(
            args.workload, fn, tuple(fargs), fkwargs, tasks=tasks, inflight=args.inflight
        )
        args.workloads.append("user")
    if not args.workloads:
        p.error("nothing to run")
    return args


PLOTS_HINT = "pip install 'stealer[plots]'"


def _load_plots() -> Any:
    """:mod:`stealer.bench.plots`; ImportError when matplotlib does not import."""
    return importlib.import_module("stealer.bench.plots")


def _output_paths(args: argparse.Namespace) -> tuple[str, str]:
    """``(json path, plots directory)`` from ``--json`` and ``--plots``."""
    if args.json:
        return args.json, args.plots or os.path.dirname(os.path.abspath(args.json))
    plots_dir = args.plots or "bench-out"
    return os.path.join(plots_dir, "bench.json"), plots_dir


#: ``{system name: {workload: message}}``: the failures and the n/a workloads of a run.
Outcomes = dict[str, dict[str, str]]


def _plots_import_ok() -> bool:
    """Whether the plots import; prints how to get them when not (asked for with ``--plots``:
    said before spending minutes on the run)."""
    try:
        _load_plots()
    except ImportError as exc:
        print(f"error: --plots needs matplotlib, which does not import here ({exc}). "
              f"Install it with: {PLOTS_HINT} (or run without --plots)", file=sys.stderr)
        return False
    return True


def _calibrated(user: UserWorkload) -> UserWorkload:
    """``user`` with ``task_s``: one call timed in this process (raises what the call raises)."""
    return UserWorkload(
        user.target, user.fn, user.args, user.kwargs, user.tasks, user.inflight,
        task_s=calibrate(user),
    )


def _workload_fn(
    name: str, user: UserWorkload | None
) -> Callable[[System, int, bool | str], dict[str, Any]]:
    """The run function of workload ``name`` (``"user"``: :func:`run_user` of ``user``)."""
    if name == "user":
        assert user is not None
        return lambda system, workers, _size: run_user(system, workers, user)
    return WORKLOADS[name]


def _run_once(
    args: argparse.Namespace,
    bar: Progress,
    workload: str,
    system: System,
    r: int,
    errors: Outcomes,
    not_applicable: Outcomes,
) -> dict[str, Any] | None:
    """Run ``r`` of ``workload`` on ``system``: its result, or None when it is left out (the
    system failed it or it does not apply, recorded in ``errors`` / ``not_applicable``)."""
    step = f"{workload}/{system.name}"
    if args.repeat > 1:
        step += f" run {r + 1}/{args.repeat}"
    if workload in errors.get(system.name, {}) or workload in (
        not_applicable.get(system.name, {})
    ):
        bar.update()
        return None
    bar.set_detail(step)

    def hook(frac: float) -> None:
        bar.set_detail(f"{step} {frac:.0%}")

    t0 = time.perf_counter()
    try:
        with _progress_to(hook):
            res = _workload_fn(workload, args.user)(system, args.workers, args.size)
    except NotApplicable as exc:
        not_applicable.setdefault(system.name, {})[workload] = str(exc)
        bar.set_detail(step)
        bar.update()
        return None
    except Exception as exc:
        msg = f"{type(exc).__name__}: {exc}"
        errors.setdefault(system.name, {})[workload] = msg
        bar.set_detail(step)
        bar.update()
        bar.write(f"  {workload:<9} {system.name:<8} FAILED: {msg}")
        return None
    bar.set_detail(step)
    bar.update()
    bar.write(
        f"  {workload:<9} {system.name:<8} run {r + 1}/{args.repeat}"
        f" {time.perf_counter() - t0:6.2f} s"
    )
    return res


def _run_all(
    args: argparse.Namespace, systems: Sequence[System]
) -> tuple[dict[str, dict[str, Any]], Outcomes, Outcomes]:
    """Every workload on every system, ``--repeat`` times with the systems' order rotated
    each run, under one progress bar: ``(results, errors, not_applicable)``, where
    ``results[workload]`` holds each system's medians, the ideal and every run."""
    results: dict[str, dict[str, Any]] = {}
    errors: Outcomes = {}
    not_applicable: Outcomes = {}
    steps = len(args.workloads) * len(systems) * args.repeat
    bar = Progress(steps, label="bench", enabled=args.progress)
    with bar:
        for workload in args.workloads:
            runs: dict[str, list[dict[str, Any]]] = {s.name: [] for s in systems}
            for r in range(args.repeat):
                order = [*systems[r % len(systems) :], *systems[: r % len(systems)]]
                for system in order:
                    res = _run_once(args, bar, workload, system, r, errors, not_applicable)
                    if res is not None:
                        runs[system.name].append(res)
            medians = {name: _median_dicts(rs) for name, rs in runs.items() if rs}
            ideal = next(iter(medians.values()), {}).get("ideal", {})
            results[workload] = {"systems": medians, "ideal": ideal, "runs": runs}
        bar.set_detail("done")
    return results, errors, not_applicable


def _write_plots(
    args: argparse.Namespace, results: dict[str, dict[str, Any]], names: Sequence[str],
    plots_dir: str,
) -> list[str]:
    """The PNG plots (unless ``--no-plots``); the files written.  A plot that fails, or
    matplotlib missing, is a note on stderr: it must not lose the run's numbers."""
    if args.no_plots:
        return []
    try:
        _plots = _load_plots()
        return _plots.write_plots(results, names, plots_dir, workers=args.workers)
    except ImportError as exc:  # plots were not asked for (no --plots): a note is enough
        print(f"(no plots: {exc}; for plots: {PLOTS_HINT})", file=sys.stderr)
    except Exception as exc:  # a plot must not lose the run's numbers
        print(f"(plots failed: {type(exc).__name__}: {exc})", file=sys.stderr)
    return []


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry: run, print the table, write JSON and plots. Returns an exit code:
    0, or 1 when the first system failed a workload (or nothing ran), 2 for bad usage (and
    for ``--plots DIR`` without matplotlib, checked before anything runs)."""
    args = _parse(argv)
    LATENCY_HEAPS[:] = ["small", "large"] + (["frozen"] if args.frozen_latency else [])
    if args.plots and not args.no_plots and not _plots_import_ok():
        return 2
    systems, skipped = load_systems(args.systems)
    for name, reason in skipped.items():
        print(f"note: system {name!r} skipped: {reason}", file=sys.stderr)
    if not systems:
        print("error: no system to run", file=sys.stderr)
        return 2
    if args.user is not None:
        try:
            args.user = _calibrated(args.user)
        except Exception as exc:
            print(f"error: {args.user.describe()} raised {exc!r} when called here",
                  file=sys.stderr)
            return 2
    results, errors, not_applicable = _run_all(args, systems)
    names = [s.name for s in systems] + list(skipped)  # skipped systems: columns of "—"
    print_summary(args, results, names, skipped, errors, not_applicable)

    json_path, plots_dir = _output_paths(args)
    written = [write_json(json_path, args, results, skipped, errors, not_applicable)]
    written += _write_plots(args, results, names, plots_dir)
    print("wrote " + ", ".join(written))
    first = systems[0].name
    if errors.get(first) or not any(r["systems"] for r in results.values()):
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
