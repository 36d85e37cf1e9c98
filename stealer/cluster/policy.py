"""Where work goes between nodes: placement on load reports and the inter-node steal rules.

Owns the decisions only, never the moving: no Ray, no threads, no clock of its own (every
call takes ``now``), so the rules are unit-tested against an in-process fake transport
(tests/test_cluster_policy.py).  Called by the cluster client (``stealer/cluster/client.py``:
:func:`place` for each submitted task) and by each node agent (``stealer/cluster/node.py``:
a :class:`Thief` when the node idles, a :class:`Victim` when a peer asks or when the node has
surplus for a lifeline).

The rules (Satin's cluster-aware random stealing, X10's lifelines):

* **Placement**: power of two choices.  Two distinct nodes drawn at random; the task goes to
  the one whose expected backlog per worker (its last load report plus what the client has
  sent it since) is smaller.  Two choices give an exponentially better maximum load than
  one, and need no global view, only reports that ride on result batches.
* **Local stealing first**: a node's own workers steal from each other in shared memory; a
  node steals from another only when it has been idle (nothing queued, nothing running) for
  ``idle_s``.
* **Asking ahead**: a node with nothing queued steals before its workers run dry, once the
  tasks it has in flight hold less than ``ahead`` measured round trips of work per worker
  (:meth:`Thief.low_water`): the batch then comes back about when its last task ends, where
  a node that asked only once idle left its workers idle for ``idle_s`` and a round trip
  (5-10 ms a time on the 2-node test cluster, one to three times a skew run).  The first
  attempt goes at once; after a failed one the node waits ``idle_s`` again.
* **One outstanding request**: an idle node sends at most one asynchronous steal request at a
  time, to a node drawn at random among the ``most_loaded`` most loaded peers.
* **Half the surplus, one batch**: the victim gives up to half of its surplus (tasks queued
  beyond what its own workers hold) from the steal end of its queue, capped by ``max_count``
  tasks and ``max_bytes`` of payload, in one reply.
* **Worth the trip**: a steal is asked only when the expected saving (the victim-side time of
  the work the thief would take) exceeds ``rtt_factor`` (about 2) times the measured round
  trip of a steal.
* **Lifelines**: after ``max_failed`` failed attempts in a row (an empty reply, or no peer
  worth asking), the thief registers a lifeline with its ``buddies`` (the next nodes in a
  ring of the node ids) and stops asking; a buddy that later has surplus pushes half of it
  to one lifeline thief (one batch, the same caps) and drops the lifeline.  A thief that gets
  work back (a push, a submission) is active again and clears its lifelines.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

__all__ = ["Load", "StealConfig", "RoundTrip", "Thief", "Victim", "place", "backlog_s",
           "linger_for", "grant_count", "buddies_of"]


@dataclass(frozen=True)
class Load:
    """One node's load report, as it rides on a result batch (or a steal reply)."""

    node: str
    workers: int  # the node executor's worker processes
    queued: int = 0  # tasks queued on the node and not yet handed to its workers: stealable
    running: int = 0  # tasks handed to its workers (running, or waiting in their deques)
    task_s: float = 0.0  # mean task duration measured on the node (0: not measured yet)
    at: float = 0.0  # when the node made the report (its clock; only compared with itself)
    # For moving agents between live nodes (stealer/cluster/balance.py) and for the figures
    # `stealer top` shows: the fraction of its workers' time that tasks and agents occupied
    # lately (an exponentially weighted mean over time, 0.1 s), the agents it hosts, those with messages
    # handed to them and not answered (each holds a worker while it has), the tasks it ran,
    # the agent messages it answered, and the tasks it got from / gave to other nodes
    # (steals and lifeline pushes).
    busy: float = 0.0
    agents: int = 0
    active: int = 0
    done: int = 0
    msgs: int = 0
    got: int = 0
    given: int = 0
    # fork-join proxies waiting on a child out on another node (stealer/cluster/children.py):
    # each holds a worker but runs other nodes' children inline, so it counts as free there
    waiting: int = 0

    def per_worker(self, extra: int = 0) -> float:
        """Tasks per worker, counting ``extra`` more sent since the report."""
        return (self.queued + self.running + extra) / max(1, self.workers)


@dataclass(frozen=True)
class StealConfig:
    """The knobs of the steal rules (the defaults are the cluster executor's)."""

    idle_s: float = 0.002  # idle this long before stealing from another node
    most_loaded: int = 2  # the victim is drawn among this many most loaded peers
    max_count: int = 1024  # tasks in one steal (or lifeline push) at most
    max_bytes: int = 8 << 20  # payload bytes in one steal at most
    max_failed: int = 3  # failed attempts in a row before registering lifelines
    buddies: int = 2  # lifelines per thief
    rtt_factor: float = 2.0  # steal only when the saving exceeds this times the round trip
    default_task_s: float = 0.001  # task duration assumed before any was measured
    ahead: float = 2.0  # steal once in-flight work per worker is below this many round trips
    children: int = 1  # fork-join children out per free worker of a hungry peer (0: none)
    child_depth: int = 3  # spawns this near their tree's root are always exportable
    # ... and, while a peer wants children (the want flag), spawns this near (None: all).
    # Deeper ones ran for 0.1-2 ms each in a fib(33) tree and cost round trips of 2-10 ms
    # to move (stealer/cluster/children.py: the trace and the measurements).
    want_depth: int | None = 5
    # a pending child moves to a hungry node only once it waited this many of the measured
    # round trips of a moved child (0: at once): a small tree's children are then claimed
    # back by its own workers before they could pay for the trip (measured: one fib(20)
    # tree, 1.2 ms of work, took 22 ms on a 2-node cluster with its children moving, 5.6 ms
    # without; the figures of this rule are in README's cluster section)
    child_age_rtts: float = 2.0

    def __post_init__(self) -> None:
        if self.child_depth < 0:
            raise ValueError(f"child_depth must be 0 or more, not {self.child_depth}")
        if not self.child_age_rtts >= 0:
            raise ValueError(f"child_age_rtts must be 0 or more, not {self.child_age_rtts}")
        if self.want_depth is not None and self.want_depth < self.child_depth:
            raise ValueError(f"want_depth must be child_depth ({self.child_depth}) or more, "
                             f"or None for any depth, not {self.want_depth}")


class RoundTrip:
    """The measured round trip of a steal: an exponentially weighted mean of the samples."""

    def __init__(self, initial_s: float = 0.001, weight: float = 0.25) -> None:
        self.s = initial_s
        self.samples = 0
        self._w = weight

    def add(self, sample_s: float) -> None:
        if sample_s < 0 or math.isnan(sample_s):
            return
        self.s = sample_s if self.samples == 0 else self.s + self._w * (sample_s - self.s)
        self.samples += 1


def backlog_s(load: Load, cfg: StealConfig) -> float:
    """Seconds of queued (stealable) work per worker on a node, by its report."""
    d = load.task_s if load.task_s > 0 else cfg.default_task_s
    return load.queued * d / max(1, load.workers)


def place(loads: Mapping[str, Load], rng: random.Random,
          sent: Mapping[str, int] | None = None) -> str:
    """Power of two choices: the less loaded of two distinct nodes drawn at random.

    ``sent``: tasks sent to each node since its last report (they count as its load).
    Ties go to the first drawn.  One node: that node.  Raises ValueError on no nodes.
    """
    if not loads:
        raise ValueError("no node to place on")
    names = list(loads)
    if len(names) == 1:
        return names[0]
    a, b = rng.sample(names, 2)
    sent = sent or {}
    la, lb = loads[a].per_worker(sent.get(a, 0)), loads[b].per_worker(sent.get(b, 0))
    return b if lb < la else a


LINGER_SHARE = 0.25  # a node with work queued holds results up to this share of it
LINGER_MAX_S = 0.25  # ... and never longer


def linger_for(linger_s: float, queued: int, task_s: float, workers: int) -> float:
    """How long a node's results() call holds results back while its work still runs:
    ``linger_s``, or a quarter of the work queued there per worker (``queued`` tasks of
    ``task_s`` measured seconds; 0: not measured yet) when that is longer, at most
    LINGER_MAX_S (or ``linger_s`` if the client asked for longer).  Each results() call
    costs the node and the client milliseconds of CPU (on the 2-core test cluster, the
    skew workload: 36 calls per node at a fixed 50 ms, 0.56-0.71 s of both node agents'
    CPU per run; 11-20 this way, 0.47-0.56 s), while a node with seconds of work queued
    has no result anyone needs much sooner."""
    backlog = queued * max(0.0, task_s) / max(1, workers)
    return min(max(linger_s, LINGER_MAX_S), max(linger_s, LINGER_SHARE * backlog))


def grant_count(queued: int, sizes: Sequence[int], cfg: StealConfig) -> int:
    """How many tasks a victim gives from the steal end of its queue: half its surplus,
    capped by ``max_count`` and by ``max_bytes`` (``sizes``: payload bytes of the tasks at
    the steal end, nearest first; a first task larger than the cap still goes alone, or it
    could never move)."""
    n = min(queued // 2, cfg.max_count)
    total = 0
    for i in range(min(n, len(sizes))):
        total += sizes[i]
        if total > cfg.max_bytes:
            return max(1, i)
    return n


def buddies_of(node: str, nodes: Sequence[str], k: int) -> list[str]:
    """The ``k`` nodes after ``node`` in the sorted ring of ``nodes`` (X10's lifeline graph
    is a hypercube; a ring keeps every node on at least one lifeline with few nodes)."""
    ring = sorted(set(nodes) | {node})
    i = ring.index(node)
    out = [ring[(i + j) % len(ring)] for j in range(1, len(ring))]
    return out[:k]


@dataclass
class Thief:
    """A node's side of stealing from others.  The node agent calls :meth:`poll` while it
    idles, :meth:`on_reply` when its request comes back, :meth:`on_work` when work arrives
    by other ways (a submission, a lifeline push)."""

    node: str
    cfg: StealConfig = field(default_factory=StealConfig)
    rng: random.Random = field(default_factory=random.Random)
    rtt: RoundTrip = field(default_factory=RoundTrip)
    outstanding: str | None = None  # the node asked and not answered yet
    sent_at: float = 0.0
    idle_since: float | None = None
    low: bool = False  # running low (tasks in flight, nothing queued), not idle
    failed: int = 0  # failed attempts in a row
    lifelines: list[str] = field(default_factory=list)  # buddies holding our lifeline
    fed: int = 0  # work arrivals so far: lifelines registered before one are used up

    def idle(self, now: float, low: bool = False) -> None:
        """The node has nothing queued and nothing running (from ``now`` if not before);
        ``low``: nothing queued and at most :meth:`low_water` tasks in flight (it asks
        ahead: its first attempt goes without waiting ``idle_s``)."""
        if self.idle_since is None:
            self.idle_since = now
        self.low = low

    def low_water(self, workers: int, task_s: float) -> int:
        """The tasks in flight at or below which a node with nothing queued asks ahead:
        those holding less than ``ahead`` round trips of work per worker (0, i.e. only
        once idle, while the tasks' length is not measured)."""
        if task_s <= 0 or self.cfg.ahead <= 0:
            return 0
        return int(max(1, workers) * self.cfg.ahead * self.rtt.s / task_s)

    def on_work(self) -> None:
        """Work arrived: the node is busy; its failures and lifelines are forgotten."""
        self.idle_since = None
        self.low = False
        self.failed = 0
        self.lifelines = []
        self.fed += 1

    def worth(self, load: Load) -> bool:
        """The round-trip rule: what the thief would take (half the victim's surplus,
        capped) is worth more victim-side time than ``rtt_factor`` round trips."""
        take = min(load.queued // 2, self.cfg.max_count)
        if take <= 0:
            return False
        d = load.task_s if load.task_s > 0 else self.cfg.default_task_s
        saving = take * d / max(1, load.workers)
        return saving > self.cfg.rtt_factor * self.rtt.s

    def poll(self, now: float, loads: Mapping[str, Load]) -> str | None:
        """The node to send a steal request to now, or None.  Registers the request as
        outstanding (one at a time).  Called as often as the node likes while it idles."""
        if self.outstanding is not None or self.lifelines or self.idle_since is None:
            return None
        if now - self.idle_since < self.cfg.idle_s and not (self.low and self.failed == 0):
            return None
        peers = [ld for n, ld in loads.items() if n != self.node and self.worth(ld)]
        if not peers:
            self._fail(now, loads)
            return None
        peers.sort(key=lambda ld: backlog_s(ld, self.cfg), reverse=True)
        victim = self.rng.choice(peers[: max(1, self.cfg.most_loaded)]).node
        self.outstanding, self.sent_at = victim, now
        return victim

    def on_reply(self, now: float, victim: str, got: int, loads: Mapping[str, Load]) -> None:
        """The outstanding request to ``victim`` came back with ``got`` tasks (0: refused,
        or nothing there by the time it arrived; also after a lost request, with 0)."""
        if victim != self.outstanding:
            return  # a reply to a request we no longer wait for
        self.outstanding = None
        self.rtt.add(now - self.sent_at)
        if got > 0:
            self.on_work()
        else:
            self._fail(now, loads)

    def _fail(self, now: float, loads: Mapping[str, Load]) -> None:
        self.failed += 1
        self.idle_since = now  # the next attempt waits idle_s again: no busy asking
        if self.failed >= self.cfg.max_failed:
            self.lifelines = buddies_of(self.node, list(loads), self.cfg.buddies)
            if self.node in self.lifelines:
                self.lifelines.remove(self.node)

    def registrations(self) -> list[str]:
        """The buddies to register lifelines with (empty unless :meth:`poll` gave up)."""
        return list(self.lifelines)


@dataclass
class Victim:
    """A node's side of being stolen from: what to give a thief, and the lifelines of
    thieves that gave up, pushed to when this node has surplus."""

    node: str
    cfg: StealConfig = field(default_factory=StealConfig)
    lifelines: list[str] = field(default_factory=list)  # thieves waiting for our surplus

    def grant(self, queued: int, sizes: Sequence[int]) -> int:
        """Tasks to give one steal request now (see :func:`grant_count`)."""
        return grant_count(queued, sizes, self.cfg)

    def register(self, thief: str) -> None:
        if thief != self.node and thief not in self.lifelines:
            self.lifelines.append(thief)

    def forget(self, thief: str) -> None:
        if thief in self.lifelines:
            self.lifelines.remove(thief)

    def pushes(self, queued: int, sizes: Sequence[int],
               alive: Callable[[str], bool] = lambda _n: True) -> tuple[str, int] | None:
        """The lifeline push to make now: (thief, count), half the surplus to the thief that
        registered first, or None.  That thief is dropped from the lifelines (it registers
        again if it runs dry again); dead thieves are dropped.  One batch per call: a node
        still in surplus pushes to the next thief at its next call."""
        self.lifelines = [t for t in self.lifelines if alive(t)]
        if not self.lifelines:
            return None
        n = grant_count(queued, sizes, self.cfg)
        if n <= 0:
            return None
        return self.lifelines.pop(0), n
