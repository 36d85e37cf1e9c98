"""Task records and payload storage in the shared segment.

A **record** (128 bytes) describes one task: who submitted it, its state,
its join counter, and where its payload lives.  A **handle** names a record
across processes: ``generation << 32 | index``; the generation is bumped
when the record is freed, so a stale handle can be recognised.

Payloads (the pickled call, later the pickled result) live in one of:

* the record itself, when at most ``INLINE`` bytes (most small calls);
* a block of a size class (1 KiB, 16 KiB, 256 KiB by default), taken from
  that class's free ring;
* an **overflow file** ``<segment>-x<16 hex digits>`` beside the segment
  (0600) when larger than every class or when the classes are exhausted:
  slower, never fails for lack of arena space.  The name's suffix is 64
  random bits, kept in the record's ``R_PREF`` (the reader needs nothing
  else): /dev/shm is world-writable and its listing public, so a counter
  would let another user create (or symlink) the next name first.  The file
  is created with O_EXCL|O_NOFOLLOW; a name that exists anyway (a leftover,
  or someone else's file) is skipped for a fresh one.  When the file cannot
  be written (ENOSPC: /dev/shm full), the record gets the ``LOST`` payload
  class instead, and whoever takes the payload gets a SerializationError
  saying why: the producer (a worker's result, the result thread's backlog)
  never dies of it.

Every payload descriptor (class, block index, length) is read from shared
memory and checked against the layout before anything is copied or freed.

Records come from a free ring too; when none is free the client keeps the
task in a local backlog until one is (see executor.py).

Ownership: a record is written by one process at a time, and handed to
the next through a queue push (release) and pop (acquire), so its plain
fields need no atomics.  Only ``state`` (client cancel vs worker start,
CAS) and ``pending`` (join counter, add64 acq_rel) are contended.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
import struct
import time
from typing import Any

from stealer import serialize
from stealer.errors import SerializationError
from stealer.shm import (
    H_CLIENT_PARK,
    H_OVERFLOW_SEQ,
    H_PARKED,
    H_SEARCHING,
    RECORD_BYTES,
    W_PARK,
    WORKER_BYTES,
    Segment,
    _pow2,
    shm_dir,
)

__all__ = ["Arena"]

# Record fields (byte offsets inside a record).
R_WORD0 = 0  # u64 generation (low 32) | state S_* (high 32): cancel and start CAS the whole
#              word with the handle's generation, so a stale handle can never hit a reused record
R_GEN = 0  # u32 generation: bumped (store64 release) by whoever frees the record
R_STATE = 4  # u32 S_*: client CAS (cancel) vs worker CAS (start), seq_cst both, via R_WORD0
R_KIND = 8  # u32 K_* | F_* flags: written by the record's producer before the queue push
R_STATUS = 12  # u32 ST_*: written by the worker that completes the task, before its completion push
R_LINK = 16  # u64 future id (root) or parent handle (child): producer, before the push
R_PENDING = 24  # i64 join counter: add64 (acq_rel) by the task and its children; the last one resumes it
R_OWNER = 32  # u32 worker holding the suspended continuation: written before the first add64 on pending
R_INCARNATION = 36  # u32 that worker's incarnation: same writer/ordering as R_OWNER
R_CONT = 40  # u32 continuation id in that worker: same writer/ordering as R_OWNER
R_PCLASS = 44  # u32 payload storage: 0 inline, i+1 block class i, OVERFLOW, LOST
R_PREF = 48  # u64 block index, overflow file token (random), or LOST's errno
R_PLEN = 56  # u64 payload length in bytes (LOST: the length that could not be stored)
R_TSUBMIT = 64  # u64 monotonic ns at submit (client) or spawn (worker)
R_TSTART = 72  # u64 monotonic ns when a worker started it
R_INLINE = 80
INLINE = RECORD_BYTES - R_INLINE

S_FREE, S_QUEUED, S_RUNNING, S_CANCELLED, S_DONE, S_DETACHED = range(6)
K_ROOT, K_CHILD = 1, 2
K_MASK = 0xFF
F_BUFFERS = 0x100  # payload is a frame with out-of-band buffers
ST_OK, ST_ERROR, ST_CRASHED = 0, 1, 2
OVERFLOW = 0xFFFF
LOST = 0xFFFE  # the payload could not be stored (overflow file failed); R_PREF holds the errno
OVERFLOW_TRIES = 8  # fresh names tried when an overflow file's name exists already

_HEAD = struct.Struct("=IIIIQqIIIIQQQQ")  # the 80-byte header, all fields
_KIND_LINK = struct.Struct("=IIQ")  # kind, status, link
_PAYLOAD = struct.Struct("=IQQ")  # pclass, pref, plen
_KIND_STATUS = struct.Struct("=II")
_I64 = struct.Struct("=q")
_U32 = struct.Struct("=I")
_U64 = struct.Struct("=Q")
assert _HEAD.size == R_INLINE


class Arena:
    """Record and payload allocation over a :class:`~stealer.shm.Segment`."""

    def __init__(self, seg: Segment, injector: Any = None) -> None:
        Q = seg.Q
        L = seg.layout
        self.seg = seg
        self.mm = seg.mm
        self.region = seg.region
        self.nrecords = L.records
        self.rec_base = L.offsets["records"]
        self.rec_free = Q.MPMCRing(seg.region, L.offsets["record_free"], L.records)
        self.classes: list[tuple[int, Any, int]] = []
        for i, (size, count) in enumerate(L.block_classes):
            ring = Q.MPMCRing(seg.region, L.offsets[f"block_free{i}"], _pow2(count))
            self.classes.append((size, ring, L.offsets[f"blocks{i}"]))
        self._counts = [count for _, count in L.block_classes]
        self._ov_prefix = seg.path + "-x"  # overflow files live beside the segment
        self.injector = (injector if injector is not None
                         else Q.MPMCRing(seg.region, L.offsets["injector"], L.records))
        self._idle: Any = None
        if getattr(Q, "HotPath", None) is not None and os.environ.get("STEALER_PY_HOTPATH") != "1":
            hot = Q.HotPath(seg.region, self.rec_base, self.nrecords, self.rec_free,
                            self.injector, H_CLIENT_PARK, H_SEARCHING, H_PARKED,
                            L.worker(0) + W_PARK, WORKER_BYTES, L.nworkers)
            self.submit_inline = hot.submit_inline
            self.notify_one = hot.notify_one
            self.start = hot.start
            self.finish_inline = hot.finish_inline
            self.complete_take = hot.complete_take
            self.free = self._native_free(hot)

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
        """The idle policy (stealer/idle.py) the reference composite operations use."""
        if self._idle is None:
            from stealer.idle import Idle

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
        return self.rec_base + RECORD_BYTES * (h & 0xFFFFFFFF)

    def alloc(self) -> int:
        """A free record's handle, or -1 when all are in use."""
        idx = self.rec_free.pop()
        if idx < 0:
            return -1
        gen = _U32.unpack_from(self.mm, self.rec_base + RECORD_BYTES * idx)[0]
        return (gen << 32) | idx

    def free(self, h: int) -> None:
        """Release the record and its payload storage; the handle becomes stale."""
        off = self.off(h)
        self.drop_payload(off)
        gen = (_U32.unpack_from(self.mm, off)[0] + 1) & 0x7FFFFFFF
        self.region.store64(off + R_WORD0, gen | (S_FREE << 32))  # release: stale CASes fail now
        self.rec_free.push(h & 0xFFFFFFFF)  # release: the next owner sees gen and the cleared fields

    def cas_state(self, h: int, old: int, new: int) -> bool:
        """CAS the record's state from ``old`` to ``new`` if ``h`` is still current."""
        gen = h >> 32
        return self.region.cas64(self.off(h) + R_WORD0, gen | (old << 32), gen | (new << 32))

    # -- composite hot-path operations --------------------------------------
    # Reference implementations; HotPath in native/_cqueues.pyx does the same
    # in one native call each and replaces these when the extension loads.

    def submit_inline(self, kind: int, link: int, data: bytes) -> int:
        """Client: a fresh record with an inline payload, pushed on the injector, and a
        parked worker woken if nobody searches; -1 if no record is free."""
        if len(data) > INLINE:
            raise ValueError("payload too large for the inline path")
        h = self.alloc()
        if h < 0:
            return -1
        off = self.setup(h, kind, link, time.monotonic_ns())
        self.mm[off + R_INLINE : off + R_INLINE + len(data)] = data
        _PAYLOAD.pack_into(self.mm, off + R_PCLASS, 0, 0, len(data))
        self.injector.push(h)
        self.notify_one()
        return h

    def notify_one(self) -> int:
        """Wake one parked worker if nobody searches (see stealer/idle.py)."""
        return self.idle.notify_one()

    def start(self, h: int, current_off: int, t_start: int, wait_hist_off: int = -1) -> tuple | None:
        """Worker: claim a queued record; None if the client cancelled it (caller frees it)."""
        if not self.cas_state(h, S_QUEUED, S_RUNNING):
            return None
        off = self.off(h)
        self.region.store64(current_off, h + 1)
        _I64.pack_into(self.mm, off + R_PENDING, 1)
        _U64.pack_into(self.mm, off + R_TSTART, t_start)
        if wait_hist_off >= 0:
            t_submit = _U64.unpack_from(self.mm, off + R_TSUBMIT)[0]
            self.region.hist_record(wait_hist_off, t_start - t_submit)
        kind, _status, link = self.kind_link(off)
        pclass, _pref, n = _PAYLOAD.unpack_from(self.mm, off + R_PCLASS)
        if pclass == 0:
            data = self.mm[off + R_INLINE : off + R_INLINE + n]
            _U64.pack_into(self.mm, off + R_PLEN, 0)
            return kind, link, data
        return kind, link, None

    def finish_inline(self, h: int, status: int, data: bytes, completions: Any) -> int:
        """Worker: store a small result; 0 too large, 1 root completed, 2 child."""
        if len(data) > INLINE:
            return 0
        off = self.off(h)
        mm = self.mm
        mm[off + R_INLINE : off + R_INLINE + len(data)] = data
        _PAYLOAD.pack_into(mm, off + R_PCLASS, 0, 0, len(data))
        kind = _U32.unpack_from(mm, off + R_KIND)[0] & ~F_BUFFERS
        _KIND_STATUS.pack_into(mm, off + R_KIND, kind, status)
        if kind & K_MASK != K_ROOT:
            return 2
        while not completions.push(h):
            pass
        self.idle.wake_client()
        return 1

    def complete_take(self, h: int) -> tuple:
        """Client: (kind, status, link, inline payload or None); frees the record if inline."""
        off = self.off(h)
        kind, status, link = self.kind_link(off)
        pclass, _pref, n = _PAYLOAD.unpack_from(self.mm, off + R_PCLASS)
        if pclass != 0:
            return kind, status, link, None
        data = self.mm[off + R_INLINE : off + R_INLINE + n]
        self.free(h)
        return kind, status, link, data

    def valid(self, h: int) -> bool:
        return _U32.unpack_from(self.mm, self.off(h))[0] == (h >> 32)

    def setup(self, h: int, kind: int, link: int, t_submit: int) -> int:
        """Fill a fresh record's header (state QUEUED, no payload); returns its offset."""
        off = self.off(h)
        _HEAD.pack_into(self.mm, off, h >> 32, S_QUEUED, kind, ST_OK, link, 0, 0, 0, 0, 0, 0, 0,
                        t_submit, 0)
        return off

    def kind_link(self, off: int) -> tuple[int, int, int]:
        return _KIND_LINK.unpack_from(self.mm, off + R_KIND)

    def set_status(self, off: int, status: int) -> None:
        _U32.pack_into(self.mm, off + R_STATUS, status)

    # -- payloads --------------------------------------------------------
    def put(self, off: int, data: bytes, bufs: list) -> None:
        """Store a pickled payload for the record at ``off`` (replacing none).

        Never fails for lack of room: a payload that cannot be stored becomes
        a ``LOST`` descriptor, and :meth:`take` raises a SerializationError
        that says why (so a worker or the result thread never dies of it).
        """
        self._check_off(off)
        mm = self.mm
        if bufs:
            n = serialize.frame_size(data, bufs)
            kind = _U32.unpack_from(mm, off + R_KIND)[0]
            _U32.pack_into(mm, off + R_KIND, kind | F_BUFFERS)
        else:
            n = len(data)
            kind = _U32.unpack_from(mm, off + R_KIND)[0]
            if kind & F_BUFFERS:
                _U32.pack_into(mm, off + R_KIND, kind & ~F_BUFFERS)
        if n <= INLINE:
            serialize.write_frame(mm, off + R_INLINE, data, bufs)
            _PAYLOAD.pack_into(mm, off + R_PCLASS, 0, 0, n)
            return
        for ci, (size, ring, base) in enumerate(self.classes):
            if n <= size:
                b = ring.pop()
                if b >= self._counts[ci]:  # a free-ring cell from shared memory: check it
                    raise ValueError(f"corrupt free list of block class {ci}: block {b} of "
                                     f"{self._counts[ci]} (the shared memory was overwritten)")
                if b >= 0:
                    serialize.write_frame(mm, base + size * b, data, bufs)
                    _PAYLOAD.pack_into(mm, off + R_PCLASS, ci + 1, b, n)
                    return
        try:
            token = self._write_overflow(data, bufs)
        except OSError as exc:  # ENOSPC above all: the reader gets the error, not us
            _PAYLOAD.pack_into(mm, off + R_PCLASS, LOST, exc.errno or 0, n)
            return
        self.region.add64(H_OVERFLOW_SEQ, 1)  # a statistic only: nobody orders on it
        _PAYLOAD.pack_into(mm, off + R_PCLASS, OVERFLOW, token, n)

    def _ov_path(self, token: int) -> str:
        return f"{self._ov_prefix}{token:016x}"

    def _write_overflow(self, data: bytes, bufs: list) -> int:
        """Write a payload to a new overflow file; its token (R_PREF). OSError on failure."""
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

    def _descriptor(self, off: int) -> tuple[int, int, int]:
        """The record's (pclass, pref, length), checked against the layout.

        ValueError if they point outside their storage: they come from shared
        memory, which a crashed or hostile process may have overwritten.
        """
        self._check_off(off)
        pclass, pref, n = _PAYLOAD.unpack_from(self.mm, off + R_PCLASS)
        if pclass == 0:
            ok = n <= INLINE
        elif pclass in (OVERFLOW, LOST):
            ok = True  # an overflow file's size is checked when it is read
        elif pclass <= len(self.classes):
            ok = pref < self._counts[pclass - 1] and n <= self.classes[pclass - 1][0]
        else:
            ok = False
        if not ok:
            raise ValueError(
                f"corrupt payload descriptor in task record {(off - self.rec_base) // RECORD_BYTES}"
                f": class {pclass}, index {pref}, length {n} lie outside the arena (the shared "
                "memory was overwritten)")
        return pclass, pref, n

    def take(self, off: int) -> Any:
        """Unpickle the record's payload and release its storage."""
        mm = self.mm
        try:
            pclass, pref, n = self._descriptor(off)
        except ValueError:
            _PAYLOAD.pack_into(mm, off + R_PCLASS, 0, 0, 0)  # nothing valid to release later
            raise
        has_bufs = bool(_U32.unpack_from(mm, off + R_KIND)[0] & F_BUFFERS)
        try:
            if pclass == 0:
                src: Any = mm[off + R_INLINE : off + R_INLINE + n]
            elif pclass == OVERFLOW:
                path = self._ov_path(pref)
                try:
                    src = _read_file(path, n)
                finally:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(path)
            elif pclass == LOST:
                raise lost_payload_error(pref, n)
            else:
                size, ring, base = self.classes[pclass - 1]
                start = base + size * pref
                src = mm[start : start + n]
                ring.push(pref)
        finally:
            _PAYLOAD.pack_into(mm, off + R_PCLASS, 0, 0, 0)
        return serialize.loads_frame(src, has_bufs)

    def drop_payload(self, off: int) -> None:
        """Release payload storage without reading it.

        A corrupt descriptor releases nothing (pushing a bogus block index
        would corrupt the free ring; at worst one block leaks).
        """
        self._check_off(off)
        mm = self.mm
        try:
            pclass, pref, _n = self._descriptor(off)
        except ValueError:
            pclass = 0
        if pclass == OVERFLOW:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._ov_path(pref))
        elif pclass and pclass != LOST:
            self.classes[pclass - 1][1].push(pref)
        _PAYLOAD.pack_into(mm, off + R_PCLASS, 0, 0, 0)


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
