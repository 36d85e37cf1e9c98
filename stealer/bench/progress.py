"""A tiny progress bar for long benchmark runs, written to stderr (no dependency).

    with Progress(total=10, label="bench") as bar:
        for step in steps:
            bar.set_detail(f"{step} 40%")   # optional text after the counts
            ...
            bar.update()                    # one step done

The bar draws on one line with ``\\r`` and redraws at most every ``min_interval`` seconds (and
always on the last step).  It is shown only when ``enabled`` is true; by default that is when
the stream is a terminal, so nothing is written in tests, pipes and CI logs.
:meth:`Progress.write` prints a line above the bar (or just prints it when the bar is off).
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["Progress", "render_bar"]


def render_bar(
    done: float, total: float, width: int = 24, label: str = "", detail: str = "",
    elapsed: float | None = None,
) -> str:
    """One line of a progress bar: ``label [#####-----] 5/10 12.3s detail``."""
    frac = 0.0 if total <= 0 else min(1.0, max(0.0, done / total))
    filled = round(frac * width)
    bar = "#" * filled + "-" * (width - filled)
    parts = [label] if label else []
    parts.append(f"[{bar}] {_count(done)}/{_count(total)}")
    if elapsed is not None:
        parts.append(f"{elapsed:.1f}s")
    if detail:
        parts.append(detail)
    return " ".join(parts)


def _count(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:.1f}"


class Progress:
    """A progress bar over ``total`` steps on ``stream`` (default ``sys.stderr``).

    ``enabled=None`` shows it only when ``stream.isatty()``.  A disabled bar keeps counting
    (``done``) but writes nothing except through :meth:`write`.
    """

    def __init__(
        self,
        total: float,
        label: str = "",
        stream: TextIO | None = None,
        enabled: bool | None = None,
        width: int = 24,
        min_interval: float = 0.1,
    ) -> None:
        self.total = total
        self.label = label
        self.stream: TextIO = stream if stream is not None else sys.stderr
        if enabled is None:
            isatty = getattr(self.stream, "isatty", None)
            enabled = bool(isatty()) if isatty is not None else False
        self.enabled = enabled
        self.width = width
        self.min_interval = min_interval
        self.done: float = 0
        self.detail = ""
        self._t0 = time.perf_counter()
        self._last_draw = -1e9
        self._drawn_len = 0
        self._closed = False

    def __enter__(self) -> Progress:
        self.draw(force=True)
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def update(self, n: float = 1) -> None:
        """Count ``n`` more steps done and redraw (throttled)."""
        self.done += n
        self.draw(force=self.done >= self.total)

    def set_detail(self, text: str) -> None:
        """Text shown after the counts (the current step, a sub-step's percentage)."""
        if text != self.detail:
            self.detail = text
            self.draw()

    def line(self) -> str:
        """The bar as it would be drawn now."""
        return render_bar(
            self.done, self.total, self.width, self.label, self.detail,
            time.perf_counter() - self._t0,
        )

    def draw(self, force: bool = False) -> None:
        """Redraw the bar if enabled and ``min_interval`` passed since the last draw."""
        if not self.enabled or self._closed:
            return
        now = time.perf_counter()
        if not force and now - self._last_draw < self.min_interval:
            return
        self._last_draw = now
        text = self.line()
        pad = max(0, self._drawn_len - len(text))
        self.stream.write("\r" + text + " " * pad)
        self.stream.flush()
        self._drawn_len = len(text)

    def _clear(self) -> None:
        if self.enabled and self._drawn_len:
            self.stream.write("\r" + " " * self._drawn_len + "\r")
            self._drawn_len = 0

    def write(self, message: str) -> None:
        """Print ``message`` on its own line above the bar (the bar is redrawn below it)."""
        self._clear()
        self.stream.write(message + "\n")
        self.stream.flush()
        if self.enabled and not self._closed:
            self.draw(force=True)

    def close(self) -> None:
        """Draw the final state and end the line (idempotent)."""
        if self._closed:
            return
        if self.enabled:
            self.draw(force=True)
            self.stream.write("\n")
            self.stream.flush()
        self._closed = True
