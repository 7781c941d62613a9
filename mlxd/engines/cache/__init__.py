"""A batched model's prompt cache: the KV of earlier prompts in memory, and its disk tier.

Owns the in-memory cache reused by the longest cached prefix
(:mod:`.prompt_cache`, on mlx-lm's ``LRUPromptCache``) and the disk tier whose
entries outlive a residency, keyed by the weights' identity
(:mod:`.prompt_disk`; ``prompt_cache_disk_gb``).

May import: :mod:`mlxd.config`, :mod:`mlxd.crash_points`, :mod:`mlxd.errors`;
never the schedulers, the engines, the workers, the residency or HTTP.
"""
