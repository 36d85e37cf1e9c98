"""Shared scaffolding of the single-process tests of the shared-memory structures.

* ``IMPLS`` / ``load_impl``: the two queue implementations, ``native``
  (stealer._cqueues, None where the extension is not built) and ``python``
  (stealer.shared.pyqueues).  tests/conftest.py makes the ``impl`` fixture of them.
* ``CONFIGS`` / ``make_rig`` / ``rig_fixture``: a fresh segment in /dev/shm set up
  like stealer/client/pool.py ``_Pool._setup`` does (no processes), with its Arena, for
  each of three configurations:

  - ``native``: native queues, the per-task operations done by ``HotPath``
    (native/_cqueues.pyx);
  - ``native-pyarena``: native queues, the Arena's own Python methods
    (``STEALER_PY_HOTPATH=1``);
  - ``python``: the pure-Python reference queues (``stealer.shared.pyqueues`` has no
    HotPath, so the Arena's Python methods again).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import pytest

from stealer.shared import pyqueues as _pyqueues
from stealer.shared.arena import Arena
from stealer.shared.idle import Idle
from stealer.shared.recovery import Recovery
from stealer.shared.shm import W_CURRENT, Layout, Segment

try:
    from stealer import _cqueues
except ImportError:  # pragma: no cover - depends on the build
    _cqueues = None

IMPLS: dict[str, ModuleType | None] = {"native": _cqueues, "python": _pyqueues}
CONFIGS = ("native", "native-pyarena", "python")


def load_impl(name: str) -> ModuleType:
    """The queue module ``name`` ("native" or "python"); skips the test where it is not built."""
    mod = IMPLS[name]
    if mod is None:
        pytest.skip("native extension not built")
    return mod


# --------------------------------------------------------------------------- rig


@dataclass
class Rig:
    cfg: str
    Q: ModuleType
    seg: Segment
    layout: Layout
    arena: Arena
    injector: Any
    completions: list
    inboxes: list
    recovery: Recovery

    def cur_off(self, k: int) -> int:
        """Worker k's current-task word (W_CURRENT)."""
        return self.layout.worker(k) + W_CURRENT


@contextlib.contextmanager
def _py_hotpath(on: bool) -> Iterator[None]:
    """STEALER_PY_HOTPATH set to 1 (on) or 0 for the duration, then as it was."""
    saved = os.environ.get("STEALER_PY_HOTPATH")
    os.environ["STEALER_PY_HOTPATH"] = "1" if on else "0"
    try:
        yield
    finally:
        if saved is None:
            del os.environ["STEALER_PY_HOTPATH"]
        else:
            os.environ["STEALER_PY_HOTPATH"] = saved


def make_rig(cfg: str, nworkers: int = 2, records: int = 16,
             block_classes: tuple = ((256, 4),)) -> Rig:
    """A fresh segment set up like stealer/client/pool.py ``_Pool._setup`` does (no processes).

    The caller unlinks it (``rig.seg.unlink()``).  Skips the test where ``cfg`` needs
    the native extension and it is not built.
    """
    Q = load_impl("python" if cfg == "python" else "native")
    layout = Layout(nworkers, records=records, block_classes=block_classes, fn_entries=16,
                    fn_data=4096)
    seg = Segment.create(layout, None, Q)
    try:
        r = seg.region
        injector = Q.MPMCRing(r, layout.offsets["injector"], layout.records)
        injector.init()
        with _py_hotpath(cfg == "native-pyarena"):
            arena = Arena(seg, injector)
        arena.init()
        inboxes = []
        for k in range(nworkers):
            Q.Deque(r, layout.deque(k), layout.records).init()
            inbox = Q.MPMCRing(r, layout.inbox(k), layout.records)
            inbox.init()
            inboxes.append(inbox)
        completions = [Q.SPSCRing(r, layout.completion(k), layout.records)
                       for k in range(nworkers)]
        for ring in completions:
            ring.init()
        recovery = Recovery(arena, inboxes, Idle(r, layout), 0)
    except BaseException:
        seg.unlink()
        raise
    # The parametrization means something only if each config takes its own path.
    hot = type(getattr(arena.start, "__self__", None)).__name__ == "HotPath"
    assert hot == (cfg == "native"), (cfg, arena.start)
    return Rig(cfg, Q, seg, layout, arena, injector, completions, inboxes, recovery)


def rig_fixture(**kwargs: Any) -> Callable[..., Iterator[Rig]]:
    """A ``rig`` fixture over CONFIGS: ``make_rig(cfg, **kwargs)``, unlinked afterwards.

    In a test module: ``rig = rig_fixture(nworkers=3)``.
    """

    @pytest.fixture(params=CONFIGS)
    def rig(request: pytest.FixtureRequest) -> Iterator[Rig]:
        made = make_rig(request.param, **kwargs)
        try:
            yield made
        finally:
            made.seg.unlink()

    return rig


def ring_items(ring: Any) -> list[int]:
    """The values on an MPMC ring, in order (popped and pushed back)."""
    items = []
    while (v := ring.pop()) >= 0:
        items.append(v)
    for v in items:
        assert ring.push(v)
    return items


def hold_result_thread(e: Any) -> tuple[Any, Any]:
    """Park ``e``'s result thread inside a done callback until the returned event is set;
    returns (that event, the future whose callback holds it)."""
    import threading

    import tasks

    hold, held = threading.Event(), threading.Event()

    def block(_f: Any) -> None:
        held.set()
        hold.wait(60)

    blocker = e.submit(tasks.square, 2)
    blocker.add_done_callback(block)
    assert held.wait(30), "the result thread never ran the blocking callback"
    return hold, blocker
