"""Many agents cheaply: ``spawn_agents`` (the batch spawn), dormant agents (an idle agent
held as its object alone, stealer/worker/agents/dormant.py) and stopping them all at shutdown.

The batch runs with the native HotPath and with its pure-Python reference twin
(STEALER_PY_HOTPATH=1: ``Arena.spawn_inline``)."""

from __future__ import annotations

import os
import pickle
import signal
import threading
import time

import pytest

import stealer
from stealer.client import agents_batch as batch
from stealer.client.agents_batch import AgentRefs
from stealer.errors import SerializationError
from stealer.shared._layout import D_CAP, D_CKPT, D_CPU_NS, D_OWNER
from tests import agents_lib as L
from tests.probes import records_in_use
from tests.rig import _py_hotpath

T = 60  # seconds: only to turn a hang into a failure


class Plain(stealer.Agent):
    """Message-only, no on_stop: its final value is None."""

    def __init__(self, pad: bytes = b"") -> None:
        self.pad = pad  # (a spawn payload of the size a test needs)

    def ping(self, x: object = None) -> object:
        return x


class StopFails(stealer.Agent):
    def ping(self, x: object = None) -> object:
        return x

    def on_stop(self) -> None:
        raise RuntimeError("on_stop failed")


class InitFails(stealer.Agent):
    """Message-only; its constructor raises for every third index."""

    def __init__(self, k: int) -> None:
        if k % 3 == 0:
            raise ValueError(f"no agent {k}")
        self.k = k

    def ping(self, x: object = None) -> object:
        return (self.k, x)


class OwnStep(stealer.Agent):
    """No ``step`` on the class, one on the instance: it must run, not sleep dormant."""

    def __init__(self, n: int) -> None:
        self.left = n
        self.step = self._step

    def _step(self, ctx: stealer.Ctx) -> object:
        self.left -= 1
        return ctx.done("stepped") if self.left <= 0 else None


@pytest.fixture(scope="module", params=["native", "python"])
def ex(request):
    """One executor per twin for the module: every test that takes it stops its agents and
    checks that no record stays held, so the next one starts from the same clean state.
    STEALER_PY_HOTPATH is set only while it starts (the client's and the workers' arenas
    read it then), not around the tests that make their own executors."""
    with _py_hotpath(request.param == "python"):
        e = stealer.Executor(2, records=1 << 14)
    with e:
        yield e


def _settled(ex: stealer.Executor) -> None:
    """Every spawned agent adopted: nothing left on the injector, any deque or inbox."""
    end = time.monotonic() + T
    while True:
        st = ex.stats()
        if st.injector_depth == 0 and not any(w.deque_depth or w.inbox_depth
                                              for w in st.workers):
            return
        assert time.monotonic() < end, "agents still waiting to be adopted"
        time.sleep(0.01)


def _dir_word(ex: stealer.Executor, h: int, field: int, size: int = 8) -> int:
    d = ex._pool.agents.dir
    r = ex._pool.region
    return r.load64(d.entry(h) + field) if size == 8 else r.load32(d.entry(h) + field)


def _stop_all(refs) -> list:
    for r in refs:
        r.stop()
    return [r.result(T) for r in refs]


# -- spawn_agents ---------------------------------------------------------------------
def test_spawn_agents_gives_refs_in_order(ex):
    n = batch.CHUNK + 904  # two native calls
    refs = ex.spawn_agents(L.Counter, ((i,) for i in range(n)))
    assert isinstance(refs, AgentRefs) and len(refs) == n
    assert len({r.id for r in refs}) == n
    assert [f.result(T) for f in ex.call_all(refs, "get")] == list(range(n))
    assert refs[7] == refs[7] and refs[-1] == list(refs)[-1]
    assert refs[7].call("add", 1).result(T) == 8
    assert list(refs[10:13]) == [refs[10], refs[11], refs[12]]
    assert list(refs.ids[:3]) == [refs[0].id, refs[1].id, refs[2].id]
    assert pickle.loads(pickle.dumps(refs[5])) == refs[5]
    out = _stop_all(refs)
    assert out[7] == "stopped at 8" and out[:3] == [f"stopped at {i}" for i in range(3)]
    assert records_in_use(ex) == 0


def test_spawn_agents_splits_a_batch_evenly_over_the_workers(ex):
    """Each chunk is split over the workers' inboxes in turn: from the injector, the worker
    that woke first adopted nearly all of a batch (255 or 256 of 256 in 4 of 6
    executors), and agents with calls shorter than a move never went back."""
    import collections

    pids = set(ex.worker_pids())
    for _ in range(3):
        ex.submit(L.busy, 0.002).result(T)  # a task just before, as a warm-up is
        refs = ex.spawn_agents(L.Where, [()] * 16)
        where = collections.Counter(f.result(T) for f in ex.call_all(refs, "pid"))
        assert where == dict.fromkeys(pids, 8), where
        _stop_all(refs)
    assert records_in_use(ex) == 0


def test_spawn_agents_options_reach_every_agent(ex):
    """The options are parsed once and reach every agent of the batch (the mailbox
    capacity is in each one's directory entry); an empty batch is an empty sequence."""
    refs = ex.spawn_agents(L.Counter, [(i,) for i in range(300)], mailbox=5, tier="control")
    assert [f.result(T) for f in ex.call_all(refs, "get")] == list(range(300))
    assert {_dir_word(ex, r.id, D_CAP, 4) for r in refs} == {5}
    assert len(ex.spawn_agents(L.Counter, [])) == 0
    _stop_all(refs)
    assert records_in_use(ex) == 0


def test_spawn_agents_payload_in_a_block_keeps_the_order(ex):
    """Arguments too big for the inline bytes: those agents are queued one by one,
    between the native runs, and the refs stay in order."""
    args = [(i,) if i % 4 else (i, 0.0, ["pad" * 60]) for i in range(40)]
    refs = ex.spawn_agents(_Padded, args)
    assert [f.result(T) for f in ex.call_all(refs, "get")] == list(range(40))
    _stop_all(refs)
    assert records_in_use(ex) == 0


class _Padded(L.Counter):
    def __init__(self, start: int = 0, delay: float = 0.0, pad: object = None) -> None:
        super().__init__(start, delay)
        self.pad = pad


def test_spawn_agents_checks_options_once_and_starts_nothing_on_bad_input(ex):
    with pytest.raises(ValueError):
        ex.spawn_agents(L.Counter, [(1,)] * 10, tier="nope")
    with pytest.raises(TypeError, match="agent class"):
        ex.spawn_agents(L.Counter(), [(1,)])
    with pytest.raises(TypeError, match="tuple of arguments"):
        ex.spawn_agents(L.Counter, [1, 2])
    assert records_in_use(ex) == 0


def test_spawn_agents_failure_mid_batch_stops_what_it_started(ex):
    """All or nothing: an argument that does not pickle after a whole chunk was queued
    raises, and the agents already started are stopped; no record stays held."""
    args = [(i,) for i in range(batch.CHUNK + 10)] + [(threading.Lock(),)]
    with pytest.raises(SerializationError):
        ex.spawn_agents(L.Counter, args)
    assert records_in_use(ex) == 0
    args = [(i,) for i in range(batch.CHUNK + 10)] + ["not a tuple"]
    with pytest.raises(TypeError):
        ex.spawn_agents(L.Counter, args)
    assert records_in_use(ex) == 0


def test_spawn_agents_out_of_records_raises_and_leaks_nothing(monkeypatch):
    """More agents than records: the batch waits as one spawn does (RECORD_WAIT), then
    raises, and the agents it started are stopped and their records freed."""
    from stealer.client import agents as client

    monkeypatch.setattr(client, "RECORD_WAIT", 0.5)
    with stealer.Executor(2, records=256) as ex:
        with pytest.raises(stealer.StealerError, match="no free record"):
            ex.spawn_agents(L.Counter, [(i,) for i in range(400)])
        assert records_in_use(ex) == 0
        refs = ex.spawn_agents(L.Counter, [(i,) for i in range(100)])  # all free again
        assert [f.result(T) for f in ex.call_all(refs, "get")] == list(range(100))


def test_spawn_agents_with_a_journal_names_each_agent(tmp_path):
    with stealer.Executor(2, journal=str(tmp_path / "j")) as ex:
        refs = ex.spawn_agents(L.Counter, [(i,) for i in range(5)])
        assert [r.uid for r in refs] == [f"{refs[0].uid.split('.')[0]}.{i}" for i in
                                         range(1, 6)]
        assert [r.call("get").result(T) for r in refs] == list(range(5))


# -- dormant agents ---------------------------------------------------------------------
def test_idle_agents_go_dormant_and_wake_exactly_as_before(ex):
    """A message-only agent with nothing to do after its spawn runs no turn (dormant: its
    D_CPU_NS stays 0); its first message wakes it, and from then on it keeps the order
    of every sender, checkpoints every `checkpoint_every` events and stops with on_stop."""
    refs = ex.spawn_agents(L.Counter, [(i,) for i in range(200)], checkpoint_every=4)
    _settled(ex)
    time.sleep(0.2)
    assert all(_dir_word(ex, r.id, D_OWNER, 4) for r in refs)  # adopted
    assert not any(_dir_word(ex, r.id, D_CPU_NS) for r in refs)  # and not one turn run
    woken = refs[::10]
    for r in woken:
        for s in range(30):
            r.send("note", "client", s)
    logs = [f.result(T) for f in ex.call_all(woken, "log")]
    assert logs == [[("client", s) for s in range(30)]] * len(woken)
    assert all(_dir_word(ex, r.id, D_CKPT) for r in woken)  # they checkpoint again
    assert not any(_dir_word(ex, r.id, D_CKPT) for r in refs[1::10])
    relay = ex.spawn_agent(L.Relay, refs[3])  # an agent calling a dormant one
    assert relay.call("relay", 2).result(T) == 50
    out = _stop_all(refs)
    assert out[0] == "stopped at 0" and out[199] == "stopped at 199"
    relay.stop()
    relay.result(T)
    assert records_in_use(ex) == 0


def test_adopting_an_idle_agent_whose_constructor_raises_or_that_has_its_own_step(ex):
    """The other ends of adopting an agent fresh from its spawn (Turns.adopt natively,
    dormant.adopt in Python): a constructor that raises ends that agent with its error
    and nobody else; an instance ``step`` attribute makes it run its steps."""
    refs = ex.spawn_agents(InitFails, [(k,) for k in range(30)])
    steppers = ex.spawn_agents(OwnStep, [(k + 1,) for k in range(20)])
    assert [r.result(T) for r in steppers] == ["stepped"] * 20
    for k, r in enumerate(refs):
        if k % 3 == 0:
            with pytest.raises(ValueError, match=f"no agent {k}$"):
                r.result(T)
    live = [r for k, r in enumerate(refs) if k % 3]
    assert [f.result(T) for f in ex.call_all(live, "ping", [(1,)] * len(live))] == [
        (k, 1) for k in range(30) if k % 3]
    assert _stop_all(live) == [None] * len(live)
    assert records_in_use(ex) == 0


def test_final_values_settled_in_a_batch_go_to_their_futures_or_wait_and_strays_count():
    """AgentClient.settle_many (what complete_batch hands an agent's final value that found
    no future): a value whose Future was made meanwhile resolves it, one nobody asked for
    waits in ``finished`` for ref.result(), and a result that is not an agent's is counted
    as a stray (a delivery bug: test_chaos checks the count stays 0 under kills)."""
    from stealer.agents.message import AGENT_FID
    from stealer.client.agents import _AgentFuture

    with stealer.Executor(1) as ex:
        pool = ex._pool
        ac = pool.agents
        asked, unasked = AGENT_FID | 0xFFFFF0, AGENT_FID | 0xFFFFF1  # no agent has these
        f = _AgentFuture(pool, asked, "agent")
        pool.futures[asked] = f
        assert ac.settle_many([(asked, "mine"), (unasked, "later"), (7, "stray")]) == 1
        assert f.result(T) == "mine" and asked not in pool.futures
        assert ac.finished.pop(unasked) == (0, "later")
        stray = pool.stray
        pool.settle_others([(8, None)])
        assert pool.stray == stray + 1
        pool.stray = stray


@pytest.mark.parametrize("turns", ["native", "python"])
def test_shutdown_stops_dormant_and_woken_agents_with_their_final_values(monkeypatch, turns):
    """Shutdown stops every agent directly, dormant or not: on_stop's value (None without
    one, its exception if it raises) reaches each ref, also for agents that got messages
    just before the shutdown (whose notification may still be on its way).  Both twins of
    the dormant agents' stop: Turns.stop_dormant (native) and dormant.stop_all's loop
    (STEALER_NO_FAST_TURN=1).  Among the agents without on_stop: some got a late message
    (the native pass must leave their mailbox to the loop), and some have a spawn payload
    that fills their record's inline bytes (their None no longer fits beside it: reported
    through the Python path)."""
    monkeypatch.setenv("STEALER_NO_FAST_TURN", "1" if turns == "python" else "")
    with stealer.Executor(2, records=1 << 14) as ex:
        counters = ex.spawn_agents(L.Counter, [(i,) for i in range(3000)])
        plain = ex.spawn_agents(Plain, [()] * 500)
        failing = ex.spawn_agents(StopFails, [()] * 20)
        # args of 0..99 bytes: spawn payloads of every size around the 96 inline bytes
        filled = ex.spawn_agents(Plain, [(b"x" * k,) for k in range(100)])
        _settled(ex)
        assert counters[5].call("add", 1).result(T) == 6  # woken
        for r in counters[100:400]:
            r.send("add", 1)  # late: handled, or still in the mailbox at the stop
        for r in plain[100:300]:
            r.send("ping", 1)  # the same for agents without on_stop
    assert [r.result(T) for r in plain] == [None] * 500
    assert [r.result(T) for r in filled] == [None] * 100
    got = [r.result(T) for r in counters]
    assert got[5] == "stopped at 6"
    for i, v in enumerate(got):
        if i != 5:
            assert v in ((f"stopped at {i}", f"stopped at {i + 1}") if 100 <= i < 400
                         else (f"stopped at {i}",)), (i, v)
    for r in failing:
        with pytest.raises(RuntimeError, match="on_stop failed"):
            r.result(T)


@pytest.mark.kills_workers
def test_dormant_agents_of_a_killed_worker_restart_from_their_spawn():
    with stealer.Executor(2, records=1 << 12) as ex:
        refs = ex.spawn_agents(L.Counter, [(i,) for i in range(600)])
        _settled(ex)
        assert refs[0].call("add", 1).result(T) == 1  # one woken agent among them
        os.kill(ex.worker_pids()[0], signal.SIGKILL)
        # restarted from their spawn; the woken one replays its accepted message
        assert [f.result(T) for f in ex.call_all(refs, "get")] == [1, *range(1, 600)]
        _stop_all(refs)
        assert records_in_use(ex) == 0


@pytest.mark.kills_workers
@pytest.mark.parametrize("when", ["adopting", "stopping"])
def test_a_worker_killed_while_it_adopts_or_stops_idle_agents_natively(when):
    """SIGKILL a worker while it adopts its 30,000 of 60,000 idle agents from its inbox
    (Turns.adopt, one after another; the rest of its inbox is handed on by recovery) or
    while it stops them at shutdown (Turns.stop_dormant's pass): the agents it held or
    was taking restart on its successor from their spawn, and every call and every final
    value still arrives once (no failpoints here: they would turn the native paths off)."""
    n = 60_000
    with stealer.Executor(2, records=1 << 17) as ex:
        for f in [ex.submit(time.sleep, 0.05) for _ in range(2)]:
            f.result(T)  # both workers up
        pids = ex.worker_pids()
        refs = ex.spawn_agents(Plain, [()] * n)
        if when == "adopting":
            # worker 0's share waits in its inbox (agents_batch.py), adopted one by one
            def waiting() -> int:
                return ex.stats(agents=False).workers[0].inbox_depth

            end = time.monotonic() + T
            while waiting() >= n // 2:  # until its adoptions begin
                assert time.monotonic() < end, "nothing was ever adopted"
                time.sleep(0.001)
            adopted = waiting() > 0  # and are not all done
            os.kill(pids[0], signal.SIGKILL)
            _settled(ex)
            probes = list(refs[:: n // 200])
            assert [f.result(T) for f in ex.call_all(probes, "ping", [(k,) for k in
                                                                    range(len(probes))])] \
                == list(range(len(probes)))
            # the call woke the probes: the rest are dormant where they live now
        else:
            _settled(ex)
            stopper = threading.Thread(target=ex.shutdown, kwargs={"wait": True})
            stopper.start()
            end = time.monotonic() + T
            while not ex._pool.agents.finished:  # the stop passes run: final values come
                assert time.monotonic() < end, "no final value came"
                time.sleep(0.0005)
            adopted = len(ex._pool.agents.finished) < n  # not all stopped yet
            os.kill(pids[0], signal.SIGKILL)
            stopper.join(T)
            assert not stopper.is_alive()
        ex.shutdown(wait=True)
    assert adopted, "the kill came after the whole pass: this run tests nothing"
    assert ex._pool.crashes >= 1  # (stopping: the shutdown saw it too)
    got = [r.result(T) for r in refs]
    assert got.count(None) == n


@pytest.mark.kills_workers
@pytest.mark.parametrize("point", ["dormant.adopt_built", "dormant.stop_after_close"])
def test_worker_killed_at_a_dormant_failpoint(monkeypatch, tmp_path, point):
    """Killed right after building an idle agent (before it is held dormant), or at
    shutdown between closing a dormant agent's mailbox and publishing its final value:
    that worker's agents restart on its successor from their spawn, and every call and
    every final value still arrives."""
    monkeypatch.setenv("STEALER_FAILPOINTS", f"{point}=kill@50!once")
    monkeypatch.setenv("STEALER_FAILPOINTS_DIR", str(tmp_path))
    with stealer.Executor(2, records=1 << 12) as ex:
        refs = ex.spawn_agents(L.Counter, [(i,) for i in range(500)])
        _settled(ex)
        assert [f.result(T) for f in ex.call_all(refs[::7], "get")] == list(range(0, 500, 7))
    assert [r.result(T) for r in refs] == [f"stopped at {i}" for i in range(500)]
    assert os.path.exists(tmp_path / point), f"{point} was never reached"
    assert ex._pool.crashes >= 1


def test_many_agents_in_lockstep_never_leave_their_senders_without_records():
    """Handled messages stay in records until a checkpoint covers them.  32 agents that
    each kept checkpoint_every (64) of them would hold 2,048 of these 1,024 records, and
    the client would wait for one (half a second, a worker's park timeout, in the lockstep
    benchmark): an agent keeps at most its share of a quarter of the records."""
    with stealer.Executor(2, records=1024) as ex:
        refs = [ex.spawn_agent(L.Counter, i) for i in range(32)]
        for k in range(1, 81):
            got = [f.result(60) for f in ex.call_all(refs, "add", [(1,)] * 32)]
            assert got == [i + k for i in range(32)]
        assert ex._pool.agents.record_waits == 0
        for r in refs:
            r.stop()
