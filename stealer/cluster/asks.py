"""Agents of a cluster executor reached from inside other agents and tasks.

A :class:`~stealer.cluster.agents.ClusterAgentRef` lives in the driver (it holds the
executor).  Pickled into a task's arguments or an agent's message it travels as
``(aid, name, token)`` and is loaded again as:

* in the driver whose executor (``token``) has that agent: the executor's own ref;
* anywhere else, a worker of a node executor above all: a :class:`RemoteAgentRef`, whose
  operations take this path: the worker (a call: from a blocking thread of the agent's
  host, ``ctx.run_blocking``'s pool, so the worker runs other agents meanwhile and the
  calling agent is resumed with the reply) -> its node agent (:class:`AskServer`, a Unix
  socket whose path and key the node agent puts in its workers' environment, ``ENV_PATH``
  and ``ENV_KEY``) -> the client (in the node's results stream, acknowledged and sent
  again after a lost reply, as results are) -> the agent's node as any call of the client
  (so moves, restarts after a node loss and the journal apply) -> the reply back the same
  way (``NodeAgent.answers``).

A round trip costs a few milliseconds (two Ray calls and a results poll): agents that talk
a lot belong on one node.  Order: one worker thread's sends arrive in the order it made
them (each returns once its node agent has it); calls wait on a thread pool, so calls
yielded together (``yield [r.call(...), r.call(...)]``) may reach one agent in either
order.  Cycles: a call made from an agent's generator or coroutine names its caller (its
handle here, which the node agent turns into the client's agent id), and the client, which
sees every such call, refuses one that closes a cycle of waiting agents with
errors.AgentDeadlock, raised at the caller's ``yield``/``await``.  Calls between an agent
and the agents it spawned itself on its node (local refs) are the local check's.

Imported by the client side (cluster/agents.py, node.py) and, through pickle, by workers: it
imports neither side and never Ray.
"""

from __future__ import annotations

import itertools
import os
import pickle
import socket
import threading
import weakref
from collections.abc import Callable
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

from stealer.errors import ClusterError, NotInTaskError

__all__ = ["ENV_KEY", "ENV_PATH", "AskServer", "RemoteAgentRef", "accept_loop", "dumps", "rebuild",
           "register", "unregister"]

ENV_PATH = "STEALER_CLUSTER_ASKS"  # the node agent's socket, in its workers' environment
ENV_KEY = "STEALER_CLUSTER_ASKS_KEY"  # its authentication key (hex), likewise
ASK_TIMEOUT_S = 0.5  # how often a serving thread waiting for an answer looks at close()

# the live cluster executors of this process, by token (ClusterExecutor.__init__): a ref
# loaded back in the driver becomes that executor's own ref again
_LIVE: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()


def register(token: str, ex: Any) -> None:
    """A cluster executor of this process, found by ``token`` when a ref is loaded here."""
    _LIVE[token] = ex


def unregister(token: str) -> None:
    """The executor ``token`` shut down: refs loaded here no longer find it."""
    _LIVE.pop(token, None)


def rebuild(aid: int, name: str | None, token: str, uid: str | None = None) -> Any:
    """A pickled cluster agent ref loaded: the executor's own ref where it runs, else a
    :class:`RemoteAgentRef`.  ``uid``: a journaled agent's durable id, by which an executor
    that recovered the journal (another token, other ids) finds it."""
    ex = _LIVE.get(token)
    if ex is not None:
        ref = ex._ref_of(aid)
        if ref is not None:
            return ref
    if uid is not None:
        for ex in list(_LIVE.values()):
            ref = ex._ref_of_uid(uid)
            if ref is not None:
                return ref
    return RemoteAgentRef(aid, name, token, uid)


def dumps(obj: Any) -> bytes:
    import cloudpickle

    return cloudpickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


# this thread's connection to its node agent (_ask): (pid, path, Connection), kept, since
# a new one per operation cost ~0.7 ms (connect, the key's handshake, a server thread)
_local = threading.local()


def _connection(path: str, key: str) -> Connection:
    held = getattr(_local, "held", None)
    if held is not None and held[0] == os.getpid() and held[1] == path:
        return held[2]
    conn = Client(path, family="AF_UNIX", authkey=bytes.fromhex(key))
    _local.held = (os.getpid(), path, conn)  # (a forked child makes its own)
    return conn


def _drop() -> None:
    """Forget this thread's connection (after an error, or an exception that may have
    left a reply unread in it): the next operation opens a new one."""
    held = getattr(_local, "held", None)
    _local.held = None
    if held is not None and held[0] == os.getpid():
        try:
            held[2].close()
        except OSError:
            pass


def _ask(op: str, payload: bytes, who: int | None = None) -> Any:
    """The worker's end: one operation to its node agent, on this thread's connection (a
    call waits on it for the reply).  Returns the reply, or raises its error.  ``who``: the
    calling agent's handle on this node when it waits for the reply (a call from its
    generator or coroutine), for the client's cycle check (AgentsOnCluster._asked)."""
    path, key = os.environ.get(ENV_PATH), os.environ.get(ENV_KEY)
    if not path or not key:
        raise ClusterError("a cluster agent ref is used outside the nodes of its cluster "
                           "executor: call it from the driver, or from a task or agent "
                           "of that executor")
    try:
        conn = _connection(path, key)
        conn.send((op, payload, who))
        ok, body = conn.recv()
    except (OSError, EOFError) as exc:
        _drop()
        raise ClusterError(f"this node's node agent is gone ({type(exc).__name__}: {exc}): "
                           "the node is being shut down or was cut off from its client; the "
                           f"{op} did not reach the agent") from exc
    except BaseException:  # (a signal's exception mid-exchange: its reply may be unread)
        _drop()
        raise
    value = pickle.loads(body)
    if ok:
        return value
    raise value  # (the exception the client's future got, its remote traceback chained)


class RemoteAgentRef:
    """A cluster executor's agent, from a task or an agent of that executor (on any node):
    ``call`` (inside an agent: ``yield`` it; resumed with the reply), ``send`` and
    ``stop``.  ``result()`` is the driver's (``ex.agent(name)``, or the ref it holds)."""

    __slots__ = ("_aid", "_name", "_token", "_uid")

    def __init__(self, aid: int, name: str | None, token: str, uid: str | None = None) -> None:
        self._aid = aid
        self._name = name
        self._token = token  # the executor that made it (ids are per executor)
        self._uid = uid  # journaled: the durable id (a recovering executor finds it by it)

    @property
    def id(self) -> int:
        return self._aid

    @property
    def name(self) -> str | None:
        return self._name

    def __reduce__(self) -> tuple:
        return (rebuild, (self._aid, self._name, self._token, self._uid))

    def __repr__(self) -> str:
        return f"<stealer RemoteAgentRef {self._aid}>"

    def __eq__(self, other: object) -> bool:
        return (getattr(other, "id", None) == self._aid
                and getattr(other, "_token", None) == self._token)

    def __hash__(self) -> int:
        return hash((self._aid, self._token))

    def _payload(self, op: str, method: str | None, args: tuple, kwargs: dict) -> bytes:
        from stealer.agents.message import method_ok

        if op != "stop" and not method_ok(method):
            raise ValueError(f"a message names a public method of the agent, not {method!r}")
        return dumps((self._aid, op, method, args, kwargs, self._token, self._uid))

    def call(self, method: str, /, *args: Any, **kwargs: Any) -> Any:
        """Request/reply: inside an agent, ``yield`` (or ``await``) what it returns; in a
        task, ``result()`` it (or ``yield`` it in a generator task)."""
        from stealer import forkjoin

        w = forkjoin._current
        host = getattr(w, "host", None)
        if host is None:
            raise NotInTaskError("a cluster agent is called from the driver (on the ref "
                                 "spawn_agent returned, or ex.agent(name)), or in a task or "
                                 "an agent of its executor")
        e = host.current
        if e is None:  # a task's: a child it yields or joins (result())
            return host.task_blocking(_ask, ("call", self._payload("call", method, args,
                                                                   kwargs), None))
        who = e.h if e.it is not None else None  # (from a generator: it may wait: F_AWAITED)
        return host.run_blocking(_ask, ("call", self._payload("call", method, args, kwargs),
                                        who), {})

    def send(self, method: str, /, *args: Any, **kwargs: Any) -> None:
        """One-way message (its handler's errors are not reported back); returns once the
        node agent has it."""
        _ask("send", self._payload("send", method, args, kwargs))

    def stop(self) -> None:
        """Stop the agent at its next step boundary."""
        _ask("stop", self._payload("stop", None, (), {}))

    def result(self, timeout: float | None = None) -> Any:
        raise ClusterError("an agent's final value is read in the driver (the ref it holds, "
                           "or ex.agent(name)), not in a task or agent")


def accept_loop(listener: Listener, closed: Callable[[], bool],
                serve: Callable[[Connection], None], name: str) -> None:
    """A node agent's socket server (AskServer, children.ChildServer): each connection
    served by a thread of its own, until ``closed()`` (the listener closed under it)."""
    while not closed():
        try:
            conn = listener.accept()
        except Exception:
            if closed():
                return
            continue
        threading.Thread(target=serve, args=(conn,), name=name, daemon=True).start()


class AskServer:
    """The node agent's end: one thread accepting, one per connection.  ``ask(key, op,
    payload, who)`` hands an operation to the node agent (for the client; ``who``: the
    local handle of an agent waiting for the call's reply, else None); a call's thread then
    waits for :meth:`answer` with the same key, a send's or stop's answers at once."""

    def __init__(self, directory: str,
                 ask: Callable[[int, str, bytes, int | None], None]) -> None:
        self.ask = ask
        self.authkey = os.urandom(16)
        self.path = os.path.join(directory, "asks.sock")
        self.lock = threading.Lock()
        self.waiting: dict[int, list] = {}  # key -> [Event, (ok, body) or None] (under lock)
        self.keys = itertools.count(1)
        self.closed = False
        self.asked = 0  # operations received (status)
        # the workers' threads' connections waiting for their next operation (under lock):
        # close() shuts them down, which wakes their serving threads
        self.idle: set[Connection] = set()
        self.listener = Listener(self.path, family="AF_UNIX", authkey=self.authkey)
        threading.Thread(target=self._accept, name="stealer-asks-accept", daemon=True).start()

    def env(self) -> dict[str, str]:
        """What the node's workers need in their environment to reach this server."""
        return {ENV_PATH: self.path, ENV_KEY: self.authkey.hex()}

    def answer(self, key: int, ok: bool, body: bytes) -> None:
        """The client's reply to call ``key`` (a call whose worker is gone: dropped)."""
        with self.lock:
            slot = self.waiting.pop(key, None)
        if slot is not None:
            slot[1] = (ok, body)
            slot[0].set()

    def close(self) -> None:
        """Stop serving: waiting calls fail (their agents see the error at their yield)."""
        with self.lock:
            self.closed = True
            slots, self.waiting = list(self.waiting.values()), {}
            conns = list(self.idle)
        body = dumps(ClusterError("the node agent stopped before the reply came"))
        for slot in slots:
            slot[1] = (False, body)
            slot[0].set()
        try:
            self.listener.close()
        except Exception:
            pass
        for conn in conns:  # its thread in recv() wakes with EOF (a close() would not)
            try:
                with socket.fromfd(conn.fileno(), socket.AF_UNIX, socket.SOCK_STREAM) as sk:
                    sk.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # (closed meanwhile by its thread)

    def _accept(self) -> None:
        accept_loop(self.listener, lambda: self.closed, self._serve, "stealer-asks")

    def _serve(self, conn: Connection) -> None:
        """One worker thread's connection: its operations, one after another, until it
        closes (its process ended) or this server does."""
        try:
            while True:
                with self.lock:  # (close() sees it idle here, or it sees close())
                    if self.closed:
                        return
                    self.idle.add(conn)
                try:
                    msg = conn.recv()
                finally:
                    with self.lock:
                        self.idle.discard(conn)
                if not self._one(conn, *msg) or self.closed:
                    return  # (a call's "stopped" answer went out first)
        except (EOFError, OSError):
            pass
        finally:
            conn.close()

    def _one(self, conn: Connection, op: str, payload: bytes, who: int | None) -> bool:
        """Serve one operation; False once the server is closed."""
        key = next(self.keys)
        slot: list = [threading.Event(), None]
        with self.lock:
            if self.closed:
                conn.send((False, dumps(ClusterError("the node agent stopped"))))
                return False
            self.asked += 1
            if op == "call":
                self.waiting[key] = slot
        self.ask(key, op, payload, who)
        if op != "call":
            conn.send((True, dumps(None)))
            return True
        while not slot[0].wait(ASK_TIMEOUT_S):
            if self.closed:
                break
        conn.send(slot[1] if slot[1] is not None else
                  (False, dumps(ClusterError("the node agent stopped"))))
        return True
