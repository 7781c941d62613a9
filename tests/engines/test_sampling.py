"""A batched request's own sampler: top_k keeps the k most likely tokens, and a seed repeats."""

from __future__ import annotations

import mlx.core as mx

from mlxd.engines.scheduling.sampling import make_sampler

#: log-probabilities over a vocabulary of 6, most likely first
LOGPROBS = mx.log(mx.array([[0.30, 0.25, 0.20, 0.12, 0.08, 0.05]]))


def draws(sampler: object, n: int) -> set[int]:
    return {int(sampler(LOGPROBS).item()) for _ in range(n)}  # type: ignore[operator]


def test_top_k_samples_only_among_the_k_most_likely_tokens() -> None:
    """With a hot temperature, top_k 2 draws only tokens 0 and 1; no top_k (or one past the
    vocabulary) draws from all of them; the same seed draws the same tokens."""
    assert draws(make_sampler(3.0, 1.0, 7, top_k=2), 300) == {0, 1}
    assert draws(make_sampler(3.0, 1.0, 7), 300) == set(range(6))
    assert draws(make_sampler(3.0, 1.0, 7, top_k=6), 300) == set(range(6))
    a, b = make_sampler(1.0, 1.0, 11, top_k=3), make_sampler(1.0, 1.0, 11, top_k=3)
    assert [int(a(LOGPROBS).item()) for _ in range(20)] == [int(b(LOGPROBS).item()) for _ in range(20)]
