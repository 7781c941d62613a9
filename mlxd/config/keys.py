"""API keys: reading ``server.keys`` from the config, and the key values at start.

``server.keys`` is a list of ``{name, env | file, scopes}``. The config file
names where each key is, never the key: ``env`` an environment variable,
``file`` a file holding the key (one line). :func:`parse_keys` checks the
entries when the config is read (names unique, one source each, known
scopes); :func:`resolve_keys` reads the values when ``mlxd serve`` starts and
refuses to start (a :class:`~mlxd.errors.ConfigError`: one line, exit 2) on a
variable that is unset or empty, a file that is missing or empty, a file that
its group or others may read or write (like ``ssh``, since anyone who reads it
is that client), or two entries with the same key. ``server.api_key_env``,
when that variable is set, is one more key named ``default`` with every scope.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from mlxd.config.model import SCOPES, KeyConfig, ServerConfig
from mlxd.config.readers import Table, is_env_name, join, show
from mlxd.errors import ConfigError

KEY_FIELDS = ("name", "env", "file", "scopes")

#: the name journaled for the key of ``server.api_key_env``
DEFAULT_KEY_NAME = "default"


@dataclass(frozen=True, slots=True)
class ResolvedKey:
    """A key's name, its value and its scopes, as the HTTP layer checks them."""

    name: str
    secret: str
    scopes: frozenset[str]

    def __repr__(self) -> str:  # never print the key
        return f"ResolvedKey({self.name!r}, scopes={sorted(self.scopes)})"


def parse_keys(t: Table, local_path: Callable[[Table, str, str], Path]) -> tuple[KeyConfig, ...]:
    """The entries of ``server.keys`` (``local_path`` expands a file path like other paths)."""
    raw = t.raw.get("keys")
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise t.error("keys", f"must be a list of {{name, env or file, scopes}} (got {show(raw)})")
    keys: list[KeyConfig] = []
    names: set[str] = set()
    for i, item in enumerate(raw):
        k = Table(t.source, join(t.path("keys"), i), item, KEY_FIELDS)
        name = k.string("name", "") if k.has("name") else ""
        if not name:
            raise k.error("name", "required: the name journaled for this key's requests")
        if name in names or name == DEFAULT_KEY_NAME:
            why = "is taken by server.api_key_env" if name == DEFAULT_KEY_NAME else "is used twice"
            raise k.error("name", f"{show(name)} {why}; each key needs its own name")
        names.add(name)
        if k.has("env") == k.has("file"):
            raise k.error("env", "give exactly one of env (a variable name) or file (a path)")
        env = k.string("env", "") if k.has("env") else None
        if env is not None and not is_env_name(env):
            raise k.error("env", f"must be an environment variable name (got {show(env)})")
        file = local_path(k, "file", k.string("file", "")) if k.has("file") else None
        keys.append(KeyConfig(name=name, scopes=_scopes(k), env=env, file=file))
    return tuple(keys)


def _scopes(k: Table) -> frozenset[str]:
    raw = k.raw.get("scopes")
    if not isinstance(raw, list) or not raw:
        raise k.error("scopes", f"must be a non-empty list of {', '.join(SCOPES)} (got {show(raw)})")
    for i, scope in enumerate(raw):
        if scope not in SCOPES:
            raise k.error(
                join("scopes", i), f"must be one of {', '.join(SCOPES)} (got {show(scope)})"
            )
    return frozenset(raw)


def resolve_keys(server: ServerConfig, environ: Mapping[str, str] | None = None) -> tuple[ResolvedKey, ...]:
    """Every key's value, read now; ``()`` means no auth. Raises ConfigError (one line)."""
    env = os.environ if environ is None else environ
    out: list[ResolvedKey] = []
    default = env.get(server.api_key_env) or None
    if default is not None:
        out.append(ResolvedKey(DEFAULT_KEY_NAME, default, frozenset(SCOPES)))
    for i, key in enumerate(server.keys):
        where = f"server.keys[{i}]"
        if key.env is not None:
            value = env.get(key.env, "").strip()
            if not value:
                raise ConfigError(f"{where}.env: ${key.env} (key '{key.name}') is not set or empty")
        else:
            assert key.file is not None
            value = _read_key_file(f"{where}.file", key.file)
        out.append(ResolvedKey(key.name, value, key.scopes))
    seen: dict[str, str] = {}
    for resolved in out:
        if resolved.secret in seen:
            raise ConfigError(
                f"server.keys: keys '{seen[resolved.secret]}' and '{resolved.name}' have the "
                "same value; each client needs its own key"
            )
        seen[resolved.secret] = resolved.name
    return tuple(out)


def _read_key_file(where: str, path: Path) -> str:
    try:
        mode = path.stat().st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ConfigError(
                f"{where}: {path} is open to its group or others (mode {stat.filemode(mode)}); "
                f"run 'chmod 600 {path}'"
            )
        value = path.read_text(encoding="utf-8").strip()
    except OSError as e:
        raise ConfigError(f"{where}: cannot read {path}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{where}: {path} is not a text file") from None
    if not value or "\n" in value:
        raise ConfigError(f"{where}: {path} must hold the key on one line")
    return value
