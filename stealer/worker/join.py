"""A worker's fork-join: the frames of its tasks that spawn children, and the blocking join.

Owns :class:`_Frame` (a running or suspended task with children) and the
:class:`ForkJoinHandling` mixin of stealer/worker/loop.py's Worker, whose state it shares
(the current task and frame, ``conts``, the deque and inbox, counters): creating a frame
and naming its owner in the record (R_OWNER, R_INCARNATION), driving a generator task,
suspending it until its children are DONE and resuming it on a ping (``on_ping``, from
the Worker's loop and PingHandling.run_later), collecting the children's results, the
implicit join at the end of a body (``finish``, from ``execute``), ``spawn`` (called by
stealer/forkjoin.py for the running task) and the blocking join inside a plain task
body (``join_blocking``, from forkjoin.join and nested Parallel).  The protocol of the
pings is stealer/shared/recovery.py's Pings; the record states are stealer/shared/records.py's.
"""

from __future__ import annotations

import struct
import time
from typing import Any

from stealer import forkjoin
from stealer.errors import WorkerCrashedError, result_value
from stealer.errors import with_remote_tb as _with_remote_tb
from stealer.forkjoin import Child, TaskCall, children_of
from stealer.shared import failpoints, metrics, serialize
from stealer.shared._layout import (
    F_AGENT,
    K_CHILD,
    K_MASK,
    R_OWNER,
    R_RETRIES,
    S_DONE,
    S_QUEUED,
    ST_ERROR,
    ST_OK,
)
from stealer.worker.outcome import error_payload

__all__ = ["ForkJoinHandling", "JOIN_WAIT", "MAX_NEST"]

_OWNER = struct.Struct("=II")  # R_OWNER, R_INCARNATION
_U32 = struct.Struct("=I")

JOIN_WAIT = 0.002  # seconds a blocking join sleeps between looks (a child's ping wakes it)
MAX_NEST = 1024  # deepest child chain a blocking join looks up (a task's descendants)
_C = {name: i for i, name in enumerate(metrics.COUNTERS)}  # by name: reordering is safe
C_TASKS, C_SPAWNS, C_RESUMES, C_BUSY_NS = _C["tasks"], _C["spawns"], _C["resumes"], _C["busy_ns"]

FP = failpoints  # `if FP.ON:` costs one attribute load when no failpoint is armed


class _Frame:
    """A running or suspended task on this worker (fork-join state)."""

    __slots__ = ("final", "gen", "h", "kids", "kind", "link", "off", "retries", "waiting")

    def __init__(self, h: int, off: int, kind: int, link: int, retries: int) -> None:
        self.h = h
        self.off = off
        self.kind = kind
        self.link = link
        self.retries = retries
        self.gen: Any = None
        self.kids: dict[int, Child] = {}  # spawned children not yet joined-and-read
        self.waiting: tuple[list[Child], bool] | None = None
        self.final: tuple[int, Any] | None = None  # result held until children finish


class ForkJoinHandling:
    """Mixed into Worker, whose attributes these methods use (first among its bases:
    its ``on_ping`` is the one PingHandling's stub stands for)."""

    arena: Any
    seg: Any
    r: Any
    k: int
    incarnation: int
    c: list[int]
    fns: Any
    host: Any
    idle: Any
    pings: Any
    client: Any
    inbox: Any
    deque: Any
    injector: Any
    cur_off: int
    lease_off: int
    run_off: int
    metrics_on: bool
    conts: dict[int, _Frame]
    frame: _Frame | None
    cur: tuple[int, int, int] | None
    in_body: bool
    in_spawn: bool
    interrupted: bool
    joined_ns: int
    joining: set[int]
    held: list[int]
    pass_on: Any  # (PingHandling's: not stubbed here, this class comes first)

    def execute(self, h: int) -> None:  # (Worker's)
        raise NotImplementedError

    def push_any(self, h: int) -> None:  # (Worker's)
        raise NotImplementedError

    def report(self, h: int, kind: int, link: int, status: int, value: Any) -> None:  # (Worker's)
        raise NotImplementedError

    def orphaned(self) -> None:  # (Worker's)
        raise NotImplementedError

    # -- frames --------------------------------------------------------------
    def new_frame(self, h: int, kind: int, link: int) -> _Frame:
        off = self.arena.off(h)
        retries = _U32.unpack_from(self.seg.mm, off + R_RETRIES)[0]
        # Pings from children go to the worker named here (written before the first
        # child is pushed: the push releases it to the child's worker).
        _OWNER.pack_into(self.seg.mm, off + R_OWNER, self.k, self.incarnation)
        return _Frame(h, off, kind, link, retries)

    def drive(self, frame: _Frame, send: Any, exc: BaseException | None) -> None:
        gen = frame.gen
        self.frame = frame
        while True:
            self.in_body = True
            try:
                y = gen.throw(exc) if exc is not None else gen.send(send)
            except StopIteration as stop:
                self.in_body = False
                self.finish(frame, ST_OK, stop.value)
                return
            except BaseException as e:
                self.in_body = False
                self.finish(frame, ST_ERROR, e)
                return
            finally:
                self.in_body = False
            exc = None
            try:
                kids, single = children_of(y)
                for c in kids:
                    if c.handle != -1 and not c.done and frame.kids.get(c.handle) is not c:
                        raise TypeError("a task can only join children it spawned itself")
            except TypeError as e:
                exc = e
                continue
            frame.waiting = (kids, single)
            if not self.kids_done(frame):
                self.suspend(frame)
                return  # a ping from the last child resumes it
            send, exc = self.collect(frame)

    def suspend(self, frame: _Frame) -> None:
        self.conts[frame.h] = frame
        if FP.ON:
            FP.hit("worker.in_join")

    def kids_done(self, frame: _Frame) -> bool:
        """Every child spawned so far is DONE (a join waits for all of them, as Cilk's sync)."""
        state = self.arena.tr.state
        for h in frame.kids:
            st = state(h)
            if st is not None and st[0] != S_DONE:
                return False
        return True

    def collect(self, frame: _Frame) -> tuple[Any, BaseException | None]:
        assert frame.waiting is not None
        kids, single = frame.waiting
        frame.waiting = None
        a = self.arena
        for c in kids:
            if c.done:
                continue
            coff = a.off(c.handle)
            if a.tr.state(c.handle) is None:
                status, value = ST_ERROR, (WorkerCrashedError("the child task's record was lost"),
                                           "")
            else:
                status = a.kind_link(coff)[1]
                try:
                    status, value = result_value(status, a.take(coff))
                except BaseException as e:
                    status, value = ST_ERROR, error_payload(e)
                if FP.ON:
                    FP.hit("worker.in_collect")
                a.free(c.handle)
            del frame.kids[c.handle]
            c.done = True
            if status == ST_OK:
                c.value = value
            else:
                c.exc = _with_remote_tb(value)
        for c in kids:
            if c.exc is not None:
                return None, c.exc
        return (kids[0].value if single else [c.value for c in kids]), None

    # -- a blocking join inside a plain task body (forkjoin.join, nested Parallel) ------
    def join_blocking(self, kids: list[Child], single: bool, timeout: float | None) -> Any:
        """Wait, inside the running task's body, until every child in ``kids`` is DONE,
        and return their results as a generator's ``yield`` would (a helping join).

        Meanwhile this worker runs the waiting task's *descendants* from its own deque
        only (its children, newest first, and theirs), resumes their suspended frames
        when pinged, and runs its agents' turns and the children they spawn (an agent
        never blocks, so nothing it runs waits for this task; a descendant a peer stole
        may wait for an agent's reply that only this worker can give; TaskCall children
        are agents' replies).  A task outside that subtree, run on top of this one, could
        wait for a task that waits for this one: a deadlock across workers.  It steals
        nothing either: only free workers steal (a stolen task is at the bottom of its
        thief's stack), so every stack is a chain of descendants and each join waits
        only for subtrees that finish on their own (measured: stealing descendants back
        in joins let two joining workers bounce each other's tasks to the injector, which
        no joining worker reads, and hang).  Other pings wait in a list for the end of
        the join; a non-descendant popped from our deque is pushed back.
        """
        frame = self.frame
        if self.host.current is not None:
            raise RuntimeError(
                "an agent joins its children by yielding them (yield child, or a list): a "
                "blocking join would hold its turn")
        if frame is None or any(not c.done and frame.kids.get(c.handle) is not c
                                for c in kids):
            raise TypeError("a task can only join children it spawned itself")
        top = frame.h
        cur = self.cur
        child_done = self.child_done
        inbox = self.inbox
        deque = self.deque
        deferred: list[int] = []
        t0 = time.monotonic_ns()
        joined = self.joined_ns
        deadline = None if timeout is None else time.monotonic() + timeout
        joining = self.joining
        host = self.host
        # This worker's agents run meanwhile: their turns never block (nothing they wait
        # for waits for this task), and a task (this one, or a descendant a peer stole)
        # may wait for the reply of an agent that only this worker runs.  Waiting for a
        # reply itself (TaskCall), it also adopts agents queued on the injector: a new or
        # recovered agent goes there when every worker runs a task, and could be the one
        # called.
        calls = any(isinstance(c, TaskCall) for c in kids)
        joining.add(top)
        self.in_body = False  # Ctrl-C is ignored here (as when idle): nothing half-moved
        try:
            while True:
                if all(c.done or child_done(c) for c in kids):
                    break
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(f"the children were not all done within {timeout} s")
                h = inbox.pop()
                if h >= 0:
                    if h in joining:
                        # a ping for a task waiting in a join on this stack: dropped (each
                        # join looks at its children's states itself, after this clear)
                        self.pings.clear(h)
                    elif h in self.conts:
                        if self._runs_here(h, top):
                            self._nested(self.on_ping, h, frame, cur)
                        else:
                            deferred.append(h)  # pinged again after the join (bit still set)
                    else:
                        self.pings.clear(h)  # (before pass_on looks, as in on_ping)
                        if host.answers and host.take_answer(h):
                            continue  # a call's answer: its slot pings the task (us)
                        if (host.agents or host.dormant) and host.notify(h):
                            continue  # an agent of ours: runnable now (below)
                        if self.queued_agent(h):  # handed to us: adopted now
                            self._nested(self.execute, h, frame, cur)
                            continue
                        if not self.pass_on(h):
                            deferred.append(h)  # an agent's: after the join
                    continue
                h = deque.pop()  # leased: killed from here on, a recoverer pushes it again
                if FP.ON and h >= 0:
                    FP.hit("worker.join_after_pop")
                if h >= 0 and not self._runs_here(h, top):
                    # back where it was: cannot fail (we own the deque and just popped it)
                    deque.push(h)
                    h = -1
                if h >= 0:
                    self._nested(self.execute, h, frame, cur)
                    continue
                if host.timers or host.blocked:
                    host.poll()  # due sleeps; sends waiting for room (a call's)
                if host.rq.n:
                    self._nested(self._agent_turn, -1, frame, cur)
                    continue
                if calls and len(self.injector):
                    h = self.injector.pop()  # leased
                    if h >= 0 and self.queued_agent(h):
                        self._nested(self.execute, h, frame, cur)
                        continue
                    if h >= 0:  # a task: back for a free worker (a copy left by the
                        self.push_any(h)  # lease is dropped when it is started twice)
                if self.host.dir.held:  # notifications that found a peer's inbox full
                    self.host.dir.deliver_held(self.k)
                if (not self.idle.wait_ping(self.k, inbox.__len__, JOIN_WAIT)
                        and self.client.gone()):  # our client died while we waited: exit
                    self.orphaned()
        finally:
            joining.discard(top)
            self.in_body = True
            for h in deferred:
                if not inbox.push(h):  # (room taken meanwhile) our loop runs it instead
                    self.held.append(h)
            # the join's time is not this task's busy time (the tasks run inside count their own)
            self.joined_ns = joined + time.monotonic_ns() - t0
        frame.waiting = (kids, single)
        send, exc = self.collect(frame)
        if exc is not None:
            raise exc
        return send

    def queued_agent(self, h: int) -> bool:
        """Whether ``h`` is an agent record waiting to be adopted (QUEUED)."""
        a = self.arena
        if not a.kind_link(a.off(h))[0] & F_AGENT:
            return False
        st = a.tr.state(h)
        return st is not None and st[0] == S_QUEUED

    def _agent_turn(self, _h: int) -> None:
        """One agent turn on top of a task that waits for an agent's reply."""
        self.host.run_next()

    def child_done(self, c: Child) -> bool:
        st = self.arena.tr.state(c.handle)
        return st is None or st[0] == S_DONE

    def _nested(self, run: Any, h: int, frame: _Frame, cur: Any) -> None:
        """Run a task (or resume a frame) on top of the waiting task, then make that one
        current again."""
        self.cur = None
        self.frame = None  # (execute and drive take theirs from here)
        try:
            run(h)
        finally:
            self.cur = cur
            self.frame = frame
            self.r.store64(self.cur_off, frame.h + 1)  # release: read by the recoverer
        if FP.ON:
            FP.hit("worker.join_after_nested")

    def _runs_here(self, h: int, top: int) -> bool:
        """Whether record ``h`` (a task to run or a frame to resume) may run on top of
        task ``top``, which waits in a blocking join: it is a child, grandchild... of
        ``top``, or of an agent (spawned by an agent's turn, or by such a child: an
        agent waiting for it could be the one ``top`` waits for, and nothing an agent
        runs waits for ``top``)."""
        a = self.arena
        for _ in range(MAX_NEST):
            kind, _status, link = a.kind_link(a.off(h))  # set before its push: stable
            if kind & K_MASK != K_CHILD:
                return bool(kind & F_AGENT)  # the root: an agent's children run here
            if link == top:
                return True
            h = link
        return False

    def on_ping(self, h: int) -> None:
        """A child of ``h`` finished (or a recoverer says one may have): resume it if ready."""
        a = self.arena
        if (h & 0xFFFFFFFF) >= a.nrecords:
            return
        if FP.ON:
            FP.hit("worker.ping_before_clear")
        self.pings.clear(h)  # first: a child done after our look below pings again
        if FP.ON:
            FP.hit("worker.ping_after_clear")
        if self.host.answers and self.host.take_answer(h):
            return  # a task's blocking call answered: its reply slot pings the task
        if (self.host.agents or self.host.dormant) and self.host.notify(h):
            return  # an agent of ours: messages, a reply, children, a stop
        frame = self.conts.get(h)
        if frame is None and a.kind_link(a.off(h))[0] & F_AGENT:
            st = a.tr.state(h)
            if st is not None and st[0] == S_QUEUED:
                self.execute(h)  # an agent a busier peer handed us (Host.balance)
            return
        if frame is None:
            self.pass_on(h)
            return
        if not self.kids_done(frame):
            return
        del self.conts[h]
        r = self.r
        r.store64(self.cur_off, h + 1)
        if FP.ON:
            FP.hit("worker.after_resume")
        c = self.c
        c[C_TASKS] += 1
        c[C_RESUMES] += 1
        t0 = time.monotonic_ns()
        try:
            if frame.final is not None:
                status, value = frame.final
                frame.final = None
                self.finish(frame, status, value)
            else:
                send, exc = self.collect(frame)
                self.drive(frame, send, exc)
        finally:
            self.frame = None
            r.store64(self.cur_off, 0)
            if self.metrics_on:
                dt = time.monotonic_ns() - t0
                c[C_BUSY_NS] += dt
                r.hist_record(self.run_off, dt)

    def finish(self, frame: _Frame, status: int, value: Any) -> None:
        """The task body is done; wait for outstanding children (implicit join), then report."""
        if frame.kids:
            if not self.kids_done(frame):
                frame.waiting = None
                frame.final = (status, value)
                self.suspend(frame)
                return
            a = self.arena
            for h in frame.kids:  # results never joined: drop them
                if a.tr.state(h) is not None:
                    a.free(h)
            frame.kids.clear()
        self.report(frame.h, frame.kind, frame.link, status, value)

    # -- fork-join -----------------------------------------------------------
    def task_frame(self) -> _Frame | None:
        """The running task's frame, made at its first spawn or call to an agent (None
        when no task runs)."""
        frame = self.frame
        if frame is None:
            if self.cur is None:
                return None
            h0, kind0, link0 = self.cur
            frame = self.frame = self.new_frame(h0, kind0, link0)
        return frame

    def spawn(self, fn: Any, args: tuple, kwargs: dict) -> Child:
        a = self.arena
        frame = self.task_frame()
        if frame is None:
            raise RuntimeError("spawn() outside a running task")
        fid = self.fns.id_known(fn)
        data, bufs = serialize.dumps((fid if fid >= 0 else fn, args, kwargs or None),
                                     "spawned task")
        # From here to the push, Ctrl-C is held back (_on_sigint): a child set up but in
        # no queue would hang its parent's join.
        self.in_spawn = True
        try:
            h = a.alloc()
            if h < 0:
                c = None
            else:
                # leased from the start: killed before the push, the recoverer finds it
                # QUEUED and pushes it (or FREE, not yet set up, and leaves it)
                self.r.store64(self.lease_off, h + 1)
                try:
                    off = a.setup(h, K_CHILD, frame.h, time.monotonic_ns(), frame.retries)
                    a.put(off, data, bufs)
                except BaseException:
                    a.free(h)
                    raise
                self.c[C_SPAWNS] += 1
                c = Child(h)
                frame.kids[h] = c
                if FP.ON:
                    FP.hit("worker.after_spawn")
                if not self.deque.push(h):
                    while not self.injector.push(h):
                        time.sleep(0.0001)
                self.arena.notify_one()
        finally:
            self.in_spawn = False
        if self.interrupted:
            self.interrupted = False
            raise KeyboardInterrupt
        if c is None:
            return forkjoin.inline_child(fn, args, kwargs)  # arena exhausted: run it here
        return c
