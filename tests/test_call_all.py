"""call_all: one call per agent of a group, from the client (futures in order) and from
inside an agent (yield it: the list of replies); backpressure, stopped agents, misuse."""

from __future__ import annotations

import concurrent.futures as cf
import time

import pytest

import stealer
from tests import agents_lib as L

T = 60  # seconds: only to turn a hang into a failure


@pytest.fixture(scope="module")
def ex():
    with stealer.Executor(2) as e:
        yield e


def test_futures_come_back_in_the_order_of_the_refs(ex):
    refs = [ex.spawn_agent(L.Counter, 100 * i) for i in range(12)]
    futs = ex.call_all(refs, "add", [(i,) for i in range(12)])
    assert [f.result(T) for f in futs] == [101 * i for i in range(12)]
    # the module function is the same call; no args: no arguments for any agent
    futs = stealer.call_all(refs, "get")
    assert [f.result(T) for f in futs] == [101 * i for i in range(12)]
    done, _ = cf.wait(futs, T)  # real concurrent.futures Futures
    assert done == set(futs)
    for r in refs:
        r.stop()


def test_a_full_mailbox_pushes_back_and_nothing_is_lost(ex):
    """One agent with a one-message mailbox, slow, named five times among fast ones: the
    batch waits for room (it never drops a call), and every call is applied once."""
    slow = ex.spawn_agent(L.Counter, 0, 0.02, mailbox=1)
    fast = [ex.spawn_agent(L.Counter, 0) for _ in range(4)]
    refs = [slow, fast[0], slow, fast[1], slow, fast[2], slow, fast[3], slow]
    futs = ex.call_all(refs, "add", [(1,)] * len(refs))
    got = [f.result(T) for f in futs]
    assert [got[i] for i in (0, 2, 4, 6, 8)] == [1, 2, 3, 4, 5]  # applied in call order
    assert [got[i] for i in (1, 3, 5, 7)] == [1, 1, 1, 1]
    assert slow.call("get").result(T) == 5
    for r in [slow, *fast]:
        r.stop()


def test_a_stopped_agent_fails_its_own_future_only(ex):
    refs = [ex.spawn_agent(L.Counter, i) for i in range(5)]
    refs[2].stop()
    assert refs[2].result(T) == "stopped at 2"
    futs = ex.call_all(refs, "add", [(10,)] * 5)
    for i, f in enumerate(futs):
        if i == 2:
            with pytest.raises(stealer.AgentStopped):
                f.result(T)
        else:
            assert f.result(T) == i + 10
    for r in refs:
        r.stop()


def test_inside_an_agent_the_batch_is_yielded_for_every_reply(ex):
    refs = [ex.spawn_agent(L.Counter, 10 * i) for i in range(6)]
    fan = ex.spawn_agent(L.Fanout, refs)
    assert fan.call("all_add", 1).result(T) == [10 * i + 1 for i in range(6)]
    # a list of ref.call results yielded together is the same
    assert fan.call("listed", 2).result(T) == [10 * i + 3 for i in range(6)]
    # one target stopped: the first failure is raised at the yield, after every reply
    refs[3].stop()
    assert refs[3].result(T) == "stopped at 33"
    with pytest.raises(stealer.AgentStopped):
        fan.call("all_add", 1).result(T)
    got = [r.call("get").result(T) for i, r in enumerate(refs) if i != 3]
    assert got == [10 * i + 4 for i in range(6) if i != 3]  # the others applied it
    for r in [*refs, fan]:
        r.stop()


def test_misuse_is_refused_before_anything_is_sent(ex):
    refs = [ex.spawn_agent(L.Counter, 0) for _ in range(3)]
    with pytest.raises(ValueError, match="3 agents but 2"):
        ex.call_all(refs, "add", [(1,), (1,)])
    with pytest.raises(TypeError, match="one tuple of positional arguments"):
        ex.call_all(refs, "add", [1, 1, 1])
    with pytest.raises(ValueError, match="public method"):
        ex.call_all(refs, "_private", None)
    with pytest.raises(TypeError, match="agent refs"):
        stealer.call_all([refs[0], "not a ref"], "get")
    with stealer.Executor(1) as other:
        alien = other.spawn_agent(L.Counter, 0)
        with pytest.raises(ValueError, match="another executor"):
            ex.call_all([refs[0], alien], "get")
        alien.stop()
    assert ex.call_all([], "get") == []
    time.sleep(0.05)
    assert [r.call("get").result(T) for r in refs] == [0, 0, 0]  # nothing was sent
    for r in refs:
        r.stop()


def test_a_thread_waiting_on_a_batch_is_woken_by_its_last_pending_reply(ex):
    """A thread in result() on any future of a call_all batch parks for the last reply of
    the batch still pending (Settling.batch_target), not for its own: a lockstep client
    is woken about once per worker, not once per reply.  Each target moves as replies
    come, and every result is still right."""
    refs = [ex.spawn_agent(L.Counter, 0, 0.05) for _ in range(4)]  # 50 ms per call
    futs = ex.call_all(refs, "add", [(i,) for i in range(4)])
    pool = ex._pool
    handles = [f._st_handle for f in futs]
    assert all(h is not None for h in handles) and len(set(handles)) == 4
    assert pool.batch_target(futs[0]) == handles[3]
    assert pool.batch_target(futs[2]) == handles[3]
    futs[3].result(T)
    pending = [i for i, f in enumerate(futs) if not f.done()]
    if pending:  # the last pending one now
        assert pool.batch_target(futs[0]) == handles[pending[-1]]
    assert [f.result(T) for f in futs] == [0, 1, 2, 3]
    # a plain call is in no batch; a batch of one is none either
    single = ex.call_all(refs[:1], "add", [(1,)])[0]
    assert single._st_batch is None and refs[1].call("get")._st_batch is None
    assert single.result(T) == 1
    for r in refs:
        r.stop()


def test_a_thread_gathering_batches_parks_for_their_replies_not_on_a_timer(ex, monkeypatch):
    """A client gathering call_all rounds (16 agents, as many calls as put the result thread
    in throughput mode) parks with a target, the batch's last pending reply, never for
    no record, and about once per worker a round: it is woken by replies and idle
    workers, not by its early polls (each one a wake on a CPU a busy worker gives up)."""
    from stealer.client.waiting import NO_TARGET, WAITER_POLL_MAX
    from stealer.shared.idle import Idle

    parks: list[int] = []
    park = Idle.waiter_park

    def counted(self, has_work, timeout, h=-1):
        parks.append(h)
        return park(self, has_work, timeout, h)

    refs = [ex.spawn_agent(L.Counter, 0, 0.001) for _ in range(16)]  # 1 ms per call
    warm = 2  # the first round places the new agents (hundreds of ms)
    rounds = 12
    for k in range(warm + rounds):
        if k == warm:
            monkeypatch.setattr(Idle, "waiter_park", counted)
            t0 = time.monotonic()
        futs = ex.call_all(refs, "add", [(1,)] * len(refs))
        assert [f.result(T) for f in futs] == [k + 1] * len(refs)
    wall = time.monotonic() - t0
    monkeypatch.undo()
    assert parks and NO_TARGET not in parks and -1 not in parks, parks
    # ~8 ms rounds on 2 workers: early polls (every 2 ms) made 4-6 parks a round; a slow
    # machine's longer rounds may add the waiter's safety poll (one per WAITER_POLL_MAX)
    limit = 3 * rounds + wall / WAITER_POLL_MAX
    assert len(parks) <= limit, f"{len(parks)} parks in {rounds} rounds ({wall:.3f} s)"
    for r in refs:
        r.stop()
