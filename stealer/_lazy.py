"""Import numpy on first use: a worker that never reads a histogram or scans the records
with numpy never pays for it at start (issue 10, start-up).  Used by
stealer/shared/metrics.py, stealer/shared/recovery.py and stealer/bench/lockstep.py."""

from __future__ import annotations

from typing import Any

__all__ = ["lazy_numpy"]


def lazy_numpy(g: dict[str, Any]) -> Any:
    """A stand-in for ``np`` in module globals ``g``: the first attribute read imports numpy
    and puts the real module in its place."""

    class _LazyNumpy:
        def __getattr__(self, name: str) -> Any:
            import numpy

            g["np"] = numpy
            return getattr(numpy, name)

    return _LazyNumpy()
