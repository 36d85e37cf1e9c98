"""``stealer top``: a live terminal view of a running executor, attached by its id.

An executor's id is the name of its shared segment in /dev/shm
(``stealer-<client pid>-<token>``, :attr:`stealer.Executor.id`).  Any
process of the same user can map it read-side and take snapshots with
:func:`stealer.client.stats.collect`; that never blocks a worker.  Each frame shows:

* a header: id, uptime, workers, injector depth, the client's pending tasks
  and backlog when known (only the client itself knows them: a frame built
  from :meth:`stealer.Executor.stats` has them, one attached by id does not);
* one row per worker: pid, CPU, state ("frozen Ns" when it has held work
  without progress for over a second, from the second frame on: see
  stealer/client/hang.py), whether a task runs on it now, deque
  and inbox depths, and steps/s, steals/s, parks/s and busy % over the last
  interval (since the start for the first frame), with a totals row;
* live agents, their steps, messages, migrations and throttled turns, and the
  busiest agents by CPU time (worker, generation, steps, messages, mailbox);
* queue wait and run time per tier (p50/p99/p99.9/max in ms) over the last
  interval (cumulative for the first frame);
* the busiest workers of the interval.

Counters are published by each worker every 64 steps and whenever it
parks, so a frame may be a few steps behind; a worker replaced after a
crash restarts its counters (its deltas then count from zero).

A cluster executor (``Executor(cluster=...)``) has no segment: its client
publishes its figures as a small snapshot in /dev/shm about four times a
second (stealer/cluster/snapshot.py), under an id of the form
``stealer-<client pid>-cluster-<hex>`` (``ex.id``) that :func:`list_executors`
lists beside the local ones; its frame (:func:`render_cluster`) has one row per
node: busy %, queued and running tasks, tasks done and their rate, agent
messages answered per second, agents and those with messages, tasks got from
and given to other nodes, and the latency of its results at the client.

``main`` is the command line (``stealer top [ID] [--interval S] [--once]
[--count N] [--prometheus]``); :func:`render`, :func:`render_cluster` and
:func:`list_executors` are usable on their own.
"""

from __future__ import annotations

import argparse
import contextlib
import mmap
import os
import shutil
import struct
import sys
import time
from collections.abc import Sequence
from typing import Any, TextIO

import numpy as np

from stealer.client.hang import SHOW_AFTER, Stalls
from stealer.client.stats import Stats, WorkerStats, collect, executor_gone
from stealer.cluster import snapshot
from stealer.shared import metrics
from stealer.shared.metrics import Histogram, bucket_bounds
from stealer.shared.shm import (
    H_CREATED_NS,
    H_MAGIC,
    H_NWORKERS,
    HEADER_BYTES,
    MAGIC,
    SHM_DIR,
    Segment,
    _alive,
    client_pid,
    our_files,
)

__all__ = ["list_executors", "render", "render_cluster", "main", "executor_gone"]

CLEAR = "\x1b[H\x1b[2J"  # cursor home + clear screen
_sleep = time.sleep  # indirection so tests can interrupt the refresh loop
_BUSIEST = 3


# -- finding executors ---------------------------------------------------------


def list_executors() -> list[dict[str, Any]]:
    """Running executors of this user: id, client pid, workers, uptime (oldest first).

    Scans /dev/shm for stealer segments owned by this uid whose client
    process is alive; segments still being created (no magic yet) are
    skipped.  Reads only the segment headers.  Cluster executors' snapshots
    are listed too (``kind: "cluster"``, their workers those of every alive
    node).
    """
    out = []
    now = time.time()
    for name, pid, path in our_files():
        if client_pid(name) is None or not _alive(pid):
            continue  # an overflow file, or a dead client's leftovers
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            with mmap.mmap(fd, HEADER_BYTES, mmap.MAP_SHARED, mmap.PROT_READ) as head:
                if struct.unpack_from("=Q", head, H_MAGIC)[0] != MAGIC:
                    continue
                nworkers = struct.unpack_from("=I", head, H_NWORKERS)[0]
                created = struct.unpack_from("=Q", head, H_CREATED_NS)[0] / 1e9
        except (OSError, ValueError):  # vanished, or too short: still being created
            continue
        finally:
            os.close(fd)
        out.append({
            "id": name,
            "client_pid": pid,
            "workers": nworkers,
            "uptime_s": max(0.0, now - created) if created else 0.0,
            "created": created,
        })
    out += snapshot.list_snapshots()
    out.sort(key=lambda e: (e["created"], e["id"]))
    return out


def format_list(execs: list[dict[str, Any]]) -> str:
    """A table of :func:`list_executors` entries."""
    lines = [f"{'ID':<50} {'CLIENT PID':>10} {'WORKERS':>8} {'UPTIME':>12}"]
    for e in execs:
        lines.append(f"{e['id']:<50} {e['client_pid']:>10} {e['workers']:>8} "
                     f"{_fmt_uptime(e['uptime_s']):>12}")
    return "\n".join(lines)


# -- rendering -----------------------------------------------------------------


def _fmt_uptime(s: float) -> str:
    s = int(s)
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    return f"{d}d {h:02d}:{m:02d}:{s:02d}" if d else f"{h}:{m:02d}:{s:02d}"


def _fmt_rate(x: float | None) -> str:
    if x is None or x != x:
        return "-"
    if x >= 1e6:
        return f"{x / 1e6:.2f}M"
    if x >= 1e4:
        return f"{x / 1e3:.1f}k"
    if x >= 100:
        return f"{x:.0f}"
    return f"{x:.1f}"


def _fmt_ms(ns: float) -> str:
    if ns != ns:  # nan: no events
        return "-"
    ms = ns / 1e6
    if ms < 10:
        return f"{ms:.3f}"
    if ms < 1000:
        return f"{ms:.1f}"
    return f"{ms:.0f}"


def _fmt_int(n: int) -> str:
    return f"{n:,}"


def _worker_delta(p: WorkerStats | None, c: WorkerStats) -> dict[str, int]:
    """Counter increments of one worker between two snapshots.

    A replacement worker (new pid) starts its counters from zero; then the
    whole current value is the increment.
    """
    if p is None or p.pid != c.pid:
        return dict(c.counters)
    d = {k: v - p.counters.get(k, 0) for k, v in c.counters.items()}
    if any(v < 0 for v in d.values()):
        return dict(c.counters)
    return d


def _hist_delta(p: Histogram | None, c: Histogram) -> Histogram:
    """Events of ``c`` since snapshot ``p``; ``max`` estimated for the interval.

    The recorded max is cumulative: it is exact for the interval only if it
    falls in the interval's highest bucket; otherwise that bucket's midpoint
    (within 0.8% of the true interval max) stands in for it.
    """
    if p is None or np.any(c.counts < p.counts):
        return c
    d = c - p
    nz = np.flatnonzero(d.counts)
    if not len(nz):
        return metrics.Histogram(d.counts, max(0, d.total), max(0, d.sum_ns), 0)
    lo, hi = bucket_bounds(int(nz[-1]))
    d.max_ns = c.max_ns if c.max_ns < hi else (lo + hi - 1) // 2
    return d


def _state(w: WorkerStats) -> str:
    """The state column: "frozen Ns" for a worker holding work without progress for
    over a second (stealer/client/hang.py), else its state."""
    if w.frozen_s > SHOW_AFTER:
        return f"frozen {w.frozen_s:.0f}s"
    return w.state


def render(prev: Stats | None, cur: Stats, width: int = 100) -> str:
    """The text of one frame for snapshot ``cur``.

    With ``prev`` (an earlier snapshot of the same executor), rates and
    latency cover ``cur.time - prev.time``; without it, rates are averages
    since the executor started and latency is cumulative.  Lines are cut
    at ``width`` characters.
    """
    if prev is not None and (prev.id != cur.id or cur.time <= prev.time):
        prev = None
    dt = cur.time - prev.time if prev is not None else cur.uptime_s
    window = f"last {dt:.1f} s" if prev is not None else "since start"
    lines: list[str] = []

    # header
    totals = cur.totals()
    pid = client_pid(cur.id)
    lines.append(f"stealer top - {cur.id}")
    running = sum(w.running for w in cur.workers)
    lines.append(f"up {_fmt_uptime(cur.uptime_s)}   workers {len(cur.workers)} "
                 f"({running} running)   injector {cur.injector_depth}   "
                 f"tasks {_fmt_int(totals['tasks'])}   errors {_fmt_int(totals['errors'])}")
    client = f"client pid {pid}" if pid is not None else "client"
    if cur.client:
        extra = "   ".join(f"{k} {v}" for k, v in cur.client.items())
        lines.append(f"{client}   {extra}")
    else:
        lines.append(f"{client}   (pending/backlog are known to the client only)")
    lines.append("")

    # workers
    prev_w = {w.index: w for w in prev.workers} if prev is not None else {}
    deltas = [_worker_delta(prev_w.get(w.index) if prev is not None else None, w)
              for w in cur.workers]

    def rate(n: int) -> float | None:
        return n / dt if dt > 0 else None

    def busy_pct(ns: int) -> str:
        return f"{min(100.0, ns / 1e9 / dt * 100):.1f}" if dt > 0 else "-"

    lines.append(f"workers, rates {window}")
    head = (f"{'#':>4} {'pid':>8} {'cpu':>4}  {'state':<11} {'run':>3} {'deque':>6} "
            f"{'inbox':>6} {'steps/s':>9} {'steals/s':>9} {'parks/s':>9} {'busy%':>6}")
    lines.append(head)
    for w, d in zip(cur.workers, deltas):
        lines.append(
            f"{w.index:>4} {w.pid if w.pid else '-':>8} "
            f"{w.cpu if w.cpu is not None else '-':>4}  {_state(w):<11} "
            f"{'*' if w.running else '':>3} {w.deque_depth:>6} {w.inbox_depth:>6} "
            f"{_fmt_rate(rate(d['tasks'])):>9} {_fmt_rate(rate(d['steals'])):>9} "
            f"{_fmt_rate(rate(d['parks'])):>9} {busy_pct(d['busy_ns']):>6}")
    tot = {k: sum(d[k] for d in deltas) for k in ("tasks", "steals", "parks", "busy_ns")}
    n = max(1, len(cur.workers))
    lines.append(
        f"{'all':>4} {'':>8} {'':>4}  {'':<11} {running:>3} "
        f"{sum(w.deque_depth for w in cur.workers):>6} "
        f"{sum(w.inbox_depth for w in cur.workers):>6} "
        f"{_fmt_rate(rate(tot['tasks'])):>9} {_fmt_rate(rate(tot['steals'])):>9} "
        f"{_fmt_rate(rate(tot['parks'])):>9} {busy_pct(tot['busy_ns'] // n):>6}")
    lines.append("")

    # latency per tier
    lines.append(f"latency in ms, {window if prev is not None else 'cumulative'}")
    lines.append(f"{'tier':<12} {'kind':<5} {'count':>10} {'p50':>9} {'p99':>9} "
                 f"{'p99.9':>9} {'max':>9}")
    if not cur.latency:
        lines.append("  (no latency recorded yet, or the executor runs with metrics=False)")
    for tier in metrics.TIER_NAMES:
        kinds = cur.latency.get(tier)
        if not kinds:
            continue
        for j, kind in enumerate(metrics.KINDS):
            c = kinds.get(kind)
            if c is None:
                continue
            p = prev.latency.get(tier, {}).get(kind) if prev is not None else None
            h = _hist_delta(p, c) if prev is not None else c
            cnt = h.count
            lines.append(
                f"{tier if j == 0 else '':<12} {kind:<5} {_fmt_int(cnt):>10} "
                f"{_fmt_ms(h.percentile(50)):>9} {_fmt_ms(h.percentile(99)):>9} "
                f"{_fmt_ms(h.percentile(99.9)):>9} "
                f"{_fmt_ms(float(h.max_ns) if cnt else float('nan')):>9}")
    lines.append("")

    # busiest workers
    ranked = sorted(zip(cur.workers, deltas), key=lambda wd: (-wd[1]["busy_ns"], wd[0].index))
    ranked = [(w, d) for w, d in ranked if d["busy_ns"] > 0][:_BUSIEST]
    lines.append(f"busiest workers, {window}")
    if not ranked:
        lines.append("  (none busy)")
    for w, d in ranked:
        lines.append(f"  worker {w.index:<4} pid {w.pid or '-':<8} busy {busy_pct(d['busy_ns']):>5}%"
                     f"   {_fmt_int(d['tasks'])} steps   {_fmt_int(d['steals'])} steals")
    if cur.agents_live or cur.busiest_agents:
        lines.append("")
        lines.append(f"agents: {_fmt_int(cur.agents_live)} live   "
                     f"{_fmt_int(totals['agent_steps'])} steps   "
                     f"{_fmt_int(totals['agent_messages'])} messages   "
                     f"{_fmt_int(totals['migrations'])} migrations   "
                     f"{_fmt_int(totals['throttled'])} throttled turns")
        lines.append(f"busiest agents (CPU since start)   {'worker':>6} {'gen':>4} "
                     f"{'cpu ms':>10} {'steps':>9} {'msgs':>9} {'mailbox':>7}")
        for ag in cur.busiest_agents:
            where = "-" if ag.worker is None else str(ag.worker)
            lines.append(f"  agent {ag.id:#018x}           {where:>6} {ag.generation:>4} "
                         f"{ag.cpu_ms:>10.1f} {_fmt_int(ag.steps):>9} "
                         f"{_fmt_int(ag.messages):>9} {ag.mailbox:>7}")
    return "\n".join(line[:width].rstrip() for line in lines) + "\n"


def _fmt_count(n: int) -> str:
    """A count in at most 7 characters: 1,234,567 as 1.23M."""
    return f"{n / 1e6:.2f}M" if n >= 10_000_000 else f"{n / 1e6:.3f}M" if n >= 1e6 else (
        _fmt_int(n))


def _fmt_opt_ms(ms: float | None) -> str:
    return "-" if ms is None else _fmt_ms(ms * 1e6)


def render_cluster(prev: dict[str, Any] | None, cur: dict[str, Any], width: int = 100) -> str:
    """The text of one frame for a cluster executor's snapshot ``cur`` (the dict that
    stealer/cluster/snapshot.py reads: ``ClusterExecutor.stats()`` as a dict, with id,
    pid, time and uptime_s).  With ``prev`` (an earlier snapshot of the same executor),
    rates cover ``cur["time"] - prev["time"]``; without it, they are averages since the
    executor started.  Lines are cut at ``width`` characters."""
    if prev is not None and (prev.get("id") != cur.get("id") or cur["time"] <= prev["time"]):
        prev = None
    dt = cur["time"] - prev["time"] if prev is not None else cur["uptime_s"]
    window = f"last {dt:.1f} s" if prev is not None else "since start"
    nodes: dict[str, dict[str, Any]] = cur.get("nodes", {})
    before = prev["nodes"] if prev is not None else {}
    alive = [n for n in nodes.values() if n.get("alive")]
    lines = [f"stealer top - {cur['id']} (cluster)",
             f"up {_fmt_uptime(cur['uptime_s'])}   nodes {len(alive)} alive of {len(nodes)}   "
             f"workers {sum(n['workers'] for n in alive)}   client pid {cur.get('pid', '-')}",
             f"tasks {_fmt_int(cur['submitted'])} submitted   "
             f"{_fmt_int(cur['moved'])} stolen between nodes   "
             f"{_fmt_int(cur['resubmitted'])} re-placed after a loss",
             f"results {_fmt_int(cur['done'])} in, {_fmt_int(cur['outstanding'])} awaited "
             f"(tasks' and agents')   {_fmt_int(cur.get('duplicates', 0))} duplicates dropped"]
    moves = cur.get("agent_moves", 0)
    each = f" ({cur.get('move_s', 0.0) * 1e3:.0f} ms each)" if moves else ""
    lines.append(f"agents {_fmt_int(sum(n.get('agents', 0) for n in alive))}   "
                 f"{_fmt_int(moves)} moved between live nodes{each}   "
                 f"{_fmt_int(cur.get('replayed', 0))} replayed after a loss   "
                 f"{_fmt_int(cur.get('state_errors', 0))} state errors")
    lines.append("")
    lines.append(f"nodes, rates {window}; latency of results at the client (last 2,048)")
    lines.append(f"{'node':<12} {'wrk':>3} {'busy':>4} {'queued':>6} {'run':>5} {'done':>7} "
                 f"{'tasks/s':>7} {'msgs/s':>7} {'agents':>6} {'active':>6} {'got':>6} "
                 f"{'given':>6} {'p50 ms':>6} {'p99 ms':>6}")
    tot = {"queued": 0, "running": 0, "done": 0, "rate": 0.0, "mrate": 0.0, "agents": 0,
           "active": 0, "got": 0, "given": 0}

    def delta(n: dict[str, Any], p: dict[str, Any] | None, key: str) -> int:
        now, then = n.get(key) or 0, (p.get(key) or 0) if p is not None else 0
        return now - then if now >= then else now

    for nid in sorted(nodes):
        n = nodes[nid]
        p = before.get(nid)
        done = n.get("done") or 0
        rate = delta(n, p, "done") / dt if dt > 0 else None
        mrate = delta(n, p, "msgs") / dt if dt > 0 else None
        lat = n.get("latency_ms") or {}
        busy = f"{100 * n.get('busy', 0.0):.0f}" if n.get("alive") else "lost"
        lines.append(
            f"{nid[:12]:<12} {n['workers']:>3} {busy:>4} {n.get('queued', 0):>6} "
            f"{n.get('running', 0):>5} {_fmt_count(done):>7} {_fmt_rate(rate):>7} "
            f"{_fmt_rate(mrate):>7} {n.get('agents', 0):>6} {n.get('active', 0):>6} "
            f"{_fmt_int(n.get('got', 0)):>6} {_fmt_int(n.get('given', 0)):>6} "
            f"{_fmt_opt_ms(lat.get('p50')):>6} {_fmt_opt_ms(lat.get('p99')):>6}")
        if n.get("alive"):
            for k in ("queued", "running", "agents", "active", "got", "given"):
                tot[k] += n.get(k, 0) or 0
            tot["done"] += done
            tot["rate"] += rate or 0.0
            tot["mrate"] += mrate or 0.0
    ok = dt > 0
    lines.append(
        f"{'all':<12} {sum(n['workers'] for n in alive):>3} {'':>4} {tot['queued']:>6} "
        f"{tot['running']:>5} {_fmt_count(tot['done']):>7} "
        f"{_fmt_rate(tot['rate'] if ok else None):>7} "
        f"{_fmt_rate(tot['mrate'] if ok else None):>7} {tot['agents']:>6} "
        f"{tot['active']:>6} {_fmt_int(tot['got']):>6} {_fmt_int(tot['given']):>6}")
    losses = cur.get("losses") or []
    if losses:
        lines.append("")
        lines.append("lost nodes")
        for loss in losses:
            lines.append(f"  {str(loss.get('node'))[:12]}  {loss.get('why')}: "
                         f"{_fmt_int(loss.get('tasks', 0))} tasks, "
                         f"{_fmt_int(loss.get('replaced', 0))} placed again in "
                         f"{1e3 * loss.get('replace_s', 0.0):.0f} ms")
    return "\n".join(line[:width].rstrip() for line in lines) + "\n"


# -- command line --------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="stealer top",
        description="Live view of a running stealer executor: per-worker counters and "
                    "queue depths, per-tier latency percentiles, the busiest workers.")
    p.add_argument("id", nargs="?", default=None,
                   help="executor id (Executor.id, the /dev/shm segment name) or its client "
                        "pid; default: the only running executor (several: they are listed)")
    p.add_argument("--interval", type=float, default=1.0, metavar="S",
                   help="seconds between frames (default 1.0)")
    p.add_argument("--once", action="store_true", help="print one frame and exit")
    p.add_argument("--count", type=int, default=0, metavar="N",
                   help="exit after N frames (default: until Ctrl-C)")
    p.add_argument("--prometheus", action="store_true",
                   help="print Prometheus exposition text instead of the table")
    return p


def _resolve(arg: str | None, err: TextIO, prog: str = "stealer top") -> tuple[str | None, int]:
    """The executor id to attach to, or (None, exit code) after a message on ``err``.

    ``prog`` names the command in the messages (``stealer dashboard`` resolves ids the same way).
    """
    if arg is None or arg.isdigit():
        execs = list_executors()
        if prog != "stealer top":  # (the dashboard attaches to local executors only)
            execs = [e for e in execs if e.get("kind") != "cluster"]
        if arg is not None:
            execs = [e for e in execs if e["client_pid"] == int(arg)]
        if len(execs) == 1:
            return execs[0]["id"], 0
        if not execs:
            who = f" with client pid {arg}" if arg is not None else ""
            print(f"{prog}: no running stealer executor{who} found (of this user)", file=err)
        else:
            print(format_list(execs), file=err)
            print(f"\n{prog}: {len(execs)} executors are running; pass the id of one", file=err)
        return None, 2
    return os.path.basename(arg), 0


def _emit(out: TextIO, frame: str, tty: bool, first: bool) -> None:
    if tty:
        lines = frame.rstrip("\n").split("\n")
        rows = shutil.get_terminal_size().lines
        if len(lines) > rows - 1:
            lines = [*lines[: max(1, rows - 2)], f"... ({len(lines) - rows + 2} more lines)"]
        out.write(CLEAR + "\n".join(lines) + "\n")
    else:
        out.write(("" if first else "\n") + frame)
    out.flush()


def main(argv: Sequence[str] | None = None) -> int:
    """``stealer top [ID] [--interval S] [--once] [--count N] [--prometheus]``.

    Returns 0 after the requested frames or on Ctrl-C, 1 when the executor
    cannot be attached or goes away, 2 for usage errors (including no id
    with zero or several executors running: they are listed).
    """
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    out, err = sys.stdout, sys.stderr
    if args.interval <= 0 or args.count < 0:
        print("stealer top: --interval must be > 0 and --count >= 0", file=err)
        return 2
    exec_id, code = _resolve(args.id, err)
    if exec_id is None:
        return code
    count = 1 if args.once else args.count
    if snapshot.is_cluster_id(exec_id):
        return _main_cluster(args, exec_id, count, out, err)
    try:
        seg = Segment.attach_any(exec_id)
    except ValueError as exc:
        print(f"stealer top: {exc}", file=err)
        return 2
    except FileNotFoundError:
        print(f"stealer top: no executor with id {exec_id} (not in {SHM_DIR}; it may have "
              "exited). Run `stealer top` without an id to list running executors.", file=err)
        return 1
    except (OSError, RuntimeError) as exc:
        print(f"stealer top: cannot attach to {exec_id}: {exc}", file=err)
        return 1
    gone = executor_gone(exec_id)
    if gone:
        print(f"stealer top: {gone}", file=err)
        return 1
    if args.prometheus:
        from stealer import prometheus

        fmt = prometheus.text
    else:
        fmt = None
    tty = out.isatty()
    prev: list[Stats] = []
    stalls = Stalls()  # frozen workers, seen over our own frames

    def frame() -> str | int:
        cur = collect(seg)
        stalls.observe(cur.workers, time.monotonic())
        gone = executor_gone(exec_id)  # after the read: never show a dead executor's frame
        if gone:
            if tty:
                out.write("\n")
            print(f"stealer top: {gone}", file=err)
            return 1
        width = shutil.get_terminal_size().columns if tty else 100
        text = fmt(cur) if fmt is not None else render(prev[0] if prev else None, cur, width)
        prev[:] = [cur]
        return text

    return _frames(frame, out, tty, count, args.interval)


def _main_cluster(args: argparse.Namespace, exec_id: str, count: int, out: TextIO,
                  err: TextIO) -> int:
    """``stealer top`` on a cluster executor: frames from its published snapshot."""
    if args.prometheus:
        print("stealer top: --prometheus reads a local executor's segment; a cluster "
              "executor's figures are its stats() (or this table)", file=err)
        return 2
    tty = out.isatty()
    prev: list[dict[str, Any]] = []

    def frame() -> str | int:
        try:
            cur = snapshot.read(exec_id)
        except FileNotFoundError:
            if prev and tty:
                out.write("\n")
            print(f"stealer top: cluster executor {exec_id} has exited" if prev else
                  f"stealer top: no executor with id {exec_id} (not in {SHM_DIR}; it may "
                  "have exited). Run `stealer top` without an id to list running "
                  "executors.", file=err)
            return 1
        except (OSError, ValueError) as exc:
            print(f"stealer top: cannot read {exec_id}: {exc}", file=err)
            return 1
        width = shutil.get_terminal_size().columns if tty else 100
        text = render_cluster(prev[0] if prev else None, cur, width)
        prev[:] = [cur]
        return text

    return _frames(frame, out, tty, count, args.interval)


def _frames(frame: Any, out: TextIO, tty: bool, count: int, interval: float) -> int:
    """Print ``frame()``'s text every ``interval`` until ``count`` frames (0: no end),
    Ctrl-C or a closed pipe (0), or until it returns an exit code instead of a text."""
    frames = 0
    try:
        while True:
            text = frame()
            if isinstance(text, int):
                return text
            _emit(out, text, tty, frames == 0)
            frames += 1
            if count and frames >= count:
                return 0
            _sleep(interval)
    except KeyboardInterrupt:
        if tty:
            out.write("\n")
            out.flush()
        return 0
    except BrokenPipeError:  # `stealer top | head`
        with contextlib.suppress(OSError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, out.fileno())  # so the flush at exit does not raise again
            os.close(devnull)
        return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
