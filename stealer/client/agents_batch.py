"""Many agents at once: ``Executor.spawn_agents`` and the compact sequence of their refs.

``ex.spawn_agents(cls, args_list, **options)`` starts one agent per tuple of ``args_list``
(``cls(*args)`` on a worker, as ``spawn_agent`` does), in the order of the list.  What one
spawn does once per agent is done once per batch here: the class is pickled once (the
function table), the options parsed and checked once, each agent's payload is its small
spawn tuple (one pickle per distinct ``args`` object: ``[()] * n`` pickles once), and the
records of a chunk are taken, filled, given their directory entries and queued by one
native call per worker (``HotPath.spawn_inline``; ``Arena.spawn_inline`` is its reference
twin), with one wake-up of the workers per chunk.  A chunk is split evenly over the workers
in turn (``AgentClient.pick``: live, no task running), each part pushed on that worker's
inbox: from the injector, whichever worker woke first adopted nearly all of them (255 or
256 of 256 in 4 of 6 executors), and agents whose calls are shorter than a move never
move back.

All or nothing: if anything fails part-way (an argument that does not pickle, no free
record within the wait of a single spawn, the executor shutting down), the agents this call
had already started are stopped (their final values are ``None``, their records freed as
any stopped agent's) and the error is raised; no record stays held.

The result is an :class:`AgentRefs`: a sequence of :class:`~stealer.AgentRef` that holds
the agents' ids in an ``array`` (8 bytes each) and makes a ref when one is read, so the
refs of a million agents cost the client 8 MB, not a hundred.
"""

from __future__ import annotations

import itertools
import time
from array import array
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, overload

from stealer.agents.api import AgentRef
from stealer.agents.message import AGENT_FID
from stealer.agents.options import DEFAULT_OPTIONS, AgentOptions
from stealer.shared import serialize
from stealer.shared._layout import F_AGENT, INLINE, K_ROOT

__all__ = ["AgentRefs", "spawn_many", "CHUNK"]

CHUNK = 4096  # agents pickled and queued per native call (and per wake-up of the workers)


class AgentRefs(Sequence[AgentRef]):
    """The refs of agents started together, in order: ``refs[i]`` is an
    :class:`~stealer.AgentRef` (equal to any other ref on that agent); slices are
    :class:`AgentRefs` too.  Holds 8 bytes per agent."""

    __slots__ = ("_hs", "_rt", "_seg")

    def __init__(self, handles: array, seg: str, rt: Any) -> None:
        self._hs = handles
        self._seg = seg
        self._rt = rt

    def __len__(self) -> int:
        return len(self._hs)

    @overload
    def __getitem__(self, i: int) -> AgentRef: ...

    @overload
    def __getitem__(self, i: slice) -> AgentRefs: ...

    def __getitem__(self, i: int | slice) -> AgentRef | AgentRefs:
        if isinstance(i, slice):
            return AgentRefs(self._hs[i], self._seg, self._rt)
        return AgentRef(self._hs[i], self._seg, self._rt)

    def __iter__(self) -> Iterator[AgentRef]:
        seg, rt = self._seg, self._rt
        for h in self._hs:
            yield AgentRef(h, seg, rt)

    def __repr__(self) -> str:
        return f"<stealer.AgentRefs of {len(self._hs)} agents>"

    @property
    def ids(self) -> array:
        """The agents' ids (``AgentRef.id``), in order (a copy)."""
        return array("Q", self._hs)


def spawn_many(c: Any, cls: type, args_list: Iterable[tuple], kwargs: dict | None,
               opts: AgentOptions, retries: int) -> AgentRefs | list[AgentRef]:
    """``AgentClient`` ``c``: one agent per tuple of ``args_list`` (see the module doc)."""
    pool = c.pool
    # journaled: each spawn is its own journal event and uid; control tier: the directory
    # flags carry AF_CONTROL (agents/inline.py), which spawn() sets and the batch does not
    if c.j is not None or opts.tier == 0:
        return _spawn_each(c, cls, args_list, kwargs, opts, retries)
    deadline_at = None if opts.deadline is None else time.monotonic() + opts.deadline
    wopts = None if opts == DEFAULT_OPTIONS else opts.to_worker()
    what = f"agent {getattr(cls, '__qualname__', cls)!r} and its arguments"
    fid = pool.fns.id_of(cls)
    key = fid if fid >= 0 else cls
    kw = kwargs or None
    dir_off = c.dir.base
    hs = array("Q")
    it = iter(args_list)
    try:
        while True:
            chunk = list(itertools.islice(it, CHUNK))
            if not chunk:
                break
            pool.check_open()
            datas: list[bytes] = []
            big: dict[int, tuple[bytes, list]] = {}  # index -> payload that is not inline
            last: Any = datas  # (never a tuple: the first args always pickle)
            enc: tuple[bytes, list] = (b"", [])
            for i, args in enumerate(chunk):
                if args is not last:
                    if type(args) is not tuple:
                        raise TypeError(f"spawn_agents() takes a tuple of arguments per "
                                        f"agent, not {args!r}")
                    enc = serialize.dumps((key, args, kw, wopts, deadline_at), what)
                    last = args
                if enc[1] or len(enc[0]) > INLINE:
                    big[i] = enc
                datas.append(enc[0])
            _queue(c, datas, big, dir_off, opts.mailbox, retries, hs)
            pool.idle.notify_all()
    except BaseException:
        for h in hs:  # all or nothing: the ones started so far stop
            c.stop(h)
        raise
    return AgentRefs(hs, c.name, c)


def _queue(c: Any, datas: list[bytes], big: dict[int, tuple[bytes, list]], dir_off: int,
           cap: int, retries: int, hs: array) -> None:
    """Queue one chunk's agents in order: runs of inline payloads by one native call each,
    the others (and any one that waits for a free record) one by one."""
    a = c.a
    pool = c.pool
    i, n = 0, len(datas)
    part = -(-n // pool.n)  # each worker's share of the chunk
    out: list[int] = []
    while i < n:
        j = i
        while j < n and j not in big:
            j += 1
        if j > i:
            # at most a worker's share of the chunk, for the next worker in turn (the
            # injector if none fits)
            k = c.pick()
            if k >= 0:
                j = min(j, i + part)
            out.clear()
            st = a.spawn_inline(datas[i:j], K_ROOT | F_AGENT, AGENT_FID, retries, dir_off, cap,
                                out, None if k < 0 else pool.inboxes[k])
            hs.extend(out)
            i += len(out)
            if st == -2:  # set up, the ring full: the pool's requeue takes it
                pool.push(out[-1])
                continue
            if st == -1:  # no free record now: wait for one as a single spawn does
                _one(c, c.alloc("a new agent"), datas[i], [], cap, retries, hs)
                i += 1
            continue
        _one(c, c.alloc("a new agent"), *big[i], cap, retries, hs)
        i += 1


def _one(c: Any, h: int, data: bytes, bufs: list, cap: int, retries: int, hs: array) -> None:
    """One agent on record ``h`` (a payload that is not inline, or after a wait); never
    control tier (spawn_many spawns those one by one)."""
    c.queue_agent(h, data, bufs, cap, 0, retries)
    hs.append(h)


def _spawn_each(c: Any, cls: type, args_list: Iterable[tuple], kwargs: dict | None,
                opts: AgentOptions, retries: int) -> list[AgentRef]:
    refs: list[AgentRef] = []
    try:
        for args in args_list:
            if type(args) is not tuple:
                raise TypeError(f"spawn_agents() takes a tuple of arguments per agent, not "
                                f"{args!r}")
            refs.append(c.spawn(cls, args, kwargs or {}, opts, retries))
    except BaseException:
        for r in refs:
            c.stop(r._h)
        raise
    return refs
