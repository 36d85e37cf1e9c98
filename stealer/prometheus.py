"""Opt-in Prometheus endpoint for an executor (``pip install prometheus-client``).

::

    import stealer.prometheus

    server = stealer.prometheus.serve_metrics(executor)      # or an executor id
    ...                                                       # scrape server.url
    server.shutdown()

(:func:`serve` does the same and returns ``(server, port)``.)  This is a tool
on top of the executor, not part of it: the core never imports this module.

Every scrape takes a fresh snapshot (:meth:`stealer.Executor.stats`, or
:func:`stealer.client.stats.collect` on a segment attached by id) through a custom
collector registered in its own ``CollectorRegistry`` (never the global
one).  Exported families (``<c>`` is every entry of
:data:`stealer.shared.metrics.COUNTERS`)::

    stealer_up                                 1 while the executor runs, else 0 (and nothing else)
    stealer_info{id,client_pid}                1
    stealer_uptime_seconds                     gauge
    stealer_workers                            gauge: worker slots
    stealer_workers_running                    gauge: workers running a task now
    stealer_queue_depth{queue="injector"}      gauge
    stealer_queue_depth{queue="deque"|"inbox",worker="k"}
    stealer_worker_<c>_total{worker="k"}       counter (busy_ns is in nanoseconds)
    stealer_client_pending / _backlog          gauges  (from an Executor object only)
    stealer_client_crashes_total / _replacements_total   counters (idem)
    stealer_latency_seconds{tier,kind,quantile="0.5|0.9|0.99|0.999"}  summary, with
    stealer_latency_seconds_count / _sum{tier,kind}

Latency quantiles are cumulative since the executor started (the
histograms are never reset) and come from log-linear buckets, within 0.8%.
For windowed percentiles use ``rate(..._sum) / rate(..._count)`` for means,
or ``stealer top``.  A worker replaced after a crash restarts its counters
from zero, which Prometheus' ``rate()`` treats as a counter reset.

:func:`text` renders the same exposition text (format 0.0.4, byte for byte
what prometheus_client would write) from a snapshot without a server and
without prometheus_client installed: ``stealer top --prometheus`` uses it.
The server binds to 127.0.0.1 unless told otherwise: the metrics name
processes and workload shapes, so expose them deliberately.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from stealer.client.stats import Stats, collect, executor_gone
from stealer.shared import metrics

if TYPE_CHECKING:
    from stealer.client.executor import Executor

__all__ = ["serve_metrics", "serve", "text", "families", "Family", "MetricsServer", "StealerCollector"]

QUANTILES = (0.5, 0.9, 0.99, 0.999)
MIN_VERSION_RETURNING_SERVER = (0, 17)  # start_http_server returns (server, thread) since 0.17

_COUNTER_HELP = {
    "tasks": "Steps run (a task, or one resumption of a fork-join task)",
    "steals": "Successful steals (batches) from a peer's deque",
    "steal_attempts": "Steal calls on a peer's deque",
    "parks": "Times the worker went to sleep on its futex",
    "wakeups": "Parks that ended by a notification (not a timeout)",
    "injector_takes": "Batches taken from the client's injector",
    "spawns": "Children spawned",
    "resumes": "Suspended tasks resumed after their children",
    "errors": "Tasks that raised",
    "busy_ns": "Nanoseconds spent running task code",
}
_CLIENT = {  # client field -> (type, help)
    "pending": ("gauge", "Tasks submitted and not yet resolved"),
    "backlog": ("gauge", "Submitted tasks waiting in the client for a free record"),
    "crashes": ("counter", "Worker processes that died unexpectedly"),
    "replacements": ("counter", "Worker processes started to replace others"),
    "rings_repaired": ("counter", "Shared ring cells a killed worker left half-done, repaired"),
}


def _require() -> Any:
    """prometheus_client, or an ImportError that says how to install it."""
    try:
        import prometheus_client
    except ImportError as exc:
        raise ImportError(
            "stealer.prometheus needs the prometheus_client package to serve metrics: "
            "pip install prometheus-client (or pip install 'stealer[prometheus]')") from exc
    return prometheus_client


# -- the metric families, independent of prometheus_client ---------------------


@dataclass
class Family:
    """One metric family: ``name`` without the ``_total`` of counters; samples are full names."""

    name: str
    type: str  # "counter" | "gauge" | "summary"
    help: str
    samples: list[tuple[str, dict[str, str], float]] = field(default_factory=list)

    def add(self, value: float, suffix: str = "", **labels: str) -> None:
        self.samples.append((self.name + suffix, labels, value))


def _down() -> list[Family]:
    up = Family("stealer_up", "gauge", "1 while the executor runs, 0 once it is gone")
    up.add(0)
    return [up]


def families(stats: Stats) -> list[Family]:
    """The exported metric families of one snapshot."""
    out: list[Family] = []
    up = Family("stealer_up", "gauge", "1 while the executor runs, 0 once it is gone")
    up.add(1)
    out.append(up)
    info = Family("stealer_info", "gauge", "Executor id (its /dev/shm segment) and client pid")
    parts = stats.id.split("-")
    info.add(1, id=stats.id, client_pid=parts[1] if len(parts) == 3 else "")
    out.append(info)
    g = Family("stealer_uptime_seconds", "gauge", "Seconds since the executor started")
    g.add(stats.uptime_s)
    out.append(g)
    g = Family("stealer_workers", "gauge", "Worker slots of the executor")
    g.add(len(stats.workers))
    out.append(g)
    g = Family("stealer_workers_running", "gauge", "Workers running a task now")
    g.add(sum(w.running for w in stats.workers))
    out.append(g)

    q = Family("stealer_queue_depth", "gauge",
               "Tasks queued: the client's injector, each worker's deque and inbox (resumes)")
    q.add(stats.injector_depth, queue="injector")
    for w in stats.workers:
        q.add(w.deque_depth, queue="deque", worker=str(w.index))
    for w in stats.workers:
        q.add(w.inbox_depth, queue="inbox", worker=str(w.index))
    out.append(q)

    for c in metrics.COUNTERS:
        f = Family(f"stealer_worker_{c}", "counter",
                   _COUNTER_HELP.get(c, f"Worker counter {c}") + ", per worker")
        for w in stats.workers:
            f.add(w.counters.get(c, 0), "_total", worker=str(w.index))
        out.append(f)

    for key, value in stats.client.items():
        typ, doc = _CLIENT.get(key, ("gauge", f"Client value {key}"))
        f = Family(f"stealer_client_{key}", typ, doc)
        f.add(value, "_total" if typ == "counter" else "")
        out.append(f)

    lat = Family("stealer_latency_seconds", "summary",
                 "Queue wait (submit or spawn to start) and run time of task steps per tier, "
                 "cumulative since the executor started (quantiles within 0.8%)")
    for tier in metrics.TIER_NAMES:
        kinds = stats.latency.get(tier, {})
        for kind in metrics.KINDS:
            h = kinds.get(kind) or metrics.Histogram()
            for qv in QUANTILES:
                lat.add(h.percentile(qv * 100) / 1e9, tier=tier, kind=kind, quantile=str(qv))
            lat.add(h.total, "_count", tier=tier, kind=kind)
            lat.add(h.sum_ns / 1e9, "_sum", tier=tier, kind=kind)
    out.append(lat)
    return out


def _go_float(v: float) -> str:
    """A value as prometheus_client writes it (Go's float formatting)."""
    d = float(v)
    if math.isnan(d):
        return "NaN"
    if math.isinf(d):
        return "+Inf" if d > 0 else "-Inf"
    s = repr(d)
    dot = s.find(".")
    if d > 0 and dot > 6:  # Go switches to exponents sooner than Python
        mantissa = f"{s[0]}.{s[1:dot]}{s[dot + 1:]}".rstrip("0.")
        return f"{mantissa}e+{dot - 1:02d}"
    return s


def _escape(v: str) -> str:
    return v.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def render_text(fams: list[Family]) -> str:
    """Prometheus text exposition format 0.0.4 of some families."""
    out = []
    for f in fams:
        head = f.name + "_total" if f.type == "counter" else f.name
        doc = f.help.replace("\\", r"\\").replace("\n", r"\n")
        out.append(f"# HELP {head} {doc}\n# TYPE {head} {f.type}\n")
        for name, labels, value in f.samples:
            lab = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels.items()))
            out.append(f"{name}{{{lab}}} {_go_float(value)}\n" if lab
                       else f"{name} {_go_float(value)}\n")
    return "".join(out)


def _snapshot(source: Stats | Executor | str) -> Stats:
    if isinstance(source, Stats):
        return source
    if isinstance(source, str):
        from stealer.shared.shm import Segment

        return collect(Segment.attach_any(os.path.basename(source)))
    return source.stats()


def text(stats: Stats | Executor | str) -> str:
    """The exposition text of a snapshot (or of an executor, or an executor id, now).

    Needs no server and no prometheus_client.
    """
    return render_text(families(_snapshot(stats)))


# -- prometheus_client glue -----------------------------------------------------


def _snapshotter(source: Executor | str) -> Callable[..., Stats | None]:
    """A function returning a fresh snapshot, or None once the executor is gone.

    Its ``agents`` argument (default True) goes to :func:`collect` / ``Executor.stats``
    (the dashboard's sampler scans agents less often than it samples).
    """
    if isinstance(source, str):
        from stealer.shared.shm import Segment

        exec_id = os.path.basename(source)
        seg = Segment.attach_any(exec_id)  # ValueError / FileNotFoundError for a bad id

        def snap(agents: bool = True) -> Stats | None:
            return None if executor_gone(exec_id) else collect(seg, agents=agents)

        return snap
    if not callable(getattr(source, "stats", None)):
        raise TypeError(f"serve() takes a stealer.Executor or an executor id, not "
                        f"{type(source).__name__}")
    ex = source
    exec_id = ex.id

    def snap_ex(agents: bool = True) -> Stats | None:
        if executor_gone(exec_id):
            return None
        try:
            return ex.stats(agents=agents)
        except Exception:
            if executor_gone(exec_id):  # shut down while we read
                return None
            raise

    return snap_ex


class StealerCollector:
    """A prometheus_client collector: each ``collect()`` takes a fresh snapshot."""

    def __init__(self, snapshot: Callable[[], Stats | None]) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterator[Any]:
        from prometheus_client.metrics_core import Metric

        s = self.snapshot()
        for f in families(s) if s is not None else _down():
            m = Metric(f.name, f.help, f.type)
            for name, labels, value in f.samples:
                m.add_sample(name, labels, value)
            yield m


class MetricsServer:
    """The running HTTP endpoint: ``port``, ``url``, ``shutdown()``; also a context manager."""

    def __init__(self, httpd: Any, thread: threading.Thread | None) -> None:
        self.httpd = httpd
        self.thread = thread
        self.addr = httpd.server_address[0]
        self.port: int = httpd.server_address[1]
        self._lock = threading.Lock()
        self._closed = False

    @property
    def url(self) -> str:
        host = f"[{self.addr}]" if ":" in self.addr else self.addr
        return f"http://{host}:{self.port}/metrics"

    def shutdown(self) -> None:
        """Stop serving and close the socket (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.httpd.shutdown()
        self.httpd.server_close()
        if self.thread is not None:
            self.thread.join(5.0)

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return f"<MetricsServer {self.url}{' (closed)' if self._closed else ''}>"


def _version(pc: Any) -> tuple[int, ...]:
    try:
        from importlib.metadata import version

        raw = version("prometheus-client")
    except Exception:
        raw = getattr(pc, "__version__", "0")
    parts = []
    for p in raw.split(".")[:3]:
        digits = "".join(ch for ch in p if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def _start_own(registry: Any, port: int, addr: str) -> tuple[Any, threading.Thread]:
    """What start_http_server does, for prometheus_client < 0.17 (which returns nothing)."""
    import socket
    from wsgiref.simple_server import WSGIRequestHandler, make_server

    from prometheus_client.exposition import ThreadingWSGIServer, make_wsgi_app

    class Quiet(WSGIRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass

    class Server(ThreadingWSGIServer):
        address_family = socket.AF_INET6 if ":" in addr else socket.AF_INET

    httpd = make_server(addr, port, make_wsgi_app(registry), Server, handler_class=Quiet)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True,
                              name="stealer-prometheus")
    thread.start()
    return httpd, thread


def serve(executor_or_id: Executor | str, port: int = 0,
          addr: str = "127.0.0.1") -> tuple[MetricsServer, int]:
    """Serve ``/metrics`` for an executor (object or id) on ``addr:port``.

    ``port=0`` binds an ephemeral port; the bound port is returned with the
    server.  Call ``server.shutdown()`` when done (the thread is a daemon,
    so it never holds up exit).  Raises ImportError without prometheus_client,
    ValueError or FileNotFoundError for a bad id, OSError if the port is taken.
    """
    pc = _require()
    snap = _snapshotter(executor_or_id)
    registry = pc.CollectorRegistry(auto_describe=False)
    registry.register(StealerCollector(snap))
    if _version(pc) >= MIN_VERSION_RETURNING_SERVER:
        result = pc.start_http_server(port, addr=addr, registry=registry)
        if isinstance(result, tuple):
            httpd, thread = result[0], result[1]
        else:  # a version returning the server alone
            httpd, thread = result, None
    else:
        httpd, thread = _start_own(registry, port, addr)
    server = MetricsServer(httpd, thread)
    return server, server.port


def serve_metrics(executor: Executor | str, port: int = 0,
                  addr: str = "127.0.0.1") -> MetricsServer:
    """Expose ``executor.stats()`` as a Prometheus endpoint; returns the server.

    The server has ``.port``, ``.url`` and ``.shutdown()`` and is a context
    manager; ``port=0`` picks a free port.  Binds to loopback unless ``addr``
    says otherwise.  ``executor`` may also be an executor id (attached
    read-side, as ``stealer top`` does).  Errors as for :func:`serve`.
    """
    server, _port = serve(executor, port, addr)
    return server
