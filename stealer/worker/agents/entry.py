"""What every piece of the Host shares: an agent's entry, its states, the counters.

:class:`_Entry` is one agent living in a worker's heap (the Host's ``agents``), with the
states a turn moves it through; :class:`CallPending` is a call an agent made and waits on.
Imported by stealer/worker/agents/host.py and the Host's pieces (worker/agents/*.py), never by anything
outside them (dormant.py gets ``_Entry`` passed in, as before).
"""

from __future__ import annotations

import collections
import os
import struct
import time
from typing import Any

from stealer.agents.api import Ctx, Pending
from stealer.agents.options import AgentOptions
from stealer.shared import metrics
from stealer.shared._layout import F_AGENT, K_ROOT

_U32 = struct.Struct("=I")
_U64 = struct.Struct("=Q")
_C = {name: i for i, name in enumerate(metrics.COUNTERS)}  # the worker's counter indices
C_BUSY_NS, C_STEPS, C_MSGS = _C["busy_ns"], _C["agent_steps"], _C["agent_messages"]
C_MIGRATIONS, C_THROTTLED, C_RESUMES = _C["migrations"], _C["throttled"], _C["resumes"]
C_PREEMPT, C_INLINE = _C["preempt_publishes"], _C["inline_controls"]

# what an entry is doing
RUNNABLE, WAITING, SLEEPING, SUSPENDED, FINISHED = range(5)

# a message record's R_TSTART (the steps before it, for an exact replay) with this bit: a
# call its caller cancelled before its handler started, not run (Messages.deliver), and so
# not run by a replay either
SKIPPED = 1 << 63

# An entry's fields.  Where the extension is built they live in its Entry (declared in
# native/_cqueues.pxd, the same names: tests/test_fast_turn.py checks), the base of _Entry,
# so the native turn reaches them as C struct fields; else _Entry holds them as __slots__.
ENTRY_FIELDS = (
    "applied",
    "arrived",
    "blocked",
    "ckpt_ns",
    "ckpt_time",
    "cls",
    "cpu_ns",
    "ctx",
    "cur",
    "deadline",
    "deadline_ns",
    "events",
    "frame",
    "gen",
    "h",
    "handled",
    "it",
    "it_msg",
    "jacked",
    "jreplies",
    "jseen",
    "jsent",
    "jspawned",
    "last_ckpt",
    "link",
    "msgs",
    "obj",
    "opts",
    "outbox",
    "pending",
    "pinned",
    "queued",
    "rcache",
    "ready_at",
    "replay",
    "restarts",
    "seen",
    "spawn_args",
    "state",
    "steps",
    "stop",
    "tier",
    "turn_ns",
    "uid",
    "ver",
    "waiting",
    "wake_at",
    "want_step",
    "win_cpu",
    "win_start",
)

_Base: type = object
if os.environ.get("STEALER_NO_EXTENSIONS", "") in ("", "0"):
    try:
        from stealer._cqueues import Entry as _Base  # type: ignore[no-redef]
    except ImportError:  # not built: the reference queues say so (queues.py)
        pass


class _Entry(_Base):
    """One agent living in this worker's heap."""

    # (its states, for dormant.py, which cannot import this module)
    RUNNABLE = RUNNABLE
    WAITING = WAITING

    __slots__ = ENTRY_FIELDS if _Base is object else ()

    def __init__(self, h: int, link: int) -> None:
        self.h = h
        self.link = link
        self.obj: Any = None
        self.cls: Any = None
        self.spawn_args: tuple = ((), None)
        self.opts = AgentOptions()
        self.tier = 1
        self.deadline: float | None = None
        self.gen = 0
        self.state = RUNNABLE
        self.want_step = True
        self.queued = False
        # made on first use: a million idle agents hold no deques (see Host.take, _send)
        self.pending: collections.deque[int] | None = None
        self.replay = 0  # the first `replay` pending messages were handled before a restore
        self.applied = 0  # handle + 1 of the newest message whose effect is in obj (0: none)
        self.seen = 0  # the mailbox head value walked up to
        self.it: Any = None  # a suspended generator (step or handler)
        # (message, reply, replay, sender, seq, call, chain) of a suspended handler
        self.it_msg: tuple | None = None
        self.waiting: Any = None
        self.frame: Any = None  # fork-join frame of children spawned in this agent
        self.wake_at = 0.0
        self.ready_at = 0
        self.outbox: collections.deque[tuple[int, int]] | None = None
        self.blocked = False
        self.pinned = False  # its state does not pickle: it never moves
        self.stop = False  # AF_STOP seen (adopt, notify, stop_all): stops at its next turn
        self.events = 0  # steps + messages since the last checkpoint
        self.last_ckpt = 0  # D_CKPT value of our latest checkpoint
        self.ckpt_time = time.monotonic_ns()
        self.steps = 0
        self.msgs = 0
        self.handled = 0  # messages handled in the current turn
        self.cpu_ns = 0
        # placement (placement.py): run time per turn (moving average), the last
        # checkpoint's pickling time, when it moved here (0: spawned here)
        self.turn_ns = 0
        self.ckpt_ns = 0
        self.arrived = 0
        self.win_start = 0  # monotonic ns
        self.cur = (h, K_ROOT | F_AGENT, link)  # the worker's `cur` while it runs (spawn())
        self.deadline_ns = 0
        self.win_cpu = 0
        self.restarts: list[float] | None = None
        self.ctx: Ctx | None = None  # made at the first step or handler
        # the journal (agents/journal/): durable id, snapshot version, messages applied per
        # sender (seq), messages sent and agents spawned so far, replies logged for calls
        # a replay makes again, and the last reply given to each calling agent
        self.uid: str | None = None
        self.ver = 0
        self.jseen: dict[str, int] | None = None
        self.jsent = 0
        self.jacked = 0  # jsent when the latest checkpoint was taken: the `ack` we send
        self.jspawned = 0
        self.jreplies: dict[int, tuple] | None = None
        # per calling agent: seq -> (status, value) of the calls answered that the caller's
        # checkpoint may not cover yet (pruned by the `ack` of its later messages)
        self.rcache: dict[str, dict[int, tuple]] | None = None


class CallPending(Pending):
    """A call made by an agent: the reply arrives in record ``rh`` (K_REPLY)."""

    __slots__ = ("rh",)

    def __init__(self, rh: int) -> None:
        super().__init__()
        self.rh = rh
