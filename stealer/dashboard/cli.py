"""``stealer dashboard [ID]``: serve the web dashboard of a running executor, attached by id.

Resolves the id as ``stealer top`` does (an id, a client pid, or the only running
executor), starts :func:`stealer.dashboard.serve_dashboard` on it, prints the URL (with
its token) and serves until Ctrl-C or until the executor exits.  Called by
:mod:`stealer.cli`.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import webbrowser
from collections.abc import Sequence

from stealer.client.stats import executor_gone
from stealer.top import _resolve

__all__ = ["main"]

PROG = "stealer dashboard"
TOKEN_ENV = "STEALER_DASHBOARD_TOKEN"
_sleep = time.sleep  # indirection so tests can stop the loop


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Serve a live web dashboard of a running stealer executor: throughput, "
                    "queue depths, steals, latency CDFs per tier, agents, per-worker CPU and "
                    "memory. Read-only; binds 127.0.0.1 with a random token by default.")
    p.add_argument("id", nargs="?", default=None,
                   help="executor id (Executor.id) or its client pid; default: the only "
                        "running executor (several: they are listed)")
    p.add_argument("--port", type=int, default=0, help="port (default: a free one)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1); any other needs a token "
                        f"from --token-file or ${TOKEN_ENV}")
    p.add_argument("--prefix", default="",
                   help="serve under this path, e.g. /stealer (behind a reverse proxy)")
    p.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                   help="a Host name the server answers besides its own address (a "
                        "proxy's public name); repeatable")
    p.add_argument("--token-file", default=None, metavar="FILE",
                   help=f"read the token from FILE (or set ${TOKEN_ENV}); default: a random "
                        "one, printed in the URL")
    p.add_argument("--interval", type=float, default=0.25, metavar="S",
                   help="seconds between updates (default 0.25)")
    p.add_argument("--open", action="store_true", help="open the URL in a web browser")
    p.add_argument("--log", action="store_true", help="log each request on stderr")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Returns 0 on Ctrl-C, 1 when the executor cannot be attached or exits, 2 for usage."""
    from stealer.dashboard.server import serve_dashboard

    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    err = sys.stderr
    exec_id, code = _resolve(args.id, err, PROG)
    if exec_id is None:
        return code
    token = os.environ.get(TOKEN_ENV) or None
    if args.token_file:
        try:
            with open(args.token_file) as f:
                token = f.read().strip()
        except OSError as exc:
            print(f"{PROG}: cannot read --token-file: {exc}", file=err)
            return 2
    try:
        dash = serve_dashboard(exec_id, port=args.port, host=args.host, token=token,
                               prefix=args.prefix, allowed_hosts=args.allow_host,
                               interval=args.interval, quiet=not args.log)
    except (ValueError, TypeError) as exc:
        print(f"{PROG}: {exc}", file=err)
        return 2
    except (OSError, RuntimeError) as exc:
        print(f"{PROG}: {exc}", file=err)
        return 1
    with dash:
        print(f"{PROG}: executor {exec_id}\n  {dash.url}\n(Ctrl-C to stop)", flush=True)
        if args.open:
            webbrowser.open(dash.url)
        try:
            while True:
                gone = executor_gone(exec_id)
                if gone:
                    _sleep(max(0.5, 2 * dash.sampler.interval))  # open pages hear it
                    print(f"{PROG}: {gone}", file=err)
                    return 1
                _sleep(0.5)
        except KeyboardInterrupt:
            return 0
