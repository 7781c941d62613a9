"""`make serve` installs what serving needs, showing progress, and none of the test toolchain."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_the_serve_install_has_no_test_extra_and_shows_progress(tmp_path: Path) -> None:
    """The commands `make serve` would run to install: pip without --quiet, the package and its runtime extras, never `.[test...]`."""
    venv = tmp_path / "venv"
    plan = subprocess.run(["make", "-n", "-B", f"VENV={venv}", f"{venv}/.serve-installed"],
                          cwd=REPO, capture_output=True, text=True, check=True).stdout
    installs = [line for line in plan.splitlines() if "pip install" in line]
    assert any(line.rstrip().endswith("pip install -e .") for line in installs), plan
    assert any("'.[vlm,embeddings]'" in line and "||" in line for line in installs), plan
    assert not any("--quiet" in line or "[test" in line for line in installs), plan
    serve = subprocess.run(["make", "-n", f"VENV={venv}", "serve"], cwd=REPO,
                           capture_output=True, text=True, check=True).stdout
    assert "[test" not in serve, serve  # (the tmp path holds the word "pytest")
