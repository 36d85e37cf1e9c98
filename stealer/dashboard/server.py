"""The dashboard's HTTP server: static page, event stream, JSON snapshot, and the locks on them.

Owns :func:`serve_dashboard` and :class:`DashboardServer` (the handle: ``url``, ``close()``)
and every rule a request must pass, in this order:

1. the method: GET or HEAD, anything else 405 (the server never reads a request body,
   so nothing from a request is ever unpickled, evaluated or submitted);
2. the ``Host`` header: a name in the allowlist (loopback names, the bound address, the
   names given in ``allowed_hosts``), else 403: a DNS-rebinding page cannot reach it;
3. the ``Origin`` header, when a browser sends one: a host of the allowlist, else 403
   (a cross-site page's ``EventSource`` is refused);
4. the path: under ``prefix``, one of the routes below, else 404;
5. the token: ``?token=`` (then an HttpOnly, SameSite=Strict cookie carries it),
   the cookie, or ``Authorization: Bearer``; else 401.

Routes under the prefix: ``/`` (index.html), ``/app.js``, ``/style.css``,
``/favicon.svg`` (package data in ``static/``, read once), ``/events`` (Server-Sent
Events from the shared :class:`~stealer.dashboard.sampler.Sampler`), ``/api/snapshot``
(the latest update as JSON) and ``/api/meta`` (id, tiers, CPU topology).  Every response
carries ``Content-Security-Policy: default-src 'self'``; the page loads nothing from
elsewhere.

Called by users (``serve_dashboard(ex)``) and :mod:`stealer.dashboard.cli`.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import os
import re
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from http import HTTPStatus
from http.cookies import CookieError, SimpleCookie
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, quote, urlsplit

from stealer.client.stats import executor_gone
from stealer.dashboard import payload
from stealer.dashboard.sampler import ClusterSampler, Sampler
from stealer.shared import metrics

if TYPE_CHECKING:
    from stealer.client.executor import Executor

__all__ = ["DashboardServer", "serve_dashboard"]

CSP = ("default-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'")
STATIC = {  # route -> (file in static/, content type)
    "/": ("index.html", "text/html; charset=utf-8"),
    "/index.html": ("index.html", "text/html; charset=utf-8"),
    "/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/style.css": ("style.css", "text/css; charset=utf-8"),
    "/favicon.svg": ("favicon.svg", "image/svg+xml"),
}
MAX_STREAMS = 16  # open event streams at once (each holds a thread); more get 503
KEEPALIVE_S = 15.0  # a comment line this often when no update comes (proxies drop idle streams)
TOKEN_RE = re.compile(r"[A-Za-z0-9._~-]{16,256}")
PREFIX_RE = re.compile(r"(/[A-Za-z0-9._~-]+)*")
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


def _is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _host_name(value: str) -> str:
    """The host of a Host header or an Origin's netloc, lowercased, without port or brackets."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1:value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


def _local_names(host: str) -> set[str]:
    """Names under which this machine is reached on a wildcard bind (0.0.0.0, ::)."""
    import psutil

    names = {socket.gethostname().lower(), socket.getfqdn().lower()}
    try:
        for addrs in psutil.net_if_addrs().values():
            for a in addrs:
                if a.family in (socket.AF_INET, socket.AF_INET6):
                    names.add(a.address.split("%")[0].lower())
    except OSError:
        pass
    return names


def _static_files() -> dict[str, bytes]:
    root = resources.files("stealer.dashboard") / "static"
    out = {}
    for name, _ctype in STATIC.values():
        try:
            out[name] = (root / name).read_bytes()
        except (FileNotFoundError, OSError) as exc:
            raise RuntimeError(
                f"the dashboard's page ({name}) is missing from the installed package: "
                "reinstall stealer (pip install --force-reinstall stealer)") from exc
    return out


@dataclass
class _Config:
    token: str
    prefix: str
    allowed: set[str]  # host names; "*" allows any
    sampler: Sampler
    meta: bytes
    static: dict[str, bytes]
    cookie: str
    streams: threading.BoundedSemaphore = field(
        default_factory=lambda: threading.BoundedSemaphore(MAX_STREAMS))
    quiet: bool = True


class _Handler(BaseHTTPRequestHandler):
    server_version = "stealer-dashboard"
    sys_version = ""
    timeout = 30  # seconds a client may take to send its request or read a write
    cfg: _Config  # set on the subclass made per server

    # -- every other method -----------------------------------------------------------

    def __getattr__(self, name: str) -> Any:
        if name.startswith("do_"):  # POST, PUT, DELETE, PATCH, OPTIONS, anything: read-only
            return self._refuse_method
        raise AttributeError(name)

    def _refuse_method(self) -> None:
        self._send(HTTPStatus.METHOD_NOT_ALLOWED,
                   b"stealer dashboard is read-only: only GET and HEAD are served\n",
                   extra={"Allow": "GET, HEAD"})

    def do_GET(self) -> None:
        self._handle(head=False)

    def do_HEAD(self) -> None:
        self._handle(head=True)

    def log_message(self, format: str, *args: Any) -> None:
        if not self.cfg.quiet:
            super().log_message(format, *args)

    # -- responses ----------------------------------------------------------------------

    def _headers(self, code: int, ctype: str, length: int | None,
                 extra: dict[str, str] | None = None) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        if length is not None:
            self.send_header("Content-Length", str(length))
        self.send_header("Content-Security-Policy", CSP)
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("X-Frame-Options", "DENY")
        self.send_header("Referrer-Policy", "no-referrer")
        self.send_header("Cross-Origin-Resource-Policy", "same-origin")
        self.send_header("Cache-Control", "no-store")
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.end_headers()

    def _send(self, code: int, body: bytes, ctype: str = "text/plain; charset=utf-8",
              extra: dict[str, str] | None = None, head: bool = False) -> None:
        self._headers(code, ctype, len(body), extra)
        if not head:
            self.wfile.write(body)

    # -- the checks ----------------------------------------------------------------------

    def _allowed(self, name: str) -> bool:
        return "*" in self.cfg.allowed or name in self.cfg.allowed

    def _token_from_request(self, query: dict[str, list[str]]) -> tuple[bool, bool]:
        """(authorised, came in the query: set the cookie)."""
        want = self.cfg.token.encode()

        def ok(value: str) -> bool:
            return hmac.compare_digest(value.encode("utf-8", "replace"), want)

        given = query.get("token")
        if given and ok(given[-1]):
            return True, True
        auth = self.headers.get("Authorization", "")
        if auth.startswith("Bearer ") and ok(auth[7:].strip()):
            return True, False
        raw = self.headers.get("Cookie")
        if raw:
            try:
                jar = SimpleCookie(raw)
            except CookieError:
                jar = SimpleCookie()
            morsel = jar.get(self.cfg.cookie)
            if morsel is not None and ok(morsel.value):
                return True, False
        return False, False

    def _handle(self, head: bool) -> None:
        cfg = self.cfg
        host = self.headers.get("Host")
        if not host or not self._allowed(_host_name(host)):
            self._send(HTTPStatus.FORBIDDEN,
                       f"stealer dashboard: Host {host!r} is not allowed (a guard against DNS "
                       "rebinding). Open it by the address it printed, or allow the name "
                       "with serve_dashboard(..., allowed_hosts=[...]) / "
                       "stealer dashboard --allow-host NAME.\n".encode(), head=head)
            return
        origin = self.headers.get("Origin")
        if origin is not None:
            netloc = urlsplit(origin).netloc
            if not netloc or not self._allowed(_host_name(netloc)):
                self._send(HTTPStatus.FORBIDDEN,
                           f"stealer dashboard: requests from origin {origin!r} are refused\n"
                           .encode(), head=head)
                return
        parts = urlsplit(self.path)
        path = parts.path
        if cfg.prefix:
            if path == cfg.prefix:  # the prefix without its slash: to the page
                loc = path.rsplit("/", 1)[-1] + "/" + (f"?{parts.query}" if parts.query else "")
                self._send(HTTPStatus.MOVED_PERMANENTLY, b"", extra={"Location": loc}, head=head)
                return
            if not path.startswith(cfg.prefix + "/"):
                self._send(HTTPStatus.NOT_FOUND, b"not found\n", head=head)
                return
            path = path[len(cfg.prefix):]
        authorised, set_cookie = self._token_from_request(parse_qs(parts.query))
        if not authorised:
            self._send(HTTPStatus.UNAUTHORIZED,
                       b"stealer dashboard: this page needs its token. Open the whole URL "
                       b"that serve_dashboard() or `stealer dashboard` printed (it ends in "
                       b"?token=...); the browser then keeps it in a cookie.\n",
                       extra={"WWW-Authenticate": 'Bearer realm="stealer dashboard"'}, head=head)
            return
        extra = {}
        if set_cookie:
            extra["Set-Cookie"] = (f"{cfg.cookie}={cfg.token}; Path={cfg.prefix or ''}/; "
                                   "HttpOnly; SameSite=Strict")
        if path in STATIC:
            name, ctype = STATIC[path]
            self._send(HTTPStatus.OK, cfg.static[name], ctype, extra, head)
        elif path == "/events":
            self._events(head, extra)
        elif path == "/api/snapshot":
            self._send(HTTPStatus.OK, cfg.sampler.latest(), "application/json", extra, head)
        elif path == "/api/meta":
            self._send(HTTPStatus.OK, cfg.meta, "application/json", extra, head)
        else:
            self._send(HTTPStatus.NOT_FOUND, b"not found\n", head=head)

    # -- the event stream ------------------------------------------------------------------

    def _events(self, head: bool, extra: dict[str, str]) -> None:
        cfg = self.cfg
        sampler = cfg.sampler
        if not cfg.streams.acquire(blocking=False):
            self._send(HTTPStatus.SERVICE_UNAVAILABLE,
                       f"stealer dashboard: {MAX_STREAMS} pages are open already\n".encode(),
                       extra={"Retry-After": "10"}, head=head)
            return
        try:
            self._headers(HTTPStatus.OK, "text/event-stream; charset=utf-8", None,
                          {**extra, "X-Accel-Buffering": "no"})
            if head:
                return
            self.wfile.write(b"retry: 3000\n\n")
            self.wfile.flush()
            sampler.subscribe()
            try:
                fresh = time.monotonic() - sampler.sampled_at < sampler.interval
                seq = sampler.seq - 1 if fresh or sampler.gone is not None else sampler.seq
                while True:
                    got, data = sampler.next(seq, KEEPALIVE_S)
                    if got < 0:
                        return  # the server closes
                    if data is None:
                        if sampler.gone is not None:
                            return
                        self.wfile.write(b": keep-alive\n\n")
                    else:
                        seq = got
                        self.wfile.write(b"data: " + data + b"\n\n")
                    self.wfile.flush()
                    if data is not None and sampler.gone is not None:
                        return
            finally:
                sampler.unsubscribe()
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            pass  # the page went away
        finally:
            cfg.streams.release()


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True


class DashboardServer:
    """A running dashboard: ``url`` (with the token: give it to the browser), ``close()``.

    Also ``token``, ``host``, ``port``, ``base_url`` (without the token), ``sampler``;
    a context manager.
    """

    def __init__(self, httpd: _HTTPServer, cfg: _Config, host: str, exec_id: str) -> None:
        self._httpd = httpd
        self._cfg = cfg
        self.sampler = cfg.sampler
        self.token = cfg.token
        self.prefix = cfg.prefix
        self.executor_id = exec_id
        self.host = host
        self.port: int = httpd.server_address[1]
        self._closed = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="stealer-dashboard-http", daemon=True)
        self._thread.start()

    @property
    def base_url(self) -> str:
        host = self.host
        if host in ("0.0.0.0", "::", ""):
            host = socket.gethostname()
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port}{self.prefix}/"

    @property
    def url(self) -> str:
        return f"{self.base_url}?token={quote(self.token)}"

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Stop serving: end the event streams, the sampler and the socket (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.sampler.close()
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(5.0)

    def __enter__(self) -> DashboardServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<DashboardServer {self.base_url}{' (closed)' if self._closed else ''}>"


def _meta(exec_id: str, nworkers: int, has_client: bool, sampler: Sampler) -> bytes:
    from stealer import __version__, affinity

    try:
        topo = affinity.read_topology()
        topology: dict[str, Any] | None = {
            "cpus": [{"id": c.id, "core": c.core, "package": c.package, "node": c.node}
                     for c in topo.cpus],
            "online": list(topo.online), "quota_cpus": topo.quota_cpus}
    except Exception:  # an odd /sys: the pinning panel then shows the CPU numbers alone
        topology = None
    return json.dumps({
        "id": exec_id, "version": __version__, "workers": nworkers, "client": has_client,
        "tiers": list(metrics.TIER_NAMES), "kinds": list(metrics.KINDS),
        "interval_s": sampler.interval, "window_s": sampler.window_s,
        "cdf_group": payload.CDF_GROUP, "victims": metrics.VICTIMS, "topology": topology,
    }, separators=(",", ":")).encode()


def _cluster_source(ex: Any) -> tuple[str, Callable[..., dict[str, Any] | None]] | None:
    """(id, snapshot reader) when ``ex`` is a cluster executor or its id: its figures are
    the snapshot its client publishes (stealer/cluster/snapshot.py, read as ``stealer top``
    reads it: no Ray here); None for a local executor."""
    from stealer.cluster import snapshot as cluster_snapshot  # (no Ray: plain files)

    exec_id = ex if isinstance(ex, str) else getattr(ex, "id", None)
    if not isinstance(exec_id, str) or not cluster_snapshot.is_cluster_id(exec_id):
        return None
    exec_id = os.path.basename(exec_id)
    try:
        cluster_snapshot.read(exec_id)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"serve_dashboard: no executor with id {exec_id!r} (it may have exited); "
            "`stealer top` without an id lists the running ones") from None

    def snap(agents: bool = True) -> dict[str, Any] | None:
        if executor_gone(exec_id):
            return None
        try:
            return cluster_snapshot.read(exec_id)
        except FileNotFoundError:  # shut down while we read
            return None

    return exec_id, snap


def _check_token(token: str | None, host: str) -> str:
    if token is None:
        if not _is_loopback(host):
            raise ValueError(
                f"serve_dashboard: host={host!r} is reachable from other machines; pass "
                "token=secrets.token_urlsafe() (and give the URL only to those who may see "
                "the executor), or keep the default host='127.0.0.1'")
        return secrets.token_urlsafe(32)
    if not isinstance(token, str) or not TOKEN_RE.fullmatch(token):
        raise ValueError("serve_dashboard: token must be 16-256 characters of A-Z a-z 0-9 . _ "
                         "~ - (secrets.token_urlsafe() makes one)")
    return token


def _check_prefix(prefix: str) -> str:
    if not isinstance(prefix, str):
        raise TypeError(f"serve_dashboard: prefix must be a str, not {type(prefix).__name__}")
    prefix = prefix.rstrip("/")
    if prefix and not prefix.startswith("/"):
        prefix = "/" + prefix
    if not PREFIX_RE.fullmatch(prefix):
        raise ValueError(f"serve_dashboard: prefix {prefix!r} must be a path like '/stealer' "
                         "(segments of A-Z a-z 0-9 . _ ~ -)")
    return prefix


def serve_dashboard(ex: Executor | str, port: int = 0, host: str = "127.0.0.1",
                    token: str | None = None, prefix: str = "",
                    allowed_hosts: Iterable[str] = (), interval: float = 0.25,
                    window_s: float = 10.0, quiet: bool = True) -> DashboardServer:
    """Serve a live dashboard of ``ex`` (an Executor, or a running executor's id).

    Returns the server (``.url`` carries a fresh random token unless ``token`` is given;
    ``.close()``).  Binds ``host:port`` (``port=0``: a free port); a host other than a
    loopback address needs an explicit ``token``.  ``prefix`` serves every page under a
    path (behind a reverse proxy that keeps it).  ``allowed_hosts`` adds names the
    ``Host`` header may carry (a proxy's public name; ``"*"``: any).  Updates go out every
    ``interval`` seconds to every open page from one sampler; latency covers the last
    ``window_s`` seconds.  ``quiet=False`` logs each request on stderr.

    Raises ValueError (a bad token, prefix or interval; a non-loopback host without a
    token), FileNotFoundError (no executor with that id), RuntimeError (the executor has
    shut down), OSError (the port is taken).
    """
    from stealer.prometheus import _snapshotter  # the same read: an Executor or an id

    token = _check_token(token, host)
    prefix = _check_prefix(prefix)
    cluster = _cluster_source(ex)
    if cluster is not None:
        exec_id, snapshot = cluster
        has_client = not isinstance(ex, str)
    elif isinstance(ex, str):
        exec_id = ex.rsplit("/", 1)[-1]
        try:
            snapshot = _snapshotter(exec_id)
        except FileNotFoundError:
            raise FileNotFoundError(
                f"serve_dashboard: no executor with id {exec_id!r} (it may have exited); "
                "`stealer top` without an id lists the running ones") from None
        has_client = False
    else:
        snapshot = _snapshotter(ex)  # TypeError for something that is not an Executor
        exec_id = ex.id
        has_client = True
    gone = executor_gone(exec_id)
    if gone:
        raise RuntimeError(f"serve_dashboard: {gone}; serve a running executor")
    allowed = set(LOOPBACK_NAMES)
    allowed.add(_host_name(host))
    if host in ("0.0.0.0", "::", ""):
        allowed |= _local_names(host)
    allowed |= {_host_name(h) if h != "*" else "*" for h in allowed_hosts}
    if cluster is not None:
        sampler: Sampler = ClusterSampler(snapshot, lambda: executor_gone(exec_id), interval,
                                          window_s)
    else:
        sampler = Sampler(snapshot, lambda: executor_gone(exec_id), interval, window_s)
    try:
        first = snapshot()
        if cluster is not None:
            nworkers = sum(n.get("workers") or 0 for n in (first or {}).get("nodes", {}).values()
                           if n.get("alive"))
        else:
            nworkers = len(first.workers) if first is not None else 0
        cfg = _Config(token=token, prefix=prefix, allowed=allowed, sampler=sampler,
                      meta=_meta(exec_id, nworkers, has_client, sampler),
                      static=_static_files(), cookie="stealer-dashboard", quiet=quiet)
        handler = type("Handler", (_Handler,), {"cfg": cfg})
        server_cls = type("Server", (_HTTPServer,), {
            "address_family": socket.AF_INET6 if ":" in host else socket.AF_INET})
        httpd = server_cls((host, port), handler)
    except BaseException:
        sampler.close()
        raise
    cfg.cookie = f"stealer-dashboard-{httpd.server_address[1]}"  # ports share cookies
    return DashboardServer(httpd, cfg, host, exec_id)
