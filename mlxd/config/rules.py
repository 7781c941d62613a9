"""The rules of each config section: what :func:`mlxd.config.load_config` checks.

One :class:`Parser` reads one config top-down (server, journal, manager, then
each model) and reports every error it finds in one :class:`mlxd.errors.ConfigError`
(one line per error, each naming its key path and line): a bad value is recorded
and its key's default read on, and a section or model entry that cannot be read
further is recorded and left out, so a user fixes all of them after one run. Along the way it collects warnings (one line each) for
keys that are accepted but have no effect: the vllm-mlx engine keys, a
``preempt_after_s`` that the strategy never uses, an ``image_dir`` on a text
model. The typed readers it uses are in :mod:`mlxd.config.readers`.
"""

from __future__ import annotations

import functools
import os
import unicodedata
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar, cast

from mlxd.config import distributed as distributed_rules
from mlxd.config.engine_kinds import ENGINE_KINDS, ENGINES, EngineName
from mlxd.config.keys import parse_keys
from mlxd.config.known_keys import (
    ENGINE_KEY_NOTES,
    ENGINE_KEYS,
    FAKE_KEYS,
    FAULT_KEYS,
    JOURNAL_KEYS,
    MANAGER_KEYS,
    MODEL_KEYS,
    POLICY_KEYS,
    SERVER_KEYS,
    SOURCE_KEYS,
    TOP_KEYS,
)
from mlxd.config.kv import default_disk_bytes
from mlxd.config.model import (
    DEMO_KINDS,
    Config,
    FakeSettings,
    FaultSettings,
    JournalConfig,
    ManagerConfig,
    Measured,
    Measurement,
    ModelConfig,
    ServerConfig,
    default_state_dir,
    resolve_estimate,
)
from mlxd.config.origins import host_entry, origin_entry
from mlxd.config.readers import (
    Source,
    Table,
    check_number,
    classify_source,
    expand_path_text,
    is_env_name,
    join,
    parse_memory_size,
    show,
)
from mlxd.errors import ConfigError
from mlxd.residency.policy import (
    EVICTIONS,
    STRATEGIES,
    ContentionPolicy,
    Eviction,
    ResidencyRules,
    Strategy,
)
from mlxd.units import GIB

T = TypeVar("T")

_SERVER = ServerConfig()
_JOURNAL = JournalConfig()
_MANAGER = ManagerConfig()
_FAKE = FakeSettings()


class Parser:
    """Reads one config, section by section, collecting every error (see the module)."""

    def __init__(self, source: Source, measured: Measured, *, missing_ok: bool = False) -> None:
        self.source = source
        self.measured_arg = measured
        self.missing_ok = missing_ok
        self.warnings: list[str] = []

    def config(self, raw: object, path: Path | None) -> Config:
        top = Table(
            self.source,
            "",
            {} if raw is None else raw,
            TOP_KEYS,
            what="a mapping with the sections server, journal, manager, models",
        )
        if not top.has("models"):
            self._record(self.source.error("models", "required: a list of models"))
        server = self._part(lambda: self._server(top.table("server", SERVER_KEYS)), _SERVER)
        journal = self._part(lambda: self._journal(top.table("journal", JOURNAL_KEYS)), _JOURNAL)
        manager = self._part(lambda: self._manager(top.table("manager", MANAGER_KEYS)), _MANAGER)
        measured = self.measured_arg
        if callable(measured):
            measured = measured(journal)
        no_models: tuple[ModelConfig, ...] = ()
        models = self._part(lambda: self._models(top, measured), no_models) if top.has("models") else no_models
        self._raise_collected()
        return Config(
            server=server,
            journal=journal,
            manager=manager,
            models=models,
            path=path,
            warnings=tuple(self.warnings),
            measured=dict(measured),
        ).with_prompt_cache_disk()

    # -- collecting errors ----------------------------------------------------------------

    def _record(self, error: ConfigError) -> None:
        if not self.source.recorded(error):
            raise error

    def _part(self, read: Callable[[], T], fallback: T) -> T:
        """``read()``; on an error it could not read past, record it and use ``fallback``."""
        try:
            return read()
        except ConfigError as e:
            self._record(e)
            return fallback

    def _raise_collected(self) -> None:
        """Raise every recorded error at once: one line each, in the file's order."""
        problems = self.source.problems or []
        if not problems:
            return
        if len(problems) == 1:
            raise problems[0]
        lines = [p.message for p in problems]
        raise ConfigError(
            f"{len(lines)} errors:\n" + "\n".join(lines), param=problems[0].param
        )

    # -- sections -------------------------------------------------------------------------

    def _server(self, t: Table) -> ServerConfig:
        host = t.string("host", _SERVER.host)
        if any(ch.isspace() for ch in host):
            raise t.error("host", f"must be a host name or address (got {show(host)})")
        port = t.integer("port", _SERVER.port, minimum=0, maximum=65535)
        api_key_env = t.string("api_key_env", _SERVER.api_key_env)
        if not is_env_name(api_key_env):
            raise t.error(
                "api_key_env", f"must be an environment variable name (got {show(api_key_env)})"
            )
        ollama_port = None  # off unless given (null: off)
        if t.raw.get("ollama_port") is not None:
            ollama_port = t.integer("ollama_port", 0, minimum=0, maximum=65535)
            if ollama_port == port != 0:
                raise t.error("ollama_port", f"must differ from server.port ({port})")
        return ServerConfig(
            host=host,
            port=port,
            ollama_port=ollama_port,
            api_key_env=api_key_env,
            shutdown_grace_s=t.number("shutdown_grace_s", _SERVER.shutdown_grace_s),
            max_body_mb=t.number("max_body_mb", _SERVER.max_body_mb, positive=True),
            keys=parse_keys(t, self._local_path),
            allowed_hosts=_entries(t, "allowed_hosts", host_entry),
            allowed_origins=_entries(t, "allowed_origins", origin_entry),
        )

    def _journal(self, t: Table) -> JournalConfig:
        path = (
            self._local_path(t, "path", t.string("path", ""))
            if "path" in t.raw
            else default_state_dir() / "journal.db"
        )
        sync = t.string("synchronous", "full", choices=("full", "normal"))
        return JournalConfig(
            path=path,
            synchronous=cast(Literal["full", "normal"], sync),
            retain_days=t.number("retain_days", _JOURNAL.retain_days),
            max_mb=t.number("max_mb", _JOURNAL.max_mb),
        )

    def _manager(self, t: Table) -> ManagerConfig:
        if t.has("memory_budget_gb") and t.has("memory_budget"):
            raise t.error("memory_budget", "conflicts with memory_budget_gb; give only one of them")
        if t.has("memory_budget"):
            try:
                budget = parse_memory_size(t.raw["memory_budget"])
            except ValueError as e:
                raise t.error("memory_budget", str(e)) from None
        elif t.has("memory_budget_gb"):
            budget = self._gb_to_bytes(t, "memory_budget_gb", t.raw["memory_budget_gb"])
        else:
            raise t.error(
                "memory_budget_gb",
                "required: the memory budget for resident models, in GB "
                "(or memory_budget: '16gb' | '512mb' | '1000000b')",
            )
        tier = default_state_dir() / "prompt-cache"
        return ManagerConfig(
            memory_budget_bytes=budget,
            idle_unload_seconds=t.number("idle_unload_seconds", 0.0),
            restore_on_start=t.boolean("restore_on_start", True),
            contention_policy=self._policy(t.table("contention_policy", POLICY_KEYS)),
            stop_timeout_s=t.number("stop_timeout_s", 60.0, positive=True),
            rules=self._rules(t),
            prompt_cache_disk_bytes=self._disk_tier_bytes(t, tier),
            prompt_cache_dir=tier,
        )

    def _disk_tier_bytes(self, t: Table, path: Path) -> int:
        """``prompt_cache_disk_gb`` in bytes (0: off); left out, sized from the free disk."""
        if "prompt_cache_disk_gb" not in t.raw:
            return default_disk_bytes(path)
        return int(t.number("prompt_cache_disk_gb", 0.0) * GIB)

    def _rules(self, t: Table) -> ResidencyRules:
        return ResidencyRules(
            eviction=cast(Eviction, t.string("eviction", "lru", choices=EVICTIONS)),
            min_resident_s=t.number("min_resident_s", 0.0),
            max_swap_delay_s=t.number("max_swap_delay_s", 0.0),
            max_keep_alive_s=t.optional_number("max_keep_alive_s"),
        )

    def _policy(self, t: Table) -> ContentionPolicy:
        strategy = cast(Strategy, t.string("strategy", "wait_then_fail", choices=STRATEGIES))
        policy = ContentionPolicy.of(strategy)
        if "wait_timeout_s" in t.raw:
            timeout = t.optional_number("wait_timeout_s", positive=True)
            policy = ContentionPolicy.of(strategy, wait_timeout_s=timeout)
        after = t.optional_number("preempt_after_s")
        if after is not None and strategy != "wait_then_preempt":
            self.warnings.append(
                f"{t.path('preempt_after_s')}: ignored: only strategy 'wait_then_preempt' uses it "
                f"(this one is '{strategy}')"
            )
        return ContentionPolicy(strategy, policy.wait_timeout_s, after)

    def _models(self, top: Table, measured: Mapping[str, Measurement]) -> tuple[ModelConfig, ...]:
        raw = top.raw["models"]
        if not isinstance(raw, list):
            raise top.error("models", f"must be a list of models (got {show(raw)})")
        if not raw:
            raise top.error("models", "must list at least one model")
        seen: dict[str, int] = {}
        read = [
            self._part(functools.partial(self._model, i, item, seen, measured), None)
            for i, item in enumerate(raw)
        ]
        return tuple(model for model in read if model is not None)

    # -- one model ------------------------------------------------------------------------

    def _model(
        self, index: int, raw: object, seen: dict[str, int], measured: Mapping[str, Measurement]
    ) -> ModelConfig:
        t = Table(self.source, join("models", index), raw, (*MODEL_KEYS, *ENGINE_KEYS))
        name = self._name(t, index, seen)
        engine = cast(EngineName, t.string("engine", ENGINES[0], choices=ENGINES))
        source_key, source_text = self._source_key(t, engine)
        mllm = t.boolean("mllm", False)
        embedding = t.boolean("embedding", False)
        if embedding and mllm:
            raise t.error("embedding", "a model is either an embedding model or an mllm, not both")
        if embedding and engine != "mlx":
            raise t.error("embedding", "only for engine: mlx (mlx-embeddings serves it)")
        if embedding and (t.raw.get("isolation") == "process" or t.raw.get("distributed")):
            raise t.error("embedding", "embedding models run in the daemon (isolation: thread)")
        estimated = t.raw.get("estimated_memory_gb")
        fake = self._fake(t, engine)
        demo = self._demo(t, engine, mllm, embedding)
        missing: str | None = None
        if source_text is None:
            source, kind = f"fake:{name}", None
        else:
            source, kind, missing = self._source(t, source_key, source_text, engine, demo)
        ignored, continuous_batching, gpu_util = self._engine_keys(t, name)
        dist = distributed_rules.distributed(t, engine, mllm, demo, self._local_path)
        model = ModelConfig(
            name=name,
            source=source,
            preload=t.boolean("preload", False),
            pin=t.boolean("pin", False),
            estimated_memory_bytes=(
                None
                if estimated is None
                else self._gb_to_bytes(t, "estimated_memory_gb", estimated)
            ),
            idle_unload_seconds=t.optional_number("idle_unload_seconds"),
            mllm=mllm,
            engine=engine,
            max_queue=t.integer("max_queue", 64, minimum=1),
            max_batch_size=t.integer("max_batch_size", 8, minimum=1),
            max_prompt_tokens=t.optional_integer("max_prompt_tokens", minimum=1),
            kv_cache_bytes=self._cache_gb(t, "kv_cache_gb", engine),
            prompt_cache_bytes=self._cache_gb(t, "prompt_cache_gb", engine),
            priority=t.integer("priority", 0, minimum=-1000, maximum=1000),
            fake=fake,
            faults=self._faults(t),
            image_dir=self._image_dir(t, mllm, name),
            demo=demo,
            isolation=distributed_rules.isolation(t, engine, dist is not None),
            distributed=dist,
            embedding=embedding,
            continuous_batching=continuous_batching,
            gpu_memory_utilization=gpu_util,
            ignored_keys=ignored,
            source_kind=kind,
            missing=missing,
        )
        if resolve_estimate(model, measured) is None:
            raise t.error("estimated_memory_gb", self._why_no_estimate(model, source_key))
        return model

    def _name(self, t: Table, index: int, seen: dict[str, int]) -> str:
        name = t.raw.get("name")
        if name is None:
            raise t.error("name", "required: the model id that clients send")
        if not isinstance(name, str):
            raise t.error("name", f"must be a string (got {show(name)})")
        if not name:
            raise t.error("name", "must not be empty")
        if len(name) > 128:
            raise t.error("name", f"must be at most 128 characters (got {len(name)})")
        if any(ch.isspace() or unicodedata.category(ch).startswith("C") for ch in name):
            raise t.error(
                "name", f"must not contain whitespace or control characters (got {show(name)})"
            )
        if name in seen:
            raise t.error(
                "name", f"duplicate model name {show(name)} (models[{seen[name]}].name has it too)"
            )
        seen[name] = index
        return name

    def _source_key(self, t: Table, engine: str) -> tuple[str, str | None]:
        """Which of path/source/model gives the source, and its text (None: a fake without one)."""
        given = [(k, t.raw[k]) for k in SOURCE_KEYS if t.raw.get(k) is not None]
        for key, value in given:
            if not isinstance(value, str):
                raise t.error(key, f"must be a string (got {show(value)})")
            if not value.strip():
                raise t.error(key, "must not be empty")
        for key, value in given[1:]:
            first_key, first = given[0]
            if value != first:
                raise t.error(
                    key,
                    f"conflicts with {first_key} ({show(first)} vs {show(value)}); "
                    "give only one of path, source, model",
                )
        if given:
            return given[0][0], cast(str, given[0][1])
        if not ENGINE_KINDS[engine].weights:
            return "path", None  # nothing to load from
        raise t.error(
            "path",
            "required (or source: / model:): a local model directory or a Hugging Face repo id",
        )

    def _source(
        self, t: Table, key: str, text: str, engine: str, demo: str | None
    ) -> tuple[str, Literal["local", "hub"], str | None]:
        """The source, its kind, and why it cannot load now (``missing_ok`` only)."""
        if "\0" in text:
            raise t.error(key, f"must not contain NUL characters (got {show(text)})")
        try:
            kind = classify_source(text, self.source.base_dir)
        except ValueError as e:
            raise t.error(key, str(e)) from None
        if kind == "local":
            path = self._local_path(t, key, text)
            if engine == "mlx" and demo is None and not path.exists():
                why = f"local path '{path}' does not exist"
                if not self.missing_ok:
                    raise t.error(key, why)
                self.warnings.append(f"{t.path(key)}: {why} (the model stays failed until it does)")
                return str(path), "local", why
            if engine == "mlx" and path.exists() and not path.is_dir():
                raise t.error(key, f"'{path}' is a file; a model source is a directory")
            return str(path), "local", None
        if demo is not None:
            raise t.error(
                "demo",
                f"needs a local path to write the demo model to ({key} is a Hugging Face repo id)",
            )
        return text, "hub", None

    def _fake(self, t: Table, engine: str) -> FakeSettings | None:
        if not t.has("fake"):
            return FakeSettings() if engine == "fake" else None
        if engine != "fake":
            raise t.error(
                "fake", f"only allowed with engine: fake (this model's engine is {engine})"
            )
        f = t.table("fake", FAKE_KEYS)
        memory = f.raw.get("memory_gb")
        return FakeSettings(
            load_seconds=f.number("load_seconds", _FAKE.load_seconds),
            unload_seconds=f.number("unload_seconds", _FAKE.unload_seconds),
            tokens_per_second=f.number("tokens_per_second", _FAKE.tokens_per_second, positive=True),
            fail_loads=f.int_list("fail_loads", minimum=1),
            fail_unloads=f.int_list("fail_unloads", minimum=1),
            reply=f.string("reply", _FAKE.reply),
            memory_bytes=None if memory is None else self._gb_to_bytes(f, "memory_gb", memory),
        )

    def _faults(self, t: Table) -> FaultSettings | None:
        if not t.has("faults"):
            return None
        f = t.table("faults", FAULT_KEYS)
        return FaultSettings(
            load=cast(Any, f.optional_string("load", choices=("raise", "raise_once", "hang", "ignore_cancel"))),
            stop=cast(Any, f.optional_string("stop", choices=("raise", "raise_once", "hang"))),
            generate=cast(Any, f.optional_string("generate", choices=("raise", "hang"))),
            after_tokens=f.integer("after_tokens", 1, minimum=0),
            delay_s=f.number("delay_s", 2.0),
        )

    def _demo(
        self, t: Table, engine: str, mllm: bool, embedding: bool
    ) -> Literal["tiny", "small", "vision", "embedding"] | None:
        demo = t.optional_string("demo", choices=DEMO_KINDS)
        if demo is None:
            return None
        if engine != "mlx":
            raise t.error("demo", f"only for engine: mlx (this model's engine is {engine})")
        if (demo == "vision") != mllm:
            need = "true" if demo == "vision" else "false"
            raise t.error("demo", f"a '{demo}' demo model needs mllm: {need}")
        if (demo == "embedding") != embedding:
            need = "true" if demo == "embedding" else "false"
            raise t.error("demo", f"a '{demo}' demo model needs embedding: {need}")
        return cast(Literal["tiny", "small", "vision", "embedding"], demo)

    def _image_dir(self, t: Table, mllm: bool, name: str) -> Path | None:
        text = t.optional_string("image_dir")
        if text is None:
            return None
        path = self._local_path(t, "image_dir", text)
        if path.exists() and not path.is_dir():
            raise t.error("image_dir", f"'{path}' is not a directory")
        if not mllm:
            self.warnings.append(
                f"{t.path('image_dir')} ({name}): ignored: only mllm models read images"
            )
        elif not path.exists():
            self.warnings.append(f"{t.path('image_dir')} ({name}): '{path}' does not exist (yet)")
        return path

    def _engine_keys(
        self, t: Table, name: str
    ) -> tuple[tuple[str, ...], bool | None, float | None]:
        """Check the vllm-mlx engine keys' types; record them as ignored (with a warning each)."""
        ignored: list[str] = []
        for key, kind in ENGINE_KEYS.items():
            if key not in t.raw:
                continue
            if kind == "bool":
                t.optional_boolean(key)
            elif kind == "int":
                t.optional_integer(key, minimum=0)
            elif kind == "number":
                t.optional_number(key)
            elif kind == "fraction":
                t.optional_number(key, positive=True, at_most=1.0)
            elif kind == "string":
                t.optional_string(key)
            ignored.append(key)
            note = ENGINE_KEY_NOTES.get(key)
            self.warnings.append(
                f"{t.path(key)} ({name}): vllm-mlx engine key, ignored by mlxd"
                + (f" ({note})" if note else "")
            )
        gpu = t.optional_number("gpu_memory_utilization", positive=True, at_most=1.0)
        return tuple(ignored), t.optional_boolean("continuous_batching"), gpu

    # -- values ---------------------------------------------------------------------------

    def _gb_to_bytes(self, t: Table, key: str, value: object) -> int:
        gb = check_number(self.source, t.path(key), value, positive=True)
        size = int(gb * GIB)
        if size < 1:
            raise t.error(key, f"must be at least one byte (got {show(value)})")
        return size

    def _cache_gb(self, t: Table, key: str, engine: str) -> int | None:
        """``kv_cache_gb`` (positive for MLX models: a generation needs KV) or ``prompt_cache_gb``
        (0 turns the prompt cache off); None when absent (derived: mlxd.config.kv)."""
        value = t.raw.get(key)
        if value is None:
            return None
        if t.raw.get("embedding") is True:
            self.warnings.append(
                f"{t.path(key)}: ignored: an embedding model keeps no KV or prompt cache "
                "(it commits its weights only)"
            )
            return None
        positive = key == "kv_cache_gb" and ENGINE_KINDS[engine].kv
        return int(check_number(self.source, t.path(key), value, positive=positive) * GIB)

    def _local_path(self, t: Table, key: str, text: str) -> Path:
        """A path value: ``~`` and variables expanded, relative to the config file's folder."""
        try:
            expanded = Path(expand_path_text(text, default_state_dir))
        except ValueError as e:
            raise t.error(key, str(e)) from None
        if not expanded.is_absolute():
            expanded = self.source.base_dir / expanded
        return Path(os.path.normpath(expanded))

    @staticmethod
    def _why_no_estimate(model: ModelConfig, source_key: str) -> str:
        if not model.engine_kind.weights:
            return f"required for this {model.engine} model (or fake.memory_gb)"
        if model.source_kind == "hub":
            return (
                f"required: {source_key} is a Hugging Face repo id, and a non-local model needs "
                "an explicit memory estimate so that eviction stays deterministic"
            )
        if model.demo is not None:
            return f"required: the demo model at '{model.source}' is not made yet"
        return (
            f"required: no *.safetensors or *.gguf files under '{model.source}' to estimate "
            "the model's memory from"
        )


def _entries(t: Table, key: str, parse: Callable[[str], str]) -> tuple[str, ...]:
    """A list of strings, each normalized by ``parse`` (absent or null: empty)."""
    raw = t.raw.get(key)
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise t.error(key, f"must be a list of strings (got {show(raw)})")
    out: list[str] = []
    for i, item in enumerate(raw):
        if not isinstance(item, str):
            raise t.source.error(join(t.path(key), i), f"must be a string (got {show(item)})")
        try:
            out.append(parse(item))
        except ValueError as e:
            raise t.source.error(join(t.path(key), i), str(e)) from None
    return tuple(dict.fromkeys(out))
