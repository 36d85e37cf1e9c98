"""The client's side of agents: spawn, send, call, stop, and the final values.

An agent's final value reaches the client as any root task's result does
(its record is published on a completion ring when it is DONE), under the
future id ``AGENT_FID | handle``.  No Future exists per agent until
somebody asks (``ref.result()``, ``ref.future``): a million idle agents
cost the client nothing; a final value nobody has asked for yet waits in
:attr:`AgentClient.finished`.
"""

from __future__ import annotations

import functools
import threading
import time
import weakref
from typing import Any

from stealer.agents.api import AgentRef, _clients
from stealer.agents.jblob import pack as journal_pack
from stealer.agents.mailbox import (
    CLOSED,
    POST_FULL,
    POST_NOREC,
    POST_QUIET,
    POST_STOPPED,
    Directory,
)
from stealer.agents.message import AGENT_FID, encode_message, message_reply, method_ok
from stealer.agents.options import DEFAULT_OPTIONS, AgentOptions
from stealer.client.futures import _Future
from stealer.errors import (
    AgentStopped,
    BrokenExecutor,
    JournalError,
    MailboxFull,
    StealerError,
    result_value,
)
from stealer.shared import serialize
from stealer.shared._layout import (
    AF_CONTROL,
    D_CKPT,
    F_AGENT,
    INLINE,
    K_CKPT,
    K_MASK,
    K_MSG,
    K_REPLY,
    K_ROOT,
    S_CANCELLED,
    S_DONE,
    S_QUEUED,
    S_RECOVERING,
    S_RUNNING,
    ST_ERROR,
    ST_OK,
)
from stealer.shared.records import Outcome
from stealer.shared.recovery import task_call_slot
from stealer.shared.shm import STATE_READY, STATE_STARTING, W_CURRENT, W_STATE

__all__ = ["AgentClient", "AGENT_FID", "lookup", "encode_message"]

RECORD_WAIT = 30.0  # seconds a send or spawn waits for a free record before giving up

# what a call reports on its future rather than raising
_CALL_ERRORS = (AgentStopped, MailboxFull, ValueError, StealerError, JournalError)



def lookup(seg: str) -> AgentClient | None:
    ref = _clients.get(seg)
    return ref() if ref is not None else None


class _AgentFuture(_Future):
    """The Future of an agent's final value: stop the agent to end it, not cancel()."""

    def cancel(self) -> bool:
        return False


class AgentClient:
    """Per-executor client state of its agents (created with the pool).

    Over 400 lines because it is the client's whole side of the agent protocol, one
    operation per method group (spawn and placement, the journal's spawn and message
    records, final values, send/call/call_all, abandoning an agent that failed outside
    its worker, recovery from a journal), all on the same few fields (the arena, the
    directory, the futures); splitting it would pass those fields around instead."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.a = pool.arena
        self.dir = Directory(pool.region, pool.arena, pool.layout.offsets["agents"],
                             pool.inboxes, pool.idle, pool.defer_ping,
                             # signal a busy owner only where it handles it (inline.py)
                             worker_base=pool.layout.worker if pool.native else None)
        self.lock = threading.Lock()
        self.next_worker = 0  # where place() puts the next new agent
        self.futures: dict[int, _Future] = {}  # agent handle -> its final value's Future
        self.finished: dict[int, tuple[int, Any]] = {}  # fid -> (status, value), nobody asked yet
        self.name = pool.name
        # the journal (Executor(journal=PATH)): None, or the client's shard and epoch
        self.j: Any = None
        self.jlock = threading.Lock()
        self.jseq = 0  # sequence number of the client's last journaled message
        self.jspawned = 0  # agents this client spawned (their uids: "<epoch>.<n>")
        self.names: dict[str, str] = {}  # agent name -> uid (this journal, every epoch)
        # agent name -> handle, without a journal (this executor's run; under jlock)
        self.live_names: dict[str, int] = {}
        self.names_prune_at = 64  # its size at which the names of ended agents are dropped
        self.by_uid: dict[str, int] = {}  # uid -> handle of a live agent spawned or recovered
        self.ended: dict[str, tuple[int, bytes, int]] = {}  # uid -> final value, recovered
        self.record_waits = 0  # sends, calls and spawns that found no free record (tests)
        _clients[pool.name] = weakref.ref(self)
        # a call's two steps (see call): native (HotPath) when the arena uses it, else
        # their Python references (Arena.reply_slot, Directory.post)
        hot = self.a.hot
        # calls()' loop in one native call where the messages are written natively too
        self.native_calls: Any = None
        if hot is not None:
            hot.set_agents(pool.layout.offsets["agents"], pool.inboxes)
            self.post = hot.post_msg
            if serialize._fast is not None:
                self.native_calls = functools.partial(hot.calls, serialize._fast)
        else:
            self.post = self.dir.post

    def close(self) -> None:
        _clients.pop(self.name, None)
        if self.j is not None:
            from stealer.agents import api

            # (a bound method: compared by ==, so remove() finds the one recover() added)
            if self._remap in api._remap:
                api._remap.remove(self._remap)
            self.j.close()

    # -- records ------------------------------------------------------------------
    def alloc(self, what: str) -> int:
        a = self.a
        h = a.alloc()
        if h >= 0:
            return h
        end = time.monotonic() + RECORD_WAIT
        delay = 0.0001
        self.record_waits += 1
        # replies waiting to be read hold records: let the result thread take them now
        # (parked in throughput mode, it would look only at its next poll)
        self.pool.wake()
        while True:
            self.pool.check_open()
            time.sleep(delay)
            delay = min(delay * 2, 0.01)
            h = a.alloc()
            if h >= 0:
                return h
            if time.monotonic() > end:
                raise StealerError(
                    f"no free record for {what} in {RECORD_WAIT:.0f} s: every record holds a "
                    "live agent, a queued message or an unread result. Create the Executor "
                    "with more records (Executor(records=...)), or stop agents you no "
                    "longer need.")

    # -- spawn ------------------------------------------------------------------
    def spawn(self, cls: type, args: tuple, kwargs: dict, opts: AgentOptions,
              retries: int, name: str | None = None) -> AgentRef:
        pool = self.pool
        deadline_at = None if opts.deadline is None else time.monotonic() + opts.deadline
        wopts = None if opts == DEFAULT_OPTIONS else opts.to_worker()
        what = f"agent {getattr(cls, '__qualname__', cls)!r} and its arguments"
        uid = None
        j = self.j
        if j is not None:
            uid, jinfo = self._journal_spawn(cls, args, kwargs, wopts, name, what)
            data, bufs = serialize.dumps((cls, args, kwargs or None, wopts, deadline_at,
                                          jinfo), what)
        else:
            if name is not None:
                self._check_name(name)
            fid = pool.fns.id_of(cls)  # the class once in the function table, then by id
            # small enough for a record's inline bytes: a million idle agents use no blocks
            data, bufs = serialize.dumps((fid if fid >= 0 else cls, args, kwargs or None,
                                          wopts, deadline_at), what)
        pool.check_open()
        h = self.alloc("a new agent")
        self.queue_agent(h, data, bufs, opts.mailbox, AF_CONTROL if opts.tier == 0 else 0,
                         retries, place=True)
        if uid is not None:
            self.by_uid[uid] = h
        elif name is not None:
            with self.jlock:
                try:
                    self._check_name(name)  # (another thread may have taken it meanwhile)
                except ValueError:
                    self.stop(h)
                    raise
                names = self.live_names
                names[name] = h
                if len(names) >= self.names_prune_at:  # (names of ended agents: dropped)
                    for n, held in list(names.items()):
                        if self._ended(held):
                            del names[n]
                    self.names_prune_at = max(64, 2 * len(names))
        return AgentRef(h, self.name, self, uid)

    def _check_name(self, name: str) -> None:
        """A name for an agent of an executor without a journal: a non-empty str that no
        live agent of this executor has (as Ray's named actors: an ended agent's name is
        free again; with a journal names are the journal's, never reused)."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"an agent's name is a non-empty str, not {name!r}")
        h = self.live_names.get(name)
        if h is not None and not self._ended(h):
            raise ValueError(f"this executor already has an agent named {name!r} (names "
                             "are unique among its live agents; ex.agent(name) finds it)")

    def queue_agent(self, h: int, data: bytes, bufs: list, mailbox: int, flags: int,
                    retries: int, place: bool = False) -> None:
        """Set up agent record ``h`` (its directory entry first, then the record with its
        spawn payload) and queue it (with ``place``, on the next worker in turn:
        :meth:`place`); on an error the record is freed and nothing queued."""
        a = self.a
        try:
            self.dir.init(h, mailbox, flags)  # before the record is QUEUED
            off = a.setup(h, K_ROOT | F_AGENT, AGENT_FID | h, time.monotonic_ns(), retries)
            a.put(off, data, bufs)
        except BaseException:
            a.free(h)
            raise
        if place:
            self.place(h)
        else:
            self.pool.push(h)

    def place(self, h: int) -> None:
        """Queue new agent ``h`` on the next worker in turn that is live and not running a
        task (:meth:`pick`): pushed into its inbox, where it starts it (worker/join.py
        on_ping; a dead worker's inbox is handed on by recovery.py dead_pings), so agents
        spawned in a row start spread evenly.  From the injector, whichever worker took
        its batches adopted them (seen: 246 of 256 on one), and the balancer then spent
        hundreds of moves evening them out.  The injector if no worker fits."""
        pool = self.pool
        for _ in range(pool.n):
            k = self.pick()
            if k < 0:
                break
            if pool.inboxes[k].push(h):
                pool.idle.notify_worker(k)
                return
        pool.push(h)
        pool.idle.notify_one()

    def pick(self) -> int:
        """The next worker in turn that is live and not running a task (an agent's turn is
        fine: a worker in a task reads its inbox only after it, and the agent would wait);
        -1 if none is."""
        pool = self.pool
        r = pool.region
        n = pool.n
        for _ in range(n):
            k = self.next_worker
            self.next_worker = (k + 1) % n  # racing spawners may share a turn: harmless
            base = pool.layout.worker(k)
            # relaxed: the worker's store32s (starting, ready...); a stale one only delays
            # the agent until recovery hands the dead worker's inbox on
            if r.load32(base + W_STATE) not in (STATE_STARTING, STATE_READY):
                continue
            cur = r.load64(base + W_CURRENT)  # relaxed: a hint (pairs with nothing)
            if cur and self._task_runs(cur - 1):
                continue  # a task runs there
            return k
        return -1

    def _task_runs(self, h: int) -> bool:
        """Is task ``h``, named by a worker's current word, still running?  A worker
        clears the word after it published the task's result: a client woken by that
        result (the worker hands it its CPU) and spawning agents at once found the word
        still set for milliseconds, and put every agent on the other worker (256 of 256
        in 5 of 8 runs).  A record that is not RUNNING any more is done."""
        a = self.a
        if a.kind_link(a.off(h))[0] & F_AGENT:
            return False
        st = a.tr.state(h)  # None: the record was freed (and maybe reused) since
        return st is not None and st[0] == S_RUNNING

    # -- the journal ------------------------------------------------------------------
    def recover(self, plan: Any) -> int:
        """Restart the live agents of a journal: each from its newest snapshot (a K_CKPT
        record, as after a worker death), with the messages it had not applied in its
        mailbox.  Returns how many agents were restarted."""
        from stealer.agents import api
        from stealer.agents.jblob import loads, unpack
        from stealer.shared._layout import D_COUNT

        a = self.a
        r = self.pool.region
        j = self.j
        live = []
        for uid, p in plan.agents.items():
            if p.spawn is None:
                continue
            if p.name is not None:
                self.names[p.name] = uid
            if p.end is not None:
                self.ended[uid] = p.end
            else:
                live.append(p)
        need = sum(2 + len(p.msgs) for p in live)
        have = self.pool.layout.records
        if need > have // 2:
            raise JournalError(
                f"recovering {len(live)} agents needs about {need} records (their checkpoints "
                f"and {need - 2 * len(live)} messages to replay) but this executor has "
                f"{have}: create it with Executor(records={1 << max(need * 2, 2).bit_length()}"
                ", ...)")
        api._remap.append(self._remap)
        handles = {p.uid: self.alloc("a recovered agent") for p in live}
        self.by_uid.update(handles)  # refs in spawn arguments are remapped from here on
        now = time.monotonic_ns()
        for p in live:
            h = handles[p.uid]
            cls, args, kwargs, wopts = loads(*p.spawn)
            opts = AgentOptions.from_worker(wopts) if wopts else DEFAULT_OPTIONS
            deadline_at = None if opts.deadline is None else time.monotonic() + opts.deadline
            self.dir.init(h, opts.mailbox, AF_CONTROL if opts.tier == 0 else 0)
            ck = -1
            if p.snap is not None:
                ch = self.alloc("a recovered checkpoint")
                off = a.setup(ch, K_CKPT, 0, now)
                a.put(off, *unpack(p.snap["body"], p.snap["oob"]))
                ck = ch + 1
                # plain store: published by the agent record's push below
                r.store64(self.dir.entry(h) + D_CKPT, ck)
            jinfo = (p.uid, p.name, p.replies or None, ck)
            data, bufs = serialize.dumps((cls, args, kwargs, wopts, deadline_at, jinfo),
                                         f"agent {p.uid!r}")
            off = a.setup(h, K_ROOT | F_AGENT, AGENT_FID | h, now, self.pool.retries)
            a.put(off, data, bufs)
            for body, oob, _sender, _seq in p.msgs:
                m = self.alloc("a replayed message")
                moff = a.setup(m, K_MSG, 1, now)  # link 1: replayed (agents/journal/)
                a.put(moff, *unpack(body, oob))
                # the replayed messages may exceed the capacity: counted, never refused
                # (seq_cst RMW, pairs with the owner's give_back)
                r.add32(self.dir.entry(h) + D_COUNT, 1)
                self.dir.push(h, m)
        rows = [(j.epoch, uid, h) for uid, h in handles.items()]
        rows += [(j.epoch, uid, -1) for uid in self.ended]
        with j.ctl.c:  # one transaction, committed before any recovered agent runs
            j.ctl.c.execute("BEGIN")
            j.ctl.c.executemany("INSERT INTO handles VALUES (?,?,?)", rows)
        for p in live:
            self.pool.push(handles[p.uid])
        self.pool.idle.notify_all()
        return len(live)

    def _remap(self, uid: str) -> tuple[str, int] | None:
        h = self.by_uid.get(uid)
        if h is None and uid in self.ended:
            h = -1
        return None if h is None else (self.name, h)

    def ref(self, name: str) -> AgentRef:
        """ex.agent(name): a ref on the agent of that name (live or finished)."""
        from stealer.errors import AgentNotFound

        h = self.live_names.get(name)
        if h is not None:
            return AgentRef(h, self.name, self, None)
        uid = self.names.get(name)
        if uid is None:
            where = f"the journal {self.j.path}" if self.j else "this executor"
            known = sorted(self.names) + sorted(self.live_names)
            raise AgentNotFound(f"no agent named {name!r} in {where}; "
                                f"names: {', '.join(known[:10]) or 'none'}")
        h = self.by_uid.get(uid, -1)
        return AgentRef(h, self.name, self, uid)

    def _journal_spawn(self, cls: type, args: tuple, kwargs: dict, wopts: Any,
                       name: str | None, what: str) -> tuple[str, tuple]:
        """Write the spawn event (before the agent exists anywhere): its uid and jinfo."""
        if name is not None and (not isinstance(name, str) or not name):
            raise ValueError(f"an agent's name is a non-empty str, not {name!r}")
        body, oob = journal_pack(serialize.dumps((cls, args, kwargs or None, wopts), what))
        with self.jlock:
            if name is not None and name in self.names:
                raise ValueError(f"this journal already has an agent named {name!r} (names "
                                 "are unique per journal; ex.agent(name) finds it)")
            self.jspawned += 1
            uid = f"{self.j.epoch}.{self.jspawned}"
            self.j.shard.spawn(uid, name, None, f"{cls.__module__}.{cls.__qualname__}", body,
                               oob)
            if name is not None:
                self.names[name] = uid
        return uid, (uid, name, None, 0)

    def _journal_msg(self, uid: str | None, h: int, method: str, args: tuple, kwargs: dict,
                     reply: int, deadline: float | None) -> tuple[bytes, list]:
        j = self.j
        if j is None or uid is None:
            return encode_message(h, method, args, kwargs, reply, deadline)
        with self.jlock:  # sequence numbers in the order the messages are logged
            self.jseq += 1
            seq = self.jseq
            data, bufs = encode_message(h, method, args, kwargs, reply, deadline,
                                        f"c{j.epoch}", seq)
            body, oob = journal_pack((data, bufs))
            j.shard.msg(uid, f"c{j.epoch}", seq, reply >= 0, body, oob)
        return data, bufs

    # -- final values ----------------------------------------------------------------
    def future(self, h: int, uid: str | None = None) -> _Future:
        if h < 0:  # an agent that had finished before the journal was recovered
            return self._ended_future(uid)
        with self.lock:
            f = self.futures.get(h)
            if f is not None:
                return f
            fid = AGENT_FID | h
            f = _AgentFuture(self.pool, fid, f"agent {h:#x}")
            self.futures[h] = f
            self.pool.futures[fid] = f
            got = self.finished.pop(fid, None)
        if got is not None:  # finished before anybody asked
            self.pool.futures.pop(fid, None)
            self.pool.resolve(f, *got)
        elif self.pool.broken and self.pool.futures.pop(fid, None) is not None:
            self.pool.resolve(f, 1, (BrokenExecutor(self.pool.broken), ""))
        return f

    def _ended_future(self, uid: str | None) -> _Future:
        got = self.ended.get(uid) if uid is not None else None
        if got is None:
            raise AgentStopped(f"agent {uid!r} is not in this executor's journal", -1)
        status, body, oob = got
        f = _AgentFuture(self.pool, -1, f"agent {uid}")
        try:
            from stealer.agents.jblob import loads

            status, value = result_value(status, loads(body, oob))
        except BaseException as exc:
            status, value = ST_ERROR, (exc, "")
        self.pool.resolve(f, status, value)
        return f

    def settle(self, fid: int, status: int, value: Any) -> bool:
        """Result thread: an agent's final value that no Future waited for."""
        if not fid & AGENT_FID:
            return False
        with self.lock:
            # A Future made since the caller found none in pool.futures (future() registers
            # it under this lock, then looks in `finished`): it gets the value, or the value
            # would wait in `finished` for a Future that never looks again (a hang, seen as
            # ref.result() timing out when a stop's final value raced the call).
            f = self.pool.futures.pop(fid, None)
            if f is None:
                self.finished[fid] = (status, value)
                return True
        self.pool.resolve(f, status, value)
        return True

    def settle_many(self, pairs: list[tuple[int, Any]]) -> int:
        """Result thread: :meth:`settle` of many plain (``ST_OK``) final values at once, one
        lock section for the batch (a shutdown of a million idle agents brings a million
        of them, a lock and a call each took about a microsecond); how many were not an
        agent's (strays)."""
        pool_futures = self.pool.futures
        finished = self.finished
        later = []
        stray = 0
        with self.lock:  # as settle: a Future made meanwhile gets the value
            for fid, value in pairs:
                if not fid & AGENT_FID:
                    stray += 1
                    continue
                f = pool_futures.pop(fid, None)
                if f is None:
                    finished[fid] = (ST_OK, value)
                else:
                    later.append((f, value))
        for f, value in later:
            self.pool.resolve(f, ST_OK, value)
        return stray

    def alive(self) -> bool:
        """Any agent record whose final value the result thread has not read yet (a scan:
        shutdown only; DONE counts, its completion may still be on its way)."""
        import numpy as np

        from stealer.shared._layout import K_MASK, S_FREE, STATE_MASK, STATE_SHIFT

        w, ks, _link = self.pool.rec._columns()
        kind = ks & np.uint64(0xFFFFFFFF)
        agent = (kind & np.uint64(F_AGENT | K_MASK)) == np.uint64(F_AGENT | K_ROOT)
        st = (w >> np.uint64(STATE_SHIFT)) & np.uint64(STATE_MASK)
        return bool(np.any(agent & (st != np.uint64(S_FREE))))

    # -- messages ---------------------------------------------------------------------
    def _check(self, h: int) -> None:
        if self._ended(h):
            raise self._stopped(h)

    def _ended(self, h: int) -> bool:
        """Agent ``h`` stopped, finished or failed (its record done or reused, its mailbox
        closed): it takes no more messages."""
        st = self.a.tr.state(h) if h >= 0 else None
        # acquire load of D_HEAD: pairs with the owner's closing CAS
        return (st is None or st[0] == S_DONE
                or bool(self.pool.region.load64(self.dir.entry(h)) & CLOSED))

    @staticmethod
    def _stopped(h: int) -> AgentStopped:
        return AgentStopped(f"agent {h:#x} was stopped, finished or failed; it takes no more "
                            "messages (its ref's result() says how it ended)", h)

    def _deliver(self, h: int, m: int, defer: set[int] | None = None) -> None:
        if not self.dir.push(h, m):
            self.a.free(m)
            self.dir.give_back(h)  # the slot reserved for it
            raise AgentStopped(f"agent {h:#x} was stopped, finished or failed before the "
                               "message arrived", h)
        self.dir.notify(h, defer=defer)

    def _wake(self, owners: set[int]) -> None:
        """Wake each worker a batch of messages went to (call_all), once."""
        idle = self.pool.idle
        for k in owners:
            idle.notify_worker(k)
        owners.clear()

    def _reserve(self, h: int, block: bool, timeout: float | None,
                 defer: set[int] | None = None) -> None:
        d = self.dir
        if d.reserve(h):
            return
        if defer:  # about to wait for room: the batch sent so far must be handled first
            self._wake(defer)
        if not block:
            raise MailboxFull(f"the mailbox of agent {h:#x} is full ({d.count(h)[1]} "
                              "messages); send with block=True to wait, or make it bigger "
                              "with spawn_agent(..., mailbox=N)", h)
        end = None if timeout is None else time.monotonic() + timeout
        while not d.reserve(h):
            self._check(h)
            self.pool.check_open()
            left = 0.05 if end is None else min(0.05, end - time.monotonic())
            if left <= 0:
                raise MailboxFull(f"the mailbox of agent {h:#x} stayed full for {timeout} s",
                                  h)
            d.wait_room(h, left)

    def send(self, h: int, method: str, args: tuple, kwargs: dict, block: bool,
             timeout: float | None, uid: str | None = None) -> None:
        self.pool.check_open()
        self._check(h)
        self._reserve(h, block, timeout)
        try:
            data, bufs = self._journal_msg(uid, h, method, args, kwargs, -1, None)
        except BaseException:
            self.dir.give_back(h)
            raise
        try:
            m = self.alloc("a message")
            off = self.a.setup(m, K_MSG, 0, time.monotonic_ns())
            self.a.put(off, data, bufs)
        except BaseException:
            self.dir.give_back(h)
            raise
        self._deliver(h, m)

    def call(self, h: int, method: str, args: tuple, kwargs: dict,
             deadline: float | None, uid: str | None = None,
             defer: set[int] | None = None) -> _Future:
        return self.calls(((h, uid, deadline),), method, (args,), kwargs, defer)[0]

    def calls(self, targets: Any, method: str, arglists: Any, kwargs: dict | None,
              defer: set[int] | None) -> list[_Future]:
        """One call of ``method`` per target ``(handle, uid, deadline)``, with the
        arguments of ``arglists`` in order: their futures.  A call that fails before its
        message is posted (stopped agent, bad arguments) fails its own future only."""
        pool = self.pool
        pool.check_open()
        # Two steps per call, one native call each with the extension (HotPath.reply_slot,
        # post_msg; else Arena.reply_slot, Directory.post): the reply slot, whose handle the
        # message names, then the message.  What they cannot do goes on in Python: a
        # journaled message (_call_py), no free record, a full mailbox, a payload too big
        # for the record (_post_py).  The method is checked and the locals are looked up
        # once per batch (call_all's rounds: a call cost ~7 µs of client CPU, a fifth of it
        # in encode_message's check and its error text).
        mok = method_ok(method)
        journaled = self.j is not None
        kw = kwargs or None
        ids = pool.ids
        futures = pool.futures
        native = self.native_calls
        if native is not None and mok and not journaled:
            # the same loop in one native call (HotPath.calls): a lockstep round's calls
            # cost ~1 µs less each; what it does not do itself it hands to _call_py and
            # _post_call, as below
            return native(pool, _Future, ids, futures, targets, method, arglists, kw,
                          self._call_py, self._post_call, defer)
        reply_slot = self.a.reply_slot
        out = []
        for (h, uid, deadline), args in zip(targets, arglists):
            f = _Future(pool, next(ids), method)
            rh = (reply_slot(f._st_fid) if h >= 0 and mok and (uid is None or not journaled)
                  else -1)
            if rh < 0:  # no free record (the Python path waits for one), a journaled call,
                # a bad method or handle (it fails the future, saying why)
                out.append(self._call_py(f, h, method, args, kwargs or {}, deadline, uid,
                                         defer))
                continue
            f._st_handle = rh  # cancel() withdraws it (the agent then drops the reply)
            futures[f._st_fid] = f
            out.append(self._post_call(f, h, method, args, kw, deadline, rh, defer))
        return out

    def _post_call(self, f: _Future, h: int, method: str, args: tuple, kw: dict | None,
                   deadline: float | None, rh: int, defer: set[int] | None,
                   data: bytes | None = None, r: int | None = None) -> _Future:
        """:meth:`calls`' second step for one call whose reply slot ``rh`` is set up and
        whose future is registered: the message encoded (unless ``data`` is), posted
        (unless ``r`` is post's result for ``data`` already), and post's result acted on.
        An error that is the call's (a stopped agent, a payload that does not pickle) fails
        this future only."""
        fid = f._st_fid
        try:
            bufs: list = []
            if data is None:  # encode_message's payload (its method checked by the caller)
                data, bufs = serialize.dumps((h, method, args, kw, rh, deadline, None, 0, 0),
                                             f"message {method!r}")
            if r is None:
                r = self.post(h, data) if not bufs and len(data) <= INLINE else POST_FULL
            if r == POST_STOPPED:
                raise self._stopped(h)
            if r in (POST_FULL, POST_NOREC):  # nothing done yet: Python waits
                self._post_py(h, data, bufs, defer)
            elif r != POST_QUIET:
                self.dir.routed(h, r, -1, defer)
        except BaseException as exc:
            if self.pool.futures.pop(fid, None) is not None:
                self.a.release(rh, 1, 0, 0)  # QUEUED -> FREEING -> free (still ours)
            if not isinstance(exc, _CALL_ERRORS):
                raise
            f.set_exception(exc)
        return f

    def _post_py(self, h: int, data: bytes, bufs: list, defer: set[int] | None) -> None:
        """The rest of a native call in Python: a mailbox slot (waiting for room), a
        message record (waiting for one), the payload, the push and the notification."""
        self._check(h)
        self._reserve(h, True, None, defer)
        a = self.a
        try:
            m = self.alloc("a message")
            off = a.setup(m, K_MSG, 0, time.monotonic_ns())
            a.put(off, data, bufs)
        except BaseException:
            self.dir.give_back(h)
            raise
        self._deliver(h, m, defer)

    def _call_py(self, f: _Future, h: int, method: str, args: tuple, kwargs: dict,
                 deadline: float | None, uid: str | None, defer: set[int] | None) -> _Future:
        """:meth:`call` in Python (the reference of the native path; journaled calls)."""
        pool = self.pool
        fid = f._st_fid
        a = self.a
        try:
            self._check(h)
            rh = self.alloc("a reply")
            a.setup(rh, K_ROOT, fid, time.monotonic_ns())  # QUEUED on no queue: the reply slot
            f._st_handle = rh  # cancel() withdraws it (the agent then skips the call)
            if uid is not None and self.j is not None:
                # journaled: the journal holds the message, and a recovery would run it,
                # so the agent runs it even if cancelled: cancel() must say False
                f._st_keep = True
            pool.futures[fid] = f
            try:
                self._reserve(h, True, None, defer)
                try:
                    data, bufs = self._journal_msg(uid, h, method, args, kwargs, rh, deadline)
                except BaseException:
                    self.dir.give_back(h)
                    raise
                m = self.alloc("a message")
                off = a.setup(m, K_MSG, 0, time.monotonic_ns())
                a.put(off, data, bufs)
                self._deliver(h, m, defer)
            except BaseException:
                if pool.futures.pop(fid, None) is not None:
                    a.release(rh, 1, 0, 0)  # QUEUED -> FREEING -> free (still ours)
                raise
        except _CALL_ERRORS as exc:
            f.set_exception(exc)
        return f

    def call_all(self, targets: list[tuple[int, str | None, float | None]], method: str,
                 arglists: list[tuple]) -> list[_Future]:
        """api.call_all from the client: one call per target, each worker woken once."""
        owners: set[int] = set()
        try:
            futs = self.calls(targets, method, arglists, None, owners)
        finally:
            self._wake(owners)  # also for the calls made before an exception
        if len(futs) > 1:
            # one batch: a thread waiting on any of them is woken by the last one's reply
            # (or a worker running out of work), not by each (Settling.wait_for)
            batch = [[f._st_fid for f in futs], len(futs) - 1]  # the ids, a cursor
            for f in futs:
                f._st_batch = batch
        return futs

    # -- agents that failed outside their worker ---------------------------------------
    def abandon(self, h: int, exc: BaseException) -> None:
        """Agent ``h`` failed for good outside its worker (its worker died more often than
        ``retries`` allows, or was killed for a step stuck past its step_timeout): close
        its mailbox, fail the calls waiting there with ``exc``, free its messages and its
        checkpoint.  The caller then publishes the agent's own failure."""
        a = self.a
        d = self.dir
        r = self.pool.region
        head = d.close(h)
        ent = d.entry(h)
        ck = r.load64(ent + D_CKPT)
        mark = a.kind_link(a.off(ck - 1))[2] if ck else 0
        for m in d.older(head, mark) if head else []:
            try:
                reply = message_reply(a.read_call(a.off(m)))
            except BaseException:
                reply = -1
            if reply >= 0:
                self.fail_reply(reply, exc)  # a handled call's slot is gone: the CAS fails
            a.free(m)
        if ck:
            r.store64(ent + D_CKPT, 0)
            a.free(ck - 1)

    def fail_reply(self, rh: int, exc: BaseException) -> None:
        """The client answers reply slot ``rh`` (still QUEUED) with ``exc``."""
        a = self.a
        tr = a.tr
        st = tr.state(rh)
        if st is None:
            return
        kind, _status, link = a.kind_link(a.off(rh))
        if st[0] == S_CANCELLED:
            a.release(rh, S_CANCELLED, 0, 0)
            return
        if kind & K_MASK == K_ROOT:  # a client's call: its future, here
            if a.release(rh, S_QUEUED, 0, 0) is Outcome.OK:
                f = self.pool.futures.pop(link, None)
                if f is not None:
                    self.pool.resolve(f, ST_ERROR, (exc, ""))
            return
        task = task_call_slot(kind)  # a task's call
        if ((task or kind & K_MASK == K_REPLY)
                and tr.cas(rh, S_QUEUED, 0, S_RECOVERING, 0) is Outcome.OK):
            data, bufs = serialize.dumps((exc, ""))
            off = a.off(rh)
            a.put_result(off, data, bufs)
            a.set_status(off, ST_ERROR)
            tr.fail(rh, 0)  # RECOVERING|0 -> DONE|0; seq_cst releases the result
            if task:
                self.pool.pings.ping(link)  # the calling task's frame collects it
            else:
                self.dir.notify(link)  # the calling agent collects it

    def stop(self, h: int) -> None:
        from stealer.shared._layout import AF_STOP, D_FLAGS

        if self.pool.forked:
            raise BrokenExecutor(self.pool.broken)
        if h < 0 or self.a.tr.state(h) is None:
            return  # already finished
        self.pool.region.or64(self.dir.entry(h) + D_FLAGS, AF_STOP)  # seq_cst; read by the owner
        self.dir.notify(h)
