"""When agents move between live nodes: the rebalancing rule.

Owns the decision only, never the moving: no Ray, no threads, no clock of its own (every
call takes ``now``), so the rule is unit-tested on its own (tests/test_cluster_policy.py).
Called by the cluster client (``stealer/cluster/moves.py``) with each load report that rides
on a node's result batch; the client does the moving, by checkpoint + restore (the agent's
state fetched, the agent stopped on its old node, spawned on the new one with that state,
the messages sent meanwhile held at the client and delivered after, in their order).

The rule:

* **A busy node**: its workers were occupied (by tasks, and by agents with messages) for at
  least ``busy`` of the time lately (``Load.busy``, a mean over time weighted to the last
  0.1 s), and more of its agents had messages waiting than it has workers (``Load.active >
  Load.workers``): agents waited for a worker, so some of them would run in parallel
  elsewhere.  Many agents on few workers is not enough; a node busy with tasks alone is not
  either (stealing moves tasks).
* **An idle node**: occupied for at most ``idle`` of the time lately, nothing queued.
* **Lasting**: a (busy, idle) pair moves anything only once each node has shown that for
  ``reports`` reports in a row spanning ``hold_s`` at least: a momentary difference never
  moves anything.  After a move both nodes start again from no streak, so the next move
  waits for fresh reports of the new situation.
* **Sooner when the evidence is clear**: the busy fraction a report carries is a mean over
  time (time constant 0.1 s), so one report already sums up the recent past.  An idle node
  whose last report (at most ``clear_idle_age_s`` old) shows at most ``clear_idle`` busy,
  no agent with messages and nothing queued or running has idled for about 0.4 s at least:
  that report alone lasts (an idle node reports only every 0.5 s, so three of them took
  1-1.5 s).  A busy node lasts once its last ``clear_reports`` reports in a row, spanning
  ``clear_hold_s``, each showed ``clear_busy`` or more with at least twice as many active
  agents as workers (``clear_busy`` 0.97 means its workers were full for about 0.35 s
  before: ``clear_age_s``, which the gain then counts in the imbalance's age).  A report
  that is not clear starts that count again; the rule above still applies.
* **Half the gap**: enough agents to even out the active agents per worker of the two
  (for nodes of equal workers, half the difference of their counts; the busy node's count
  is the fewest it showed over its streak), busiest first (the most messages since the
  client last looked), at most what the rate cap leaves (``max_per_s`` moves in any second).
* **Only movable agents**: one that keeps a state (``state_every > 0``: the client holds
  its checkpoint), whose state pickles, whose final value nobody awaits yet, and that got
  messages lately (an idle agent gains nothing by moving).
* **Only when it pays**: the gain (each moved agent's share of the busy node's workers,
  ``workers / active``, run instead on the idle node's free workers, over the imbalance's
  age so far, at most ``horizon_s``: it is expected to last as long again) must exceed
  ``gain_factor`` times the cost (for each agent the measured time of a move: from its
  state's arrival at the client to its restore's answer on the new node, ``default_move_s``
  before any was measured; plus its state's bytes twice, fetched and sent, at
  ``bandwidth``).  When the whole half gap does not pay, fewer agents may (the idle node's
  free workers cap the gain, not the cost).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from stealer.cluster.policy import Load, RoundTrip

__all__ = ["BalanceConfig", "Balancer", "Candidate"]


@dataclass(frozen=True)
class BalanceConfig:
    """The knobs of the rebalancing rule (the defaults are the cluster executor's)."""

    reports: int = 3  # reports in a row that show the imbalance
    hold_s: float = 0.5  # and it lasted this long at least
    busy: float = 0.9  # a node occupied this much of its window (or more) is busy
    idle: float = 0.25  # one occupied this much (or less), with nothing queued, is idle
    max_per_s: int = 4  # moves started in any one second at most
    horizon_s: float = 5.0  # the gain counts the imbalance's age so far, at most this
    gain_factor: float = 2.0  # move only when the gain exceeds this times the cost
    default_move_s: float = 0.02  # the time of a move before one was measured
    bandwidth: float = 200e6  # bytes/s a state travels at (fetched, then sent on)
    # clear evidence (see the module's doc): one idle report, or a short busy streak
    clear_idle: float = 0.02  # an idle report at most this busy lasts alone
    clear_idle_age_s: float = 1.0  # if it is at most this old (an idle node reports each 0.5 s)
    clear_busy: float = 0.97  # busy reports at least this busy (and active >= 2 x workers)
    clear_reports: int = 2  # this many of them in a row
    clear_hold_s: float = 0.1  # spanning this long at least
    clear_age_s: float = 0.35  # how long such a busy fraction says the node was full already


@dataclass(frozen=True)
class Candidate:
    """An agent of a busy node, as the client sees it."""

    aid: int
    recent: int  # messages it got since the client last looked (0: quiet)
    keeps_state: bool = True  # state_every > 0: the client holds its checkpoint
    state_bytes: int | None = 0  # its kept state's pickled size; None: it does not pickle
    awaited: bool = False  # somebody asked for its final value (it must end where it is)


@dataclass
class _Streak:
    kind: str  # "busy", "idle" or "" (neither)
    since: float
    reports: int
    active: int  # busy: the fewest active agents shown; idle: the most
    clear: bool = False  # the last report was clear evidence (Balancer.clear)
    last: float = 0.0  # when its last report came
    clear_n: int = 0  # busy: clear reports in a row up to the last one
    clear_since: float = 0.0  # busy: when the first of them came


class Balancer:
    """The client's side of the rule: :meth:`report` with every load report, :meth:`plan`
    for the moves to start now, :meth:`moved` with each move's measured time."""

    def __init__(self, cfg: BalanceConfig | None = None) -> None:
        self.cfg = cfg or BalanceConfig()
        self.streaks: dict[str, _Streak] = {}
        self.started: deque[float] = deque()  # when the moves of the last second started
        self.move = RoundTrip(initial_s=self.cfg.default_move_s)  # measured time of a move

    def kind(self, load: Load) -> str:
        cfg = self.cfg
        if load.busy >= cfg.busy and load.active > load.workers:
            return "busy"
        if load.busy <= cfg.idle and load.queued == 0:
            return "idle"
        return ""

    def clear(self, load: Load, kind: str) -> bool:
        """Whether the report alone is clear evidence of its kind (see the module's doc)."""
        cfg = self.cfg
        if kind == "idle":
            return (load.busy <= cfg.clear_idle and load.active == 0 and load.queued == 0
                    and load.running == 0)
        if kind == "busy":
            return load.busy >= cfg.clear_busy and load.active >= 2 * load.workers
        return False

    def report(self, now: float, load: Load) -> bool:
        """A node's load report; True when some (busy, idle) pair now lasts (a plan may
        move something)."""
        k = self.kind(load)
        c = self.clear(load, k)
        s = self.streaks.get(load.node)
        if s is None or s.kind != k:
            self.streaks[load.node] = s = _Streak(k, now, 1, load.active)
        else:
            s.reports += 1
            s.active = min(s.active, load.active) if k == "busy" else max(s.active,
                                                                          load.active)
        s.last = now
        s.clear = c
        if not c:
            s.clear_n = 0
        elif s.clear_n == 0:
            s.clear_n, s.clear_since = 1, now
        else:
            s.clear_n += 1
        return bool(k) and self.lasting(load.node, k, now) and any(
            self.lasting(n, "idle" if k == "busy" else "busy", now) for n in self.streaks)

    def forget(self, node: str) -> None:
        """A node lost, or the client moved agents from or to it."""
        self.streaks.pop(node, None)

    def lasting(self, node: str, kind: str, now: float) -> bool:
        s = self.streaks.get(node)
        cfg = self.cfg
        if s is None or s.kind != kind:
            return False
        if s.reports >= cfg.reports and now - s.since >= cfg.hold_s:
            return True
        if not s.clear:
            return False
        if kind == "idle":
            return now - s.last <= cfg.clear_idle_age_s
        return s.clear_n >= cfg.clear_reports and now - s.clear_since >= cfg.clear_hold_s

    def allowance(self, now: float) -> int:
        """Moves the rate cap allows to start now."""
        while self.started and now - self.started[0] >= 1.0:
            self.started.popleft()
        return max(0, self.cfg.max_per_s - len(self.started))

    def cost(self, c: Candidate) -> float:
        """Seconds one move of ``c`` costs: the measured move, its state's bytes twice."""
        return self.move.s + 2 * (c.state_bytes or 0) / self.cfg.bandwidth

    def moved(self, seconds: float) -> None:
        """A move ended: from its state's arrival at the client to its restore's answer."""
        self.move.add(seconds)

    def plan(self, now: float, loads: Mapping[str, Load],
             candidates: Callable[[str], Sequence[Candidate]]) -> list[tuple[int, str, str]]:
        """The moves to start now, (agent id, from, to) each; ``candidates(node)``: that
        node's agents (asked only of busy nodes with a lasting imbalance).  The moves are
        counted as started (the rate cap) and both nodes of each pair start a new streak."""
        busy = [n for n in loads if self.lasting(n, "busy", now)]
        idle = [n for n in loads if self.lasting(n, "idle", now)]
        if not busy or not idle:
            return []
        busy.sort(key=lambda n: self.streaks[n].active / max(1, loads[n].workers),
                  reverse=True)
        idle.sort(key=lambda n: loads[n].busy)
        out: list[tuple[int, str, str]] = []
        for src, dst in zip(busy, idle):
            left = self.allowance(now)
            if left <= 0:
                break
            chosen = self._pair(now, loads[src], loads[dst], candidates(src), left)
            if chosen:
                self.started.extend([now] * len(chosen))
                self.forget(src)
                self.forget(dst)
                out += [(c.aid, src, dst) for c in chosen]
        return out

    def _pair(self, now: float, src: Load, dst: Load, cands: Sequence[Candidate],
              left: int) -> list[Candidate]:
        cfg = self.cfg
        s, d = self.streaks[src.node], self.streaks[dst.node]
        ws, wd = max(1, src.workers), max(1, dst.workers)
        half_gap = (s.active * wd - d.active * ws) // (ws + wd)
        movable = [c for c in cands if c.keeps_state and c.state_bytes is not None
                   and not c.awaited and c.recent > 0]
        movable.sort(key=lambda c: (-c.recent, c.state_bytes, c.aid))
        chosen = movable[:max(0, min(half_gap, left))]
        share = ws / max(1, s.active)  # of a worker, each moved agent's on the busy node
        free = wd * max(0.0, 1.0 - dst.busy)
        age = now - max(s.since, d.since)
        if s.clear and d.clear:  # what the busy fraction says of the time before the streak
            age += cfg.clear_age_s
        age = min(age, cfg.horizon_s)
        while chosen:
            gain = age * min(free, len(chosen) * share)
            if gain > cfg.gain_factor * sum(self.cost(c) for c in chosen):
                return chosen
            chosen.pop()
        return []
