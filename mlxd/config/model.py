"""The configuration's meaning: frozen dataclasses for each section, and memory estimates.

:class:`Config` and its parts are what the rest of mlxd reads; they are built
by :mod:`mlxd.config.rules` from a YAML file read by :mod:`mlxd.config.readers`.
:func:`resolve_estimate` is the one rule for a model's memory estimate
(DESIGN.md's order: configured, measured, weight files, the fake's size).
A measured size belongs to the weights it was measured on, not to the model's
name: :func:`weights_fingerprint` names those weights, and a measurement applies
only while they are the same (see :func:`resolve_estimate`).
"""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

from mlxd.config.engine_kinds import ENGINE_KINDS, EngineKind, EngineName
from mlxd.config.kv import DiskTier, disk_tier, resolve_cache_sizes
from mlxd.config.readers import classify_source
from mlxd.errors import ConfigError
from mlxd.residency.policy import ContentionPolicy, ResidencyRules
from mlxd.units import GIB, MIB

DEMO_KINDS = ("tiny", "small", "vision", "embedding")
ISOLATIONS = ("thread", "process")
BACKENDS = ("ring", "jaccl", "mpi")
#: where an ``engine: mlx`` model runs when its config does not say (``engine: fake``
#: models run in the daemon unless they say ``isolation: process``); chosen by
#: measurement (bench/isolation.py), see README "Engine processes"
DEFAULT_ISOLATION: Literal["thread", "process"] = "thread"

def default_state_dir() -> Path:
    """Where mlxd keeps its journal and demo models by default."""
    if env := os.environ.get("MLXD_STATE_DIR"):
        return Path(env).expanduser()
    if sys.platform == "darwin":
        return Path("~/Library/Application Support/mlxd").expanduser()
    base = os.environ.get("XDG_STATE_HOME") or "~/.local/state"
    return Path(base).expanduser() / "mlxd"


#: what an API key may do: ``inference`` (/v1), ``read`` (status, history, events, plan,
#: metrics), ``admin`` (load, unload, reload)
SCOPES: tuple[str, ...] = ("inference", "read", "admin")


@dataclass(frozen=True, slots=True)
class KeyConfig:
    """One entry of ``server.keys``: a named key, read from ``env`` or ``file``, and its scopes."""

    name: str
    scopes: frozenset[str]
    env: str | None = None
    file: Path | None = None


@dataclass(frozen=True, slots=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    api_key_env: str = "MLXD_API_KEY"
    shutdown_grace_s: float = 10.0
    max_body_mb: float = 32.0
    #: scoped keys (``api_key_env`` stays one more key, named ``default``, with every scope)
    keys: tuple[KeyConfig, ...] = ()
    #: a second port on ``host`` serving the same app, for clients that hard-code Ollama's
    #: 11434 (None: off; 0: any free port)
    ollama_port: int | None = None
    #: Host names and addresses accepted besides loopback (normalized; mlxd.config.origins)
    allowed_hosts: tuple[str, ...] = ()
    #: origins allowed on state-changing requests besides the request's own (normalized)
    allowed_origins: tuple[str, ...] = ()

    @property
    def max_body_bytes(self) -> int:
        """The request body limit in bytes (``max_body_mb`` MiB), for Quart and for 100-continue."""
        return int(self.max_body_mb * MIB)


@dataclass(frozen=True, slots=True)
class JournalConfig:
    path: Path = field(default_factory=lambda: default_state_dir() / "journal.db")
    synchronous: Literal["full", "normal"] = "full"
    #: rows older than this many days are pruned (0: keep every age)
    retain_days: float = 30.0
    #: the journal file is kept under this many MiB (0: no size limit)
    max_mb: float = 1024.0


@dataclass(frozen=True, slots=True)
class ManagerConfig:
    memory_budget_bytes: int = 16 * GIB
    idle_unload_seconds: float = 0.0
    restore_on_start: bool = True
    contention_policy: ContentionPolicy = field(default_factory=ContentionPolicy)
    #: an engine stop that takes longer counts as failed (and is retried later)
    stop_timeout_s: float = 60.0
    #: eviction, min_resident_s, max_swap_delay_s, max_keep_alive_s
    rules: ResidencyRules = field(default_factory=ResidencyRules)
    #: the disk tier of prompt caches (``prompt_cache_disk_gb``; see mlxd.config.kv): its
    #: bound in bytes (0: off, what a config built in code gets) and its directory
    prompt_cache_disk_bytes: int = 0
    prompt_cache_dir: Path = field(default_factory=lambda: default_state_dir() / "prompt-cache")


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
class DistributedHost:
    """One machine of a distributed model, as in ``mlx.launch``'s hostfile."""

    #: how to reach it with ssh (for the first host, rank 0: this machine, never ssh'd to)
    ssh: str
    #: addresses the ranks connect to it over (ring; jaccl's coordinator is the first
    #: host's); empty: the ssh name, resolved when the model loads
    ips: tuple[str, ...] = ()
    #: jaccl: the RDMA device towards each rank (None towards itself)
    rdma: tuple[str | None, ...] = ()


@dataclass(frozen=True, slots=True)
class DistributedSettings:
    """``distributed:``: one model tensor-sharded over ranks with ``mlx.distributed``."""

    backend: Literal["ring", "jaccl", "mpi"]
    hosts: tuple[DistributedHost, ...]
    #: the hostfile the hosts came from (None: ``hosts:`` in the config)
    hostfile: Path | None = None
    #: the first port of the ring (one per rank) or jaccl's coordinator port; None:
    #: free ports when every host is this machine, else 32323 (mlx.launch's default)
    port: int | None = None
    #: the Python interpreter on the other hosts (None: this one's path)
    python: str | None = None
    #: ``NAME=value`` environment for every rank (a hostfile's ``envs``)
    envs: tuple[str, ...] = ()

    @property
    def size(self) -> int:
        return len(self.hosts)


@dataclass(frozen=True, slots=True)
class FaultSettings:
    """``faults:``: make a model's engine misbehave on purpose (the fault-injection tests).

    Any engine (fake or MLX) injects them at its real points; see
    :mod:`mlxd.engines.injected_faults`. None of them is ever set in a production config.
    """

    #: ``raise`` (every load), ``raise_once`` (the first), ``hang`` (never ends,
    #: cancellable), ``ignore_cancel`` (keeps going ``delay_s`` after being cancelled)
    load: Literal["raise", "raise_once", "hang", "ignore_cancel"] | None = None
    #: ``raise`` (every stop), ``raise_once`` (the first), ``hang`` (never returns)
    stop: Literal["raise", "raise_once", "hang"] | None = None
    #: ``raise`` (mid-stream) or ``hang`` (between two tokens), after ``after_tokens`` tokens
    generate: Literal["raise", "hang"] | None = None
    after_tokens: int = 1
    delay_s: float = 2.0


@dataclass(frozen=True, slots=True)
class ModelConfig:
    name: str
    source: str
    preload: bool = False
    pin: bool = False
    estimated_memory_bytes: int | None = None
    idle_unload_seconds: float | None = None
    mllm: bool = False
    #: the kind of engine (its capabilities: :attr:`engine_kind`)
    engine: EngineName = "mlx"
    max_queue: int = 64
    #: generations that share each decode step (continuous batching); 1 = one at a time
    max_batch_size: int = 8
    #: prompts longer than this many tokens are a 400 (None: the model's context)
    max_prompt_tokens: int | None = None
    #: ``kv_cache_gb`` / ``prompt_cache_gb`` as configured (None: derived, see mlxd.config.kv)
    kv_cache_bytes: int | None = None
    prompt_cache_bytes: int | None = None
    #: higher is served first and may preempt lower (never the reverse)
    priority: int = 0
    fake: FakeSettings | None = None
    #: faults to inject (testing only; None: none)
    faults: FaultSettings | None = None
    #: directory from which ``file://`` image URLs may be read (None: no local files)
    image_dir: Path | None = None
    #: offline demo model: when set and ``source`` holds no model yet, the engine writes
    #: a random-weight demo model of this kind there on first load (``mlxd demo-model``)
    demo: Literal["tiny", "small", "vision", "embedding"] | None = None
    #: an encoder served by POST /v1/embeddings (mlx-embeddings), not a generator
    embedding: bool = False
    #: ``thread``: the engine runs in the daemon; ``process``: in a worker process
    isolation: Literal["thread", "process"] = "thread"
    distributed: DistributedSettings | None = None
    #: seed keys kept for the budget report
    continuous_batching: bool | None = None
    gpu_memory_utilization: float | None = None
    #: vllm-mlx engine keys that were present and are ignored by mlxd
    ignored_keys: tuple[str, ...] = ()
    #: ``local`` (a path; ``source`` is absolute) or ``hub`` (a Hugging Face repo id),
    #: as the loader decided; None for configs built in code (decided by looking)
    source_kind: Literal["local", "hub"] | None = None
    #: set when the config was read leniently (``mlxd serve``) and the local source was
    #: missing: why the model cannot load now (it starts ``failed`` with this error)
    missing: str | None = None
    #: where this model's prompt caches outlive its residency (None: nowhere); set by the
    #: config reader from ``manager.prompt_cache_disk_gb`` (:func:`mlxd.config.kv.disk_tier`).
    #: Not compared: a reload that changes only it does not replace a loaded model
    prompt_cache_disk: DiskTier | None = field(default=None, compare=False)

    @property
    def engine_kind(self) -> EngineKind:
        """What this model's kind of engine can do (:mod:`mlxd.config.engine_kinds`)."""
        return ENGINE_KINDS[self.engine]

    @property
    def is_local(self) -> bool:
        if not self.engine_kind.weights:
            return True  # nothing to download
        if self.source_kind is not None:
            return self.source_kind == "local"
        try:
            return classify_source(self.source, Path.cwd()) == "local"
        except ValueError:
            return False


@dataclass(frozen=True, slots=True)
class Measurement:
    """A model's footprint measured after a load, and the weights it was measured on."""

    bytes: int
    #: :func:`weights_fingerprint` of the model when it was measured; None: not known
    #: (journaled before schema v3, or a config built in code)
    weights: str | None = None


@dataclass(frozen=True, slots=True)
class MemoryEstimate:
    """What a loaded model commits: ``bytes = weights + kv_cache + prompt_cache``."""

    bytes: int
    #: where the weights figure comes from: ``config`` (estimated_memory_gb) | ``measured``
    #: (after the last load, journaled) | ``weights`` (summed weight files) | ``fake`` (fake.memory_gb)
    #: | ``unknown`` (a missing local source, read leniently: 0 bytes, never loaded)
    source: str
    weights: int = 0
    kv_cache: int = 0
    prompt_cache: int = 0

    def parts(self) -> dict[str, int]:
        """``{weights, kv_cache, prompt_cache}`` as shown by /v1/models and /admin/status."""
        return {"weights": self.weights, "kv_cache": self.kv_cache, "prompt_cache": self.prompt_cache}


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
    #: the measured sizes the config was checked with (model name -> measurement)
    measured: Mapping[str, Measurement] = field(default_factory=dict, compare=False)

    #: the models by name (built once: a lookup per request must not scan 10,000 models)
    _by_name: dict[str, ModelConfig] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_name", {m.name: m for m in self.models})

    def model(self, name: str) -> ModelConfig | None:
        return self._by_name.get(name)

    def with_prompt_cache_disk(self, path: Path | None = None, max_bytes: int | None = None) -> Config:
        """This config with the prompt cache's disk tier at ``path`` bounded by ``max_bytes``
        (default: the manager's), handed to each model that keeps a prompt cache
        (:func:`mlxd.config.kv.disk_tier`)."""
        m = self.manager
        m = replace(m, prompt_cache_dir=path or m.prompt_cache_dir,
                    prompt_cache_disk_bytes=m.prompt_cache_disk_bytes if max_bytes is None else max_bytes)
        tiers = (disk_tier(x, m.prompt_cache_dir, m.prompt_cache_disk_bytes) for x in self.models)
        return replace(self, manager=m, models=tuple(
            replace(x, prompt_cache_disk=t) for x, t in zip(self.models, tiers, strict=True)))

    def estimate(
        self, name: str, measured: Mapping[str, Measurement] | None = None
    ) -> MemoryEstimate:
        """The memory estimate of model ``name``: what the manager budgets and check-config prints.

        :func:`resolve_estimate` gives DESIGN.md's order. ``measured`` (model ->
        measurement, from the journal) replaces the ones the config was loaded with.
        Raises ``KeyError`` for an unknown model and :class:`ConfigError` if no
        estimate applies (possible only for a config built in code).
        """
        model = self.model(name)
        if model is None:
            raise KeyError(name)
        est = resolve_estimate(model, self.measured if measured is None else measured)
        if est is None:
            raise ConfigError(f"{name}: no memory estimate; set estimated_memory_gb")
        return est

    def idle_unload_for(self, name: str) -> float:
        """Seconds without a lease after which ``name`` unloads (0: never; pinned models never do).

        The model's ``idle_unload_seconds`` if set, else ``manager.idle_unload_seconds``;
        the manager schedules idle unloads with exactly this figure.
        """
        model = self.model(name)
        if model is None:
            raise KeyError(name)
        if model.pin:
            return 0.0
        if model.idle_unload_seconds is not None:
            return model.idle_unload_seconds
        return self.manager.idle_unload_seconds


#: the files whose sizes make a local model's ``weights`` estimate
WEIGHT_PATTERNS = ("*.safetensors", "*.gguf")


def _weight_files(source: str) -> tuple[Path, list[tuple[str, int, int]]]:
    """The resolved path of a local source and ``(relative path, size, mtime_ns)`` of each
    of its weight files, sorted; stat only, the weights are never read."""
    path = Path(source).expanduser()
    try:
        root = path.resolve()
    except (OSError, RuntimeError):  # a symlink loop: no weights to be found there
        return path, []
    try:
        if root.is_file():
            found = [root] if any(root.match(p) for p in WEIGHT_PATTERNS) else []
        elif root.is_dir():
            found = [fp for pattern in WEIGHT_PATTERNS for fp in root.rglob(pattern)]
        else:
            return root, []
    except OSError:  # unreadable: no weights to be found there
        return root, []
    files = []
    for fp in found:
        try:
            st = fp.stat()  # through symlinks (a Hugging Face snapshot links to its blobs)
        except OSError:
            continue
        rel = fp.name if fp == root else fp.relative_to(root).as_posix()
        files.append((rel, st.st_size, st.st_mtime_ns))
    return root, sorted(files)


def weights_bytes(source: str) -> int:
    """Summed size of ``*.safetensors``/``*.gguf`` files of a local source (0 if none)."""
    return sum(size for _, size, _ in _weight_files(source)[1])


def weights_fingerprint(model: ModelConfig) -> str:
    """What a measurement of ``model`` was taken on; a measurement applies while this is unchanged.

    A local source: its resolved path and each weight file's relative path, size
    and mtime (stat only). A Hub source: its repo id (the weights mlxd loads for
    it; a new revision is measured again when it loads). A fake: its
    ``fake.memory_gb`` (what its engine reports). A distributed model also
    names its number of ranks (this host measures its share).
    """
    h = hashlib.sha256()
    if not model.engine_kind.weights:
        memory = model.fake.memory_bytes if model.fake is not None else None
        h.update(f"{model.engine}\0{memory}".encode())
    elif model.is_local:
        root, files = _weight_files(model.source)
        h.update(f"local\0{root}".encode(errors="surrogateescape"))
        for rel, size, mtime_ns in files:
            h.update(f"\0{rel}\0{size}\0{mtime_ns}".encode(errors="surrogateescape"))
    else:
        h.update(f"hub\0{model.source}".encode(errors="surrogateescape"))
    if model.distributed is not None:
        h.update(f"\0ranks\0{model.distributed.size}".encode())
    return h.hexdigest()[:32]


def resolve_estimate(
    model: ModelConfig, measured: Mapping[str, Measurement]
) -> MemoryEstimate | None:
    """The memory estimate of DESIGN.md: weights (explicit, measured, weight files, then the
    fake's size) plus the KV cache and the prompt cache (:func:`mlxd.config.kv.resolve_cache_sizes`).

    Returns None when no weights figure applies (a non-local source with no
    estimate), which the config loader turns into an error.
    """
    weights = resolve_weights(model, measured)
    if weights is None:
        return None
    if weights[1] == "unknown":
        return MemoryEstimate(0, "unknown")  # never loaded: no caches either
    caches = resolve_cache_sizes(model)
    total = weights[0] + caches.kv_cache + caches.prompt_cache
    return MemoryEstimate(total, weights[1], weights[0], caches.kv_cache, caches.prompt_cache)


def resolve_weights(
    model: ModelConfig, measured: Mapping[str, Measurement]
) -> tuple[int, str] | None:
    """The weights part of the estimate and its source (first that applies).

    A measurement applies only when its weights are the model's current ones
    (:func:`weights_fingerprint`): after two models swap paths, or a weight file
    changes, the old size is ignored until the next load measures again. A
    measurement from before fingerprints (``weights`` None) is the last resort,
    for a model that would otherwise have no estimate (a Hub model whose
    ``estimated_memory_gb`` was removed once it had been measured).
    """
    if model.estimated_memory_bytes is not None:
        return model.estimated_memory_bytes, "config"
    m = measured.get(model.name)
    if m is not None and m.bytes <= 0:
        m = None
    if m is not None and m.weights is not None and m.weights == weights_fingerprint(model):
        return m.bytes, "measured"
    if model.engine_kind.weights:
        w = weights_bytes(model.source)
        if w > 0 and model.distributed is not None:
            # this host holds one shard: the weights split evenly (the replicated
            # embeddings make the real share a little larger; the first load measures it)
            return -(-w // model.distributed.size), "weights"
        if w > 0:
            return w, "weights"
    elif model.fake is not None and model.fake.memory_bytes is not None:
        return model.fake.memory_bytes, "fake"
    if m is not None and m.weights is None:
        return m.bytes, "measured"
    if model.missing is not None:
        return 0, "unknown"  # the engine refuses to load it (see ModelConfig.missing)
    return None


#: model name -> its latest measurement, or a function of the journal settings that reads them
Measured = Mapping[str, Measurement] | Callable[[JournalConfig], Mapping[str, Measurement]]


@dataclass(frozen=True, slots=True)
class Overrides:
    """What ``mlxd serve``'s command line sets over the file (``--host``, ``--port``,
    ``--journal``, ``--ollama-port``).

    Applied at start and again to each reloaded file, so that a reload compares
    the running settings with what the same command line would start with now.
    """

    host: str | None = None
    port: int | None = None
    journal_path: Path | None = None
    ollama_port: int | None = None

    def apply(self, config: Config) -> Config:
        server, journal = config.server, config.journal
        if self.host is not None:
            server = replace(server, host=self.host)
        if self.port is not None:
            server = replace(server, port=self.port)
        if self.ollama_port is not None:
            server = replace(server, ollama_port=self.ollama_port)
        if self.journal_path is not None:
            journal = replace(journal, path=self.journal_path)
        return replace(config, server=server, journal=journal)
