"""The client's handling of a dead worker: what its exit means, and the recovery of
everything it held.

Owns the messages for an exit (:func:`describe_exit`, :func:`describe_start_failure`,
:func:`exited_by_itself`; still importable from stealer.client.pool) and the
:class:`WorkerDeaths` mixin of stealer/client/pool.py's ``_Pool``, whose state it shares:
``on_death`` (called by the result thread's ``check_workers`` when a worker's sentinel
fires: drain its completion ring, recover, start a replacement or break the pool),
``recover`` (the rules are stealer/shared/recovery.py's: this reads the dead worker's current,
lease and ping words and scans for records it held), ``repair_rings`` (a ring claim it
cut in two, stealer/client/ringfix.py; also retried by ``check_workers``) and the completion of
root tasks it left DONE or that recovery failed.
"""

from __future__ import annotations

import signal
from typing import Any

from stealer.client import ringfix
from stealer.errors import AgentError, AgentStopped, StepTimeout, WorkerCrashedError
from stealer.shared import failpoints as FP
from stealer.shared._layout import (
    F_AGENT,
    K_MASK,
    K_REPLY,
    K_ROOT,
    S_DONE,
    S_FREEING,
    S_RECOVERING,
    S_RUNNING,
)
from stealer.shared.records import Outcome
from stealer.shared.recovery import reply_slot
from stealer.shared.shm import (
    H_SHUTDOWN,
    LEASE_SLOTS,
    STATE_EXITING,
    STATE_INIT_FAILED,
    STATE_RETIRED,
    STATE_STARTING,
    W_ALLOC,
    W_CURRENT,
    W_LEASE,
    W_PING_IN,
    W_PING_OUT,
    W_RING_OP,
    W_RING_POS,
    W_RING_VAL,
    W_STATE,
)

__all__ = ["WorkerDeaths", "describe_exit", "describe_start_failure", "exited_by_itself"]

MAX_EARLY_DEATHS = 3  # a worker slot that dies this many times before starting breaks the pool


def describe_exit(k: int, pid: int | None, code: int | None) -> str:
    who = f"worker {k} (pid {pid})"
    if code is None:
        return f"{who} stopped"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        hint = {
            "SIGKILL": "killed from outside: the kernel's OOM killer (check `dmesg`), a "
            "timeout, or kill -9",
            "SIGSEGV": "a crash in native code (a C extension, ctypes, or a stack overflow)",
            "SIGBUS": "a crash in native code, or /dev/shm ran out of space",
            "SIGABRT": "the interpreter or a C library aborted (see the worker's stderr)",
        }.get(name, "a signal from the task or from outside")
        return f"{who} was killed by {name} ({hint})"
    return (f"{who} exited with code {code} while running it (a task called os._exit() or "
            "the interpreter aborted; see the worker's stderr)")


_CRASH_SIGNALS = frozenset(s.value for s in (signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS,
                                             signal.SIGILL, signal.SIGFPE))


def exited_by_itself(code: int | None) -> bool:
    """An exit code, or a signal the process raised itself (a crash), not a kill from outside."""
    return code is not None and (code >= 0 or -code in _CRASH_SIGNALS)


def describe_start_failure(k: int, pid: int | None, code: int | None) -> str:
    how = describe_exit(k, pid, code).split(" while running it")[0]
    return (f"{how} before it was ready (see its traceback on stderr). With the 'spawn' and "
            "'forkserver' start methods the main module is re-imported in each worker: run "
            "from a file (not stdin) and guard the entry point with "
            "`if __name__ == '__main__':`")


class WorkerDeaths:
    """Mixed into _Pool, whose attributes these methods use (the result thread's)."""

    region: Any
    layout: Any
    native: bool
    arena: Any
    rec: Any
    pings: Any
    idle: Any
    agents: Any
    procs: list[Any]
    completions: list[Any]
    futures: dict[int, Any]
    hung: dict[int, str]
    crashes: int
    early_deaths: list[int]
    step_killed: dict[int, int]
    ring_caps: dict[int, int]
    ring_fill: Any
    ring_pending: list[tuple[int, int, int]]
    rings_repaired: int

    def unwatch(self, p: Any) -> None:  # (_Pool's)
        raise NotImplementedError

    def start_worker(self, k: int) -> None:  # (_Pool's)
        raise NotImplementedError

    def set_broken(self, msg: str) -> None:  # (_Pool's)
        raise NotImplementedError

    def complete_batch(self, hs: list[int]) -> None:  # (_Pool's, or its native twin)
        raise NotImplementedError

    def consume(self, ring: Any, limit: int) -> int:  # (_Pool's)
        raise NotImplementedError

    def complete_taken(self, h: int, kind: int, status: int, fid: int, data: Any) -> None:
        raise NotImplementedError  # (_Pool's)

    def resolve(self, f: Any, status: int, value: Any) -> None:  # (_Pool's)
        raise NotImplementedError

    def on_death(self, k: int, p: Any) -> None:
        self.unwatch(p)
        p.join(1.0)
        code = p.exitcode
        self.procs[k] = None
        r = self.region
        base = self.layout.worker(k)
        state = r.load32(base + W_STATE)
        holder = getattr(r.lock, "holder", None) if not self.native else None
        if holder is not None and p.pid and holder() == p.pid:
            self.set_broken(
                f"{describe_exit(k, p.pid, code).split(' while running it')[0]} while holding "
                "the lock of stealer's pure-Python queues, which are not kill-safe; the "
                "executor cannot go on. Install stealer with its native extension (a C "
                "compiler and Cython at install time) for crash safety.")
            return
        self.drain(k)  # every completion it published, before its words are read
        if FP.ON:
            FP.hit("client.after_drain")
        self.idle.forget(k)
        if state == STATE_INIT_FAILED:  # the worker says so; its exit code alone proves nothing
            self.set_broken("the initializer raised an exception in a worker process (its "
                            "traceback is on stderr); the executor cannot start workers")
            return
        if state == STATE_STARTING:
            desc = describe_start_failure(k, p.pid, code)
        else:
            desc = describe_exit(k, p.pid, code)
        desc = self.hung.pop(k, None) or desc  # killed by check_hangs: say so
        self.recover(k, desc)
        if state == STATE_EXITING and r.load32(H_SHUTDOWN):
            return
        if state == STATE_RETIRED and code == 0:
            self.start_worker(k)  # max_tasks_per_child reached: a planned replacement
            return
        self.crashes += 1
        if state == STATE_STARTING and exited_by_itself(code):
            # Only a worker that failed to start by itself (an import error, a bad
            # __main__) counts; one killed from outside while starting does not.
            self.early_deaths[k] += 1
            if self.early_deaths[k] >= MAX_EARLY_DEATHS:
                self.set_broken(f"{desc}, {MAX_EARLY_DEATHS} times in a row; the executor "
                                "cannot start workers")
                return
        elif state != STATE_STARTING:
            self.early_deaths[k] = 0
        if not r.load32(H_SHUTDOWN):
            self.start_worker(k)

    def repair_rings(self, k: int = -1) -> None:
        """Dead worker ``k``'s half-done ring claim (and any still pending) repaired, unless
        a live worker's intent names the same claim: then it waits for the next call."""
        r = self.region
        L = self.layout
        claims = self.ring_pending
        if k >= 0:
            base = L.worker(k)
            claims.append((r.load64(base + W_RING_OP), r.load64(base + W_RING_POS),
                           r.load64(base + W_RING_VAL)))
        live = [(r.load64(L.worker(j) + W_RING_OP), r.load64(L.worker(j) + W_RING_POS))
                for j, p in enumerate(self.procs) if p is not None and j != k]
        self.ring_pending = []
        for c in claims:
            done = ringfix.repair(r, self.ring_caps, c[0], c[1], live, c[2], self.ring_fill,
                                  self.rec.give_back, self.rec.owned)
            if done == ringfix.PENDING:
                self.ring_pending.append(c)
            self.rings_repaired += done == ringfix.DONE

    def drain(self, k: int) -> None:
        self.consume(self.completions[k], 1 << 30)

    def recover(self, k: int, desc: str) -> None:
        """Worker ``k`` is dead and its ring drained: settle every record it held.

        The rules are stealer/shared/recovery.py's; this reads the dead worker's
        current and lease words and scans for records held by it.
        """
        r = self.region
        a = self.arena
        rec = self.rec
        who = k + 1
        base = self.layout.worker(k)
        self.repair_rings(k)  # first: a ring it stopped must flow for what follows
        words = [r.load64(base + W_CURRENT)]
        words += [r.load64(base + W_LEASE + 8 * i) for i in range(LEASE_SLOTS)]
        for h in dict.fromkeys(v - 1 for v in words if v):
            if FP.ON:
                FP.hit("client.recovery")
            rec.leased(h, who)  # QUEUED: again on the injector; CANCELLED/FREEING: freed
        took = r.load64(base + W_ALLOC)  # acquire; the dead worker's last free-ring pop
        if took:
            rec.allocated(took - 1)  # FREE in that generation: never set up, freed
        # Pings it held (its inbox, its last pop) or half-sent (recovery.py Pings)
        rec.dead_pings(k, r.load64(base + W_PING_IN), r.load64(base + W_PING_OUT))
        # Tasks it was running and fork-join frames it held: their ping bits cleared before
        # their children are looked at (below, in one scan), so a child done after that
        # pings again (the replacement, which then recovers the frame).
        held = {state: rec.held_by(who, (state,)) for state in (S_RUNNING, S_RECOVERING)}
        frames = [h for hs in held.values() for h in hs]
        for h in frames:
            self.pings.clear(h)
        # Results stored but maybe not published (the ring was drained: roots DONE|who
        # are unpublished; children: ping their parents again; a ping already on its way
        # is not sent twice, and frames of the dead worker are looked at below).
        parents = set()
        for h in rec.held_by(who, (S_DONE,)):
            kind, _status, link = a.kind_link(a.off(h))
            if kind & K_MASK == K_ROOT:
                self.complete_one(h)
            elif kind & K_MASK == K_REPLY:
                self.agents.dir.notify(link)  # a reply its caller may not have heard of
            else:
                parents.add(link)
        for parent in parents.difference(frames):
            self.pings.ping(parent)
        for h in rec.held_by(who, (S_FREEING,)):
            a.free(h)  # a release it began (payload fields are zeroed before they are dropped)
        # An agent whose step ignored its step_timeout: we killed the worker for it; it
        # fails with StepTimeout (running it again would get stuck again).
        stuck = self.step_killed.pop(k, None)
        if stuck is not None and a.tr.take_over(stuck, S_RUNNING, who, 0) is Outcome.OK:
            rec.fail(stuck, StepTimeout(
                f"a step of agent {stuck:#x} ignored its step_timeout (stuck in C code?); "
                f"its worker was killed and replaced", stuck), self.complete_failed_root)
        # Tasks it was running, and fork-join frames it held.
        kids = rec.children_of(frames)
        for state, hs in held.items():  # RECOVERING: it died recovering another's
            # Reply slots first: each goes back to QUEUED (orphan), so an agent failed for
            # good below (out of retries) then fails the calls in its mailbox, that one
            # included; left RUNNING, abandon could not fail it, and the call would hang.
            hs = sorted(hs, key=lambda h: not reply_slot(a.mm, a.off(h)))
            for h in hs:
                if FP.ON:
                    FP.hit("client.recovery")
                rec.orphan(h, who, desc, self.complete_failed_root, state, kids.get(h, []))
        r.store64(base + W_CURRENT, 0)  # settled: nobody may act on these words again
        for i in range(LEASE_SLOTS):
            r.store64(base + W_LEASE + 8 * i, 0)
        r.store64(base + W_ALLOC, 0)

    def complete_one(self, h: int) -> None:
        kind, status, fid, data = self.arena.complete_take(h)
        self.complete_taken(h, kind, status, fid, data)

    def complete_failed_root(self, h: int, status: int, value: Any) -> None:
        """Recovery gave up on root task ``h`` (claimed by us): fail its future, free it."""
        a = self.arena
        kind, _st, fid = a.kind_link(a.off(h))
        exc, _tb = value
        if kind & F_AGENT:
            self.agents.abandon(h, AgentStopped(
                f"agent {h:#x} failed: {exc}", h) if not isinstance(exc, AgentError) else exc)
        a.free(h)
        f = self.futures.pop(fid, None)
        if f is not None:
            if not isinstance(exc, AgentError):
                exc = WorkerCrashedError(f"{exc} The task was {f._st_name}.")
            self.resolve(f, status, (exc, ""))
        else:
            self.agents.settle(fid, status, value)  # an agent nobody asked about yet
