"""``manager.prompt_cache_disk_gb``: the prompt cache's disk tier in the config."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from mlxd.config import DiskTier, parse_config
from mlxd.config.kv import DEFAULT_DISK_MAX_BYTES
from mlxd.errors import ConfigError
from mlxd.units import GIB

HUB = "mlx-community/Qwen2.5-0.5B-Instruct-4bit"


def own_state_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Point ``$MLXD_STATE_DIR`` at a directory of the test's (not created: the tier is made on
    first use)."""
    monkeypatch.setenv("MLXD_STATE_DIR", str(tmp_path / "state"))
    return tmp_path / "state"


def config(manager: str = "") -> dict[str, object]:
    raw = yaml.safe_load(
        f"manager:\n  memory_budget_gb: 8\n{manager}models:\n"
        f"  - {{name: batched, path: {HUB}, estimated_memory_gb: 0.5}}\n"
        f"  - {{name: serial, path: {HUB}, estimated_memory_gb: 0.5, max_batch_size: 1}}\n"
        f"  - {{name: vision, path: {HUB}, estimated_memory_gb: 0.5, mllm: true}}\n"
        "  - {name: fake, engine: fake, estimated_memory_gb: 0.5}\n"
    )
    assert isinstance(raw, dict)
    return raw


def test_default_is_a_tenth_of_the_free_disk_at_most_20_gb(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Left out, the tier is 10% of the free disk under the state dir, at most 20 GiB."""
    state_dir = own_state_dir(tmp_path, monkeypatch)
    st = os.statvfs(tmp_path)
    expected = min(DEFAULT_DISK_MAX_BYTES, st.f_bavail * st.f_frsize // 10)
    m = parse_config(config()).manager
    assert m.prompt_cache_dir == state_dir / "prompt-cache"
    assert m.prompt_cache_disk_bytes == pytest.approx(expected, rel=0.01)
    assert DEFAULT_DISK_MAX_BYTES == 20 * GIB


def test_only_models_that_keep_a_prompt_cache_get_the_tier(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A set size reaches the batched MLX models; serial, vision and fake models keep none."""
    state_dir = own_state_dir(tmp_path, monkeypatch)
    c = parse_config(config("  prompt_cache_disk_gb: 2.5\n"))
    tier = DiskTier(state_dir / "prompt-cache", int(2.5 * GIB))
    assert c.manager.prompt_cache_disk_bytes == tier.max_bytes
    assert {m.name: m.prompt_cache_disk for m in c.models} == {
        "batched": tier, "serial": None, "vision": None, "fake": None}


def test_zero_turns_the_tier_off() -> None:
    """``prompt_cache_disk_gb: 0``: no model writes its prompt cache to disk."""
    c = parse_config(config("  prompt_cache_disk_gb: 0\n"))
    assert c.manager.prompt_cache_disk_bytes == 0
    assert all(m.prompt_cache_disk is None for m in c.models)


def test_a_negative_size_is_an_error_naming_the_key() -> None:
    """A negative size is refused, naming the key."""
    with pytest.raises(ConfigError, match=r"manager\.prompt_cache_disk_gb"):
        parse_config(config("  prompt_cache_disk_gb: -1\n"))


def test_changing_only_the_tier_does_not_replace_a_model() -> None:
    """A reload that only resizes the tier leaves every model equal (a loaded one is not replaced)."""
    a = parse_config(config("  prompt_cache_disk_gb: 1\n"))
    b = parse_config(config("  prompt_cache_disk_gb: 0\n"))
    assert a.models == b.models


def test_the_tier_can_be_moved_with_every_model(tmp_path: Path) -> None:
    """``with_prompt_cache_disk`` moves the tier of the manager and of every model keeping one
    (how a test's daemon gets a tier of its own)."""
    c = parse_config(config("  prompt_cache_disk_gb: 1\n")).with_prompt_cache_disk(tmp_path / "t")
    assert c.manager.prompt_cache_dir == tmp_path / "t"
    batched, serial = c.model("batched"), c.model("serial")
    assert batched is not None and serial is not None
    assert batched.prompt_cache_disk == DiskTier(tmp_path / "t", GIB)
    assert serial.prompt_cache_disk is None
