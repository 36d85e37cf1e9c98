"""Record and payload storage (stealer/shared/arena.py), on every implementation of the hot path.

Each test runs on three arenas over a real segment in /dev/shm (tests/rig.py):

* ``native``: native queues, the per-task operations done by ``HotPath``
  (native/_cqueues.pyx);
* ``native-pyarena``: native queues, the Arena's own Python methods
  (``STEALER_PY_HOTPATH=1``);
* ``python``: the pure-Python reference queues (``stealer.shared.pyqueues`` has no
  HotPath, so the Arena's Python methods again).

The fast path (submit_inline / start / finish_inline / complete_take) and the
Python path (setup / put / put_result / read_call / take / drop_result / free)
must give back the same bytes, keep the call payload while a result is stored,
release every block they took, and reject corrupt words instead of reading or
writing outside the record or the block area.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pickle
import stat
from typing import Any

import pytest
from rig import CONFIGS, Rig, make_rig, rig_fixture, ring_items

from stealer.shared import serialize
from stealer.shared._layout import (
    F_BUFFERS,
    F_RBUFFERS,
    INLINE,
    K_CHILD,
    K_ROOT,
    OVERFLOW,
    R_INLINE,
    R_KIND,
    R_PCLASS,
    R_PLEN,
    R_PREF,
    R_RCLASS,
    R_RETRIES,
    R_RLEN,
    R_RREF,
    R_STATUS,
    R_TSTART,
    R_TSUBMIT,
    RECORD_BYTES,
    S_CANCELLED,
    S_DONE,
    S_FREE,
    S_QUEUED,
    S_RUNNING,
    ST_ERROR,
    ST_OK,
)
from stealer.shared.records import Outcome, word

CLASSES = ((256, 8), (1024, 4))  # small block classes: a few KiB of blocks in all
BIG = 2000  # larger than every class: an overflow file


# --------------------------------------------------------------------------- rig

rig = rig_fixture(block_classes=CLASSES)


def blob(n: int, seed: int = 1) -> bytes:
    return bytes((seed * 31 + i * 7) & 0xFF for i in range(n))


def pickled(n: int, seed: int = 1) -> tuple[bytes, Any]:
    """A pickle of exactly ``n`` bytes (n >= 15, not 271..273) and the object it holds."""
    for k in range(max(0, n - 20), n + 1):
        obj = blob(k, seed)
        data = pickle.dumps(obj, 5)
        if len(data) == n:
            return data, obj
    raise AssertionError(f"no pickle of {n} bytes")


def u32(rig: Rig, off: int) -> int:
    return int.from_bytes(rig.arena.mm[off : off + 4], "little")


def u64(rig: Rig, off: int) -> int:
    return int.from_bytes(rig.arena.mm[off : off + 8], "little")


def put64(rig: Rig, off: int, v: int) -> None:
    rig.arena.mm[off : off + 8] = v.to_bytes(8, "little")


def put32(rig: Rig, off: int, v: int) -> None:
    rig.arena.mm[off : off + 4] = v.to_bytes(4, "little")


def overflow_files(rig: Rig) -> list[str]:
    return sorted(glob.glob(rig.seg.path + "-x*"))


def assert_all_free(rig: Rig) -> None:
    """Every record on the record free ring once, every block on its class ring once."""
    a = rig.arena
    assert sorted(ring_items(a.rec_free)) == list(range(a.nrecords))
    for (_size, ring, _base), count in zip(a.classes, a._counts):
        assert sorted(ring_items(ring)) == list(range(count))
    assert overflow_files(rig) == []


def fresh(rig: Rig, kind: int = K_ROOT, link: int = 99, retries: int = 0) -> tuple[int, int]:
    """A record set up by the Python path: (handle, offset), QUEUED, no payload yet."""
    a = rig.arena
    h = a.alloc()
    assert h >= 0
    return h, a.setup(h, kind, link, 12345, retries)


def run_hot(rig: Rig, call: bytes, who: int = 1, kind: int = K_ROOT, link: int = 7) -> int:
    """submit_inline + take off the injector + start by worker who-1: a RUNNING|who handle."""
    a = rig.arena
    h = a.submit_inline(kind, link, call)
    assert h >= 0
    assert rig.injector.pop() == h
    assert a.start(h, rig.cur_off(who - 1), 1000, -1, who) == (kind, link, call)
    return h


# --------------------------------------------------------------------------- fast path


@pytest.mark.parametrize("call_len", [0, 1, 48, INLINE])
@pytest.mark.parametrize("res_len", [0, 1, 48, INLINE])
def test_hot_path_round_trip(rig, call_len, res_len):
    a, tr = rig.arena, rig.arena.tr
    call = blob(call_len, 3)
    h = a.submit_inline(K_ROOT, 1234, call, 3)
    assert h >= 0
    off = a.off(h)
    assert rig.injector.pop() == h
    assert len(rig.injector) == 0
    assert tr.load(h) == (h >> 32, S_QUEUED, 0)
    assert u32(rig, off + R_RETRIES) == 3
    assert u64(rig, off + R_TSUBMIT) > 0

    t = a.start(h, rig.cur_off(1), 777, -1, 2)
    assert t == (K_ROOT, 1234, call)
    assert rig.arena.region.load64(rig.cur_off(1)) == h + 1  # the current word: h + 1
    assert tr.load(h) == (h >> 32, S_RUNNING, 2)
    assert u64(rig, off + R_TSTART) == 777

    if call_len + res_len <= INLINE:
        res = blob(res_len, 5)
        assert a.finish_inline(h, ST_ERROR, res, rig.completions[1], 2) == 1
        assert rig.completions[1].pop() == h
        assert tr.load(h) == (h >> 32, S_DONE, 2)
        assert a.start(h, rig.cur_off(1), 1, -1, 2) is None  # DONE: no second start
        assert a.complete_take(h) == (K_ROOT, ST_ERROR, 1234, res)
        assert tr.load(h) == ((h >> 32) + 1, S_FREE, 0)  # freed by complete_take
        assert not a.valid(h)
    else:
        # Too large beside the call: 0, nothing changed, the Python path takes over.
        res, obj = pickled(max(res_len, 60), 5)
        assert a.finish_inline(h, ST_OK, res, rig.completions[1], 2) == 0
        assert tr.load(h) == (h >> 32, S_RUNNING, 2)
        assert rig.completions[1].pop() < 0
        a.put_result(off, res, [])
        a.set_status(off, ST_ERROR)
        assert tr.finish(h, 2) is Outcome.OK
        assert a.complete_take(h) == (K_ROOT, ST_ERROR, 1234, None)  # not inline: kept
        assert tr.load(h) == (h >> 32, S_DONE, 2)
        assert a.take(off) == obj
        assert a.release(h, S_DONE, 2, 0) is Outcome.OK
    assert_all_free(rig)


def test_hot_child_is_not_published(rig):
    a = rig.arena
    h = run_hot(rig, b"call", who=1, kind=K_CHILD, link=0x1234_0000_0005)
    assert a.finish_inline(h, ST_OK, b"result", rig.completions[0], 1) == 2
    assert rig.completions[0].pop() < 0  # the caller pings the parent instead
    assert a.tr.load(h) == (h >> 32, S_DONE, 1)
    assert a.complete_take(h) == (K_CHILD, ST_OK, 0x1234_0000_0005, b"result")
    assert_all_free(rig)


def test_submit_inline_too_large_takes_nothing(rig):
    a = rig.arena
    with pytest.raises(ValueError):
        a.submit_inline(K_ROOT, 1, bytes(INLINE + 1))
    assert len(a.rec_free) == a.nrecords
    assert len(rig.injector) == 0


def test_submit_inline_without_free_record(rig):
    a = rig.arena
    hs = [a.submit_inline(K_ROOT, i, b"x") for i in range(a.nrecords)]
    assert all(h >= 0 for h in hs)
    assert len({h & 0xFFFFFFFF for h in hs}) == a.nrecords
    assert a.submit_inline(K_ROOT, 0, b"x") == -1
    assert a.alloc() == -1
    assert rig.injector.pop_many(a.nrecords + 1) == hs


def test_start_none_for_cancelled_stale_or_started(rig):
    a, tr = rig.arena, rig.arena.tr
    cur = rig.cur_off(0)
    h = a.submit_inline(K_ROOT, 1, b"c")
    assert tr.cancel(h) is Outcome.OK
    assert a.start(h, cur, 1, -1, 1) is None
    assert tr.load(h) == (h >> 32, S_CANCELLED, 0)
    assert a.release(h, S_CANCELLED, 0, 1) is Outcome.OK
    # stale: freed (and its index back on the free ring)
    assert a.start(h, cur, 1, -1, 1) is None
    assert tr.load(h) == ((h >> 32) + 1, S_FREE, 0)
    # started already (a second copy of the handle, as after a re-push): one wins
    h2 = a.submit_inline(K_ROOT, 2, b"d")
    assert a.start(h2, cur, 1, -1, 1) == (K_ROOT, 2, b"d")
    assert a.start(h2, rig.cur_off(1), 1, -1, 2) is None
    assert tr.load(h2) == (h2 >> 32, S_RUNNING, 1)


def test_start_stale_handle_on_reused_record(rig):
    a, tr = rig.arena, rig.arena.tr
    for _ in range(a.nrecords - 1):  # only one record stays free
        assert a.alloc() >= 0
    old = a.submit_inline(K_ROOT, 1, b"old")
    assert rig.injector.pop() == old
    assert a.release(old, S_QUEUED, 0, 0) is Outcome.OK
    new = a.submit_inline(K_ROOT, 2, b"new")
    assert new & 0xFFFFFFFF == old & 0xFFFFFFFF and new != old
    assert a.start(old, rig.cur_off(0), 1, -1, 1) is None
    assert tr.load(new) == (new >> 32, S_QUEUED, 0)
    assert a.start(new, rig.cur_off(0), 1, -1, 1) == (K_ROOT, 2, b"new")


@pytest.mark.parametrize("case", ["queued", "running-other", "cancelled", "done", "stale",
                                  "stale-reused"])
def test_finish_inline_minus_one_unless_running_who(rig, case):
    a, tr = rig.arena, rig.arena.tr
    comp = rig.completions[0]
    h = a.submit_inline(K_ROOT, 1, b"call")
    assert rig.injector.pop() == h
    if case == "running-other":
        assert a.start(h, rig.cur_off(1), 1, -1, 2) is not None
    elif case == "cancelled":
        assert tr.cancel(h) is Outcome.OK
    elif case == "done":
        assert a.start(h, rig.cur_off(0), 1, -1, 1) is not None
        assert a.finish_inline(h, ST_OK, b"first", comp, 1) == 1
        assert comp.pop() == h
    elif case.startswith("stale"):
        assert a.release(h, S_QUEUED, 0, 0) is Outcome.OK
        if case == "stale-reused":
            for _ in range(a.nrecords):
                h2 = a.submit_inline(K_ROOT, 2, b"other")
                if h2 & 0xFFFFFFFF == h & 0xFFFFFFFF:
                    break
            assert a.start(h2, rig.cur_off(0), 1, -1, 1) is not None  # RUNNING|1, new gen
    word = a.region.load64(a.off(h))
    assert a.finish_inline(h, ST_OK, b"res", comp, 1) == -1
    assert a.region.load64(a.off(h)) == word  # no transition
    assert comp.pop() < 0  # nothing published


# --------------------------------------------------------------------------- Python path


def _class_of(rig: Rig, n: int, inline_at: int) -> int:
    if inline_at + n <= INLINE:
        return 0
    for i, (size, _count) in enumerate(CLASSES):
        if n <= size:
            return i + 1
    return OVERFLOW


@pytest.mark.parametrize("call_len", [20, 60, INLINE, 200, 900, BIG])
@pytest.mark.parametrize("res_len", [20, 40, 200, 1000, BIG])
def test_payload_classes_and_call_kept(rig, call_len, res_len):
    a = rig.arena
    call, cobj = pickled(call_len, 1)
    res, robj = pickled(res_len, 2)
    h, off = fresh(rig)
    a.put(off, call, [])
    pclass = _class_of(rig, call_len, 0)
    assert u32(rig, off + R_PCLASS) == pclass
    assert u64(rig, off + R_PLEN) == call_len
    assert a.read_call(off) == cobj
    t = a.start(h, rig.cur_off(0), 5, -1, 1)
    assert t == (K_ROOT, 99, call if pclass == 0 else None)

    a.put_result(off, res, [])
    at = call_len if pclass == 0 else 0
    rclass = _class_of(rig, res_len, at)
    assert u32(rig, off + R_RCLASS) == rclass
    assert u64(rig, off + R_RLEN) == res_len
    if rclass == 0:  # inline, right after an inline call
        assert a.mm[off + R_INLINE + at : off + R_INLINE + at + res_len] == res
    if OVERFLOW in (pclass, rclass):
        for path in overflow_files(rig):
            assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert len(overflow_files(rig)) == (pclass == OVERFLOW) + (rclass == OVERFLOW)
    assert a.take(off) == robj
    assert a.read_call(off) == cobj  # the call stays readable: a re-run needs it

    # A re-run: the old result dropped, a new one stored; the call still there.
    res2, robj2 = pickled(res_len, 3)
    a.drop_result(off)
    assert u32(rig, off + R_RCLASS) == 0 and u64(rig, off + R_RLEN) == 0
    a.put_result(off, res2, [])
    assert a.take(off) == robj2
    assert a.read_call(off) == cobj
    assert a.tr.finish(h, 1) is Outcome.OK
    assert a.release(h, S_DONE, 1, 0) is Outcome.OK
    assert_all_free(rig)


def test_out_of_band_buffers_round_trip(rig):
    a = rig.arena
    arr = bytearray(blob(3000, 9))  # above serialize.INBAND_MAX: out-of-band
    call, cbufs = serialize.dumps(("f", pickle.PickleBuffer(arr)))
    assert cbufs
    h, off = fresh(rig)
    a.put(off, call, cbufs)
    assert u32(rig, off + R_KIND) & F_BUFFERS
    got = a.read_call(off)
    assert got[0] == "f" and bytes(got[1]) == bytes(arr)
    res, rbufs = serialize.dumps(pickle.PickleBuffer(bytearray(blob(5000, 4))))
    a.put_result(off, res, rbufs)
    assert u32(rig, off + R_KIND) & F_RBUFFERS
    assert bytes(a.take(off)) == blob(5000, 4)
    a.put_result(off, *serialize.dumps("plain"))  # replaces it; the flag follows
    assert not u32(rig, off + R_KIND) & F_RBUFFERS
    assert a.take(off) == "plain"
    assert bytes(a.read_call(off)[1]) == bytes(arr)
    a.free(h)
    assert_all_free(rig)


def test_free_releases_both_payloads_no_leak(rig):
    a = rig.arena
    sizes = [(20, 200), (200, 20), (200, 900), (900, BIG), (BIG, BIG), (60, 60), (20, 40)]
    for cycle in range(120):
        cl, rl = sizes[cycle % len(sizes)]
        h, off = fresh(rig)
        a.put(off, pickled(cl, cycle)[0], [])
        assert a.start(h, rig.cur_off(0), 1, -1, 1) is not None
        a.put_result(off, pickled(rl, cycle)[0], [])
        if cycle % 3 == 0:  # a retry first: drop the result, store another
            a.drop_result(off)
            a.put_result(off, pickled(rl, cycle + 1)[0], [])
        assert a.tr.finish(h, 1) is Outcome.OK
        if cycle % 2:
            a.complete_take(h)  # frees only all-inline records
            if a.valid(h):
                assert a.release(h, S_DONE, 1, 0) is Outcome.OK
        else:
            assert a.release(h, S_DONE, 1, 0) is Outcome.OK
    assert_all_free(rig)


def test_exhausted_classes_spill_to_overflow_and_come_back(rig):
    a = rig.arena
    n0 = CLASSES[0][1] + CLASSES[1][1] + 2  # more 200-byte payloads than both classes hold
    hs = []
    for i in range(n0):
        h, off = fresh(rig)
        a.put(off, pickled(200, i)[0], [])
        hs.append((h, off))
    classes = [u32(rig, off + R_PCLASS) for _h, off in hs]
    assert classes == [1] * CLASSES[0][1] + [2] * CLASSES[1][1] + [OVERFLOW] * 2
    assert [a.read_call(off) for _h, off in hs] == [pickled(200, i)[1] for i in range(n0)]
    for h, _off in hs:
        a.free(h)
    assert_all_free(rig)


def test_complete_take_keeps_non_inline_records(rig):
    a = rig.arena
    h, off = fresh(rig)
    call, cobj = pickled(200, 1)
    a.put(off, call, [])
    assert a.start(h, rig.cur_off(0), 1, -1, 1) == (K_ROOT, 99, None)
    # the call is in a block: an inline result goes at offset 0 of the inline area
    assert a.finish_inline(h, ST_OK, b"r" * INLINE, rig.completions[0], 1) == 1
    assert rig.completions[0].pop() == h
    assert u32(rig, off + R_RCLASS) == 0 and u64(rig, off + R_RLEN) == INLINE
    assert a.complete_take(h) == (K_ROOT, ST_OK, 99, None)  # call not inline: kept
    assert a.tr.load(h) == (h >> 32, S_DONE, 1)
    assert a.read_call(off) == cobj
    assert a.mm[off + R_INLINE : off + R_INLINE + INLINE] == b"r" * INLINE
    assert a.release(h, S_DONE, 1, 0) is Outcome.OK
    assert_all_free(rig)


# --------------------------------------------------------------------------- corrupt words


@pytest.mark.parametrize("idx", [16, 17, 1 << 20, 0xFFFFFFFF])
def test_handle_index_out_of_range_rejected(rig, idx):
    a = rig.arena
    assert a.nrecords == 16
    h = (3 << 32) | idx
    end = a.rec_base + RECORD_BYTES * a.nrecords
    after = bytes(a.mm[end : end + 256])
    with pytest.raises(IndexError):
        a.off(h)
    with pytest.raises(IndexError):
        a.start(h, rig.cur_off(0), 1, -1, 1)
    with pytest.raises(IndexError):
        a.finish_inline(h, ST_OK, b"x", rig.completions[0], 1)
    with pytest.raises(IndexError):
        a.complete_take(h)
    with pytest.raises(IndexError):
        a.free(h)
    assert bytes(a.mm[end : end + 256]) == after
    assert len(a.rec_free) == a.nrecords


@pytest.mark.parametrize("plen", [INLINE + 1, 1 << 20, (1 << 64) - 1])
def test_corrupt_inline_call_length_rejected(rig, plen):
    a = rig.arena
    h = a.submit_inline(K_ROOT, 1, b"abc")
    off = a.off(h)
    put64(rig, off + R_PLEN, plen)
    with pytest.raises(ValueError):
        a.start(h, rig.cur_off(0), 1, -1, 1)
    with pytest.raises(ValueError):
        a.read_call(off)


@pytest.mark.parametrize("plen,rlen", [(0, INLINE + 1), (10, INLINE - 9), (INLINE + 1, 0),
                                       (0, (1 << 64) - 1), ((1 << 64) - 1, 2)])
def test_corrupt_inline_result_length_rejected(rig, plen, rlen):
    a = rig.arena
    h = run_hot(rig, b"abc")
    assert a.finish_inline(h, ST_OK, b"res", rig.completions[0], 1) == 1
    off = a.off(h)
    put64(rig, off + R_PLEN, plen)
    put64(rig, off + R_RLEN, rlen)
    with pytest.raises(ValueError):
        a.complete_take(h)
    with pytest.raises(ValueError):
        a.take(off)
    assert a.tr.load(h) == (h >> 32, S_DONE, 1)  # not freed


@pytest.mark.parametrize("plen", [INLINE + 1, (1 << 64) - 1])
def test_finish_inline_with_corrupt_call_length_writes_nothing(rig, plen):
    a = rig.arena
    h = run_hot(rig, b"abc")
    off = a.off(h)
    put64(rig, off + R_PLEN, plen)
    before = bytes(a.mm[a.rec_base : a.rec_base + RECORD_BYTES * a.nrecords])
    assert a.finish_inline(h, ST_OK, b"res", rig.completions[0], 1) == 0
    assert bytes(a.mm[a.rec_base : a.rec_base + RECORD_BYTES * a.nrecords]) == before


@pytest.mark.parametrize("which", ["call", "result"])
def test_corrupt_block_payload_rejected(rig, which):
    a = rig.arena
    _h, off = fresh(rig)
    a.put(off, pickled(200, 1)[0], [])
    a.put_result(off, pickled(200, 2)[0], [])
    ref = R_PREF if which == "call" else R_RREF
    n = R_PLEN if which == "call" else R_RLEN
    load = a.read_call if which == "call" else a.take
    good = u64(rig, off + n)
    put64(rig, off + n, CLASSES[0][0] + 1)  # longer than its class's block
    with pytest.raises(ValueError):
        load(off)
    put64(rig, off + n, good)
    put64(rig, off + ref, CLASSES[0][1])  # one past the last block
    with pytest.raises(ValueError):
        load(off)


@pytest.mark.parametrize("which", ["call", "result"])
def test_corrupt_block_ref_never_enters_the_free_ring(rig, which):
    """Freeing a record whose block index is out of range must not recycle that index:
    the next payload stored in that class would be written past the class's blocks."""
    a = rig.arena
    _size, count = CLASSES[0]
    ring = a.classes[0][1]
    h, off = fresh(rig)
    a.put(off, pickled(200, 1)[0], [])
    a.put_result(off, pickled(200, 2)[0], [])
    put64(rig, off + (R_PREF if which == "call" else R_RREF), count)  # one past the last
    with contextlib.suppress(ValueError, IndexError):
        a.free(h)
    items = ring_items(ring)
    assert all(0 <= b < count for b in items), f"block free ring holds {items} (count {count})"
    assert len(items) == len(set(items))


# --------------------------------------------------------------------------- agreement


def _script(rig: Rig) -> tuple[list, bytes]:
    """One fixed sequence of operations: (what each returned, the first records' bytes)."""
    a, tr = rig.arena, rig.arena.tr
    out: list = []
    c0, c1 = rig.completions
    h1 = a.submit_inline(K_ROOT, 11, b"a" * 10, 1)
    h2 = a.submit_inline(K_CHILD, h1, b"b" * 90)
    h3 = a.submit_inline(K_ROOT, 13, b"")
    out.append(rig.injector.pop_many(8) == [h1, h2, h3])
    out.append(a.start(h1, rig.cur_off(0), 100, -1, 1))
    out.append(a.start(h2, rig.cur_off(1), 200, -1, 2))
    out.append(tr.cancel(h3))
    out.append(a.start(h3, rig.cur_off(0), 300, -1, 1))
    out.append(a.finish_inline(h1, ST_OK, b"r" * 86, c0, 1))
    out.append(a.finish_inline(h2, ST_OK, b"r" * 7, c1, 2))  # does not fit beside 90 bytes
    out.append(a.finish_inline(h2, ST_ERROR, b"e" * 6, c1, 2))
    out.append((c0.pop_many(8) == [h1], c1.pop_many(8)))
    h4, off4 = fresh(rig, K_ROOT, 14, 2)
    a.put(off4, pickled(300)[0], [])
    out.append(a.start(h4, rig.cur_off(1), 400, -1, 2))
    a.put_result(off4, pickled(30)[0], [])
    out.append(tr.finish(h4, 2))
    out.append(a.complete_take(h4))
    out.append(a.take(off4) == pickled(30)[1])
    out.append([tr.load(h) for h in (h1, h2, h3, h4)])
    image = bytearray(a.mm[a.rec_base : a.rec_base + RECORD_BYTES * 4])
    for i in range(4):  # the submit clock is the only field that may differ
        image[RECORD_BYTES * i + R_TSUBMIT : RECORD_BYTES * i + R_TSUBMIT + 8] = bytes(8)
    out.append(a.complete_take(h1))
    out.append(a.complete_take(h2))
    out.append(a.release(h3, S_CANCELLED, 0, 0))
    out.append(a.release(h4, S_DONE, 2, 0))
    out.append([tr.load(h) for h in (h1, h2, h3, h4)])
    out.append(len(a.rec_free))
    out.append([len(ring) for _s, ring, _b in a.classes])
    return out, bytes(image)


def test_implementations_agree():
    rigs = []
    try:
        for cfg in CONFIGS:
            rigs.append(make_rig(cfg, block_classes=CLASSES))
        results = [_script(r) for r in rigs]
        (out0, image0) = results[0]
        for cfg, (out, image) in zip(CONFIGS[1:], results[1:]):
            for i, (x, y) in enumerate(zip(out0, out)):
                assert x == y, f"{CONFIGS[0]} and {cfg} differ at step {i}: {x!r} != {y!r}"
            for i in range(4):
                rec = slice(RECORD_BYTES * i, RECORD_BYTES * (i + 1))
                assert image0[rec] == image[rec], f"{cfg}: record {i} differs"
        # and what they agree on is right (a fresh segment: handles 0, 1, 2, 3 at generation 0)
        assert out0 == [
            True, (K_ROOT, 11, b"a" * 10), (K_CHILD, 0, b"b" * 90), Outcome.OK, None,
            1, 0, 2, (True, []), (K_ROOT, 14, None), Outcome.OK, (K_ROOT, ST_OK, 14, None),
            True, [(0, S_DONE, 1), (0, S_DONE, 2), (0, S_CANCELLED, 0), (0, S_DONE, 2)],
            (K_ROOT, ST_OK, 11, b"r" * 86), (K_CHILD, ST_ERROR, 0, b"e" * 6),
            Outcome.OK, Outcome.OK, [(1, S_FREE, 0)] * 4, 16, [8, 4],
        ]
    finally:
        for r in rigs:
            r.seg.unlink()


def test_status_and_retries_fields(rig):
    a = rig.arena
    h = run_hot(rig, b"x")
    off = a.off(h)
    assert a.finish_inline(h, 7, b"y", rig.completions[0], 1) == 1
    assert u32(rig, off + R_STATUS) == 7
    _h2, off2 = fresh(rig, retries=5)
    assert u32(rig, off2 + R_RETRIES) == 5
    put32(rig, off2 + R_STATUS, 1)
    a.set_status(off2, ST_OK)
    assert u32(rig, off2 + R_STATUS) == ST_OK


# --------------------------------------------------------------------------- a task's ends


def test_start_task_finish_value_end_task(rig):
    """The worker's three per-task calls (start at the time of the call; encode a plain
    result and finish it; clear the current word and record the run time), on each arena:
    the same words as start / finish_inline / store64 + hist_record."""
    import time

    from stealer.shared import metrics

    a, tr = rig.arena, rig.arena.tr
    cur = rig.cur_off(0)
    hist = rig.layout.metrics(0) + metrics.hist_offset(0, 1)
    values = [None, True, 7, -2.5, "é", b"xy", [1, 2], {"k": (3,)}]
    for v in values:
        h = a.submit_inline(K_ROOT, 99, b"call")
        assert rig.injector.pop() == h
        before = time.monotonic_ns()
        kind, link, call, t0 = a.start_task(h, cur, -1, 1)
        assert (kind, link, call) == (K_ROOT, 99, b"call")
        assert before <= t0 <= time.monotonic_ns()
        assert a.region.load64(cur) == h + 1 and tr.load(h) == (h >> 32, S_RUNNING, 1)
        assert a.finish_value(h, v, rig.completions[0], 1) == 1
        assert rig.completions[0].pop() == h and tr.load(h) == (h >> 32, S_DONE, 1)
        t1 = a.end_task(cur, hist, t0)
        assert t1 >= t0 and a.region.load64(cur) == 0
        _k, status, _l, data = a.complete_take(h)
        assert status == ST_OK and serialize.load_value(data) == v
        small = serialize.encode_small(v)
        assert data == (small if small is not None else pickle.dumps(v, 5))
    assert metrics.Histogram.read(a.mm, hist).total == len(values)
    assert_all_free(rig)


def test_finish_value_refuses_before_storing_anything(rig):
    """An out-of-band buffer raises, and a result that does not fit beside the call comes
    back encoded: either way the record is still RUNNING with no result, for the Python
    path."""
    import numpy as np

    a, tr = rig.arena, rig.arena.tr
    h = run_hot(rig, blob(40), who=1)
    with pytest.raises(Exception) as info:
        a.finish_value(h, np.arange(1000), rig.completions[0], 1)
    assert type(info.value).__name__ in ("_OutOfBand", "_HasBuffers")
    # too long beside the call: the payload comes back, to be stored apart
    assert a.finish_value(h, b"z" * 100, rig.completions[0], 1) == serialize.encode_small(
        b"z" * 100)
    long = a.finish_value(h, list(range(40)), rig.completions[0], 1)
    assert type(long) is bytes and serialize.load_value(long) == list(range(40))
    assert tr.load(h) == (h >> 32, S_RUNNING, 1) and rig.completions[0].pop() < 0
    assert a.finish_value(h, 5, rig.completions[0], 2) == -1  # not held by worker 2
    assert a.finish_value(h, 5, rig.completions[0], 1) == 1
    assert rig.completions[0].pop() == h
    assert serialize.load_value(a.complete_take(h)[3]) == 5
    assert_all_free(rig)


@pytest.mark.parametrize("nargs", [2, 40])
def test_a_small_call_reads_back_as_a_call_wherever_it_is_stored(rig, nargs):
    """A call in the small format (the native submit writes it inline; the backlog stores
    it through put) reads back as ``(fref, args, None)``, inline or in a block."""
    a = rig.arena
    args = tuple(range(nargs))
    call = serialize.encode_small_call(5, args)
    assert call is not None and (len(call) <= INLINE) == (nargs == 2)
    h, off = fresh(rig)
    a.put(off, call, [])
    assert a.read_call(off) == (5, args, None)
    a.drop_payload(off)
    a.free(h)
    assert_all_free(rig)


def test_a_full_injector_is_told_apart_from_a_corrupt_free_ring_at_any_generation(rig):
    """submit_inline returns ``-2 - h`` when it set record ``h`` up but the injector was
    full.  For generation 0x8000, record 0, that value was the native path's code for a
    corrupt free ring (-3 - 0x7FFFFFFFFFFF): it raised IndexError instead."""
    a = rig.arena
    idxs = []
    while (i := a.rec_free.pop()) >= 0:
        idxs.append(i)
    assert 0 in idxs
    a.region.store64(a.off(0), word(0x8000, S_FREE))  # record 0, recycled 32,768 times
    assert a.rec_free.push(0)
    filler = 0
    while rig.injector.push(filler):
        filler += 1
    h = 0x8000 << 32
    assert a.submit_inline(K_ROOT, 1, b"x") == -2 - h
    assert a.tr.load(h) == (0x8000, S_QUEUED, 0)


def test_default_blocks_hold_what_just_misses_a_record_inline():
    """A 256-byte class, one block per record up to 65,536: 256 lockstep agents keep up
    to 64 handled messages of ~120 bytes each until their checkpoints (16,384), which
    overflowed the 4,096 1 KiB blocks into files."""
    from stealer.shared.shm import Layout, default_blocks

    assert default_blocks(16384)[0] == (256, 16384)
    assert default_blocks(1 << 21)[0] == (256, 1 << 16)  # capped: 16 MiB of segment
    assert [s for s, _ in default_blocks(64)] == [256, 1024, 16384, 262144]
    assert Layout(2).block_classes == default_blocks(16384)
    assert Layout(2, records=100).block_classes == default_blocks(128)  # records: a power of 2
    explicit = ((512, 8),)
    assert Layout(2, block_classes=explicit).block_classes == explicit
