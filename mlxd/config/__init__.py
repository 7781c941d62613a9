"""Configuration: the YAML format of DESIGN.md.

A vllm-mlx ``--models-config`` file loads unchanged (sections ``manager`` and
``models``; ``path``/``source``/``model``; ``memory_budget_gb`` or
``memory_budget``; per-entry engine keys accepted and reported as ignored).
mlxd adds ``server``, ``journal``, ``pin``, per-model ``idle_unload_seconds``,
``restore_on_start``, ``engine: fake`` with ``fake:`` settings.

Owns: :mod:`.model` (the dataclasses and the memory-estimate rule),
:mod:`.readers` (strict YAML readers and value grammars), :mod:`.rules` (what
each section may hold), :mod:`.budget` (the memory budget report's figures).
May import: :mod:`mlxd.errors`, :mod:`mlxd.units`, :mod:`mlxd.residency.policy`;
nothing of the residency core, the journal, engines or HTTP.

Entry points: :func:`load_config` (a YAML file), :func:`parse_config` (an
already-parsed object), :func:`builtin_demo_config` (the offline demo that
``mlxd serve`` runs without ``--config``). Every error is a
:class:`mlxd.errors.ConfigError` whose message starts with the key path
(``models[2].estimated_memory_gb: must be a positive number``).
"""

from __future__ import annotations

import os
from pathlib import Path

from mlxd.config.kv import DiskTier
from mlxd.config.model import (
    DEMO_KINDS,
    Config,
    FakeSettings,
    FaultSettings,
    JournalConfig,
    ManagerConfig,
    Measured,
    Measurement,
    MemoryEstimate,
    ModelConfig,
    Overrides,
    ServerConfig,
    default_state_dir,
    resolve_estimate,
    weights_bytes,
    weights_fingerprint,
)
from mlxd.config.readers import Source, SourceKind, classify_source, parse_memory_size, read_yaml
from mlxd.config.rules import Parser
from mlxd.residency.policy import DEFAULT_WAIT_TIMEOUT_S, STRATEGIES, ContentionPolicy, Strategy

__all__ = [
    "DEFAULT_WAIT_TIMEOUT_S",
    "DEMO_KINDS",
    "STRATEGIES",
    "Config",
    "ContentionPolicy",
    "DiskTier",
    "FakeSettings",
    "FaultSettings",
    "JournalConfig",
    "ManagerConfig",
    "Measured",
    "Measurement",
    "MemoryEstimate",
    "ModelConfig",
    "Overrides",
    "ServerConfig",
    "SourceKind",
    "Strategy",
    "builtin_demo_config",
    "classify_source",
    "default_state_dir",
    "load_config",
    "parse_config",
    "parse_memory_size",
    "resolve_estimate",
    "weights_bytes",
    "weights_fingerprint",
]


def load_config(
    path: str | os.PathLike[str],
    *,
    measured: Measured = {},  # noqa: B006
    missing_ok: bool = False,
) -> Config:
    """Read and validate a YAML config file (see DESIGN.md, "Config").

    ``measured`` maps model names to their last :class:`Measurement` (the
    journal's ``measurements``, with the weights each was taken on), or is a
    function of the journal settings that reads them. Raises :class:`ConfigError` naming the file and the key path.
    With ``missing_ok`` (the daemon), a local model directory that does not
    exist is not an error: the model gets ``missing`` (and a warning) instead.
    """
    file = Path(path)
    data, lines = read_yaml(file, str(path))
    source = Source(str(path), lines, file.absolute().parent, problems=[])
    return Parser(source, measured, missing_ok=missing_ok).config(data, file.absolute())


def parse_config(
    raw: object,
    *,
    path: Path | None = None,
    measured: Measured = {},  # noqa: B006
) -> Config:
    """Validate an already-parsed config object; relative paths resolve against ``path``'s folder."""
    base = path.absolute().parent if path is not None else Path.cwd()
    source = Source(str(path) if path is not None else None, {}, base, problems=[])
    return Parser(source, measured).config(raw, path.absolute() if path is not None else None)


def builtin_demo_config(measured: Measured = {}) -> Config:  # noqa: B006
    """The built-in offline demo config that ``mlxd serve`` runs without ``--config``."""
    from mlxd.resources import demo_config_path

    return load_config(demo_config_path(), measured=measured)
