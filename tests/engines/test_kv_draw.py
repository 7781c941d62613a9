"""A request's KV beyond its model's floor is drawn from the budget (real mlx-lm, a real manager).

The tiny demo model (1 KiB of KV a token, a floor of one 2,048-token sequence)
shares a tight budget with two idle fake models; its requests' KV is reserved
when they are admitted (evicting the least recently used idle model, with the
cause on its transition) and given back when they leave.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path

import pytest
import trio

from mlxd.config import Config, ContentionPolicy, FakeSettings, ManagerConfig, ModelConfig
from mlxd.engines import DefaultEngines
from mlxd.engines.base import Finished, GenerationRequest
from mlxd.errors import InvalidRequest
from mlxd.residency.events import KvPeakEvent, LeaseReleased, ManagerEvent, TransitionEvent
from mlxd.residency.manager import Manager
from mlxd.residency.states import Reason, State
from tests.engines.mlx_helpers import tiny_config

MIB = 1 << 20


def _config(
    tiny_dir: Path, budget: int, strategy: str = "wait_then_fail", isolation: str = "thread"
) -> Config:
    fakes = tuple(
        ModelConfig(name=n, source=f"fake/{n}", engine="fake", estimated_memory_bytes=10 * MIB,
                    fake=FakeSettings(load_seconds=0.0, tokens_per_second=100.0))
        for n in ("fake-a", "fake-b")
    )
    tiny = tiny_config(tiny_dir, estimated_memory_bytes=8 * MIB, prompt_cache_bytes=MIB,
                       isolation=isolation)
    policy = ContentionPolicy.of(strategy, wait_timeout_s=5.0)
    return Config(manager=ManagerConfig(budget, contention_policy=policy), models=(*fakes, tiny))


@asynccontextmanager
async def _manager(config: Config) -> AsyncIterator[tuple[Manager, list[ManagerEvent]]]:
    engines = DefaultEngines()
    manager = Manager(config, engines)
    events: list[ManagerEvent] = []
    manager.subscribe(events.append)
    async with trio.open_nursery() as nursery:
        await nursery.start(engines.run)  # the owner of isolation: process's worker
        await nursery.start(manager.run)
        try:
            for name in ("fake-a", "fake-b", "tiny"):  # fake-a is the least recently used
                await manager.load(name)
            yield manager, events
        finally:
            manager._core.check_invariants()  # white-box: the core's own invariants
            nursery.cancel_scope.cancel()


def _ids(n: int) -> GenerationRequest:
    return GenerationRequest(kind="completion", prompt_ids=tuple(5 + i % 400 for i in range(n)),
                             max_tokens=8, temperature=0.0)


async def _generate(manager: Manager, request: GenerationRequest) -> Finished:
    """Generate under a lease on tiny, as the HTTP layer does (the request names its lease)."""
    async with manager.lease("tiny") as lease:
        fin = None
        with lease.scope():
            async for ev in lease.engine.generate(replace(request, lease_id=lease.id)):
                assert manager.snapshot().committed_bytes <= manager.snapshot().budget_bytes
                if isinstance(ev, Finished):
                    fin = ev
        assert fin is not None
        return fin


@pytest.mark.parametrize("isolation", ["thread", "process"])
async def test_kv_beyond_the_floor_evicts_the_idle_lru_model_and_comes_back(
    tiny_model_dir: Path, isolation: str
) -> None:
    """A 3,000-token prompt needs 1.2 MiB of KV beyond tiny's floor with 0.5 MiB free: fake-a
    (idle, least recently used) is evicted for it and its transition says so; fake-b stays;
    the KV is given back when the request ends. The same with the engine in a worker process
    (the daemon side reserves)."""
    budget = 31 * MIB + MIB // 2  # 10 + 10 + (8 + 2 + 1) committed: 0.5 MiB free
    async with _manager(_config(tiny_model_dir, budget, isolation=isolation)) as (manager, events):
        assert manager.model_snapshot("tiny").committed_bytes == 11 * MIB  # weights + floor + cache
        p = manager.plan("tiny", kv_bytes=(3008 + 255) * 1024 - 2 * MIB)
        assert (p.action, [v.model for v in p.victims]) == ("evict_then_load", ["fake-a"])
        fin = await _generate(manager, _ids(3000))
        assert (fin.prompt_tokens, fin.completion_tokens) == (3000, 8)
        evicted = [e for e in events if isinstance(e, TransitionEvent) and e.model == "fake-a"
                   and e.to_state is State.UNLOADING]
        assert len(evicted) == 1 and evicted[0].reason is Reason.EVICTED
        assert evicted[0].cause is not None and "KV of a request on 'tiny'" in evicted[0].cause
        assert manager.state_of("fake-b") is State.LOADED
        with trio.fail_after(10):
            while manager.model_snapshot("tiny").kv_bytes:  # noqa: ASYNC110 (given back by the engine)
                await trio.sleep(0.01)
        assert manager.model_snapshot("tiny").committed_bytes == 11 * MIB


async def test_a_small_request_fits_the_floor_and_evicts_nothing(tiny_model_dir: Path) -> None:
    """A request of 1,000 tokens fits the floor reserved at load: no reservation, no eviction,
    and its lease journals no KV wait."""
    async with _manager(_config(tiny_model_dir, 31 * MIB + MIB // 2)) as (manager, events):
        mark = len(events)
        await _generate(manager, _ids(1000))
        assert not [e for e in events[mark:] if isinstance(e, TransitionEvent)]
        (released,) = [e for e in events[mark:] if isinstance(e, LeaseReleased)]
        assert released.kv_wait_seconds is None
        assert manager.model_snapshot("tiny").kv_bytes == 0


async def test_a_reservation_that_waited_says_how_long_on_its_lease(tiny_model_dir: Path) -> None:
    """With both fakes busy, a 3,000-token request's KV waits (policy wait) until they are idle,
    then evicts fake-a: its lease's release carries ``kv_wait_seconds``, at least the time the
    fakes were held after the reservation was queued."""
    held_s = 0.3
    async with _manager(_config(tiny_model_dir, 31 * MIB + MIB // 2)) as (manager, events):
        async with trio.open_nursery() as n, manager.lease("fake-a"), manager.lease("fake-b"):
            n.start_soon(_generate, manager, _ids(3000))
            with trio.fail_after(30):
                while not manager.model_snapshot("tiny").queued:  # noqa: ASYNC110 (its KV waits)
                    await trio.sleep(0.001)
            await trio.sleep(held_s)  # the subject: the fakes stay busy this long
        (released,) = [e for e in events if isinstance(e, LeaseReleased) and e.model == "tiny"]
        assert released.kv_wait_seconds is not None and released.kv_wait_seconds >= held_s
        assert manager.state_of("fake-a") is State.UNLOADED


async def test_kv_that_cannot_fit_the_budget_is_a_400_that_says_by_how_much(tiny_model_dir: Path) -> None:
    """With every other model evicted the budget leaves tiny 23.5 MiB of KV: a 30,000-token
    prompt is refused before generation (naming the budget and the shortfall), while counting
    its tokens is never refused for KV."""
    async with _manager(_config(tiny_model_dir, 31 * MIB + MIB // 2)) as (manager, _events):
        async with manager.lease("tiny") as lease:
            big = _ids(30_000)
            assert await lease.engine.count_tokens(big) == 30_000
            with pytest.raises(InvalidRequest) as err:
                await lease.engine.prepare(big)
        text = err.value.message
        assert err.value.code == "model_exceeds_budget" and err.value.http_status == 400
        assert "memory budget" in text and "short" in text and "30,000 tokens" in text, text
        assert manager.state_of("fake-a") is State.LOADED  # nothing was evicted for it


async def test_fail_policy_refuses_kv_it_would_have_to_wait_for(tiny_model_dir: Path) -> None:
    """Under ``fail`` a busy model is never drained for KV: with both fakes busy, the request
    gets 503 model_capacity as its error, and nothing is evicted."""
    async with _manager(_config(tiny_model_dir, 31 * MIB + MIB // 2, "fail")) as (manager, _ev):
        async with manager.lease("fake-a"), manager.lease("fake-b"):
            with pytest.raises(Exception) as err:
                await _generate(manager, _ids(3000))
        assert getattr(err.value, "code", None) == "model_capacity", err.value
        assert manager.model_snapshot("tiny").kv_bytes == 0


async def test_an_isolated_batched_model_reports_its_kv_like_a_thread_one(tiny_model_dir: Path) -> None:
    """Under ``isolation: process`` a batched model shows memory_in_use (with its KV peak) in
    the status, and its residency's end emits the kv_peaks record the journal writes."""
    async with _manager(_config(tiny_model_dir, 64 * MIB, isolation="process")) as (manager, events):
        await _generate(manager, _ids(300))
        held = manager.status()["models"]["tiny"]["memory_in_use"]
        assert held is not None and held["kv_cache_peak"] > 0, held
        await manager.unload("tiny")
        peaks = [e for e in events if isinstance(e, KvPeakEvent) and e.model == "tiny"]
        assert len(peaks) == 1 and peaks[0].kv_peak_bytes == held["kv_cache_peak"], peaks
