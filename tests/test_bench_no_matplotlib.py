"""``stealer bench`` where matplotlib does not import (simulated: ``None`` in sys.modules).

``--plots DIR`` asked for plots: the command says how to get them and fails before running
anything.  Without ``--plots`` the plots are a default extra: a note, and the run succeeds.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from stealer.cli import main


@pytest.fixture
def no_matplotlib(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    monkeypatch.delitem(sys.modules, "stealer.bench.plots", raising=False)
    import stealer.bench

    monkeypatch.delattr(stealer.bench, "plots", raising=False)


def test_plots_dir_without_matplotlib_says_how_and_fails(
        tmp_path: Path, capsys: Any, no_matplotlib: None) -> None:
    rc = main(["bench", "--tiny", "--systems", "process", "--workloads", "overhead",
               "--plots", str(tmp_path / "plots")])
    err = capsys.readouterr().err
    assert rc != 0
    assert "pip install 'stealer[plots]'" in err and "--plots needs matplotlib" in err
    assert not (tmp_path / "plots").exists()  # nothing ran, nothing written


def test_default_plots_without_matplotlib_are_a_note(
        tmp_path: Path, capsys: Any, no_matplotlib: None,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    rc = main(["bench", "--tiny", "--systems", "process", "--workloads", "overhead"])
    err = capsys.readouterr().err
    assert rc == 0
    assert "no plots" in err and "pip install 'stealer[plots]'" in err
    assert (tmp_path / "bench-out" / "bench.json").is_file()
    assert not list((tmp_path / "bench-out").glob("*.png"))
