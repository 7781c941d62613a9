"""`mlxd check-config`: validate a config and print the memory budget report in words."""

from __future__ import annotations

import argparse

from mlxd.config import load_config
from mlxd.config.budget import build_memory_budget_report, render_report
from mlxd.journal.reads import journal_measurements


def cmd_check_config(args: argparse.Namespace) -> int:
    """``mlxd check-config PATH``: validate the config and print the budget report (exit 0).

    A config error raises :class:`mlxd.errors.ConfigError`, which the CLI prints
    as one line and turns into exit code 2.
    """
    config = load_config(args.path, measured=journal_measurements)
    print(render_report(config, build_memory_budget_report(config)))
    return 0
