"""A migration killed midway leaves the journal at the old version or the new one, never between.

``tests/unit/test_migrate.py`` kills a bare migrator parked inside a long
statement; here the real ``mlxd serve`` SIGKILLs itself between two statements
of a migration (``MLXD_CRASH_AT=migrate.mid_migration:N``), for the first
migration of a fresh file and for a pending second one
(``MLXD_MIGRATIONS_DIR``) on a journal that already holds history.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterable
from pathlib import Path

import httpx
import pytest

from mlxd.journal.migrate import discover, open_readonly, split_statements
from mlxd.journal.replay import check_journal
from tests.crash.journal_view import snapshot
from tests.crash.supervisor import (
    INIT_STATEMENTS,
    LATEST,
    TEST_MIGRATION,
    config,
    with_test_migration,
)
from tests.support.daemon import DaemonProcess, write_config
from tests.support.old_journal import write_v1_journal

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
    assert snap.version == LATEST and snap.problems == [] and snap.max_run == 1


def test_a_pending_migration_killed_at_each_statement_keeps_its_version_and_history(
    tmp_path: Path,
) -> None:
    """Killed after any statement of a pending migration, the journal keeps its version and rows; the next start applies it."""
    journal = tmp_path / "journal.db"
    cfg = write_config(tmp_path / "models.yaml", config(journal))
    with DaemonProcess(cfg, tmp_path) as daemon:
        _until_ready(daemon.url)
        r = httpx.post(daemon.url + "/admin/models/gamma/load", timeout=30)
        assert r.status_code == 200
        daemon.kill()
    history = snapshot(journal)
    assert history.version == LATEST and history.transitions

    pending = with_test_migration(tmp_path / "migrations")
    for n in range(1, PROBE_STATEMENTS + 1):
        _killed_at(cfg, tmp_path, n, MLXD_MIGRATIONS_DIR=str(pending))
        snap = snapshot(journal)
        assert snap.integrity == ["ok"]
        assert snap.version == LATEST
        assert not [t for t in snap.tables if "crash_probe" in t] and not snap.probe_column
        assert snap.transitions == history.transitions and snap.max_run == history.max_run

    with DaemonProcess(cfg, tmp_path, env={"MLXD_MIGRATIONS_DIR": str(pending)}) as daemon:
        _until_ready(daemon.url)  # restore done; then a clean stop
    conn = open_readonly(journal)
    try:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == LATEST + 1
        probes = dict(conn.execute("SELECT model, n FROM crash_probe_view").fetchall())
        assert probes["gamma"] >= 2  # the rows the migration copied are those of the kept history
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


#: statements of the real 0002 (the last one is the empty one after the final ';')
STATEMENTS_0002 = len(list(split_statements(discover()[1].path.read_text())))


def test_the_real_0002_killed_midway_on_a_v1_journal_keeps_every_row(tmp_path: Path) -> None:
    """Killed inside 0002 (with the old transitions table dropped) on a v1 journal, the file stays v1 with every row; then the newest version keeps them all."""
    _kill_0002_at(tmp_path, (3, STATEMENTS_0002))


@pytest.mark.stress
def test_the_real_0002_killed_at_each_statement_keeps_every_row(tmp_path: Path) -> None:
    """Killed after each statement of 0002 on a v1 journal, the file stays v1 with every row; then the newest version keeps them all."""
    _kill_0002_at(tmp_path, range(1, STATEMENTS_0002 + 1))


def _kill_0002_at(tmp_path: Path, statements: Iterable[int]) -> None:
    journal = tmp_path / "journal.db"
    write_v1_journal(journal, 10_000)
    settings = config(journal)
    settings["journal"].update(retain_days=0, max_mb=0)  # the rows are from 2023: keep them
    cfg = write_config(tmp_path / "models.yaml", settings)
    before = _rows(journal)
    for n in statements:
        _killed_at(cfg, tmp_path, n)
        snap = snapshot(journal)
        assert snap.integrity == ["ok"] and snap.version == 1 and snap.problems == []
        assert _rows(journal) == before
    with DaemonProcess(cfg, tmp_path) as daemon:
        _until_ready(daemon.url)
    after = _rows(journal, runs=3)
    # client (v2) and kv_wait_seconds (v6) added
    assert after["leases"] == [(*lease, None, None) for lease in before["leases"]]
    assert {k: v for k, v in after.items() if k != "leases"} == {
        k: v for k, v in before.items() if k != "leases"
    }
    snap = snapshot(journal)
    assert snap.version == LATEST and snap.problems == []
    conn = open_readonly(journal)
    try:  # a small older file is converted at the start (see mlxd.journal.retention)
        assert conn.execute("PRAGMA auto_vacuum").fetchone()[0] == 2
    finally:
        conn.close()


def _rows(path: Path, runs: int | None = None) -> dict[str, list[tuple[object, ...]]]:
    """Every row of the history tables (of the first ``runs`` runs), in order."""
    conn = open_readonly(path)
    where = "" if runs is None else f" WHERE run_id <= {int(runs)}"
    try:
        return {
            table: [tuple(r) for r in conn.execute(f"SELECT * FROM {table}{where} ORDER BY rowid")]
            for table in ("events", "transitions", "leases")
        }
    finally:
        conn.close()
