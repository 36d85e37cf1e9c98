"""PNG plots of a ``stealer bench`` run (matplotlib, Agg backend, no pyplot state).

:func:`write_plots` takes the results dict of :func:`stealer.bench.cli.main`
(``results[workload]["systems"][name]`` and ``results[workload]["ideal"]``) and writes, for
what the run contains:

- ``<workload>_percentiles.png`` for every workload with latency samples (``latency``,
  ``tiers``, and ``user`` for ``--workload``): p50/p90/p99/p99.9/max grouped bars per system and the ideal,
  log y axis;
- ``<workload>_cdf.png``: the latency CDF per system and the ideal (log x), and beside it the
  tail ``P(latency > x)`` on log-log axes, where the p99 and p99.9 differences show;
- ``efficiency.png``: efficiency bars of every workload reporting ``efficiency`` (skew, and
  agents when present) and the fork-join speedups (fib, uts) per system, each beside the
  ideal;
- ``overhead.png``: µs per no-op task via ``submit``, ``map`` and ``map(chunksize=64)``.

Systems keep one colour across all plots; the ideal is grey.  Missing values (a system that
was skipped or failed) are left out.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, NullFormatter

__all__ = [
    "write_plots",
    "plot_percentiles",
    "plot_cdf",
    "plot_efficiency",
    "plot_overhead",
    "PERCENTILES",
]

#: The latency statistics of the percentile plot: (result key, label).
PERCENTILES: tuple[tuple[str, str], ...] = (
    ("p50_ms", "p50"),
    ("p90_ms", "p90"),
    ("p99_ms", "p99"),
    ("p99_9_ms", "p99.9"),
    ("max_ms", "max"),
)

IDEAL = "ideal"
_IDEAL_COLOR = "0.55"
_PALETTE = ("C0", "C1", "C2", "C3", "C4", "C5", "C6", "C8", "C9")

_TITLES = {
    "latency": "latency: Poisson arrivals of 1 ms tasks at 70% load",
    "user": "your workload",
    "tiers": "tiers: call reply time while bulk agents saturate the workers",
}


def _colors(names: Sequence[str]) -> dict[str, str]:
    out = {name: _PALETTE[i % len(_PALETTE)] for i, name in enumerate(names)}
    out[IDEAL] = _IDEAL_COLOR
    return out


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    x = float(value)
    return x if x == x and abs(x) != float("inf") else None  # drop NaN and inf


def _series(res: dict[str, Any], systems: Sequence[str]) -> list[tuple[str, dict[str, Any]]]:
    """``(name, result)`` of each system with a result, then the ideal (if any)."""
    per_system = res.get("systems", {})
    out = [(name, per_system[name]) for name in systems if per_system.get(name)]
    ideal = res.get("ideal") or {}
    if ideal:
        out.append((IDEAL, ideal))
    return out


def _new_figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _plain_log_axis(axis: Any) -> None:
    """Label a log axis with plain numbers (0.5, 2, 10, 200) instead of powers of ten; label the 2 and
    5 minor ticks as well when the axis spans two decades or less."""
    lo, hi = (abs(v) for v in axis.get_view_interval())
    span = math.log10(hi / lo) if lo > 0 and hi > 0 else 99.0
    axis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
    if span <= 2.0:
        def minor(v: float, _pos: int) -> str:
            mantissa = round(v / 10 ** math.floor(math.log10(v)), 6) if v > 0 else 0
            return f"{v:g}" if mantissa in (2.0, 5.0) else ""

        axis.set_minor_formatter(FuncFormatter(minor))
    else:
        axis.set_minor_formatter(NullFormatter())


def _save(fig: Figure, path: str) -> str:
    fig.savefig(path, format="png")
    return path


def _grouped_bars(
    ax: Any,
    groups: Sequence[str],
    series: Sequence[tuple[str, Sequence[float | None]]],
    colors: dict[str, str],
    log: bool,
    fmt: str = "{:.3g}",
) -> None:
    """Bars of ``series`` (name, one value per group) side by side within each group."""
    n = max(1, len(series))
    width = 0.8 / n
    for j, (name, values) in enumerate(series):
        xs, hs = [], []
        for i, v in enumerate(values):
            if v is None or (log and v <= 0):
                continue
            xs.append(i - 0.4 + width * (j + 0.5))
            hs.append(v)
        if not xs:
            continue
        bars = ax.bar(xs, hs, width=width * 0.95, label=name, color=colors.get(name),
                      hatch="//" if name == IDEAL else None, edgecolor="white", linewidth=0.5)
        if len(series) * len(groups) <= 24:
            ax.bar_label(bars, labels=[fmt.format(h) for h in hs], fontsize=7, padding=1)
    ax.set_xticks(range(len(groups)), list(groups))
    if log:
        ax.set_yscale("log")
    ax.grid(axis="y", alpha=0.3, which="both" if log else "major")
    ax.set_axisbelow(True)


def plot_percentiles(
    res: dict[str, Any], systems: Sequence[str], path: str, title: str = ""
) -> str | None:
    """Latency percentiles per system and the ideal as grouped bars (log y)."""
    series = [
        (name, [_num(r.get(key)) for key, _label in PERCENTILES])
        for name, r in _series(res, systems)
    ]
    series = [(name, vals) for name, vals in series if any(v is not None for v in vals)]
    if not series:
        return None
    fig = _new_figure(max(7.0, 1.2 + 0.35 * len(series) * len(PERCENTILES)), 4.5)
    ax = fig.add_subplot()
    _grouped_bars(ax, [label for _k, label in PERCENTILES], series, _colors(systems), log=True)
    _plain_log_axis(ax.yaxis)
    ax.set_ylabel("latency (ms, log scale)")
    ax.set_title(title or "latency percentiles")
    ax.legend(fontsize=8)
    return _save(fig, path)


def _cdf_points(samples: Sequence[float]) -> tuple[list[float], list[float]]:
    xs = sorted(float(x) for x in samples if _num(x) is not None and x > 0)
    n = len(xs)
    ys = [(i + 1) / n for i in range(n)] if n > 1 else [1.0] * n
    return xs, ys


def plot_cdf(res: dict[str, Any], systems: Sequence[str], path: str, title: str = "") -> str | None:
    """Latency CDF per system and the ideal (log x), and the tail P(latency > x) (log-log)."""
    curves = []
    for name, r in _series(res, systems):
        xs, ys = _cdf_points(r.get("samples_ms") or [])
        if xs:
            curves.append((name, xs, ys))
    if not curves:
        return None
    colors = _colors(systems)
    fig = _new_figure(11.0, 4.5)
    ax_cdf, ax_tail = fig.subplots(1, 2)
    for name, xs, ys in curves:
        style = {"color": colors.get(name), "label": name, "linewidth": 1.5,
                 "linestyle": "--" if name == IDEAL else "-"}
        ax_cdf.step(xs, ys, where="post", **style)
        n = len(xs)
        if n > 1:  # P(X > x) at each sample except the last (which would be 0)
            tail_x = xs[:-1]
            tail_y = [1.0 - i / n for i in range(1, n)]
            ax_tail.step(tail_x, tail_y, where="post", **style)
    ax_cdf.set_xscale("log")
    ax_cdf.set_ylim(0.0, 1.0)
    ax_cdf.set_xlabel("latency (ms, log scale)")
    ax_cdf.set_ylabel("fraction of tasks ≤ x")
    ax_cdf.grid(alpha=0.3, which="both")
    ax_cdf.legend(fontsize=8, loc="lower right")
    ax_cdf.set_title("CDF")
    ax_tail.set_xscale("log")
    ax_tail.set_yscale("log")
    ax_tail.set_xlabel("latency (ms, log scale)")
    ax_tail.set_ylabel("fraction of tasks > x (log)")
    for q, label in ((0.01, "p99"), (0.001, "p99.9")):
        ax_tail.axhline(q, color="0.8", linewidth=0.8, zorder=0)
        ax_tail.annotate(label, (0.0, q), xycoords=("axes fraction", "data"), fontsize=7,
                         color="0.5", xytext=(2, 2), textcoords="offset points")
    ax_tail.grid(alpha=0.3, which="both")
    for axis in (ax_cdf.xaxis, ax_tail.xaxis):
        _plain_log_axis(axis)
    ax_tail.set_title("tail")
    fig.suptitle(title or "latency distribution")
    return _save(fig, path)


def plot_efficiency(
    results: dict[str, dict[str, Any]], systems: Sequence[str], path: str,
    workers: int | None = None,
) -> str | None:
    """Efficiency bars (every workload reporting ``efficiency``) and fork-join speedups."""
    colors = _colors(systems)
    panels: list[tuple[str, list[str], list[tuple[str, list[float | None]]], str]] = []
    eff_groups = [w for w, res in results.items()
                  if any(_num(r.get("efficiency")) is not None for _n, r in _series(res, systems))]
    if eff_groups:
        names = [*systems, IDEAL]
        series = []
        for name in names:
            vals = []
            for w in eff_groups:
                res = results[w]
                r = res.get("ideal", {}) if name == IDEAL else res.get("systems", {}).get(name, {})
                vals.append(_num((r or {}).get("efficiency")))
            if any(v is not None for v in vals):
                series.append((name, vals))
        panels.append(("efficiency (1.0 = no scheduling loss)", eff_groups, series, "efficiency"))
    fj = results.get("forkjoin")
    if fj:
        keys = [("fib_speedup", "fib"), ("uts_speedup", "uts")]
        series = []
        for name, r in _series(fj, systems):
            vals = [_num(r.get(k)) for k, _label in keys]
            if any(v is not None for v in vals):
                series.append((name, vals))
        if series:
            ylabel = f"speedup over one process{f' ({workers} workers)' if workers else ''}"
            panels.append(("fork-join speedup", [label for _k, label in keys], series, ylabel))
    if not panels:
        return None
    fig = _new_figure(5.5 * len(panels), 4.5)
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, (title, groups, series, ylabel) in zip(axes, panels):
        _grouped_bars(ax, groups, series, colors, log=False, fmt="{:.2f}")
        ax.set_title(title)
        ax.set_ylabel(ylabel)
        ax.set_ylim(bottom=0.0)
        if ylabel == "efficiency":
            ax.axhline(1.0, color="0.3", linewidth=0.8, linestyle=":")
        elif workers:
            ax.axhline(float(workers), color="0.3", linewidth=0.8, linestyle=":")
        ax.legend(fontsize=8)
    return _save(fig, path)


def plot_overhead(res: dict[str, Any], systems: Sequence[str], path: str) -> str | None:
    """µs per no-op task via submit, map and map(chunksize) per system (log y)."""
    keys = [("submit_us", "submit"), ("map_us", "map"), ("map_chunked_us", "map(chunk=64)")]
    per_system = res.get("systems", {})
    series = []
    for name in systems:
        r = per_system.get(name)
        if not r:
            continue
        vals = [_num(r.get(k)) for k, _label in keys]
        if any(v is not None for v in vals):
            series.append((name, vals))
    if not series:
        return None
    fig = _new_figure(max(6.0, 1.5 + 0.5 * len(series) * len(keys)), 4.5)
    ax = fig.add_subplot()
    _grouped_bars(ax, [label for _k, label in keys], series, _colors(systems), log=True)
    _plain_log_axis(ax.yaxis)
    ax.set_ylabel("µs per no-op task (log scale)")
    ax.set_title("overhead: no-op tasks (lower is better)")
    ax.legend(fontsize=8)
    return _save(fig, path)


def write_plots(
    results: dict[str, dict[str, Any]],
    systems: Sequence[str],
    out_dir: str,
    workers: int | None = None,
) -> list[str]:
    """Write every plot the results allow into ``out_dir`` (created); returns the paths."""
    os.makedirs(out_dir, exist_ok=True)
    written: list[str] = []

    def keep(path: str | None) -> None:
        if path is not None:
            written.append(path)

    for workload, res in results.items():
        has_samples = any(r.get("samples_ms") for _n, r in _series(res, systems))
        if not has_samples:
            continue
        title = _TITLES.get(workload, workload)
        if workload == "user":
            call = next(iter(res.get("systems", {}).values()), {}).get("info", {}).get("call")
            if call:
                title = f"{title}: {call}"
        keep(plot_percentiles(res, systems, os.path.join(out_dir, f"{workload}_percentiles.png"),
                              f"{title}: percentiles"))
        keep(plot_cdf(res, systems, os.path.join(out_dir, f"{workload}_cdf.png"), title))
    keep(plot_efficiency(results, systems, os.path.join(out_dir, "efficiency.png"), workers))
    if "overhead" in results:
        keep(plot_overhead(results["overhead"], systems, os.path.join(out_dir, "overhead.png")))
    return written
