"""The agents' journal: durable events and snapshots in SQLite, and recovery plans.

``Executor(journal=PATH)`` keeps, in directory PATH:

* ``journal.db``: what the journal is (format, stealer version, owner),
  one row per executor that opened it (its *epoch*), and the handles the
  recovering executor gave its agents (workers read them to remap refs).
* ``client.db`` and ``w<k>.db``: the *shards*, one per writer process (the
  client, worker k), each in WAL mode with a single writer, so a slow disk
  stalls one shard, not every agent.  Their rows:

  - ``spawns``: an agent's durable id (uid), name, parent, class and spawn
    arguments;
  - ``msgs``: a message accepted for an agent (the sender's key and
    sequence number, the pickled message), written *before* the message is
    pushed (write-ahead): an agent can never have seen a message the
    journal does not have;
  - ``snaps``: a versioned snapshot of an agent (its in-memory checkpoint:
    state, generation, counters, and which senders' messages it covers);
  - ``replies``: the reply to a call an agent made, so a caller replaying
    after recovery gets the same answer without calling again;
  - ``ends``: an agent finished, stopped or failed, with its final value.

Every row carries a CRC32 of its fields (a message's also covers its epoch
and time, which order the replay); a row that fails it is never applied, and
a warning names the agent and the event.  A damaged message cuts the
agent's later messages in that shard up to the end of the executor run
(epoch) that wrote it: a recovery since then has cut it already, and what
was logged after that recovery stands.  A damaged snapshot is skipped (the
newest good one is used).  SQLite's WAL checksums already drop a torn tail
of the log file; a damaged page ends the read of that table there; a shard
that no longer opens for writing is moved aside (still read by recovery) and
a new one started.

Every event is committed when it happens (autocommit), so a *process*
crash (SIGKILL, OOM) of the client or of any worker loses nothing that was
acknowledged.  ``durability`` says what power loss may take:

* ``"always"``: ``synchronous=FULL``; every commit is fsync'ed before the
  call that made it returns (a send returns once its message is on disk).
  Nothing acknowledged is lost.
* ``"batch"`` (default): commits reach the OS at once; a thread fsyncs each
  shard's log every 5 ms.  Power loss may lose the last ~5 ms of events.
* ``"none"``: the OS writes back when it likes (SQLite still syncs at its
  checkpoints, so the files stay consistent): power loss may lose the
  events of the last seconds.

Recovery (:func:`plan`) works per agent: the newest snapshot whose CRC
holds, then the messages it does not cover.  A message from another agent
A that A will send again when it replays (its sequence number is above
what A's own snapshot had sent) is left to A, so each sender's messages
still arrive in order.  A call whose reply is in the journal is sent again
as a one-way message (its effect) and A takes the logged reply at once.
Duplicates (a re-send of a message already applied) are dropped by
(sender, sequence number).

Without a recovery, a worker death restarts its agents from their
in-memory checkpoints, and a caller may call again a call whose reply it had
already received.  So a callee keeps each reply to an agent's call until
the caller acknowledges it: every journaled message carries ``ack``, the
sender's sequence number when its latest checkpoint was taken, and the
callee forgets that sender's replies up to it.  The kept replies are part of
the callee's checkpoint (and snapshot), so they survive its own restart.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import math
import os
import sqlite3
import sys
import threading
import time
import zlib
from dataclasses import dataclass, field
from typing import Any

from stealer.agents.jblob import loads, pack, sender_is_agent, unpack  # noqa: F401 (re-exported)
from stealer.errors import JournalError

__all__ = ["FORMAT", "MODES", "Shard", "ControlDB", "open_for_client", "plan", "Plan",
           "AgentPlan", "pack", "unpack", "sender_is_agent"]

FORMAT = 1
MODES = ("always", "batch", "none")
SYNC_EVERY = 0.005  # seconds between the fsyncs of a shard's log under "batch"
MIN_FREE = 8 << 20  # bytes the journal's disk must have free at start
CONTROL = "journal.db"
LOCK = "LOCK"
OWNED = (CONTROL, LOCK, "client.db")

SCHEMA = """
CREATE TABLE IF NOT EXISTS spawns(id INTEGER PRIMARY KEY, uid TEXT, name TEXT, parent TEXT,
    epoch INTEGER, cls TEXT, body BLOB, oob INTEGER, crc INTEGER);
CREATE TABLE IF NOT EXISTS msgs(id INTEGER PRIMARY KEY, target TEXT, sender TEXT,
    seq INTEGER, epoch INTEGER, ts INTEGER, call INTEGER, body BLOB, oob INTEGER,
    crc INTEGER);
CREATE TABLE IF NOT EXISTS snaps(id INTEGER PRIMARY KEY, uid TEXT, ver INTEGER,
    gen INTEGER, sent INTEGER, seen TEXT, ts INTEGER, body BLOB, oob INTEGER, crc INTEGER);
CREATE TABLE IF NOT EXISTS replies(id INTEGER PRIMARY KEY, caller TEXT, seq INTEGER,
    status INTEGER, body BLOB, oob INTEGER, crc INTEGER);
CREATE TABLE IF NOT EXISTS ends(id INTEGER PRIMARY KEY, uid TEXT, status INTEGER,
    ts INTEGER, body BLOB, oob INTEGER, crc INTEGER);
"""


def _crc(*fields: Any) -> int:
    c = 0
    for f in fields:
        if isinstance(f, (bytes, bytearray, memoryview)):
            c = zlib.crc32(f, c)
        else:
            c = zlib.crc32(repr(f).encode(), c)
    return c


def _explain(exc: BaseException, path: str) -> JournalError:
    text = str(exc)
    if (isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)) or \
            "full" in text:
        return JournalError(f"the journal's disk is full ({path}: {text}); free some space or "
                            "give Executor(journal=...) a directory on another disk")
    if isinstance(exc, PermissionError) or "readonly" in text or "read-only" in text:
        return JournalError(f"the journal {path} is not writable ({text}); give a directory "
                            "you can write to")
    return JournalError(f"the journal {path} failed: {type(exc).__name__}: {text}")


def _damaged(exc: sqlite3.DatabaseError) -> bool:
    """SQLite found the file damaged (SQLITE_CORRUPT, SQLITE_NOTADB): not full, read-only,
    locked or unopenable, which are the user's to fix."""
    code = getattr(exc, "sqlite_errorcode", None)  # Python >= 3.11
    if code is not None:
        return code & 0xFF in (11, 26)
    return "malformed" in str(exc) or "not a database" in str(exc)


def _move_aside(path: str, epoch: int) -> str:
    """Rename damaged shard ``path`` (with its log) to ``<name>.damaged-<epoch>[.n].db``."""
    base, n = path[:-3], 0
    while True:
        aside = f"{base}.damaged-{epoch}{f'.{n}' if n else ''}.db"
        if not os.path.exists(aside):
            break
        n += 1
    os.replace(path, aside)
    if os.path.exists(path + "-wal"):  # its log holds pages of that file: it goes along
        os.replace(path + "-wal", aside + "-wal")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path + "-shm")  # an index of that log (SQLite rebuilds it)
    return aside


class Shard:
    """One writer's database (client.db, w<k>.db): every event committed as it happens."""

    def __init__(self, path: str, mode: str, epoch: int) -> None:
        self.path = path
        self.mode = mode
        self.epoch = epoch
        self.lock = threading.Lock()
        self.dirty = False
        self.closed = False
        self._wal_fd = -1
        try:
            try:
                self.c = self._open()
            except sqlite3.DatabaseError as exc:
                if not _damaged(exc):
                    raise
                # a damaged shard (torn page, cut file) is never written again: recovery
                # reads what it can of it under its new name (still "*.db"); a new one starts
                aside = _move_aside(path, epoch)
                print(f"stealer: journal: {os.path.basename(path)} is damaged ({exc}); kept "
                      f"as {os.path.basename(aside)} (recovery reads what it can of it), and "
                      "a new one is started", file=sys.stderr)
                self.c = self._open()
        except (sqlite3.Error, OSError) as exc:
            raise _explain(exc, path) from exc
        self.syncer: threading.Thread | None = None
        if mode == "batch":
            self.syncer = threading.Thread(target=self._sync_loop, daemon=True,
                                           name="stealer-journal-sync")
            self.syncer.start()

    def _open(self) -> sqlite3.Connection:
        c = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False,
                            timeout=30.0)
        try:
            os.chmod(self.path, 0o600)
            c.execute("PRAGMA journal_mode=WAL")
            c.execute("PRAGMA synchronous=" + ("FULL" if self.mode == "always" else "NORMAL"))
            c.executescript(SCHEMA)
        except BaseException:
            c.close()
            raise
        return c

    def _w(self, sql: str, params: tuple) -> None:
        with self.lock:
            if self.closed:
                raise JournalError(f"the journal shard {self.path} is closed")
            try:
                self.c.execute(sql, params)
            except sqlite3.Error as exc:
                raise _explain(exc, self.path) from exc
            self.dirty = True

    def _sync_loop(self) -> None:
        wal = self.path + "-wal"
        while not self.closed:
            time.sleep(SYNC_EVERY)
            if not self.dirty:
                continue
            self.dirty = False
            with contextlib.suppress(OSError):
                if self._wal_fd < 0:
                    self._wal_fd = os.open(wal, os.O_RDONLY)
                os.fsync(self._wal_fd)

    def sync(self) -> None:
        """fsync the log now (the sync thread's work, for a clean close)."""
        if self.mode == "none" or self.closed:
            return
        with contextlib.suppress(OSError):
            fd = os.open(self.path + "-wal", os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def close(self) -> None:
        with self.lock:
            if self.closed:
                return
            self.closed = True
            with contextlib.suppress(sqlite3.Error):
                self.c.close()
        self.sync()
        if self._wal_fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._wal_fd)

    # -- events ---------------------------------------------------------------------------
    def spawn(self, uid: str, name: str | None, parent: str | None, cls: str, body: bytes,
              oob: int) -> None:
        self._w("INSERT INTO spawns(uid,name,parent,epoch,cls,body,oob,crc) VALUES "
                "(?,?,?,?,?,?,?,?)", (uid, name, parent, self.epoch, cls, body, oob,
                                      _crc(uid, name, parent, cls, body, oob)))

    def msg(self, target: str, sender: str, seq: int, call: bool, body: bytes,
            oob: int) -> None:
        ts = time.monotonic_ns()
        self._w("INSERT INTO msgs(target,sender,seq,epoch,ts,call,body,oob,crc) VALUES "
                "(?,?,?,?,?,?,?,?,?)",
                (target, sender, seq, self.epoch, ts, int(call), body, oob,
                 _crc(target, sender, seq, self.epoch, ts, int(call), body, oob)))

    def snap(self, uid: str, ver: int, gen: int, sent: int, seen: dict, body: bytes,
             oob: int) -> None:
        s = json.dumps(seen, separators=(",", ":"), sort_keys=True)
        self._w("INSERT INTO snaps(uid,ver,gen,sent,seen,ts,body,oob,crc) VALUES "
                "(?,?,?,?,?,?,?,?,?)", (uid, ver, gen, sent, s, time.time_ns(), body, oob,
                                        _crc(uid, ver, gen, sent, s, body, oob)))

    def reply(self, caller: str, seq: int, status: int, body: bytes, oob: int) -> None:
        self._w("INSERT INTO replies(caller,seq,status,body,oob,crc) VALUES (?,?,?,?,?,?)",
                (caller, seq, status, body, oob, _crc(caller, seq, status, body, oob)))

    def end(self, uid: str, status: int, body: bytes, oob: int) -> None:
        self._w("INSERT INTO ends(uid,status,ts,body,oob,crc) VALUES (?,?,?,?,?,?)",
                (uid, status, time.time_ns(), body, oob, _crc(uid, status, body, oob)))


class ControlDB:
    """journal.db: meta, epochs, and the handles a recovering executor gave its agents."""

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            self.c = sqlite3.connect(path, isolation_level=None, check_same_thread=False,
                                     timeout=30.0)
            self.c.execute("PRAGMA journal_mode=WAL")
            self.c.executescript(
                "CREATE TABLE IF NOT EXISTS meta(key TEXT PRIMARY KEY, value TEXT);"
                "CREATE TABLE IF NOT EXISTS epochs(epoch INTEGER PRIMARY KEY, pid INTEGER, "
                "started INTEGER, workers INTEGER);"
                "CREATE TABLE IF NOT EXISTS handles(epoch INTEGER, uid TEXT, handle INTEGER,"
                " PRIMARY KEY(epoch, uid));")
        except sqlite3.Error as exc:
            raise _explain(exc, path) from exc

    def meta(self) -> dict[str, str]:
        return dict(self.c.execute("SELECT key, value FROM meta"))

    def handles(self, epoch: int) -> dict[str, int]:
        return dict(self.c.execute("SELECT uid, handle FROM handles WHERE epoch=?", (epoch,)))

    def close(self) -> None:
        with contextlib.suppress(sqlite3.Error):
            self.c.close()


def _version() -> str:
    # the package is loaded before any of its modules: read, not imported (an import
    # would close a circle stealer -> executor -> journal -> stealer, tests/test_layers.py)
    return getattr(sys.modules.get("stealer"), "__version__", "?")


def check_dir(path: str, create: bool) -> str:
    """The journal directory, checked: ours, writable, a journal or empty, disk not full."""
    path = os.path.abspath(os.fspath(path))
    if not os.path.exists(path):
        if not create:
            raise JournalError(f"there is no journal at {path}")
        try:
            os.makedirs(path, mode=0o700)
        except OSError as exc:
            raise _explain(exc, path) from exc
    if not os.path.isdir(path):
        raise JournalError(f"the journal {path} is not a directory; give a directory "
                           "(it is created if missing)")
    st = os.stat(path)
    if st.st_uid != os.getuid():
        raise JournalError(f"the journal {path} belongs to another user (uid {st.st_uid}); "
                           "a journal holds pickled state: use one of your own")
    if create and not os.access(path, os.W_OK | os.X_OK):
        raise JournalError(f"the journal directory {path} is not writable; give a "
                           "directory you can write to")
    names = set(os.listdir(path))
    if names and CONTROL not in names:
        raise JournalError(f"{path} is not a stealer journal (it holds "
                           f"{', '.join(sorted(names)[:3])}...); give an empty or new "
                           "directory")
    if create:
        vfs = os.statvfs(path)
        if vfs.f_bavail * vfs.f_frsize < MIN_FREE:
            raise JournalError(f"the journal's disk is full ({path} has "
                               f"{vfs.f_bavail * vfs.f_frsize} bytes free); free some space "
                               "or use a directory on another disk")
    return path


def check_meta(ctl: ControlDB, path: str, create: bool) -> None:
    try:
        meta = ctl.meta()
    except sqlite3.Error as exc:
        raise JournalError(f"{path}/{CONTROL} is not a readable stealer journal "
                           f"({exc}); it may be damaged") from exc
    if not meta:
        if not create:
            raise JournalError(f"{path} is not a stealer journal (no metadata)")
        ctl.c.executemany("INSERT INTO meta VALUES (?,?)",
                          [("format", str(FORMAT)), ("stealer", _version()),
                           ("owner", str(os.getuid())), ("created", str(time.time()))])
        return
    if meta.get("format") != str(FORMAT):
        raise JournalError(f"the journal {path} has format {meta.get('format')!r} (written by "
                           f"stealer {meta.get('stealer')}); this stealer {_version()} reads "
                           f"format {FORMAT}: recover it with that version")
    if meta.get("owner") != str(os.getuid()):
        raise JournalError(f"the journal {path} was written by another user (uid "
                           f"{meta.get('owner')}); use one of your own")


def _lock_file(path: str, what: str, wait: float) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    end = time.monotonic() + wait
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() >= end:
                with contextlib.suppress(OSError):
                    holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
                os.close(fd)
                raise JournalError(f"{what} (process {holder or '?'}); stop it first, or "
                                   "use another directory") from None
            time.sleep(0.05)


def lock_shard(path: str) -> int:
    """A worker holds ``w<k>.lock`` while it writes ``w<k>.db`` (its predecessor, if
    any, is dead: the lock was released with it)."""
    fd = _lock_file(path, "another process writes this journal shard", 10.0)
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd


@dataclass
class ClientJournal:
    path: str
    mode: str
    epoch: int
    lock_fd: int
    ctl: ControlDB
    shard: Shard

    def close(self) -> None:
        self.shard.close()
        self.ctl.close()
        with contextlib.suppress(OSError):
            os.close(self.lock_fd)


def open_for_client(path: str, mode: str, workers: int,
                    recover: bool) -> tuple[ClientJournal, Plan]:
    """Lock the journal for a new executor, read what it holds, and start its epoch."""
    if mode not in MODES:
        raise ValueError(f"durability must be one of {', '.join(map(repr, MODES))}, not "
                         f"{mode!r}")
    path = check_dir(path, True)
    fd = _lock_file(os.path.join(path, LOCK),
                    f"the journal {path} is held by another live executor", 0.0)
    ctl = None
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        # workers of a dead executor may still be finishing their current step: wait for
        # them to let go of their shards (they exit once they notice their client died)
        for name in sorted(os.listdir(path)):
            if name.endswith(".lock") and name.startswith("w"):
                os.close(_lock_file(os.path.join(path, name),
                                    f"a worker of a dead executor still writes {path}", 15.0))
        fresh = not os.path.exists(os.path.join(path, CONTROL))
        ctl = ControlDB(os.path.join(path, CONTROL))
        os.chmod(ctl.path, 0o600)
        check_meta(ctl, path, True)
        p = Plan(path, {}, [], 0, 0) if fresh else plan(path, quiet=not recover)
        live = sum(1 for a in p.agents.values() if a.live)
        if live and not recover:
            raise JournalError(f"the journal {path} holds {live} live agents of an earlier "
                               "executor: pass recover=True (or use stealer.recover(PATH)) "
                               "to resume them, or give a new directory")
        row = ctl.c.execute("SELECT MAX(epoch) FROM epochs").fetchone()
        # the shards' epochs too: a journal.db that lost its rows must not hand out
        # the uids ("<epoch>.<n>") of agents that are in the shards
        epoch = max(row[0] or 0, p.last_epoch) + 1
        ctl.c.execute("INSERT INTO epochs VALUES (?,?,?,?)",
                      (epoch, os.getpid(), time.time_ns(), workers))
        shard = Shard(os.path.join(path, "client.db"), mode, epoch)
    except BaseException:
        if ctl is not None:
            ctl.close()
        os.close(fd)
        raise
    return ClientJournal(path, mode, epoch, fd, ctl, shard), p


# -- reading: what recovery will do -------------------------------------------------------
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
            cut: set[str] = set()
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


class WorkerJournal:
    """A worker's side of the journal: its shard (``w<k>.db``, locked while it lives),
    its plain tasks' sender key, and the handles a recovering client gave agents."""

    def __init__(self, path: str, mode: str, epoch: int, k: int, incarnation: int) -> None:
        self.path = path
        self.epoch = epoch
        self.lock_fd = lock_shard(os.path.join(path, f"w{k}.lock"))
        self.shard = Shard(os.path.join(path, f"w{k}.db"), mode, epoch)
        self.task_key = f"t{epoch}.{k}.{incarnation}"
        self.task_seq = 0
        self.task_spawned = 0
        self._handles: dict[str, int] | None = None

    def handle(self, uid: str) -> int | None:
        """The handle the recovering client gave agent ``uid`` in this epoch (None: it was
        not recovered).  Read once: the client wrote them all before any agent ran."""
        if self._handles is None:
            ctl = ControlDB(os.path.join(self.path, CONTROL))
            try:
                self._handles = ctl.handles(self.epoch)
            finally:
                ctl.close()
        return self._handles.get(uid)

    def close(self) -> None:
        self.shard.close()
        with contextlib.suppress(OSError):
            os.close(self.lock_fd)


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
