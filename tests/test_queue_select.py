"""The fallback warning says what happened (issue 10): no extension built vs. one that fails."""

from __future__ import annotations

import glob

from stealer.shared import queues as _queues


def test_no_extension_built_says_so_and_blames_no_circular_import(monkeypatch):
    monkeypatch.setattr(glob, "glob", lambda pattern: [])
    text = _queues._why_no_extension(ImportError(
        "cannot import name '_cqueues' from partially initialized module 'stealer' (most "
        "likely due to a circular import)"))
    assert "no native extension" in text
    assert "STEALER_NO_EXTENSIONS=1" in text
    assert "circular" not in text


def test_a_built_extension_that_fails_to_load_is_named_with_the_error(monkeypatch):
    monkeypatch.setattr(glob, "glob", lambda pattern: ["/x/stealer/_cqueues.cpython-39.so"]
                        if pattern.endswith(".so") else [])
    text = _queues._why_no_extension(ImportError("undefined symbol: PyFoo"))
    assert "_cqueues.cpython-39.so exists but does not load" in text
    assert "undefined symbol: PyFoo" in text
    assert "another Python" in text
