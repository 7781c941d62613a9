"""Files shipped with mlxd: the journal migrations and the built-in demo config.

In a wheel they live inside the package (``mlxd/migrations``,
``mlxd/data/models.demo.yaml``, put there by hatch's force-include); in a
source checkout (editable install) they are at the repository's top level.
"""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

_REPO_ROOT = Path(__file__).resolve().parent.parent


def _find(packaged: str, in_repo: Path) -> Path:
    candidate = Path(str(resources.files("mlxd").joinpath(packaged)))
    if candidate.exists():
        return candidate
    return in_repo


def migrations_dir() -> Path:
    """The folder of numbered ``NNNN_name.sql`` journal migrations.

    ``MLXD_MIGRATIONS_DIR`` replaces it (the crash tests use a longer test migration).
    """
    override = os.environ.get("MLXD_MIGRATIONS_DIR")
    if override:
        return Path(override)
    return _find("migrations", _REPO_ROOT / "migrations")


def demo_config_path() -> Path:
    """The built-in offline demo config that ``mlxd serve`` runs without ``--config``."""
    return _find("data/models.demo.yaml", _REPO_ROOT / "etc" / "models.demo.yaml")
