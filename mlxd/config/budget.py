"""The memory budget report: ``mlxd check-config`` and the daemon's start-up log.

Two questions about a config, answered in words:

1. *Do the models fit the budget?* Each model's estimate and where it comes
   from, their sum against ``manager.memory_budget``, the models that can never
   fit (they fail with ``model_exceeds_budget``), what pinned and preloaded
   models leave for the others, and what the contention policy does when a
   model does not fit.
2. *Does the budget fit the machine?* The seed's reconciliation
   (:class:`MemoryBudgetReport`): the budget counts what models commit (their
   weights and, for batched text models, their KV and prompt caches) and is
   compared with the allocation ceiling MLX works under, the device's
   recommended working set on Metal (scaled by the lowest
   ``gpu_memory_utilization`` of a continuous-batching entry, as vllm-mlx
   would install it). On a host where MLX reports no working set (Linux, CPU)
   there is no ceiling to reconcile with; the total RAM is shown as context.

MLX is imported lazily, inside :func:`device_working_set_bytes`, so importing
this module (and ``mlxd --help``) stays fast.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import EllipsisType

from mlxd.config import Config, ContentionPolicy, Measurement, MemoryEstimate, ModelConfig
from mlxd.config.kv import eligibility, resolve_cache_sizes
from mlxd.units import format_bytes

log = logging.getLogger(__name__)

_ESTIMATE_SOURCES = {
    "config": "from estimated_memory_gb",
    "measured": "measured after its last load, from the journal",
    "weights": "summed *.safetensors/*.gguf files",
    "fake": "from fake.memory_gb",
}


@dataclass(frozen=True, slots=True)
class MemoryBudgetReport:
    """Reconciliation of the weight budget with the allocation ceiling (the seed's report).

    The budget counts what models commit (weights and caches); the ceiling (device working set x
    utilization) is process-wide. Both are totals over every resident model, so
    a budget above the ceiling is a deterministic conflict: mlxd would keep
    models resident that MLX cannot allocate, and a load would fail with an
    out-of-memory error instead of evicting.
    """

    budget_bytes: int
    #: Metal's recommended working set; None where MLX reports none (CPU backend)
    device_working_set_bytes: int | None
    #: lowest gpu_memory_utilization among continuous-batching entries, if any declares one
    gpu_memory_utilization: float | None
    gpu_memory_utilization_source: str | None
    continuous_batching_entries: int
    total_entries: int
    #: total RAM of this host (context where there is no ceiling); None if unknown
    host_memory_bytes: int | None = None
    host_available_bytes: int | None = None

    @property
    def allocation_ceiling_bytes(self) -> int | None:
        """The most MLX can allocate: the working set, scaled by the utilization if one is set."""
        if self.device_working_set_bytes is None:
            return None
        return int(self.device_working_set_bytes * (self.gpu_memory_utilization or 1.0))

    @property
    def exceeds_ceiling(self) -> bool:
        """True when the budget alone cannot fit under the ceiling."""
        ceiling = self.allocation_ceiling_bytes
        return ceiling is not None and self.budget_bytes > ceiling

    @property
    def exceeds_host_memory(self) -> bool:
        """True when the budget is larger than this host's RAM."""
        return self.host_memory_bytes is not None and self.budget_bytes > self.host_memory_bytes


def device_working_set_bytes() -> int | None:
    """Metal's recommended working-set size, or None when MLX cannot report one."""
    try:
        import mlx.core as mx

        if not mx.metal.is_available():
            return None
        info = mx.device_info()
        raw = info.get("max_recommended_working_set_size", info.get("memory_size", 0))
        working_set = int(raw or 0)
    except Exception as e:  # platform dependent: no MLX, no Metal, an older MLX
        log.debug("could not query MLX device memory: %s", e)
        return None
    return working_set or None


def _host_memory() -> tuple[int | None, int | None]:
    try:
        import psutil

        vm = psutil.virtual_memory()
        return int(vm.total), int(vm.available)
    except Exception:  # psutil missing or unsupported platform
        return None, None


def build_memory_budget_report(
    config: Config,
    *,
    device_working_set: int | EllipsisType | None = ...,
    host_memory: tuple[int | None, int | None] | EllipsisType = ...,
) -> MemoryBudgetReport:
    """Reconcile the budget with the allocation ceiling (``...``: ask MLX and psutil).

    Only continuous-batching entries contribute a ``gpu_memory_utilization``
    (in vllm-mlx only the batched engine installs a Metal limit); the lowest one
    wins, since the limit is process-wide. With none, the ceiling is the working
    set itself.
    """
    if isinstance(device_working_set, EllipsisType):
        device_working_set = device_working_set_bytes()
    if isinstance(host_memory, EllipsisType):
        host_memory = _host_memory()
    candidates: list[tuple[float, str]] = []
    batching = 0
    for model in sorted(config.models, key=lambda m: m.name):
        if not model.continuous_batching:
            continue
        batching += 1
        if model.gpu_memory_utilization is not None:
            candidates.append((model.gpu_memory_utilization, f"models-config entry '{model.name}'"))
    utilization, source = min(candidates) if candidates else (None, None)
    return MemoryBudgetReport(
        budget_bytes=config.manager.memory_budget_bytes,
        device_working_set_bytes=device_working_set,
        gpu_memory_utilization=utilization,
        gpu_memory_utilization_source=source,
        continuous_batching_entries=batching,
        total_entries=len(config.models),
        host_memory_bytes=host_memory[0],
        host_available_bytes=host_memory[1],
    )


def _seconds(s: float) -> str:
    return f"{s:g} s"


def describe_policy(policy: ContentionPolicy) -> str:
    """What a request that does not fit (after idle eviction) gets, in one sentence."""
    timeout = policy.wait_timeout_s
    give_up = ", then gets 503 capacity_timeout" if timeout is not None else ""
    waits = (
        f"waits up to {_seconds(timeout)} for room"
        if timeout is not None
        else "waits for room without a time limit"
    )
    victims = "the least recently used busy models"
    if policy.strategy == "fail":
        return (
            "fail: a request that does not fit gets 503 model_capacity at once "
            "(with Retry-After); busy models are never drained for it"
        )
    if policy.strategy in ("wait", "wait_then_fail"):
        return (
            f"{policy.strategy}: a request that does not fit {waits}{give_up} (meanwhile "
            f"{victims} drain: they take no new requests and their running ones finish)"
        )
    if policy.strategy == "preempt":
        return (
            f"preempt: a request that does not fit preempts the requests of {victims} at once "
            f"(they get 503 preempted) and {waits}{give_up}"
        )
    delay = policy.preempt_delay_s or 0.0
    first = (
        f"waits {_seconds(delay)} for {victims} to finish, then preempts them (503 preempted)"
        if delay > 0
        else f"preempts the requests of {victims} at once (preempt_after_s is 0; they get 503 preempted)"
    )
    return f"wait_then_preempt: a request that does not fit {first}; in all it {waits}{give_up}"


def describe_ceiling(report: MemoryBudgetReport) -> list[tuple[int, str]]:
    """The seed's reconciliation sentences, as ``(logging level, sentence)`` pairs."""
    out: list[tuple[int, str]] = []
    budget = format_bytes(report.budget_bytes)
    ceiling = report.allocation_ceiling_bytes
    if ceiling is None:
        out.append(
            (
                logging.INFO,
                f"Memory budget: {budget} for the models' weights and caches; no Metal allocation ceiling to "
                "reconcile it with (MLX cannot report a device working set on this host).",
            )
        )
    else:
        working_set = format_bytes(report.device_working_set_bytes or 0)
        if report.gpu_memory_utilization is not None:
            origin = (
                f"{report.gpu_memory_utilization * 100:.0f}% of the {working_set} device working "
                f"set, from gpu_memory_utilization of {report.gpu_memory_utilization_source}; "
                f"{report.continuous_batching_entries} of {report.total_entries} entries use "
                "continuous batching"
            )
        else:
            origin = "the device's recommended working set"
        out.append(
            (
                logging.INFO,
                f"Memory budget: {budget} for the models' weights and caches; allocation ceiling "
                f"{format_bytes(ceiling)} "
                f"({origin}).",
            )
        )
        if report.exceeds_ceiling:
            raise_hint = " or raise gpu_memory_utilization" if report.gpu_memory_utilization else ""
            out.append(
                (
                    logging.WARNING,
                    f"The memory budget ({budget}) exceeds the allocation ceiling "
                    f"({format_bytes(ceiling)}). The budget counts what models commit (weights and "
                    "caches), so mlxd will keep models resident that MLX cannot allocate, and a load can fail with an "
                    f"out-of-memory error instead of evicting. Lower the budget below "
                    f"{format_bytes(ceiling)} (further still, since activations also come out of the "
                    f"ceiling){raise_hint}.",
                )
            )
    if not report.exceeds_ceiling:
        out.append(
            (
                logging.INFO,
                "The budget covers each model's weights, the KV of its running generations "
                "(a floor reserved at load, the rest reserved per request while it runs) and, "
                "for batched text models, its prompt cache (prompt_cache_gb); activations are "
                "additional and are not reserved by it.",
            )
        )
    if report.host_memory_bytes is not None:
        available = (
            f", {format_bytes(report.host_available_bytes)} available now"
            if report.host_available_bytes is not None
            else ""
        )
        out.append(
            (logging.INFO, f"This host has {format_bytes(report.host_memory_bytes)} of RAM{available}.")
        )
        if report.exceeds_host_memory:
            out.append(
                (
                    logging.WARNING,
                    f"The memory budget ({budget}) is larger than this host's RAM "
                    f"({format_bytes(report.host_memory_bytes)}): models that fit the budget may not fit "
                    "in memory; lower the budget.",
                )
            )
    return out


def describe_budget(
    config: Config, measured: Mapping[str, Measurement] | None = None
) -> list[tuple[int, str]]:
    """What the estimates mean for the budget, as ``(logging level, sentence)`` pairs.

    The sum against the budget, the models that can never fit, what pinned and
    preloaded models take, the contention policy, idle unload and restore.
    """
    budget = config.manager.memory_budget_bytes
    sizes = {m.name: config.estimate(m.name, measured).bytes for m in config.models}
    total = sum(sizes.values())
    info, warn = logging.INFO, logging.WARNING
    out: list[tuple[int, str]] = []
    if total <= budget:
        out.append(
            (
                info,
                f"The estimates add up to {format_bytes(total)} of the {format_bytes(budget)} budget: "
                "all models fit at once.",
            )
        )
    else:
        out.append(
            (
                info,
                f"The estimates add up to {format_bytes(total)}, more than the {format_bytes(budget)} budget: not "
                "all models fit at once; idle models are evicted, least recently used first "
                "(pinned ones never).",
            )
        )
    for m in config.models:
        if sizes[m.name] > budget:
            out.append(
                (
                    warn,
                    f"{m.name} can never fit ({format_bytes(sizes[m.name])} > the {format_bytes(budget)} budget): "
                    "requests for it fail at once with 400 model_exceeds_budget.",
                )
            )
    out.extend(
        _describe_group(config, sizes, "pin", "Pinned (resident until shutdown once loaded)")
    )
    out.extend(_describe_group(config, sizes, "preload", "Preloaded at start-up"))
    pinned = sum(sizes[m.name] for m in config.models if m.pin)
    if 0 < pinned <= budget:
        room = budget - pinned
        for m in config.models:
            if not m.pin and room < sizes[m.name] <= budget:
                out.append(
                    (
                        warn,
                        f"{m.name} ({format_bytes(sizes[m.name])}) cannot load while every pinned model "
                        f"is resident (they leave {format_bytes(room)}).",
                    )
                )
    out.append((info, f"Contention policy: {describe_policy(config.manager.contention_policy)}."))
    idle = config.manager.idle_unload_seconds
    out.append(
        (
            info,
            f"Idle unload: after {_seconds(idle)} without requests (per-model overrides apply)."
            if idle > 0
            else "Idle unload: off (models stay until evicted), except per-model overrides.",
        )
    )
    restore = (
        "on: what was resident when the last run ended is loaded again."
        if config.manager.restore_on_start
        else "off."
    )
    out.append((info, f"Restore on start: {restore}"))
    return out


def _describe_group(
    config: Config, sizes: Mapping[str, int], attr: str, label: str
) -> list[tuple[int, str]]:
    group = [m for m in config.models if getattr(m, attr)]
    if not group:
        return []
    total = sum(sizes[m.name] for m in group)
    budget = config.manager.memory_budget_bytes
    names = ", ".join(m.name for m in group)
    if total <= budget:
        return [(logging.INFO, f"{label}: {names}, {format_bytes(total)} in all; that fits the budget.")]
    consequence = (
        "they can never all be resident; the loads beyond the budget fail"
        if attr == "pin"
        else "preloads beyond the budget evict earlier unpinned ones or fail"
    )
    return [
        (
            logging.WARNING,
            f"{label}: {names}, {format_bytes(total)} in all, more than the {format_bytes(budget)} budget: "
            f"{consequence}.",
        )
    ]


def describe_model(
    config: Config, model: ModelConfig, measured: Mapping[str, Measurement] | None
) -> list[str]:
    """A few lines about one model: source, engine, estimate, residency, ignored keys."""
    if not model.engine_kind.weights:
        where = f"no weights ({model.engine} engine)"
    elif model.is_local:
        pending = model.demo is not None and not Path(model.source).exists()
        kind_of = "local demo model, written on first load" if pending else "local"
        where = f"{model.source} ({kind_of})"
    else:
        where = f"{model.source} (Hugging Face Hub, downloaded on first load)"
    kind = "vision, mlx-vlm" if model.mllm else "text, mlx-lm"
    if model.embedding:
        kind = "embedding, mlx-embeddings"
    engine = f"{model.engine} ({kind})" if model.engine_kind.weights else model.engine
    est = config.estimate(model.name, measured)
    residency = [
        "preloaded at start" if model.preload else "loaded on first request",
        "pinned (never evicted)" if model.pin else "evictable",
    ]
    idle = config.idle_unload_for(model.name)
    residency.append(f"idle unload after {_seconds(idle)}" if idle > 0 else "no idle unload")
    lines = [
        f"{model.name}: {where}",
        f"    engine {engine}; max_queue {model.max_queue}; {describe_batching(model)}",
        f"    commits {format_bytes(est.bytes)} when loaded: weights {format_bytes(est.weights)} "
        f"({_ESTIMATE_SOURCES.get(est.source, est.source)}) + {describe_caches(model, est)}",
        f"    {'; '.join(residency)}",
    ]
    if model.ignored_keys:
        lines.append(f"    ignored vllm-mlx keys: {', '.join(model.ignored_keys)}")
    return lines


def describe_batching(model: ModelConfig) -> str:
    """What ``max_batch_size`` means for this model (the eligibility rule, in words)."""
    rule = eligibility(model)
    if rule.serial_because is None:
        return (
            f"up to {model.max_batch_size} generations share each decode step "
            "(one at a time if the model's KV cache cannot be batched)"
        )
    if model.max_batch_size <= 1 or model.embedding:
        return rule.serial_because
    return f"max_batch_size {model.max_batch_size} ignored: {rule.serial_because}"


def describe_caches(model: ModelConfig, est: MemoryEstimate) -> str:
    """The KV cache and prompt cache parts of a model's commitment, and where they come from."""
    sizes = resolve_cache_sizes(model)
    if sizes.source == "none":
        return "nothing else (an embedding model keeps no KV cache or prompt cache: weights only)"
    text = f"KV cache {format_bytes(est.kv_cache)} + prompt cache {format_bytes(est.prompt_cache)}"
    if sizes.source == "derived" and sizes.kv_bytes_per_token is not None:
        per = sizes.kv_bytes_per_token
        text += f" (from the model config: {per:,} KV bytes per token"
        if model.kv_cache_bytes is None:
            text += (
                f"; KV floor of one {est.kv_cache // max(1, per):,}-token sequence, more drawn "
                "from the budget per request while it runs"
            )
        if model.prompt_cache_bytes is None and est.prompt_cache:
            text += f"; {est.prompt_cache // per:,} prompt tokens kept"
        text += ")"
    elif sizes.source == "unknown":
        text += (
            " (KV bytes per token unknown until the model's config.json is on disk; "
            "set kv_cache_gb and prompt_cache_gb to count them from the first load)"
        )
    elif sizes.source == "config":
        text += " (from kv_cache_gb and prompt_cache_gb)"
    if model.kv_cache_bytes is not None and eligibility(model).per_request:
        text += "; kv_cache_gb is a fixed KV region: the cap of its running KV"
    return text


def render_report(
    config: Config, report: MemoryBudgetReport, notes: Mapping[str, list[str]] | None = None
) -> str:
    """The whole ``check-config`` report, in words; ``notes``: more lines per model, shown
    under its commitment (the CLI's measured KV peaks from the journal)."""
    s = config.server
    lines = [
        f"Config: {config.path or '(built in code)'}: valid.",
        f"Server: {s.host}:{s.port}; an API key is required when ${s.api_key_env} is set.",
        f"Journal: {config.journal.path} (synchronous {config.journal.synchronous}).",
        f"Memory budget: {format_bytes(config.manager.memory_budget_bytes)} "
        f"({config.manager.memory_budget_bytes} bytes).",
        _disk_tier(config),
        "",
        f"Models ({len(config.models)}):",
    ]
    for model in config.models:
        block = describe_model(config, model, None)
        block[3:3] = [f"    {note}" for note in (notes or {}).get(model.name, [])]
        lines.extend(f"  {line}" for line in block)
    lines += ["", "Budget:"]
    lines.extend(_sentences(describe_budget(config)))
    lines += ["", "Memory ceiling:"]
    lines.extend(_sentences(describe_ceiling(report)))
    if config.warnings:
        lines += ["", f"Warnings ({len(config.warnings)}):"]
        lines.extend(f"  - {w}" for w in config.warnings)
    return "\n".join(lines)


def _disk_tier(config: Config) -> str:
    """The prompt cache's disk tier in one line (not part of the budget: it is disk)."""
    m = config.manager
    if m.prompt_cache_disk_bytes <= 0:
        return "Prompt cache on disk: off (manager.prompt_cache_disk_gb: 0)."
    return (f"Prompt cache on disk: up to {format_bytes(m.prompt_cache_disk_bytes)} under "
            f"{m.prompt_cache_dir} (least recently used entries go first; docs/prompt-cache.md).")


def _sentences(pairs: list[tuple[int, str]]) -> list[str]:
    return [f"  {'WARNING: ' if level >= logging.WARNING else ''}{text}" for level, text in pairs]


def log_memory_budget_report(
    config: Config,
    report: MemoryBudgetReport | None = None,
    *,
    logger: logging.Logger = log,
    measured: Mapping[str, Measurement] | None = None,
) -> None:
    """Log the reconciliation and the budget findings (for the daemon at start-up)."""
    report = report or build_memory_budget_report(config)
    for level, text in describe_ceiling(report):
        logger.log(level, "%s", text)
    for level, text in describe_budget(config, measured):
        logger.log(level, "%s", text)
    for warning in config.warnings:
        logger.warning("config: %s", warning)




