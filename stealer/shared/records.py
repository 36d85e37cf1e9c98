"""The task-record lifecycle: named states, one 64-bit word, generation-checked transitions.

Every task lives in a record (layout in stealer/shared/_layout.py).  Its first word
holds the generation, the state and *who* holds it::

    bits  0-31  generation: bumped each time the record is freed
    bits 32-39  state (S_*)
    bits 40-63  who: index + 1 of the worker that holds it (0: nobody, or the client)

A *handle* is ``generation << 32 | index``.  Every transition is one CAS on
the word that expects the handle's generation (and the state and holder
the actor believes in), so an actor with a stale handle, or a process that
died and was replaced, can never act on a recycled record: its CAS fails
and it gets a named outcome back instead.

::

             alloc (client submit / worker spawn; exclusive: popped from the free ring)
    FREE ───────────────▶ QUEUED ──cancel (client)──▶ CANCELLED ──claim (whoever takes it)──┐
      ▲                    │  ▲                                                              │
      │              start │  │ requeue (recoverer, a retry after the holder died)           │
      │          (worker k)▼  │                                                              │
      │                  RUNNING|k ── finish (worker k: result stored first) ──▶ DONE|k       │
      │                    │                                                      │           │
      │          take_over (k died) ─▶ RECOVERING|me ── fail (no retries left) ───┘           │
      │                                       └── requeue (a retry) ──▶ QUEUED                │
      │                                                                           │ consume   │
      │                                                       (client: root; parent: child)   │
      │                                                                           ▼           │
      └──────────────── release: payloads dropped, generation + 1 ◀──── FREEING|me ◀──────────┘

* QUEUED: the call payload is intact; the handle sits in a queue, possibly
  twice (a recoverer re-pushes a handle a dead worker had taken; ``start``
  lets exactly one copy win, stale copies fail their CAS and are dropped).
* RUNNING|k: worker k claimed it.  A fork-join task stays RUNNING|k while
  suspended: its frame lives in worker k's heap (R_OWNER, R_INCARNATION).
  The call payload stays until the record is freed, so a task whose worker
  died can be re-run (at-least-once for side effects).
* DONE|k: the result (R_RCLASS/R_RREF/R_RLEN, R_STATUS) was stored *before*
  the CAS.  Worker k then publishes it (a root: its completion ring; a
  child: a ping to the parent's owner).  If k dies in between, the
  recoverer sees DONE|k and publishes it again where that is idempotent.

Recovery after worker k dies (stealer/shared/recovery.py's rules, run by
stealer/client/deaths.py) reads only words: W_CURRENT and W_LEASE of the dead worker name
at most two handles; the state and holder in their words say what the dead worker had done
with them.

Used by everything that moves a record through these states: the client (its executor,
futures, pool's deaths, the agents' client), the worker (its loop, the agents' host), the
arena and the recovery.
"""

from __future__ import annotations

import enum
from typing import Any

from stealer.shared._layout import (
    GEN_MASK,
    S_CANCELLED,
    S_DONE,
    S_FREE,
    S_FREEING,
    S_QUEUED,
    S_RECOVERING,
    S_RUNNING,
    STATE_MASK,
    STATE_SHIFT,
    WHO_SHIFT,
)

__all__ = ["Outcome", "word", "unpack", "STATE_NAMES", "Transitions"]

STATE_NAMES = {S_FREE: "free", S_QUEUED: "queued", S_RUNNING: "running",
               S_CANCELLED: "cancelled", S_DONE: "done", S_FREEING: "freeing",
               S_RECOVERING: "recovering"}


class Outcome(enum.IntEnum):
    """What a transition found: it happened, or why not."""

    OK = 0  # the CAS succeeded
    STALE = 1  # the generation moved on: the record was freed (and maybe reused)
    CONFLICT = 2  # same generation, another state or holder: somebody else acted first


def word(gen: int, state: int, who: int = 0) -> int:
    """The state word for generation ``gen``, ``state`` held by ``who`` (worker index + 1)."""
    return (gen & GEN_MASK) | (state << STATE_SHIFT) | (who << WHO_SHIFT)


def unpack(w: int) -> tuple[int, int, int]:
    """(generation, state, who) of a state word."""
    return w & GEN_MASK, (w >> STATE_SHIFT) & STATE_MASK, w >> WHO_SHIFT


class Transitions:
    """The named transitions over the records of one segment (any process).

    ``region`` is the segment's Region (seq_cst CAS on 64-bit words);
    ``off(h)`` gives a record's byte offset.  The hot ones (submit, start,
    finish of inline results) are also done in one native call each by
    HotPath in native/_cqueues.pyx, with the same words.
    """

    def __init__(self, region: Any, off: Any) -> None:
        self.r = region
        self.off = off

    def load(self, h: int) -> tuple[int, int, int]:
        """(generation, state, who) of the record ``h`` names (acquire load)."""
        return unpack(self.r.load64(self.off(h)))  # pairs with every CAS/store below

    def current(self, h: int) -> bool:
        """True if ``h`` still names the record (same generation)."""
        return self.r.load64(self.off(h)) & GEN_MASK == h >> 32

    def state(self, h: int) -> tuple[int, int] | None:
        """(state, who) if ``h`` is current, else None."""
        g, s, who = self.load(h)
        return (s, who) if g == h >> 32 else None

    def cas(self, h: int, old: int, old_who: int, new: int, new_who: int) -> Outcome:
        """Move ``h`` from state ``old`` held by ``old_who`` to ``new`` held by ``new_who``."""
        gen = h >> 32
        # seq_cst CAS on the state word: pairs with every other transition's CAS
        if self.r.cas64(self.off(h), word(gen, old, old_who), word(gen, new, new_who)):
            return Outcome.OK
        return Outcome.CONFLICT if self.current(h) else Outcome.STALE

    # The transitions, by name (see the diagram in the module docstring).
    def cancel(self, h: int) -> Outcome:
        """Client: withdraw a queued task (the worker that later takes it frees it)."""
        return self.cas(h, S_QUEUED, 0, S_CANCELLED, 0)

    def finish(self, h: int, who: int) -> Outcome:
        """Worker who-1: the result is stored; publish it next."""
        return self.cas(h, S_RUNNING, who, S_DONE, who)

    def requeue(self, h: int, me: int) -> Outcome:
        """Recoverer ``me`` (after take_over): make ``h`` runnable again (a retry)."""
        return self.cas(h, S_RECOVERING, me, S_QUEUED, 0)

    def fail(self, h: int, me: int) -> Outcome:
        """Recoverer ``me`` (after take_over): no retry is left; the error is stored."""
        return self.cas(h, S_RECOVERING, me, S_DONE, me)

    def take_over(self, h: int, state: int, who: int, me: int) -> Outcome:
        """Recoverer: ``h`` is RUNNING (or RECOVERING) held by dead worker who-1; claim it
        to re-run or fail it (RECOVERING|me); only one recoverer wins."""
        return self.cas(h, state, who, S_RECOVERING, me)

    def claim(self, h: int, state: int, who: int, me: int) -> Outcome:
        """Take ``h`` (in ``state`` held by ``who``) for release: only one claimer wins."""
        return self.cas(h, state, who, S_FREEING, me)
