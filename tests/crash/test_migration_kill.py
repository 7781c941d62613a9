"""A migration killed midway leaves the journal at the old version or the new one, never between.

``tests/unit/test_migrate.py`` kills a bare migrator parked inside a long
statement; here the real ``mlxd serve`` SIGKILLs itself between two statements
of a migration (``MLXD_CRASH_AT=migrate.mid_migration:N``), for the first
migration of a fresh file and for a pending second one
(``MLXD_MIGRATIONS_DIR``) on a journal that already holds history.
"""

from __future__ import annotations

import shutil
import signal
import time
from pathlib import Path

import httpx
import pytest

from mlxd.journal.migrate import open_readonly
from mlxd.journal.replay import check_journal
from mlxd.resources import migrations_dir
from tests.crash.journal_view import snapshot
from tests.crash.supervisor import INIT_STATEMENTS, TEST_MIGRATION, config
from tests.support.daemon import DaemonProcess, write_config

PROBE_STATEMENTS = TEST_MIGRATION.count(";")


def _until_ready(url: str) -> None:
    deadline = time.monotonic() + 30
    while not httpx.get(url + "/health", timeout=10).json()["ready"]:
        assert time.monotonic() < deadline, "not ready after 30 s"
        time.sleep(0.01)


def _killed_at(cfg: Path, tmp: Path, n: int, **env: str) -> None:
    """Start the daemon armed at the nth statement; it must die by SIGKILL before it is ready."""
    daemon = DaemonProcess(cfg, tmp, env={"MLXD_CRASH_AT": f"migrate.mid_migration:{n}", **env})
    with pytest.raises(RuntimeError, match="exited"):
        daemon.start(timeout=30)
    assert daemon.proc is not None and daemon.proc.returncode == -signal.SIGKILL
    assert f"crash point migrate.mid_migration:{n} reached" in daemon.log()


def test_a_fresh_journal_killed_inside_its_first_migration_stays_empty(tmp_path: Path) -> None:
    """Killed between statements of 0001, a new journal is at v0 with no table, and the next start builds it."""
    journal = tmp_path / "journal.db"
    cfg = write_config(tmp_path / "models.yaml", config(journal))
    for n in sorted({1, INIT_STATEMENTS // 2, INIT_STATEMENTS}):
        _killed_at(cfg, tmp_path, n)
        snap = snapshot(journal)
        assert (snap.version, snap.tables, snap.integrity) == (0, (), ["ok"])
    with DaemonProcess(cfg, tmp_path) as daemon:
        _until_ready(daemon.url)
    snap = snapshot(journal)
    assert snap.version == 1 and snap.problems == [] and snap.max_run == 1


def test_a_pending_migration_killed_at_each_statement_keeps_v1_and_its_history(
    tmp_path: Path,
) -> None:
    """Killed after any statement of a pending 0002, the journal stays v1 with its rows; the next start gets v2."""
    journal = tmp_path / "journal.db"
    cfg = write_config(tmp_path / "models.yaml", config(journal))
    with DaemonProcess(cfg, tmp_path) as daemon:
        _until_ready(daemon.url)
        r = httpx.post(daemon.url + "/admin/models/gamma/load", timeout=30)
        assert r.status_code == 200
        daemon.kill()
    history = snapshot(journal)
    assert history.version == 1 and history.transitions

    pending = tmp_path / "migrations"
    pending.mkdir()
    shutil.copy(migrations_dir() / "0001_init.sql", pending)
    (pending / "0002_crash_probe.sql").write_text(TEST_MIGRATION)
    for n in range(1, PROBE_STATEMENTS + 1):
        _killed_at(cfg, tmp_path, n, MLXD_MIGRATIONS_DIR=str(pending))
        snap = snapshot(journal)
        assert snap.integrity == ["ok"]
        assert snap.version == 1
        assert not [t for t in snap.tables if "crash_probe" in t] and not snap.probe_column
        assert snap.transitions == history.transitions and snap.max_run == history.max_run

    with DaemonProcess(cfg, tmp_path, env={"MLXD_MIGRATIONS_DIR": str(pending)}) as daemon:
        _until_ready(daemon.url)  # restore done; then a clean stop
    conn = open_readonly(journal)
    try:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == 2
        probes = dict(conn.execute("SELECT model, n FROM crash_probe_view").fetchall())
        assert probes["gamma"] >= 2  # the rows 0002 copied are those of the kept history
        assert check_journal(conn) == []
        # the previous run's gamma came back (restore), then went at the clean stop
        last = conn.execute(
            "SELECT to_state, reason FROM transitions WHERE model = 'gamma' ORDER BY seq DESC LIMIT 3"
        ).fetchall()
        assert [tuple(r) for r in last][::-1] == [
            ("loaded", "restore"), ("unloading", "shutdown"), ("unloaded", "shutdown"),
        ]  # fmt: skip
    finally:
        conn.close()
