"""`mlxd check-config`: validate a config and print the memory budget report in words."""

from __future__ import annotations

import argparse
from datetime import datetime

from mlxd.config import Config, load_config
from mlxd.config.budget import build_memory_budget_report, render_report
from mlxd.errors import ConfigError
from mlxd.journal.reads import KvPeaks, journal_kv_peaks, journal_measurements
from mlxd.units import format_bytes


def cmd_check_config(args: argparse.Namespace) -> int:
    """``mlxd check-config PATH``: validate the config and print the budget report (exit 0).

    Config errors raise one :class:`mlxd.errors.ConfigError` listing all of them, which
    the CLI prints one line each and turns into exit code 2; so does a model that can
    never fit the budget, unless ``--allow-unfit``. Each model's KV peaks in the journal
    (``kv_peaks``) are printed under the KV cache its config budgets.
    """
    config = load_config(args.path, measured=journal_measurements)
    notes = kv_peak_notes(config, journal_kv_peaks(config.journal))
    print(render_report(config, build_memory_budget_report(config), notes))
    unfit = unfit_models(config)
    if unfit and not args.allow_unfit:
        lines = [
            f"models[{i}] ({name}): can never fit: {format_bytes(size)} > the "
            f"{format_bytes(config.manager.memory_budget_bytes)} budget (every request for it would "
            "fail with model_exceeds_budget); raise manager.memory_budget_gb, lower the model's "
            "estimate, or pass --allow-unfit"
            for i, name, size in unfit
        ]
        head = [f"{len(lines)} errors:"] if len(lines) > 1 else []
        raise ConfigError("\n".join(head + lines), param="manager.memory_budget_gb")
    return 0


def unfit_models(config: Config) -> list[tuple[int, str, int]]:
    """``(index, name, bytes)`` of each model whose estimate is larger than the whole budget."""
    budget = config.manager.memory_budget_bytes
    sizes = [(i, m.name, config.estimate(m.name).bytes) for i, m in enumerate(config.models)]
    return [(i, name, size) for i, name, size in sizes if size > budget]


def kv_peak_notes(config: Config, peaks: dict[str, KvPeaks]) -> dict[str, list[str]]:
    """One line per model with journaled KV peaks: the highest against today's kv_cache, the latest."""
    notes: dict[str, list[str]] = {}
    for model in config.models:
        p = peaks.get(model.name)
        if p is None:
            continue
        budget = config.estimate(model.name).kv_cache
        share = f" ({p.highest_bytes / budget:.0%} of its {format_bytes(budget)})" if budget else ""
        notes[model.name] = [
            f"KV measured: peak {format_bytes(p.highest_bytes)}{share} in {p.residencies} "
            f"residenc{'y' if p.residencies == 1 else 'ies'} since {_local(p.since)}; "
            f"the latest {format_bytes(p.latest_bytes)} ({_local(p.latest_at)})"
        ]
    return notes


def _local(at: float) -> str:
    return datetime.fromtimestamp(at).strftime("%Y-%m-%d %H:%M")
