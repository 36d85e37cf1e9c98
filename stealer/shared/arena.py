"""Task records and payload storage in the shared segment.

A **record** (192 bytes, layout in stealer/shared/_layout.py) describes one task:
who submitted it, its state word, and where its two payloads live: the
pickled call and, once it ran, the pickled result.  A **handle** names a
record across processes: ``generation << 32 | index``; the generation is
bumped when the record is freed, so a stale handle is recognised.  The
lifecycle and its transitions are stealer/shared/records.py's.

Payloads live in one of:

* the record itself, when they fit its ``INLINE`` bytes (the result right
  after the call: most small calls and results);
* a block of a size class (1 KiB, 16 KiB, 256 KiB by default), taken from
  that class's free ring;
* an **overflow file** ``<segment>-x<n>`` in /dev/shm (0600) when larger
  than every class or when the classes are exhausted: slower, never fails
  for lack of arena space.

The call payload stays until the record is freed, so a task whose worker
died can run again.  Records come from a free ring too; when none is free
the client keeps the task in a local backlog until one is (stealer/client/pool.py).

Ownership: a record's plain fields are written by its holder only (the
state word says who) and handed on through a queue push (release) and pop
(acquire) or a CAS of the state word; only that word is contended.

The client creates the arena (stealer/client/pool.py, for stealer/client/executor.py's
submit), every worker attaches to it (stealer/worker/loop.py); the recovery of a dead
worker's records (stealer/shared/recovery.py) frees and gives back through it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import pickle
import secrets
import stat
import struct
import time
from typing import Any

from stealer.errors import SerializationError
from stealer.shared import failpoints, serialize
from stealer.shared._layout import (
    D_CAP,
    DIR_BYTES,
    F_BUFFERS,
    F_RBUFFERS,
    INLINE,
    K_CHILD,
    K_MASK,
    K_ROOT,
    OVERFLOW,
    R_INLINE,
    R_KIND,
    R_PCLASS,
    R_RCLASS,
    R_RETRIES,
    R_RREF,
    R_STATUS,
    R_TSTART,
    R_TSUBMIT,
    RECORD_BYTES,
    S_CANCELLED,
    S_FREE,
    S_QUEUED,
    S_RUNNING,
    ST_ERROR,
    ST_LOST,
    ST_OK,
)
from stealer.shared.records import Outcome, Transitions, word
from stealer.shared.shm import (
    H_CLIENT_PARK,
    H_OVERFLOW_SEQ,
    H_PARKED,
    H_SEARCHING,
    W_ALLOC,
    W_PARK,
    WORKER_BYTES,
    Segment,
    shm_dir,
)

__all__ = ["Arena", "F_BUFFERS", "F_RBUFFERS", "INLINE", "K_CHILD", "K_MASK", "K_ROOT",
           "S_CANCELLED", "S_FREE", "S_QUEUED", "S_RUNNING", "ST_ERROR", "ST_LOST", "ST_OK"]

# The record layout, states and kinds: stealer/shared/_layout.py (shared with native/ by setup.py).
LOST = 0xFFFE  # payload class: it could not be stored (overflow file failed); the ref holds the errno
OVERFLOW_TRIES = 8  # fresh names tried when an overflow file's name exists already

_PCALL = struct.Struct("=IIQQ")  # pclass, rclass, pref, plen
_RES = struct.Struct("=QQ")  # rref, rlen
_KIND_LINK = struct.Struct("=IIQ")  # kind, status, link
_KIND_STATUS = struct.Struct("=II")
_U32 = struct.Struct("=I")
_U64 = struct.Struct("=Q")


class Arena:
    """Record and payload allocation over a :class:`~stealer.shared.shm.Segment`.

    Over 400 lines: one object per process owns the records, the blocks and the overflow
    files, and its composite calls (``submit_inline``, ``spawn_inline``, ``start``,
    ``finish_inline``..., the reference twins of native/_cqueues.pyx's HotPath, which
    replaces them on the instance when it is built) allocate, store and read payloads in
    one step; its sections, in order: allocation (alloc, free, release), a task's steps
    (the composites), the record's fields, and payload storage (put, take, read, drop).
    """

    def __init__(self, seg: Segment, injector: Any = None) -> None:
        Q = seg.Q
        L = seg.layout
        self.seg = seg
        self.mm = seg.mm
        self.region = seg.region
        self.nrecords = L.records
        self.rec_base = L.offsets["records"]
        self.rec_free = Q.MPMCRing(seg.region, L.offsets["record_free"], L.free_cap(L.records))
        self.classes: list[tuple[int, Any, int]] = []
        for i, (size, count) in enumerate(L.block_classes):
            ring = Q.MPMCRing(seg.region, L.offsets[f"block_free{i}"], L.free_cap(count))
            self.classes.append((size, ring, L.offsets[f"blocks{i}"]))
        self._counts = [count for _, count in L.block_classes]
        self._ov_prefix = seg.path + "-x"  # overflow files live beside the segment
        self.injector = (injector if injector is not None
                         else Q.MPMCRing(seg.region, L.offsets["injector"], L.injector_cap))
        self.tr = Transitions(seg.region, self.off)
        self.ring_caps = {q.offset: q.capacity for q in self.mpmc_rings()}  # (ringfix.py)
        self._idle: Any = None
        self.worker = False  # a worker's arena (set_worker): its failpoints fire
        self.hot: Any = None  # the native HotPath, when it is used
        if getattr(Q, "HotPath", None) is not None and os.environ.get("STEALER_PY_HOTPATH") != "1":
            hot = Q.HotPath(seg.region, self.rec_base, self.nrecords, self.rec_free,
                            self.injector, H_CLIENT_PARK, H_SEARCHING, H_PARKED,
                            L.worker(0) + W_PARK, WORKER_BYTES, L.nworkers)
            self.hot = hot
            self.reply_slot = hot.reply_slot
            self.submit_inline = hot.submit_inline
            self.spawn_inline = hot.spawn_inline
            self.notify_one = hot.notify_one
            self.start = hot.start
            self.finish_inline = hot.finish_inline
            self.complete_take = hot.complete_take
            self.start_task = hot.start_task
            self.finish_value = hot.finish_value
            self.end_task = hot.end_task
            self.reply_inline = hot.reply_inline
            self.read_inline = hot.read_inline
            self.free = self._native_free(hot)

    def mpmc_rings(self, *more: Any) -> list[Any]:
        """Every MPMC ring object of this arena (free records, free blocks, injector),
        plus ``more`` (rings or lists of rings: the inboxes)."""
        out = [self.rec_free, self.injector, *(ring for _, ring, _ in self.classes)]
        for m in more:
            out.extend(m if isinstance(m, list) else [m])
        return out

    def set_worker(self, wbase: int) -> None:
        """A worker's arena (worker block at ``wbase``): every record its pops take off the
        free ring is named at ``wbase + W_ALLOC`` (recovery.py ``allocated``), and its
        record failpoints fire.  (Its ring intents are set by the worker, stealer/worker/loop.py.)"""
        self.worker = True
        self.rec_free.set_take(wbase + W_ALLOC, self.rec_base, self.nrecords)

    def free_ring_offsets(self) -> frozenset[int]:
        """The rings that hold free record and block indices (a dead push to one of them
        is finished by stealer/client/ringfix.py: nothing else would give the index back)."""
        return frozenset([self.rec_free.offset, *(ring.offset for _, ring, _ in self.classes)])

    def _native_free(self, hot: Any) -> Any:
        drop = self.drop_payload
        off = self.off
        nfree = hot.free

        def free(h: int) -> None:
            drop(off(h))
            nfree(h)

        return free

    @property
    def idle(self) -> Any:
        """The idle policy (stealer/shared/idle.py) the reference composite operations use."""
        if self._idle is None:
            from stealer.shared.idle import Idle

            self._idle = Idle(self.region, self.seg.layout)
        return self._idle

    def init(self) -> None:
        """Creator only: every record and block starts free."""
        self.rec_free.init()
        for i in range(self.nrecords):
            self.rec_free.push(i)
        for (_size, ring, _base), count in zip(self.classes, self._counts):
            ring.init()
            for i in range(count):
                ring.push(i)

    # -- records ---------------------------------------------------------
    def off(self, h: int) -> int:
        idx = h & 0xFFFFFFFF
        if idx >= self.nrecords:
            raise IndexError(f"bad record handle {h:#x}: index out of range; shared memory is corrupt")
        return self.rec_base + RECORD_BYTES * idx

    def alloc(self) -> int:
        """A free record's handle, or -1 when all are in use.

        In a worker the pop names the record's handle in W_ALLOC (set_worker) before it
        releases its cell: killed from there until the record is set up, its recoverer
        frees it (FREE in that generation: never set up)."""
        idx = self.rec_free.pop()
        if idx < 0:
            return -1
        if failpoints.ON and self.worker:
            failpoints.hit("record.alloc_after_pop")
        gen = _U32.unpack_from(self.mm, self.rec_base + RECORD_BYTES * idx)[0]
        return (gen << 32) | idx

    def free(self, h: int) -> None:
        """Release the record (its exclusive holder only) and both payloads; ``h`` goes stale.

        A worker names the push before the FREE store (pre_push: the native HotPath.c_free
        does the same): killed between the store and the push's claim, the record is FREE
        and on no ring, and the client's repair of that intent gives it back (ringfix.py)."""
        off = self.off(h)
        self.drop_payload(off)
        gen = (_U32.unpack_from(self.mm, off)[0] + 1) & 0x7FFFFFFF
        idx = h & 0xFFFFFFFF
        self.rec_free.pre_push(idx)  # (a worker's intent words; read after its death)
        self.region.store64(off, word(gen, S_FREE))  # release: stale CASes fail now
        if failpoints.ON and self.worker:
            failpoints.hit("record.free_after_state")
        self.rec_free.push(idx)  # release: the next owner sees gen and the cleared fields

    def release(self, h: int, state: int, who: int, me: int) -> Outcome:
        """Claim ``h`` (in ``state`` held by ``who``) and free it; only one claimer wins."""
        out = self.tr.claim(h, state, who, me)
        if out is Outcome.OK:
            self.free(h)
        return out

    # -- composite hot-path operations --------------------------------------
    # Reference implementations; HotPath in native/_cqueues.pyx does the same
    # in one native call each and replaces these when the extension loads.

    def reply_slot(self, fid: int) -> int:
        """Client: a fresh record set up as a call's reply slot (K_ROOT, link ``fid``,
        QUEUED on no queue); its handle, or -1 when no record is free."""
        h = self.alloc()
        if h >= 0:
            self.setup(h, K_ROOT, fid, time.monotonic_ns())
        return h

    def submit_inline(self, kind: int, link: int, data: bytes, retries: int = 0) -> int:
        """Client: a fresh record with an inline payload, pushed on the injector, and a
        parked worker woken if nobody searches; -1 if no record is free, ``-2 - h`` if
        record ``h`` is set up but the injector was full (the caller pushes it later)."""
        if len(data) > INLINE:
            raise ValueError("payload too large for the inline path")
        h = self.alloc()
        if h < 0:
            return -1
        off = self.setup(h, kind, link, time.monotonic_ns(), retries)
        self.mm[off + R_INLINE : off + R_INLINE + len(data)] = data
        _PCALL.pack_into(self.mm, off + R_PCLASS, 0, 0, 0, len(data))
        if not self.injector.push(h):
            return -2 - h
        self.notify_one()
        return h

    def spawn_inline(self, datas: list[bytes], kind: int, link_or: int, retries: int,
                     dir_off: int, cap: int, out: list[int], ring: Any = None) -> int:
        """Client: a batch of agents (stealer/client/agents_batch.py), one record each: for each
        inline payload take a record set up as :meth:`submit_inline` does with link
        ``link_or | h``, give it a fresh directory entry at ``dir_off`` (zeroed, capacity
        ``cap``; published by the push) and push it on ``ring`` (a worker's inbox) or, None,
        on the injector, appending each handle to ``out``.  Wakes nobody (the caller
        notifies once).  0: all queued; -1: no free record (``out`` holds those queued);
        -2: the ring was full, the last handle in ``out`` is set up but not queued."""
        q = self.injector if ring is None else ring
        for data in datas:
            if len(data) > INLINE:
                raise ValueError("payload too large for the inline path")
        t_submit = time.monotonic_ns()
        mm = self.mm
        for data in datas:
            h = self.alloc()
            if h < 0:
                return -1
            off = self.setup(h, kind, link_or | h, t_submit, retries)
            mm[off + R_INLINE : off + R_INLINE + len(data)] = data
            _PCALL.pack_into(mm, off + R_PCLASS, 0, 0, 0, len(data))
            e = dir_off + DIR_BYTES * (h & 0xFFFFFFFF)
            mm[e : e + DIR_BYTES] = bytes(DIR_BYTES)  # plain stores: published by the push
            _U32.pack_into(mm, e + D_CAP, cap)
            out.append(h)
            if not q.push(h):  # release: the worker's pop acquires it
                return -2
        return 0

    def notify_one(self) -> int:
        """Wake one parked worker if nobody searches (see stealer/shared/idle.py)."""
        return self.idle.notify_one()

    def start(self, h: int, current_off: int, t_start: int, wait_hist_off: int = -1,
              who: int = 0) -> tuple | None:
        """Worker who-1: QUEUED -> RUNNING|who, the current word set first (records.py).

        None if ``h`` was not QUEUED; else (kind, link, inline call bytes or None).
        """
        off = self.off(h)
        self.region.store64(current_off, h + 1)  # the lease: read by the recoverer
        if self.tr.cas(h, S_QUEUED, 0, S_RUNNING, who) is not Outcome.OK:
            return None
        _U64.pack_into(self.mm, off + R_TSTART, t_start)
        if wait_hist_off >= 0:
            t_submit = _U64.unpack_from(self.mm, off + R_TSUBMIT)[0]
            self.region.hist_record(wait_hist_off, t_start - t_submit)
        kind, _status, link = self.kind_link(off)
        pclass, _rclass, _pref, n = _PCALL.unpack_from(self.mm, off + R_PCLASS)
        if pclass == 0:
            if n > INLINE:
                raise ValueError(f"corrupt record {h:#x}: inline payload of {n} bytes")
            return kind, link, self.mm[off + R_INLINE : off + R_INLINE + n]
        return kind, link, None

    def start_task(self, h: int, current_off: int, wait_hist_off: int = -1,
                   who: int = 0) -> tuple | None:
        """:meth:`start` at the time of the call: None, or (kind, link, inline call bytes
        or None, start time in monotonic ns)."""
        t = time.monotonic_ns()
        r = self.start(h, current_off, t, wait_hist_off, who)
        return None if r is None else (*r, t)

    def finish_value(self, h: int, value: Any, completions: Any, who: int = 0) -> int | bytes:
        """:meth:`finish_inline` of a plain result (ST_OK) it encodes itself: the small
        format, else an in-band pickle (raises at the first out-of-band buffer, before
        anything is stored).  Returns as finish_inline, except that a payload too long to
        sit beside the call comes back (bytes, nothing stored) instead of 0."""
        data = serialize.dump_result(value)
        return self.finish_inline(h, ST_OK, data, completions, who) or data

    def end_task(self, current_off: int, run_hist_off: int, t_start: int) -> int:
        """Worker: nothing runs now (current word cleared, release: read by a recoverer),
        the run time since ``t_start`` recorded at ``run_hist_off`` (-1: not); returns the
        time now (monotonic ns)."""
        self.region.store64(current_off, 0)
        t = time.monotonic_ns()
        if run_hist_off >= 0:
            self.region.hist_record(run_hist_off, t - t_start)
        return t

    def _result_at(self, off: int) -> int:
        """Where an inline result starts: after an inline call payload."""
        pclass, _rclass, _pref, plen = _PCALL.unpack_from(self.mm, off + R_PCLASS)
        return plen if pclass == 0 else 0

    def finish_inline(self, h: int, status: int, data: bytes, completions: Any,
                      who: int = 0) -> int:
        """Worker who-1: store a small result, RUNNING|who -> DONE|who, publish a root.

        0 too large, -1 not RUNNING|who any more, 1 root completed, 2 child.
        """
        off = self.off(h)
        at = self._result_at(off)
        if at + len(data) > INLINE:
            return 0
        mm = self.mm
        mm[off + R_INLINE + at : off + R_INLINE + at + len(data)] = data
        _U32.pack_into(mm, off + R_RCLASS, 0)
        _RES.pack_into(mm, off + R_RREF, 0, len(data))
        kind = _U32.unpack_from(mm, off + R_KIND)[0] & ~F_RBUFFERS
        _KIND_STATUS.pack_into(mm, off + R_KIND, kind, status)
        if self.tr.finish(h, who) is not Outcome.OK:
            return -1
        if kind & K_MASK != K_ROOT:
            return 2
        while not completions.push(h):
            pass
        self.idle.wake_client(h)
        return 1

    def reply_inline(self, rh: int, status: int, data: bytes, completions: Any,
                     who: int) -> int:
        """Worker who-1, an agent's reply to call slot ``rh``: claim it (QUEUED|0 ->
        RUNNING|who), then :meth:`finish_inline`.  -3 if it was not QUEUED|0 (nothing
        done), else as finish_inline (0: too large, the slot is ours, RUNNING|who)."""
        if self.tr.cas(rh, S_QUEUED, 0, S_RUNNING, who) is not Outcome.OK:
            return -3
        return self.finish_inline(rh, status, data, completions, who)

    def read_inline(self, h: int) -> Any:
        """Worker: record ``h``'s call payload read back if it is a pickle stored inline
        (an agent's message or spawn), else None (then :meth:`read_call` reads it)."""
        off = self.off(h)
        pclass, _rclass, _pref, n = _PCALL.unpack_from(self.mm, off + R_PCLASS)
        if (pclass or _U32.unpack_from(self.mm, off + R_KIND)[0] & F_BUFFERS or not 1 <= n <= INLINE
                or self.mm[off + R_INLINE] == serialize.SMALL):
            return None
        return pickle.loads(self.mm[off + R_INLINE : off + R_INLINE + n])

    def complete_take(self, h: int) -> tuple:
        """Client: (kind, status, link, inline result or None); frees the record if all inline."""
        t = self.peek_result(h)
        if t[3] is not None:
            self.free(h)
        return t

    def peek_result(self, h: int) -> tuple:
        """complete_take without the free: the record stays as it is."""
        off = self.off(h)
        kind, status, link = self.kind_link(off)
        pclass, rclass, _pref, plen = _PCALL.unpack_from(self.mm, off + R_PCLASS)
        if pclass != 0 or rclass != 0:
            return kind, status, link, None
        n = _RES.unpack_from(self.mm, off + R_RREF)[1]
        if plen + n > INLINE:
            raise ValueError(f"corrupt record {h:#x}: inline result out of bounds")
        return kind, status, link, self.mm[off + R_INLINE + plen : off + R_INLINE + plen + n]

    def valid(self, h: int) -> bool:
        return self.tr.current(h)

    def setup(self, h: int, kind: int, link: int, t_submit: int, retries: int = 0) -> int:
        """Fill a fresh record's header (state QUEUED, no payloads); returns its offset."""
        off = self.off(h)
        mm = self.mm
        mm[off + 8 : off + R_INLINE] = bytes(R_INLINE - 8)
        _KIND_LINK.pack_into(mm, off + R_KIND, kind, ST_OK, link)
        _U32.pack_into(mm, off + R_RETRIES, retries)
        _U64.pack_into(mm, off + R_TSUBMIT, t_submit)
        self.region.store64(off, word(h >> 32, S_QUEUED))  # alloc: published by the queue push
        return off

    def kind_link(self, off: int) -> tuple[int, int, int]:
        return _KIND_LINK.unpack_from(self.mm, off + R_KIND)

    def set_status(self, off: int, status: int) -> None:
        _U32.pack_into(self.mm, off + R_STATUS, status)

    # -- payloads --------------------------------------------------------
    # A record holds two payloads: the call (kept until the record is freed,
    # so a task can be re-run after its worker died) and the result.  Each is
    # inline (the result right after an inline call), in a size-class block,
    # or in an overflow file ``<segment>-x<16 hex digits>`` beside the
    # segment (0600): its suffix is 64 random bits kept in the record (the
    # reader needs nothing else), since /dev/shm is world-writable and its
    # listing public, so a counter would let another user create (or
    # symlink) the next name first.  It is created with O_EXCL|O_NOFOLLOW; a
    # name that exists anyway is skipped for a fresh one.  A payload that
    # cannot be written (ENOSPC: /dev/shm full) gets the LOST class instead,
    # and whoever reads it gets a SerializationError saying why: a producer
    # (a worker's result, the result thread's backlog) never dies of it.
    # Every descriptor read from shared memory is checked before use.
    def _store(self, data: bytes, bufs: list, inline_at: int, off: int) -> tuple[int, int, int]:
        """Write a payload; (class, ref, length)."""
        mm = self.mm
        n = serialize.frame_size(data, bufs) if bufs else len(data)
        if inline_at + n <= INLINE:
            serialize.write_frame(mm, off + R_INLINE + inline_at, data, bufs)
            return 0, 0, n
        for ci, (size, ring, base) in enumerate(self.classes):
            if n <= size:
                b = ring.pop()
                if b >= self._counts[ci]:  # a free-ring cell from shared memory: check it
                    raise ValueError(f"corrupt free list of block class {ci}: block {b} of "
                                     f"{self._counts[ci]} (the shared memory was overwritten)")
                if b >= 0:
                    serialize.write_frame(mm, base + size * b, data, bufs)
                    return ci + 1, b, n
        try:
            token = self._write_overflow(data, bufs)
        except OSError as exc:  # ENOSPC above all: the reader gets the error, not us
            return LOST, exc.errno or 0, n
        self.region.add64(H_OVERFLOW_SEQ, 1)  # a statistic only: nobody orders on it
        return OVERFLOW, token, n

    def _ov_path(self, token: int) -> str:
        return f"{self._ov_prefix}{token:016x}"

    def _write_overflow(self, data: bytes, bufs: list) -> int:
        """Write a payload to a new overflow file; its token. OSError on failure."""
        for _attempt in range(OVERFLOW_TRIES):
            token = _ov_token()
            path = self._ov_path(token)
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                             | os.O_CLOEXEC, 0o600)
            except FileExistsError:
                continue  # a leftover or someone else's file (or symlink): never touch it
            try:
                if bufs:  # the frame of serialize.write_frame, written part by part
                    _write_all(fd, serialize.frame_header(data, bufs))
                    _write_all(fd, data)
                    for b in bufs:
                        _write_all(fd, b.raw())
                else:
                    _write_all(fd, data)
            except BaseException:
                os.close(fd)
                with contextlib.suppress(OSError):
                    os.unlink(path)
                raise
            os.close(fd)
            return token
        raise FileExistsError(errno.EEXIST, f"{OVERFLOW_TRIES} fresh overflow file names in a "
                              "row existed already", self._ov_prefix + "*")

    def _check_off(self, off: int) -> None:
        rel = off - self.rec_base
        if rel < 0 or rel >= self.nrecords * RECORD_BYTES or rel % RECORD_BYTES:
            raise IndexError(f"offset {off} is not a record of this arena (a corrupt handle?)")

    def _check(self, cls: int, ref: int, n: int, inline_at: int) -> None:
        if cls == 0:
            ok = inline_at + n <= INLINE
        elif cls in (OVERFLOW, LOST):
            ok = True  # an overflow file's size is checked when it is read
        elif cls <= len(self.classes):
            ok = ref < self._counts[cls - 1] and n <= self.classes[cls - 1][0]
        else:
            ok = False
        if not ok:
            raise ValueError(f"corrupt payload descriptor: class {cls}, index {ref}, length {n} "
                             "lie outside the arena (the shared memory was overwritten)")

    def _load(self, cls: int, ref: int, n: int, inline_at: int, off: int, has_bufs: bool,
              call: bool = False) -> Any:
        mm = self.mm
        self._check_off(off)
        self._check(cls, ref, n, inline_at)
        if cls == 0:
            start = off + R_INLINE + inline_at
            src: Any = mm[start : start + n]
        elif cls == OVERFLOW:
            src = _read_file(self._ov_path(ref), n)
        elif cls == LOST:
            raise lost_payload_error(ref, n)
        else:
            size, _ring, base = self.classes[cls - 1]
            start = base + size * ref
            src = mm[start : start + n]
        if call and not has_bufs:  # a call in the small format decodes as a call
            return serialize.load_call(src)
        return serialize.loads_frame(src, has_bufs)

    def _drop(self, cls: int, ref: int, n: int) -> None:
        if cls == OVERFLOW:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._ov_path(ref))
        elif cls and cls != LOST:
            if (cls > len(self.classes) or ref >= self._counts[cls - 1]
                    or n > self.classes[cls - 1][0]):
                # a corrupt descriptor (one _check rejects): never put an index on a free ring
                # for it (leak it; a free ring has room for duplicates, Layout.free_cap)
                return
            self.classes[cls - 1][1].push(ref)

    def put(self, off: int, data: bytes, bufs: list) -> None:
        """Store a fresh record's call payload (never fails for lack of room: see LOST)."""
        self._check_off(off)
        mm = self.mm
        kind = _U32.unpack_from(mm, off + R_KIND)[0]
        _U32.pack_into(mm, off + R_KIND, (kind | F_BUFFERS) if bufs else (kind & ~F_BUFFERS))
        cls, ref, n = self._store(data, bufs, 0, off)
        _PCALL.pack_into(mm, off + R_PCLASS, cls, 0, ref, n)

    def put_result(self, off: int, data: bytes, bufs: list) -> None:
        """Store the result beside the call payload (the record is RUNNING, ours)."""
        self._check_off(off)
        mm = self.mm
        self.drop_result(off)
        cls, ref, n = self._store(data, bufs, self._result_at(off), off)
        kind = _U32.unpack_from(mm, off + R_KIND)[0]
        _U32.pack_into(mm, off + R_KIND, (kind | F_RBUFFERS) if bufs else (kind & ~F_RBUFFERS))
        _RES.pack_into(mm, off + R_RREF, ref, n)
        _U32.pack_into(mm, off + R_RCLASS, cls)

    def read_call(self, off: int) -> Any:
        """Unpickle the call payload; its storage stays (a retry reads it again)."""
        pclass, _rclass, pref, n = _PCALL.unpack_from(self.mm, off + R_PCLASS)
        has_bufs = bool(_U32.unpack_from(self.mm, off + R_KIND)[0] & F_BUFFERS)
        return self._load(pclass, pref, n, 0, off, has_bufs, call=True)

    def take(self, off: int) -> Any:
        """Unpickle the result payload (its storage is released with the record)."""
        mm = self.mm
        rclass = _U32.unpack_from(mm, off + R_RCLASS)[0]
        rref, n = _RES.unpack_from(mm, off + R_RREF)
        has_bufs = bool(_U32.unpack_from(mm, off + R_KIND)[0] & F_RBUFFERS)
        return self._load(rclass, rref, n, self._result_at(off), off, has_bufs)

    def drop_result(self, off: int) -> None:
        """Release the result's storage (before a re-run, or a new result)."""
        mm = self.mm
        rclass = _U32.unpack_from(mm, off + R_RCLASS)[0]
        rref, n = _RES.unpack_from(mm, off + R_RREF)
        _U32.pack_into(mm, off + R_RCLASS, 0)
        _RES.pack_into(mm, off + R_RREF, 0, 0)
        self._drop(rclass, rref, n)

    def drop_payload(self, off: int) -> None:
        """Release both payloads' storage without reading them (fields zeroed first, so a
        release interrupted by a kill never pushes a block twice)."""
        mm = self.mm
        pclass, rclass, pref, n = _PCALL.unpack_from(mm, off + R_PCLASS)
        rref, rn = _RES.unpack_from(mm, off + R_RREF)
        _PCALL.pack_into(mm, off + R_PCLASS, 0, 0, 0, 0)
        _RES.pack_into(mm, off + R_RREF, 0, 0)
        self._drop(pclass, pref, n)
        self._drop(rclass, rref, rn)


def _ov_token() -> int:
    """64 random bits naming an overflow file (module-level so tests can force collisions)."""
    return secrets.randbits(64)


def _write_all(fd: int, buf: Any) -> None:
    """os.write until every byte is written (one call stops at about 2 GiB on Linux)."""
    view = memoryview(buf).cast("B")
    while view:
        k = os.write(fd, view)
        if k <= 0:
            raise OSError(errno.EIO, "write() made no progress")
        view = view[k:]


def _read_file(path: str, n: int) -> bytearray:
    """The ``n`` bytes of an overflow file, checked to be ours and exactly that long."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_size != n:
            raise ValueError(f"overflow file {path} is not the payload its task record "
                             f"describes ({st.st_size} bytes, expected {n})")
        buf = bytearray(n)
        view = memoryview(buf)
        pos = 0
        while pos < n:  # one read() stops at about 2 GiB
            k = os.readv(fd, [view[pos:]])
            if k <= 0:
                raise ValueError(f"overflow file {path} ended after {pos} of {n} bytes")
            pos += k
        return buf
    finally:
        os.close(fd)


def lost_payload_error(err: int, n: int) -> SerializationError:
    """The error for a payload that could not be stored (``LOST``): what happened, what to do."""
    msg = (f"a payload of {n} bytes (a task's arguments or result) could not be stored in "
           f"shared memory: {os.strerror(err) if err else 'unknown error'}.")
    if err in (errno.ENOSPC, errno.EDQUOT):
        d = shm_dir()
        msg += (f" {d} is full: free space there (remove files other programs left), pass "
                "smaller arguments and results, or give the container more shared memory "
                "(e.g. docker run --shm-size=1g).")
    elif err == errno.EEXIST:
        msg += (" Every fresh overflow file name tried existed already: another process is "
                "creating files in the shared-memory directory.")
    return SerializationError(msg)
