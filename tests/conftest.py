"""Shared fixtures: every test session must leave /dev/shm clean."""

from __future__ import annotations

import os

import pytest

SHM = "/dev/shm"


def stealer_files() -> set[str]:
    try:
        return {n for n in os.listdir(SHM) if n.startswith(f"stealer-{os.getpid()}-")}
    except OSError:
        return set()


@pytest.fixture(autouse=True, scope="module")
def no_shm_leak():
    """After each test module, no segment created by this process remains."""
    yield
    import gc

    gc.collect()
    left = stealer_files()
    assert not left, f"shared-memory files leaked: {sorted(left)}"
