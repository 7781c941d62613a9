"""Committed bytes, KV included, never exceed the budget (the real manager, fake engines).

Each model commits ``weights + kv_cache + prompt_cache`` when it loads. Random
models (weights, KV cache and prompt cache sizes) and a random sequence of
requests run through the real :class:`~mlxd.residency.manager.Manager` under
virtual time; after every request the committed bytes (which count each
resident model's caches) are within the budget, and each resident model
commits exactly its three parts plus the KV its requests hold.

KV reservations run through the real shell too: a request holding its lease
asks its model's broker (:class:`~mlxd.residency.kv.ModelKv`, what an MLX
engine's queue asks) for random KV bytes beyond the floor, which may evict idle
models, wait under the policy, or be refused; granted bytes are given back
when the request ends. Fake engines never ask by themselves (docs/memory.md).
40 examples by default, 5,000 under ``--stress``.
"""

from __future__ import annotations

import trio
import trio.testing
from hypothesis import event as note_event
from hypothesis import given, settings
from hypothesis import strategies as st

from mlxd.config import Config, ContentionPolicy, FakeSettings, ManagerConfig, ModelConfig
from mlxd.errors import MlxdError, ModelExceedsBudget
from mlxd.residency.kv import ModelKv
from mlxd.residency.manager import Manager
from mlxd.residency.states import State
from mlxd.units import format_bytes
from tests.support.harness import running

MB = 1 << 20
sizes = st.integers(min_value=1, max_value=400).map(lambda n: n * MB)
caches = st.integers(min_value=0, max_value=300).map(lambda n: n * MB)


#: the stress profile's count, else the default suite's 40 (each example is a real manager run)
EXAMPLES = 5000 if settings.default.max_examples >= 5000 else 40
kv_asks = st.integers(min_value=0, max_value=600).map(lambda n: n * MB)


@settings(max_examples=EXAMPLES, deadline=None)
@given(
    parts=st.lists(st.tuples(sizes, caches, caches), min_size=1, max_size=4),
    budget_mb=st.integers(min_value=200, max_value=1500),
    requests=st.lists(st.tuples(st.integers(min_value=0, max_value=3), kv_asks), min_size=1,
                      max_size=12),
)
def test_committed_bytes_with_kv_never_exceed_the_budget(
    parts: list[tuple[int, int, int]], budget_mb: int, requests: list[tuple[int, int]]
) -> None:
    """Whatever the sizes, the order of requests and the KV they reserve, committed (weights +
    KV + prompt cache + reservations) stays within the budget, a model too big with its caches
    is refused, not loaded, and every reservation is given back when its request ends."""
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
            for pick, kv in requests:
                name = f"m{pick % len(models)}"
                assert h.manager.estimates.memory_parts(name) == dict(
                    zip(
                        ("weights", "kv_cache", "prompt_cache"),
                        parts[pick % len(models)],
                        strict=True,
                    )
                )
                too_big = want[name] > budget
                # one request at a time and every other model idle: the only refusal is a model
                # too big with its caches; anything else (a timeout included) fails the test
                try:
                    with trio.fail_after(60):
                        async with h.manager.lease(name) as lease:
                            await _hold_kv(h.manager, name, lease.id, kv, budget)
                except ModelExceedsBudget as e:
                    assert too_big, e
                    assert (e.http_status, e.type, e.code, e.param) == (
                        400, "invalid_request_error", "model_exceeds_budget", "model"
                    )
                    assert e.message == (
                        f"'{name}' needs {format_bytes(want[name])}, more than the whole "
                        f"memory budget of {format_bytes(budget)}"
                    )
                    assert h.manager.state_of(name) is State.UNLOADED  # not loaded
                else:
                    assert not too_big, f"{name} ({want[name]} bytes) loaded over {budget}"
                assert h.manager.snapshot().committed_bytes <= budget
                for r in map(h.manager.model_snapshot, h.manager.model_names()):
                    if r.holds_budget:
                        assert r.committed_bytes == want[r.spec.name] and r.kv_bytes == 0

    trio.run(scenario, clock=trio.testing.MockClock(autojump_threshold=0))


async def _hold_kv(manager: Manager, model: str, lease_id: str, nbytes: int, budget: int) -> None:
    """Reserve ``nbytes`` of KV as an engine admitting a request does, run, give them back."""
    broker = ModelKv(manager, model)
    answered = trio.Event()
    box: list[MlxdError | None] = []

    def answer(error: MlxdError | None) -> None:
        box.append(error)
        answered.set()

    t0 = trio.current_time()
    withdraw = broker.reserve(lease_id, nbytes, answer)
    try:
        await answered.wait()
        waited = trio.current_time() > t0
    except BaseException:
        withdraw()
        raise
    r = manager.model_snapshot(broker.model)
    assert manager.snapshot().committed_bytes <= budget
    note_event(f"KV {'granted' if box[0] is None else box[0].code}" + (" (waited)" if waited else ""))
    if box[0] is not None:
        if box[0].code == "model_exceeds_budget":  # only when it could never fit
            assert nbytes > budget - (r.committed_bytes - r.kv_bytes)
        return
    assert r.kv_bytes >= nbytes
    await trio.sleep(1)
    broker.give_back(nbytes)
