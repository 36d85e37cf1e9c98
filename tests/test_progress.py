"""``Executor.map(..., progress=True)``: a bar with rate and ETA on a terminal, silent elsewhere;
tqdm's bar when tqdm is installed, stealer.client.progress's plain one otherwise."""

from __future__ import annotations

import io
import sys

import pytest
import tasks

import stealer
from stealer.client.progress import Progress, render_bar


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture(scope="module")
def ex():
    with stealer.Executor(2) as e:
        yield e


@pytest.fixture
def no_tqdm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm -> ImportError


@pytest.fixture
def tty(monkeypatch: pytest.MonkeyPatch) -> Terminal:
    """A terminal as sys.stderr, from the first use of the fixture's ``install``."""
    out = Terminal()
    out.install = lambda: monkeypatch.setattr(sys, "stderr", out)  # type: ignore[attr-defined]
    return out


def last_line(text: str) -> str:
    return text.rstrip("\n").rsplit("\r", 1)[-1]


def test_render_bar_rate_and_eta():
    assert render_bar(5, 10, width=10, elapsed=2.0, rate=True) == (
        "[#####-----] 5/10 2.0s 2.5/s eta 2.0s")
    assert render_bar(10, 10, width=4, elapsed=2.0, rate=True) == "[####] 10/10 2.0s 5.0/s"
    assert render_bar(0, 10, width=2, elapsed=1.0, rate=True) == "[--] 0/10 1.0s 0.00/s eta ?"
    assert render_bar(5, None, elapsed=2.0, rate=True, label="map") == "map 5 2.0s 2.5/s"
    assert render_bar(300, 300 + 150 * 90, width=0, elapsed=2.0, rate=True).endswith(
        "150/s eta 1m30s")
    assert render_bar(1, 4, width=8) == "[##------] 1/4"  # the tools' bar is unchanged


def test_progress_counts_without_a_total():
    buf = Terminal()
    with Progress(None, label="x", stream=buf, min_interval=0.0, rate=True) as bar:
        bar.update(3)
    assert last_line(buf.getvalue()).startswith("x 3 ")


# (pytest's capture sets sys.stderr again between a fixture and the test body: each test
# installs its terminal itself)


def test_map_plain_bar_on_a_terminal(ex, tty, no_tqdm):
    tty.install()
    assert list(ex.map(tasks.square, range(50), progress=True)) == [i * i for i in range(50)]
    text = tty.getvalue()
    assert text.endswith("\n") and "\r" in text
    line = last_line(text)
    assert line.startswith("map [") and " 50/50 " in line and "/s" in line


@pytest.mark.parametrize("chunksize", [1, 7])
def test_map_progress_counts_inputs(ex, tty, no_tqdm, chunksize):
    tty.install()
    got = list(ex.map(tasks.add, range(30), range(100), chunksize=chunksize, progress=True))
    assert got == [2 * i for i in range(30)]
    assert " 30/30 " in last_line(tty.getvalue())


def test_map_progress_lazy_input(ex, tty, no_tqdm):
    tty.install()
    assert list(ex.map(tasks.square, range(40), buffersize=4, progress=True)) == [
        i * i for i in range(40)]
    assert " 40/40 " in last_line(tty.getvalue())  # len() known: a total and an ETA
    tty.seek(0)
    tty.truncate()
    gen = (i for i in range(40))
    assert list(ex.map(tasks.square, gen, buffersize=4, progress=True)) == [
        i * i for i in range(40)]
    line = last_line(tty.getvalue())
    assert line.startswith("map 40 ") and "/" in line and "eta" not in line


def test_map_progress_silent_when_not_a_terminal(ex, monkeypatch, no_tqdm):
    out = io.StringIO()
    monkeypatch.setattr(sys, "stderr", out)
    assert list(ex.map(tasks.square, range(10), progress=True)) == [i * i for i in range(10)]
    assert out.getvalue() == ""


def test_map_progress_closes_the_bar_on_error_and_early_exit(ex, tty, no_tqdm):
    tty.install()
    with pytest.raises(ValueError, match="boom"):
        list(ex.map(tasks.raise_value_error, ["boom"] * 3, progress=True))
    assert tty.getvalue().endswith("\n")
    tty.seek(0)
    tty.truncate()
    it = ex.map(tasks.sleep_then, [0.01] * 20, range(20), progress=True)
    assert next(it) == 0
    it.close()
    assert tty.getvalue().endswith("\n") and " 1/20 " in last_line(tty.getvalue())


def test_map_progress_with_tqdm(ex, tty):
    pytest.importorskip("tqdm")
    tty.install()
    assert list(ex.map(tasks.square, range(25), progress=True)) == [i * i for i in range(25)]
    text = tty.getvalue()
    assert "25/25" in text and "task/s" in text


def test_map_progress_with_tqdm_silent_when_not_a_terminal(ex, monkeypatch):
    pytest.importorskip("tqdm")
    out = io.StringIO()
    monkeypatch.setattr(sys, "stderr", out)
    assert list(ex.map(tasks.square, range(10), progress=True)) == [i * i for i in range(10)]
    assert out.getvalue() == ""
