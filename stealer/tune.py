"""``stealer tune``: sweep pinning policies and worker counts, pick the best configuration.

For every policy (``compact``, ``scatter``, ``physical``, ``none``; :mod:`stealer.affinity`)
and every worker count (default ``1..usable CPUs``), a fresh :class:`stealer.Executor`
``(workers, cpus=policy)`` runs the workload, and one row records p50 and p99 latency and
throughput.  The default workload is the benchmark's (:mod:`stealer.bench.wl_tasks`):

- latency: Poisson arrivals of 1 ms tasks at 70% of the configuration's capacity (quick size,
  2,000 tasks): p50 and p99 of arrival to result, beside the zero-overhead ideal's p99;
- overhead: no-op tasks through ``submit`` (quick size, 2,000 tasks): throughput in tasks/s.

With ``--workload MODULE:FUNCTION`` (and ``--args``, ``--tasks``, ``--inflight`` as for
``stealer bench``) the user's function gives all three numbers instead.

A configuration the machine cannot honour (``physical`` with more workers than physical
cores, a CPU list outside the allowed set: :class:`~stealer.errors.AffinityError`) is kept as
a skipped row with the reason; an oversubscribed one (more workers than usable CPUs) runs
with a note.  The table is followed by the best row by p99 (lowest) and by throughput
(highest); ``--json`` writes every row.  ``stealer tune --quick`` (the default sizes) takes
well under a minute on 2 CPUs.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from stealer.bench import harness as _harness
from stealer.bench import report as _bench_report
from stealer.bench import systems as _systems
from stealer.bench import wl_tasks as _tasks
from stealer.bench import wl_user as _user
from stealer.bench.progress import Progress

__all__ = ["DEFAULT_POLICIES", "Row", "sweep", "best", "format_rows", "main"]

#: The named policies swept by default (explicit CPU lists are not swept).
DEFAULT_POLICIES: tuple[str, ...] = ("compact", "scatter", "physical", "none")

Row = dict[str, Any]


def _usable_cpus() -> int:
    from stealer import affinity

    return max(1, affinity.read_topology().usable_count)


def _plan(policy: str, workers: int) -> tuple[list[int | None] | None, list[str], str | None]:
    """``(cpus, warnings, error)`` of :func:`stealer.affinity.plan` for this configuration."""
    from stealer import affinity
    from stealer.errors import AffinityError

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            cpus = affinity.plan(workers, policy)
        except AffinityError as exc:
            return None, [], str(exc)
    return cpus, [str(w.message) for w in caught], None


def _cpus_text(cpus: Sequence[int | None] | None) -> str:
    if cpus is None:
        return "—"
    if all(c is None for c in cpus):
        return "unpinned"
    return ",".join("-" if c is None else str(c) for c in cpus)


def _system(policy: str, notes: list[str]) -> _systems.System:
    import stealer

    def make(workers: int) -> Any:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ex = stealer.Executor(max_workers=workers, cpus=policy)
        for w in caught:
            text = str(w.message)
            if text not in notes:
                notes.append(text)
        return ex

    return _systems.System(f"stealer[{policy}]", make, forkjoin="native")


def _short(note: str) -> str:
    """A table-sized form of a note ("oversubscribed" for the affinity warning)."""
    return "oversubscribed" if note.startswith("oversubscription") else note


Workload = Callable[[_systems.System, int], dict[str, Any]]


def _default_workload(size: str) -> Workload:
    def run(system: _systems.System, workers: int) -> dict[str, Any]:
        lat = _tasks.run_latency(system, workers, size)
        _harness._report(0.8)
        ovh = _tasks.run_overhead(system, workers, size)
        return {
            "p50_ms": lat["p50_ms"],
            "p99_ms": lat["p99_ms"],
            "ideal_p99_ms": lat["ideal"]["p99_ms"],
            "tasks_per_s": ovh["submit_tasks_per_s"],
            "detail": {
                "latency": _bench_report._strip_samples(lat),
                "overhead": _bench_report._strip_samples(ovh),
            },
        }

    return run


def _user_workload(spec: _user.UserWorkload) -> Workload:
    def run(system: _systems.System, workers: int) -> dict[str, Any]:
        res = _user.run_user(system, workers, spec)
        return {
            "p50_ms": res["p50_ms"],
            "p99_ms": res["p99_ms"],
            "ideal_p99_ms": res["ideal"]["p99_ms"],
            "tasks_per_s": res["tasks_per_s"],
            "detail": {"user": _bench_report._strip_samples(res)},
        }

    return run


def _detail_hook(progress: Progress, label: str) -> Callable[[float], None]:
    def hook(frac: float) -> None:
        progress.set_detail(f"{label} {frac:.0%}")

    return hook


def sweep(
    workload: Workload,
    policies: Sequence[str],
    worker_counts: Sequence[int],
    repeat: int = 1,
    progress: Progress | None = None,
) -> list[Row]:
    """Run ``workload`` on every (policy, workers) configuration; one row each, in order."""
    rows: list[Row] = []
    for policy in policies:
        for workers in worker_counts:
            row: Row = {"policy": policy, "workers": workers, "status": "ok", "notes": []}
            rows.append(row)
            label = f"{policy} x {workers}"
            cpus, plan_warnings, error = _plan(policy, workers)
            row["cpus"] = _cpus_text(cpus)
            if error is not None:
                row["status"] = "skipped"
                row["notes"].append(error)
                if progress is not None:
                    progress.update(repeat)
                    progress.write(f"  {label:<14} skipped (see the notes)")
                continue
            notes: list[str] = list(plan_warnings)
            runs = []
            for _ in range(repeat):
                hook: Callable[[float], None] | None = None
                if progress is not None:
                    progress.set_detail(label)
                    hook = _detail_hook(progress, label)
                t0 = time.perf_counter()
                try:
                    with _harness._progress_to(hook):
                        runs.append(workload(_system(policy, notes), workers))
                except Exception as exc:
                    row["status"] = "failed"
                    notes.append(f"failed: {type(exc).__name__}: {exc}")
                    if progress is not None:
                        progress.update(repeat - len(runs))
                        progress.write(f"  {label:<14} FAILED: {type(exc).__name__}: {exc}")
                    break
                if progress is not None:
                    progress.set_detail(label)
                    progress.update()
                    progress.write(f"  {label:<14} {time.perf_counter() - t0:6.2f} s")
            row["notes"] = list(dict.fromkeys(notes))
            if runs and row["status"] == "ok":
                med = _bench_report._median_dicts(runs)
                row.update({k: med[k] for k in ("p50_ms", "p99_ms", "ideal_p99_ms",
                                                 "tasks_per_s")})
                row["detail"] = med["detail"]
    return rows


def best(rows: Sequence[Row]) -> dict[str, Row | None]:
    """The ok row with the lowest p99 and the one with the highest throughput (ties: the
    first, i.e. the earlier policy and fewer workers)."""
    ok = [r for r in rows if r.get("status") == "ok" and "p99_ms" in r]
    by_p99 = min(ok, key=lambda r: r["p99_ms"], default=None)
    by_tput = max(ok, key=lambda r: r["tasks_per_s"], default=None)
    return {"p99": by_p99, "throughput": by_tput}


def _fmt(row: Row, key: str, spec: str) -> str:
    value = row.get(key)
    return "—" if value is None else format(value, spec)


def format_rows(
    rows: Sequence[Row], picks: dict[str, Row | None] | None = None, note_width: int = 40
) -> str:
    """Aligned table: policy, workers, cpus, p50, p99, ideal p99, tasks/s, best, notes.

    Notes longer than ``note_width`` become footnotes ``[k]`` printed in full below.
    """
    picks = best(rows) if picks is None else picks
    header = ["policy", "workers", "cpus", "p50 ms", "p99 ms", "ideal p99", "tasks/s", "best",
              "notes"]
    body = []
    footnotes: list[str] = []
    for r in rows:
        marks = [name for name, pick in picks.items() if pick is r]
        cells = []
        for note in r.get("notes", []):
            short = _short(note)
            if len(short) > note_width:
                footnotes.append(f"[{len(footnotes) + 1}] {r['policy']} x {r['workers']}: {note}")
                short = f"[{len(footnotes)}]"
            cells.append(short)
        if r.get("status", "ok") != "ok":
            cells.insert(0, r["status"])
        body.append([
            r["policy"], str(r["workers"]), r.get("cpus", "—"),
            _fmt(r, "p50_ms", ".2f"), _fmt(r, "p99_ms", ".2f"), _fmt(r, "ideal_p99_ms", ".2f"),
            _fmt(r, "tasks_per_s", ",.0f"), ",".join(marks), " ".join(cells),
        ])
    widths = [max(len(x[i]) for x in [header, *body]) for i in range(len(header))]
    right = {1, 3, 4, 5, 6}

    def line(cells: Sequence[str]) -> str:
        out = [c.rjust(w) if i in right else c.ljust(w)
               for i, (c, w) in enumerate(zip(cells, widths))]
        return "  ".join(out).rstrip()

    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, body), *footnotes])


def _describe_best(picks: dict[str, Row | None]) -> list[str]:
    out = []
    p = picks.get("p99")
    if p is not None:
        out.append(
            f"best p99:        cpus={p['policy']!r} max_workers={p['workers']}: p99 "
            f"{p['p99_ms']:.2f} ms (ideal {p['ideal_p99_ms']:.2f} ms), "
            f"{p['tasks_per_s']:,.0f} tasks/s"
        )
    t = picks.get("throughput")
    if t is not None:
        out.append(
            f"best throughput: cpus={t['policy']!r} max_workers={t['workers']}: "
            f"{t['tasks_per_s']:,.0f} tasks/s, p99 {t['p99_ms']:.2f} ms"
        )
    if not out:
        out.append("no configuration ran; see the notes")
    return out


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError("worker counts must be >= 1")
    return values


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="stealer tune",
        description="Sweep pinning policies x worker counts on a workload; report the best "
        "p99 and throughput with the table behind the choice.",
        epilog="Default workload: 1 ms tasks arriving at 70%% load (p50/p99 latency) and "
        "no-op tasks through submit (throughput), both at the bench's quick size.  "
        "--workload MODULE:FUNCTION uses your function instead (see stealer bench --help).",
    )
    p.add_argument("--policies", default=",".join(DEFAULT_POLICIES),
                   help=f"comma-separated policies (default {','.join(DEFAULT_POLICIES)})")
    p.add_argument("--workers", type=_int_list, default=None, metavar="N,N,...",
                   help="worker counts to try (default: 1..usable CPUs)")
    sizes = p.add_mutually_exclusive_group()
    sizes.add_argument("--quick", action="store_true",
                       help="quick sizes (the default; well under a minute on 2 CPUs)")
    sizes.add_argument("--full", action="store_true", help="the benchmark's full sizes")
    sizes.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # tests
    p.add_argument("--repeat", type=int, default=1, help="runs per configuration (medians)")
    p.add_argument("--json", metavar="PATH", help="write every row as JSON here")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bar on stderr (default: when stderr is a terminal)")
    g = p.add_argument_group("your own workload")
    g.add_argument("--workload", metavar="MODULE:FUNCTION", help="a function to tune for")
    g.add_argument("--args", default="[]", metavar="JSON", help="its arguments (a JSON list)")
    g.add_argument("--kwargs", default="{}", metavar="JSON", help="its keyword arguments")
    g.add_argument("--tasks", type=int, default=None, help="calls per configuration")
    g.add_argument("--inflight", type=int, default=0, metavar="K",
                   help="at most K tasks outstanding (default 0: all at once)")
    args = p.parse_args(argv)
    args.size = "full" if args.full else "tiny" if args.tiny else "quick"
    args.policies = [x.strip() for x in args.policies.split(",") if x.strip()]
    from stealer import affinity

    unknown = [x for x in args.policies if x not in affinity.POLICIES]
    if unknown or not args.policies:
        p.error(f"unknown policy {', '.join(unknown)}; valid: {', '.join(affinity.POLICIES)}")
    if args.workers is None:
        args.workers = list(range(1, _usable_cpus() + 1))
    if args.repeat < 1:
        p.error("--repeat must be >= 1")
    args.user = None
    if args.workload:
        tasks = _user.USER_TASKS[args.size] if args.tasks is None else args.tasks
        if tasks < 1 or args.inflight < 0:
            p.error("--tasks must be >= 1 and --inflight >= 0")
        try:
            fn = _user.resolve_function(args.workload)
            fargs = _user._json_value(args.args, "--args", list)
            fkwargs = _user._json_value(args.kwargs, "--kwargs", dict)
        except ValueError as exc:
            p.error(str(exc))
        args.user = _user.UserWorkload(args.workload, fn, tuple(fargs), fkwargs, tasks=tasks,
                                         inflight=args.inflight)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry of ``stealer tune``; returns 0, or 1 when no configuration ran."""
    args = _parse(argv)
    try:
        import stealer  # noqa: F401
    except Exception as exc:
        print(f"error: 'import stealer' failed: {exc!r}", file=sys.stderr)
        return 1
    if args.user is not None:
        try:
            spec = _user.UserWorkload(
                args.user.target, args.user.fn, args.user.args, args.user.kwargs,
                args.user.tasks, args.user.inflight, task_s=_user.calibrate(args.user),
            )
        except Exception as exc:
            print(f"error: {args.user.describe()} raised {exc!r} when called here",
                  file=sys.stderr)
            return 1
        workload = _user_workload(spec)
        what = f"{spec.describe()} x {spec.tasks:,} (inflight {spec.inflight or 'all'})"
    else:
        workload = _default_workload(args.size)
        what = (f"latency: 1 ms tasks at 70% load x {_tasks.LATENCY_TASKS[args.size]:,}; "
                f"throughput: {_tasks.OVERHEAD_TASKS[args.size]:,} no-op submits")
    steps = len(args.policies) * len(args.workers) * args.repeat
    with Progress(steps, label="tune", enabled=args.progress) as bar:
        rows = sweep(workload, args.policies, args.workers, args.repeat, bar)
        bar.set_detail("done")
    picks = best(rows)
    print(f"stealer tune: {what}; size={args.size} repeat={args.repeat} "
          f"usable CPUs={_usable_cpus()}")
    print(format_rows(rows, picks))
    for line in _describe_best(picks):
        print(line)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        meta = {
            "python": sys.version.split()[0],
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "usable_cpus": _usable_cpus(),
            "size": args.size,
            "repeat": args.repeat,
            "policies": args.policies,
            "workers": args.workers,
            "workload": what,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        index = {id(r): i for i, r in enumerate(rows)}
        doc = {
            "meta": meta,
            "rows": rows,
            "best": {
                k: None if r is None
                else {"policy": r["policy"], "workers": r["workers"], "row": index[id(r)]}
                for k, r in picks.items()
            },
        }
        with open(args.json, "w", encoding="utf-8") as fh:
            fh.write(_bench_report.dumps_compact(doc))
            fh.write("\n")
        print(f"wrote {args.json}")
    return 0 if any(r is not None for r in picks.values()) else 1


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
