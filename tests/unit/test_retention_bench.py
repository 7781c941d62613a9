"""bench/retention.py: a small run by default; the full 1,000,000-lease acceptance run under --stress."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from bench.retention import RESULTS, compare, measure, report
from mlxd.units import MIB


def test_a_small_run_prunes_and_reports(tmp_path: Path) -> None:
    """3,000 leases with max_mb 0.5: the pruning run prunes, the other does not, and both are measured."""
    pruning, plain = measure(3000, 3000, 0.5, tmp_path)
    assert pruning.events_pruned > 0 and plain.events_pruned == 0
    assert pruning.pruning_from is not None and plain.pruning_from is None
    assert len(pruning.latencies) == len(plain.latencies) == 300
    assert plain.max_db_bytes > pruning.max_db_bytes
    text = report(pruning, plain, 3000, 0.5)
    assert "p99 while pruning / without" in text


@pytest.mark.stress
def test_a_million_leases_stay_under_max_mb_and_pruning_barely_delays_commits() -> None:
    """1,000,000 leases with max_mb 50: the file stays under 55 MB; p99 record-to-commit within 20%."""
    directory = RESULTS / "retention-bench.tmp"
    try:
        pruning, plain = measure(1_000_000, 5000, 50, directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    print("\n" + report(pruning, plain, 5000, 50))
    assert pruning.max_db_bytes < 55 * MIB
    assert compare(pruning, plain)["ratio"] <= 1.2
