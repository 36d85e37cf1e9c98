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
import secrets
import struct
import subprocess
import sys

import pytest

import stealer
from stealer import arena as arena_mod
from stealer import shm
from stealer.arena import Arena

_PAYLOAD = struct.Struct("=IQQ")  # pclass, pref, plen at R_PCLASS
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
