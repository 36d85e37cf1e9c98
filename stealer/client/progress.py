"""Progress bars on stderr: ``Executor.map(..., progress=True)`` and the tools' long runs.

    with Progress(total=10, label="bench") as bar:
        for step in steps:
            bar.set_detail(f"{step} 40%")   # optional text after the counts
            ...
            bar.update()                    # one step done

The bar draws on one line with ``\\r`` and redraws at most every ``min_interval`` seconds (and
always on the last step).  It is shown only when ``enabled`` is true; by default that is when
the stream is a terminal, so nothing is written in tests, pipes and CI logs.
:meth:`Progress.write` prints a line above the bar (or just prints it when the bar is off).
``rate=True`` adds the rate and, when the total is known, the time left (ETA); a total of
``None`` (an input of unknown length) shows the count alone.

:func:`map_bar` is what ``Executor.map(progress=True)`` draws: tqdm's bar when tqdm is
installed, else this one (no dependency).  The core imports nothing from the tools layer;
``stealer.bench.progress`` re-exports this module for the tools.

:class:`MapProgress` is what a running ``map(progress=True)`` shows besides its bar: the
executor keeps one per running map (weakly: a map's iterator dropped unread leaves none
behind) and ``Executor.stats().maps`` lists them, for the dashboard.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any, Protocol, TextIO

__all__ = ["Progress", "render_bar", "map_bar", "map_progress", "Bar", "Counted", "counting",
           "MapProgress"]


def render_bar(
    done: float, total: float | None, width: int = 24, label: str = "", detail: str = "",
    elapsed: float | None = None, rate: bool = False,
) -> str:
    """One line of a progress bar: ``label [#####-----] 5/10 12.3s detail``.

    With ``rate`` (and ``elapsed``): ``... 5/10 12.3s 0.4/s eta 12.3s``.  With ``total``
    None: ``label 5 12.3s ...`` (no bar, no ETA).
    """
    parts = [label] if label else []
    if total is None:
        parts.append(_count(done))
    else:
        frac = 0.0 if total <= 0 else min(1.0, max(0.0, done / total))
        filled = round(frac * width)
        bar = "#" * filled + "-" * (width - filled)
        parts.append(f"[{bar}] {_count(done)}/{_count(total)}")
    if elapsed is not None:
        parts.append(f"{elapsed:.1f}s")
        if rate:
            per_s = done / elapsed if elapsed > 0 else 0.0
            parts.append(f"{_rate(per_s)}/s")
            if total is not None and done < total:
                parts.append(f"eta {_duration((total - done) / per_s)}" if per_s > 0
                             else "eta ?")
    if detail:
        parts.append(detail)
    return " ".join(parts)


def _count(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:.1f}"


def _rate(r: float) -> str:
    return f"{r:.0f}" if r >= 100 else f"{r:.1f}" if r >= 1 else f"{r:.2f}"


def _duration(s: float) -> str:
    if s < 60:
        return f"{s:.1f}s"
    m, s = divmod(int(s), 60)
    return f"{m}m{s:02d}s" if m < 60 else f"{m // 60}h{m % 60:02d}m"


class Progress:
    """A progress bar over ``total`` steps on ``stream`` (default ``sys.stderr``).

    ``enabled=None`` shows it only when ``stream.isatty()``.  A disabled bar keeps counting
    (``done``) but writes nothing except through :meth:`write`.  ``rate=True`` shows the
    rate and the ETA; ``total=None`` counts without a bar.
    """

    def __init__(
        self,
        total: float | None,
        label: str = "",
        stream: TextIO | None = None,
        enabled: bool | None = None,
        width: int = 24,
        min_interval: float = 0.1,
        rate: bool = False,
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
        self.rate = rate
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
        self.draw(force=self.total is not None and self.done >= self.total)

    def set_detail(self, text: str) -> None:
        """Text shown after the counts (the current step, a sub-step's percentage)."""
        if text != self.detail:
            self.detail = text
            self.draw()

    def line(self) -> str:
        """The bar as it would be drawn now."""
        return render_bar(
            self.done, self.total, self.width, self.label, self.detail,
            time.perf_counter() - self._t0, self.rate,
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


# -- Executor.map(progress=True) ------------------------------------------------------------


class Bar(Protocol):
    """What map needs of a bar (tqdm's and :class:`Progress` both have it)."""

    total: Any

    def update(self, n: int = 1) -> Any: ...

    def close(self) -> Any: ...


def map_bar(total: int | None, label: str = "map", stream: TextIO | None = None) -> Bar:
    """A bar with rate and ETA on ``stream`` (stderr) if it is a terminal, else silent.

    tqdm's when tqdm imports (it decides the terminal question itself: ``disable=None``),
    else :class:`Progress`.
    """
    out = stream if stream is not None else sys.stderr
    try:
        from tqdm import tqdm
    except ImportError:
        return Progress(total, label=label, stream=out, rate=True)
    return tqdm(total=total, desc=label, unit="task", file=out, disable=None, leave=True)


class Counted:
    """An iterator that counts what it yields (``n``): how many inputs a map read."""

    __slots__ = ("it", "n")

    def __init__(self, it: Iterable[Any]) -> None:
        self.it = iter(it)
        self.n = 0

    def __iter__(self) -> Counted:
        return self

    def __next__(self) -> Any:
        x = next(self.it)
        self.n += 1
        return x


def _tick(bar: Bar, value: Any) -> Any:
    bar.update(1)
    return value


def counting(results: Iterator[Any], bar: Bar) -> Iterator[Any]:
    """``results``, counting each one on ``bar`` as it is handed out; the bar closes at the end.

    No local holds a result across a yield (as in Executor.map: CPython issue 14406).
    """
    nxt = results.__next__
    try:
        while True:
            try:
                yield _tick(bar, nxt())
            except StopIteration:
                return
    finally:
        bar.close()
        close = getattr(results, "close", None)
        if close is not None:
            close()


class MapProgress:
    """One running ``map(progress=True)``: its bar, and what it has done for the stats.

    ``done``: results handed out; ``total``: inputs (None: unknown yet); ``submitted``:
    inputs read so far; ``started``: monotonic time of the map call.  Updated by the
    iterator's thread, read by any other (plain ints: a snapshot may be one behind).
    """

    __slots__ = ("__weakref__", "bar", "counted", "done", "label", "running", "started",
                 "total")

    def __init__(self, bar: Bar, label: str, total: int | None, counted: Counted) -> None:
        self.bar = bar
        self.label = label
        self.total = total
        self.done = 0
        self.counted = counted
        self.started = time.monotonic()
        self.running: Any = None  # the executor's set of running maps, while in it

    # the Bar protocol, for counting(): the bar's count, and ours
    def update(self, n: int = 1) -> Any:
        self.done += n
        return self.bar.update(n)

    def close(self) -> Any:
        """The map ended (read to the end, failed or closed): it leaves the running maps."""
        if self.running is not None:
            self.running.discard(self)
            self.running = None
        return self.bar.close()

    def as_dict(self, now: float | None = None) -> dict[str, Any]:
        return {"label": self.label, "done": self.done, "total": self.total,
                "submitted": self.counted.n,
                "elapsed_s": round((now or time.monotonic()) - self.started, 3)}


def map_progress(results: Iterator[Any], counted: Counted, iterables: tuple,
                 read_all: bool, label: str = "map",
                 running: Any = None, name: str | None = None) -> Iterator[Any]:
    """The iterator of ``Executor.map(progress=True)``: ``results`` counted on a map bar.

    The total is the number of inputs: all were read already when ``read_all`` (map
    submits every task up front), else the shortest ``len()`` of the iterables, or
    unknown (a lazily read input without a length: the bar counts without an ETA).
    ``running``: a set (the executor's WeakSet) the map's :class:`MapProgress` stays in
    while it runs, under ``name`` (default ``label``), for ``Executor.stats().maps``.
    """
    if read_all:
        total: int | None = counted.n
    else:
        try:
            total = min(len(it) for it in iterables)
        except TypeError:
            total = None
    bar = MapProgress(map_bar(total, label), name or label, total, counted)
    if running is not None:  # the executor's running maps (a WeakSet): gone with the iterator
        running.add(bar)
        bar.running = running
    return counting(results, bar)
