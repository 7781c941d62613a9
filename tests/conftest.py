"""Shared pytest configuration: the --stress flag for long suites, the vision extra, the demo config."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mlxd.config import Config
from tests.support.demo import demo_config

# `make test` preloads OpenBLAS into this process (MLX runs here too; mlxd.blas). Its children
# choose for themselves: `mlxd serve` re-executes itself with it, and Chromium, node and the
# agent CLIs must not get it (Chromium's processes die with OpenBLAS preloaded).
os.environ.pop("LD_PRELOAD", None)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--stress",
        action="store_true",
        default=False,
        help="run the long suites (many Hypothesis examples, 1,000 crash kills, ...)",
    )


def pytest_configure(config: pytest.Config) -> None:
    from hypothesis import settings

    settings.register_profile("default", max_examples=300, deadline=None)
    settings.register_profile("stress", max_examples=5000, deadline=None)
    settings.load_profile("stress" if config.getoption("--stress") else "default")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--stress"):
        return
    skip = pytest.mark.skip(reason="long suite: run with --stress")
    for item in items:
        if "stress" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def stress(request: pytest.FixtureRequest) -> bool:
    """True when the run was started with --stress."""
    return bool(request.config.getoption("--stress"))


@pytest.fixture(scope="session")
def vision_extra() -> None:
    """mlx-vlm is installed; a test using this fails without it (skips only with MLXD_SKIP_VISION=1)."""
    from tests.support.vision import require_vision

    require_vision()


@pytest.fixture(scope="session")
def demo_state(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One state directory for the demo config: its demo models are written once, on first load."""
    return tmp_path_factory.mktemp("demo-state")


@pytest.fixture
def demo(demo_state: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Config:
    """The built-in demo config (``make serve``'s: models ``demo``, ``demo-small``, two fakes)."""
    return demo_config(demo_state, tmp_path, monkeypatch)
