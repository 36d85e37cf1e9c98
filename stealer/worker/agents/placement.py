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
* **Either way, the imbalance must last.**  Counts at one moment mislead in
  the lockstep pattern: whichever worker got the round's last calls holds a
  backlog at the round's end while its peer idles, every round, with the
  agents already even.  Moving one then makes the peer the straggler of the
  next round, which moves it back (one move per round: 11 to 25 per 1,000
  calls before this rule).  Queue lengths averaged over time mislead too:
  they follow the order the calls arrive in.  What lasts is the share of
  time a worker is busy.  Each worker keeps its own as a time-weighted
  moving average (:class:`BusyShare`, time constant :data:`AVG_TAU_NS`,
  several rounds; busy from its turns, idle from the moment it searches for
  work) and publishes it; agents move only while ours exceeds the peer's by
  :data:`BUSY_GAP` or more and by more than :data:`GAP_AGENTS` times one of
  our agents' share of our time (:func:`lasting`), and at most enough of
  them to close half the gap (:func:`agents_for`).  Moving one agent then
  narrows the gap without swapping it, so it never has to come back.  The
  gap used to be a fixed 0.2, which let a lasting smaller one stand: the two
  vCPUs of the development VM run the same code 10-15% apart for minutes at
  a time, and with 16 lockstep agents on each worker the slower one finished
  last in 183-196 of 200 rounds, 0.8-1.0 ms behind (a tenth of a round),
  while one agent moved over evens them.  A move is taken off at once (our
  share down, the peer's up by a :func:`gift` that fades as its own average
  takes the agents in), so one gap is not closed twice.
* **A worker that just received an agent sends one back only for a bigger
  gap.**  On a shared machine the vCPUs' speeds drift, and a gap of one or
  two agents' shares comes and goes: with the rule above alone, runs of
  2,500-3,000 lockstep rounds on a busy VM moved 0.85-1.4 agents per 1,000
  calls, as many one way as the other (14/14, 50/34).  For
  :data:`REVERSE_NS` after an agent arrived by migration, a worker's gap
  must exceed :data:`GAP_BACK_AGENTS` agents' shares and twice
  :data:`BUSY_GAP` (``lasting(..., back=True)``): a gap that only swapped
  sides stays put, a structural one (a peer left idle, agents that grew
  heavier) still moves.  With two workers this is the move back; with
  more it also slows a chain through the newest receiver, which is no loss.
  And an agent that moved stays where it went for :data:`COOLDOWN_NS` (1 s;
  it was 50 ms, and the same agent went back and forth up to four times in
  a second).
* **And moves are budgeted** (:class:`MoveBudget`): a burst of
  :data:`MOVE_BURST` agents, then :data:`MOVE_RATE` per second per worker.  A
  busy client shares a core with one worker and makes it the slower one
  until the OS moves the client to the other core: the busy shares then
  swap, and without a budget the agents would follow the client back and
  forth.  New agents start spread over the workers (the client places them
  in turn), so the burst is for a real imbalance, and the rate for a slow
  drift.

Costs are measured: every checkpoint times its pickling (``ckpt_ns``); the
restore is taken to cost as much, plus :data:`MOVE_FIXED_NS` for the
transitions, the push and the adoption.  Work per turn is each agent's
moving average of its turns' run time, and the worker's over all its agents
for the backlog.
"""

from __future__ import annotations

import math

__all__ = [
    "AVG_TAU_NS",
    "COOLDOWN_NS",
    "DEFAULT_CKPT_NS",
    "BUSY_GAP",
    "GAP_AGENTS",
    "GAP_BACK_AGENTS",
    "REVERSE_NS",
    "IDLE_SHARE",
    "BusyShare",
    "MOVE_BURST",
    "MOVE_FIXED_NS",
    "MOVE_RATE",
    "MoveBudget",
    "decayed",
    "gain_to_busy",
    "gift",
    "agents_for",
    "gain_to_idle",
    "lasting",
    "move_cost_ns",
    "moves_to_busy",
    "pays_to_idle",
]

# ns: a move's cost beside pickling and unpickling the state (two record transitions, a
# push, a wake-up, the adoption's bookkeeping), measured as a no-state agent's move
MOVE_FIXED_NS = 50_000
DEFAULT_CKPT_NS = 30_000  # ns: pickling time assumed for an agent never checkpointed yet
COOLDOWN_NS = 1_000_000_000  # ns an agent stays on the worker it moved to before moving again
MAX_BATCH = 32  # agents handed to a busy peer at one check (each move pickles one state)
AVG_TAU_NS = 100_000_000  # ns: time constant of the load averages (several lockstep rounds)
BUSY_GAP = 0.05  # busy share by which ours must exceed a peer's before an agent moves to it,
GAP_AGENTS = 1.5  # ... and by more than this many of our agents' shares of our busy time
GAP_BACK_AGENTS = 3.0  # ... or this many, and 2 * BUSY_GAP, within REVERSE_NS of an arrival
REVERSE_NS = 2_000_000_000  # ns after an agent arrived by migration that the higher bar holds
IDLE_SHARE = 0.2  # a peer busy less than this is all but idle: moves to it skip the budget
MOVE_BURST = 32.0  # agents a worker may move at once after a quiet while (MAX_BATCH)
MOVE_RATE = 1.0  # agents per second a worker may move, after its burst


class MoveBudget:
    """A token bucket of moves (:data:`MOVE_BURST`, refilled at :data:`MOVE_RATE` per
    second); one per worker, owned by its host."""

    __slots__ = ("at", "tokens")

    def __init__(self) -> None:
        self.tokens = MOVE_BURST
        self.at = 0  # monotonic ns of the last refill; 0: none yet

    def left(self, now_ns: int) -> int:
        """Moves allowed now."""
        if self.at:
            self.tokens = min(MOVE_BURST, self.tokens + (now_ns - self.at) * MOVE_RATE / 1e9)
        self.at = now_ns
        return int(self.tokens)

    def spend(self, n: int) -> None:
        self.tokens = max(0.0, self.tokens - n)


class BusyShare:
    """The share of its time a worker has been busy, as a time-weighted moving average
    (time constant :data:`AVG_TAU_NS`): kept by that worker's host (busy at each turn,
    idle when the loop searches for work; leaving.py) and published for its peers
    (shm.W_BUSY_AVG), who bring it to their own moment with :func:`decayed`.  Each
    worker averages only its own: one sampling its peers would sample them only while
    busy itself, and every worker would see itself the busier."""

    __slots__ = ("at", "avg", "cur")

    def __init__(self) -> None:
        self.avg = 0.0
        self.at = 0  # monotonic ns of the last update; 0: none yet
        self.cur = 0  # 1 busy, 0 idle, since ``at``

    def update(self, now_ns: int, busy: int) -> float:
        """Busy (1) or idle (0) from ``now_ns`` on; returns the share at ``now_ns``."""
        if self.at:
            self.avg = decayed(self.avg, self.at, now_ns, self.cur)
        else:
            self.avg = float(busy)
        self.at = now_ns
        self.cur = busy
        return self.avg

    def now(self, now_ns: int) -> float:
        """The share at ``now_ns``."""
        return decayed(self.avg, self.at, now_ns, self.cur) if self.at else 0.0

    def take(self, now_ns: int, share: float) -> None:
        """Take ``share`` off (agents that carried it left)."""
        self.avg = max(0.0, self.now(now_ns) - share)
        if self.at:
            self.at = now_ns


def decayed(avg: float, at_ns: int, now_ns: int, value: float) -> float:
    """The average ``avg`` of ``at_ns`` brought to ``now_ns``, ``value`` between."""
    dt = now_ns - at_ns
    if dt <= 0:
        return avg
    return avg + (1.0 - math.exp(-dt / AVG_TAU_NS)) * (value - avg)


def gift(share: float, at_ns: int, now_ns: int) -> float:
    """What is left at ``now_ns`` of a busy ``share`` handed to a peer at ``at_ns`` that
    its own average does not show yet (it takes it in over :data:`AVG_TAU_NS`)."""
    dt = now_ns - at_ns
    return share if dt <= 0 else share * math.exp(-dt / AVG_TAU_NS)


def lasting(gap: float, per: float = 0.0, back: bool = False) -> bool:
    """Is a busy-share ``gap`` (ours minus a peer's) one that moving agents closes, not
    the noise of a lockstep round's arrival order?  ``per``: one of our agents' share of
    our busy time (our share over our agents): a move takes about that off our share and
    adds it to the peer's, so a gap under 1.5 of them would only swap sides.  ``back``:
    an agent arrived here by migration less than :data:`REVERSE_NS` ago, so the gap
    must be bigger (:data:`GAP_BACK_AGENTS` shares, twice :data:`BUSY_GAP`)."""
    if back:
        return gap >= max(2 * BUSY_GAP, GAP_BACK_AGENTS * per)
    return gap >= max(BUSY_GAP, GAP_AGENTS * per)


def agents_for(gap: float, mine: float, agents: int) -> int:
    """How many of our ``agents`` (busy ``mine`` of our time between them) close half a
    busy-share ``gap`` with a peer, at least one."""
    per = mine / max(agents, 1)
    return max(1, int(gap / 2 / per)) if per > 0 else 1


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


def moves_to_busy(mine: int, theirs: int, avg_ns: int, cost_ns: int,
                  cap: int | None = None) -> int:
    """How many agents to hand to a busy peer holding ``theirs`` (runnable agents plus
    pending notifications) when we hold ``mine``, each ``avg_ns`` per turn: half the
    difference (a start-up batch evens out in one go), none unless the first move pays
    twice its cost, never more than ``cap`` (:func:`agents_for` when the busy-share gap
    :func:`lasting`, 0 when it does not)."""
    if mine - theirs < 2:
        return 0
    w = max(avg_ns, 1)
    if gain_to_busy(mine * w, theirs * w, w, cost_ns) <= 2 * cost_ns:
        return 0
    n = (mine - theirs) // 2
    if cap is not None:
        n = min(n, cap)
    return min(MAX_BATCH, n)
