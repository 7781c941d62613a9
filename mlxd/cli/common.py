"""What several ``mlxd`` commands share: exit codes, the unreachable-daemon error, the journal path."""

from __future__ import annotations

import argparse
from pathlib import Path

from mlxd.config import JournalConfig, load_config

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3


class DaemonUnreachable(Exception):
    """The CLI could not reach the daemon over HTTP (exit 3)."""


def journal_path_from_args(args: argparse.Namespace) -> Path:
    """``--journal PATH``, else ``--config``'s ``journal.path``, else the default path."""
    if getattr(args, "journal", None):
        return Path(args.journal).expanduser()
    if getattr(args, "config", None):
        return Path(load_config(Path(args.config)).journal.path).expanduser()
    return Path(JournalConfig().path)
