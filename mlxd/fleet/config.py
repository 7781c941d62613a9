"""The fleet file of ``mlxd route`` and ``mlxd status --fleet``: the daemons and what they serve.

.. code-block:: yaml

    proxy:                     # the LiteLLM proxy `mlxd route` starts
      host: 127.0.0.1          # loopback by default
      port: 4000
      master_key_env: LITELLM_MASTER_KEY   # if set, clients need "Authorization: Bearer <key>"
      num_retries: 3           # other daemons tried after a refusal or a lost daemon
      timeout_s: 600
    daemons:
      - name: mac-a            # shown in `route --check` and `status --fleet`
        url: http://mac-a.local:8080
        api_key_env: MLXD_KEY_MAC_A    # a key with the inference and read scopes
        models: [qwen, llama]  # the models this daemon may serve (names in its config)

Every error names its key path (``daemons[1].url: ...``) and is a
:class:`~mlxd.errors.ConfigError` (the CLI exits 2).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from mlxd.errors import ConfigError

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_TOP_KEYS = {"proxy", "daemons"}
_PROXY_KEYS = {"host", "port", "master_key_env", "num_retries", "timeout_s"}
_DAEMON_KEYS = {"name", "url", "api_key_env", "models"}


@dataclass(frozen=True, slots=True)
class Daemon:
    """One mlxd daemon of the fleet."""

    name: str
    url: str  # base URL without a trailing slash (http://host:port)
    api_key_env: str | None
    models: tuple[str, ...]

    def api_key(self) -> str | None:
        """The key from its variable (None: no variable named, or it is unset)."""
        return os.environ.get(self.api_key_env) if self.api_key_env else None

    def headers(self) -> dict[str, str]:
        key = self.api_key()
        return {"Authorization": f"Bearer {key}"} if key else {}


@dataclass(frozen=True, slots=True)
class Proxy:
    host: str = "127.0.0.1"
    port: int = 4000
    master_key_env: str | None = None
    num_retries: int = 3
    timeout_s: float = 600.0


@dataclass(frozen=True, slots=True)
class Fleet:
    daemons: tuple[Daemon, ...]
    proxy: Proxy = field(default_factory=Proxy)

    def models(self) -> list[str]:
        """Every model some daemon may serve, in first-listed order."""
        return list(dict.fromkeys(m for d in self.daemons for m in d.models))


def _unknown(path: str, raw: Mapping[str, Any], known: set[str]) -> None:
    for key in raw:
        if key not in known:
            raise ConfigError(f"{path}{key}: unknown key (known: {', '.join(sorted(known))})")


def _mapping(path: str, value: object) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{path}: must be a mapping")
    return value


def _env_name(path: str, value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", value):
        raise ConfigError(f"{path}: must be an environment variable name (got {value!r})")
    return value


def _proxy(raw: object) -> Proxy:
    if raw is None:
        return Proxy()
    p = _mapping("proxy", raw)
    _unknown("proxy.", p, _PROXY_KEYS)
    host = p.get("host", "127.0.0.1")
    if not isinstance(host, str) or not host:
        raise ConfigError("proxy.host: must be a host name or address")
    port = p.get("port", 4000)
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ConfigError(f"proxy.port: must be a port number 0-65535 (got {port!r})")
    retries = p.get("num_retries", 3)
    if isinstance(retries, bool) or not isinstance(retries, int) or not 0 <= retries <= 20:
        raise ConfigError(f"proxy.num_retries: must be an integer 0-20 (got {retries!r})")
    timeout = p.get("timeout_s", 600.0)
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0:
        raise ConfigError(f"proxy.timeout_s: must be a positive number of seconds (got {timeout!r})")
    return Proxy(host, port, _env_name("proxy.master_key_env", p.get("master_key_env")),
                 retries, float(timeout))


def _daemon(i: int, raw: object) -> Daemon:
    path = f"daemons[{i}]"
    d = _mapping(path, raw)
    _unknown(f"{path}.", d, _DAEMON_KEYS)
    url = d.get("url")
    if not isinstance(url, str) or not re.fullmatch(r"https?://[^/\s]+/?", url):
        raise ConfigError(f"{path}.url: must be a daemon base URL such as http://mac-a.local:8080 "
                          f"(got {url!r})")
    name = d.get("name", url.split("//", 1)[1].rstrip("/"))
    if not isinstance(name, str) or not _NAME.fullmatch(name.replace(":", "-")):
        raise ConfigError(f"{path}.name: must be a short name of letters, digits, '.', '-' or '_'")
    models = d.get("models")
    if (not isinstance(models, list) or not models
            or not all(isinstance(m, str) and m for m in models)):
        raise ConfigError(f"{path}.models: must be a non-empty list of model names")
    return Daemon(name, url.rstrip("/"), _env_name(f"{path}.api_key_env", d.get("api_key_env")),
                  tuple(dict.fromkeys(models)))


def parse_fleet(raw: object) -> Fleet:
    top = _mapping("fleet file", raw)
    _unknown("", top, _TOP_KEYS)
    daemons = top.get("daemons")
    if not isinstance(daemons, list) or not daemons:
        raise ConfigError("daemons: must be a non-empty list of daemons (url, api_key_env, models)")
    parsed = tuple(_daemon(i, d) for i, d in enumerate(daemons))
    seen: dict[str, int] = {}
    for i, d in enumerate(parsed):
        if d.name in seen:
            raise ConfigError(f"daemons[{i}].name: '{d.name}' is also daemons[{seen[d.name]}]")
        seen[d.name] = i
    return Fleet(parsed, _proxy(top.get("proxy")))


def load_fleet(path: Path) -> Fleet:
    try:
        raw = yaml.safe_load(path.read_text())
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the fleet file ({e.strerror or e})") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
    return parse_fleet(raw)
