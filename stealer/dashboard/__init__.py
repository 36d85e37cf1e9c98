"""A live web dashboard of an executor, served by the standard library, safe by default.

::

    from stealer.dashboard import serve_dashboard

    with stealer.Executor() as ex:
        dash = serve_dashboard(ex)        # or an executor id, attached as `stealer top` does
        print(dash.url)                   # http://127.0.0.1:PORT/?token=...
        ...
        dash.close()

``stealer dashboard [ID]`` does the same from a shell.  A tool on top of the executor: the
core never imports this package (tests/test_layers.py).  The parts:

* :mod:`~stealer.dashboard.server`: the HTTP server, its checks (GET only, Host and Origin
  allowlist, token then cookie, CSP), the event stream;
* :mod:`~stealer.dashboard.sampler`: one thread that snapshots the executor for every
  open page, only while one is open;
* :mod:`~stealer.dashboard.payload`: what an update holds (aggregates: sized by workers
  and tiers, never by tasks);
* :mod:`~stealer.dashboard.cli`: ``stealer dashboard``;
* ``static/``: the page (HTML, CSS, and JS drawing its own canvas charts), package data.
"""

from __future__ import annotations

from stealer.dashboard.server import DashboardServer, serve_dashboard

__all__ = ["DashboardServer", "serve_dashboard"]
