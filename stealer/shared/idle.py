"""Who is searching, who is parked, and whom to wake.

Policy (after tokio's ``idle.rs``):

* A worker out of local work becomes a *searcher* only while at most half
  the workers search (``try_search``); the rest go straight to parking.
* A searcher that finds work stops searching; if it was the last searcher
  it wakes one more worker, so parallelism ramps up one wake at a time.
* Publishing work (submit, spawn, a stolen batch) wakes one parked worker
  only when nobody is searching: a searcher will find the work anyway.
* Parking is a Dekker handshake with the notifier.  The worker stores its
  park word (PARKED), enters the parked set, issues a seq_cst fence, then
  re-checks every queue before sleeping on the futex; the notifier
  publishes work, issues a seq_cst fence, then reads the searching and
  parked sets and CASes one park word PARKED -> NOTIFIED before
  ``futex_wake``.  One of the two always sees the other, so no wake-up is
  lost.

Kill safety.  Who searches and who is parked are two *worker sets* in the
segment header (``H_SEARCHING``, ``H_PARKED``): bit ``k % 64`` of 64-bit word
``k // 64`` is worker ``k``, and a count is a popcount.  Every transition of
a worker is ONE atomic read-modify-write on its own bit (``or64`` to enter,
``and64`` to leave), so a worker killed between any two of its steps has
either done a transition or not, never half of one; ``forget`` (the client,
after the death) clears the dead worker's bits with ``and64``, which is
idempotent whatever the worker had done.  (The previous design, a per-worker
flag plus a shared counter, took two steps per transition: a worker killed
between them made ``forget`` decrement the counter twice, the unsigned count
wrapped, and notifiers believed forever that somebody searched.)  Several
words instead of one keep this exact for more than 64 workers; a reader
sees each word atomically but not all of them at once, which only matters
to the advisory "at most half search" count, never to a wake-up (each bit's
handshake is per worker).  ``SET_WORDS`` words fit the header, so an
executor has at most ``MAX_WORKERS`` workers.

The native ``HotPath.c_notify_one`` in native/_cqueues.pyx is the same
notify as :meth:`Idle.notify_one`, in one call after a submit.

Used by every worker (stealer/worker/loop.py: search, park, wake a peer), the client
(stealer/client/pool.py and waiting.py: its own park word, the wakes after a submit) and
the reference queues' composite operations (stealer/shared/arena.py).
"""

from __future__ import annotations

import os
import platform
import struct
import sys
import threading
from collections.abc import Iterable
from typing import Any

from stealer.shared.shm import (
    H_CLIENT_MOVED,
    H_CLIENT_PARK,
    H_CLIENT_TID,
    H_PARKED,
    H_SEARCHING,
    H_WAITER_FOR,
    H_WAITER_PARK,
    MAX_WORKERS,
    W_PARK,
    Layout,
)

__all__ = ["Idle", "ResultPolicy", "RUNNING", "PARKED", "NOTIFIED", "PARKED_BATCH", "BATCH_POLL"]

RUNNING, PARKED, NOTIFIED, PARKED_BATCH = 0, 1, 2, 3  # PARKED_BATCH: the client words only
WAITER_AWAKE = 4  # the waiter word only: a client thread in _Pool.wait_for, awake
_M64 = (1 << 64) - 1

BATCH_ENTER = 8  # outstanding tasks per worker from which the result thread parks SCHED_BATCH
BATCH_LEAVE = 4  # ... and below which it is SCHED_OTHER again (a gap, so it does not flap)
BATCH_POLL = 0.002  # seconds: in throughput mode the result thread looks at least this often
_SCHED_BATCH: int | None = getattr(os, "SCHED_BATCH", None)  # Linux only
# The result thread's time slice in its normal (SCHED_OTHER) mode: the least the kernel
# takes (0.1 ms; the default is 0.7 ms x (1 + log2 CPUs)), see ResultPolicy
RESULT_SLICE_NS = 100_000
_SETATTR_NR = {"x86_64": 314, "aarch64": 274}  # sched_setattr(2)
_SCHED_ATTR = struct.Struct("=IIQiIQQQ")  # struct sched_attr, version 0 (48 bytes)
_RESET_ON_FORK = 0x01  # SCHED_FLAG_RESET_ON_FORK


def set_slice(ns: int, policy: int | None = None) -> bool:
    """Ask the kernel for a ``ns`` time slice for the calling thread (Linux; 0: the
    default again), which has or gets ``policy`` (``SCHED_OTHER`` by default, or
    ``SCHED_BATCH``): ``sched_setattr`` with ``sched_runtime``, which EEVDF (Linux 6.6+)
    takes as the slice: a thread whose slice is shorter than the running task's gets an
    earlier deadline and preempts it on wake-up (6.12+).  Older kernels ignore it.  The
    thread's nice value is kept.  A short slice is not inherited (``SCHED_FLAG_RESET_ON_FORK``:
    a thread or process the caller starts gets the default one).  False if the system has no
    such call or refused it."""
    global _syscall
    nr = _SETATTR_NR.get(platform.machine())
    if nr is None or not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        if _syscall is None:  # (loading libc's handle cost more than the call itself)
            _syscall = ctypes.CDLL(None, use_errno=True).syscall
        nice = os.getpriority(os.PRIO_PROCESS, 0)  # the calling thread's (Linux: per thread)
        attr = ctypes.create_string_buffer(_SCHED_ATTR.pack(
            _SCHED_ATTR.size, os.SCHED_OTHER if policy is None else policy,
            _RESET_ON_FORK if ns else 0, nice, 0, ns, 0, 0), _SCHED_ATTR.size)
        return bool(_syscall(nr, 0, attr, 0) == 0)
    except (OSError, AttributeError):  # no libc symbol, a seccomp filter...
        return False


_syscall: Any = None  # libc's syscall(2), once set_slice first needs it


class Idle:
    def __init__(self, region: Any, layout: Layout) -> None:
        n = layout.nworkers
        if n > MAX_WORKERS:
            raise ValueError(f"an executor can have at most {MAX_WORKERS} workers (asked for "
                             f"{n}); run several executors for more")
        self.r = region
        self.n = n
        self.nwords = (n + 63) // 64
        self.park_words = [layout.worker(k) + W_PARK for k in range(n)]
        self.bits = [1 << (k & 63) for k in range(n)]
        self.search_words = [H_SEARCHING + 8 * (k >> 6) for k in range(n)]
        self.parked_words = [H_PARKED + 8 * (k >> 6) for k in range(n)]
        self._next = 0
        self.owed = False  # worker side: a completion not announced yet (wake_client)

    # -- counts (advisory: a snapshot per 64-bit word) --------------------------
    def searching(self) -> int:
        """How many workers search now."""
        return self.r.count_bits(H_SEARCHING, self.nwords)

    def parked(self) -> int:
        """How many workers are parked (or about to park, or just woken) now."""
        return self.r.count_bits(H_PARKED, self.nwords)

    # -- searching ---------------------------------------------------------
    def try_search(self, k: int) -> bool:
        """Worker ``k`` becomes a searcher unless half the workers already search."""
        r = self.r
        if self.n > 1 and 2 * r.count_bits(H_SEARCHING, self.nwords) >= self.n:
            return False
        # seq_cst RMW, the whole transition: the notifiers' loads after their fence see the bit
        # (and skip the wake) only if this worker scans the queues after their publication
        r.or64(self.search_words[k], self.bits[k])
        return True

    def stop_search(self, k: int, found_work: bool) -> None:
        """Leave the searching state; the last searcher to find work wakes another."""
        r = self.r
        bit = self.bits[k]
        # seq_cst RMW, the whole transition; pairs with the notifiers' fence (see try_search)
        old = r.and64(self.search_words[k], ~bit & _M64)
        if found_work and old == bit and (
                self.nwords == 1 or r.count_bits(H_SEARCHING, self.nwords) == 0):
            self.notify_one()

    def forget(self, k: int) -> None:
        """Client, after worker ``k`` died: take it out of the searching and parked sets.

        Idempotent, and right whichever step the worker was killed after: each
        of its transitions was one RMW on its own bit, which these undo.
        """
        r = self.r
        clear = ~self.bits[k] & _M64
        r.and64(self.search_words[k], clear)  # seq_cst RMW; the dead worker wrote it last
        r.and64(self.parked_words[k], clear)  # seq_cst RMW; likewise
        r.exchange32(self.park_words[k], RUNNING)  # seq_cst; notifiers CAS only PARKED words

    # -- waking --------------------------------------------------------------
    def notify_one(self) -> bool:
        """Wake one parked worker if nobody searches; call after publishing work.

        (The native HotPath.notify_one in native/_cqueues.pyx does the same in one call.)
        """
        r = self.r
        nw = self.nwords
        # seq_cst fence, then: nobody searching and somebody parked? (one native call)
        if not r.idle_check(H_SEARCHING, H_PARKED, nw):
            return False
        n = self.n
        start = self._next if self._next < n else 0
        sw, sb = start >> 6, start & 63
        for i in range(nw + 1):  # round robin from worker ``start``: its word twice, split
            j = (sw + i) % nw
            # acquire: pairs with the parker's or64 (after its PARKED store), so the CAS below
            # sees PARKED or later
            m = r.load64(H_PARKED + 8 * j)
            if i == 0:
                m &= _M64 << sb
            elif i == nw:
                m &= (1 << sb) - 1
            while m:
                low = m & -m
                m ^= low
                k = 64 * j + low.bit_length() - 1
                if k >= n:
                    break
                w = self.park_words[k]
                if r.cas32(w, PARKED, NOTIFIED):  # pairs with the worker's store of PARKED
                    self._next = k + 1
                    r.futex_wake(w, 1)
                    return True
        return False

    def notify_worker(self, k: int) -> None:
        """Wake worker ``k`` if parked (after pushing to its inbox)."""
        r = self.r
        r.fence()  # seq_cst: the inbox push before the park-word read
        w = self.park_words[k]
        if r.cas32(w, PARKED, NOTIFIED):
            r.futex_wake(w, 1)

    def notify_all(self) -> None:
        for k in range(self.n):
            self.notify_worker(k)

    # -- parking (worker k) ---------------------------------------------------
    def wait_ping(self, k: int, ready: Any, timeout: float) -> bool:
        """Worker ``k``, blocked in a task's join (Worker.join_blocking): sleep until
        notify_worker(k) (a child's ping), ``ready()`` or ``timeout``.  Not in the parked
        set: notify_one, which wakes a worker for *new* work, never picks one that would
        not take it."""
        r = self.r
        w = self.park_words[k]
        r.store32(w, PARKED)  # seq_cst: read by notify_worker's CAS (PARKED -> NOTIFIED)
        try:
            r.fence()  # seq_cst: PARKED before the re-check; pairs with notify_worker's fence
            if ready():
                return True
            return r.futex_wait(w, PARKED, timeout)
        finally:
            r.store32(w, RUNNING)  # seq_cst: overwrites NOTIFIED; a later CAS then fails

    def park(self, k: int, has_work: Any, timeout: float) -> bool:
        """Sleep until notified, work appears, or ``timeout``; False on timeout."""
        r = self.r
        w = self.park_words[k]
        word, bit = self.parked_words[k], self.bits[k]
        r.store32(w, PARKED)  # seq_cst: read by notifiers' CAS (PARKED -> NOTIFIED)
        # seq_cst RMW (release): a notifier's acquire load that sees the bit sees PARKED above
        r.or64(word, bit)
        try:
            r.fence()  # seq_cst: the bit before the re-check; pairs with the notifier's fence
            if has_work():
                return True
            return r.futex_wait(w, PARKED, timeout)
        finally:
            r.and64(word, ~bit & _M64)  # seq_cst RMW: out of the set first, so a set bit means
            #                             the worker is parked or dead (forget clears it then)
            r.store32(w, RUNNING)  # seq_cst: overwrites NOTIFIED; notifiers' CAS then fails

    # -- the client's result thread -----------------------------------------
    def wake_client(self, h: int = -1) -> None:
        """Worker side, after pushing the completion of record ``h``: wake the client if
        parked.  A client thread waiting on a future (``_Pool.wait_for``) is woken instead
        of the result thread: awake, it looks at the rings before it parks (nothing to
        do); parked for one record, only that record's completion wakes it.  A wake not
        paid now is owed (:attr:`owed`): the worker pays it once, before it idles
        (:meth:`flush_client`), and the sleeper polls meanwhile; so in the result thread's
        throughput mode (PARKED_BATCH).  HotPath.c_finish does the same."""
        r = self.r
        r.fence()  # seq_cst: the completion push before reading the park words
        while True:
            v = r.load32(H_WAITER_PARK)  # seq_cst: pairs with the waiter's stores of its state
            if v in (WAITER_AWAKE, NOTIFIED):
                return  # it looks at the rings before it parks
            if v == PARKED_BATCH and r.load64(H_WAITER_FOR) != h:
                self.owed = True
                return
            if v not in (PARKED, PARKED_BATCH):
                break  # no waiter: the result thread's word
            if r.cas32(H_WAITER_PARK, v, NOTIFIED):  # seq_cst: pairs with its re-check
                r.futex_wake(H_WAITER_PARK, 1)
                return
        v = r.load32(H_CLIENT_PARK)  # seq_cst: pairs with client_park's store
        if v == PARKED_BATCH:
            self.owed = True
        elif v == PARKED and r.cas32(H_CLIENT_PARK, v, NOTIFIED):
            r.futex_wake(H_CLIENT_PARK, 1)
            os.sched_yield()  # let it run now (HotPath.c_finish)

    def flush_client(self) -> None:
        """Worker side, about to idle after completions it did not announce (``owed``
        here or in its HotPath): wake the result thread from either park."""
        self.owed = False
        r = self.r
        r.fence()  # seq_cst: the completion pushes before reading the park words
        # seq_cst load: pairs with the waiter's stores of its state (waiter_take/_park)
        if r.load32(H_WAITER_PARK) in (WAITER_AWAKE, NOTIFIED):
            # it looks at the rings before it parks or leaves (as wake_client): waking the
            # result thread here made it take the GIL from a client gathering a lockstep
            # round, 3-4 times a round, each a GIL hand-off both ways
            return
        if not self._wake_parked(H_WAITER_PARK):
            self._wake_parked(H_CLIENT_PARK)

    def waiter_take(self) -> None:
        """A client thread took the waiter role (``_Pool.wait_for``): awake."""
        self.r.store32(H_WAITER_PARK, WAITER_AWAKE)  # seq_cst: read by wake_client

    def waiter_leave(self) -> None:
        """The waiter gives the role up: from now on workers wake the result thread.  The
        caller then looks at the rings once more (a worker that saw it awake woke nobody)."""
        r = self.r
        r.store32(H_WAITER_PARK, RUNNING)  # seq_cst: pairs with wake_client's fence and load
        r.fence()  # seq_cst: the store before the caller's look at the rings

    def waiter_park(self, has_work: Any, timeout: float, h: int = -1) -> bool:
        """The client thread that waits on a future (``_Pool.wait_for``): sleep until a
        worker publishes the completion of record ``h`` (-1: any completion), another
        client thread pokes it (:meth:`poke_waiter`), a worker pays the wakes it owes
        before it idles, or ``timeout``."""
        r = self.r
        if h >= 0:
            r.store64(H_WAITER_FOR, h)  # seq_cst, before the state that makes workers read it
            v = PARKED_BATCH
        else:
            v = PARKED
        return self._park(H_WAITER_PARK, v, has_work, timeout, WAITER_AWAKE)

    def poke_waiter(self) -> None:
        """Client: wake the thread parked in :meth:`waiter_park` (a future it may wait on was
        settled or cancelled by another thread); one load when none is parked."""
        self._wake_parked(H_WAITER_PARK)

    def _wake_parked(self, word: int) -> bool:
        """Wake the client thread parked (either mode) on ``word``; True if it was."""
        r = self.r
        # seq_cst load and CAS: pair with the parker's store of its state and its re-check
        v = r.load32(word)
        if v in (PARKED, PARKED_BATCH) and r.cas32(word, v, NOTIFIED):
            r.futex_wake(word, 1)
            return True
        return False

    def client_park(self, has_work: Any, timeout: float, batch: bool = False) -> bool:
        """The result thread: sleep until a worker or the API wakes it, or ``timeout``;
        ``batch``: it parks in throughput mode (:class:`ResultPolicy`), and a waking
        worker does not yield its CPU to it."""
        return self._park(H_CLIENT_PARK, PARKED_BATCH if batch else PARKED, has_work, timeout,
                          RUNNING)

    def _park(self, word: int, v: int, has_work: Any, timeout: float, awake: int) -> bool:
        """A client thread's sleep on ``word``: store ``v`` (its parked state), re-check
        ``has_work``, wait; ``awake`` is stored after (it overwrites NOTIFIED, so a later
        waker's CAS fails)."""
        r = self.r
        r.store32(word, v)  # seq_cst: pairs with wake_client's fence, load and CAS
        try:
            if has_work():
                return True
            return r.futex_wait(word, v, timeout)
        finally:
            r.store32(word, awake)  # seq_cst: overwrites NOTIFIED


class ResultPolicy:
    """How the result thread is scheduled (Linux): handed a worker's CPU when it is woken,
    ``SCHED_BATCH`` while a backlog waits.  Made and used by the result thread only.

    **Hand-off.**  A worker that wakes the parked result thread yields its CPU at once
    (``HotPath.c_finish``), but that helps only if the kernel queued the thread on this
    CPU; queued behind the worker of another CPU, it waited for that CPU's time slice
    or tick: result-return p99 2.5-3.0 ms on the ``latency`` workload (1 ms tasks, 2
    workers on 2 vCPUs), while its p50 was 16-20 µs.  So the worker first narrows the
    thread's CPU affinity to its own CPU (``sched_setaffinity``, allowed between
    processes of one user), then wakes it and yields: it runs now, on this CPU (return
    p99 0.24 ms; latency p50 1.52 -> 1.40 ms).  Awake, the thread takes its own CPUs back
    (:meth:`unmove`), so it can move to an idle CPU for whatever it then does.  It
    publishes its thread id for this only if its CPUs cover every CPU a worker is pinned
    to (the user may have confined the client: then nobody moves it), and withdraws it
    before it exits.  The pure-Python reference's wake does not hand off (it is a
    scheduling hint only).

    **Throughput mode.**

    A completion that finds the result thread parked wakes it (``futex_wake``).  As a
    normal (``SCHED_OTHER``) thread it may preempt the worker running where the kernel
    queues it, and the waking worker then pays for an inter-processor interrupt between
    two of its tasks: 12-15 µs per task on a 2-vCPU VM, against 2-4 µs for a wake that
    preempts nobody (``skew`` workload; the waking worker's gap, measured with stamped
    tasks).  A ``SCHED_BATCH`` thread never preempts on wake-up: it runs at the next
    scheduling point of its CPU (a yield of the worker that woke it there, a CPU going
    idle, the scheduler tick), so each result can arrive up to a tick (1-4 ms) later.

    So the thread turns ``SCHED_BATCH`` only while at least ``BATCH_ENTER`` tasks per
    worker are outstanding, when a queued task waits several task-times anyway and every
    microsecond a worker loses delays all of them, and back to ``SCHED_OTHER`` below
    ``BATCH_LEAVE`` per worker: a lightly loaded executor, where a result has to reach its
    waiter at once, is never in this mode.  In this mode the thread parks on
    ``PARKED_BATCH``, and the waking worker does not yield its CPU to it either.  Calls to
    agents count as outstanding tasks (control-tier replies are flushed at once).  Never
    if the thread started with another policy (the user chose it: ``chrt``, a real-time or idle class),
    or if the system refuses the call.  :meth:`update` runs before each park: one system
    call per change of mode.

    **Short slice.**  Out of throughput mode the thread asks for the shortest time slice
    (:data:`RESULT_SLICE_NS`, :func:`set_slice`).  With as many busy workers as cores, a
    result the hand-off could not place (the thread queued on another CPU, or the kernel
    kept the waking worker running after its yield) waited out the running worker's
    slice (1.4 ms by default on 2 CPUs) or the 4 ms tick: control-tier replies inside
    5 ms bulk steps had p50 0.3 ms but 1.1-4.0 ms outliers, about 1 call in 100-300.
    EEVDF lets a thread whose slice is shorter than the running task's preempt it when it
    wakes; its share of the CPU is unchanged (its weight is).  Throughput mode sets the
    default slice back; the short one is asked again on the way out.
    """

    def __init__(self, workers: int, region: Any = None,
                 worker_cpus: Iterable[int | None] = ()) -> None:
        self.enter = BATCH_ENTER * workers
        self.leave = BATCH_LEAVE * workers
        self.batch = False
        try:  # the calling thread's policy: only a thread that started normal is changed
            self.ok = _SCHED_BATCH is not None and os.sched_getscheduler(0) == os.SCHED_OTHER
        except OSError:
            self.ok = False
        self.r = region
        self.mask: set[int] | None = None  # this thread's own CPUs, while workers may move it
        if region is not None and hasattr(os, "sched_setaffinity"):
            try:
                mask: set[int] | None = os.sched_getaffinity(0)
            except OSError:
                mask = None
            if mask is not None and {c for c in worker_cpus if c is not None} <= mask:
                self.mask = mask
                # seq_cst store; workers load it after their CAS of the park word
                region.store32(H_CLIENT_TID, threading.get_native_id())
        if self.ok:
            set_slice(RESULT_SLICE_NS)  # see the class's docstring (short slice)

    def unmove(self) -> None:
        """Awake: if a worker moved this thread onto its CPU to wake it, take back its own
        CPUs (one load when none did)."""
        r = self.r
        # seq_cst load, then exchange: pair with the worker's store of 1 after its move
        # (_hand_over in native/_cqueues.pyx); cleared before the restore, so a later move
        # sets it again and is seen at the next check
        if r is not None and r.load32(H_CLIENT_MOVED) and r.exchange32(H_CLIENT_MOVED, 0):
            self.restore()

    def restore(self) -> None:
        """This thread on its own CPUs again (before it starts a process, which inherits
        them, and at the end)."""
        if self.mask is not None:
            try:
                os.sched_setaffinity(0, self.mask)
            except OSError:  # a CPU went offline or out of the cpuset: keep what we have
                pass

    def close(self) -> None:
        """The thread is about to exit: nobody may move its (reusable) thread id any more."""
        if self.mask is not None:
            self.r.store32(H_CLIENT_TID, 0)  # seq_cst: a worker's load after its CAS sees it
            self.restore()
            self.mask = None

    def update(self, outstanding: int) -> bool:
        """The calling thread is about to park with ``outstanding`` tasks unfinished: its
        mode now (True: throughput)."""
        if not self.ok:
            return False
        want = outstanding >= (self.leave if self.batch else self.enter)
        if want == self.batch:
            return want
        try:
            os.sched_setscheduler(0, _SCHED_BATCH if want else os.SCHED_OTHER,  # type: ignore[arg-type]
                                  os.sched_param(0))
        except OSError:  # seccomp, a container's policy: leave the thread as it is
            self.ok = False
        else:
            self.batch = want
            # the slice: the kernel's default in throughput mode, short out of it (a change
            # of policy alone keeps the slice the thread had)
            if want:
                set_slice(0, _SCHED_BATCH)
            else:
                set_slice(RESULT_SLICE_NS)
        return self.batch
