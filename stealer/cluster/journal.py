"""Journals on a cluster: ``Executor(cluster=..., journal=PATH)``, agents that survive the
loss of their node and of the client.

The cluster client is the journal's one writer.  Every durable fact of a cluster agent
passes through it already: its spawn arguments, every message sent to it (in the order its
node runs them: the client numbers the batches), and its state, which the client asks for
every ``state_every`` messages and keeps, with the messages since, to start the agent again
on another node when its node is lost (stealer/cluster/agents.py).  So the journal is that
record made durable, in the local journal's store and format (stealer/agents/journal/:
``open_for_client`` locks the directory and starts an epoch, :class:`Shard` writes the
rows, ``plan`` reads them back), in one shard, ``client.db``:

* ``spawns``: uid ``"<epoch>.<n>"``, name, and ``((cls, args, init_kwargs, options),
  state_every, retries)``; written before the agent exists on any node;
* ``msgs``: each call, send and stop, sender ``"c"`` and the agent's own sequence number
  (it runs on across the client's runs), written *before* the message can reach the node
  (write-ahead: a send returns once its row is committed);
* ``snaps``: each state the client keeps (the periodic STATE calls, a move's evict, and
  one per agent at shutdown), version and ``seen["c"]`` the last message it covers;
* ``ends``: an agent's final value once the client has it (it asks for it at ``stop``).

Recovery (``recover=True``) reads the plan: per agent its spawn, newest snapshot and the
messages after it; each live one starts on a node as after a node loss (spawn, SET_STATE,
the messages in their order, replies nobody waits for dropped).  A message the snapshot
covers is never run again, one it does not cover runs once on the restored state: so each
is applied once to the state the agent ends with (a deterministic agent ends as in a
crash-free run; effects outside its state may repeat: at-least-once).

Why not one journal per node, taken over by a survivor when its node is lost: nodes never
write here, so there is nothing of a lost (or cut-off, still running) node's to fence or
take over, and no directory has to be shared between machines: only the client's.  A node
keeps no durable state at all; the one lock that matters is the client's (``LOCK``, as on
one machine: a second client on a journal held by a live one is refused).  What a node
cut off from the client still does (it fences itself after ``fence_s``) never reaches the
journal, whose next epoch is the new client's.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

from stealer.agents.jblob import loads, pack
from stealer.agents.journal.opening import open_for_client
from stealer.agents.journal.plan import AgentPlan, Plan
from stealer.cluster.ledger import AgentRecord
from stealer.errors import AgentStopped, JournalError, RemoteError
from stealer.shared import serialize

__all__ = ["SENDER", "ClusterJournal", "JournalOnCluster", "recovered", "state_lost"]

SENDER = "c"  # the sender key of the client's messages, in every epoch (seq runs on)


def _pack(obj: Any, what: str) -> tuple[bytes, int]:
    return pack(serialize.dumps(obj, what))


def _who(a: AgentRecord) -> str:
    return f"{a.uid}" + (f" ({a.name!r})" if a.name else "")


class ClusterJournal:
    """The cluster client's handle on its journal: the epoch it writes and the rows."""

    def __init__(self, path: Any, mode: str, nodes: int, recover: bool,
                 aids: Iterator[int]) -> None:
        self.cj, self.plan = open_for_client(path, mode, nodes, recover, kind="cluster")
        self.shard: Any = self.cj.shard
        try:  # (before any node agent starts: a journal that does not load starts none)
            self.records = list(recovered(self.plan, aids))
        except Exception as exc:
            self.close()
            raise JournalError(f"the agents of the journal {self.cj.path} cannot be "
                               f"recovered here: {type(exc).__name__}: {exc} (their classes "
                               "and arguments must import in this client)") from exc
        self.spawned = 0  # agents spawned in this epoch (their uids: "<epoch>.<n>")
        # name -> uid, every epoch's (names are unique per journal)
        self.names = {p.name: uid for uid, p in self.plan.agents.items()
                      if p.name is not None and p.spawn is not None}

    @property
    def path(self) -> str:
        return self.cj.path

    def spawn(self, a: AgentRecord) -> None:
        """The spawn row of a new agent (under the client's lock): gives it its uid."""
        if a.name is not None and a.name in self.names:
            raise ValueError(f"the journal {self.path} already has an agent named "
                             f"{a.name!r} (names are unique per journal; ex.agent(name) "
                             "finds it)")
        cls = a.spawn[0]
        body, oob = _pack((a.spawn, a.every, a.retries),
                          f"agent {getattr(cls, '__qualname__', cls)!r} and its arguments")
        uid = f"{self.cj.epoch}.{self.spawned + 1}"
        self.shard.spawn(uid, a.name, None, f"{cls.__module__}.{cls.__qualname__}", body, oob)
        self.spawned += 1
        a.uid = uid
        if a.name is not None:
            self.names[a.name] = uid

    def msg(self, a: AgentRecord, seq: int, kind: str, arg: Any) -> None:
        """Message #seq to ``a`` (call, send, stop), before it can reach its node."""
        body, oob = _pack((kind, arg), f"message to agent {_who(a)}")
        self.shard.msg(a.uid, SENDER, seq, kind == "call", body, oob)

    def snap(self, a: AgentRecord, covers: int, state: Any) -> None:
        """A state of ``a`` kept by the client: the effect of its messages up to #covers."""
        body, oob = _pack(state, f"state of agent {_who(a)}")
        self.shard.snap(a.uid, covers, a.losses, 0, {SENDER: covers}, body, oob)

    def end(self, a: AgentRecord, ok: bool, value: Any) -> None:
        """``a`` is over: its final value (``ok``), or the error it ended with."""
        try:
            body, oob = _pack(value, f"final value of agent {_who(a)}")
        except Exception as e:  # (a value that does not pickle: its text is kept)
            ok, value = False, RemoteError(f"the final value of agent {_who(a)} could not "
                                           f"be kept: {e}")
            body, oob = _pack(value, "error")
        self.shard.end(a.uid, 0 if ok else 1, body, oob)

    def close(self) -> None:
        if self.shard is not None:
            self.shard = None
            self.cj.close()  # (once: it closes the lock's fd)


def recovered(plan: Plan, aids: Iterator[int]) -> Iterator[AgentRecord]:
    """The client's records of a journal's agents (``aids``: the ids they get): a live
    one with its newest state and the messages after it in ``log`` ([seq, None, kind,
    arg], for :meth:`AgentsOnCluster._start_again`); a finished one ``over``, its final
    value in ``result``."""
    for uid in sorted(plan.agents, key=_uid_key):
        p: AgentPlan = plan.agents[uid]
        if p.spawn is None:
            continue
        spawn, every, retries = loads(*p.spawn)
        a = AgentRecord(next(aids), spawn, p.name, retries)
        a.uid, a.every = uid, every
        if p.end is not None:
            a.over = True
            a.failed = AgentStopped(f"agent {uid}" + (f" ({p.name!r})" if p.name else "")
                                    + " had finished before this recovery; its result() "
                                    "is kept")
            a.result = Future()
            status, body, oob = p.end
            try:
                value = loads(body, oob)
            except Exception as exc:
                status, value = 1, JournalError(f"the final value of agent {uid} in the "
                                                f"journal does not load: {exc}")
            if status:
                a.result.set_exception(value)
            else:
                a.result.set_result(value)
            yield a
            continue
        if p.snap is not None:
            a.state, a.has_state = loads(p.snap["body"], p.snap["oob"]), True
            a.state_seq = int(p.snap["seen"].get(SENDER, 0))
        a.seq = a.state_seq
        for body, oob, _sender, seq in sorted(p.msgs, key=lambda m: m[3]):
            kind, arg = loads(body, oob)
            a.log.append([seq, None, kind, arg])
            a.seq = max(a.seq, seq)
            a.over = a.over or kind == "stop"
        yield a


def _uid_key(uid: str) -> tuple[int, ...]:
    return tuple(int(x) if x.isdigit() else 0 for x in uid.split("."))


def state_lost(a: AgentRecord, exc: BaseException) -> BaseException | None:
    """A STATE call of a journaled agent failed: the error its calls fail with from now
    (its state does not pickle: it cannot be kept durable), or None (it had ended: its
    final value says how)."""
    if isinstance(exc, AgentStopped):
        return None
    return JournalError(f"the state of journaled agent {_who(a)} could not be kept "
                        f"({type(exc).__name__}: {exc}); a journaled agent's state must "
                        "pickle (its __getstate__(), else its __dict__)")


class JournalOnCluster:
    """The journal's side of the cluster executor (a mixin: ``self`` is the executor,
    whose lock, records and agent methods, stealer/cluster/agents.py, it uses)."""

    _lock: Any
    _tids: Any
    _agents: dict[int, AgentRecord]
    _names: dict[str, AgentRecord]
    _nodes: dict[str, Any]
    _stats: Any
    _journal: ClusterJournal | None = None
    _suspended = False

    def _recover_journal(self) -> int:
        """``recover=True``: every agent of the journal, the live ones started on nodes
        from their newest state and the messages after it.  How many were started."""
        j = self._journal
        assert j is not None
        n = 0
        with self._lock:
            for a in j.records:
                self._agents[a.aid] = a
                if a.name is not None:
                    self._names[a.name] = a
                if a.result is not None:  # finished: its final value is kept
                    continue
                self._start_again(a, [])  # type: ignore[attr-defined]
                if a.over:  # a stop among its messages: its final value goes in the journal
                    self._ask_result(a)
                n += 1
            self._stats.recovered = n
        return n

    def _ask_result(self, a: AgentRecord) -> None:
        """The agent's final value is asked for (under the lock); journaled, it goes into
        the journal when it comes."""
        a.result = self._agent_op(a, "result", None)  # type: ignore[attr-defined]
        a.result.add_done_callback(lambda _f: setattr(a, "over", True))
        if a.uid is not None:
            a.result.add_done_callback(functools.partial(self._journal_end, a))

    def _journal_end(self, a: AgentRecord, fut: Future) -> None:
        if fut.cancelled() or self._journal is None:
            return
        exc = fut.exception()
        try:
            self._journal.end(a, exc is None, fut.result() if exc is None else exc)
        except Exception as e:  # (the journal closed at shutdown, a full disk)
            _complain(f"the journal (the end of agent {_who(a)})", e)

    def _journal_state(self, a: AgentRecord, covers: int) -> None:
        """The state just kept of ``a`` (under the lock), as its snapshot."""
        try:
            self._journal.snap(a, covers, a.state)  # type: ignore[union-attr]
        except Exception as e:
            _complain(f"the journal (a snapshot of agent {_who(a)})", e)

    def _unkept(self, a: AgentRecord, exc: BaseException) -> None:
        """A STATE call of journaled ``a`` failed (under the lock): an agent that had
        ended is asked for its final value; one whose state does not pickle cannot be
        durable: it is stopped, and its calls fail with a JournalError (as on one
        machine), which the journal keeps as its end."""
        err = state_lost(a, exc)
        if err is None:
            if a.result is None:
                self._ask_result(a)
            return
        self._agent_op(a, "stop", None)  # type: ignore[attr-defined]
        a.failed, a.over = err, True
        try:
            self._journal.end(a, False, err)  # type: ignore[union-attr]
        except Exception as e:
            _complain(f"the journal (the end of agent {_who(a)})", e)

    def _suspend(self) -> None:
        """At shutdown: the state of every journaled agent with messages since its last
        one is asked for (and kept as its snapshot when it comes), so a recovery replays
        nothing; their batches go at once."""
        if self._journal is None or self._suspended:
            return
        self._suspended = True
        with self._lock:
            for a in self._agents.values():
                n = a.node
                if (a.uid is not None and a.every and a.failed is None and not a.over
                        and a.moving is None and a.seq > a.state_seq and n is not None
                        and n.alive):
                    self._ask_state(a)  # type: ignore[attr-defined]
            nodes = [n for n in self._nodes.values() if n.pending]
        for n in nodes:
            self._send(n)  # type: ignore[attr-defined]

    def _close_journal(self) -> None:
        if self._journal is not None:
            self._journal.close()


def _complain(who: str, exc: BaseException) -> None:
    import sys

    print(f"stealer.cluster: {who}: {type(exc).__name__}: {exc}", file=sys.stderr)
