"""Load/generate/unload cycles in one process: a clean exit and no memory creep."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mlxd.engines.model_files.demo_model import write_demo_model

pytestmark = pytest.mark.mlx

REPO = Path(__file__).resolve().parents[2]
KB = 1 << 10
MB = 1 << 20


@pytest.fixture(scope="module")
def small_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The ~25M-parameter demo model (96 MB of fp32 weights): big enough for a leak to show in RSS."""
    path = tmp_path_factory.mktemp("models") / "small"
    write_demo_model(path, "small")
    return path


def test_twenty_cycles_exit_cleanly_and_give_the_memory_back(small_model_dir: Path) -> None:
    """20 load/generate/unload cycles exit with 0 and end within 20 MB of the RSS and 2 threads of the count after the first unload."""
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
    # the MLX thread is pooled: what it keeps across residencies is made once, by the first
    # load (MLX's random key for that thread, 8 bytes), so the first measurement includes it
    measured = result["measured"]
    assert max(measured) - min(measured) <= KB and min(measured) > 0.9 * weights, measured
    assert min(result["rss_after_load"]) - max(after_unload) > 0.5 * weights
    active = result["active_after_unload"]
    assert len(set(active)) == 1 and active[0] <= KB, active  # nothing grows, nothing is left but that
    # MLX keeps native threads for every thread that ran MLX work: a thread per load would
    # add about two a cycle (docs/platform-facts.md, "MLX never frees a thread's native threads")
    threads = result["threads_after_unload"]
    assert threads[-1] <= threads[0] + 2, f"threads grew over 20 cycles: {threads}"
