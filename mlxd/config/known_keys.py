"""The keys each section of the config knows (anything else is an error with a hint), and
the vllm-mlx engine keys, accepted with their seed type and reported as ignored.

:mod:`mlxd.config.rules` reads a config with these lists; nothing here reads a file.
"""

from __future__ import annotations

TOP_KEYS = ("server", "journal", "manager", "models")
SERVER_KEYS = ("host", "port", "api_key_env", "shutdown_grace_s", "max_body_mb", "keys",
               "ollama_port", "allowed_hosts", "allowed_origins")
JOURNAL_KEYS = ("path", "synchronous", "retain_days", "max_mb")
MANAGER_KEYS = (
    "memory_budget_gb",
    "memory_budget",
    "idle_unload_seconds",
    "restore_on_start",
    "contention_policy",
    "stop_timeout_s",
    "eviction",
    "min_resident_s",
    "max_swap_delay_s",
    "max_keep_alive_s",
    "prompt_cache_disk_gb",
)
POLICY_KEYS = ("strategy", "wait_timeout_s", "preempt_after_s")
SOURCE_KEYS = ("path", "source", "model")
MODEL_KEYS = (
    "name",
    *SOURCE_KEYS,
    "preload",
    "pin",
    "estimated_memory_gb",
    "idle_unload_seconds",
    "mllm",
    "engine",
    "max_queue",
    "max_batch_size",
    "max_prompt_tokens",
    "kv_cache_gb",
    "prompt_cache_gb",
    "priority",
    "fake",
    "faults",
    "image_dir",
    "demo",
    "isolation",
    "distributed",
    "embedding",
)
FAULT_KEYS = ("load", "stop", "generate", "after_tokens", "delay_s")
FAKE_KEYS = (
    "load_seconds",
    "unload_seconds",
    "tokens_per_second",
    "fail_loads",
    "fail_unloads",
    "reply",
    "memory_gb",
)
#: vllm-mlx per-entry engine keys (RegisteredModel / RegistryServeDefaults): accepted with
#: their seed type (bool, int, number, fraction, string, any), reported as ignored
ENGINE_KEYS: dict[str, str] = {
    "continuous_batching": "bool",
    "enable_mtp": "bool",
    "prefill_step_size": "int",
    "specprefill": "bool",
    "specprefill_enabled": "bool",
    "specprefill_threshold": "int",
    "specprefill_keep_pct": "number",
    "specprefill_backbone_pct": "number",
    "specprefill_draft_model": "string",
    "stream_interval": "int",
    "gpu_memory_utilization": "fraction",
    "max_tokens": "int",
    "force_mllm": "bool",
    "scheduler_config": "any",
    "download_config": "any",
}
ENGINE_KEY_NOTES = {
    "continuous_batching": "mlxd batches up to max_batch_size generations per model",
    "force_mllm": "use mllm: true",
    "max_tokens": "clients set max_tokens per request",
    "gpu_memory_utilization": "check-config still reconciles it with the budget",
}
