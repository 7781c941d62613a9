"""Memory beyond the weights: the KV cache of running generations and the prompt cache.

A loaded model commits ``weights + kv_cache + prompt_cache`` bytes at load, and
its requests' KV beyond that is drawn from the budget while they run
(docs/memory.md). Both caches hold keys and values, whose size per token follows
from the model's ``config.json``:

    KV bytes per token = 2 (keys and values) x layers x KV heads x head size x dtype bytes

**One eligibility rule** (:func:`eligibility`) says, from the model's kind and
its cache type, whether it batches, keeps a prompt cache, commits KV and counts
its requests' KV; the budget report, the plan, the engines and ``check-config``
all read it:

* ``embedding: true``: none of the three (an encoder keeps no KV): weights only;
* fake engines: no KV of their own (their committed bytes stay their configured
  size, ``kv_cache_gb`` / ``prompt_cache_gb`` included if set), and no request of
  theirs asks KV of the budget;
* ``mllm: true`` (mlx-vlm samples a batch with one sampler), distributed (ranks run
  in lockstep), ``max_batch_size: 1``, or a KV cache mlx-lm cannot merge (known
  once loaded): one generation at a time, no prompt cache, KV committed;
* otherwise: batched, with a prompt cache, KV committed.

Every model that commits KV counts its requests' KV (drawn from the budget
beyond the floor, or capped by ``kv_cache_gb``) except a distributed one: its
ranks hold their KV in their own processes and the daemon books none per request.

Defaults when the config leaves ``kv_cache_gb`` / ``prompt_cache_gb`` out:

* ``kv_cache``: the floor reserved at load, one sequence of
  :data:`DEFAULT_SEQUENCE_TOKENS` tokens (capped by the context length), so a small
  request never waits for a reservation; KV beyond it is reserved per request.
  Set, ``kv_cache_gb`` is a fixed KV region instead: reserved at load and the cap
  of the model's running KV (requests beyond it wait in the model's queue);
* ``prompt_cache``: :data:`DEFAULT_PROMPT_CACHE_TOKENS` tokens of earlier prompts,
  only where the engine keeps a prompt cache; 0 elsewhere;
* fake engines: 0 and 0.

The prompt cache also has a disk tier (``manager.prompt_cache_disk_gb``,
docs/prompt-cache.md): a directory under the state dir where a model's prompt
caches outlive its residency, bounded in bytes. Left out, the bound is
:func:`default_disk_bytes`: 10% of the free disk there, at most
:data:`DEFAULT_DISK_MAX_BYTES`. It is not part of the budget (it is disk, not memory).

When ``config.json`` cannot be read yet (a Hugging Face model not downloaded,
a demo model written on its first load), the KV bytes per token are unknown
and both defaults are 0 until it can be (the next config read or load);
``check-config`` says so. Reading ``config.json`` is file I/O: never per request.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mlxd.config.model import ModelConfig

#: tokens per sequence that the default ``kv_cache`` has room for
DEFAULT_SEQUENCE_TOKENS = 2048
#: tokens of earlier prompts that the default ``prompt_cache`` keeps
DEFAULT_PROMPT_CACHE_TOKENS = 8192
_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
#: the default disk tier: this share of the free disk under the state dir, at most the cap
DEFAULT_DISK_SHARE = 0.10
DEFAULT_DISK_MAX_BYTES = 20 * 1024**3


@dataclass(frozen=True, slots=True)
class DiskTier:
    """The disk tier of prompt caches: a directory under the state dir, bounded in bytes (LRU)."""

    path: Path
    max_bytes: int


@dataclass(frozen=True, slots=True)
class CacheSizes:
    """A model's KV cache and prompt cache sizes (bytes) and where they come from."""

    kv_cache: int
    prompt_cache: int
    #: KV bytes per token read from config.json (None: unknown)
    kv_bytes_per_token: int | None
    #: ``config`` (both keys set), ``derived`` (from the model config), ``unknown``, ``fake``,
    #: ``none`` (an embedding model: weights only)
    source: str


_FAKE_DEFAULT = CacheSizes(0, 0, None, "fake")


def read_model_config(source: str) -> dict[str, Any] | None:
    """The ``config.json`` of a local model directory or of a cached Hugging Face repo."""
    path = Path(source).expanduser()
    candidates = [path / "config.json"]
    if not path.exists() and "/" in source and not source.startswith(("/", ".", "~")):
        try:  # a hub id: the snapshot already in the Hugging Face cache, if any
            from huggingface_hub import try_to_load_from_cache

            hit = try_to_load_from_cache(source, "config.json")
            if isinstance(hit, str):
                candidates = [Path(hit)]
        except Exception:
            return None
    for file in candidates:
        try:
            data = json.loads(file.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict):
            return data
    return None


def kv_bytes_per_token(cfg: dict[str, Any]) -> int | None:
    """``2 x layers x kv_heads x head_dim x dtype bytes`` of a (text) model config, or None."""
    text = cfg.get("text_config")
    merged = {**cfg, **text} if isinstance(text, dict) else cfg
    try:
        layers = int(merged["num_hidden_layers"])
        heads = int(merged["num_attention_heads"])
        kv_heads = int(merged.get("num_key_value_heads") or heads)
        head_dim = int(merged.get("head_dim") or int(merged["hidden_size"]) // heads)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None
    dtype = str(merged.get("torch_dtype") or merged.get("dtype") or "float16")
    size = 2 * layers * kv_heads * head_dim * _DTYPE_BYTES.get(dtype, 2)
    return size if size > 0 else None


def context_length(cfg: dict[str, Any]) -> int | None:
    text = cfg.get("text_config")
    merged = {**cfg, **text} if isinstance(text, dict) else cfg
    value = merged.get("max_position_embeddings")
    return int(value) if isinstance(value, int) and value > 0 else None


#: mlx-lm's KV caches grow by this many tokens at a time (``KVCache.step``)
KV_STEP = 256


@dataclass(frozen=True, slots=True)
class Eligibility:
    """What a model's engine does with memory beyond its weights (module docstring)."""

    #: generations share decode steps (continuous batching)
    batches: bool
    #: earlier prompts' KV is kept for reuse
    prompt_cache: bool
    #: running generations hold KV (committed at load and drawn from the budget per request)
    kv: bool
    #: why it does not batch (None when it does), in words for check-config
    serial_because: str | None = None
    #: each request's KV is counted while it runs: drawn from the budget beyond the floor,
    #: or capped by ``kv_cache_gb`` (module docstring: all that commit KV but distributed ones)
    per_request: bool = False


def eligibility(model: ModelConfig, cache_batchable: bool | None = None) -> Eligibility:
    """The one rule (module docstring); ``cache_batchable``: whether mlx-lm can merge the
    loaded model's KV caches (None before a load: assumed, as check-config says)."""
    if model.embedding:
        return Eligibility(False, False, False, "an embedding model generates nothing")
    kind = model.engine_kind
    if not kind.batches:
        return Eligibility(False, False, kind.kv, kind.serial_because)
    why = None
    if model.mllm:
        why = "mllm models generate one at a time (mlx-vlm's batch generator has no per-request sampling)"
    elif model.distributed is not None:
        why = "distributed models generate one at a time (their ranks run in lockstep)"
    elif model.max_batch_size <= 1:
        why = "max_batch_size 1: one generation at a time"
    elif cache_batchable is False:
        why = "its KV cache cannot be batched by mlx-lm: one generation at a time"
    return Eligibility(why is None, why is None, True, why, per_request=model.distributed is None)


def keeps_prompt_cache(model: ModelConfig) -> bool:
    """Whether the engine of ``model`` keeps a prompt cache (:func:`eligibility`)."""
    return eligibility(model).prompt_cache


def kv_need_bytes(tokens: list[int], bytes_per_token: int) -> int:
    """The most KV a batch of sequences growing to ``tokens`` tokens each can hold.

    mlx-lm's ``BatchKVCache`` keeps every sequence as long as the longest one (left
    padding) and grows by :data:`KV_STEP` tokens from wherever it starts, so the last
    step may be all but one token unused: ``n x (longest + KV_STEP - 1)`` tokens.
    One sequence (a serial model) is the case ``n = 1``.
    """
    if not tokens:
        return 0
    return len(tokens) * (max(tokens) + KV_STEP - 1) * bytes_per_token


def resolve_cache_sizes(model: ModelConfig) -> CacheSizes:
    """The one rule for a model's ``kv_cache`` and ``prompt_cache`` bytes (module docstring)."""
    kv_set, pc_set = model.kv_cache_bytes, model.prompt_cache_bytes
    if not model.engine_kind.kv:  # no config.json to size them from: as configured, else 0
        if kv_set is None and pc_set is None:
            return _FAKE_DEFAULT  # one shared value: a reload of 10,000 fakes stays quick
        return CacheSizes(kv_set or 0, pc_set or 0, None, "fake")
    rule = eligibility(model)
    if not rule.kv:
        return CacheSizes(0, 0, None, "none")
    cfg = read_model_config(model.source)
    bpt = kv_bytes_per_token(cfg) if cfg is not None else None
    if kv_set is not None and pc_set is not None:
        return CacheSizes(kv_set, pc_set, bpt, "config")
    if bpt is None:
        return CacheSizes(kv_set or 0, pc_set or 0, None, "unknown")
    per_sequence = min(
        DEFAULT_SEQUENCE_TOKENS, context_length(cfg or {}) or DEFAULT_SEQUENCE_TOKENS
    )
    kv = kv_set if kv_set is not None else bpt * per_sequence
    if pc_set is not None:
        pc = pc_set
    else:
        pc = bpt * DEFAULT_PROMPT_CACHE_TOKENS if rule.prompt_cache else 0
    return CacheSizes(kv, pc, bpt, "derived")


def residency_cache_sizes(model: ModelConfig, path: Path) -> tuple[int | None, int, int]:
    """``(KV bytes per token, kv_cache, prompt_cache)`` for a residency of ``model`` loaded from
    ``path``: the sizes in ``model`` (the manager hands over what the load committed), else the
    defaults (a config built in code)."""
    cfg = read_model_config(str(path))
    bpt = kv_bytes_per_token(cfg) if cfg is not None else None
    sizes = resolve_cache_sizes(model)
    kv, pc = model.kv_cache_bytes, model.prompt_cache_bytes
    return (
        bpt,
        kv if kv is not None else sizes.kv_cache,
        pc if pc is not None else sizes.prompt_cache,
    )


def default_disk_bytes(path: Path) -> int:
    """The disk tier's default bound: :data:`DEFAULT_DISK_SHARE` of the free disk where
    ``path`` is (or would be created), at most :data:`DEFAULT_DISK_MAX_BYTES`; 0 if unknown."""
    probe = path.expanduser()
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    try:
        st = os.statvfs(probe)
    except OSError:
        return 0
    return min(DEFAULT_DISK_MAX_BYTES, int(st.f_bavail * st.f_frsize * DEFAULT_DISK_SHARE))


def disk_tier(model: ModelConfig, path: Path, max_bytes: int) -> DiskTier | None:
    """Where ``model``'s prompt caches go when its residency ends: the tier, for a model that
    keeps a prompt cache (:func:`keeps_prompt_cache`, the one rule) when the tier is on."""
    if max_bytes <= 0 or not keeps_prompt_cache(model):
        return None
    return DiskTier(path, max_bytes)
