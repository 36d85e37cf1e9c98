"""Shared fixtures: every test module must leave /dev/shm clean; ``impl``, the queue module
under test.  Helpers shared by several test modules live in tests/rig.py (shared-memory
structures in this process) and tests/probes.py (executors and client processes)."""

from __future__ import annotations

import os
from types import ModuleType

import pytest
from rig import load_impl

SHM = "/dev/shm"


def stealer_files() -> set[str]:
    try:
        return {n for n in os.listdir(SHM) if n.startswith(f"stealer-{os.getpid()}-")}
    except OSError:
        return set()


@pytest.fixture(autouse=True, scope="module")
def no_shm_leak():
    """After each test module, no segment created by this process remains.

    A full collection runs only when segments are left (one held by garbage in a cycle is
    unlinked by its finalizer then): with none left it could change nothing, and it costs
    ~0.3 s per module in a client that has run most of the suite."""
    yield
    import gc

    left = stealer_files()
    if left:
        gc.collect()
        left = stealer_files()
    assert not left, f"shared-memory files leaked: {sorted(left)}"


@pytest.fixture(scope="module", params=["native", "python"])
def impl(request: pytest.FixtureRequest) -> ModuleType:
    """The queue module under test: ``stealer._cqueues`` or ``stealer.shared.pyqueues``."""
    return load_impl(request.param)
