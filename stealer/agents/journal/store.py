"""The journal's store: the shards' writer (:class:`Shard`), ``journal.db`` (:class:`ControlDB`)
and the rows' checksums; what every other module of the journal reads and writes through.

A shard (``client.db``, ``w<k>.db``) has one writer process, in WAL mode, so a slow disk
stalls one shard, not every agent.  Its rows:

- ``spawns``: an agent's durable id (uid), name, parent, class and spawn arguments;
- ``msgs``: a message accepted for an agent (the sender's key and sequence number, the
  pickled message), written *before* the message is pushed (write-ahead): an agent can
  never have seen a message the journal does not have;
- ``snaps``: a versioned snapshot of an agent (its in-memory checkpoint: state,
  generation, counters, and which senders' messages it covers);
- ``replies``: the reply to a call an agent made, so a caller replaying after recovery
  gets the same answer without calling again;
- ``ends``: an agent finished, stopped or failed, with its final value.

Every row carries a CRC32 of its fields (:func:`_crc`; a message's also covers its epoch
and time, which order the replay): plan.py checks them.  SQLite's WAL checksums already
drop a torn tail of the log file; a shard that no longer opens for writing is moved aside
(still read by recovery) and a new one started.

Every event is committed when it happens (autocommit), so a *process* crash (SIGKILL,
OOM) of the client or of any worker loses nothing that was acknowledged.  ``durability``
says what power loss may take:

* ``"always"``: ``synchronous=FULL``; every commit is fsync'ed before the call that made
  it returns (a send returns once its message is on disk).  Nothing acknowledged is lost.
* ``"batch"`` (default): commits reach the OS at once; a thread fsyncs each shard's log
  every 5 ms (:data:`SYNC_EVERY`).  Power loss may lose the last ~5 ms of events.
* ``"none"``: the OS writes back when it likes (SQLite still syncs at its checkpoints, so
  the files stay consistent): power loss may lose the events of the last seconds.

Used by opening.py (the client's and the workers' shards and journal.db), plan.py and
inspection.py (journal.db, checksums, :func:`check_meta`); the events are written by
stealer/client/agents.py (through ``ClientJournal.shard``) and stealer/worker/agents/
(through ``WorkerJournal.shard``).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import sqlite3
import sys
import threading
import time
import zlib
from typing import Any

from stealer.errors import JournalError

__all__ = ["FORMAT", "SYNC_EVERY", "CONTROL", "Shard", "ControlDB", "check_meta"]

FORMAT = 1
SYNC_EVERY = 0.005  # seconds between the fsyncs of a shard's log under "batch"
CONTROL = "journal.db"

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
        # how far the fsyncs trail the commits (the lag a power loss could take), published
        # by publish_to: events committed, events an fsync covered, and the monotonic ns of
        # the oldest committed event no finished fsync covers (the one in flight's first, else
        # the first since it began); all under ``lock``
        self.written = 0
        self.synced = 0
        self._pending_ns = 0  # first event committed since the last fsync began (0: none)
        self._syncing_ns = 0  # first event the fsync in flight covers (0: none in flight)
        self._gauge: tuple[Any, int] | None = None  # (region, base) of J_WRITTEN.. in shm
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
            self.written += 1
            if self.mode == "always":  # synchronous=FULL: the commit was fsync'ed
                self.synced = self.written
            elif not self._pending_ns:
                self._pending_ns = time.monotonic_ns()
            if self._gauge is not None:
                self._publish()

    # -- the lag ------------------------------------------------------------------------
    def publish_to(self, region: Any, base: int) -> None:
        """Publish the shard's progress at ``base`` of a shared segment from now on (the
        three u64 words J_WRITTEN, J_SYNCED, J_OLDEST of stealer/shared/shm.py), for
        ``Executor.stats()`` and the dashboard: how far the fsyncs trail the commits."""
        with self.lock:
            self._gauge = (region, base)
            self._publish()

    def oldest_unsynced_ns(self) -> int:
        """Monotonic ns of the oldest committed event no finished fsync covers (0: none)."""
        return self._syncing_ns or self._pending_ns

    def _publish(self) -> None:  # under self.lock
        assert self._gauge is not None
        r, base = self._gauge
        r.store64(base, self.written)  # J_WRITTEN (shm.py): relaxed, read by stats
        r.store64(base + 8, self.synced)  # J_SYNCED
        r.store64(base + 16, self.oldest_unsynced_ns())  # J_OLDEST

    def _sync_loop(self) -> None:
        wal = self.path + "-wal"
        while not self.closed:
            time.sleep(SYNC_EVERY)
            with self.lock:
                if not self.dirty:
                    continue
                self.dirty = False
                covers = self.written  # every event committed so far: in the log's pages
                self._syncing_ns, self._pending_ns = self._pending_ns, 0
            synced = False
            with contextlib.suppress(OSError):
                if self._wal_fd < 0:
                    self._wal_fd = os.open(wal, os.O_RDONLY)
                os.fsync(self._wal_fd)
                synced = True
            with self.lock:
                if synced:
                    self.synced = max(self.synced, covers)
                else:  # tried again next round: those events still trail
                    self.dirty = True
                    self._pending_ns = self._syncing_ns or self._pending_ns
                self._syncing_ns = 0
                if self._gauge is not None:
                    self._publish()

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
    # would close a circle stealer -> client.executor -> agents.journal -> stealer,
    # tests/test_layers.py)
    return getattr(sys.modules.get("stealer"), "__version__", "?")

def check_meta(ctl: ControlDB, path: str, create: bool, kind: str | None = None) -> None:
    """Check ``journal.db``'s metadata (with ``create``: write it into a new journal).
    ``kind``: who may open it, ``"local"`` (an Executor's) or ``"cluster"`` (a cluster
    executor's, stealer/cluster/journal.py: the same tables, other blobs); None: any (a
    reader).  A journal without the key is a local one (written before it existed)."""
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
                           ("owner", str(os.getuid())), ("created", str(time.time()))]
                          + ([("kind", kind)] if kind not in (None, "local") else []))
        return
    if meta.get("format") != str(FORMAT):
        raise JournalError(f"the journal {path} has format {meta.get('format')!r} (written by "
                           f"stealer {meta.get('stealer')}); this stealer {_version()} reads "
                           f"format {FORMAT}: recover it with that version")
    have = meta.get("kind", "local")
    if kind is not None and have != kind:
        how = ("Executor(cluster=..., journal=PATH, recover=True)" if have == "cluster"
               else "Executor(journal=PATH, recover=True) on one machine")
        raise JournalError(f"the journal {path} was written by a {have} executor, not a "
                           f"{kind} one (their events differ); open it with {how}, or "
                           "give a new directory")
    if meta.get("owner") != str(os.getuid()):
        raise JournalError(f"the journal {path} was written by another user (uid "
                           f"{meta.get('owner')}); use one of your own")
