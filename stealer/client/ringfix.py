"""Repair of an MPMC ring cell a dead worker left half-done (client side, after a death).

A Vyukov ring op claims a position with a CAS, then writes the cell (a push: the
value, then ``seq = pos + 1``; a pop: ``seq = pos + capacity``).  A worker killed
between the two leaves the cell claimed and never written, and the ring stops
there for every process: consumers see "empty" at a push's stuck cell, producers
see "full" one lap after a pop's.  So every MPMC op of a worker names its claim
before the CAS (``set_intent``: W_RING_OP = ring offset << 2 | RING_PUSH/RING_POP,
W_RING_POS = position), and after its death the client's ``recover``
(stealer/client/deaths.py) calls :func:`repair` with those two words:

* a push on a free-record or free-block ring (``fill``): the dead worker was giving
  that record or block (W_RING_VAL) back, and no other rule would (it is FREE, and no
  word names it), so it must end up on the ring exactly once (:func:`_fill_push`):

  - its claim made and the cell unwritten (the enqueue position is past it, the
    cell's seq still equals it): the push is finished with that value;
  - no claim of it landed (the position named and nobody claimed it yet, or another
    producer's value is in that cell): ``give_back(ring offset, value)`` pushes it;
  - the cell holds that value (written; maybe taken off since, by an alloc that has
    not set the record up yet, so FREE is no proof of anything): nothing;
  - the position unknown (POS_UNKNOWN: a free names its push with ``pre_push``
    *before* it stores the FREE state, and the push names its position only when it
    claims one): no claim was made, so it is given back if ``owned(ring offset,
    value)`` says the free got that far (the record is FREE: nobody else can have
    made it so, it was the dead worker's);
* a push's claim on any other ring (the injector, an inbox): the cell gets the
  value RING_SKIP and seq = pos + 1; every pop releases such a cell and goes on
  to the next one, so nothing is delivered for it (the value the dead worker
  meant to push is recovered by the rules that cover its other words: its lease,
  current and ping words, records.py, which pushing it here would duplicate);
* a pop's claim (the dequeue position is past it, seq still pos + 1): the cell
  is released (seq = pos + capacity).  The value it held was leased by the dead
  worker before its claim, where the ring has a lease (the injector, an inbox:
  recovery.py's rules); on a free ring (``fill``) it is a record or block index
  that the dead worker's pop never returned: ``give_back(ring offset, value)``
  pushes it again (a free ring's capacity is its count: never full).

Which process made the claim is not known from the ring: the dead worker's
intent names the position it was about to claim, not whether its CAS won.  A
claim that a *live* process made and has not written yet looks the same, and
its intent words name the same position: then the cell is left alone (PENDING)
and the caller asks again later.  A stale intent (an op that finished) never
matches, since positions only grow: its cell's seq has moved past both values.
Client threads hold the GIL across a whole ring op, so none is mid-op here.

The loads are acquire (Region.load64) and pair with the release fence each op
issues after its intent stores and before its CAS (native/_cqueues.pyx
``_say_intent``); the seq is read again after the live intents, so a claimer
that finished meanwhile (its seq store precedes its next intent) is seen.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable
from typing import Any

from stealer.shared._layout import RING_POP, RING_PUSH
from stealer.shared.pyqueues import POS_UNKNOWN, RING_SKIP
from stealer.shared.shm import LINE

__all__ = ["DONE", "NOTHING", "PENDING", "POS_UNKNOWN", "RING_SKIP", "repair"]

NOTHING = "nothing"  # no half-done claim of that intent (the op finished, or never claimed)
DONE = "repaired"  # the cell was half-done: written now
PENDING = "pending"  # a live process's intent names the same claim: ask again later


def repair(region: Any, rings: dict[int, int], op: int, pos: int,
           live: Iterable[tuple[int, int]] = (), value: int = 0,
           fill: Container[int] = (),
           give_back: Callable[[int, int], None] | None = None,
           owned: Callable[[int, int], bool] | None = None) -> str:
    """Repair the cell a dead worker's intent ``(op, pos)`` (W_RING_OP, W_RING_POS) may
    have left half-done.  ``rings``: ring offset -> capacity of every MPMC ring of the
    segment; ``live``: the (op, pos) intents of every live worker; ``value``
    (W_RING_VAL): what a push meant to store, stored if its ring is in ``fill``;
    ``give_back(ring offset, value)``: puts on a ``fill`` ring what a dead pop on it took
    and never returned, or a dead push's value that never landed; ``owned(ring offset,
    value)``: whether a dead push's value was the dead worker's to give back (a record:
    FREE), asked before each give-back of a push's value.  A repair is asked once per
    intent (again only after PENDING): a DONE or NOTHING is final."""
    kind = op & 3
    cap = rings.get(op >> 2)
    if not op or cap is None or kind not in (RING_PUSH, RING_POP):
        return NOTHING  # no op yet, or not a ring of ours (words from a foreign build)
    off = op >> 2
    if kind == RING_PUSH and off in fill:
        return _fill_push(region, off, cap, op, pos, live, value, give_back, owned)
    if pos == POS_UNKNOWN:
        return NOTHING  # (only pushes on free rings name one)
    cell = off + 2 * LINE + 16 * (pos & (cap - 1))
    ahead = region.load64(off if kind == RING_PUSH else off + LINE)  # acquire (position word)
    stuck = pos if kind == RING_PUSH else pos + 1  # the seq of a claimed, unwritten cell
    if ahead <= pos or region.load64(cell) != stuck:  # not claimed, or written
        return NOTHING
    if (op, pos) in set(live):
        return PENDING
    if region.load64(cell) != stuck:  # again, after the live intents (see above)
        return NOTHING
    if kind == RING_PUSH:
        region.store64(cell + 8, value if off in fill else RING_SKIP)  # published by the seq store
        region.store64(cell, pos + 1)  # release: pairs with a pop's acquire load of seq
    else:
        took = region.load64(cell + 8)  # the cell is claimed: no producer can write it
        region.store64(cell, pos + cap)  # release: pairs with the next push's acquire load
        if off in fill and give_back is not None:
            give_back(off, took)
    return DONE


def _fill_push(region: Any, off: int, cap: int, op: int, pos: int,
               live: Iterable[tuple[int, int]], value: int,
               give_back: Callable[[int, int], None] | None,
               owned: Callable[[int, int], bool] | None) -> str:
    """A dead worker's push of ``value`` onto free ring ``off``: make it land exactly once
    (the cases are the module docstring's)."""

    def back() -> str:  # no claim of ours landed: the value is on no ring
        if give_back is None or owned is None or not owned(off, value):
            return NOTHING
        give_back(off, value)
        return DONE

    if pos == POS_UNKNOWN:  # died before the push named (so before it claimed) a position
        return back()
    cell = off + 2 * LINE + 16 * (pos & (cap - 1))
    if region.load64(off) <= pos:  # acquire (enqueue position): nobody claimed it yet, and
        return back()  #              our CAS never will: the value did not land
    seq = region.load64(cell)  # acquire: pairs with the claimer's release store of seq
    if seq == pos:  # claimed, unwritten: ours, or a live producer's still in flight
        if (op, pos) in set(live):
            return PENDING
        seq = region.load64(cell)  # again, after the live intents (module docstring)
        if seq == pos:
            region.store64(cell + 8, value)  # published by the seq store
            region.store64(cell, pos + 1)  # release: pairs with a pop's acquire load of seq
            return DONE
    if seq in (pos + 1, pos + cap):  # written by its claimer, maybe taken off since
        took = region.load64(cell + 8)  # that claim's value: stays until the next lap's push
        if region.load64(off) > pos + cap:  # acquire: a producer of the next lap may have
            return NOTHING  #                  overwritten it: cannot tell (see below)
        return NOTHING if took == value else back()
    # A lap further: what this cell held is gone, and the value may have landed here and
    # been taken since.  Left alone rather than risk a second copy (a record then stays
    # out of the free ring); it takes a ring's capacity of pushes between the death and
    # its repair.
    return NOTHING
