"""Dormant agents: an idle agent held by its object alone until its first message.

A worker keeps each agent it runs in an ``_Entry`` (stealer/agents/host.py): about fifty
fields of scheduling, placement, checkpoint and journal state, some 700 bytes with the
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
"""

from __future__ import annotations

import struct
from typing import Any

from stealer._layout import AF_STOP, D_FLAGS, F_AGENT, K_ROOT, R_TSTART, ST_ERROR, ST_OK

__all__ = ["may_doze", "thaw", "stop_all"]

_U64 = struct.Struct("=Q")
_MISSING = object()


def may_doze(host: Any, e: Any) -> bool:
    """Adopt, for an agent just built from its spawn (its mailbox walked): keep it as its
    object alone if it has nothing to do.  True if it went dormant (``host.agents`` no
    longer holds ``e``)."""
    if (e.want_step or e.pending or e.deadline is not None or e.stop or host.stopping
            or e.uid is not None or e.jreplies is not None or e.outbox or e.frame is not None):
        return False
    del host.agents[e.h]
    host.dormant[e.h] = e.obj
    return True


def thaw(host: Any, h: int, entry: type, waiting: int) -> Any:
    """The entry of dormant agent ``h`` (``entry``: host.py's ``_Entry``, ``waiting``: its
    WAITING state), made now as adopting it made it; None if ``h`` is not dormant here.
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
    e.state = waiting
    # the start of its checkpoint and throttle windows: when this worker started it
    t = _U64.unpack_from(a.mm, off + R_TSTART)[0]
    e.ckpt_time = t
    e.win_start = t
    host.agents[h] = e
    return e


def stop_all(host: Any, entry: type, waiting: int) -> None:
    """Shutdown: stop every dormant agent here (see the module doc)."""
    d = host.dir
    w = host.w
    r = host.r
    a = host.a
    none = w.encode_result(ST_OK, None)  # the final value of an agent without on_stop
    dormant = host.dormant
    while dormant:
        h, obj = dormant.popitem()
        r.or64(d.entry(h) + D_FLAGS, AF_STOP)  # seq_cst: as Host.stop_all (a successor sees it)
        fn = getattr(obj, "on_stop", None)
        status, value = ST_OK, None
        if fn is not None:
            w.in_body = True
            try:
                value = fn()
            except BaseException as exc:
                status, value = ST_ERROR, exc
            finally:
                w.in_body = False
        if d.close(h):
            # messages arrived since it went dormant (their notification not handled yet):
            # finish() answers them with AgentStopped and frees them, as for any agent
            dormant[h] = obj
            host.finish(thaw(host, h, entry, waiting), status, value)
            continue
        link = a.kind_link(a.off(h))[2]
        if fn is None:
            w.report_encoded(h, K_ROOT | F_AGENT, link, *none)
        else:
            w.report(h, K_ROOT | F_AGENT, link, status, value)
