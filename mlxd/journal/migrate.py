"""Opening the journal file and upgrading its schema (``mlxd migrate``).

Theory of operation
-------------------
The schema version lives in ``PRAGMA user_version``. Migrations are the files
``NNNN_name.sql`` of :func:`mlxd.resources.migrations_dir`, numbered 1..N without
gaps or duplicates. Each file is applied in **one** transaction together with
its ``user_version`` bump (SQLite DDL is transactional), so a migration that
fails or is killed midway leaves the database at the old version or at the
new one, never in between.

Each step takes the write lock first (``BEGIN IMMEDIATE``) and re-reads the
version inside the transaction, so two processes migrating the same file at
once apply each step exactly once. The statements are executed one by one
inside that transaction (``executescript`` would commit it), which is why a
migration file must not contain ``BEGIN``/``COMMIT`` or ``PRAGMA
journal_mode`` (the journal sets WAL when it connects, see
:func:`open_database`).

Refusals are :class:`~mlxd.errors.ConfigError` (one line, exit 2): a gap, a
duplicate number, a misnamed ``.sql`` file, a database newer than this program.
A migration whose SQL fails is a :class:`~mlxd.errors.JournalError` (exit 1)
naming the file; the database stays at the version before it.

``mlxd migrate --status`` opens the file read-only (``mode=ro``) and never
writes; on a missing file it says so.
"""

from __future__ import annotations

import re
import sqlite3
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from mlxd.crash_points import crash_point
from mlxd.errors import ConfigError, JournalError

MIGRATION_RE = re.compile(r"^(\d{4})_[A-Za-z0-9_-]+\.sql$")

Synchronous = Literal["full", "normal"]


@dataclass(frozen=True, slots=True)
class Migration:
    number: int
    path: Path

    @property
    def name(self) -> str:
        return self.path.name


@dataclass(frozen=True, slots=True)
class MigrationStatus:
    """What ``mlxd migrate --status`` reports."""

    path: Path
    exists: bool
    #: ``user_version`` of the file (0 when missing or never migrated)
    current: int
    #: the highest migration this program ships
    latest: int
    pending: tuple[str, ...]

    def describe(self) -> str:
        if not self.exists:
            return (
                f"{self.path}: no journal file yet "
                f"(the daemon or 'mlxd migrate' creates it at schema v{self.latest})"
            )
        if self.current > self.latest:
            return (
                f"{self.path}: schema v{self.current} is newer than this mlxd "
                f"(knows up to v{self.latest}); upgrade mlxd"
            )
        if not self.pending:
            return f"{self.path}: schema v{self.current}, up to date"
        return (
            f"{self.path}: schema v{self.current} of v{self.latest}; "
            f"pending: {', '.join(self.pending)}"
        )


def discover(directory: Path | None = None) -> list[Migration]:
    """The migrations of ``directory`` in order; refuses gaps, duplicates and misnamed files."""
    if directory is None:
        from mlxd.resources import migrations_dir

        directory = migrations_dir()
    if not directory.is_dir():
        raise ConfigError(f"migrations: folder {directory} is missing from this install")
    found: dict[int, Path] = {}
    for p in sorted(directory.iterdir()):
        if p.suffix != ".sql":
            continue
        m = MIGRATION_RE.match(p.name)
        if not m:
            raise ConfigError(
                f"migrations: {p.name} is not named NNNN_name.sql (four digits, then a name)"
            )
        n = int(m.group(1))
        if n in found:
            raise ConfigError(
                f"migrations: duplicate number {n:04d} ({found[n].name} and {p.name})"
            )
        found[n] = p
    numbers = sorted(found)
    if numbers != list(range(1, len(numbers) + 1)):
        missing = sorted(set(range(1, (numbers[-1] if numbers else 0) + 1)) - set(numbers))
        raise ConfigError(
            "migrations: numbers must run 1..N without gaps; missing "
            + ", ".join(f"{n:04d}" for n in missing)
        )
    return [Migration(n, found[n]) for n in numbers]


def split_statements(sql: str) -> Iterator[str]:
    """The statements of a migration file, one at a time (triggers and strings kept whole)."""
    pending = ""
    for chunk in sql.split(";"):
        pending += chunk + ";"
        if sqlite3.complete_statement(pending):
            yield pending
            pending = ""
    tail = pending[:-1]  # the ';' added after the last chunk is not in the file
    if tail.strip():
        yield tail


def schema_version(conn: sqlite3.Connection) -> int:
    return int(conn.execute("PRAGMA user_version").fetchone()[0])


def _apply_one(conn: sqlite3.Connection, migration: Migration) -> bool:
    """Apply one migration with its version bump in one transaction; False if already applied."""
    sql = migration.path.read_text(encoding="utf-8")
    conn.execute("BEGIN IMMEDIATE")
    try:
        if schema_version(conn) >= migration.number:
            conn.execute("COMMIT")
            return False  # another process applied it while we waited for the lock
        for statement in split_statements(sql):
            conn.execute(statement)
            crash_point("migrate.mid_migration")
        # PRAGMA takes no bound parameters; the number is an int from the file name.
        conn.execute(f"PRAGMA user_version = {int(migration.number)}")
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
    return True


def migrate(
    conn: sqlite3.Connection,
    directory: Path | None = None,
    *,
    on_apply: Callable[[Migration], None] | None = None,
) -> tuple[int, int]:
    """Bring ``conn``'s database up to the newest migration; returns ``(before, after)``.

    ``conn`` must be in autocommit mode (``isolation_level=None``). ``on_apply``
    is called just before each migration is applied.
    """
    migrations = discover(directory)
    latest = migrations[-1].number if migrations else 0
    try:
        before = schema_version(conn)
    except sqlite3.Error as e:
        raise JournalError(f"journal: cannot read the schema version: {e}") from e
    if before > latest:
        raise ConfigError(
            f"journal: schema v{before} is newer than this mlxd (knows up to v{latest}); "
            "upgrade mlxd or point it at another journal"
        )
    current = before
    for migration in migrations:
        if migration.number <= current:
            continue
        if on_apply is not None:
            on_apply(migration)
        try:
            _apply_one(conn, migration)
        except sqlite3.Error as e:
            raise JournalError(
                f"journal: migration {migration.name} failed ({e}); "
                f"the database stays at v{current}"
            ) from e
        current = migration.number
    return before, current


def open_database(
    path: Path,
    *,
    synchronous: Synchronous = "full",
    busy_timeout_ms: int = 5000,
) -> sqlite3.Connection:
    """Open (creating it and its folder if needed) the journal for writing.

    WAL, ``synchronous`` FULL or NORMAL (``fullfsync`` on macOS), foreign keys
    on, ``busy_timeout``, incremental auto-vacuum for a new file; autocommit
    mode so transactions are explicit.
    """
    if synchronous not in ("full", "normal"):
        raise ConfigError(f"journal.synchronous: must be full or normal, not {synchronous!r}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(
            path,
            isolation_level=None,
            timeout=busy_timeout_ms / 1000,
            check_same_thread=True,
        )
    except (OSError, sqlite3.Error) as e:
        raise JournalError(f"journal: cannot open {path}: {e}") from e
    try:
        conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout_ms)}")
        # Before the first table (a new file) this is what the file gets: freed pages can be
        # given back while the daemon runs. On an older file it waits for a VACUUM
        # (mlxd.journal.retention.convert_to_incremental).
        conn.execute("PRAGMA auto_vacuum = INCREMENTAL")
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute(f"PRAGMA synchronous = {synchronous.upper()}")
        if sys.platform == "darwin":
            conn.execute("PRAGMA fullfsync = ON")
        conn.execute("PRAGMA foreign_keys = ON")
    except sqlite3.Error as e:
        conn.close()
        raise JournalError(f"journal: cannot open {path}: {e}") from e
    return conn


def open_readonly(path: Path, *, busy_timeout_ms: int = 5000) -> sqlite3.Connection:
    """Open the journal read-only (``mode=ro``): it is never created or written.

    Raises :class:`JournalError` when the file does not exist.
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise JournalError(f"journal: no journal file at {path}")
    try:
        conn = sqlite3.connect(
            path.resolve().as_uri() + "?mode=ro",
            uri=True,
            timeout=busy_timeout_ms / 1000,
            isolation_level=None,
        )
        conn.row_factory = sqlite3.Row
        conn.execute("PRAGMA query_only = ON")
    except sqlite3.Error as e:
        raise JournalError(f"journal: cannot read {path}: {e}") from e
    return conn


def status(path: Path, directory: Path | None = None) -> MigrationStatus:
    """The schema status of the journal at ``path``; reads only."""
    migrations = discover(directory)
    latest = migrations[-1].number if migrations else 0
    path = Path(path).expanduser()
    if not path.exists():
        return MigrationStatus(path, False, 0, latest, tuple(m.name for m in migrations))
    conn = open_readonly(path)
    try:
        current = schema_version(conn)
    except sqlite3.Error as e:
        raise JournalError(f"journal: cannot read {path}: {e}") from e
    finally:
        conn.close()
    pending = tuple(m.name for m in migrations if m.number > current)
    return MigrationStatus(path, True, current, latest, pending)




