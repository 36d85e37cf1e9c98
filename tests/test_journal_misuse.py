"""The agents' journal attacked: damaged journals (bit flips, torn WAL tails, torn pages),
misuse at start (foreign, held, full, read-only, other version/owner), unpicklable state,
names, and the ``stealer journal`` inspector (issue 8, points 4 to 6).

Journals are written with the message-only ``Acc`` agent of tests/journal_lib.py: its state
is the list of values it was sent, so a lost, repeated or reordered message shows in it.
A journal copied while its executor is live still has its rows in the ``-wal`` files (no
checkpoint) and no shutdown snapshot: recovery replays its messages.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import sqlite3
import time

import pytest

import stealer
from stealer import cli
from stealer.agents import journal
from stealer.agents.journal import opening  # MIN_FREE is patched where it is read
from tests import journal_lib as L

T = 60  # seconds: only to turn a hang into a failure
K = 6  # values the client sends each agent
FWD = 100  # a0 forwards FWD + j to a1 (a message logged by a worker's shard)


# -- helpers ----------------------------------------------------------------------------
def _write(d, copy=None, every: int = 1000, forward: bool = True, n: int = 2,
           workers: int = 2) -> None:
    """Agents a0..a<n-1> get add(0..K-1) from the client, one call at a time (one message
    per turn: a snapshot every ``every`` of them); a0 forwards FWD + j to a1.  ``copy``:
    copy the directory while the executor is live, then shut down (a last snapshot each).

    A test that needs the agents live after the shutdown writes with one worker: with two,
    a worker without agents of its own may adopt an agent that another worker is stopping
    for the shutdown and end it for good (see test_shutdown_suspends_every_journaled_agent).
    So does a test that needs a journal without snapshots: with two, an idle worker may
    take an agent over, and a migration checkpoints it (journaled) whatever ``every`` says;
    recovery then replays only what followed (a0's forwards before it are not sent again).
    """
    with stealer.Executor(workers, journal=d) as ex:
        refs = [ex.spawn_agent(L.Acc, f"t{i}", name=f"a{i}", checkpoint_every=every,
                               checkpoint_seconds=1000) for i in range(n)]
        for j in range(K):
            for r in refs:
                r.call("add", j).result(T)
            if forward:
                refs[0].call("forward", refs[1], FWD + j).result(T)
        want = _full(n, forward)
        for i, r in enumerate(refs):  # the forwarded adds arrive after forward() returned
            _wait_for(lambda r=r, i=i: _split(r.call("get").result(T)) == want[f"a{i}"])
        if copy is not None:
            time.sleep(0.2)  # the last turn's journal writes (they follow its reply)
            _copy_live(d, copy)


def _copy_live(src: os.PathLike, dst: os.PathLike) -> None:
    """Copy a journal that its live executor may be writing: a file can vanish between
    copytree's listing and its copy (SQLite's rollback journal, ``*.db-journal``, lives
    for one transaction; seen once in a full run); then copy again from scratch."""
    for _ in range(20):
        try:
            shutil.copytree(src, dst)
            return
        except shutil.Error:
            shutil.rmtree(dst, ignore_errors=True)
            time.sleep(0.01)
    shutil.copytree(src, dst)


def _wait_for(cond, timeout: float = T) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.02)


def _split(vals: list) -> tuple[list, list]:
    """(the client's values, the forwarded values), each in arrival order: messages are
    ordered per sender only."""
    return [v for v in vals if v < FWD], [v for v in vals if v >= FWD]


def _full(n: int = 2, forward: bool = True) -> dict[str, tuple[list, list]]:
    out = {f"a{i}": (list(range(K)), []) for i in range(n)}
    if forward and n > 1:
        out["a1"] = (list(range(K)), [FWD + j for j in range(K)])
    return out


def _uids(d) -> dict[str, str]:
    """name -> uid."""
    return {a.name: a.uid for a in journal.plan(d, quiet=True).agents.values() if a.name}


def _shards(d) -> list[str]:
    return sorted(n for n in os.listdir(d) if n.endswith(".db") and n != journal.CONTROL)


def _select(d, sql: str, params: tuple = ()) -> list[tuple]:
    """(shard, *row) for the rows of every shard, in (shard, id) order."""
    out = []
    for name in _shards(d):
        c = sqlite3.connect(os.path.join(d, name))
        try:
            out += [(name, *r) for r in c.execute(sql, params)]
        finally:
            c.close()
    return out


def _flip_row(d, shard: str, table: str, rid: int) -> None:
    """Flip one bit in the middle of row ``rid``'s body (what bit rot does to a value)."""
    c = sqlite3.connect(os.path.join(d, shard), isolation_level=None)
    try:
        body = bytearray(c.execute(f"SELECT body FROM {table} WHERE id=?", (rid,)).fetchone()[0])
        body[len(body) // 2] ^= 0x10
        c.execute(f"UPDATE {table} SET body=? WHERE id=?", (bytes(body), rid))
    finally:
        c.close()


def _listing(d) -> list[str]:
    return sorted(os.listdir(d))


def _epochs(d) -> int:
    c = sqlite3.connect(os.path.join(d, journal.CONTROL))
    try:
        return c.execute("SELECT COUNT(*) FROM epochs").fetchone()[0]
    finally:
        c.close()


def _bare_journal(d) -> None:
    """A journal with no agents, without starting workers."""
    cj, _ = journal.open_for_client(str(d), "batch", 2, False)
    cj.close()


def _check_recovered(ex, names=("a0", "a1")) -> None:
    """What a damaged journal may give: fewer messages, never one twice or out of order."""
    want = _full()
    for name in names:
        client, fwd = _split(ex.agent(name).call("get").result(T))
        wc, wf = want[name]
        assert client == wc[: len(client)], (name, client)
        assert len(set(fwd)) == len(fwd) and fwd == sorted(fwd), (name, fwd)
        assert set(fwd) <= set(wf), (name, fwd)


# -- 1. corruption ----------------------------------------------------------------------
@pytest.mark.parametrize("how", ["row", "file", "ts"])
def test_a_flipped_message_is_cut_with_a_warning_and_never_applied(tmp_path, capsys, how):
    d, c = tmp_path / "j", tmp_path / "c"
    _write(d, copy=c, forward=False, workers=1)  # the copy: no snapshot, all replayed
    uid = _uids(c)["a0"]
    rows = _select(c, "SELECT id, body FROM msgs WHERE target=? AND call=1 ORDER BY id",
                   (uid,))
    assert len(rows) >= K + 1 and {r[0] for r in rows} == {"client.db"}  # K adds, gets
    shard, rid, body = rows[3]  # add(3)
    if how == "row":
        _flip_row(c, shard, "msgs", rid)
    elif how == "ts":  # its time: what orders the replay (per sender too, across shards)
        con = sqlite3.connect(os.path.join(c, shard), isolation_level=None)
        bit = 1 << 45  # about 10 hours: flipped, add(3) is replayed first or last
        con.execute("UPDATE msgs SET ts = (ts | ?) - (ts & ?) WHERE id=?", (bit, bit, rid))
        con.close()
    else:  # bit rot in the file itself: SQLite has no page checksums, only our CRC sees it
        db = os.path.join(c, shard)
        con = sqlite3.connect(db)
        con.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # the rows into client.db
        con.close()
        with open(db, "rb") as f:
            raw = bytearray(f.read())
        assert raw.count(body) == 1
        raw[raw.index(body) + len(body) // 2] ^= 0x01
        with open(db, "wb") as f:
            f.write(raw)
    capsys.readouterr()
    p = journal.plan(c)
    warned = [w for w in p.warnings if uid in w and f"event {rid}" in w]
    assert len(warned) == 1, p.warnings
    assert len(p.agents[uid].msgs) == 3  # add(0..2): the flipped one and all after it cut
    assert p.agents[_uids(c)["a1"]].msgs  # the other agent untouched
    with stealer.Executor(2, journal=c, recover=True) as ex:
        assert ex.recovered == 2
        assert ex.agent("a0").call("get").result(T) == [0, 1, 2]
        assert ex.agent("a1").call("get").result(T) == list(range(K))
        assert ex.agent("a0").call("add", 7).result(T) == 4  # and it lives on
        if how == "row":  # the client dies now (a copy of what it leaves on disk)
            _copy_live(c, tmp_path / "c2")
    err = capsys.readouterr().err
    assert uid in err and f"event {rid}" in err
    if how == "row":  # what was logged after the first recovery is not cut with the damage
        with stealer.Executor(2, journal=tmp_path / "c2", recover=True) as ex:
            assert ex.agent("a0").call("get").result(T) == [0, 1, 2, 7]


def test_a_flipped_message_at_any_position_cuts_from_there(tmp_path):
    d, c = tmp_path / "j", tmp_path / "c"
    _write(d, copy=c, forward=False, n=1, workers=1)  # no snapshot (see _write)
    uid = _uids(c)["a0"]
    rows = _select(c, "SELECT id FROM msgs WHERE target=? ORDER BY id", (uid,))
    for i, (shard, rid) in enumerate(rows):
        t = tmp_path / f"t{i}"
        shutil.copytree(c, t)
        _flip_row(t, shard, "msgs", rid)
        p = journal.plan(t, quiet=True)
        assert len(p.agents[uid].msgs) == i
        assert any(uid in w and f"event {rid}" in w for w in p.warnings)


def test_a_flipped_message_from_an_agent_is_sent_again_by_its_replay(tmp_path, capsys):
    d, c = tmp_path / "j", tmp_path / "c"
    _write(d, copy=c, workers=1)  # no snapshot: a0 replays every forward(), sends again
    uids = _uids(c)
    rows = _select(c, "SELECT id FROM msgs WHERE target=? AND sender=? ORDER BY id",
                   (uids["a1"], uids["a0"]))
    assert len(rows) == K and {r[0] for r in rows} != {"client.db"}  # in a worker's shard
    shard, rid = rows[2]
    _flip_row(c, shard, "msgs", rid)
    capsys.readouterr()
    p = journal.plan(c)
    assert any(uids["a1"] in w and f"event {rid}" in w for w in p.warnings), p.warnings
    with stealer.Executor(2, journal=c, recover=True) as ex:
        assert ex.recovered == 2
        a1 = ex.agent("a1")
        _wait_for(lambda: len(a1.call("get").result(T)) >= 2 * K)
        assert _split(a1.call("get").result(T)) == _full()["a1"]


def test_a_flipped_snapshot_falls_back_to_an_older_one_or_the_spawn(tmp_path, capsys):
    d = tmp_path / "j"
    _write(d, every=2, workers=1)  # snapshots every 2 messages, and one each at shutdown
    uids = _uids(d)
    snaps = {name: _select(d, "SELECT id, ver FROM snaps WHERE uid=? ORDER BY ver", (uid,))
             for name, uid in uids.items()}
    assert all(len(s) >= 3 for s in snaps.values()), snaps
    shard, rid, newest = snaps["a0"][-1]
    _flip_row(d, shard, "snaps", rid)  # a0: its newest snapshot
    for shard1, rid1, _ver in snaps["a1"]:  # a1: all of them
        _flip_row(d, shard1, "snaps", rid1)
    capsys.readouterr()
    p = journal.plan(d)
    a0, a1 = p.agents[uids["a0"]], p.agents[uids["a1"]]
    assert a0.snap is not None and a0.snap["ver"] < newest and a0.msgs
    assert a1.snap is None and a1.msgs
    assert any(uids["a0"] in w and f"snapshot {newest}" in w for w in p.warnings)
    assert any(uids["a1"] in w for w in p.warnings)
    with stealer.Executor(1, journal=d, recover=True) as ex:
        assert ex.recovered == 2
        want = _full()
        for name in ("a0", "a1"):  # every message, once, in order per sender
            assert _split(ex.agent(name).call("get").result(T)) == want[name]
        a0r, a1r = ex.agent("a0"), ex.agent("a1")
        for j in range(3):  # more messages and snapshots, then a clean shutdown
            a0r.call("add", 50 + j).result(T)
            a0r.call("forward", a1r, 150 + j).result(T)
        _wait_for(lambda: len(a1r.call("get").result(T)) == 2 * K + 3)
    assert uids["a0"] in capsys.readouterr().err
    p = journal.plan(d, quiet=True)  # the snapshots taken since are used
    assert p.agents[uids["a0"]].snap["ts"] > a0.snap["ts"]
    assert p.agents[uids["a1"]].snap is not None
    with stealer.Executor(2, journal=d, recover=True) as ex:  # and a second recovery
        assert ex.recovered == 2
        got = {name: _split(ex.agent(name).call("get").result(T)) for name in ("a0", "a1")}
    assert got["a0"] == (want["a0"][0] + [50, 51, 52], [])
    assert got["a1"] == (want["a1"][0], want["a1"][1] + [150, 151, 152])


def test_a_truncated_wal_recovers_what_is_left(tmp_path):
    d, c = tmp_path / "j", tmp_path / "c"
    _write(d, copy=c, every=2)
    wals = [n for n in sorted(os.listdir(c)) if n.endswith(".db-wal")
            and n != journal.CONTROL + "-wal" and os.path.getsize(os.path.join(c, n))]
    assert "client.db-wal" in wals and len(wals) >= 2, wals
    rng = random.Random(8)
    trials = [(w, rng.randrange(os.path.getsize(os.path.join(c, w)))) for w in wals
              for _ in range(4)]
    for i, (wal, cut) in enumerate(trials):
        t = tmp_path / f"t{i}"
        shutil.copytree(c, t)
        os.truncate(os.path.join(t, wal), cut)
        p = journal.plan(t, quiet=True)  # never raises
        for a in p.agents.values():  # each sender's messages once, in order
            seqs: dict[str, list[int]] = {}
            for _body, _oob, sender, seq in a.msgs:
                seqs.setdefault(sender, []).append(seq)
            assert all(q == sorted(set(q)) for q in seqs.values()), (wal, cut, a.uid)
    # and recovery from some of them: what is left, nothing twice, nothing out of order
    for i in (0, len(trials) - 1):
        t = tmp_path / f"t{i}"
        with stealer.Executor(2, journal=t, recover=True) as ex:
            assert ex.recovered == len(ex.agents())
            _check_recovered(ex, tuple(ex.agents()))
    # a worker shard's log cut: the client's shard has every spawn and client message (the
    # messages a0 forwarded that were only in that log are lost if a snapshot of a0 in the
    # other shard says they were sent)
    w = next(w for w in wals if w != "client.db-wal")
    t = tmp_path / "tw"
    shutil.copytree(c, t)
    os.truncate(os.path.join(t, w), 100)  # inside the WAL header: the whole log is gone
    with stealer.Executor(2, journal=t, recover=True) as ex:
        assert ex.recovered == 2
        _check_recovered(ex)
        for name in ("a0", "a1"):
            assert _split(ex.agent(name).call("get").result(T))[0] == list(range(K))


@pytest.mark.parametrize("where, how", [("worker", "truncated"), ("worker", "torn-page"),
                                        ("worker", "garbage"), ("client", "truncated")])
def test_a_damaged_shard_file_is_named_and_the_others_recover(tmp_path, capsys, where, how):
    d = tmp_path / "j"
    _write(d, every=2, workers=1)  # clean shutdown: the rows are in the .db files
    uids = _uids(d)
    if where == "client":
        shard = "client.db"  # every spawn and the client's messages
    else:  # the worker shard with the most snapshots
        counts = {s: n for s, n in _select(d, "SELECT COUNT(*) FROM snaps")}
        shard = max((s for s in counts if s != "client.db"), key=counts.get)
    path = os.path.join(d, shard)
    size = os.path.getsize(path)
    if how == "truncated":
        os.truncate(path, size // 2)
    elif how == "torn-page":  # the page that holds the snapshots' table
        con = sqlite3.connect(path)
        root, psize = (con.execute("SELECT rootpage FROM sqlite_master WHERE name='snaps'")
                       .fetchone()[0], con.execute("PRAGMA page_size").fetchone()[0])
        con.close()
        with open(path, "r+b") as f:
            f.seek((root - 1) * psize + 16)
            f.write(os.urandom(psize // 2))
    else:  # the whole file from its middle on
        with open(path, "r+b") as f:
            f.seek(size // 2)
            f.write(os.urandom(size - size // 2))
    capsys.readouterr()
    p = journal.plan(d)
    assert any(w.startswith(shard) for w in p.warnings), p.warnings
    live = [a.name for a in p.agents.values() if a.live]
    assert len(live) == (2 if where == "worker" else 0)  # the spawns are in client.db
    with stealer.Executor(2, journal=d, recover=True) as ex:
        # a shard that does not open is moved aside, not left to fail its writer forever
        assert ex.wait_ready(T)
        assert ex.recovered == len(live)
        if how == "truncated":
            assert os.path.exists(os.path.join(d, shard[:-3] + ".damaged-2.db"))
        _check_recovered(ex, live)
        for name in live:  # the client's messages are all in the intact client.db
            assert _split(ex.agent(name).call("get").result(T))[0] == list(range(K))
        for name in set(uids) - set(live):
            with pytest.raises(stealer.AgentNotFound):
                ex.agent(name)
        assert ex.spawn_agent(L.Acc, name="new").call("add", 1).result(T) == 1
    assert shard in capsys.readouterr().err
    p = journal.plan(d, quiet=True)  # and the next recovery reads the new shard too
    assert "new" in {a.name for a in p.agents.values() if a.live}


def test_a_damaged_control_database_is_a_clear_error(tmp_path):
    d = tmp_path / "j"
    _bare_journal(d)
    with open(os.path.join(d, journal.CONTROL), "r+b") as f:
        f.write(b"\0" * 100)  # its header
    before = _listing(d)
    with pytest.raises(stealer.JournalError):
        journal.plan(d)
    with pytest.raises(stealer.JournalError):
        stealer.Executor(2, journal=d, recover=True)
    assert _listing(d) == before


def test_shutdown_suspends_every_journaled_agent(tmp_path):
    for t in range(10):
        d = tmp_path / f"j{t}"
        with stealer.Executor(2, journal=d) as ex:
            refs = [ex.spawn_agent(L.Acc, i) for i in range(24)]
            for r in refs:
                r.send("add", 1)
            for r in refs:
                assert r.call("get").result(T) == [1]
        p = journal.plan(d, quiet=True)
        assert [a.uid for a in p.agents.values() if not a.live] == []


def test_a_zeroed_control_database_does_not_reuse_uids(tmp_path):
    d = tmp_path / "j"
    with stealer.Executor(1, journal=d) as ex:
        ex.spawn_agent(L.Acc, name="a0").call("add", 1).result(T)
    os.truncate(os.path.join(d, journal.CONTROL), 0)  # its epochs are gone: the shards stay
    with stealer.Executor(1, journal=d, recover=True) as ex:
        assert ex.recovered == 1
        b0 = ex.spawn_agent(L.Acc, name="b0")
        assert b0.uid != ex.agent("a0").uid  # a new executor's uids are new ones
        assert b0.call("add", 2).result(T) == 1
        assert ex.agent("a0").call("get").result(T) == [1]
    with stealer.Executor(2, journal=d, recover=True) as ex:
        assert ex.recovered == 2
        assert ex.agent("a0").call("get").result(T) == [1]
        assert ex.agent("b0").call("get").result(T) == [2]


# -- 2. misuse --------------------------------------------------------------------------
def test_not_a_journal_directory(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(stealer.JournalError, match="not a directory"):
        stealer.Executor(2, journal=f)
    assert f.read_text() == "x"
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    for recover in (False, True):
        with pytest.raises(stealer.JournalError, match="not a stealer journal"):
            stealer.Executor(2, journal=foreign, recover=recover)
        assert _listing(foreign) == ["notes.txt"]
    with pytest.raises(stealer.JournalError, match="not a stealer journal"):
        journal.plan(foreign)


@pytest.mark.parametrize("key, value, words", [
    ("format", "99", "format '99'"),
    ("owner", "12345", "another user"),
])
def test_another_version_or_owner(tmp_path, key, value, words):
    d = tmp_path / "j"
    _bare_journal(d)
    c = sqlite3.connect(os.path.join(d, journal.CONTROL), isolation_level=None)
    c.execute("UPDATE meta SET value=? WHERE key=?", (value, key))
    c.close()
    before, epochs = _listing(d), _epochs(d)
    for recover in (False, True):
        with pytest.raises(stealer.JournalError, match=words):
            stealer.Executor(2, journal=d, recover=recover)
    with pytest.raises(stealer.JournalError, match=words):
        journal.plan(d)
    assert _listing(d) == before and _epochs(d) == epochs


def test_a_directory_of_another_user(tmp_path):
    d = tmp_path / "j"
    _bare_journal(d)
    os.chown(d, os.getuid() + 12345, -1)  # we may (root): the file's owner, not its meta
    try:
        before = _listing(d)
        with pytest.raises(stealer.JournalError, match="belongs to another user"):
            stealer.Executor(2, journal=d)
        assert _listing(d) == before
    finally:
        os.chown(d, os.getuid(), -1)


def test_a_journal_held_by_a_live_executor(tmp_path):
    d = tmp_path / "j"
    with stealer.Executor(1, journal=d) as ex:
        ex.spawn_agent(L.Acc, name="a0").call("add", 1).result(T)
        epochs = _epochs(d)
        for recover in (False, True):
            with pytest.raises(stealer.JournalError, match=f"process {os.getpid()}"):
                stealer.Executor(2, journal=d, recover=recover)
        assert _epochs(d) == epochs
        assert ex.agent("a0").call("add", 2).result(T) == 2  # the holder is unharmed
    with stealer.Executor(2, journal=d, recover=True) as ex:  # released at shutdown
        assert ex.recovered == 1
        assert ex.agent("a0").call("get").result(T) == [1, 2]


def test_a_full_disk(tmp_path, monkeypatch):
    monkeypatch.setattr(opening, "MIN_FREE", 1 << 62)
    d = tmp_path / "fresh"
    with pytest.raises(stealer.JournalError, match="disk is full"):
        stealer.Executor(2, journal=d)
    assert not os.path.exists(os.path.join(d, journal.CONTROL))
    assert not os.path.exists(d) or not os.listdir(d)
    monkeypatch.undo()
    e = tmp_path / "old"
    _bare_journal(e)
    before, epochs = _listing(e), _epochs(e)
    monkeypatch.setattr(opening, "MIN_FREE", 1 << 62)
    with pytest.raises(stealer.JournalError, match="disk is full"):
        stealer.Executor(2, journal=e, recover=True)
    assert _listing(e) == before and _epochs(e) == epochs


def test_a_directory_that_is_not_writable(tmp_path, monkeypatch):
    # We run as root, whom chmod does not stop, so os.access (what check_dir asks) is made
    # to say "no" for the journal directory only; the rest of the process is unaffected.
    d = tmp_path / "ro"
    d.mkdir()
    real = os.access

    def access(p, mode, *a, **kw):
        if os.path.abspath(os.fspath(p)) == str(d):
            return False
        return real(p, mode, *a, **kw)

    monkeypatch.setattr(os, "access", access)
    with pytest.raises(stealer.JournalError, match="not writable"):
        stealer.Executor(2, journal=d)
    assert os.listdir(d) == []


def test_live_agents_need_recover_true(tmp_path):
    d = tmp_path / "j"
    with stealer.Executor(1, journal=d) as ex:
        ex.spawn_agent(L.Acc, name="a0").call("add", 1).result(T)
    before, epochs = _listing(d), _epochs(d)
    with pytest.raises(stealer.JournalError, match=r"1 live agents.*recover=True"):
        stealer.Executor(2, journal=d)
    assert _listing(d) == before and _epochs(d) == epochs
    with stealer.recover(d, 2) as ex:  # stealer.recover(PATH) is the other way
        assert ex.recovered == 1
        assert ex.agent("a0").call("get").result(T) == [1]


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="recover=True needs the journal"):
        stealer.Executor(2, recover=True)
    bogus = tmp_path / "bogus"
    with pytest.raises(ValueError, match="durability must be one of"):
        stealer.Executor(2, journal=bogus, durability="bogus")
    assert not os.path.exists(bogus)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert journal.plan(empty).agents == {}
    with stealer.Executor(2, journal=empty, recover=True, durability="none") as ex:
        assert ex.recovered == 0 and ex.agents() == {}
    with stealer.Executor(2) as ex, pytest.raises(stealer.AgentNotFound,
                                                  match="'x' in this executor"):
        ex.agent("x")  # (without a journal names live as long as the executor)


def test_unpicklable_state_names_the_agent_and_the_attribute(tmp_path):
    with stealer.Executor(2, journal=tmp_path / "j") as ex:
        ref = ex.spawn_agent(L.Locky, name="locky", checkpoint_every=1)
        with pytest.raises(stealer.JournalError, match="'guard'") as ei:
            ref.result(T)
        assert ref.uid in str(ei.value) and "Locky" in str(ei.value)


def test_names(tmp_path):
    d = tmp_path / "j"
    with stealer.Executor(1, journal=d, durability="always") as ex:
        live = ex.spawn_agent(L.Acc, name="live")
        with pytest.raises(ValueError, match="already has an agent named 'live'"):
            ex.spawn_agent(L.Acc, name="live")
        for bad in ("", 7):
            with pytest.raises(ValueError, match="name"):
                ex.spawn_agent(L.Acc, name=bad)
        fin = ex.spawn_agent(L.Finisher, "value", name="fin")
        bad = ex.spawn_agent(L.Finisher, "broken", True, name="bad")
        assert fin.result(T) == "value"
        with pytest.raises(ValueError, match="broken"):
            bad.result(T)
        assert live.call("add", 5).result(T) == 1
        with pytest.raises(stealer.AgentNotFound, match="'nope'"):
            ex.agent("nope")
    with stealer.Executor(2, journal=d, recover=True) as ex:
        assert ex.recovered == 1
        assert set(ex.agents()) == {"live", "fin", "bad"}
        assert ex.agent("fin").result(T) == "value"
        with pytest.raises(ValueError, match="broken"):
            ex.agent("bad").result(T)
        assert ex.agent("live").call("get").result(T) == [5]
        for name in ("live", "fin"):  # names stay taken across recoveries
            with pytest.raises(ValueError, match=f"named '{name}'"):
                ex.spawn_agent(L.Acc, name=name)
        with pytest.raises(stealer.AgentNotFound):
            ex.agent("nope")
        ex.agent("live").stop()
        assert ex.agent("live").result(T) is None
    with stealer.Executor(2, journal=d) as ex:  # nothing live: no recover=True needed
        assert ex.agent("fin").result(T) == "value"
        assert ex.agent("live").result(T) is None


# -- 3. the inspector -------------------------------------------------------------------
def test_stealer_journal_lists_agents_and_what_recovery_does(tmp_path, capsys):
    d, c = tmp_path / "j", tmp_path / "c"
    _write(d, copy=c, every=2, workers=1)
    capsys.readouterr()
    for path in (c, d):  # live (messages to replay), then after shutdown (a last snapshot)
        p = journal.plan(path, quiet=True)
        assert cli.main(["journal", str(path)]) == 0
        out = capsys.readouterr().out
        assert "2 live" in out
        for a in p.agents.values():
            line = next(ln for ln in out.splitlines() if ln.startswith(a.uid + " "))
            assert a.name in line and " live " in line and a.cls in line
            assert f"v{a.snap['ver']}" in line if a.snap else "from its spawn" in line
            assert f"+ {len(a.msgs)} message(s) to replay" in line
    assert any(a.msgs for a in journal.plan(c, quiet=True).agents.values())
    uid = _uids(d)["a1"]
    assert cli.main(["journal", str(d), "--agent", "a1", "--tail", "3"]) == 0
    out = capsys.readouterr().out.splitlines()
    i = next(i for i, ln in enumerate(out) if ln.startswith(f"last 3 events of {uid}"))
    tail = out[i + 1:]
    assert len(tail) == 3 and "snapshot v" in tail[-1]  # the shutdown snapshot is last
    assert cli.main(["journal", str(d), "--agent", "a1", "--tail", "100"]) == 0
    out = capsys.readouterr().out
    assert "spawned tests.journal_lib.Acc named 'a1'" in out
    logged = re.findall(r"(?:call|message) #\d+ from ", out)
    assert len(logged) == len(_select(d, "SELECT id FROM msgs WHERE target=?", (uid,)))
    assert cli.main(["journal", str(d), "--agent", "a1", "--tail", "0"]) == 0
    assert capsys.readouterr().out.rstrip().endswith(f"last 0 events of {uid}:")
    assert cli.main(["journal", str(d), "--agent", "nope"]) == 0
    assert "no agent named 'nope'" in capsys.readouterr().out


def test_stealer_journal_shows_finished_agents(tmp_path, capsys):
    d = tmp_path / "j"
    with stealer.Executor(2, journal=d) as ex:
        assert ex.spawn_agent(L.Finisher, 1, name="fin").result(T) == 1
        with pytest.raises(ValueError):
            ex.spawn_agent(L.Finisher, 2, True, name="bad").result(T)
    capsys.readouterr()
    assert cli.main(["journal", str(d)]) == 0
    out = capsys.readouterr().out
    assert "0 live" in out and "2 finished" in out
    lines = out.splitlines()
    assert any(" fin " in ln and " done " in ln and "result kept" in ln for ln in lines)
    assert any(" bad " in ln and " failed " in ln for ln in lines)


def test_stealer_journal_on_what_is_not_a_journal(tmp_path, capsys):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    for path in (foreign, tmp_path / "missing", foreign / "notes.txt"):
        assert cli.main(["journal", str(path)]) == 2
        cap = capsys.readouterr()
        assert "stealer journal:" in cap.err and "not a stealer journal" in cap.err
        assert cap.out == ""
    assert _listing(foreign) == ["notes.txt"]
