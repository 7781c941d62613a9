"""Journal retention: incremental vacuum, so the file can give space back.

Theory of operation
-------------------
A journal created by schema v2 code has ``auto_vacuum = INCREMENTAL`` from its
first page (:func:`mlxd.journal.migrate.open_database` sets it before the first
table). A file made before has ``NONE``, and SQLite applies a new mode to an
existing file only with a ``VACUUM``, which rewrites the whole file and cannot
run inside a transaction, so no migration can do it. It is done once, outside
any migration:

* by ``mlxd migrate`` (with the daemon stopped: it takes the journal's lock), or
* by the writer process at the daemon's start when the file is at most
  :data:`CONVERT_AT_START_BYTES` (a VACUUM of that takes about a second); a
  bigger file is left as it is, with a warning saying to run ``mlxd migrate``.

A VACUUM is atomic: killed midway, the file is as it was, and the next attempt
starts again. Until the conversion, pruning still frees pages inside the file
(new rows reuse them), but the file does not shrink.
"""

from __future__ import annotations

import logging
import sqlite3
from pathlib import Path

from mlxd.units import MIB, format_bytes

#: an older journal up to this size is converted to incremental vacuum when the daemon starts
CONVERT_AT_START_BYTES = 64 * MIB

_MODES = {0: "none", 1: "full", 2: "incremental"}


def auto_vacuum_mode(conn: sqlite3.Connection) -> str:
    """``none``, ``full`` or ``incremental``: the file's auto-vacuum mode."""
    return _MODES.get(int(conn.execute("PRAGMA auto_vacuum").fetchone()[0]), "none")


def file_bytes(conn: sqlite3.Connection) -> int:
    """The size of the main database file in bytes (pages times page size)."""
    pages = int(conn.execute("PRAGMA page_count").fetchone()[0])
    return pages * int(conn.execute("PRAGMA page_size").fetchone()[0])


def convert_to_incremental(conn: sqlite3.Connection) -> tuple[int, int] | None:
    """Switch the file to incremental auto-vacuum with one VACUUM; None if it already is.

    Returns the file's size before and after. ``conn`` must be outside a
    transaction (autocommit mode).
    """
    if auto_vacuum_mode(conn) == "incremental":
        return None
    before = file_bytes(conn)
    conn.execute("PRAGMA auto_vacuum = INCREMENTAL")
    conn.execute("VACUUM")
    return before, file_bytes(conn)


def convert_at_start(conn: sqlite3.Connection, path: Path) -> tuple[int, str] | None:
    """At the daemon's start: convert a small older file; returns ``(logging level, line)``, if any."""
    if auto_vacuum_mode(conn) == "incremental":
        return None
    size = file_bytes(conn)
    if size > CONVERT_AT_START_BYTES:
        return logging.WARNING, (
            f"journal: {path} ({format_bytes(size)}) predates incremental vacuum, so pruned "
            "space is reused but the file does not shrink; stop mlxd and run "
            "'mlxd migrate' once to convert it"
        )
    sizes = convert_to_incremental(conn)
    assert sizes is not None
    return logging.INFO, (
        f"journal: {path} converted to incremental vacuum "
        f"({format_bytes(sizes[0])} -> {format_bytes(sizes[1])})"
    )
