"""Load/generate/unload cycles in one process: a clean exit and no memory creep."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mlxd.engines.demo_model import write_demo_model

pytestmark = pytest.mark.mlx

REPO = Path(__file__).resolve().parents[2]
MB = 1 << 20


@pytest.fixture(scope="module")
def small_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The ~25M-parameter demo model (96 MB of fp32 weights): big enough for a leak to show in RSS."""
    path = tmp_path_factory.mktemp("models") / "small"
    write_demo_model(path, "small")
    return path


def test_twenty_cycles_exit_cleanly_and_give_the_memory_back(small_model_dir: Path) -> None:
    """20 load/generate/unload cycles exit with 0 and end within 20 MB of the RSS after the first unload."""
    proc = subprocess.run(
        [sys.executable, "-m", "tests.engines.cycles_main", str(small_model_dir), "20"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "terminate called" not in proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    after_unload = result["rss_after_unload"]
    assert len(after_unload) == 20
    growth = after_unload[-1] - after_unload[0]
    assert growth <= 20 * MB, f"RSS grew {growth / MB:.1f} MB over 20 cycles: {after_unload}"
    # the weights really were resident between load and unload, and were freed every time
    weights = (small_model_dir / "model.safetensors").stat().st_size
    assert all(m == result["measured"][0] and m > 0.9 * weights for m in result["measured"])
    assert min(result["rss_after_load"]) - max(after_unload) > 0.5 * weights
    assert result["active_after_unload"] == [0] * 20
