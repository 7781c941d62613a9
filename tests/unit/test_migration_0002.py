"""Migration 0002 on a v1 journal full of history: every row kept, history the same, the new columns."""

from __future__ import annotations

import json
import logging
import sqlite3
from pathlib import Path

import pytest

from mlxd import cli
from mlxd.journal import retention
from mlxd.journal.migrate import discover, migrate, open_database, open_readonly
from mlxd.journal.reads import LEASE_COLUMNS
from mlxd.journal.replay import check_journal
from mlxd.journal.retention import auto_vacuum_mode
from tests.support.old_journal import write_v1_journal

TABLES = ("runs", "events", "transitions", "leases", "measurements")


def _history(capsys: pytest.CaptureFixture[str], path: Path, *extra: str) -> list[dict[str, object]]:
    capsys.readouterr()
    assert cli.main(["history", "--journal", str(path), "--json", "--limit", "0", *extra]) == 0
    rows: list[dict[str, object]] = json.loads(capsys.readouterr().out)
    return rows


def _dump(path: Path) -> dict[str, list[tuple[object, ...]]]:
    conn = open_readonly(path)
    try:
        return {
            t: [tuple(r) for r in conn.execute(f"SELECT * FROM {t} ORDER BY rowid")] for t in TABLES
        }
    finally:
        conn.close()


def test_a_100k_row_journal_keeps_every_row_and_prints_the_same_history(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """0001 -> 0002 on 100,000 rows keeps every row and `mlxd history --json` prints the same rows."""
    path = tmp_path / "journal.db"
    assert write_v1_journal(path, 100_000) >= 100_000
    before = _dump(path)
    transitions = _history(capsys, path)
    leases = _history(capsys, path, "--leases")
    assert len(transitions) == len(before["transitions"]) and len(leases) == len(before["leases"])
    v1 = tuple(c for c in LEASE_COLUMNS if c not in ("client", "kv_wait_seconds"))
    assert all(tuple(r) == v1 for r in leases)  # a v1 file reads without the later columns

    assert cli.main(["migrate", "--journal", str(path)]) == 0
    # the later migrations only add (a table, an index, a trigger, a column)
    assert f"migrated from v1 to v{len(discover())}" in capsys.readouterr().out

    after = _dump(path)
    for table in ("runs", "events", "transitions", "measurements"):
        assert after[table] == before[table], table
    # `client` (v2) and `kv_wait_seconds` (v6) added at the end
    assert [r[:-2] for r in after["leases"]] == before["leases"]
    assert {r[-2:] for r in after["leases"]} == {(None, None)}
    assert _history(capsys, path) == transitions
    after_leases = _history(capsys, path, "--leases")
    assert [r.pop("client") for r in after_leases] == [None] * len(leases)
    assert [r.pop("kv_wait_seconds") for r in after_leases] == [None] * len(leases)
    assert after_leases == leases
    conn = open_readonly(path)
    try:
        assert check_journal(conn) == []
        assert conn.execute("PRAGMA user_version").fetchone()[0] == len(discover())
        assert conn.execute("SELECT pruned_through FROM retention").fetchone()[0] == 0
        assert conn.execute("SELECT count(*) FROM checkpoints").fetchone()[0] == 0
    finally:
        conn.close()


def test_the_new_reason_and_columns_are_accepted(tmp_path: Path) -> None:
    """After 0002 a transition may say engine_died and a lease names its client; unknown reasons still fail."""
    path = tmp_path / "journal.db"
    write_v1_journal(path, 100)
    conn = sqlite3.connect(path, isolation_level=None)
    with pytest.raises(sqlite3.IntegrityError):
        conn.execute(
            "INSERT INTO transitions VALUES (999, 1, 0, 'alpha', 'loaded', 'failed', 'engine_died', NULL, NULL)"
        )
    conn.close()
    assert cli.main(["migrate", "--journal", str(path)]) == 0
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA foreign_keys = ON")
    conn.execute("INSERT INTO events VALUES (999, 1, 0, 'transition', 'alpha', '{}')")
    conn.execute(
        "INSERT INTO transitions VALUES (999, 1, 0, 'alpha', 'loaded', 'failed', 'engine_died', NULL, NULL)"
    )
    with pytest.raises(sqlite3.IntegrityError):
        conn.execute(
            "INSERT INTO transitions VALUES (1000, 1, 0, 'alpha', 'loaded', 'failed', 'bogus', NULL, NULL)"
        )
    conn.execute("UPDATE leases SET client = 'laptop' WHERE rowid = 1")
    indexes = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE tbl_name = 'transitions'")}
    assert {"transitions_model_seq", "transitions_at", "transitions_run"} <= indexes
    conn.close()


def test_an_older_file_gets_incremental_vacuum_once_outside_the_migration(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A v1 file (auto_vacuum none) is converted by one VACUUM: at start when small, else by `mlxd migrate`."""
    path = tmp_path / "journal.db"
    write_v1_journal(path, 2_000)
    conn = open_database(path)
    try:
        migrate(conn)
        assert auto_vacuum_mode(conn) == "none"  # a migration cannot VACUUM: not converted yet
        monkeypatch.setattr(retention, "CONVERT_AT_START_BYTES", 1024)
        level, line = retention.convert_at_start(conn, path) or (0, "")
        assert level == logging.WARNING and "run 'mlxd migrate'" in line
        assert auto_vacuum_mode(conn) == "none"
        monkeypatch.undo()
        level, line = retention.convert_at_start(conn, path) or (0, "")
        assert level == logging.INFO and "converted to incremental vacuum" in line
        assert auto_vacuum_mode(conn) == "incremental"
        assert retention.convert_at_start(conn, path) is None  # once
    finally:
        conn.close()
    other = tmp_path / "other.db"
    write_v1_journal(other, 2_000)
    assert cli.main(["migrate", "--journal", str(other)]) == 0
    assert "incremental vacuum on" in capsys.readouterr().out
    assert auto_vacuum_mode(open_readonly(other)) == "incremental"
    fresh = open_database(tmp_path / "fresh.db")
    assert auto_vacuum_mode(fresh) == "incremental"  # a new file has it from its first page
