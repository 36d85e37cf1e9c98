"""The progress bar of the tools (``stealer bench``, ``stealer tune``): the core's.

It lives in :mod:`stealer.client.progress` so that ``Executor.map(..., progress=True)`` (core) can
draw it without importing the tools layer; see that module for how to use it.
"""

from __future__ import annotations

from stealer.client.progress import Progress, render_bar

__all__ = ["Progress", "render_bar"]
