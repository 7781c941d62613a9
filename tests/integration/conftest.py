"""Fixtures of the end-to-end tests: a tiny real model and configs mixing it with fakes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mlxd.config import Config, parse_config
from mlxd.engines.model_files.demo_model import write_demo_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight llama written by mlxd's demo-model writer."""
    path = tmp_path_factory.mktemp("models") / "tiny"
    write_demo_model(path, "tiny")
    return path


@pytest.fixture(scope="session")
def bert_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight BERT (mlx-embeddings) written by the demo-model writer."""
    path = tmp_path_factory.mktemp("models") / "bert"
    write_demo_model(path, "embedding")
    return path


@pytest.fixture(scope="session")
def vision_model(vision_extra: None, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight LLaVA (mlx-vlm) written by the demo-model writer."""
    path = tmp_path_factory.mktemp("models") / "llava"
    write_demo_model(path, "vision")
    return path


def config_of(raw: dict[str, Any], tmp: Path) -> Config:
    """Parse a config dict exactly as a YAML file with these contents would be."""
    return parse_config(raw, path=tmp / "models.yaml")


def fake(name: str, gb: float, **fake_settings: Any) -> dict[str, Any]:
    settings = {"load_seconds": 0.3, "tokens_per_second": 100, **fake_settings}
    return {"name": name, "engine": "fake", "estimated_memory_gb": gb, "fake": settings}
