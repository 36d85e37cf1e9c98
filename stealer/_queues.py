"""Select the queue implementation: native (Cython) or the pure-Python reference.

``STEALER_NO_EXTENSIONS=1`` forces the reference; if the extension fails to
import, the reference is used and a warning says so once.
"""

from __future__ import annotations

import os
import warnings
from types import ModuleType

__all__ = ["impl", "NATIVE", "load"]


def load(force_python: bool | None = None) -> ModuleType:
    """Return the queue module (``stealer._cqueues`` or ``stealer._pyqueues``)."""
    if force_python is None:
        force_python = os.environ.get("STEALER_NO_EXTENSIONS", "") not in ("", "0")
    if not force_python:
        try:
            from stealer import _cqueues

            return _cqueues
        except ImportError as exc:  # pragma: no cover - depends on the build
            warnings.warn(
                f"stealer: the native extension could not be loaded ({exc}); using the "
                "pure-Python queues, which are much slower. Reinstall with a C compiler "
                "available (pip install --force-reinstall stealer) to fix this.",
                RuntimeWarning,
                stacklevel=2,
            )
    from stealer import _pyqueues

    return _pyqueues


impl = load()
NATIVE: bool = impl.NATIVE
