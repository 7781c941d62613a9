"""The vision extra (mlx-vlm) is part of the suite: missing, it fails the run unless opted out."""

from __future__ import annotations

import importlib.util
import os

import pytest

#: set to 1 to run the suite without the vlm extra (the vision tests then skip, saying so)
SKIP_ENV = "MLXD_SKIP_VISION"


def require_vision() -> None:
    """Fail the calling test when mlx-vlm is not installed, or skip it if MLXD_SKIP_VISION=1."""
    if importlib.util.find_spec("mlx_vlm") is not None:
        return
    if os.environ.get(SKIP_ENV) == "1":
        pytest.skip(f"the vlm extra (mlx-vlm) is not installed and {SKIP_ENV}=1")
    pytest.fail(
        f"the vlm extra (mlx-vlm) is not installed: pip install -e '.[test,vlm]', "
        f"or set {SKIP_ENV}=1 to run without the vision tests",
        pytrace=False,
    )
