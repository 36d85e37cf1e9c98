"""When an agent moves to another worker: only when the expected gain pays for the move.

A move is a checkpoint (the agent's state pickled once), a record transition
and a push, then a restore on the peer (the state unpickled): its cost grows
with the state.  The gain is the time the peer's CPU would otherwise be lost.
Before this rule the host moved an agent whenever a peer looked idle or held
two fewer runnable agents, which in the commonest client pattern -- a client
stepping N agents in lockstep, every agent idle between two calls -- moved
about one agent per eight calls (each a pickle and an unpickle) while the
load was already even: a peer looks idle for a moment at the start of every
round, before its share of the round's calls has reached it.

The rules (pure functions, tested without processes in tests/test_placement.py):

* **An idle peer** (searching or parked) takes the next agent only if the
  peer has nothing on its way (an empty inbox: the client's calls to its own
  agents are there before it wakes) and the move shortens the makespan of
  this worker's backlog by more than twice the move's cost (the agent may
  have to come back once): :func:`pays_to_idle`.
* **A busy peer** takes agents only if it holds fewer (runnable agents plus
  notifications in its inbox) at two checks in a row, and the gain of the
  first move, computed the same way on both backlogs, is more than twice its
  cost: :func:`moves_to_busy`.
* **An agent that just arrived** stays for :data:`COOLDOWN_NS`: no agent
  bounces between two workers faster than that, whatever the counts say.

Costs are measured: every checkpoint times its pickling (``ckpt_ns``); the
restore is taken to cost as much, plus :data:`MOVE_FIXED_NS` for the
transitions, the push and the adoption.  Work per turn is each agent's
moving average of its turns' run time, and the worker's over all its agents
for the backlog.
"""

from __future__ import annotations

__all__ = [
    "COOLDOWN_NS",
    "DEFAULT_CKPT_NS",
    "MOVE_FIXED_NS",
    "gain_to_busy",
    "gain_to_idle",
    "move_cost_ns",
    "moves_to_busy",
    "pays_to_idle",
]

# ns: a move's cost beside pickling and unpickling the state (two record transitions, a
# push, a wake-up, the adoption's bookkeeping), measured as a no-state agent's move
MOVE_FIXED_NS = 50_000
DEFAULT_CKPT_NS = 30_000  # ns: pickling time assumed for an agent never checkpointed yet
COOLDOWN_NS = 50_000_000  # ns an agent stays on the worker it moved to before moving again
MAX_BATCH = 32  # agents handed to a busy peer at one check (each move pickles one state)


def move_cost_ns(ckpt_ns: int) -> int:
    """The cost of moving an agent whose last checkpoint took ``ckpt_ns`` to pickle."""
    return MOVE_FIXED_NS + 2 * (ckpt_ns if ckpt_ns > 0 else DEFAULT_CKPT_NS)


def gain_to_idle(backlog_ns: int, work_ns: int, cost_ns: int) -> int:
    """Makespan saved when an idle peer takes one agent (``work_ns`` per turn) of this
    worker's ``backlog_ns``: it then runs beside the rest, after the move's cost."""
    return backlog_ns - max(backlog_ns - work_ns, cost_ns + work_ns)


def pays_to_idle(backlog_ns: int, work_ns: int, cost_ns: int) -> bool:
    """Hand the next agent to an idle peer with nothing on its way?"""
    return gain_to_idle(backlog_ns, work_ns, cost_ns) > 2 * cost_ns


def gain_to_busy(mine_ns: int, theirs_ns: int, work_ns: int, cost_ns: int) -> int:
    """Makespan of both backlogs saved by moving one agent from ours to theirs."""
    return max(mine_ns, theirs_ns) - max(mine_ns - work_ns, theirs_ns + work_ns + cost_ns)


def moves_to_busy(mine: int, theirs: int, avg_ns: int, cost_ns: int) -> int:
    """How many agents to hand to a busy peer holding ``theirs`` (runnable agents plus
    pending notifications) when we hold ``mine``, each ``avg_ns`` per turn: half the
    difference (a start-up batch evens out in one go), none unless the first move pays
    twice its cost."""
    if mine - theirs < 2:
        return 0
    w = max(avg_ns, 1)
    if gain_to_busy(mine * w, theirs * w, w, cost_ns) <= 2 * cost_ns:
        return 0
    return min(MAX_BATCH, (mine - theirs) // 2)
