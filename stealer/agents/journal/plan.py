"""The recovery plan: reading every shard and working out, per agent, what a recovery
restores and replays (:func:`plan`, :class:`Plan`, :class:`AgentPlan`).

Recovery works per agent: the newest snapshot whose CRC holds, then the messages it does
not cover.  A message from another agent A that A will send again when it replays (its
sequence number is above what A's own snapshot had sent) is left to A, so each sender's
messages still arrive in order.  A call whose reply is in the journal is sent again as a
one-way message (its effect) and A takes the logged reply at once.  Duplicates (a re-send
of a message already applied) are dropped by (sender, sequence number).

A row whose CRC fails is never applied, and a warning names the agent and the event.  A
damaged message cuts the agent's later messages in that shard up to the end of the
executor run (epoch) that wrote it: a recovery since then has cut it already, and what was
logged after that recovery stands.  A damaged snapshot is skipped (the newest good one is
used); a damaged page ends the read of that table there.

Called by opening.py (``open_for_client``: the plan an executor recovers with, which
stealer/client/agents.py replays), by inspection.py (``stealer journal PATH``), and by tests
and benchmarks/journal.py.
"""

from __future__ import annotations

import json
import math
import os
import sqlite3
import sys
from dataclasses import dataclass, field

from stealer.agents.jblob import sender_is_agent
from stealer.agents.journal.store import CONTROL, ControlDB, _crc, check_meta
from stealer.errors import JournalError

__all__ = ["AgentPlan", "Plan", "plan"]


@dataclass
class AgentPlan:
    uid: str
    name: str | None = None
    parent: str | None = None
    cls: str = "?"
    spawn: tuple[bytes, int] | None = None
    snap: dict | None = None  # newest valid snapshot: ver, gen, sent, seen, body, oob, ts
    snaps: int = 0
    end: tuple[int, bytes, int] | None = None
    msgs: list = field(default_factory=list)  # to replay, in order: (body, oob, sender, seq)
    events: int = 0  # rows of this agent in the journal
    replies: dict[int, tuple[int, bytes, int]] = field(default_factory=dict)

    @property
    def sent(self) -> int:
        return self.snap["sent"] if self.snap else 0

    @property
    def live(self) -> bool:
        return self.end is None and self.spawn is not None


@dataclass
class Plan:
    path: str
    agents: dict[str, AgentPlan]
    warnings: list[str]
    epochs: int
    rows: int
    last_epoch: int = 0  # the newest epoch in journal.db or in any good row of a shard


def _epoch_of(key: str) -> int:
    """The epoch a uid or sender key was made in: "3.7", "3.7/2", "t3.0.1.5", "c3"."""
    head = key.split(".", 1)[0].lstrip("ct") if isinstance(key, str) else ""
    return int(head) if head.isdigit() else 0


def _warn(warnings: list[str], text: str) -> None:
    warnings.append(text)
    print(f"stealer: journal: {text}", file=sys.stderr)


def _rows(c: sqlite3.Connection, table: str, cols: str, shard: str,
          warnings: list[str]) -> list[tuple]:
    out: list[tuple] = []
    try:
        cur = c.execute(f"SELECT id, {cols} FROM {table} ORDER BY id")
        for row in cur:
            out.append(row)
    except sqlite3.DatabaseError as exc:
        last = out[-1][0] if out else 0
        _warn(warnings, f"{shard}: table {table} is damaged after event {last} ({exc}); "
                        "the events from there on are cut")
    return out


def plan(path: str, quiet: bool = False) -> Plan:
    """Read every shard and work out, per agent, what recovery restores and replays."""
    path = os.path.abspath(os.fspath(path))
    if not os.path.isdir(path) or not os.path.exists(os.path.join(path, CONTROL)):
        if os.path.isdir(path) and not os.listdir(path):
            return Plan(path, {}, [], 0, 0)
        raise JournalError(f"{path} is not a stealer journal (no {CONTROL})")
    ctl = ControlDB(os.path.join(path, CONTROL))
    try:
        check_meta(ctl, path, False)
        epochs, top = ctl.c.execute("SELECT COUNT(*), MAX(epoch) FROM epochs").fetchone()
    finally:
        ctl.close()
    top = top or 0
    warnings: list[str] = []
    agents: dict[str, AgentPlan] = {}

    def ag(uid: str) -> AgentPlan:
        p = agents.get(uid)
        if p is None:
            p = agents[uid] = AgentPlan(uid)
        return p

    msgs: list[tuple] = []
    nrows = 0
    shards = sorted(n for n in os.listdir(path) if n.endswith(".db") and n != CONTROL)
    for si, name in enumerate(shards):
        try:
            c = sqlite3.connect(os.path.join(path, name), isolation_level=None, timeout=30.0)
            c.execute("PRAGMA query_only=1")
        except sqlite3.Error as exc:
            _warn(warnings, f"{name}: cannot be opened ({exc}); its events are cut")
            continue
        try:
            for rid, uid, nm, parent, _epoch, cls, body, oob, crc in _rows(
                    c, "spawns", "uid,name,parent,epoch,cls,body,oob,crc", name, warnings):
                nrows += 1
                if _crc(uid, nm, parent, cls, body, oob) != crc:
                    _warn(warnings, f"{name}: the spawn of agent {uid!r} (event {rid}) fails "
                                    "its checksum; the agent cannot be recovered")
                    continue
                p = ag(uid)
                if p.spawn is None:
                    p.name, p.parent, p.cls, p.spawn = nm, parent, cls, (body, oob)
                p.events += 1
                top = max(top, _epoch_of(uid))
            rows = _rows(c, "msgs", "target,sender,seq,epoch,ts,call,body,oob,crc", name,
                         warnings)
            good = [_crc(*r[1:9]) == r[9] for r in rows]
            # A damaged message's epoch is suspect, but a shard's epochs only grow along
            # its rows: the good rows around it bound it.  Its agent's messages are cut up
            # to the end of that epoch: a later epoch began with a recovery that had cut
            # it already (so its messages stand), and its own may have followed it.
            bounds: list[float] = [0.0] * len(rows)
            nxt: float = math.inf
            for i in range(len(rows) - 1, -1, -1):
                bounds[i] = nxt
                if good[i]:
                    nxt = rows[i][4]
            cut: dict[str, float] = {}  # target -> its messages up to this epoch are cut
            prev = 0
            for i, row in enumerate(rows):
                rid, target, sender, seq, epoch, ts, call, body, oob, crc = row
                nrows += 1
                if not good[i]:
                    upto = epoch if isinstance(epoch, int) and prev <= epoch <= bounds[i] \
                        else bounds[i]
                    cut[target] = max(cut.get(target, 0), upto)
                    _warn(warnings, f"{name}: a message to agent {target!r} (event {rid}, "
                                    f"from {sender!r} #{seq}) fails its checksum; that "
                                    f"agent's later messages in {name} of that executor run "
                                    "are cut")
                    continue
                prev = epoch
                top = max(top, epoch)
                if target in cut and epoch <= cut[target]:
                    continue
                ag(target).events += 1
                msgs.append((epoch, ts, si, rid, target, sender, seq, call, body, oob))
            for row in _rows(c, "snaps", "uid,ver,gen,sent,seen,ts,body,oob,crc", name,
                             warnings):
                rid, uid, ver, gen, sent, seen, ts, body, oob, crc = row
                nrows += 1
                if _crc(uid, ver, gen, sent, seen, body, oob) != crc:
                    # each snapshot stands alone: the newest good one is used (one taken
                    # after a recovery from an older one has a higher version again)
                    _warn(warnings, f"{name}: snapshot {ver} of agent {uid!r} (event {rid}) "
                                    "fails its checksum; it is skipped (the newest good "
                                    "one is used)")
                    continue
                p = ag(uid)
                p.events += 1
                p.snaps += 1
                if p.snap is None or ver > p.snap["ver"]:
                    p.snap = {"ver": ver, "gen": gen, "sent": sent, "seen": json.loads(seen),
                              "body": body, "oob": oob, "ts": ts}
            for rid, caller, seq, status, body, oob, crc in _rows(
                    c, "replies", "caller,seq,status,body,oob,crc", name, warnings):
                nrows += 1
                if _crc(caller, seq, status, body, oob) != crc:
                    _warn(warnings, f"{name}: the reply to call #{seq} of agent {caller!r} "
                                    f"(event {rid}) fails its checksum; it is called again")
                    continue
                ag(caller).replies.setdefault(seq, (status, body, oob))
            for rid, uid, status, _ts, body, oob, crc in _rows(
                    c, "ends", "uid,status,ts,body,oob,crc", name, warnings):
                nrows += 1
                if _crc(uid, status, body, oob) != crc:
                    _warn(warnings, f"{name}: the end of agent {uid!r} (event {rid}) fails "
                                    "its checksum; the agent is recovered from its snapshot")
                    continue
                p = ag(uid)
                p.events += 1
                if p.end is None:
                    p.end = (status, body, oob)
        finally:
            c.close()
    # messages: in send order; a duplicate (sender, seq) is one message
    msgs.sort(key=lambda m: m[:4])
    dup: set[tuple[str, str, int]] = set()
    for _e, _ts, _si, _rid, target, sender, seq, _call, body, oob in msgs:
        key = (target, sender, seq)
        if key in dup:
            continue
        dup.add(key)
        p = agents.get(target)
        if p is None or not p.live:
            continue
        if seq <= (p.snap["seen"].get(sender, 0) if p.snap else 0):
            continue  # its effect is in the snapshot
        src = agents.get(sender) if sender_is_agent(sender) else None
        if src is not None and src.live and seq > src.sent:
            continue  # the sender's replay sends it again (in order, calls included)
        p.msgs.append((body, oob, sender, seq))
    for uid, p in list(agents.items()):
        if p.spawn is None:
            if p.end is None and not quiet:
                _warn(warnings, f"agent {uid!r} has events but no spawn in the journal; "
                                "it is not recovered")
            continue
        # only replies a replay will ask for again
        p.replies = {s: v for s, v in p.replies.items() if s > p.sent}
    return Plan(path, agents, warnings, epochs, nrows, top)
