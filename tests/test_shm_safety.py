"""Shared memory that is hostile, corrupt or full: the arena, the segment and the executor.

Covers: unguessable overflow file names and pre-created files at them;
bounds checks on payload descriptors and handles read from shared memory
(native hot path and the Python arena); stale-segment cleanup that does not
trust pids; a full /dev/shm (a real tmpfs, mounted here when root);
payloads written in pieces (os.write stops at ~2 GiB); exceptions that do
not survive pickling.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import gc
import os
import pickle
import re
import secrets
import struct
import subprocess
import sys
import threading
import time

import pytest
import tasks

import stealer
from stealer.errors import RemoteTraceback
from stealer.shared import arena as arena_mod
from stealer.shared import shm
from stealer.shared._layout import R_PCLASS, R_PLEN, R_PREF
from stealer.shared.arena import INLINE, LOST, OVERFLOW, Arena


class _CallDescriptor:
    """(pclass, pref, plen) of a record's call payload, read/written at ``off + R_PCLASS``."""

    def unpack_from(self, mm, at):
        rec = at - R_PCLASS
        return (struct.unpack_from("=I", mm, rec + R_PCLASS)[0],
                *struct.unpack_from("=QQ", mm, rec + R_PREF))

    def pack_into(self, mm, at, pclass, pref, plen):
        rec = at - R_PCLASS
        struct.pack_into("=I", mm, rec + R_PCLASS, pclass)
        struct.pack_into("=QQ", mm, rec + R_PREF, pref, plen)


_PAYLOAD = _CallDescriptor()  # the call payload's descriptor
SMALL = dict(records=16, block_classes=((1024, 4), (4096, 2)), fn_entries=16, fn_data=4096)


@pytest.fixture
def shm_dir(tmp_path, monkeypatch):
    """A private segment directory (STEALER_SHM_DIR), checked empty afterwards."""
    d = tmp_path / "shm"
    d.mkdir()
    monkeypatch.setenv("STEALER_SHM_DIR", str(d))
    yield d
    assert not [p for p in os.listdir(d) if p.startswith("stealer-")], os.listdir(d)


@pytest.fixture
def arena(shm_dir):
    seg = shm.Segment.create(shm.Layout(1, **SMALL))
    a = Arena(seg)
    a.init()
    yield a
    seg.unlink()


def _record(a, kind=arena_mod.K_ROOT):
    h = a.alloc()
    assert h >= 0
    return h, a.setup(h, kind, 0, 0)


def _overflow_files(a):
    d = os.path.dirname(a.seg.path)
    return sorted(n for n in os.listdir(d) if n.startswith(a.seg.name + "-x"))


# -- 1. overflow file names -------------------------------------------------------------
def test_overflow_names_are_random_not_a_counter(arena):
    h1, off1 = _record(arena)
    h2, off2 = _record(arena)
    arena.put(off1, os.urandom(10_000), [])
    arena.put(off2, os.urandom(10_000), [])
    names = _overflow_files(arena)
    assert len(names) == 2
    for n in names:
        assert re.fullmatch(re.escape(arena.seg.name) + r"-x[0-9a-f]{16}", n), n
    tokens = {int(n.rsplit("-x", 1)[1], 16) for n in names}
    assert tokens == {_PAYLOAD.unpack_from(arena.mm, o + R_PCLASS)[1] for o in (off1, off2)}
    arena.free(h1)
    arena.free(h2)
    assert _overflow_files(arena) == []


def test_precreated_overflow_names_are_skipped_never_followed(arena, tmp_path, monkeypatch):
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    taken = [0x1111, 0x2222]
    with open(arena._ov_path(taken[0]), "wb") as f:  # a leftover (or someone else's) file
        f.write(b"old")
    os.symlink(victim, arena._ov_path(taken[1]))  # an attacker's symlink
    tokens = iter([*taken, 0x3333])
    monkeypatch.setattr(arena_mod, "_ov_token", lambda: next(tokens))
    h, off = _record(arena)
    data = pickle.dumps(os.urandom(20_000))
    arena.put(off, data, [])
    assert _PAYLOAD.unpack_from(arena.mm, off + R_PCLASS)[:2] == (OVERFLOW, 0x3333)
    assert victim.read_bytes() == b"precious"
    with open(arena._ov_path(taken[0]), "rb") as f:
        assert f.read() == b"old"
    assert pickle.loads(data) == arena.read_call(off)
    arena.free(h)
    for t in taken:
        os.unlink(arena._ov_path(t))


def test_overflow_names_all_taken_is_a_clear_error_not_a_hang(arena, monkeypatch):
    path = arena._ov_path(0x42)
    open(path, "wb").close()
    monkeypatch.setattr(arena_mod, "_ov_token", lambda: 0x42)
    h, off = _record(arena)
    arena.put(off, pickle.dumps(b"x" * 20_000), [])
    assert _PAYLOAD.unpack_from(arena.mm, off + R_PCLASS)[0] == LOST
    with pytest.raises(stealer.SerializationError, match="existed already"):
        arena.read_call(off)
    arena.free(h)
    os.unlink(path)


def test_executor_ignores_files_planted_at_counter_names():
    """Names an attacker could predict from the segment's (public) name: <seg>-x1, -x2, ..."""
    victim = f"/dev/shm/victim-{os.getpid()}-{secrets.token_hex(4)}"
    with open(victim, "wb") as f:
        f.write(b"precious")
    try:
        with stealer.Executor(1) as e:
            planted = [f"/dev/shm/{e.segment_name}-x{i}" for i in range(1, 9)]
            for p in planted:
                os.symlink(victim, p)
            big = os.urandom(3 * 1024 * 1024)
            assert e.submit(tasks.nbytes_of, big).result(timeout=30) == len(big)
            assert len(e.submit(tasks.make_bytes, 1 << 21).result(timeout=30)) == 1 << 21
        with open(victim, "rb") as f:
            assert f.read() == b"precious"
        assert not any(os.path.lexists(p) for p in planted)  # removed with the segment
    finally:
        os.unlink(victim)


def test_overflow_file_names_are_found_by_cleanup_helpers(arena):
    h, off = _record(arena)
    arena.put(off, os.urandom(10_000), [])
    (name,) = _overflow_files(arena)
    found = {n: pid for n, pid, _ in shm.our_files()}
    assert found == {arena.seg.name: os.getpid(), name: os.getpid()}
    assert shm.client_pid(name) is None and shm.client_pid(arena.seg.name) == os.getpid()
    shm.unlink_all(arena.seg.name)
    assert not os.listdir(os.path.dirname(arena.seg.path))
    with pytest.raises(FileNotFoundError):
        arena.read_call(off)
    arena.free(h)


# -- 2. bounds checks on what shared memory says -------------------------------------------
def test_python_take_rejects_descriptors_outside_their_storage(arena):
    ncls = len(arena.classes)
    bad = [
        (0, 0, INLINE + 1),  # inline, longer than the inline area
        (1, 4, 10),  # class 0 has blocks 0..3
        (1, 0, 1025),  # longer than a class-0 block
        (2, 1 << 40, 10),
        (ncls + 1, 0, 10),  # no such class
        (0xABCD, 0, 10),
    ]
    for desc in bad:
        h, off = _record(arena)
        _PAYLOAD.pack_into(arena.mm, off + R_PCLASS, *desc)
        with pytest.raises(ValueError, match="corrupt payload descriptor"):
            arena.read_call(off)
        _PAYLOAD.pack_into(arena.mm, off + R_PCLASS, *desc)
        arena.drop_payload(off)  # releases nothing bogus
        arena.free(h)
    # the free rings still hold exactly the real blocks
    for (_size, ring, _base), count in zip(arena.classes, arena._counts):
        assert sorted(ring.pop() for _ in range(count)) == list(range(count))
        assert ring.pop() < 0
        for b in range(count):
            ring.push(b)
    with pytest.raises(IndexError):
        arena.read_call(arena.rec_base + 16 * 128)


def test_python_take_rejects_an_overflow_file_of_the_wrong_size(arena):
    h, off = _record(arena)
    arena.put(off, pickle.dumps(os.urandom(20_000)), [])
    pclass, token, n = _PAYLOAD.unpack_from(arena.mm, off + R_PCLASS)
    _PAYLOAD.pack_into(arena.mm, off + R_PCLASS, pclass, token, n + 1)
    with pytest.raises(ValueError, match="not the payload"):
        arena.read_call(off)
    arena.free(h)
    assert _overflow_files(arena) == []


@pytest.fixture
def hot(arena):
    if not hasattr(arena.seg.Q, "HotPath"):
        pytest.skip("native extension not built")
    return arena.seg.Q.HotPath(arena.region, arena.rec_base, arena.nrecords, arena.rec_free,
                               arena.injector, shm.H_CLIENT_PARK)


def test_native_hot_path_rejects_out_of_range_handles(arena, hot):
    L = arena.seg.layout
    cur = L.worker(0) + shm.W_CURRENT
    ring = arena.seg.Q.SPSCRing(arena.region, L.completion(0), L.records)
    before = bytes(arena.mm)
    for idx in (arena.nrecords, arena.nrecords + 1, 0xFFFFFFFF):
        h = (3 << 32) | idx
        with pytest.raises(IndexError, match="bad record handle"):
            hot.start(h, cur, 1)
        with pytest.raises(IndexError, match="bad record handle"):
            hot.finish_inline(h, 0, b"abc", ring)
        with pytest.raises(IndexError, match="bad record handle"):
            hot.complete_take(h)
        with pytest.raises(IndexError, match="bad record handle"):
            hot.free(h)
    assert bytes(arena.mm) == before  # nothing was written anywhere


def test_native_hot_path_rejects_corrupt_inline_lengths(arena, hot):
    L = arena.seg.layout
    h = hot.submit_inline(arena_mod.K_ROOT, 7, b"payload")
    assert h >= 0 and arena.injector.pop() == h
    off = arena.off(h)
    # (moderate corrupt lengths: the unchecked code would read past the record, not crash)
    struct.pack_into("=Q", arena.mm, off + R_PLEN, INLINE + 1)
    with pytest.raises(ValueError, match="corrupt record"):
        hot.start(h, L.worker(0) + shm.W_CURRENT, 1)
    struct.pack_into("=Q", arena.mm, off + R_PLEN, 4096)
    with pytest.raises(ValueError, match="corrupt record"):
        hot.complete_take(h)
    struct.pack_into("=Q", arena.mm, off + R_PLEN, 3)
    kind, _status, link, data = hot.complete_take(h)  # a sane length still works
    assert (kind, link, data) == (arena_mod.K_ROOT, 7, b"")  # (no result was stored)


# -- 3. stale segments ----------------------------------------------------------------
def _dead_pid():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _craft_segment(d, pid, locked_marker=True):
    name = f"stealer-{pid}-{secrets.token_hex(16)}"
    head = bytearray(shm.HEADER_BYTES)
    struct.pack_into("=Q", head, shm.H_MAGIC, shm.MAGIC)
    struct.pack_into("=I", head, shm.H_LOCKED, 1 if locked_marker else 0)
    path = os.path.join(d, name)
    with open(path, "wb") as f:
        f.write(head)
    with open(path + "-x00000000deadbeef", "wb") as f:
        f.write(b"overflow")
    return name, path


def test_cleanup_keeps_a_live_segment_whatever_its_pid_says(shm_dir):
    """A client in another PID namespace: its pid means nothing here, but its lock is held."""
    name, path = _craft_segment(shm_dir, _dead_pid())
    holder = os.open(path, os.O_RDONLY)  # another open file description: like another process
    try:
        fcntl.flock(holder, fcntl.LOCK_SH)
        assert shm.cleanup_stale() == []
        assert os.path.exists(path) and os.path.exists(path + "-x00000000deadbeef")
    finally:
        os.close(holder)  # the "client" dies: the kernel drops its lock
    assert sorted(shm.cleanup_stale()) == sorted([name, name + "-x00000000deadbeef"])
    assert os.listdir(shm_dir) == []


def test_cleanup_keeps_a_live_segment_from_a_subprocess(shm_dir):
    name, path = _craft_segment(shm_dir, _dead_pid())
    code = ("import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDONLY); "
            "fcntl.flock(fd, fcntl.LOCK_SH); print('locked', flush=True); sys.stdin.read()")
    p = subprocess.Popen([sys.executable, "-c", code, path], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline() == "locked\n"
        assert shm.cleanup_stale() == []
        assert os.path.exists(path)
    finally:
        p.stdin.close()
        p.wait(10)
        p.stdout.close()
    assert name in shm.cleanup_stale()
    assert os.listdir(shm_dir) == []


def test_a_real_segment_holds_its_lock_until_unlinked(shm_dir):
    seg = shm.Segment.create(shm.Layout(1, **SMALL))
    dead = os.path.join(shm_dir, f"stealer-{_dead_pid()}-{secrets.token_hex(16)}")
    os.rename(seg.path, dead)  # as if its pid meant nothing here
    try:
        assert shm.cleanup_stale() == []
        assert os.path.exists(dead)
        del seg  # the creator lets go of it (or dies): its fd and mapping close
        gc.collect()
        assert shm.cleanup_stale() == [os.path.basename(dead)]
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(dead)


def test_cleanup_of_files_without_the_lock_marker_falls_back_to_the_pid(shm_dir):
    live, live_path = _craft_segment(shm_dir, os.getppid(), locked_marker=False)
    dead, _ = _craft_segment(shm_dir, _dead_pid(), locked_marker=False)
    assert sorted(shm.cleanup_stale()) == sorted([dead, dead + "-x00000000deadbeef"])
    assert os.path.exists(live_path)
    os.unlink(live_path)
    # an overflow file whose segment is gone is an orphan
    assert shm.cleanup_stale() == [live + "-x00000000deadbeef"]


def test_create_gives_up_a_name_that_cleanup_removed_before_it_was_locked(shm_dir):
    path = os.path.join(shm_dir, "stealer-1-" + "0" * 32)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.unlink(path)
        assert not shm._lock_own_file(fd, path)
    finally:
        os.close(fd)


# -- 4. a full /dev/shm -----------------------------------------------------------------
@pytest.fixture
def small_tmpfs(tmp_path, monkeypatch):
    """A tmpfs of 8 MiB as the segment directory (needs root to mount)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    d = tmp_path / "tmpfs"
    d.mkdir()

    def mount(size):
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=1777", "tmpfs",
                            str(d)], capture_output=True, text=True)
        if r.returncode:
            pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
        return d

    monkeypatch.setenv("STEALER_SHM_DIR", str(d))
    yield mount
    subprocess.run(["umount", "-l", str(d)], check=False)


def _fill(d, leave):
    """Fill the tmpfs at ``d`` until ``leave`` bytes are free."""
    st = os.statvfs(d)
    free = st.f_bavail * st.f_frsize
    with open(os.path.join(d, "filler"), "wb") as f:
        f.write(b"\0" * max(0, free - leave))


def test_full_shm_fails_at_segment_creation(small_tmpfs):
    d = small_tmpfs("8m")
    with pytest.raises(shm.SharedMemoryFullError, match="--shm-size") as info:
        shm.Segment.create(shm.Layout(2))  # about 25 MiB
    assert isinstance(info.value, stealer.StealerError) and isinstance(info.value, OSError)
    assert info.value.errno == errno.ENOSPC
    assert "records=" in str(info.value)
    assert os.listdir(d) == []


def test_full_shm_fails_at_executor_creation_not_with_sigbus(small_tmpfs):
    d = small_tmpfs("8m")
    code = ("import stealer\n"
            "if __name__ == '__main__':\n"
            "    stealer.Executor(1)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, (r.returncode, r.stderr[-2000:])
    assert "SharedMemoryFullError" in r.stderr and "--shm-size" in r.stderr
    assert os.listdir(d) == []


def test_full_shm_for_an_overflow_payload_fails_the_task_not_the_worker(small_tmpfs):
    d = small_tmpfs("32m")
    with stealer.Executor(1, records=16) as e:
        assert e.wait_ready(30)
        pid = e.worker_pids()[0]
        _fill(d, leave=1 << 20)
        try:
            with pytest.raises(stealer.SerializationError, match=r"No space left.*--shm-size"):
                e.submit(tasks.nbytes_of, os.urandom(3 << 20)).result(timeout=30)
            with pytest.raises(stealer.SerializationError, match=r"No space left.*--shm-size"):
                e.submit(tasks.make_bytes, 3 << 20).result(timeout=30)
            assert e.worker_pids() == [pid]
            assert e.submit(tasks.square, 7).result(timeout=30) == 49
        finally:
            os.unlink(os.path.join(d, "filler"))
        assert len(e.submit(tasks.make_bytes, 3 << 20).result(timeout=30)) == 3 << 20
        assert e.worker_pids() == [pid]
    assert os.listdir(d) == []


# -- 5. payloads written (and read) in pieces ------------------------------------------------
def test_overflow_writes_and_reads_loop_until_complete(arena, monkeypatch):
    real_write, real_readv = os.write, os.readv
    calls = {"write": 0, "readv": 0}

    def short_write(fd, buf):
        calls["write"] += 1
        return real_write(fd, memoryview(buf).cast("B")[:4000])

    def short_readv(fd, bufs):
        calls["readv"] += 1
        return real_readv(fd, [memoryview(bufs[0]).cast("B")[:3000]])

    monkeypatch.setattr(os, "write", short_write)
    monkeypatch.setattr(os, "readv", short_readv)
    arr = bytearray(os.urandom(50_000))
    data, bufs = stealer.shared.serialize.dumps(pickle.PickleBuffer(arr))
    assert bufs  # the out-of-band path
    h, off = _record(arena)
    arena.put(off, data, bufs)
    plain = pickle.dumps(os.urandom(30_000))
    h2, off2 = _record(arena)
    arena.put(off2, plain, [])
    assert calls["write"] > 20
    assert bytes(arena.read_call(off)) == bytes(arr)
    assert arena.read_call(off2) == pickle.loads(plain)
    assert calls["readv"] > 20
    arena.free(h)
    arena.free(h2)


# -- 6. exceptions that do not survive pickling ------------------------------------------
class TwoArgError(Exception):
    def __init__(self, a, b):
        super().__init__(f"{a}-{b}")
        self.b = b


class BadStrError(Exception):
    def __str__(self):
        raise RuntimeError("no str for you")


class BadStrUnpicklableError(BadStrError):
    def __init__(self, *args):
        super().__init__(*args)
        self.lock = threading.Lock()


def raise_two_arg(a, b):
    raise TwoArgError(a, b)


def raise_bad_str():
    raise BadStrError("x")


def raise_bad_str_unpicklable():
    raise BadStrUnpicklableError("x")


def spawn_raising_child():
    c = stealer.spawn(raise_two_arg, "kid", 2)
    yield c


@pytest.fixture(scope="module")
def ex():
    with stealer.Executor(2) as e:
        yield e


def _remote_tb(exc, where):
    cause = exc.__cause__
    assert isinstance(cause, RemoteTraceback), repr(cause)
    assert where in str(cause)


def test_exception_whose_init_needs_arguments(ex):
    with pytest.raises(TwoArgError) as info:
        ex.submit(raise_two_arg, "a", "b").result(timeout=30)
    assert str(info.value) == "a-b" and info.value.b == "b"
    _remote_tb(info.value, "raise_two_arg")


def test_exception_whose_init_needs_arguments_from_a_child_task(ex):
    with pytest.raises(TwoArgError, match="kid-2") as info:
        ex.submit(spawn_raising_child).result(timeout=30)
    _remote_tb(info.value, "spawn_raising_child")


def test_exception_whose_str_raises(ex):
    with pytest.raises(BadStrError) as info:
        ex.submit(raise_bad_str).result(timeout=30)
    _remote_tb(info.value, "raise_bad_str")


def test_exception_whose_str_raises_and_that_does_not_pickle(ex):
    pid = set(ex.worker_pids())
    with pytest.raises(stealer.RemoteError, match="BadStrUnpicklableError") as info:
        ex.submit(raise_bad_str_unpicklable).result(timeout=30)
    _remote_tb(info.value, "raise_bad_str_unpicklable")
    assert set(ex.worker_pids()) == pid  # no worker died over it


def test_error_payload_unpickles_where_the_class_is_missing():
    from stealer.worker.loop import error_payload

    try:
        raise_two_arg("p", "q")
    except TwoArgError as e:
        payload = error_payload(e)
    data = pickle.dumps(payload)
    exc, tb = pickle.loads(data)
    assert type(exc) is TwoArgError and "raise_two_arg" in tb
    # a client that cannot import the class gets a RemoteError naming it, not a crash
    hidden = data.replace(b"TwoArgError", b"TwoArgErrxr")  # same length: the pickle stays valid
    exc, tb = pickle.loads(hidden)
    assert isinstance(exc, stealer.RemoteError) and "TwoArg" in str(exc) and "p-q" in str(exc)
    assert "raise_two_arg" in tb


def _resident_kib(pid: int, path: str) -> int:
    """Rss of ``pid``'s mapping of ``path`` (kB), from /proc/<pid>/smaps."""
    total, inside = 0, False
    with open(f"/proc/{pid}/smaps") as fh:
        for line in fh:
            if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
                inside = line.rstrip().endswith(path)
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1])
    return total


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/<pid>/smaps")
def test_the_hot_part_of_the_segment_is_mapped_in_every_process_at_start():
    """Segment.populate: the header, rings and records are mapped before the first task
    (no page fault per page in the first burst); the agent directory and payload blocks
    stay lazy.  On a kernel without MADV_POPULATE_WRITE (before 5.14) nothing is mapped
    ahead: then this only checks that nothing more than the hot part was."""
    with stealer.Executor(2) as e:
        e.submit(tasks.square, 1).result(30)
        pool = e._pool
        hot_kib = (pool.layout.offsets["agents"] // 4096) * 4
        total_kib = pool.layout.total // 1024
        major, minor = (int(x) for x in re.findall(r"\d+", os.uname().release)[:2])
        populated = (major, minor) >= (5, 14)
        for pid in [os.getpid()] + [p.pid for p in pool.procs]:
            deadline = time.monotonic() + 30  # a worker may still be starting
            while True:
                rss = _resident_kib(pid, pool.seg.path)
                if not populated or rss >= hot_kib or time.monotonic() > deadline:
                    break
                time.sleep(0.01)
            if populated:
                assert rss >= hot_kib, (pid, rss, hot_kib)
            assert rss < total_kib // 2, (pid, rss, total_kib)  # the blocks were not
