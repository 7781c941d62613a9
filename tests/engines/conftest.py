"""Fixtures of the engine tests: tiny demo models written once per session.

The engines run real mlx-lm (and mlx-vlm) on their own MLX threads, so these
tests use the real clock: a thread lets Trio's virtual clock jump (trio#456).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio

from mlxd.engines.mlx_text import MlxTextEngine
from mlxd.engines.model_files.demo_model import write_demo_model
from mlxd.engines.workers.worker_process import Workers
from tests.engines.mlx_helpers import tiny_config
from tests.support.engines import RecordedTextEngine


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random llama (mlxd demo-model --size tiny), shared by the session."""
    path = tmp_path_factory.mktemp("models") / "tiny"
    write_demo_model(path, "tiny")
    return path


@pytest.fixture(scope="session")
def vision_model_dir(vision_extra: None, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random LLaVA (mlxd demo-model --vision); needs the vlm extra (see vision_extra)."""
    path = tmp_path_factory.mktemp("models") / "vision"
    write_demo_model(path, "vision")
    return path


@pytest.fixture
async def engine(tiny_model_dir: Path) -> AsyncIterator[MlxTextEngine]:
    """A loaded text engine on the tiny model, stopped after the test."""
    eng = RecordedTextEngine(tiny_config(tiny_model_dir, max_queue=4), prefill_step=16)
    await eng.load(lambda _p: None)
    try:
        yield eng
    finally:
        await eng.stop()


@pytest.fixture
async def workers() -> AsyncIterator[Workers]:
    """The owner of the test's engine worker processes, running; they end with the test."""
    owner = Workers()
    async with trio.open_nursery() as nursery:
        await nursery.start(owner.run)
        yield owner
        nursery.cancel_scope.cancel()
