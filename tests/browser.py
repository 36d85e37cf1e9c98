"""Headless Chromium driven through the Chrome DevTools protocol, standard library only.

The browser is the distribution's (``apt-get install chromium``; ``find_chromium`` looks
on PATH); nothing is downloaded.  It talks CDP over a pipe (``--remote-debugging-pipe``:
commands on its fd 3, replies and events on its fd 4, each JSON message ended by a NUL
byte), so no debugging port is opened and no websocket library is needed.

    with Chromium(tmp_path) as b:
        page = b.new_page(1400, 1000)
        b.call("Page.navigate", {"url": url}, page)
        b.evaluate("document.title", page)

Used by tests/test_dashboard_browser.py (and to make the README's screenshot).
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

_LAUNCH = """
import os, sys
a, b = int(sys.argv[1]), int(sys.argv[2])
a2, b2 = os.dup(a), os.dup(b)
os.dup2(a2, 3)
os.dup2(b2, 4)
for fd in {a, b, a2, b2} - {3, 4}:
    os.close(fd)
os.set_inheritable(3, True)
os.set_inheritable(4, True)
os.execv(sys.argv[3], sys.argv[3:])
"""
NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def find_chromium() -> str | None:
    for name in NAMES:
        path = shutil.which(name)
        if path:
            return path
    return None


class CDPError(RuntimeError):
    pass


class Chromium:
    """One headless browser process; ``call`` sends a command and waits for its reply."""

    def __init__(self, profile: Path, binary: str | None = None) -> None:
        binary = binary or find_chromium()
        if binary is None:
            raise FileNotFoundError("no chromium on PATH (apt-get install chromium)")
        to_r, to_w = os.pipe()  # we write commands, the browser reads them on fd 3
        from_r, from_w = os.pipe()  # the browser writes on fd 4, we read
        args = [binary, "--headless=new", "--remote-debugging-pipe", "--no-first-run",
                "--no-default-browser-check", "--disable-gpu", "--disable-extensions",
                "--disable-background-networking", "--disable-sync", "--mute-audio",
                "--disable-dev-shm-usage", f"--user-data-dir={profile}", "about:blank"]
        if os.geteuid() == 0:
            args.insert(1, "--no-sandbox")  # root (CI's container): the sandbox refuses to start
        # a small launcher puts our pipe ends on fds 3 and 4, whatever numbers they have here
        self.proc = subprocess.Popen([sys.executable, "-c", _LAUNCH, str(to_r), str(from_w),
                                      *args], pass_fds=(to_r, from_w),
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        os.close(to_r)
        os.close(from_w)
        self._w = os.fdopen(to_w, "wb", buffering=0)
        self._r = os.fdopen(from_r, "rb", buffering=0)
        self._next = 0
        self._replies: dict[int, dict[str, Any]] = {}
        self.events: list[dict[str, Any]] = []
        self._cond = threading.Condition()
        self._eof = False
        self._reader = threading.Thread(target=self._read, daemon=True, name="cdp-reader")
        self._reader.start()

    def _read(self) -> None:
        buf = b""
        while True:
            chunk = self._r.read(65536)
            if not chunk:
                break
            buf += chunk
            while b"\0" in buf:
                raw, buf = buf.split(b"\0", 1)
                msg = json.loads(raw)
                with self._cond:
                    if "id" in msg:
                        self._replies[msg["id"]] = msg
                    else:
                        self.events.append(msg)
                    self._cond.notify_all()
        with self._cond:
            self._eof = True
            self._cond.notify_all()

    def call(self, method: str, params: dict[str, Any] | None = None,
             session: str | None = None, timeout: float = 30.0) -> dict[str, Any]:
        with self._cond:
            self._next += 1
            mid = self._next
        msg: dict[str, Any] = {"id": mid, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        self._w.write(json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        with self._cond:
            while mid not in self._replies:
                left = deadline - time.monotonic()
                if self._eof or left <= 0:
                    raise CDPError(f"{method}: no reply ({'browser exited' if self._eof else 'timeout'})")
                self._cond.wait(left)
            reply = self._replies.pop(mid)
        if "error" in reply:
            raise CDPError(f"{method}: {reply['error']}")
        return reply.get("result", {})

    def new_page(self, width: int = 1400, height: int = 1000) -> str:
        """A new tab, attached: its session id (Runtime, Log and Page events enabled)."""
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})[
            "sessionId"]
        for domain in ("Runtime", "Log", "Page"):
            self.call(f"{domain}.enable", session=session)
        self.call("Emulation.setDeviceMetricsOverride", {
            "width": width, "height": height, "deviceScaleFactor": 1, "mobile": False},
            session)
        return session

    def evaluate(self, expression: str, session: str) -> Any:
        r = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True,
                                           "awaitPromise": True}, session)
        if "exceptionDetails" in r:
            raise CDPError(f"{expression}: {r['exceptionDetails']}")
        return r["result"].get("value")

    def wait_for(self, expression: str, session: str, timeout: float = 20.0) -> Any:
        """Evaluate until truthy; the value, or CDPError after ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            v = self.evaluate(expression, session)
            if v:
                return v
            if time.monotonic() > deadline:
                raise CDPError(f"still false after {timeout} s: {expression}")
            time.sleep(0.1)

    def errors(self, session: str) -> list[str]:
        """Console errors, uncaught exceptions and error log entries (CSP, failed loads)."""
        out = []
        with self._cond:
            events = list(self.events)
        for e in events:
            if e.get("sessionId") != session:
                continue
            p = e.get("params", {})
            if e["method"] == "Runtime.exceptionThrown":
                out.append(f"exception: {p['exceptionDetails'].get('text')} "
                           f"{p['exceptionDetails'].get('exception', {}).get('description')}")
            elif e["method"] == "Runtime.consoleAPICalled" and p.get("type") == "error":
                out.append("console.error: " + " ".join(str(a.get("value", a.get("description")))
                                                        for a in p.get("args", [])))
            elif e["method"] == "Log.entryAdded" and p["entry"].get("level") == "error":
                out.append(f"log: {p['entry'].get('text')} {p['entry'].get('url', '')}")
        return out

    def screenshot(self, session: str, path: Path, selectors: list[str] | None = None) -> Path:
        """The whole page as a PNG at ``path``; with ``selectors``, the box around the
        elements they match (a group of panels), with a margin of 8 px."""
        params: dict[str, Any] = {"format": "png", "captureBeyondViewport": True}
        if selectors:
            box = self.evaluate(
                "(() => { const rs = " + json.dumps(selectors) + ".flatMap((s) => [...document"
                ".querySelectorAll(s)]).filter((e) => !e.hidden).map((e) => "
                "e.getBoundingClientRect()); if (!rs.length) return null; "
                "const x = Math.min(...rs.map((r) => r.left)) + scrollX, "
                "y = Math.min(...rs.map((r) => r.top)) + scrollY; "
                "return [x, y, Math.max(...rs.map((r) => r.right)) + scrollX - x, "
                "Math.max(...rs.map((r) => r.bottom)) + scrollY - y]; })()", session)
            if box is None:
                raise CDPError(f"nothing shown matches {selectors}")
            x, y, w, h = box
            params["clip"] = {"x": max(0, x - 8), "y": max(0, y - 8), "width": w + 16,
                              "height": h + 16, "scale": 1}
        data = self.call("Page.captureScreenshot", params, session)
        path.write_bytes(base64.b64decode(data["data"]))
        return path

    def close(self) -> None:
        try:
            self.call("Browser.close", timeout=5)
        except (CDPError, OSError):
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        for f in (self._w, self._r):
            try:
                f.close()
            except OSError:
                pass

    def __enter__(self) -> Chromium:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
