"""What several ``mlxd`` commands share: exit codes, the unreachable-daemon error, the journal path."""

from __future__ import annotations

import argparse
from pathlib import Path

from mlxd.config import JournalConfig, load_config
from mlxd.errors import ConfigError

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


def checked_api_key(key: str | None, source: str) -> str | None:
    """``key`` if it can travel in an ``Authorization: Bearer`` header; else a one-line ConfigError.

    ``source`` names where the key came from (``--api-key``, ``MLXD_API_KEY``).
    """
    if key is None:
        return None
    bad = next((ch for ch in key if not (ch.isascii() and ch.isprintable()) or ch.isspace()), None)
    if bad is not None:
        what = "a non-ASCII character" if not bad.isascii() else f"the character {bad!r}"
        raise ConfigError(
            f"{source}: an API key must be printable ASCII without spaces (it has {what})"
        )
    return key
