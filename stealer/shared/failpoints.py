"""Failpoints: named places in the worker and the client where a test can inject a fault.

Off by default at the cost of one module-attribute check (``if failpoints.ON``).
A test arms them through the environment, which worker processes inherit::

    STEALER_FAILPOINTS="worker.after_finish=kill;client.result_thread=raise"
    STEALER_FAILPOINTS_DIR=/tmp/some-dir   # optional: "once" across all processes

Each entry is ``name=action`` with an optional ``@N`` (fire on the N-th hit in
this process, default 1) and an optional ``!once`` (fire in only one process
of the whole run: the first to create ``$STEALER_FAILPOINTS_DIR/<name>``).
Actions: ``kill`` (SIGKILL this process), ``exit`` (``os._exit(7)``),
``raise`` (raise :class:`FailpointError`), ``interrupt`` (raise
KeyboardInterrupt), ``sleep<ms>`` (e.g. ``sleep50``).

Hit (``hit(name)``) by the worker (stealer/worker/: loop, join, agents/), the client
(stealer/client/pool.py, deaths.py), the arena and the recovery (stealer/shared/).  The
names (a test arms each in turn, tests/test_failpoints.py):
"""

from __future__ import annotations

import os
import signal
import time

__all__ = ["ON", "POINTS", "FailpointError", "hit", "configure"]

POINTS = {
    # worker side
    "worker.after_take": "a handle was taken off a queue (leased), before start",
    "worker.after_start": "QUEUED -> RUNNING done, before the task body",
    "worker.after_body": "the task body returned or raised, before its result is stored",
    "worker.after_store": "the result is stored, before RUNNING -> DONE",
    "worker.after_finish": "RUNNING -> DONE done, before the completion/ping is published",
    "worker.after_publish": "published, before the current word is cleared",
    "worker.after_spawn": "a child record is set up and leased, before its push",
    "worker.in_join": "a fork-join frame is suspended, before the worker moves on",
    "worker.after_resume": "a frame was resumed from a ping, before it runs",
    "worker.in_collect": "a frame is collecting (freeing) its children's records",
    "worker.join_after_pop": "a blocking join popped a handle (leased), before it runs or goes back",
    "worker.join_after_nested": "a blocking join ran a descendant, the waiting task current again",
    "worker.ping_after_set": "a ping's AF_PINGED bit is set by us, before the push",
    "worker.ping_before_clear": "a ping was popped (leased in W_PING_IN), before its bit is cleared",
    "worker.ping_after_clear": "a ping's bit is cleared, before the frame's children are looked at",
    "recovery.after_take_over": "a recoverer claimed a dead worker's task, before re-run/fail",
    # agents (stealer/worker/agents/, the Host and its pieces)
    "agent.adopt": "an agent record was started here, before its mailbox is walked",
    "agent.turn_enter": "an agent's turn begins (off the run queue), before W_CURRENT is set",
    "agent.step_enter": "a step begins (W_IN_STEP set), before its user code runs",
    "agent.after_step": "an agent step returned, before its outcome is applied",
    "agent.after_handler": "a message handler returned, before the message is marked done",
    "agent.reply_after_claim": "a reply slot claimed (QUEUED -> RUNNING), its reply not stored",
    "agent.after_mark_done": "a message is marked done, before its mailbox slot is given back",
    "agent.ckpt_before_switch": "a checkpoint record is written, before D_CKPT points to it",
    "agent.ckpt_after_switch": "D_CKPT switched, before the old checkpoint and messages are freed",
    "agent.migrate_after_ckpt": "a migrating agent is checkpointed, before RUNNING -> QUEUED",
    "agent.migrate_after_cas": "a migrating agent is QUEUED (leased), before its push",
    "agent.task_call_before_send": "a task's call to an agent: its reply slot is set up and "
    "a child of the task, before the message is sent",
    "agent.finish_after_close": "a finishing agent's mailbox is closed, before calls are failed",
    "agent.inline_turn": "a control agent's turn nested in another's step, before its messages",
    "dormant.adopt_built": "an idle agent's object is built, before it is held dormant",
    "dormant.stop_after_close": "shutdown: a dormant agent's mailbox is closed, before its "
    "final value is published",
    # the agents' journal (stealer/worker/agents/; Executor(journal=...))
    "journal.after_msg_logged": "a worker logged a message, before it reaches the mailbox",
    "journal.after_reply_logged": "a call's reply is logged, before it is stored for the caller",
    "journal.before_snap_logged": "a checkpoint is in shared memory, before its snapshot row",
    "journal.after_end_logged": "an agent's end is logged, before its final value is published",
    # native MPMC rings (native/_cqueues.pyx; kill only; no window in the reference queues,
    # whose ops hold a lock): the claim's CAS done, before the cell is written
    "ring.push_after_claim": "a push claimed a ring position, before the value and seq stores",
    "ring.pop_after_claim": "a pop claimed a ring position, before the cell is released",
    # a worker's records (stealer/shared/arena.py; the native HotPath.c_free for the first): the
    # windows where a record is FREE and on no ring, or off the free ring and nobody's yet
    "record.free_after_state": "a free stored the record's FREE state, before its push",
    "record.alloc_after_pop": "an alloc popped a record index off the free ring, before the "
    "caller has the handle",
    # client side
    "client.result_thread": "the result thread, each loop",
    "client.after_drain": "worker death handling, after draining its completion ring",
    "client.recovery": "worker death handling, before a record is recovered",
}


class FailpointError(RuntimeError):
    """Raised by a failpoint armed with ``raise``."""


_spec: dict[str, tuple[str, int, bool]] = {}
_hits: dict[str, int] = {}
ON = False


def configure(spec: str | None) -> None:
    """Arm failpoints from a spec string (see the module docstring); None or "" disarms."""
    global ON
    _spec.clear()
    _hits.clear()
    for entry in filter(None, (spec or "").split(";")):
        name, _, action = entry.partition("=")
        once = action.endswith("!once")
        action = action.removesuffix("!once")
        action, _, nth = action.partition("@")
        if name not in POINTS:
            raise ValueError(f"unknown failpoint {name!r}; known: {', '.join(POINTS)}")
        _spec[name] = (action, int(nth or 1), once)
    _arm_native()
    ON = bool(_spec)


# fired inside native code (their index is arm_ring_failpoint's); the last one also in the
# Python twin (Arena.free, which hit() serves), so only the first two need the extension
_NATIVE = ("ring.push_after_claim", "ring.pop_after_claim", "record.free_after_state")
_NATIVE_ONLY = _NATIVE[:2]
_native_armed = False


def _arm_native() -> None:
    """Hand the native failpoints to native/_cqueues.pyx (a countdown in C: the window is
    a few instructions inside one ring op, where no Python code runs)."""
    global _native_armed
    armed = [name for name in _NATIVE if name in _spec]
    if not armed and not _native_armed:
        return  # (nothing to disarm: the extension is not even imported)
    _native_armed = bool(armed)
    try:
        from stealer import _cqueues  # type: ignore[attr-defined]
    except ImportError:
        need = [name for name in armed if name in _NATIVE_ONLY]
        if need:  # said once, where it is armed: it would silently never fire
            raise ValueError(f"failpoints {need} need stealer's native extension") from None
        return
    for which, name in enumerate(_NATIVE):
        action, nth, once = _spec.get(name, ("kill", 0, False))
        if action != "kill":
            raise ValueError(f"failpoint {name} only supports the action kill")
        d = os.environ.get("STEALER_FAILPOINTS_DIR") if once else None
        _cqueues.arm_ring_failpoint(which, nth, os.path.join(d, name) if d else None)


def hit(name: str) -> None:
    """Called at failpoint ``name`` (only when ON): fire its action if armed."""
    armed = _spec.get(name)
    if armed is None:
        return
    action, nth, once = armed
    n = _hits[name] = _hits.get(name, 0) + 1
    if n != nth:
        return
    if once:
        d = os.environ.get("STEALER_FAILPOINTS_DIR")
        if d:
            try:
                os.close(os.open(os.path.join(d, name), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                return
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(10)
    elif action == "exit":
        os._exit(7)
    elif action == "raise":
        raise FailpointError(f"failpoint {name}")
    elif action == "interrupt":
        raise KeyboardInterrupt(f"failpoint {name}")
    elif action.startswith("sleep"):
        time.sleep(int(action[5:] or 10) / 1000)
    else:
        raise ValueError(f"unknown failpoint action {action!r}")


configure(os.environ.get("STEALER_FAILPOINTS"))
__doc__ = (__doc__ or "") + "".join(f"\n* ``{k}``: {v}" for k, v in POINTS.items())
