"""Control-tier messages handled inside a running step of another agent.

Tiers act at step boundaries: a control-tier call to an agent whose worker is
in the middle of a 5 ms bulk step waited for that step to end (reply p99
5.3-6.7 ms in the ``tiers`` workload).  Now its sender (the client, or an
agent on another worker) signals the owner when it sees it mid-turn
(:func:`signal_if_busy`, called by ``Directory.notify`` for an agent whose
directory flags carry ``AF_CONTROL``), and the owner's handler
(:func:`on_signal`, SIGUSR2) runs the control agent's pending messages right
there, between two bytecodes of the running step: a nested, messages-only
turn.

When it runs, and what a control handler may touch:

* Only inside an agent's *step* (``Host.in_step``), while user code runs
  (``Worker.in_body``), never inside stealer's own bookkeeping (``in_api``:
  a send, a call, a spawn the step makes; ``in_spawn``: fork-join).  Anywhere
  else the signal is ignored and the worker loop handles the message at the
  next turn boundary, as before; except two windows of a step, where the
  message is handled as soon as the step's user code runs again, not after
  the whole step: a signal that lands while the step's turn is being set up,
  or during one of its calls into stealer (a send, a spawn...), is noted
  (``Host.ctl_missed``) and handled when the user code starts or the call
  returns.
* The sender signals only if it sees the owner in a turn (``W_CURRENT``).  A
  message pushed after the worker loop last looked at its inbox but before
  the next turn stores ``W_CURRENT`` gets no signal: so every step of a worker
  that hosts control agents looks at their mailboxes when it starts (after a
  fence that pairs with the sender's, Dekker-style: the sender signals, or
  the owner sees the message, or both).
* Never for the agent that is mid-step: its messages wait for its step to end
  (an agent's handlers and steps never overlap).  Nor for a journaled agent,
  one replaying after a restore, a stopped one, or one suspended in a
  generator: those keep the ordinary turn.
* A control handler runs on its own agent's state only, on the worker's main
  thread, while the interrupted step's frame is paused: it must not touch
  objects it shares with other agents of the process (module globals, caches,
  a class attribute another agent mutates) unless they tolerate being
  entered between two bytecodes, as a signal handler must.  It may reply,
  send, call (a generator handler suspends as usual and resumes at a turn),
  spawn and stop agents.
* The interrupted step's ``step_timeout`` still holds: an alarm that fires
  during the nested turn is raised in the step as soon as the turn ends.
* The running step's CPU time excludes the nested turn's; the control agent
  is charged for it.

Only with the native queues (whose operations are atomic with respect to
Python signal handlers; the reference queues hold a non-reentrant lock).
"""

from __future__ import annotations

import time
from typing import Any

from stealer.shared import failpoints as FP

__all__ = ["SIGNAL", "on_signal", "signal_if_busy"]

from stealer.agents.mailbox import SIGNAL, signal_if_busy  # (the sender's side)


def on_signal(host: Any) -> None:
    """The owner (signal handler): run the pending messages of its control agents now, if
    a step of another agent is running and is in user code."""
    w = host.w
    if not (host.in_step and w.in_body and not host.in_api and not w.in_spawn):
        # between turns, in a message turn, or in stealer's own code: the worker loop sees
        # the notification at the turn's end, but a step about to start would keep it for
        # the whole step (the sender signalled once): Host.step looks at this flag first
        host.ctl_missed = True
        return
    outer = host.current
    if outer is None or outer.tier == 0:
        return  # a control step is never interrupted by another control agent
    host.in_api += 1
    try:
        for e in list(host.controls.values()):
            if e is not outer and _eligible(host, e):
                _nested_turn(host, e, outer)
    finally:
        host.in_api -= 1
    if host.alarm_due:  # the step's own timer fired during the nested turn: raise it now
        host.alarm_due = False
        host.on_alarm_now()


def _eligible(host: Any, e: Any) -> bool:
    if host.agents.get(e.h) is not e or e.uid is not None or e.replay or e.stop:
        return False
    if e.it is not None or e.blocked or e.state >= host.SUSPENDED:  # or finished
        return False
    # AF_NOTIFIED cleared first (seq_cst RMW, as the loop's ping handling does before its
    # walk): the notification of these messages stays queued in our inbox until the step
    # ends, and while the flag stays set a later message sends none, so no signal either,
    # and would wait for the step's end.  Cleared, the next one notifies (a second, harmless
    # ping: the loop's handling of each is idempotent) and signals again.  Then the mailbox
    # chain since our last walk.
    host.dir.clear_notified(e.h)
    host.take(e)
    return bool(e.pending)


def _nested_turn(host: Any, e: Any, outer: Any) -> None:
    w = host.w
    saved = (w.cur, w.frame)
    w.cur = e.cur
    w.frame = e.frame
    host.current = e
    host.in_step = False  # the control handler is not the step (alarms wait: _on_alarm)
    host.nested = True
    t0 = time.monotonic_ns()
    e.handled = 0
    try:
        if FP.ON:
            FP.hit("agent.inline_turn")
        host.deliver_batch(e)
    finally:
        dt = time.monotonic_ns() - t0
        host.nested = False
        host.in_step = True
        host.current = outer
        w.cur, w.frame = saved
        w.in_body = True  # back in the interrupted step's user code
        e.cpu_ns += dt
        e.win_cpu += dt
        host.nested_ns += dt  # taken off the running step's time (Host.turn)
        w.c[host.c_inline] += 1
        host.after_turn(e)
        w.flush_client()  # its replies go out now, throughput mode or not
