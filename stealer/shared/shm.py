"""The shared-memory segment of one executor: layout, create/attach, cleanup.

One file in /dev/shm per executor, mode 0600, named
``stealer-<client pid>-<128-bit random token>`` so it cannot be guessed.
Everything inside is fixed-size integers at fixed offsets (see
:class:`Layout`); each structure starts on its own 64-byte cache line.

The directory is ``/dev/shm`` unless the environment variable
``STEALER_SHM_DIR`` names another (read at every call, so worker processes
inherit it; tests point it at a small tmpfs).

Memory is reserved when the segment is created (``posix_fallocate``): a
full /dev/shm fails there with :class:`SharedMemoryFullError`, never later
with a SIGBUS on a page the kernel cannot back.

Cleanup: the client unlinks the segment (and its overflow files,
``<name>-x<16 hex digits>``, see arena.py) at shutdown and from a
finalizer; a worker whose client died unlinks them before exiting; and
every new executor removes segments left by clients that no longer exist
(:func:`cleanup_stale`).

Liveness of a segment's creator is an ``flock``, not a pid: the creator
holds a shared lock on the file for as long as it has it open, and
``cleanup_stale`` removes a segment only when it can take the exclusive
lock.  The kernel drops the lock when the creator dies, in whichever PID
namespace it ran (containers sharing /dev/shm see pids that mean nothing
to each other, and a pid can be reused); a pid plus start time would still
need a guess for segments of other namespaces, the lock needs none.
Segments without the lock marker (older versions, or a file still being
created) fall back to the pid in the name.  Nothing here uses
``multiprocessing.shared_memory``, so the resource tracker never warns.

The client creates the segment (stealer/client/pool.py) and every worker attaches to it
(stealer/worker/loop.py); both sides and the agents read its words through the offsets
here; ``stealer top`` and stealer.prometheus attach read-side by id, for the snapshots of
stealer/client/stats.py.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import glob
import json
import mmap
import os
import re
import secrets
import stat
import struct
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from stealer.errors import SharedMemoryFullError, StealerError
from stealer.shared._layout import (
    CLIENT_MOVED_AT,
    CLIENT_TID_AT,
    DIR_BYTES,
    RECORD_BYTES,
    WAITER_FOR_AT,
    WAITER_PARK_AT,
)
from stealer.shared.queues import impl as Q

__all__ = ["Layout", "Segment", "SharedMemoryFullError", "cleanup_stale", "shm_dir", "SHM_DIR",
           "PREFIX"]

SHM_DIR = "/dev/shm"  # default directory; STEALER_SHM_DIR overrides it (see shm_dir)
PREFIX = "stealer-"
LINE = 64
MAGIC = 0x5354454C45525631  # "STELERV1"

# Header words (byte offsets). Each on its own cache line.
H_MAGIC = 0  # u64 written by the creator once, read by attachers to validate
H_NWORKERS = 8  # u32 written by the creator once
H_SHUTDOWN = 64  # u32 written by the client (store32 seq_cst), read by workers in their loop
H_CLIENT_PARK = 256  # u32 futex word of the client's result thread (0 awake, 1 parked, 3 parked in throughput mode, 2 notified): stored seq_cst by it, CAS by workers to wake it
H_CLIENT_TID = H_CLIENT_PARK + CLIENT_TID_AT  # u32 thread id of the client's result thread while workers may move it onto their CPU to wake it (0: they must not): it stores it (seq_cst) at start and 0 before it exits; workers load it (relaxed, after their CAS of H_CLIENT_PARK, which orders it)
H_CLIENT_MOVED = H_CLIENT_PARK + CLIENT_MOVED_AT  # u32 1: a worker narrowed the result thread's CPU affinity: the worker stores 1 (seq_cst) after its sched_setaffinity succeeded, the result thread exchanges it back to 0 (seq_cst) at the top of each loop and then restores its affinity
H_WAITER_PARK = H_CLIENT_PARK + WAITER_PARK_AT  # u32 futex word of the one client thread that waits on a future and settles completions itself (_Pool.wait_for): 0 no such thread, 4 awake (it looks at the rings before it parks: nobody wakes it), 1 parked (wake it for any completion), 3 parked for H_WAITER_FOR's completion only (others: owed, as in throughput mode), 2 notified; stored seq_cst by that thread, CAS 1/3 -> 2 by workers after a completion push (before they look at H_CLIENT_PARK) and by the client's other threads after they settled or cancelled a future
H_WAITER_FOR = H_CLIENT_PARK + WAITER_FOR_AT  # u64 handle of the record the waiter waits for: stored by it (seq_cst) before it stores 3 in H_WAITER_PARK; workers load it (relaxed) after they load 3 there, which orders it
H_OVERFLOW_SEQ = 320  # u64 overflow files created (a statistic; names are random): add64 by any producer
H_FN_COUNT = 384  # u64 number of function-table entries: written by the client only (store64 release)
H_FN_BYTES = 392  # u64 bytes used in the function data area: client only
H_STARTED = 448  # u32 workers that finished starting: add32 by workers, futex-waited by wait_ready
H_CREATED_NS = 512  # u64 time.time_ns() at creation: creator only, before any attach
H_LOCKED = 520  # u32 1: the creator holds flock(LOCK_SH) on the file while it lives; creator only,
#                 before H_MAGIC; read (pread) by cleanup_stale to trust a free lock as "creator gone"
H_LOCK_HOLDER = 576  # u32 pid holding the pure-Python reference's lock (0: free): its holder,
#                     under the lock; read by the client after a worker death
H_STOP_AGENTS = 640  # u32 1: the client is shutting down; workers stop their agents at the next
#                     step boundary: client store32 (seq_cst) in begin_shutdown, workers load32
H_JOURNAL_MODE = 704  # u32 the agents' journal's durability, JOURNAL_MODES index (0: no journal):
#                      the client store32s it once at start, before any worker exists; stats load32
JOURNAL_MODES = ("off", "always", "batch", "none")
H_JOURNAL = 712  # u64[3] client.db's J_WRITTEN, J_SYNCED, J_OLDEST (below), as W_JOURNAL's
# A journal shard's progress (agents/journal/store.py Shard.publish_to), three u64 at its base:
J_WRITTEN = 0  # events committed to the shard so far: the shard's writer store64s it under the
#                shard's lock after each commit; stats load64 it (relaxed: a statistic, paired
#                with nothing, at most a few events behind)
J_SYNCED = 8  # events an fsync of the shard's log has covered (J_WRITTEN under "always"): the
#               sync thread store64s it under that lock after its fsync; stats load64 (relaxed)
J_OLDEST = 16  # monotonic ns of the oldest committed event no fsync has covered yet (0: none):
#                the writer (first event after a sync began) and the sync thread (after its
#                fsync), both under the shard's lock; stats load64 it (relaxed) for the lag
# Worker sets (stealer/shared/idle.py): bit k % 64 of u64 word k // 64 is worker k. Each transition of
# a worker is one atomic RMW on its own bit, so a worker killed at any point leaves a state the
# client's Idle.forget (one idempotent and64) repairs; a count is a popcount.
SET_WORDS = 128  # u64 words per set: room for MAX_WORKERS workers
MAX_WORKERS = 64 * SET_WORDS
H_SEARCHING = 1024  # u64[SET_WORDS] searching workers: worker or64/and64 (seq_cst) of its own bit, client and64 after a death; notifiers load relaxed after their seq_cst fence
H_PARKED = 2048  # u64[SET_WORDS] parked workers: worker or64 (seq_cst, after storing PARKED) / and64, client and64 after a death; notifiers load acquire, pairing with the or64
H_LAYOUT = 3072  # u32 length + JSON of the layout and options: creator only, read by attach_any
HEADER_BYTES = 4096

# Per-worker block (stride WORKER_BYTES). Park word alone on its line.
W_PARK = 0  # u32 0 running, 1 parked, 2 notified: worker sets 1, notifier CASes 1->2 then futex-wakes
W_CURRENT = 64  # u64 handle+1 of the task running now (0 none): worker store64 release, client load64 after death
W_INCARNATION = 72  # u32 bumped by the client before starting a (replacement) worker process
W_STATE = 76  # u32 0 starting, 1 ready, 2 exiting, 3 retired, 4 init failed: worker store32, client load32
#   its values: written by the worker (worker/loop.py), read by the client (client/pool.py, stats.py) and peers (worker/agents/)
STATE_STARTING, STATE_READY, STATE_EXITING, STATE_RETIRED, STATE_INIT_FAILED = range(5)
W_PID = 84  # u32 pid of the current incarnation: worker store32 at start; read by stats/top
W_CPU = 88  # u32 CPU the worker is pinned to + 1 (0: not pinned): worker store32 at start
W_STEP_DEADLINE = 96  # u64 monotonic ns by which the agent step running now must end (0: none):
#                      worker store64 (release) around a step with a step_timeout; the client
#                      load64s it in its monitor and kills a worker stuck past it
W_RUNNABLE = 104  # u32 agents runnable on this worker besides the one in its turn: the worker
#                  store32s it at each turn (release); idle peers load32 it to ask for one
W_IN_STEP = 108  # u32 1 while this worker runs an agent's step (Host.step), else 0: the worker
#                 store32s it (seq_cst) around the step; idle peers load32 it and ask for an
#                 agent (SIGUSR1) only then: a message handler does not take the request
W_PING_OUT = 112  # u64 handle+1 of the frame this worker is pinging (0: none): the worker stores it
#                  (release) before its or64 of AF_PINGED and 0 after the push; the client reads it
#                  after the worker's death and pings that frame again (recovery.py Pings)
W_PING_IN = 120  # u64 handle+1 of the ping this worker pops from its inbox: written by the inbox
#                 pop before the CAS that takes it (the ring's lease, relaxed); the client reads it
#                 after the worker's death: a ping taken but maybe not handled is delivered again
W_LEASE = 128  # 16 x u64 handle+1 a worker is taking off a queue (records.py): slot 0 for single
#               takes, slot i for the i-th of an injector batch; the worker writes each before the
#               CAS that takes the handle (relaxed), the client reads them after the worker's death
LEASE_SLOTS = 16
W_RING_OP = 256  # u64 {MPMC ring offset << 2 | 1 push, 2 pop} this worker is about to claim,
#                 then W_RING_POS the position: the ring op writes both (relaxed, then a release
#                 fence) before its claiming CAS; the client reads them after the worker's death
#                 (acquire) to repair a cell left half-done (stealer/client/ringfix.py), and while it
#                 lives to tell its claim in flight from a dead one's
W_RING_POS = 264  # u64: see W_RING_OP; POS_UNKNOWN (all ones): a free's push named before its
#                  FREE store (MPMCRing.pre_push), the position not claimed yet (ringfix.py)
W_RING_VAL = 272  # u64 the value a push is about to store (written with W_RING_POS, same rules):
#                  a dead worker's claim on a free-record or free-block ring is completed with it
W_ALLOC = 280  # u64 handle+1 of the record this worker's last pop took off the free-record
#               ring: the pop stores it (relaxed) after its claim's CAS, before it releases the
#               cell (MPMCRing.set_take); the client reads it after the worker's death and
#               frees the record if it is still FREE in that generation (never set up: alloc
#               to setup, recovery.py ``allocated``); stale values name a newer generation
W_BUSY_AVG = 288  # u64 this worker's busy share x BUSY_SCALE << 1 | 1 if busy now
#                  (agents/placement.py BusyShare): the worker store64s it (relaxed, with
#                  W_BUSY_AT) at its turns and when it starts searching for work; peers load64
#                  both (relaxed: a hint for moving agents, a torn pair harmless)
W_BUSY_AT = 296  # u64 monotonic ns of that share (see W_BUSY_AVG)
BUSY_SCALE = 1 << 20  # W_BUSY_AVG's fixed point
W_JOURNAL = 320  # u64[3] this worker's journal shard (w<k>.db): J_WRITTEN, J_SYNCED, J_OLDEST
#                 above, stored by that worker's shard (its writer and its sync thread, under
#                 the shard's lock), read relaxed by stats; zero without a journal
WORKER_BYTES = 384

# Record (task) layout: RECORD_BYTES each (stealer/shared/_layout.py has the fields).


def shm_dir() -> str:
    """The directory of segments: $STEALER_SHM_DIR, else :data:`SHM_DIR` (read at each call)."""
    return os.environ.get("STEALER_SHM_DIR") or SHM_DIR


def _pow2(n: int) -> int:
    p = 1
    while p < n:
        p <<= 1
    return p


def _align(n: int) -> int:
    return (n + LINE - 1) & ~(LINE - 1)


def default_blocks(records: int) -> tuple[tuple[int, int], ...]:
    """The payload block classes of a segment of ``records`` records: 256-byte blocks, one
    per record up to 65,536 (16 MiB), for what just misses a record's 96 inline bytes (an
    agent message with a small array is ~120 bytes, a small agent's checkpoint ~150, and
    each agent keeps its handled messages until its next checkpoint: 256 lockstep agents
    held 16,384 of them, past the 4,096 1 KiB blocks, and 40% of their messages went to
    overflow files, an open, write and close on each side); then 1 KiB, 16 KiB and
    256 KiB blocks."""
    return ((256, min(records, 1 << 16)), (1024, 4096), (16384, 512), (262144, 32))


@dataclass(frozen=True)
class Layout:
    """Offsets of every structure in the segment; computed identically by every process."""

    nworkers: int
    records: int = 16384  # max tasks alive at once (queued, running, waiting on children, results unread)
    # (size, count) of each payload block class; () for the default (default_blocks)
    block_classes: tuple[tuple[int, int], ...] = ()
    fn_entries: int = 4096
    fn_data: int = 1 << 20
    # Capacity of each worker's inbox; 0: ``records``.  Tests only (STEALER_TEST_INBOX_CAP,
    # read by the client in stealer/client/pool.py): a small inbox shows quickly what fills one.
    inbox_cap: int = 0
    offsets: dict[str, int] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.nworkers < 1:
            raise ValueError("nworkers must be >= 1")
        object.__setattr__(self, "records", _pow2(self.records))
        object.__setattr__(self, "inbox_cap", _pow2(self.inbox_cap or self.records))
        if not self.block_classes:
            object.__setattr__(self, "block_classes", default_blocks(self.records))
        off = HEADER_BYTES
        o: dict[str, int] = {}

        def take(name: str, size: int) -> None:
            nonlocal off
            o[name] = off
            off = _align(off + size)

        n, cap = self.nworkers, self.records
        take("workers", WORKER_BYTES * n)
        take("deques", Q.Deque.nbytes(cap) * n)
        take("inboxes", Q.MPMCRing.nbytes(self.inbox_cap) * n)
        take("completions", Q.SPSCRing.nbytes(cap) * n)
        take("injector", Q.MPMCRing.nbytes(2 * cap))  # see injector_cap
        take("record_free", Q.MPMCRing.nbytes(self.free_cap(cap)))
        take("records", RECORD_BYTES * cap)
        take("agents", DIR_BYTES * cap)  # the agent directory: one entry per record slot
        for i, (size, count) in enumerate(self.block_classes):
            take(f"block_free{i}", Q.MPMCRing.nbytes(self.free_cap(count)))
            take(f"blocks{i}", size * count)
        from stealer.shared.metrics import BLOCK_BYTES

        take("metrics", _align(BLOCK_BYTES) * n)
        take("fn_table", 16 * self.fn_entries)
        take("fn_data", self.fn_data)
        o["total"] = off
        object.__setattr__(self, "offsets", o)

    @property
    def injector_cap(self) -> int:
        """The injector's capacity: every record once, plus room for the duplicate handles a
        recovery may push (a re-pushed lease whose first copy was still queued)."""
        return 2 * self.records

    @staticmethod
    def free_cap(count: int) -> int:
        """A free ring's capacity for ``count`` records or blocks: twice their number.  A
        worker killed inside a pop leaves its cell claimed and unreleased; pushes meet it one
        lap later, and a ring of ``count`` cells (always almost full) is one lap ahead after
        a few pops: its frees would find it full until the client's recovery repairs the
        cell (stealer/client/ringfix.py).  With two laps of room they meet it only after ``count``
        more pops, far more than happen before a death is handled."""
        return 2 * _pow2(count)

    @property
    def total(self) -> int:
        return self.offsets["total"]

    def worker(self, k: int) -> int:
        return self.offsets["workers"] + WORKER_BYTES * k

    def deque(self, k: int) -> int:
        return self.offsets["deques"] + Q.Deque.nbytes(self.records) * k

    def inbox(self, k: int) -> int:
        return self.offsets["inboxes"] + Q.MPMCRing.nbytes(self.inbox_cap) * k

    def completion(self, k: int) -> int:
        return self.offsets["completions"] + Q.SPSCRing.nbytes(self.records) * k

    def metrics(self, k: int) -> int:
        from stealer.shared.metrics import BLOCK_BYTES

        return self.offsets["metrics"] + _align(BLOCK_BYTES) * k

    def to_args(self) -> tuple:
        return (self.nworkers, self.records, self.block_classes, self.fn_entries, self.fn_data,
                self.inbox_cap)

    @classmethod
    def from_args(cls, args: tuple) -> Layout:
        n, records, classes, fn_entries, fn_data, *rest = args
        return cls(n, records, tuple(tuple(c) for c in classes), fn_entries, fn_data, *rest)


class Segment:
    """An mmap of the executor's /dev/shm file, plus a Region over it."""

    def __init__(self, name: str, mm: mmap.mmap, layout: Layout, lock: object = None,
                 queues: Any = None) -> None:
        self.name = name
        self.Q = queues or Q  # the queue implementation every process of this executor uses
        self.path = os.path.join(shm_dir(), name)
        self.mm = mm
        self.layout = layout
        self.region = (self.Q.Region(mm, lock) if self.Q.NATIVE or lock is None
                       else self.Q.Region(mm, lock, H_LOCK_HOLDER))
        self._release: Any = None  # creator: closes the fd holding the liveness lock

    @classmethod
    def create(cls, layout: Layout, lock: object = None, queues: Any = None) -> Segment:
        """A new segment, its memory reserved and its liveness lock held.

        Raises :class:`SharedMemoryFullError` when the directory has no room.
        """
        d = shm_dir()
        for _attempt in range(_CREATE_TRIES):
            name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(16)}"
            path = os.path.join(d, name)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o600)
            try:
                if not _lock_own_file(fd, path):
                    # A cleanup_stale elsewhere took the name away first (or held it too long).
                    _unlink_if_same(fd, path)
                    os.close(fd)
                    continue
                _reserve(fd, layout, d)
                mm = mmap.mmap(fd, layout.total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            except BaseException:
                os.close(fd)
                with contextlib.suppress(OSError):
                    os.unlink(path)
                raise
            break
        else:
            raise StealerError(f"could not create a shared-memory segment in {d}: another "
                               "process keeps removing new files there")
        seg = cls(name, mm, layout, lock, queues)
        seg.path = path
        # The lock lives as long as this fd (and the mapping's duplicate of it).
        seg._release = weakref.finalize(seg, os.close, fd)
        r = seg.region
        meta = json.dumps({"layout": layout.to_args(), "client_pid": os.getpid()}).encode()
        if len(meta) > HEADER_BYTES - H_LAYOUT - 4:
            seg.unlink()
            raise ValueError("layout description too large for the header")
        mm[H_LAYOUT + 4 : H_LAYOUT + 4 + len(meta)] = meta
        r.store32(H_LAYOUT, len(meta))
        r.store64(H_CREATED_NS, time.time_ns())
        r.store32(H_NWORKERS, layout.nworkers)
        r.store32(H_LOCKED, 1)
        r.store64(H_MAGIC, MAGIC)  # last: attachers check it
        return seg

    def populate(self) -> None:
        """Map the segment's hot part into this process now: the header, the workers'
        blocks, the deques, inboxes, completion rings, injector, free ring and records,
        the pages every task touches (the agent directory, payload blocks, metrics and
        function table stay lazy).

        Each process otherwise takes a page fault at its first touch of each page, about
        1 µs apiece on a VM (measured: 0.9 µs per write fault on an already allocated
        tmpfs page), all in the first burst of tasks: the client touches every record
        within one pass of the free ring (16,384 records, about 800 pages).  One
        ``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14) does it at start instead; on an older
        kernel the pages stay lazy, as before.
        """
        end = self.layout.offsets["agents"] & ~(mmap.PAGESIZE - 1)
        with contextlib.suppress(OSError, ValueError):
            self.mm.madvise(_MADV_POPULATE_WRITE, 0, end)

    @classmethod
    def attach(cls, name: str, layout: Layout, lock: object = None,
               queues: Any = None) -> Segment:
        path = os.path.join(shm_dir(), name)
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            size = os.fstat(fd).st_size
            if size < layout.total:  # mapping past the end would SIGBUS on first touch
                raise RuntimeError(f"{path} is {size} bytes, smaller than the {layout.total} "
                                   "bytes of its layout: not a stealer segment, or truncated")
            mm = mmap.mmap(fd, layout.total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        seg = cls(name, mm, layout, lock, queues)
        if seg.region.load64(H_MAGIC) != MAGIC:
            raise RuntimeError(f"{path} is not a stealer segment")
        return seg

    @classmethod
    def attach_any(cls, name: str) -> Segment:
        """Attach to a running executor's segment knowing only its name (``stealer top``)."""
        if client_pid(name) is None:
            raise ValueError(f"{name!r} is not a stealer segment name (stealer-<pid>-<token>)")
        path = os.path.join(shm_dir(), name)
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            head = os.pread(fd, HEADER_BYTES, 0)
        finally:
            os.close(fd)
        if len(head) < HEADER_BYTES or struct.unpack_from("=Q", head, H_MAGIC)[0] != MAGIC:
            raise RuntimeError(f"{path} is not a stealer segment (or is still starting)")
        n = struct.unpack_from("=I", head, H_LAYOUT)[0]
        meta = json.loads(head[H_LAYOUT + 4 : H_LAYOUT + 4 + n])
        return cls.attach(name, Layout.from_args(tuple(meta["layout"])))

    def unlink(self) -> None:
        unlink_all(self.name)
        if self._release is not None:
            self._release()  # the file is gone: nothing left for the lock to protect


_CREATE_TRIES = 8
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14 (<linux/mman.h>)
_LOCK_WAIT_S = 2.0  # how long create waits for a cleanup_stale that inspects the new file


def _lock_own_file(fd: int, path: str) -> bool:
    """Creator: take the shared liveness lock; False if ``path`` no longer names ``fd``'s file.

    A cleanup_stale in another process may have opened the brand-new (still
    empty) file, taken the exclusive lock and unlinked it; it holds the lock
    only for a few system calls, so wait for it, then check the name.
    """
    deadline = time.monotonic() + _LOCK_WAIT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.001)
    return _same_file(fd, path)


def _same_file(fd: int, path: str) -> bool:
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def _unlink_if_same(fd: int, path: str) -> None:
    if _same_file(fd, path):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _reserve(fd: int, layout: Layout, d: str) -> None:
    """Allocate every page of the segment now, so a full tmpfs fails here, not with SIGBUS."""
    try:
        os.posix_fallocate(fd, 0, layout.total)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.ENOMEM, errno.EFBIG):
            free = _free_bytes(d)
            raise SharedMemoryFullError(
                exc.errno,
                f"cannot reserve {layout.total / 2**20:.1f} MiB of shared memory in {d} for "
                f"the executor ({'unknown' if free is None else f'{free / 2**20:.1f} MiB'} "
                f"free there: {os.strerror(exc.errno)}). Free space in {d} (remove files other "
                "programs left there), create the executor with fewer records= (now "
                f"{layout.records}) or workers, or give the container more shared memory "
                "(e.g. docker run --shm-size=1g).") from exc
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
        os.ftruncate(fd, layout.total)  # a filesystem without fallocate: sparse, as before


def _free_bytes(d: str) -> int | None:
    try:
        st = os.statvfs(d)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def unlink_all(name: str) -> None:
    """Remove the segment file and its overflow files; missing files are fine."""
    d = shm_dir()
    for path in [os.path.join(d, name), *glob.glob(os.path.join(d, glob.escape(name) + "-x*"))]:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


# A segment, or one of its overflow files (decimal numbers: older versions; 16 hex digits now).
_NAME_RE = re.compile(r"^stealer-(\d+)-[0-9a-f]{32}(-x[0-9a-f]{1,16})?$")


def client_pid(name: str) -> int | None:
    """The client pid in a segment's name; None for anything else (overflow files too).

    The pid is the one in the creator's PID namespace: a hint for display,
    not proof of life (see :func:`cleanup_stale`).
    """
    m = _NAME_RE.match(name)
    return int(m.group(1)) if m and not m.group(2) else None


def our_files() -> Iterator[tuple[str, int, str]]:
    """(name, client pid, path) of every segment and overflow file this user owns."""
    d = shm_dir()
    try:
        names = os.listdir(d)
    except OSError:
        return
    uid = os.getuid()
    for name in names:
        m = _NAME_RE.match(name)
        if not m:
            continue
        path = os.path.join(d, name)
        try:
            if os.stat(path, follow_symlinks=False).st_uid != uid:
                continue
        except OSError:
            continue
        yield name, int(m.group(1)), path


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_if_stale(name: str, pid: int, path: str) -> list[str]:
    """Unlink a segment and its overflow files if its creator is gone; the names removed."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return []
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            return []
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return []  # held: its creator (or a process it forked) still has it open
        head = os.pread(fd, HEADER_BYTES, 0)
        locked = (len(head) == HEADER_BYTES
                  and struct.unpack_from("=Q", head, H_MAGIC)[0] == MAGIC
                  and struct.unpack_from("=I", head, H_LOCKED)[0] == 1)
        # A free lock on a segment whose creator took it proves the creator is gone.  Other
        # files (older versions, or one whose creator has not locked it yet) fall back to the
        # pid in the name; a creator that loses its file this way sees so and picks another.
        if not locked and _alive(pid):
            return []
        removed = []
        # Unlink while holding the lock: a creator locks before it trusts its file.
        with contextlib.suppress(OSError):
            os.unlink(path)
            removed.append(name)
    except OSError:
        return []  # vanished or unreadable meanwhile: not ours to judge now
    finally:
        os.close(fd)
    d = os.path.dirname(path)
    for ov in glob.glob(os.path.join(d, glob.escape(name) + "-x*")):
        with contextlib.suppress(OSError):
            os.unlink(ov)
            removed.append(os.path.basename(ov))
    return removed


def cleanup_stale() -> list[str]:
    """Unlink segments (and overflow files) whose creating client no longer runs.

    Overflow files whose segment no longer exists are removed too (their
    executor has shut down or was cleaned up).
    """
    removed = []
    overflow = []
    for name, pid, path in our_files():
        if client_pid(name) is None:
            overflow.append((name, path))
        else:
            removed += _remove_if_stale(name, pid, path)
    for name, path in overflow:
        base = os.path.join(os.path.dirname(path), name.rsplit("-x", 1)[0])
        if os.path.lexists(path) and not os.path.lexists(base):
            with contextlib.suppress(OSError):
                os.unlink(path)
                removed.append(name)
    return removed
