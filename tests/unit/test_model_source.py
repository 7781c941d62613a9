"""One rule tells a local model directory from a Hugging Face repo id, for the config and the engines."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlxd.config import classify_source, parse_config
from mlxd.engines.model_files import sources
from mlxd.errors import ConfigError, LoadFailed

HUB = [
    "mlx-community/Qwen2.5-0.5B-Instruct-4bit",
    "org/name",
    "Org_1/model.v2",
    "_org/name_",  # the Hub allows "_" at either end of a part
    "a/b",
    "org/" + "n" * 96,
]
LOCAL_BY_SPELLING = ["/abs/missing", "./rel/missing", "../up/missing", "~/missing", "$HOME/x", ".", ".."]
NEITHER = [
    "just-a-name",  # a bare name is more likely a mistyped path
    "a/b/c",
    "org/",
    "org/na--me",
    "org/na..me",
    "org/name.git",
    "-org/name",
    "org/name-",
    "org/.name",
    "org/näme",
    "org/" + "n" * 97,
    "org/na me",
    "",
]


@pytest.mark.parametrize("text", HUB)
def test_repo_ids_are_hub_sources(text: str, tmp_path: Path) -> None:
    """Strings with the Hub's repo-id shape (org/name) that are not local paths are fetched from the Hub."""
    assert classify_source(text, tmp_path) == "hub"


@pytest.mark.parametrize("text", LOCAL_BY_SPELLING)
def test_path_spellings_are_local_even_when_missing(text: str, tmp_path: Path) -> None:
    """A source written as a path is local whether or not it exists (a missing one is an error later)."""
    assert classify_source(text, tmp_path) == "local"


@pytest.mark.parametrize("text", NEITHER)
def test_anything_else_is_refused(text: str, tmp_path: Path) -> None:
    """A source that is neither a path nor a valid repo id is refused, never downloaded."""
    with pytest.raises(ValueError, match="neither an existing local path"):
        classify_source(text, tmp_path)


def test_an_existing_folder_wins_over_the_repo_id_shape(tmp_path: Path) -> None:
    """org/name that exists under the base folder is that folder, not a Hub repo."""
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert classify_source("org/name", tmp_path) == "local"
    assert classify_source("org/other", tmp_path) == "hub"


@pytest.mark.parametrize("text", ["org/na--me", "just-a-name", "org/name.git"])
def test_config_and_engine_refuse_the_same_sources(text: str, tmp_path: Path) -> None:
    """The config reader and the engine's source resolver give the same verdict (they share the rule)."""
    raw = {"manager": {"memory_budget_gb": 4},
           "models": [{"name": "m", "path": text, "estimated_memory_gb": 1}]}
    with pytest.raises(ConfigError, match="neither an existing local path"):
        parse_config(raw, path=tmp_path / "models.yaml")
    with pytest.raises(LoadFailed, match="neither an existing local path"):
        sources.local_path(text)


def test_the_engine_follows_the_configs_verdict(tmp_path: Path) -> None:
    """A config-loaded source is not classified again: hub stays hub, local must exist as a folder."""
    raw = {"manager": {"memory_budget_gb": 4},
           "models": [{"name": "h", "path": "org/name", "estimated_memory_gb": 1}]}
    (model,) = parse_config(raw, path=tmp_path / "models.yaml").models
    assert model.source_kind == "hub"
    assert sources.local_path(model.source, model.source_kind) is None
    assert sources.local_path(str(tmp_path), "local") == tmp_path
    with pytest.raises(LoadFailed, match="no such directory"):
        sources.local_path(str(tmp_path / "gone"), "local")
