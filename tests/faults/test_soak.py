"""The 30-minute soak (``--stress``): ``bench/soak.py`` against a real daemon, judged by its verdict."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.stress
def test_thirty_minutes_of_mixed_traffic(tmp_path: Path) -> None:
    """30 minutes of streams, drops, swaps under a budget for one of three models, admin unloads and preemptions: RSS grows under 1 MB/min after warm-up, fds and threads do not grow, no lease leaks, no 5xx but typed 503s, a clean stop."""
    out = tmp_path / "soak.md"
    done = subprocess.run(
        [sys.executable, "bench/soak.py", "--minutes", "30", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=45 * 60,
    )
    assert out.with_suffix(".json").exists(), done.stdout[-3000:] + done.stderr[-3000:]
    verdict = json.loads(out.with_suffix(".json").read_text())["verdict"]
    assert verdict["ok"], (verdict, out.read_text())
