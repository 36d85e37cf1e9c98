"""Is the client that started this worker still alive?  (For every start method.)

A worker whose client died (kill -9, OOM killer) must remove the segment and
exit; nobody else will.  The worker's *parent* says nothing about that: with
the ``forkserver`` start method the parent is the fork server, with ``spawn``
and ``fork`` it is the client, and a reparented process's parent is init or
a subreaper.  So the worker watches the client *by identity*:

* The client passes its pid and its start time (field 22 of
  ``/proc/<pid>/stat``, clock ticks since boot) in the worker's arguments.
* At start the worker opens a pidfd on that pid (``os.pidfd_open``, Linux
  >= 5.3) and then checks that the process at the pid has that start time.
  A pidfd names one process for good, and the client outlives the pidfd's
  opening if it is still there after it, so a recycled pid is caught here.
* Later, :meth:`ProcessWatch.gone` polls the pidfd: readable means exited.
* Without ``pidfd_open`` (older kernels, seccomp filters) it falls back to
  ``os.kill(pid, 0)`` plus the start time and state from ``/proc``.

Deciding "dead" is destructive (the worker unlinks the segment), so only
positive evidence counts: no such process, a different start time, or a
zombie.  When nothing can be read, the client is taken to be alive; the
next executor's ``cleanup_stale`` removes whatever is left.

``prctl(PR_SET_PDEATHSIG)`` is not used: it fires on the death of the
parent, which for ``forkserver`` is the wrong process.

The client (stealer/client/pool.py) reads its own pid and start time into the worker's
arguments; the worker (stealer/worker/loop.py) watches with :class:`ProcessWatch`.
"""

from __future__ import annotations

import os
import select

__all__ = ["ProcessWatch", "start_time"]


def _stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks since boot) of ``pid``, or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses; the last ")" ends it
        fields = data[data.rindex(b")") + 2 :].split()
        return fields[0].decode(), int(fields[19])  # fields 3 and 22 of proc(5)
    except (OSError, ValueError, IndexError):
        return None


def start_time(pid: int) -> int | None:
    """When ``pid`` started (clock ticks since boot, /proc), or None if unknown."""
    st = _stat(pid)
    return None if st is None else st[1]


class ProcessWatch:
    """Watches one process, named by pid and start time, until it exits."""

    def __init__(self, pid: int, start: int | None) -> None:
        self.pid = pid
        self.start = start
        self.fd: int | None = None
        self._poll: select.poll | None = None
        self._gone = False
        try:
            self.fd = os.pidfd_open(pid)
        except ProcessLookupError:
            self._gone = True
            return
        except (AttributeError, OSError):
            self.fd = None  # no pidfd on this system: poll by pid and start time
        else:
            self._poll = select.poll()
            self._poll.register(self.fd, select.POLLIN)
        # The pidfd names whatever had the pid when it was opened: make sure that was ours.
        if not self._same():
            self._gone = True

    def _same(self) -> bool:
        """False only on evidence that the process at ``pid`` is not (or no longer) ours."""
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass  # another user's process now, or we changed uid: let the start time decide
        st = _stat(self.pid)
        if st is None:
            return True  # no /proc: no evidence either way
        state, start = st
        if state in ("Z", "X"):
            return False  # exited; its parent has not reaped it yet
        return self.start is None or start == self.start

    def gone(self) -> bool:
        """True once the watched process has exited (checked without blocking)."""
        if self._gone:
            return True
        if self._poll is not None:
            self._gone = bool(self._poll.poll(0))  # a pidfd is readable once its process exited
        else:
            self._gone = not self._same()
        return self._gone

    def close(self) -> None:
        if self.fd is not None:
            if self._poll is not None:
                self._poll.unregister(self.fd)
                self._poll = None
            os.close(self.fd)
            self.fd = None
