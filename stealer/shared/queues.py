"""Select the queue implementation: native (Cython) or the pure-Python reference.

``STEALER_NO_EXTENSIONS=1`` forces the reference; if the extension fails to
import, the reference is used and a warning says so once.  Used by the client
(stealer/client/pool.py picks the implementation and passes the choice to its workers),
each worker (stealer/worker/loop.py) and stealer/shared/shm.py.
"""

from __future__ import annotations

import os
import warnings
from types import ModuleType

__all__ = ["impl", "NATIVE", "load"]


def load(force_python: bool | None = None) -> ModuleType:
    """Return the queue module (``stealer._cqueues`` or ``stealer.shared.pyqueues``)."""
    if force_python is None:
        force_python = os.environ.get("STEALER_NO_EXTENSIONS", "") not in ("", "0")
    if not force_python:
        try:
            from stealer import _cqueues

            return _cqueues
        except ImportError as exc:  # pragma: no cover - depends on the build
            warnings.warn(_why_no_extension(exc), RuntimeWarning, stacklevel=2)
    from stealer.shared import pyqueues as _pyqueues

    return _pyqueues


def _why_no_extension(exc: ImportError) -> str:
    """Say what actually happened: no extension was built, or one was built but fails."""
    import glob

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # stealer/
    built = glob.glob(os.path.join(here, "_cqueues*.so")) + glob.glob(
        os.path.join(here, "_cqueues*.pyd"))
    if not built:
        return ("stealer: this installation has no native extension (stealer/_cqueues*.so "
                "was not built: the package was installed with STEALER_NO_EXTENSIONS=1, or "
                "from a source without Cython and a C compiler), so the pure-Python "
                "reference queues are used: several times slower, and a worker killed while "
                "holding their lock breaks the executor. Set STEALER_NO_EXTENSIONS=1 at "
                "run time to silence this, or reinstall with Cython and a C compiler "
                "(pip install --force-reinstall --no-binary stealer stealer).")
    return (f"stealer: the native extension {os.path.basename(built[0])} exists but does not "
            f"load ({exc}); it was probably built for another Python or platform. Using the "
            "pure-Python reference queues (several times slower, not kill-safe). Reinstall "
            "stealer in this environment (pip install --force-reinstall stealer) to rebuild "
            "it.")


impl = load()
NATIVE: bool = impl.NATIVE
