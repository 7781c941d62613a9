"""Configuration: the YAML format of DESIGN.md as frozen dataclasses.

A vllm-mlx ``--models-config`` file loads unchanged (sections ``manager`` and
``models``; ``path``/``source``/``model``; ``memory_budget_gb`` or
``memory_budget``; per-entry engine keys accepted and reported as ignored).
mlxd adds ``server``, ``journal``, ``pin``, per-model ``idle_unload_seconds``,
``restore_on_start``, ``engine: fake`` with ``fake:`` settings.

Entry points: :func:`load_config` (a YAML file), :func:`parse_config` (an
already-parsed object), :func:`builtin_demo_config` (the offline demo that
``mlxd serve`` runs without ``--config``). The readers and value grammars live
in :mod:`mlxd.config_validation`, the per-section rules in :mod:`mlxd.config_parse`.

Every error is a :class:`mlxd.errors.ConfigError` whose message starts with the
key path (``models[2].estimated_memory_gb: must be a positive number``).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import EllipsisType
from typing import Literal

from mlxd.config_validation import GIB, MIB, Source, parse_memory_size, read_yaml
from mlxd.errors import ConfigError

Strategy = Literal["fail", "wait", "preempt", "wait_then_fail", "wait_then_preempt"]
STRATEGIES: tuple[Strategy, ...] = (
    "fail",
    "wait",
    "preempt",
    "wait_then_fail",
    "wait_then_preempt",
)
DEMO_KINDS = ("tiny", "small", "vision")
#: ``wait_timeout_s`` of every strategy but ``wait`` when the config does not set it
DEFAULT_WAIT_TIMEOUT_S = 30.0

__all__ = [
    "DEFAULT_WAIT_TIMEOUT_S",
    "DEMO_KINDS",
    "GIB",
    "MIB",
    "STRATEGIES",
    "Config",
    "ContentionPolicy",
    "FakeSettings",
    "JournalConfig",
    "ManagerConfig",
    "Measured",
    "MemoryEstimate",
    "ModelConfig",
    "ServerConfig",
    "Strategy",
    "builtin_demo_config",
    "default_state_dir",
    "load_config",
    "parse_config",
    "parse_memory_size",
    "resolve_estimate",
    "weights_bytes",
]


def default_state_dir() -> Path:
    """Where mlxd keeps its journal and demo models by default."""
    if env := os.environ.get("MLXD_STATE_DIR"):
        return Path(env).expanduser()
    if sys.platform == "darwin":
        return Path("~/Library/Application Support/mlxd").expanduser()
    base = os.environ.get("XDG_STATE_HOME") or "~/.local/state"
    return Path(base).expanduser() / "mlxd"


@dataclass(frozen=True, slots=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    api_key_env: str = "MLXD_API_KEY"
    shutdown_grace_s: float = 10.0
    max_body_mb: float = 32.0


@dataclass(frozen=True, slots=True)
class JournalConfig:
    path: Path = field(default_factory=lambda: default_state_dir() / "journal.db")
    synchronous: Literal["full", "normal"] = "full"


@dataclass(frozen=True, slots=True)
class ContentionPolicy:
    """What an acquire does when its model does not fit after idle eviction.

    ``wait_timeout_s`` is the bound on waiting for room. It defaults to 30 s for
    every strategy except ``wait``, which waits without bound unless it is set
    (build policies with :meth:`of` to get that default). ``preempt_after_s``
    (``wait_then_preempt`` only) defaults to 0.
    """

    strategy: Strategy = "wait_then_fail"
    wait_timeout_s: float | None = DEFAULT_WAIT_TIMEOUT_S
    preempt_after_s: float | None = None

    @classmethod
    def of(
        cls,
        strategy: Strategy,
        *,
        wait_timeout_s: float | EllipsisType | None = ...,
        preempt_after_s: float | None = None,
    ) -> ContentionPolicy:
        """The policy for ``strategy``; ``wait_timeout_s`` omitted means the strategy's default."""
        if isinstance(wait_timeout_s, EllipsisType):
            wait_timeout_s = None if strategy == "wait" else DEFAULT_WAIT_TIMEOUT_S
        return cls(strategy, wait_timeout_s, preempt_after_s)

    @property
    def preempt_delay_s(self) -> float | None:
        """Seconds a waiter waits before preempting, or None if this policy never preempts."""
        if self.strategy == "preempt":
            return 0.0
        if self.strategy == "wait_then_preempt":
            return self.preempt_after_s if self.preempt_after_s is not None else 0.0
        return None

    @property
    def waits(self) -> bool:
        return self.strategy != "fail"


@dataclass(frozen=True, slots=True)
class ManagerConfig:
    memory_budget_bytes: int = 16 * GIB
    idle_unload_seconds: float = 0.0
    restore_on_start: bool = True
    contention_policy: ContentionPolicy = field(default_factory=ContentionPolicy)


@dataclass(frozen=True, slots=True)
class FakeSettings:
    """Settings of ``engine: fake`` models (testing and demos: no weights)."""

    load_seconds: float = 2.0
    unload_seconds: float = 0.0
    tokens_per_second: float = 50.0
    #: 1-based indices of loads / unloads of this model that fail
    fail_loads: tuple[int, ...] = ()
    fail_unloads: tuple[int, ...] = ()
    #: text the fake model "generates" (repeated as needed)
    reply: str = "This is mlxd's fake engine speaking. "
    #: the fake's memory footprint (``fake.memory_gb``); the estimate of last resort
    memory_bytes: int | None = None


@dataclass(frozen=True, slots=True)
class ModelConfig:
    name: str
    source: str
    preload: bool = False
    pin: bool = False
    estimated_memory_bytes: int | None = None
    idle_unload_seconds: float | None = None
    mllm: bool = False
    engine: Literal["mlx", "fake"] = "mlx"
    max_queue: int = 64
    max_batch_size: int = 8
    fake: FakeSettings | None = None
    #: directory from which ``file://`` image URLs may be read (None: no local files)
    image_dir: Path | None = None
    #: offline demo model: when set and ``source`` holds no model yet, the engine writes
    #: a random-weight demo model of this kind there on first load (``mlxd demo-model``)
    demo: Literal["tiny", "small", "vision"] | None = None
    #: seed keys kept for the budget report
    continuous_batching: bool | None = None
    gpu_memory_utilization: float | None = None
    #: vllm-mlx engine keys that were present and are ignored by mlxd
    ignored_keys: tuple[str, ...] = ()
    #: ``local`` (a path; ``source`` is absolute) or ``hub`` (a Hugging Face repo id),
    #: as the loader decided; None for configs built in code (decided by looking)
    source_kind: Literal["local", "hub"] | None = None

    @property
    def is_local(self) -> bool:
        if self.engine == "fake":
            return True
        if self.source_kind is not None:
            return self.source_kind == "local"
        return Path(self.source).expanduser().exists()


@dataclass(frozen=True, slots=True)
class MemoryEstimate:
    bytes: int
    #: ``config`` (estimated_memory_gb) | ``measured`` (after the last load, journaled)
    #: | ``weights`` (summed weight files) | ``fake`` (fake.memory_gb)
    source: str


@dataclass(frozen=True, slots=True)
class Config:
    server: ServerConfig = field(default_factory=ServerConfig)
    journal: JournalConfig = field(default_factory=JournalConfig)
    manager: ManagerConfig = field(default_factory=ManagerConfig)
    models: tuple[ModelConfig, ...] = ()
    #: the file this was read from (None for a config built in code)
    path: Path | None = None
    #: human-readable notes about accepted-but-ignored keys
    warnings: tuple[str, ...] = ()
    #: the measured sizes the config was checked with (model name -> bytes)
    measured: Mapping[str, int] = field(default_factory=dict, compare=False)

    def model(self, name: str) -> ModelConfig | None:
        for m in self.models:
            if m.name == name:
                return m
        return None

    def estimate(self, name: str, measured: Mapping[str, int] | None = None) -> MemoryEstimate:
        """The memory estimate of model ``name`` (DESIGN.md order).

        ``measured`` (model -> bytes, from the journal) replaces the sizes the
        config was loaded with. Raises ``KeyError`` for an unknown model and
        :class:`ConfigError` if no estimate applies (a config built in code).
        """
        model = self.model(name)
        if model is None:
            raise KeyError(name)
        est = resolve_estimate(model, self.measured if measured is None else measured)
        if est is None:
            raise ConfigError(f"{name}: no memory estimate; set estimated_memory_gb")
        return est

    def idle_unload_for(self, name: str) -> float:
        """Seconds without a lease after which ``name`` unloads (0: never)."""
        model = self.model(name)
        if model is None:
            raise KeyError(name)
        if model.pin:
            return 0.0
        if model.idle_unload_seconds is not None:
            return model.idle_unload_seconds
        return self.manager.idle_unload_seconds


def weights_bytes(source: str) -> int:
    """Summed size of ``*.safetensors``/``*.gguf`` files of a local source (0 if none)."""
    path = Path(source).expanduser()
    if not path.exists():
        return 0
    if path.is_file():
        return path.stat().st_size if path.suffix in {".safetensors", ".gguf"} else 0
    total = 0
    for pattern in ("*.safetensors", "*.gguf"):
        for fp in path.rglob(pattern):
            try:
                total += fp.stat().st_size
            except OSError:
                continue
    return total


def resolve_estimate(model: ModelConfig, measured: Mapping[str, int]) -> MemoryEstimate | None:
    """The memory estimate of DESIGN.md: explicit, measured, weight files, then the fake's size.

    Returns None when none applies (a non-local source with no estimate), which
    the config loader turns into an error.
    """
    if model.estimated_memory_bytes is not None:
        return MemoryEstimate(model.estimated_memory_bytes, "config")
    if (m := measured.get(model.name)) is not None and m > 0:
        return MemoryEstimate(int(m), "measured")
    if model.engine != "fake":
        w = weights_bytes(model.source)
        if w > 0:
            return MemoryEstimate(w, "weights")
    elif model.fake is not None and model.fake.memory_bytes is not None:
        return MemoryEstimate(model.fake.memory_bytes, "fake")
    return None


# ---- loading ----------------------------------------------------------------------------

#: model name -> measured bytes, or a function of the journal settings that reads them
Measured = Mapping[str, int] | Callable[[JournalConfig], Mapping[str, int]]


def load_config(path: str | os.PathLike[str], *, measured: Measured = {}) -> Config:  # noqa: B006
    """Read and validate a YAML config file (see DESIGN.md, "Config").

    ``measured`` maps model names to the sizes measured after their last load
    (the journal's ``measurements``), or is a function of the journal settings
    that reads them. Raises :class:`ConfigError` naming the file and the key path.
    """
    from mlxd.config_parse import Parser  # lazy: config_parse imports this module

    file = Path(path)
    data, lines = read_yaml(file, str(path))
    source = Source(str(path), lines, file.absolute().parent)
    return Parser(source, measured).config(data, file.absolute())


def parse_config(
    raw: object,
    *,
    path: Path | None = None,
    measured: Measured = {},  # noqa: B006
) -> Config:
    """Validate an already-parsed config object; relative paths resolve against ``path``'s folder."""
    from mlxd.config_parse import Parser  # lazy: config_parse imports this module

    base = path.absolute().parent if path is not None else Path.cwd()
    source = Source(str(path) if path is not None else None, {}, base)
    return Parser(source, measured).config(raw, path.absolute() if path is not None else None)


def builtin_demo_config(measured: Measured = {}) -> Config:  # noqa: B006
    """The built-in offline demo config that ``mlxd serve`` runs without ``--config``."""
    from mlxd.resources import demo_config_path

    return load_config(demo_config_path(), measured=measured)
