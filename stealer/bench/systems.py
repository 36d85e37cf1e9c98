"""The executors ``stealer bench`` compares ("systems"): :class:`System` (a name and a factory
``workers -> Executor``), the loaders of stealer, ``process`` and the peers of
:mod:`stealer.bench.peers`, the registry behind ``--systems`` (:func:`register_system`,
:func:`load_systems`, :func:`auto_systems`), and the exceptions a system or workload raises
when it cannot run (:class:`SystemUnavailable`, :class:`NotApplicable`).  Used by
:mod:`stealer.bench.cli`, by every workload module (through :mod:`stealer.bench.harness`) and
by :mod:`stealer.tune`, benchmarks/test_bench.py and benchmarks/journal.py.

Systems: ``stealer`` (:class:`stealer.Executor`; skipped with a message while it does not
import), ``process`` (:class:`concurrent.futures.ProcessPoolExecutor`), and the peers of
:mod:`stealer.bench.peers` (loky, mpire, dask, ray) when installed.  The default ``auto`` is
stealer, process and every installed peer.  :func:`register_system` adds more.  A system that
fails during a workload is reported (table cell ``—``, a note, ``meta.errors`` in the JSON)
and the run goes on; a workload that does not apply to a system (:class:`NotApplicable`: the
stealer-only agent workloads on a plain pool) is a ``—`` cell, an "n/a" note and
``meta.not_applicable``.
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from stealer.bench import peers as _peers

__all__ = [
    "System",
    "SystemUnavailable",
    "NotApplicable",
    "DEFAULT_SYSTEMS",
    "auto_systems",
    "register_system",
    "load_systems",
]

class SystemUnavailable(Exception):
    """A system cannot be used in this environment (not installed, not implemented yet)."""


@dataclass(frozen=True)
class System:
    """An executor kind under test.

    ``make(workers)`` returns a fresh :class:`concurrent.futures.Executor`.  ``forkjoin`` is
    ``"native"`` when the executor runs generator tasks that ``stealer.spawn`` children, else
    ``"flat"`` (the workload decomposes fork-join work on the client side).  ``agents`` is
    ``"native"`` when the executor has ``spawn_agent`` (stealer agents; ``make`` then also takes
    ``records=``), else ``"flat"``: the agent workloads drive the same agents from the client,
    one task per step, and the stealer-only ones (``agent_overhead``, ``agent_scale``) are n/a.
    """

    name: str
    make: Callable[..., cf.Executor]
    forkjoin: str = "flat"
    note: str = ""
    agents: str = "flat"


class NotApplicable(Exception):
    """The workload does not apply to this system (an agent-only workload on a plain pool):
    reported as n/a, not as a failure."""


def _load_stealer() -> System:
    try:
        import stealer
    except Exception as exc:  # any import-time failure of a package under construction
        raise SystemUnavailable(f"'import stealer' failed: {exc!r}") from exc
    executor_cls = getattr(stealer, "Executor", None)
    if executor_cls is None:
        raise SystemUnavailable("stealer.Executor is not defined yet")

    def make(workers: int, **options: Any) -> cf.Executor:
        return executor_cls(max_workers=workers, **options)

    return System("stealer", make, forkjoin="native", agents="native")


def _load_process() -> System:
    def make(workers: int) -> cf.Executor:
        return cf.ProcessPoolExecutor(max_workers=workers)

    return System("process", make, forkjoin="flat")


def _peer_loader(name: str) -> Callable[[], System]:
    def load() -> System:
        try:
            make = _peers.load(name)
        except _peers.PeerUnavailable as exc:
            raise SystemUnavailable(str(exc)) from exc
        return System(name, make, forkjoin="flat")

    return load


_LOADERS: dict[str, Callable[[], System]] = {
    "stealer": _load_stealer,
    "process": _load_process,
    **{name: _peer_loader(name) for name in _peers.PEERS},
}

#: What ``--systems auto`` (the default) means: these plus every installed peer.
DEFAULT_SYSTEMS = ("stealer", "process")


def auto_systems() -> tuple[list[str], list[str]]:
    """``(systems to run, peers not installed)`` for ``--systems auto``."""
    present = _peers.installed()
    missing = [name for name in _peers.PEERS if name not in present]
    return [*DEFAULT_SYSTEMS, *present], missing


def register_system(name: str, loader: Callable[[], System]) -> None:
    """Make ``--systems NAME`` available; ``loader`` returns a :class:`System` or raises
    :class:`SystemUnavailable`."""
    _LOADERS[name] = loader


def load_systems(names: Sequence[str]) -> tuple[list[System], dict[str, str]]:
    """Load the named systems; returns ``(available, {skipped name: reason})``."""
    systems: list[System] = []
    skipped: dict[str, str] = {}
    for name in names:
        loader = _LOADERS.get(name)
        if loader is None:
            skipped[name] = f"unknown system (known: {', '.join(sorted(_LOADERS))})"
            continue
        try:
            systems.append(loader())
        except SystemUnavailable as exc:
            skipped[name] = str(exc)
    return systems, skipped
