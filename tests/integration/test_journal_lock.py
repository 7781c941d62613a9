"""One journal, one daemon: whatever name the second one reaches the file by; and no silent loss."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import httpx
import pytest

from mlxd.residency.events import LeaseReleased
from mlxd.residency.states import Outcome
from tests.integration.conftest import config_of, fake
from tests.support.daemon import MLXD, REPO, DaemonProcess, serving, write_config


def journal_config(path: Path, journal: str) -> Path:
    return write_config(path, {
        "journal": {"path": journal, "synchronous": "normal"},
        "manager": {"memory_budget_gb": 1},
        "models": [fake("a", 0.1)],
    })


@pytest.mark.parametrize("tries", [pytest.param(1, id="once"),
                                   pytest.param(20, id="20-tries", marks=pytest.mark.stress)])
def test_a_second_daemon_on_the_same_journal_never_starts(tmp_path: Path, tries: int) -> None:
    """With a daemon running on jt.db, a second one started through a symlink, a hard link or a relative path fails every time, and the first keeps serving."""
    state = tmp_path / "state"
    state.mkdir()
    real = tmp_path / "jt.db"
    first = DaemonProcess(journal_config(tmp_path / "first.yaml", str(real)), state)
    with first:
        (tmp_path / "jlink.db").symlink_to(real)
        os.link(real, tmp_path / "jhard.db")
        sub = tmp_path / "sub"
        sub.mkdir()
        cfg = journal_config(sub / "second.yaml", str(tmp_path / "unused.db"))
        names = {  # given with --journal, from the folder `sub`
            "symlink": str(tmp_path / "jlink.db"),
            "hard link": str(tmp_path / "jhard.db"),
            "relative": "../jt.db",
        }
        for how, journal in names.items():
            for i in range(tries):
                try:
                    second = subprocess.run(
                        [*MLXD, "serve", "--config", str(cfg), "--port", "0", "--journal", journal],
                        cwd=sub, capture_output=True, text=True, timeout=30,
                        env={**os.environ, "MLXD_STATE_DIR": str(state), "PYTHONPATH": str(REPO)},
                    )
                except subprocess.TimeoutExpired:
                    pytest.fail(f"{how}: a second daemon started on the journal (still running)")
                assert second.returncode != 0, (how, i, second.stderr[-2000:])
                assert "in use by another mlxd" in second.stderr, (how, second.stderr[-2000:])
        health = httpx.get(first.url + "/health", timeout=10).json()
        assert health["status"] == "ok", health
        assert first.proc is not None and first.proc.poll() is None


async def test_a_rejected_journal_row_makes_health_degraded(tmp_path: Path) -> None:
    """A row the database refuses (it is lost) turns /health degraded, naming it, for the rest of the run."""
    config = config_of({"manager": {"memory_budget_gb": 1}, "models": [fake("a", 0.1)]}, tmp_path)
    async with serving(config, tmp_path) as s, s.client() as c:
        assert (await c.get("/health")).json()["status"] == "ok"
        bad = s.journal.record(LeaseReleased("no-such-lease", "a", Outcome.COMPLETED, 1.0))
        with pytest.raises(Exception, match="not written"):
            await s.journal.wait_committed(bad)
        health = (await c.get("/health")).json()
        assert health["status"] == "degraded", health
        assert any(f"seq {bad}" in r and "rejected" in r for r in health["reasons"]), health
