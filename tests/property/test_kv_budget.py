"""Committed bytes, KV included, never exceed the budget (the real manager, fake engines).

Each model commits ``weights + kv_cache + prompt_cache`` when it loads. Random
models (weights, KV cache and prompt cache sizes) and a random sequence of
requests run through the real :class:`~mlxd.residency.manager.Manager` under
virtual time; after every request the committed bytes (which count each
resident model's caches) are within the budget, and each resident model
commits exactly its three parts.
"""

from __future__ import annotations

import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from mlxd.config import Config, ContentionPolicy, FakeSettings, ManagerConfig, ModelConfig
from mlxd.errors import MlxdError
from tests.support.harness import running

MB = 1 << 20
sizes = st.integers(min_value=1, max_value=400).map(lambda n: n * MB)
caches = st.integers(min_value=0, max_value=300).map(lambda n: n * MB)


@settings(max_examples=40, deadline=None)
@given(
    parts=st.lists(st.tuples(sizes, caches, caches), min_size=1, max_size=4),
    budget_mb=st.integers(min_value=200, max_value=1500),
    requests=st.lists(st.integers(min_value=0, max_value=3), min_size=1, max_size=12),
)
def test_committed_bytes_with_kv_never_exceed_the_budget(
    parts: list[tuple[int, int, int]], budget_mb: int, requests: list[int]
) -> None:
    """Whatever the sizes and the order of requests, committed (weights + KV + prompt cache)
    stays within the budget, and a model too big with its caches is refused, not loaded."""
    budget = budget_mb * MB
    models = tuple(
        ModelConfig(
            name=f"m{i}",
            source=f"fake/m{i}",
            engine="fake",
            estimated_memory_bytes=w,
            kv_cache_bytes=kv,
            prompt_cache_bytes=pc,
            fake=FakeSettings(load_seconds=0.5, tokens_per_second=10.0),
        )
        for i, (w, kv, pc) in enumerate(parts)
    )
    config = Config(
        manager=ManagerConfig(budget, contention_policy=ContentionPolicy.of("wait_then_fail")),
        models=models,
    )
    want = {f"m{i}": w + kv + pc for i, (w, kv, pc) in enumerate(parts)}

    async def scenario() -> None:
        async with running(config) as h:
            for pick in requests:
                name = f"m{pick % len(models)}"
                assert h.manager.memory_parts(name) == dict(
                    zip(
                        ("weights", "kv_cache", "prompt_cache"),
                        parts[pick % len(models)],
                        strict=True,
                    )
                )
                try:
                    with trio.move_on_after(60):
                        async with h.manager.lease(name):
                            await trio.sleep(1)
                except MlxdError:
                    pass  # refused (too big with its caches) or timed out: nothing was committed
                core = h.manager.core
                assert core.committed <= budget
                for r in core.models.values():
                    if r.holds_budget:
                        assert r.committed_bytes == want[r.spec.name]

    trio.run(scenario, clock=trio.testing.MockClock(autojump_threshold=0))
