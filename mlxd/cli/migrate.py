"""`mlxd migrate`: apply the journal migrations, or show their status without writing."""

from __future__ import annotations

import argparse

from mlxd.cli.common import journal_path_from_args
from mlxd.journal.migrate import Migration, migrate, open_database, status


def cmd_migrate(args: argparse.Namespace) -> int:
    """``mlxd migrate [--status] [--journal PATH | --config PATH]``."""
    path = journal_path_from_args(args)
    if args.status:
        print(status(path).describe())
        return 0

    def announce(m: Migration) -> None:
        print(f"applying {m.name}", flush=True)

    conn = open_database(path)
    try:
        before, after = migrate(conn, on_apply=announce)
    finally:
        conn.close()
    if before == after:
        print(f"{path}: schema v{after}, up to date")
    else:
        print(f"{path}: migrated from v{before} to v{after}")
    return 0
