"""Task records and payload storage in the shared segment.

A **record** (128 bytes) describes one task: who submitted it, its state,
its join counter, and where its payload lives.  A **handle** names a record
across processes: ``generation << 32 | index``; the generation is bumped
when the record is freed, so a stale handle can be recognised.

Payloads (the pickled call, later the pickled result) live in one of:

* the record itself, when at most ``INLINE`` bytes (most small calls);
* a block of a size class (1 KiB, 16 KiB, 256 KiB by default), taken from
  that class's free ring;
* an **overflow file** ``<segment>-x<n>`` in /dev/shm (0600) when larger
  than every class or when the classes are exhausted: slower, never fails
  for lack of arena space.

Records come from a free ring too; when none is free the client keeps the
task in a local backlog until one is (see executor.py).

Ownership: a record is written by one process at a time, and handed to
the next through a queue push (release) and pop (acquire), so its plain
fields need no atomics.  Only ``state`` (client cancel vs worker start,
CAS) and ``pending`` (join counter, add64 acq_rel) are contended.
"""

from __future__ import annotations

import contextlib
import os
import struct
import time
from typing import Any

from stealer import serialize
from stealer.shm import (
    H_CLIENT_PARK,
    H_OVERFLOW_SEQ,
    H_PARKED,
    H_SEARCHING,
    RECORD_BYTES,
    SHM_DIR,
    W_PARK,
    WORKER_BYTES,
    Segment,
    _pow2,
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
R_PCLASS = 44  # u32 payload storage: 0 inline, i+1 block class i, OVERFLOW
R_PREF = 48  # u64 block index or overflow number
R_PLEN = 56  # u64 payload length in bytes
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
        self._ov_prefix = os.path.join(SHM_DIR, seg.name + "-x")
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
        """Store a pickled payload for the record at ``off`` (replacing none)."""
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
                if b >= 0:
                    serialize.write_frame(mm, base + size * b, data, bufs)
                    _PAYLOAD.pack_into(mm, off + R_PCLASS, ci + 1, b, n)
                    return
        seq = self.region.add64(H_OVERFLOW_SEQ, 1)
        path = f"{self._ov_prefix}{seq}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            if bufs:
                buf = bytearray(n)
                serialize.write_frame(buf, 0, data, bufs)
                os.write(fd, buf)
            else:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        os.close(fd)
        _PAYLOAD.pack_into(mm, off + R_PCLASS, OVERFLOW, seq, n)

    def take(self, off: int) -> Any:
        """Unpickle the record's payload and release its storage."""
        mm = self.mm
        pclass, pref, n = _PAYLOAD.unpack_from(mm, off + R_PCLASS)
        has_bufs = bool(_U32.unpack_from(mm, off + R_KIND)[0] & F_BUFFERS)
        if pclass == 0:
            src = mm[off + R_INLINE : off + R_INLINE + n]
        elif pclass == OVERFLOW:
            path = f"{self._ov_prefix}{pref}"
            with open(path, "rb") as f:
                src = f.read()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        else:
            size, ring, base = self.classes[pclass - 1]
            start = base + size * pref
            src = mm[start : start + n]
            ring.push(pref)
        _PAYLOAD.pack_into(mm, off + R_PCLASS, 0, 0, 0)
        return serialize.loads_frame(src, has_bufs)

    def drop_payload(self, off: int) -> None:
        """Release payload storage without reading it."""
        mm = self.mm
        pclass, pref, _n = _PAYLOAD.unpack_from(mm, off + R_PCLASS)
        if pclass == OVERFLOW:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"{self._ov_prefix}{pref}")
        elif pclass:
            self.classes[pclass - 1][1].push(pref)
        _PAYLOAD.pack_into(mm, off + R_PCLASS, 0, 0, 0)
