"""Dormant agents: an idle agent held by its object alone until its first message.

A worker keeps each agent it runs in an ``_Entry`` (stealer/worker/agents/entry.py): about
fifty fields of scheduling, placement, checkpoint and journal state, some 700 bytes with the
numbers they hold.  A million spawned agents that wait for messages they may never get
would cost the worker more for that bookkeeping than for the agents themselves.

So an agent that, right after it is built from its spawn, has nothing to do (no ``step``
method, no message in its mailbox, no deadline, no stop asked, not journaled) is kept as
its object alone, in ``Host.dormant`` (handle -> object): about 80 bytes for the dict slot
and the handle, plus the object.  Everything else its entry would hold is either the
entry's initial value or already in shared memory: the spawn payload (class, arguments,
options: the agent record keeps it for restarts), its link and generation (the record's
header), the time it was started (``R_TSTART``, the start of its checkpoint and throttle
windows).  Nothing about it differs from an entry that has not run a turn yet.

The first notification (a message, a stop) *thaws* it (:func:`thaw`): its entry is made
from those, exactly as adopting it made it, and the notification then proceeds as for
any agent.  From then on it is an ordinary agent (it is not put back to sleep: an agent
that got one message is likely to get more).  A worker death restarts a dormant agent
from its spawn, as any agent without a checkpoint.

Shutdown (:func:`stop_all`): a dormant agent's stop runs its ``on_stop`` (if it has one)
and reports the value right away, with what ``Host.finish`` does for an agent with no
messages and no checkpoint (close its mailbox, publish the value); one whose mailbox got
a message meanwhile (its notification not handled yet) is thawed and stopped by a turn.

Native twins (native/_cqueues.pyx, used where the Host's native turn is: the extension, no
journal, no failpoints): ``Turns.adopt`` runs Host.adopt + :func:`adopt` for an agent fresh
from its spawn that goes dormant (its other ends are :func:`failed` and :func:`built`),
``Turns.stop_dormant`` the part of :func:`stop_all`'s loop for agents without ``on_stop``
whose mailbox is empty.  A million idle agents took ~9 µs of a worker's CPU each to adopt
and ~3 µs each to stop in these Python functions.
"""

from __future__ import annotations

import struct
from typing import Any

from stealer.agents.api import drives_itself, stop_value
from stealer.agents.mailbox import CLOSED
from stealer.shared import failpoints as FP
from stealer.shared._layout import (
    AF_CONTROL,
    AF_STOP,
    D_COUNT,
    D_FLAGS,
    D_GEN,
    D_HEAD,
    DIR_BYTES,
    F_AGENT,
    K_ROOT,
    R_LINK,
    R_TSTART,
    RECORD_BYTES,
    ST_ERROR,
    ST_OK,
)

__all__ = ["adopt", "built", "failed", "thaw", "stop_all"]

_U64 = struct.Struct("=Q")
_MISSING = object()


def adopt(host: Any, h: int, link: int, entry: Any, ent: int) -> tuple | None:
    """Host.adopt of agent ``h`` with no checkpoint (fresh from its spawn, or restarted
    from it): build it and keep it dormant if it has nothing to do; None when adopted
    here (dormant, or -- a message or a ``step`` attribute that came with the object --
    scheduled as any agent), else its spawn payload for Host.adopt's own path (``()``:
    the payload did not read; Host.adopt reads it again and fails the agent with that).
    ``ent``: its directory entry's offset (Directory.entry).

    What decides before the object is built: no journal, no deadline, no ``step`` on the
    class, no stop asked, an empty mailbox (so no handled message either: D_DONE is 0 and
    nothing is to be replayed)."""
    a = host.a
    r = host.r
    try:
        spawn = a.read_inline(h)  # one native call for a pickle stored inline
        if spawn is None:
            spawn = a.read_call(a.off(h))
    except BaseException:
        return ()
    cls, args, kwargs, _opts, deadline_at = spawn[:5]
    if deadline_at is not None or (len(spawn) > 5 and spawn[5] is not None):
        return spawn
    if type(cls) is int:
        try:
            cls = host.w.fns.get(cls)
        except BaseException:
            return ()  # its class does not load here: Host.adopt fails the agent with that
    # seq_cst loads: the or64 of a stop, the CAS of a push (mailbox.py)
    # (a control-tier agent is never dormant: its owner handles its messages inside other
    # agents' steps, agents/inline.py, from Host.controls)
    if (drives_itself(cls) or r.load64(ent + D_FLAGS) & (AF_STOP | AF_CONTROL)
            or r.load64(ent + D_HEAD)):
        return spawn
    gen = host.tries(h)  # re-run from the spawn after worker deaths: a generation each
    w = host.w
    w.in_body = True
    try:
        obj = cls(*args, **kwargs) if kwargs else cls(*args)
    except BaseException as exc:
        w.in_body = False
        failed(host, h, link, entry, exc, gen, spawn)
        return None
    w.in_body = False
    if FP.ON:
        FP.hit("dormant.adopt_built")
    r.store32(ent + D_GEN, gen)  # stats only: read by collect()
    host.dormant[h] = obj
    if drives_itself(obj) or r.load64(ent + D_HEAD):
        built(host, h, entry)
    return None


def failed(host: Any, h: int, link: int, entry: Any, exc: BaseException, gen: int,
           spawn: tuple) -> None:
    """:func:`adopt` (or its native twin, Turns.adopt) of agent ``h``, whose constructor
    raised ``exc``: it ends with that error, as any agent whose spawn fails."""
    e = entry(h, link)
    host.agents[h] = e
    host.spawned(e, spawn)
    e.gen = gen
    e.seen = host.dir.done_mark(h)
    host.finish(e, ST_ERROR, exc)


def built(host: Any, h: int, entry: Any) -> None:
    """:func:`adopt`'s (or Turns.adopt's) end for dormant agent ``h`` just built: thawed
    and scheduled if its object has a ``step`` attribute of its own (the class had none)
    or a message was pushed while it was being built (seq_cst load: pairs with the
    push's CAS of D_HEAD)."""
    step = drives_itself(host.dormant[h])
    if step or host.r.load64(host.dir.entry(h) + D_HEAD):
        e = thaw(host, h, entry)
        if step:
            e.want_step = True
            e.state = entry.RUNNABLE
        host.take(e)
        host.schedule(e)


def thaw(host: Any, h: int, entry: Any) -> Any:
    """The entry of dormant agent ``h`` (``entry``: entry.py's ``_Entry``), made now as
    adopting it made it; None if ``h`` is not dormant here.
    ``host.agents`` holds it from now on."""
    obj = host.dormant.pop(h, _MISSING)
    if obj is _MISSING:
        return None
    a = host.a
    off = a.off(h)
    e = entry(h, a.kind_link(off)[2])
    host.spawned(e, a.read_call(off))
    e.obj = obj
    e.gen = host.tries(h)
    e.want_step = False
    e.state = entry.WAITING
    # the start of its checkpoint and throttle windows: when this worker started it
    t = _U64.unpack_from(a.mm, off + R_TSTART)[0]
    e.ckpt_time = t
    e.win_start = t
    host.agents[h] = e
    return e


def stop_all(host: Any, entry: Any) -> None:
    """Shutdown: stop every dormant agent here (see the module doc).

    No AF_STOP flag is set for them (Host.stop_all sets it for the others): a dormant agent
    is stopped here and now, and if this worker dies first, the successor that adopts it
    stops it because of the same H_STOP_AGENTS that brought us here."""
    d = host.dir
    w = host.w
    r = host.r
    a = host.a
    mm = a.mm
    none = w.encode_result(ST_OK, None)  # the final value of an agent without on_stop
    dormant = host.dormant
    base = d.base
    rec_base = a.rec_base
    load64, load32, cas64 = r.load64, r.load32, r.cas64
    report = w.report_encoded
    kind = K_ROOT | F_AGENT
    has_stop: dict[type, bool] = {}  # per class: an on_stop to call?
    quick = host.quick  # Turns, or None: this loop is its twin (and has the failpoints)
    if quick is not None and not FP.ON and none[0] == ST_OK and not none[2]:
        # the agents with no on_stop and an empty mailbox in one native pass; the rest
        # (an on_stop to call, a message came) come back for the loop below
        rest, unreported = quick.stop_dormant(dormant, has_stop, none[1])
        for h, link in unreported:  # closed; the value did not fit beside the spawn
            report(h, kind, link, *none)
        dormant.update(rest)
    while dormant:
        h, obj = dormant.popitem()
        t = type(obj)
        fn = has_stop.get(t)
        if fn is None:
            fn = has_stop[t] = getattr(t, "on_stop", None) is not None
        status, value = ST_OK, None
        if fn:
            w.in_body = True
            try:
                value = stop_value(obj)
            except BaseException as exc:
                status, value = ST_ERROR, exc
            finally:
                w.in_body = False
        ent = base + DIR_BYTES * (h & 0xFFFFFFFF)
        # close an empty mailbox (acquire load, seq_cst CAS: as Directory.close, which
        # also wakes a full mailbox's blocked senders: a count > 0 takes that path)
        if ((load64(ent + D_HEAD) or load32(ent + D_COUNT)
             or not cas64(ent + D_HEAD, 0, CLOSED)) and d.close(h)):
            # messages arrived since it went dormant (their notification not handled yet):
            # finish() answers them with AgentStopped and frees them, as for any agent
            dormant[h] = obj
            host.finish(thaw(host, h, entry), status, value)
            continue
        if FP.ON:
            FP.hit("dormant.stop_after_close")
        # (its record is ours, RUNNING here: the link its spawner wrote)
        link = _U64.unpack_from(mm, rec_base + RECORD_BYTES * (h & 0xFFFFFFFF) + R_LINK)[0]
        if fn:
            w.report(h, kind, link, status, value)
        else:
            report(h, kind, link, *none)
