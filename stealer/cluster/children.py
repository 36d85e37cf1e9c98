"""Fork-join children stolen across nodes: exported at spawn, run elsewhere, joined at home.

A task's children (``stealer.spawn`` inside a task, joined by ``yield`` or ``stealer.join``)
live in its node executor's shared memory, where only that node's workers can take them.
To let an idle node share a tree started on another, a node that has hungry peers turns
some spawns into *exported* children:

* **Export at spawn** (worker side, :class:`WorkerLink`, installed in every worker of a
  node executor by its initializer): a spawn within ``child_depth`` (3) of its tree's root
  on this node, or any spawn while the node agent's *want* flag is up, sends the call to the
  node agent (one message on a Unix socket, keyed by the worker's pid and a counter) and
  spawns instead a local child :func:`proxy` carrying the same call.  The parent joins the
  proxy as any child.  A tree's shallow spawns are its largest pieces: exporting them
  always (14 messages for a binary tree) lets a thief get the oldest of them, as Satin's
  steals from the top of a deque do, which a flag raised later could not.
* **Claimed once** (node agent side, :class:`ChildTable`, pure Python): an exported child
  is PENDING until either a worker of its own node starts its proxy (the proxy *claims*
  it and runs the call itself, delegating a generator by ``yield from``: its children fork
  locally as usual) or a hungry peer gets it (SHIPPED: a steal reply or a push, oldest
  first, since the oldest spawns of a tree are its largest).  The node agent serialises
  the two.
* **Run on the thief** as a task of its node executor (:func:`imported`, which forks there
  on every worker of that node), and **reported back to the parent's node** (the node
  agent's ``child_results``), which settles the entry; a proxy that started meanwhile waits
  for it, and while it waits runs children other nodes sent here, as part of its own task
  (their children fork on this node as usual), so two nodes waiting on each other's
  children always make progress (no deadlock: a helping join across nodes).
* **Node loss**: a thief lost (dropped from the peers the client sends, or a push that
  failed) sends its SHIPPED children back to PENDING: a waiting proxy then runs the call
  itself (at-least-once); a late result of a child already claimed again, or settled, is
  dropped, so the parent sees one value per child.  The parent's node lost: the thieves
  drop its children not started, and the results of the others go nowhere (its root task
  runs again elsewhere, as every task of a lost node does).

When to ship: only to a node that says it is hungry now (a lifeline: a thief that failed
its attempts, or a node whose proxy waits on a child it sent there with nothing to help
with), the oldest pending children first, one per free worker of it (:func:`hungry`, less
what is already out there), and only children that have been pending for
``StealConfig.child_age_rtts`` (2) round trips of a moved child (the node agent measures
them: each result's time out less the time its thief held it; ~3 ms on the 2-node test
cluster), so a tree smaller than the trip is claimed back by its own workers first
(measured: one fib(20) tree of 1.2 ms took 22 ms with its children moving at once, 8.8 ms
with the rule, 5.6 ms with no stealing; fib(26), 17 ms of work: 45, 27 and 23 ms).

The want flag (deeper spawns exported too, down to ``want_depth``, 5) is up while some
peer has room by its load report or a lifeline, and this node has nothing queued. The flag
exported every spawn before: traced on one fib(33) tree (cutoff 18) over two 1-worker
nodes, the last third of the run was then an exchange of ever smaller children
(fib(17)-fib(23), 0.1-2 ms of work each) over round trips of 2-10 ms, each node's proxies
waiting in turn on the other's; each node's worker was busy ~0.27 s of a 0.36-0.44 s tree.
Nine trees a run, the median (one node alone: ~0.50 s): every spawn 0.44 and 0.39 s, down
to depth 9 0.38 and 0.38 s, 7 0.36 and 0.34 s, 5 0.33 and 0.33 s, 3 (no deeper export)
0.33 and 0.34 s. A limit found by timing each depth's children (the proxies that ran their
call here reporting its run time) was tried and dropped: 0.37-0.41 s, no better than none;
likely (not traced) because a proxy's run time includes its waits on children moved away,
so small ones measure large. A busy cluster exports only the shallow spawns, claimed back
by their own proxies (one round trip on the socket each), and the spawn path costs one
flag read and a walk of at most ``child_depth`` record links (``want_depth`` while the
flag is up).

Limits: a proxy whose child is out holds its worker while it has nothing to help with
(a worker cannot leave a task for other work of its deque without the core's join
machinery knowing of remote children): with one worker per node, the parent's node idles
until the result comes or the other node sends it children.  A child runs on the thief as
a root task of that node (its stats count it as a task there, not the client's).

Called by the node agent (``stealer/cluster/node.py``); the worker side runs inside the
node executor's workers (its initializer :func:`install`, and ``stealer.forkjoin.spawn``,
which calls the installed link).  No Ray here.
"""

from __future__ import annotations

import itertools
import math
import mmap
import os
import pickle
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from multiprocessing.connection import Client, Connection, Listener
from types import GeneratorType
from typing import Any

from stealer.cluster.asks import accept_loop
from stealer.cluster.policy import Load
from stealer.shared._layout import K_CHILD, K_MASK
from stealer.shared.serialize import cacheable
from stealer.shared.shm import _alive  # (another user's pid counts as alive: not ours)

__all__ = ["ChildServer", "ChildTable", "WorkerLink", "hungry", "imported", "install", "proxy",
           "room", "TAKEN"]

TAKEN = ("stealer-child-taken",)  # an imported child that a waiting proxy ran instead
WANT_CAP = 1  # exported children out (pending or shipped) per free worker of a hungry peer


def hungry(peers: Iterable[Load], lifelines: Iterable[str], shipped: dict[str, int],
           cap: int = WANT_CAP) -> dict[str, int]:
    """The children each hungry peer may take now: ``cap`` per free worker (nothing
    queued; free workers = workers - running + waiting, its proxies waiting on other nodes
    counted free), less the children already shipped to it and not back (its load report
    may be older than them); a lifeline thief (fresher evidence than a load report: it
    has a free worker now) may take ``cap`` whatever was shipped to it before, since a
    child shipped there may be what its worker is blocked in, waiting on a child of ours
    (measured: one fib(33) tree over two 1-worker nodes left one of them idle 200 ms of
    0.86 s that way, its lifeline unanswered until the child it waited under came back).
    Only peers with room > 0, the most room first."""
    out: dict[str, int] = {}
    for p in peers:
        free = p.workers - p.running + p.waiting if p.queued == 0 else 0
        if free > 0:
            out[p.node] = cap * free - shipped.get(p.node, 0)
    for t in lifelines:
        out[t] = max(out.get(t, 0), cap)
    return dict(sorted(((n, r) for n, r in out.items() if r > 0), key=lambda x: -x[1]))


def room(peers: Iterable[Load], lifelines: Iterable[str], shipped: dict[str, int],
         cap: int = WANT_CAP) -> int:
    """How many exported children may be pending now: what the hungry peers may take."""
    return sum(hungry(peers, lifelines, shipped, cap).values())


@dataclass
class _Export:
    payload: tuple  # (the function's pickle, the pickled (args, kwargs)): see _fn_bytes
    born: float = 0.0  # time.monotonic() when it was exported
    sent: float = 0.0  # ... when it was last SHIPPED
    node: str | None = None  # SHIPPED to this node; None: PENDING
    done: tuple[bool, Any] | None = None  # (ok, value) once a result came


class ChildTable:
    """A node agent's exported children (by key) and imported ones (by (origin, key)).

    Pure state, no threads or locks (the caller holds one).  Export states: PENDING
    (``node`` None), SHIPPED (``node`` set), DONE (``done`` set, until its proxy takes it);
    an entry leaves when its proxy claimed it (runs it locally) or took its result."""

    def __init__(self) -> None:
        self.exports: OrderedDict[Any, _Export] = OrderedDict()  # oldest first
        self.early: set[Any] = set()  # claimed before their export arrived (ignored then)
        self.imports: OrderedDict[tuple[str, Any], bytes] = OrderedDict()  # not started
        self.n = {"exported": 0, "local": 0, "shipped": 0, "returned": 0, "dropped": 0,
                  "rerun": 0, "imported": 0, "helped": 0, "declined": 0}

    # -- exported children (this node is the parent's) --------------------------------------
    def add(self, key: Any, payload: bytes, now: float = 0.0) -> None:
        if key in self.early:  # its proxy already ran it here
            self.early.discard(key)
            return
        self.exports[key] = _Export(payload, now)
        self.n["exported"] += 1

    def pending(self, born_by: float = math.inf) -> int:
        """PENDING children exported at ``born_by`` or before."""
        return sum(1 for e in self.exports.values()
                   if e.node is None and e.done is None and e.born <= born_by)

    def oldest_pending(self, after: float = -math.inf) -> float | None:
        """When the oldest PENDING child exported after ``after`` was (None: none)."""
        return next((e.born for e in self.exports.values()
                     if e.node is None and e.done is None and e.born > after), None)

    def shipped(self) -> dict[str, int]:
        """Children out on each node, not back yet."""
        out: dict[str, int] = {}
        for e in self.exports.values():
            if e.node is not None and e.done is None:
                out[e.node] = out.get(e.node, 0) + 1
        return out

    def claim(self, key: Any) -> tuple:
        """A proxy started: ("run",) it runs the call itself; ("done", ok, value) the
        result is here; ("wait",) it is out on another node."""
        e = self.exports.get(key)
        if e is None:  # its export message is still on its way (another connection)
            self.early.add(key)
            self.n["local"] += 1
            return ("run",)
        if e.done is not None:
            del self.exports[key]
            return ("done", *e.done)
        if e.node is None:
            del self.exports[key]
            self.n["local"] += 1
            return ("run",)
        return ("wait",)

    def ship(self, node: str, count: int, born_by: float = math.inf,
             now: float = 0.0) -> list[tuple[Any, bytes]]:
        """Up to ``count`` PENDING children exported at ``born_by`` or before, oldest
        first, now SHIPPED to ``node`` (at ``now``)."""
        out = []
        for key, e in self.exports.items():
            if len(out) >= count or e.born > born_by:  # (oldest first: none after is older)
                break
            if e.node is None and e.done is None:
                e.node = node
                e.sent = now
                out.append((key, e.payload))
        self.n["shipped"] += len(out)
        return out

    def sent_at(self, key: Any) -> float | None:
        """When a SHIPPED child not back yet was shipped (None: it is not such a child)."""
        e = self.exports.get(key)
        return e.sent if e is not None and e.node is not None and e.done is None else None

    def result(self, key: Any, ok: bool, value: Any) -> bool:
        """A thief's result; False when dropped (claimed again here, or settled before)."""
        e = self.exports.get(key)
        if e is None or e.done is not None:
            self.n["dropped"] += 1
            return False
        e.done = (ok, value)
        self.n["returned"] += 1
        return True

    def unship(self, keys: Iterable[Any], declined: bool = False) -> int:
        """A push that failed, or ``declined`` by a thief that had no worker free when
        they came: those children are PENDING again (if still out)."""
        n = 0
        for key in keys:
            e = self.exports.get(key)
            if e is not None and e.node is not None and e.done is None:
                e.node = None
                n += 1
        self.n["declined" if declined else "rerun"] += n
        return n

    def lost(self, node: str) -> int:
        """``node`` is gone: its children not back are PENDING again (at-least-once: a
        waiting proxy runs the call itself), and the children it sent here and that did
        not start are dropped (their parent is gone with it)."""
        back = self.unship([k for k, e in self.exports.items() if e.node == node])
        for ik in [ik for ik in self.imports if ik[0] == node]:
            del self.imports[ik]
        return back

    # -- imported children (another node's) ---------------------------------------------------
    def add_imports(self, origin: str, items: Iterable[tuple[Any, bytes]]) -> list[tuple]:
        keys = []
        for key, payload in items:
            self.imports[(origin, key)] = payload
            keys.append((origin, key))
        self.n["imported"] += len(keys)
        return keys

    def take_import(self, ikey: tuple | None = None) -> tuple[tuple, bytes] | None:
        """The import ``ikey`` (None: the oldest) if nobody started it yet, now started."""
        if ikey is None:
            if not self.imports:
                return None
            ikey = next(iter(self.imports))
        payload = self.imports.pop(ikey, None)
        return None if payload is None else (ikey, payload)


# -- the node agent's end of the workers' links -------------------------------------------------

DIR_PREFIX = "stealer-children-"


def make_dir() -> str:
    """A private directory for a node agent's socket and flag, named with its pid; first
    removes those of node agents that died without cleaning up (a node removed under
    them: SIGKILL), as the snapshots of dead clients are (stealer/cluster/snapshot.py)."""
    import shutil
    import tempfile

    base = tempfile.gettempdir()
    for name in os.listdir(base):
        if not name.startswith(DIR_PREFIX):
            continue
        pid = name[len(DIR_PREFIX):].partition("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(os.path.join(base, name), ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"{DIR_PREFIX}{os.getpid()}-")


class ChildServer:
    """Serves the node executor's workers: exports, claims, waits, imports.  Threads: one
    accepting, one per worker connection.  ``want`` is a one-byte flag file the workers
    map; ``hook`` is called (without the lock) after each export and claim, ``back`` with
    each result of an imported child run inline by a waiting proxy, ``hungry(node)`` when
    a proxy starts waiting on ``node`` with nothing to help with (a lifeline to it: that
    node's load reports reach us late)."""

    def __init__(self, directory: str, back: Callable[[tuple, bool, Any], None],
                 hook: Callable[[], None], hungry: Callable[[str], None],
                 fid_of: Callable[[Any], int] | None = None) -> None:
        self.table = ChildTable()
        # the node executor's function table id of a function given as its pickle (-1:
        # none), so that an imported child's own spawns name it by id (_local)
        self.fid_of = fid_of
        self.fids: dict[bytes, int] = {}
        self.hungry = hungry
        self.lock = threading.Lock()
        self.cv = threading.Condition(self.lock)
        self.back = back
        self.hook = hook
        self.waiting = 0  # proxies waiting on another node's result (under lock)
        self.closed = False
        self.authkey = os.urandom(16)
        self.path = os.path.join(directory, "children.sock")
        self.want_path = os.path.join(directory, "want")
        with open(self.want_path, "wb") as f:
            f.write(b"\0" * 8)
        fd = os.open(self.want_path, os.O_RDWR)
        try:
            # byte 0: the want flag. Written by this node agent only (plain store, in
            # set_want); read by its workers at each spawn (plain load, WorkerLink.wanted).
            # A stale read exports one child more or fewer: no ordering is needed.
            self.want_mm = mmap.mmap(fd, 8)
        finally:
            os.close(fd)
        self.listener = Listener(self.path, family="AF_UNIX", authkey=self.authkey)
        threading.Thread(target=self._accept, name="stealer-children-accept",
                         daemon=True).start()

    def set_want(self, on: bool) -> None:
        if not self.closed:
            self.want_mm[0] = 1 if on else 0

    def close(self) -> None:
        with self.lock:
            self.closed = True
            self.cv.notify_all()
        try:
            self.want_mm[0] = 0
            self.listener.close()
        except Exception:
            pass

    def _accept(self) -> None:
        accept_loop(self.listener, lambda: self.closed, self._serve, "stealer-children")

    def _serve(self, conn: Connection) -> None:
        try:
            while not self.closed:
                msg = _recv(conn)
                op = msg[0]
                if op == "x":
                    with self.lock:
                        self.table.add(msg[1], msg[2], time.monotonic())
                    self.hook()
                elif op == "c":
                    with self.lock:
                        ans = self.table.claim(msg[1])
                    _send(conn, ans)
                    self.hook()
                elif op == "w":
                    _send(conn, self._wait(msg[1]))
                elif op == "h":
                    self.back(msg[1], msg[2], msg[3])
                elif op == "i":
                    with self.lock:
                        got = self.table.take_import(msg[1])
                    _send(conn, None if got is None else self._local(got[1]))
        except (EOFError, OSError):
            pass
        finally:
            conn.close()

    def _local(self, payload: tuple) -> tuple:
        """An imported child's payload for a worker here: ``(fid, fn_bytes, call_bytes)``,
        its function named by its id in the node executor's function table where it can
        be (registered at its first import), not as a pickle.  Unpickled in a worker, a
        function sent by value is a new object each time, which that worker's spawns do
        not know: each spawn below it then pickled it by value again, and each of those
        children unpickled a new one (a client's ``__main__`` tree, fib(33) over two
        nodes: 0.44 s, slower than one node alone, 0.39 s)."""
        fn_bytes, call = payload
        fid = self.fids.get(fn_bytes)
        if fid is None:
            fid = -1
            if self.fid_of is not None:
                try:
                    fid = self.fid_of(pickle.loads(fn_bytes))
                except Exception:  # the worker unpickles it and reports what fails
                    fid = -1
            if len(self.fids) < 1024:
                self.fids[fn_bytes] = fid
        return (fid, None if fid >= 0 else fn_bytes, call)

    def _wait(self, key: Any) -> tuple:
        """A proxy whose child is out: its result, ("run",) if that node was lost, or
        ("help", ikey, payload) an imported child to run inline meanwhile."""
        asked = False
        with self.cv:
            self.waiting += 1
        try:
            while True:
                with self.cv:
                    if self.closed:
                        return ("done", False, (RuntimeError("the node executor shut down"),
                                                ""))
                    ans = self.table.claim(key)
                    if ans[0] != "wait":
                        return ans
                    got = self.table.take_import()
                    if got is not None:
                        self.table.n["helped"] += 1
                        break
                    if asked:
                        self.cv.wait(0.5)
                        continue
                    e = self.table.exports.get(key)
                    node = e.node if e is not None else None
                if node is not None:
                    self.hungry(node)
                asked = True
        finally:
            with self.cv:
                self.waiting -= 1
        # (outside the lock: a first import unpickles the function and registers it)
        return ("help", got[0], self._local(got[1]))


# -- the workers' end ------------------------------------------------------------------------------

class WorkerLink:
    """In a worker of a node executor: the spawn hook of ``stealer.forkjoin``."""

    def __init__(self, path: str, want_path: str, authkey: bytes, depth: int,
                 want_depth: int | None = None) -> None:
        self.path = path
        self.authkey = authkey
        self.depth = depth
        # spawns exported while the want flag is up: this near their root (StealConfig)
        self.want_depth = -1 if want_depth is None else max(depth, want_depth)
        fd = os.open(want_path, os.O_RDONLY)
        try:
            self.want = mmap.mmap(fd, 8, prot=mmap.PROT_READ)  # byte 0: see ChildServer
        finally:
            os.close(fd)
        self.conn: Connection | None = None
        self.keys = itertools.count()
        self.pid = os.getpid()

    def _c(self) -> Connection:
        if self.conn is None:
            self.conn = Client(self.path, family="AF_UNIX", authkey=self.authkey)
        return self.conn

    def shallow(self, cur: Any, depth: int = -1) -> bool:
        """Whether a child spawned now is within ``depth`` (default: the link's) of its
        tree's root on this node (its ancestors walked up by their records' links: at most
        ``depth`` reads)."""
        frame = cur.frame
        h = frame.h if frame is not None else (cur.cur[0] if cur.cur is not None else -1)
        if h < 0:
            return False
        a = cur.arena
        for _ in range(self.depth if depth < 0 else depth):
            kind, _status, link = a.kind_link(a.off(h))
            if kind & K_MASK != K_CHILD:
                return True  # the root is at most depth - 1 above the child
            h = link
        return False

    def spawn(self, cur: Any, fn: Any, args: tuple, kwargs: dict) -> Any:
        """Spawn ``fn(*args, **kwargs)``: exported (a proxy spawned here, the call sent to
        the node agent) when it is a shallow spawn or the node agent wants children; as
        usual otherwise, or when the call does not pickle, or the node agent is gone."""
        if self.want[0]:  # a peer wants children (ChildServer.want_mm): deeper ones too
            if self.want_depth >= 0 and not self.shallow(cur, self.want_depth):
                return cur.spawn(fn, args, kwargs)
        elif not self.shallow(cur):
            return cur.spawn(fn, args, kwargs)
        try:
            payload = (_fn_bytes(fn), _pack((args, kwargs)))
            key = (self.pid, next(self.keys))
            _send(self._c(), ("x", key, payload))
        except Exception:
            return cur.spawn(fn, args, kwargs)
        fid = cur.fns.id_known(fn)  # by id where it can: see ChildServer._local
        return cur.spawn(proxy, (key, fn if fid < 0 else fid, args, kwargs), {})

    def ask(self, msg: tuple) -> Any:
        c = self._c()
        _send(c, msg)
        return _recv(c)


_FN_BYTES: dict[Any, bytes] = {}  # worker: function -> its pickle, for its exports


def _fn_bytes(fn: Any) -> bytes:
    """The pickle of an exported child's function, made once per function where its
    pickle cannot change (:func:`stealer.shared.serialize.cacheable`)."""
    try:
        return _FN_BYTES[fn]
    except (KeyError, TypeError):
        pass
    data = _pack(fn)
    if len(_FN_BYTES) < 256 and cacheable(fn):
        _FN_BYTES[fn] = data
    return data


def _call_of(local: tuple) -> tuple:
    """``(fn, args, kwargs)`` of an imported child's payload (:meth:`ChildServer._local`)."""
    from stealer import forkjoin

    fid, fn_bytes, call = local
    fn = forkjoin._current.fns.get(fid) if fid >= 0 else pickle.loads(fn_bytes)
    args, kwargs = pickle.loads(call)
    return fn, args, kwargs


def _run(fn: Any, args: tuple, kwargs: dict) -> Any:
    """Generator-delegating call: ``r = yield from _run(...)`` forks as the call would."""
    r = fn(*args, **kwargs)
    if type(r) is GeneratorType:
        r = yield from r
    return r


def proxy(key: Any, fn: Any, args: tuple, kwargs: dict) -> Any:
    """The local stand-in of an exported child: runs it here if nobody took it, else waits
    for its result (running other nodes' children inline meanwhile)."""
    from stealer import forkjoin

    link = forkjoin._export
    if type(fn) is int:  # its id in this node's function table
        fn = forkjoin._current.fns.get(fn)
    try:
        ans = link.ask(("c", key))
    except Exception:  # the node agent is gone: this node is going down anyway
        ans = ("run",)
    while ans[0] in ("wait", "help"):
        if ans[0] == "help":  # another node's child, run here as part of this task: its
            ikey, ipayload = ans[1], ans[2]  # own children fork on this node's workers
            try:
                ifn, iargs, ikwargs = _call_of(ipayload)
                out = (True, (yield from _run(ifn, iargs, ikwargs)))
            except Exception as exc:
                out = (False, (_picklable(exc), ""))
            _send(link._c(), ("h", ikey, *out))
        ans = link.ask(("w", key))
    if ans[0] == "run":
        return (yield from _run(fn, args, kwargs))
    _, ok, value = ans
    if ok:
        return value
    exc, _tb = value
    raise exc


def imported(ikey: tuple) -> Any:
    """A child another node sent, run as a task here (it forks on this node's workers);
    TAKEN if a waiting proxy ran it first."""
    from stealer import forkjoin

    payload = forkjoin._export.ask(("i", ikey))
    if payload is None:
        return TAKEN
    fn, args, kwargs = _call_of(payload)
    return (yield from _run(fn, args, kwargs))


def _pack(obj: Any) -> bytes:
    """Pickle for the link between workers and their node agent: stdlib pickle, or
    cloudpickle for what it cannot write by reference.  The client's ``__main__`` functions
    and classes reach a node by value (cloudpickle), so stdlib pickle cannot write them
    again there: a user's tree written in a script exported no child, and an exception
    of a class of its own came back as a RemoteError."""
    try:
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:
        import cloudpickle

        return cloudpickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _send(conn: Connection, msg: Any) -> None:
    conn.send_bytes(_pack(msg))


def _recv(conn: Connection) -> Any:
    return pickle.loads(conn.recv_bytes())


def _picklable(exc: BaseException) -> BaseException:
    try:
        _pack(exc)
        return exc
    except Exception:
        from stealer.errors import RemoteError

        return RemoteError(f"{type(exc).__name__}: {exc}")


def install(path: str, want_path: str, authkey: bytes, depth: int, init: Any = None,
            initargs: tuple = (), want_depth: int | None = None) -> None:
    """The node executor's worker initializer: installs the spawn hook, then runs the
    user's initializer (if any)."""
    from stealer import forkjoin

    try:
        forkjoin._export = WorkerLink(path, want_path, authkey, depth, want_depth)
    except OSError:  # its node agent is stopping (a worker replaced meanwhile): no export
        forkjoin._export = None
    if init is not None:
        init(*initargs)
