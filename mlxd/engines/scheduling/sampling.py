"""A request's sampler on a batched model: per-request temperature, top_p, top_k and seed.

Used by :mod:`mlxd.engines.scheduling.batch_loop` for the generator's rows and for a job
that runs alone (:mod:`mlxd.engines.scheduling.solo`); MLX is imported when a sampler is made.
"""

from __future__ import annotations

import os
from typing import Any


def make_sampler(temperature: float, top_p: float, seed: int | None, top_k: int = 0) -> Any:
    """The request's sampler; None for greedy (the batch then samples all greedy rows at once).

    A sampled request keeps its own PRNG key (from its seed, or fresh entropy),
    split once per token, so a seeded request gives the same tokens whoever
    shares the batch with it. ``top_k`` at or past the vocabulary's size is no limit.
    """
    if temperature <= 0.0:
        return None
    import mlx.core as mx
    from mlx_lm.sample_utils import apply_top_k, apply_top_p

    key = [mx.random.key(seed if seed is not None else int.from_bytes(os.urandom(4), "little"))]
    scale = 1.0 / temperature
    nucleus = 0.0 < top_p < 1.0

    def sampler(logprobs: Any) -> Any:
        if 0 < top_k < logprobs.shape[-1]:
            logprobs = apply_top_k(logprobs, top_k)
        if nucleus:
            logprobs = apply_top_p(logprobs, top_p)
        key[0], sub = mx.random.split(key[0])
        return mx.random.categorical(logprobs * scale, key=sub)

    return sampler
