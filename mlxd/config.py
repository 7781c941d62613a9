"""Configuration: the YAML format of DESIGN.md as frozen dataclasses.

A vllm-mlx ``--models-config`` file loads unchanged (sections ``manager`` and
``models``; ``path``/``source``/``model``; ``memory_budget_gb`` or
``memory_budget``; per-entry engine keys accepted and reported as ignored).
mlxd adds ``server``, ``journal``, ``pin``, per-model ``idle_unload_seconds``,
``restore_on_start``, ``engine: fake`` with ``fake:`` settings.

Every error is a :class:`mlxd.errors.ConfigError` whose message starts with the
key path (``models[2].estimated_memory_gb: must be a positive number``).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

Strategy = Literal["fail", "wait", "preempt", "wait_then_fail", "wait_then_preempt"]
STRATEGIES: tuple[Strategy, ...] = ("fail", "wait", "preempt", "wait_then_fail", "wait_then_preempt")

GIB = 1024**3
MIB = 1024**2


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
    every strategy except ``wait``, which waits without bound unless it is set.
    ``preempt_after_s`` (``wait_then_preempt`` only) defaults to 0.
    """

    strategy: Strategy = "wait_then_fail"
    wait_timeout_s: float | None = 30.0
    preempt_after_s: float | None = None

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

    @property
    def is_local(self) -> bool:
        return self.engine == "fake" or Path(self.source).expanduser().exists()


@dataclass(frozen=True, slots=True)
class MemoryEstimate:
    bytes: int
    #: ``config`` | ``measured`` | ``weights``
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

    def model(self, name: str) -> ModelConfig | None:
        for m in self.models:
            if m.name == name:
                return m
        return None


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
    """The memory estimate of DESIGN.md: explicit, then measured, then weight files.

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
    return None
