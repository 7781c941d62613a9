"""Without the vision extra the vision tests fail, not skip, unless MLXD_SKIP_VISION=1 opts out."""

from __future__ import annotations

import importlib.util

import pytest

from tests.support import vision


def test_missing_extra_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """mlx-vlm missing and no opt-out: the test that needs it fails, naming the fix and the variable."""
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    monkeypatch.delenv(vision.SKIP_ENV, raising=False)
    with pytest.raises(pytest.fail.Exception, match="MLXD_SKIP_VISION=1"):
        vision.require_vision()


def test_opt_out_skips(monkeypatch: pytest.MonkeyPatch) -> None:
    """mlx-vlm missing with MLXD_SKIP_VISION=1: the test skips and says why."""
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    monkeypatch.setenv(vision.SKIP_ENV, "1")
    with pytest.raises(pytest.skip.Exception, match="not installed"):
        vision.require_vision()


def test_installed_extra_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """mlx-vlm installed: nothing happens, with or without the opt-out."""
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    monkeypatch.setenv(vision.SKIP_ENV, "1")
    vision.require_vision()
