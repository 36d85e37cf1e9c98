"""Peer executors for ``stealer bench``: loky, mpire, Dask and Ray behind one Executor face.

Each peer is a *factory* ``make(workers) -> concurrent.futures.Executor``, loaded by
:func:`load` only when the library imports (:class:`PeerUnavailable` otherwise).  Libraries
that are not ``concurrent.futures`` executors get a small adapter with ``submit`` (returning a
standard :class:`concurrent.futures.Future`), ``map`` (the base class's, built on ``submit``)
and ``shutdown``:

- ``loky``: ``loky.ProcessPoolExecutor`` (already an Executor).
- ``mpire``: :class:`MpireExecutor` over ``mpire.WorkerPool(n_jobs=W)``; ``submit`` is
  ``apply_async`` whose result/error callbacks (run by mpire's result-handler thread) resolve
  the future.
- ``dask``: :class:`DaskExecutor` over a ``distributed.LocalCluster`` of ``W`` worker
  processes with one thread each, and a ``Client``; ``submit`` goes through
  ``client.get_executor(pure=False)``, which resolves standard futures on the client's event
  loop (no thread pool; ``pure=False`` so identical calls are not deduplicated).
- ``ray``: :class:`RayExecutor`: ``ray.init(num_cpus=W)``, ``ray.remote(fn)`` (cached per
  function) and ``ObjectRef.future()``.

None of these libraries is a dependency of stealer; a peer that is not installed is skipped,
and ``stealer bench`` reports a peer that fails mid-run as skipped with its error.  Fork-join
work runs client-driven on every peer (``forkjoin="flat"``, :class:`~stealer.bench.systems.
System`).  Loaded by :mod:`stealer.bench.systems` (``--systems``).
"""

from __future__ import annotations

import concurrent.futures as cf
import importlib
import importlib.util
import logging
import threading
from collections.abc import Callable
from typing import Any

__all__ = [
    "PEERS",
    "MODULES",
    "PeerUnavailable",
    "MpireExecutor",
    "DaskExecutor",
    "RayExecutor",
    "installed",
    "load",
]


class PeerUnavailable(Exception):
    """The peer library is not installed or does not import."""


def _import(module: str, pip_name: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise PeerUnavailable(f"{pip_name} is not installed") from exc
    except Exception as exc:  # a broken installation must not stop the benchmark
        raise PeerUnavailable(f"'import {module}' failed: {exc!r}") from exc


class _AdapterBase(cf.Executor):
    """Shutdown bookkeeping shared by the adapters."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._shutdown = False

    def _check_open(self) -> None:
        if self._shutdown:
            raise RuntimeError("cannot schedule new futures after shutdown")


# --------------------------------------------------------------------------- mpire


class MpireExecutor(_AdapterBase):
    """``mpire.WorkerPool`` as an Executor: ``submit`` is ``apply_async`` with callbacks."""

    def __init__(self, workers: int, pool_cls: Callable[..., Any] | None = None) -> None:
        super().__init__()
        if pool_cls is None:
            pool_cls = _import("mpire", "mpire").WorkerPool
        self._pool = pool_cls(n_jobs=workers)
        self._pending: set[cf.Future[Any]] = set()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> cf.Future[Any]:
        fut: cf.Future[Any] = cf.Future()
        fut.set_running_or_notify_cancel()

        def on_result(value: Any) -> None:
            self._discard(fut)
            if not fut.done():
                fut.set_result(value)

        def on_error(exc: BaseException) -> None:
            self._discard(fut)
            if not fut.done():
                fut.set_exception(exc)

        with self._lock:
            self._check_open()
            self._pending.add(fut)
        try:  # not under the lock: the callbacks take it on mpire's result thread
            self._pool.apply_async(
                fn, args=args, kwargs=kwargs or None, callback=on_result, error_callback=on_error
            )
        except BaseException:
            self._discard(fut)
            raise
        return fut

    def _discard(self, fut: cf.Future[Any]) -> None:
        with self._lock:
            self._pending.discard(fut)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            if self._shutdown:
                return
            self._shutdown = True
            pending = list(self._pending)
        if cancel_futures or not wait:
            self._pool.terminate()
            for f in pending:
                if not f.done():
                    f.set_exception(cf.CancelledError("mpire pool terminated"))
        else:
            self._pool.stop_and_join()


# --------------------------------------------------------------------------- dask


class DaskExecutor(_AdapterBase):
    """A ``distributed.LocalCluster`` (``workers`` processes, 1 thread each) and its client."""

    def __init__(self, workers: int) -> None:
        super().__init__()
        distributed = _import("distributed", "dask[distributed]")
        self._cluster = distributed.LocalCluster(
            n_workers=workers,
            threads_per_worker=1,
            processes=True,
            dashboard_address=None,
            silence_logs=logging.ERROR,
        )
        try:
            self._client = distributed.Client(self._cluster, set_as_default=False)
            self._executor = self._client.get_executor(pure=False)
        except BaseException:
            self._cluster.close()
            raise

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> cf.Future[Any]:
        self._check_open()
        return self._executor.submit(fn, *args, **kwargs)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            if self._shutdown:
                return
            self._shutdown = True
        try:
            self._executor.shutdown(wait=wait and not cancel_futures)
        finally:
            try:
                self._client.close()
            finally:
                self._cluster.close()


# --------------------------------------------------------------------------- ray


class RayExecutor(_AdapterBase):
    """Ray tasks as an Executor: one ``ray.init(num_cpus=workers)`` per executor."""

    def __init__(self, workers: int) -> None:
        super().__init__()
        self._ray = _import("ray", "ray")
        if self._ray.is_initialized():
            raise RuntimeError("ray is already initialized in this process")
        self._ray.init(
            num_cpus=workers, include_dashboard=False, log_to_driver=False,
            logging_level=logging.ERROR,
        )
        self._remote: dict[Any, Any] = {}

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> cf.Future[Any]:
        self._check_open()
        remote = self._remote.get(fn)
        if remote is None:
            remote = self._remote[fn] = self._ray.remote(num_cpus=1)(fn)
        return remote.remote(*args, **kwargs).future()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            if self._shutdown:
                return
            self._shutdown = True
        self._remote.clear()
        self._ray.shutdown()


# --------------------------------------------------------------------------- registry


def _loky() -> Callable[[int], cf.Executor]:
    executor_cls = _import("loky", "loky").ProcessPoolExecutor

    def make(workers: int) -> cf.Executor:
        return executor_cls(max_workers=workers)

    return make


def _mpire() -> Callable[[int], cf.Executor]:
    pool_cls = _import("mpire", "mpire").WorkerPool
    return lambda workers: MpireExecutor(workers, pool_cls)


def _dask() -> Callable[[int], cf.Executor]:
    _import("distributed", "dask[distributed]")
    return DaskExecutor


def _ray() -> Callable[[int], cf.Executor]:
    _import("ray", "ray")
    return RayExecutor


#: Peer name -> loader returning ``make(workers)``; raises :class:`PeerUnavailable`.
PEERS: dict[str, Callable[[], Callable[[int], cf.Executor]]] = {
    "loky": _loky,
    "mpire": _mpire,
    "dask": _dask,
    "ray": _ray,
}


def load(name: str) -> Callable[[int], cf.Executor]:
    """The executor factory of peer ``name``; :class:`PeerUnavailable` when not installed."""
    try:
        loader = PEERS[name]
    except KeyError:
        raise PeerUnavailable(f"unknown peer {name!r}") from None
    return loader()


#: Peer name -> the top-level module whose presence means "installed".
MODULES: dict[str, str] = {"loky": "loky", "mpire": "mpire", "dask": "distributed", "ray": "ray"}


def installed() -> list[str]:
    """Names of the peers whose library is present (found, not imported), in :data:`PEERS`
    order.  A present but broken library fails later, in :func:`load`."""
    names = []
    for name in PEERS:
        try:
            spec = importlib.util.find_spec(MODULES.get(name, name))
        except (ImportError, ValueError):
            spec = None
        # A namespace package is only a directory of that name (Ray's /tmp/ray session
        # folder, when the current directory is /tmp): not the library.
        if spec is not None and spec.origin not in (None, "namespace"):
            names.append(name)
    return names
