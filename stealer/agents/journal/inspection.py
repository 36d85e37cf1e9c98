"""The journal for people: what ``stealer journal PATH [--agent NAME]`` prints.

:func:`describe` lists the agents of a journal and what a recovery would do with each (from
plan.py's plan); :func:`agent_log` is one agent's last events across the shards.  Called
by stealer/cli.py only; nothing here writes.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import time
from typing import Any

from stealer.agents.journal.plan import AgentPlan, plan
from stealer.agents.journal.store import CONTROL, FORMAT

__all__ = ["describe", "agent_log"]


def agent_log(path: str, uid: str, limit: int = 20) -> list[tuple[str, int, str]]:
    """The last ``limit`` events of agent ``uid`` across the shards, oldest first: (shard,
    event id, description), for ``stealer journal PATH --agent``.

    Event ids count per table and per shard, so only the rows' times order events across
    them: snapshots and ends carry the wall clock, messages the writer's monotonic clock
    (converted here: exact within one boot of the machine); a spawn has no time and comes
    first, a logged reply right after the call it answers."""
    path = os.path.abspath(os.fspath(path))
    off = time.time_ns() - time.monotonic_ns()
    out: list[tuple[int, str, int, str]] = []  # (time, shard, id, description)
    calls: dict[int, int] = {}  # the agent's calls: seq -> when it was logged
    replies: list[tuple[int, str, int, str]] = []  # (seq, shard, id, description)

    def ns(v: Any) -> int:
        return v if isinstance(v, int) else 0  # a damaged row's time

    for name in sorted(n for n in os.listdir(path) if n.endswith(".db") and n != CONTROL):
        c = sqlite3.connect(os.path.join(path, name), isolation_level=None, timeout=30.0)
        try:
            q = [("SELECT id, name, parent, cls FROM spawns WHERE uid=?", lambda r: -1,
                  lambda r: f"spawned {r[3]}" + (f" named {r[1]!r}" if r[1] else "")
                  + (f" by {r[2]}" if r[2] else "")),
                 ("SELECT id, sender, seq, call, length(body), ts FROM msgs WHERE target=?",
                  lambda r: ns(r[5]) + off,
                  lambda r: f"{'call' if r[3] else 'message'} #{r[2]} from {r[1]} "
                  f"({r[4]} bytes)"),
                 ("SELECT id, ver, gen, sent, length(body), ts FROM snaps WHERE uid=?",
                  lambda r: ns(r[5]),
                  lambda r: f"snapshot v{r[1]} (generation {r[2]}, {r[3]} sent, "
                  f"{r[4]} bytes)"),
                 ("SELECT id, seq, status FROM replies WHERE caller=?", None,
                  lambda r: f"reply to its call #{r[1]} logged"
                  + (" (an error)" if r[2] else "")),
                 ("SELECT id, status, ts FROM ends WHERE uid=?", lambda r: ns(r[2]),
                  lambda r: "finished" + (" with an error" if r[1] else ""))]
            for sql, key, fmt in q:
                with contextlib.suppress(sqlite3.DatabaseError):
                    for r in c.execute(sql, (uid,)):
                        if key is None:
                            replies.append((r[1], name, r[0], fmt(r)))
                        else:
                            out.append((key(r), name, r[0], fmt(r)))
            with contextlib.suppress(sqlite3.DatabaseError):
                for seq, ts in c.execute("SELECT seq, ts FROM msgs WHERE sender=? AND call=1",
                                         (uid,)):
                    calls[seq] = ns(ts) + off
        finally:
            c.close()
    out += [(calls.get(seq, -1) + 1, name, rid, text) for seq, name, rid, text in replies]
    out.sort(key=lambda e: e[:3])
    return [(name, rid, text) for _t, name, rid, text in out[max(0, len(out) - limit):]]


def describe(path: str, agent: str | None = None, limit: int = 20) -> str:
    """What ``stealer journal PATH`` prints: the agents and what recovery would do."""
    p = plan(path, quiet=True)
    lines = []
    live = [a for a in p.agents.values() if a.live]
    done = [a for a in p.agents.values() if a.end is not None and a.spawn is not None]
    lines.append(f"journal {p.path}: format {FORMAT}, opened by {p.epochs} executor(s); "
                 f"{len(live) + len(done)} agents: {len(live)} live (recover=True resumes "
                 f"them), {len(done)} finished; {p.rows:,} events")
    for w in p.warnings:
        lines.append(f"  warning: {w}")
    if agent is not None:
        uid = next((a.uid for a in p.agents.values() if agent in (a.name, a.uid)), None)
        if uid is None:
            lines.append(f"no agent named {agent!r} (or with that uid)")
            return "\n".join(lines)
        a = p.agents[uid]
        lines.append(_agent_line_header())
        lines.append(_agent_line(a))
        lines.append(f"last {limit} events of {uid}:")
        for shard, rid, text in agent_log(path, uid, limit):
            lines.append(f"  {shard:<10} {rid:>8}  {text}")
        return "\n".join(lines)
    lines.append(_agent_line_header())
    for a in sorted(p.agents.values(), key=lambda a: _uid_key(a.uid)):
        if a.spawn is not None:
            lines.append(_agent_line(a))
    return "\n".join(lines)


def _uid_key(uid: str) -> tuple:
    return tuple(int(x) if x.isdigit() else 0 for x in uid.replace("/", ".").split("."))


def _agent_line_header() -> str:
    return (f"{'agent':<12} {'name':<16} {'class':<28} {'state':<8} {'gen':>4} "
            f"{'snapshot':>9} {'age':>9} {'events':>7}  recovery")


def _agent_line(a: AgentPlan) -> str:
    if a.snap:
        snap = f"v{a.snap['ver']}"
        age = f"{(time.time_ns() - a.snap['ts']) / 1e9:.1f} s"
        gen = str(a.snap["gen"])
    else:
        snap, age, gen = "-", "-", "0"
    if a.end is not None:
        state, rec = ("failed" if a.end[0] else "done"), "result kept"
    else:
        state = "live"
        rec = (f"from snapshot {snap}" if a.snap else "from its spawn") + \
            f" + {len(a.msgs)} message(s) to replay"
    return (f"{a.uid:<12} {(a.name or '-'):<16} {a.cls[-28:]:<28} {state:<8} {gen:>4} "
            f"{snap:>9} {age:>9} {a.events:>7}  {rec}")
