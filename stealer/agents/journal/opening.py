"""Opening the journal: the directory's checks, the locks, and each process's handle on it.

:func:`open_for_client` is what ``Executor(journal=PATH)`` (stealer/client/executor.py)
calls: it locks ``PATH/LOCK`` (one live executor per journal), waits for the workers of a
dead executor to let go of their shards, reads the recovery plan (plan.py), starts the
executor's epoch in ``journal.db`` and opens ``client.db``; the :class:`ClientJournal` it
returns is held by stealer/client/pool.py and written by stealer/client/agents.py.
:class:`WorkerJournal` is a worker's side (stealer/worker/loop.py opens it, the agents'
host in stealer/worker/agents/ writes it): its shard ``w<k>.db``, locked by ``w<k>.lock``
while the worker lives.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from dataclasses import dataclass

from stealer.agents.journal.plan import Plan, plan
from stealer.agents.journal.store import CONTROL, ControlDB, Shard, _explain, check_meta
from stealer.errors import JournalError

__all__ = ["MODES", "ClientJournal", "WorkerJournal", "open_for_client", "check_dir",
           "lock_shard"]

MODES = ("always", "batch", "none")
MIN_FREE = 8 << 20  # bytes the journal's disk must have free at start
LOCK = "LOCK"


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


def open_for_client(path: str, mode: str, workers: int, recover: bool,
                    kind: str = "local") -> tuple[ClientJournal, Plan]:
    """Lock the journal for a new executor, read what it holds, and start its epoch.
    ``kind``: ``"local"`` (an Executor) or ``"cluster"`` (stealer/cluster/journal.py);
    a journal of the other kind is refused."""
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
        check_meta(ctl, path, True, kind)
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
