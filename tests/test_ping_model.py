"""A model of the fork-join ping bit (stealer/shared/recovery.py Pings) against a sequential oracle.

One frame waits for its children.  Each child, once done, runs the sender's steps
(``or64`` of the bit; push the frame's handle only if it set the bit); the frame's
owner runs the popper's steps (pop a ping; ``and64`` clearing the bit; look at the
children; resume once all are done).  Hypothesis picks the interleaving of those
atomic steps, one actor at a time, and may kill a sender between its ``or64`` and its
push; then the recovery's step runs (a forced ping: ``or64`` and push whatever the
bit said, as pool.recover does with W_PING_OUT).

The oracle is the sequential meaning of a join: the frame resumes exactly once, after
every child is done.  Checked on every schedule:

* no lost wake: once every actor has run to its end and the owner has drained its
  inbox, the frame has resumed;
* no duplicate beyond one: the inbox never holds two pings for the frame, except the
  one extra a recovery may add when the sender it stands in for had pushed already;
* never early: the frame resumes only when all children are done.

The same model with the bit cleared *after* the look (the order the protocol forbids)
loses a wake on a schedule the last test spells out, so the model can fail.
"""

from __future__ import annotations

from collections.abc import Iterator

from hypothesis import given, settings
from hypothesis import strategies as st


class Frame:
    """The shared state: the bit, the owner's inbox, the children's states."""

    def __init__(self, kids: int) -> None:
        self.bit = False
        self.inbox: list[str] = []
        self.done = [False] * kids
        self.resumed = 0
        self.early = False
        self.most = 0  # the most pings the inbox held at once
        self.forced = 0  # recoveries' forced pings

    def or64(self) -> bool:
        old, self.bit = self.bit, True
        return old

    def push(self) -> None:
        self.inbox.append("ping")
        self.most = max(self.most, len(self.inbox))


def sender(f: Frame, i: int, dies: bool) -> Iterator[None]:
    """Child ``i``: done, then the ping (Pings.ping); ``dies`` between its or64 and push."""
    f.done[i] = True
    yield
    already = f.or64()
    yield
    if dies:
        # killed here: its recoverer sees W_PING_OUT and pings again, forced
        yield
        f.or64()
        f.forced += 1
        f.push()
        return
    if not already:
        f.push()


def owner(f: Frame, clear_first: bool = True) -> Iterator[str | None]:
    """The frame's worker: pop a ping, clear the bit, look at the children (on_ping)."""
    while f.resumed == 0:
        if not f.inbox:
            yield "parked"  # only a push brings it back (the scheduler runs others)
            continue
        f.inbox.pop(0)
        yield
        if clear_first:
            f.bit = False  # and64, before the look
            yield
        ready = all(f.done)
        yield
        if not clear_first:
            f.bit = False  # the forbidden order: after the look
            yield
        if ready:
            if not all(f.done):
                f.early = True
            f.resumed += 1


def run(kids: int, schedule: list[int], deaths: set[int], clear_first: bool = True) -> Frame:
    f = Frame(kids)
    actors = [sender(f, i, i in deaths) for i in range(kids)]
    actors.append(owner(f, clear_first))
    live = list(range(len(actors)))
    for pick in schedule:
        a = pick % len(actors)  # actor ``a`` takes one step (none if it has ended)
        if a not in live:
            continue
        try:
            next(actors[a])
        except StopIteration:
            live.remove(a)
    # quiesce: every sender to its end, then the owner until its inbox is empty
    for a in range(kids):
        for _ in actors[a]:
            pass
    for _ in range(1000):  # the owner until it resumed, or parks with nothing to pop
        if f.resumed or (next(actors[kids], None) == "parked" and not f.inbox):
            break
    return f


@settings(max_examples=400, deadline=None)
@given(kids=st.integers(1, 4), schedule=st.lists(st.integers(0, 7), max_size=60),
       deaths=st.sets(st.integers(0, 3), max_size=2))
def test_ping_bit_never_loses_a_wake_nor_piles_up(kids, schedule, deaths):
    deaths = {d for d in deaths if d < kids}
    f = run(kids, schedule, deaths)
    assert f.resumed == 1, "a wake was lost: every child is done, the frame never resumed"
    assert not f.early, "resumed before every child was done"
    assert f.most <= 1 + f.forced, f"{f.most} pings at once for one frame"


def test_the_model_catches_a_clear_after_the_look():
    """Clearing after the look (the order Pings forbids) loses the last child's wake:
    child 0 pings; the owner pops and looks (child 1 not done); child 1 finishes and
    finds the bit still set, so it does not push; the owner clears: nobody pings again."""
    # actors: 0, 1 = children, 2 = owner. Child 0 to its end; the owner pops and looks;
    # child 1 to its end; the owner clears (and parks: its inbox is empty).
    schedule = [0, 0, 0, 2, 2, 1, 1, 1, 2]
    assert run(2, schedule, set(), clear_first=False).resumed == 0
    assert run(2, schedule, set(), clear_first=True).resumed == 1
