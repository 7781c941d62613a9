"""`mlxd migrate`: apply the journal migrations, or show their status without writing.

After the migrations, a journal made before incremental vacuum is converted
(one VACUUM, see :mod:`mlxd.journal.retention`); that needs the daemon stopped.
"""

from __future__ import annotations

import argparse
import os
from typing import IO

from mlxd.cli.common import journal_path_from_args
from mlxd.journal.migrate import Migration, migrate, open_database, status
from mlxd.journal.retention import auto_vacuum_mode, convert_to_incremental
from mlxd.journal.writer import take_lock
from mlxd.units import format_bytes


def cmd_migrate(args: argparse.Namespace) -> int:
    """``mlxd migrate [--status] [--journal PATH | --config PATH]``."""
    path = journal_path_from_args(args)
    if args.status:
        print(status(path).describe())
        return 0

    def announce(m: Migration) -> None:
        print(f"applying {m.name}", flush=True)

    conn = open_database(path)
    lock: tuple[IO[str], int] | None = None
    try:
        before, after = migrate(conn, on_apply=announce)
        if before == after:
            print(f"{path}: schema v{after}, up to date")
        else:
            print(f"{path}: migrated from v{before} to v{after}")
        if auto_vacuum_mode(conn) != "incremental":
            # one VACUUM of the whole file: refused while a daemon writes it (JournalError, its pid)
            lock = take_lock(path, os.getpid(), wait=0.0)
            print("converting to incremental vacuum (one VACUUM of the whole file)", flush=True)
            sizes = convert_to_incremental(conn)
            if sizes is not None:
                print(
                    f"{path}: incremental vacuum on "
                    f"({format_bytes(sizes[0])} -> {format_bytes(sizes[1])})"
                )
    finally:
        conn.close()
        if lock is not None:  # after the connection: closing a descriptor drops its POSIX locks
            os.close(lock[1])
            lock[0].close()
    return 0
