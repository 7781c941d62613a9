"""The migration runner: order, refusals, one transaction per file, read-only status, the wheel."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

from mlxd import cli
from mlxd.errors import ConfigError, JournalError
from mlxd.journal.migrate import (
    _apply_one,
    discover,
    migrate,
    open_database,
    schema_version,
    split_statements,
    status,
)
from mlxd.resources import migrations_dir

REPO = Path(__file__).resolve().parents[2]

#: DESIGN.md's public columns, table by table (the schema may add, never drop).
DESIGN_COLUMNS = {
    "runs": {"id", "started_at", "stopped_at", "clean_stop", "pid", "version", "config_path"},
    "transitions": {
        "seq", "run_id", "at", "model", "from_state", "to_state", "reason", "memory_bytes", "error",
    },
    "leases": {
        "id", "run_id", "model", "request_id", "route", "acquired_at", "released_at", "outcome",
        "prompt_tokens", "completion_tokens",
    },
    "measurements": {"model", "at", "memory_bytes", "load_seconds"},
    "events": {"seq", "run_id", "at", "kind", "model", "payload"},
}  # fmt: skip


def _dir_with(tmp_path: Path, files: dict[str, str], *, real_first: bool = True) -> Path:
    d = tmp_path / "migrations"
    d.mkdir()
    if real_first:
        shutil.copy(migrations_dir() / "0001_init.sql", d / "0001_init.sql")
    for name, sql in files.items():
        (d / name).write_text(textwrap.dedent(sql))
    return d


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_fresh_file_gets_every_design_column(tmp_path: Path) -> None:
    """A new journal is migrated to the latest version with every table and column DESIGN.md lists."""
    conn = open_database(tmp_path / "j.db")
    before, after = migrate(conn)
    assert (before, after) == (0, len(discover()))
    assert schema_version(conn) == after
    for table, columns in DESIGN_COLUMNS.items():
        have = {r[1] for r in conn.execute(f"PRAGMA table_info({table})")}
        assert columns <= have, (table, columns - have)
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert conn.execute("PRAGMA foreign_keys").fetchone()[0] == 1


def test_migrating_twice_changes_nothing(tmp_path: Path) -> None:
    """Running the migrations on an up-to-date file applies nothing and keeps the version."""
    conn = open_database(tmp_path / "j.db")
    _, v = migrate(conn)
    applied: list[str] = []
    assert migrate(conn, on_apply=lambda m: applied.append(m.name)) == (v, v)
    assert applied == []


@pytest.mark.parametrize(
    ("names", "message"),
    [
        (["0001_a.sql", "0003_c.sql"], "missing 0002"),
        (["0001_a.sql", "0001_b.sql"], "duplicate number 0001"),
        (["0001_a.sql", "2_b.sql"], "not named NNNN_name.sql"),
        (["0002_b.sql"], "missing 0001"),
    ],
)
def test_bad_numbering_refuses_with_one_line(
    tmp_path: Path, names: list[str], message: str
) -> None:
    """A gap, a duplicate or a misnamed file refuses to start with one ConfigError line."""
    d = tmp_path / "m"
    d.mkdir()
    for n in names:
        (d / n).write_text("CREATE TABLE t_" + n[:4] + "(x);")
    with pytest.raises(ConfigError, match=message) as info:
        migrate(open_database(tmp_path / "j.db"), d)
    assert "\n" not in info.value.message


def test_newer_database_refuses_and_cli_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A journal newer than the code refuses to migrate; `mlxd migrate` prints one line and exits 2."""
    path = tmp_path / "j.db"
    conn = open_database(path)
    migrate(conn)
    conn.execute("PRAGMA user_version = 99")
    conn.close()
    with pytest.raises(ConfigError, match="newer than this mlxd"):
        migrate(open_database(path))
    assert cli.main(["migrate", "--journal", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "schema v99 is newer" in err


def test_broken_later_migration_leaves_previous_version(tmp_path: Path) -> None:
    """A failing migration rolls back with its version bump: the file stays at the last good version."""
    d = _dir_with(
        tmp_path,
        {
            "0002_notes.sql": "CREATE TABLE notes(x TEXT); INSERT INTO notes VALUES ('a;b');",
            "0003_broken.sql": """
                CREATE TABLE half(x);
                INSERT INTO half VALUES (1);
                INSERT INTO no_such_table VALUES (1);
            """,
        },
    )
    conn = open_database(tmp_path / "j.db")
    with pytest.raises(JournalError, match=r"0003_broken.sql failed .* stays at v2"):
        migrate(conn, d)
    assert schema_version(conn) == 2
    assert not conn.in_transaction
    tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert "notes" in tables and "half" not in tables
    assert conn.execute("SELECT x FROM notes").fetchall() == [("a;b",)]
    (d / "0003_broken.sql").write_text("CREATE TABLE half(x);")
    assert migrate(conn, d) == (2, 3)


def test_each_step_rereads_the_version_under_the_lock(tmp_path: Path) -> None:
    """A step another process applied while we waited for the lock is skipped, not applied twice."""
    d = _dir_with(tmp_path, {"0002_seed.sql": "CREATE TABLE seed(x); INSERT INTO seed VALUES (1);"})
    path = tmp_path / "j.db"
    first, second = open_database(path), open_database(path)
    migrate(first, d)
    migrations = discover(d)
    # `second` decided to apply 0002 before `first` finished: the step sees v2 and skips.
    assert _apply_one(second, migrations[1]) is False
    assert second.execute("SELECT count(*) FROM seed").fetchone()[0] == 1


def test_statements_split_keeps_triggers_and_strings_whole() -> None:
    """Semicolons inside strings, comments and trigger bodies do not split a statement."""
    sql = textwrap.dedent("""
        -- a comment; with a semicolon
        CREATE TABLE a(x TEXT DEFAULT 'x;y');
        CREATE TRIGGER t AFTER INSERT ON a BEGIN
            UPDATE a SET x = 'z;' WHERE rowid = new.rowid;
        END;
        INSERT INTO a VALUES ('last')""")
    statements = list(split_statements(sql))
    assert len(statements) == 3
    assert statements[1].strip().startswith("CREATE TRIGGER") and "END;" in statements[1]
    conn = sqlite3.connect(":memory:")
    for s in statements:
        conn.execute(s)
    assert conn.execute("SELECT x FROM a").fetchall() == [("z;",)]


def test_status_never_writes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`mlxd migrate --status` reports a missing file without creating it and leaves a file unchanged."""
    missing = tmp_path / "nested" / "missing.db"
    assert cli.main(["migrate", "--status", "--journal", str(missing)]) == 0
    assert "no journal file yet" in capsys.readouterr().out
    assert not missing.exists() and not missing.parent.exists()

    path = tmp_path / "old.db"
    d = _dir_with(tmp_path, {"0002_more.sql": "CREATE TABLE more(x);"})
    conn = open_database(path)
    # bring the file to v1 only, with a migrations folder holding just 0001
    only_first = tmp_path / "first"
    only_first.mkdir()
    shutil.copy(d / "0001_init.sql", only_first)
    migrate(conn, only_first)
    conn.close()
    digest = _digest(path)
    report = status(path, d)
    assert (report.current, report.latest, report.pending) == (1, 2, ("0002_more.sql",))
    assert "pending: 0002_more.sql" in report.describe()
    assert _digest(path) == digest
    check = sqlite3.connect(path)
    assert schema_version(check) == 1


def test_cli_migrate_creates_and_upgrades(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`mlxd migrate --journal PATH` creates the file at the latest version and says what it did."""
    path = tmp_path / "state" / "j.db"
    assert cli.main(["migrate", "--journal", str(path)]) == 0
    out = capsys.readouterr().out
    assert "applying 0001_init.sql" in out and f"migrated from v0 to v{len(discover())}" in out
    assert cli.main(["migrate", "--status", "--journal", str(path)]) == 0
    assert "up to date" in capsys.readouterr().out


_PARKED_MIGRATOR = """
import sys
from pathlib import Path
from mlxd.journal.migrate import migrate, open_database

conn = open_database(Path(sys.argv[1]))
calls = 0

def park() -> int:
    global calls
    calls += 1
    if calls == 3000:  # deep inside 0002's INSERT, with pages already spilled to the WAL
        print("inside", flush=True)
        sys.stdin.readline()  # parked here until killed
    return 0

def on_apply(m) -> None:
    if m.number == 2:
        conn.set_progress_handler(park, 1000)

migrate(conn, Path(sys.argv[2]), on_apply=on_apply)
print("finished", flush=True)
"""


def test_kill_during_a_long_migration_keeps_the_old_version(tmp_path: Path) -> None:
    """A migrator killed with SIGKILL in the middle of a migration leaves the file at the old version."""
    d = _dir_with(
        tmp_path,
        {
            "0002_big.sql": """
                CREATE TABLE big(x INTEGER, pad TEXT);
                WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 200000)
                INSERT INTO big SELECT x, hex(randomblob(100)) FROM c;
            """
        },
    )
    path = tmp_path / "j.db"
    proc = subprocess.Popen(
        [sys.executable, "-c", _PARKED_MIGRATOR, str(path), str(d)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "inside"
        wal = path.with_name(path.name + "-wal")
        assert wal.stat().st_size > 100_000  # uncommitted pages of 0002 really are on disk
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    conn = open_database(path)
    assert schema_version(conn) == 1
    assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    assert not conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'big'").fetchall()
    assert migrate(conn, d) == (1, 2)
    assert conn.execute("SELECT count(*) FROM big").fetchone()[0] == 200000


def test_built_wheel_ships_the_migrations(tmp_path: Path) -> None:
    """The wheel built from this tree contains every migration as mlxd/migrations/NNNN_*.sql."""
    out = tmp_path / "wheel"
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", str(REPO), "-w", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    (wheel,) = out.glob("mlxd-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for m in discover():
        assert f"mlxd/migrations/{m.name}" in names
        assert zipfile.ZipFile(wheel).read(f"mlxd/migrations/{m.name}") == m.path.read_bytes()
