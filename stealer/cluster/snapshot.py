"""The figures of a cluster executor, published for ``stealer top`` (no Ray here).

A local executor is watched through its shared segment; a cluster client has none, so it
writes its ``stats()`` (per node: tasks, agents, steals between nodes, latency) as a small
JSON snapshot, about four times a second, to ``$STEALER_SHM_DIR`` (``/dev/shm``) under its
id, ``stealer-<client pid>-cluster-<16 hex digits>``: owner-only (0600), replaced whole at
each write (a reader never sees half of one), removed at shutdown (and, if the client died
without one, by the next cluster client of the same user).  ``stealer top`` lists these
ids beside the local executors and renders per-node rows from them (stealer/top.py).

Written by :class:`Publisher` (a thread of the cluster client, ``stealer/cluster/client.py``);
read by :func:`read` and :func:`list_snapshots`.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

from stealer.shared.shm import _alive, shm_dir

__all__ = ["NAME_RE", "Publisher", "is_cluster_id", "list_snapshots", "new_id", "read"]

NAME_RE = re.compile(r"^stealer-(\d+)-cluster-[0-9a-f]{16}$")
INTERVAL_S = 0.25


def new_id() -> str:
    return f"stealer-{os.getpid()}-cluster-{secrets.token_hex(8)}"


def is_cluster_id(name: str) -> bool:
    return NAME_RE.match(os.path.basename(name)) is not None


def path_of(name: str) -> str:
    return os.path.join(shm_dir(), os.path.basename(name))


def write(name: str, data: dict[str, Any]) -> None:
    """Replace the snapshot ``name`` with ``data`` (owner-only; atomic for readers)."""
    path = path_of(name)
    tmp = f"{path}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, separators=(",", ":"), default=str)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def read(name: str) -> dict[str, Any]:
    """The snapshot ``name``; FileNotFoundError if there is none (the client shut down)."""
    fd = os.open(path_of(name), os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd) as f:
        return json.load(f)


def remove(name: str) -> None:
    for p in (path_of(name), f"{path_of(name)}.tmp"):
        with contextlib.suppress(OSError):
            os.unlink(p)


def _ours() -> list[tuple[str, int]]:
    """(name, client pid) of this user's snapshots."""
    d = shm_dir()
    try:
        names = os.listdir(d)
    except OSError:
        return []
    uid, out = os.getuid(), []
    for name in names:
        m = NAME_RE.match(name.removesuffix(".tmp"))
        if m is None:
            continue
        try:
            if os.stat(os.path.join(d, name), follow_symlinks=False).st_uid != uid:
                continue
        except OSError:
            continue
        out.append((name, int(m.group(1))))
    return out


def cleanup_dead() -> int:
    """Remove this user's snapshots whose client is dead; how many."""
    n = 0
    for name, pid in _ours():
        if not _alive(pid):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(shm_dir(), name))
                n += 1
    return n


def list_snapshots() -> list[dict[str, Any]]:
    """The running cluster executors of this user, as ``stealer top`` lists executors:
    id, client pid, workers (of every alive node), uptime, created."""
    out = []
    now = time.time()
    for name, pid in _ours():
        if name.endswith(".tmp") or not _alive(pid):
            continue
        try:
            snap = read(name)
        except (OSError, ValueError):
            continue
        created = float(snap.get("created", 0.0))
        out.append({"id": name, "client_pid": pid, "kind": "cluster",
                    "workers": sum(n.get("workers", 0) for n in snap.get("nodes", {}).values()
                                   if n.get("alive")),
                    "uptime_s": max(0.0, now - created) if created else 0.0,
                    "created": created})
    return out


class Publisher:
    """A thread writing ``snapshot()`` to the file of ``name`` every ``interval_s``, until
    :meth:`stop` (which removes the file)."""

    def __init__(self, name: str, snapshot: Callable[[], dict[str, Any]],
                 interval_s: float = INTERVAL_S) -> None:
        self.name = name
        self._snapshot = snapshot
        self._interval = interval_s
        self._stop = threading.Event()
        cleanup_dead()
        atexit.register(self._at_exit)  # (a client that never shut down leaves nothing)
        self.publish()
        self._thread = threading.Thread(target=self._run, name="stealer-cluster-top",
                                        daemon=True)
        self._thread.start()

    def publish(self) -> None:
        write(self.name, self._snapshot())

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self.publish()
            except Exception:  # a full /dev/shm, a stats race: the next frame tries again
                pass

    def _at_exit(self) -> None:
        self._stop.set()
        self._thread.join(1)
        remove(self.name)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(5)
        remove(self.name)
        atexit.unregister(self._at_exit)
