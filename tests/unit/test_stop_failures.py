"""Engine stops that fail, and waits on models that are leaving, in virtual time.

Issue 10's scenarios 3, 4 and 5 at the manager level: bytes stay counted until
a stop succeeds, stops are retried with a growing delay, a model whose stop
failed is nobody's victim meanwhile, and every wait keeps its strategy's bound
(``fail`` never waits for a drain).
"""

from __future__ import annotations

import pytest
import trio
import trio.testing

from mlxd.engines.fake import FakeFleet, FakeModel
from mlxd.errors import CapacityTimeout, LoadFailed, ModelCapacity
from mlxd.residency.lease import Lease
from mlxd.residency.policy import STOP_RETRY_MAX_S, stop_retry_delay
from mlxd.units import GIB
from tests.support.harness import Results, make_config, running

ALWAYS = set(range(1, 10_000))


async def test_a_failed_loads_partial_engine_that_cannot_stop_stays_counted(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A failed load whose partial engine fails to stop stays `loading` with its bytes counted; `failed` comes when a retried stop succeeds."""
    fleet = FakeFleet()
    fleet.add(FakeModel("a", 4 * GIB, load_seconds=1, fail_loads={1}, fail_unloads={1, 2}))
    fleet.add(FakeModel("b", 4 * GIB, load_seconds=1))
    async with running(make_config({"a": 4, "b": 4}, 6, strategy="fail"), fleet) as h:
        t0 = trio.current_time()
        with pytest.raises(LoadFailed):
            await h.manager.acquire("a")
        assert trio.current_time() - t0 == 1  # refused when the load failed
        assert h.state("a") == "loading" and fleet["a"].resident == 1
        assert h.manager.snapshot().committed_bytes == 4 * GIB  # what the engine really holds
        with pytest.raises(ModelCapacity):  # no room while a's engine holds memory
            await h.manager.acquire("b")
        await trio.sleep(1 + 2 + 0.5)  # retries after 1 s (fails again), then 2 s later
        assert h.state("a") == "failed" and fleet["a"].resident == 0
        assert h.manager.snapshot().committed_bytes == 0
        assert h.transitions("a") == [
            ("a", "unloaded", "loading", "request"),
            ("a", "loading", "failed", "load_failed"),
        ]
        assert "scripted failure of load 1" in (h.manager.model_snapshot("a").last_error or "")
        async with h.manager.lease("b"):
            pass


async def test_an_abandoned_loads_partial_engine_that_cannot_stop_stays_counted(
    autojump_clock: trio.abc.Clock,
) -> None:
    """An abandoned load whose partial engine fails to stop stays `loading` (counted) until a retried stop succeeds, then `unloaded`."""
    fleet = FakeFleet()
    fleet.add(FakeModel("a", 4 * GIB, load_seconds=10, fail_unloads={1}))
    async with running(make_config({"a": 4}, 6), fleet) as h:
        with trio.move_on_after(2):
            await h.manager.acquire("a")
        await trio.testing.wait_all_tasks_blocked()
        assert h.state("a") == "loading" and h.manager.snapshot().committed_bytes == 4 * GIB
        await trio.sleep(1.5)  # the retry, 1 s after the failed stop
        assert h.state("a") == "unloaded" and fleet["a"].resident == 0
        assert h.transitions("a")[-1] == ("a", "loading", "unloaded", "abandoned")


async def test_a_stop_that_keeps_failing_is_retried_with_a_growing_delay(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A stop that always fails, on a model whose room a request needs, is retried after 1, 2, 4 ... s (capped): a handful of attempts and journal rows, not thousands a second (issue 10, scenario 4)."""
    fleet = FakeFleet()
    fleet.add(FakeModel("a", 4 * GIB, load_seconds=1, unload_seconds=0.001, fail_unloads=ALWAYS))
    fleet.add(FakeModel("b", 4 * GIB, load_seconds=1))
    async with running(make_config({"a": 4, "b": 4}, 6, wait_timeout_s=20), fleet) as h:
        await h.manager.load("a")
        t0 = trio.current_time()
        with pytest.raises(CapacityTimeout):  # b needs a's room, which never comes free
            await h.manager.acquire("b")
        assert trio.current_time() - t0 == 20
        assert fleet["a"].stops == 5  # at 0, 1, 3, 7 and 15 s
        await trio.sleep(3600)
        # attempts at 0, 1, 3, 7, ..., then every STOP_RETRY_MAX_S
        expected, t, n = 1, 0.0, 1
        while True:
            t += stop_retry_delay(n)
            if t > 3600 + 20:
                break
            expected, n = expected + 1, n + 1
        assert fleet["a"].stops == expected < 30
        rows = h.transitions("a")
        assert len(rows) == 3 + 2 * expected  # load, evict, then each failure as a pair
        assert h.state("a") == "unloading" and h.manager.snapshot().committed_bytes == 4 * GIB
        r = h.manager.model_snapshot("a")
        assert r.retry_at is not None  # stuck: its stop failed and the retry is not due yet
        assert r.retry_at - trio.current_time() <= STOP_RETRY_MAX_S


async def test_a_model_whose_stop_failed_is_nobodys_victim(autojump_clock: trio.abc.Clock) -> None:
    """A waiter does not count on the room of a model whose stop failed: it takes another victim, or waits only until its deadline."""
    fleet = FakeFleet()
    fleet.add(FakeModel("stuck", 4 * GIB, load_seconds=1, fail_unloads=ALWAYS))
    fleet.add(FakeModel("idle", 4 * GIB, load_seconds=1))
    fleet.add(FakeModel("new", 4 * GIB, load_seconds=1))
    cfg = make_config({"stuck": 4, "idle": 4, "new": 4}, 8, wait_timeout_s=20)
    async with running(cfg, fleet) as h:
        await h.manager.load("stuck")
        await h.manager.load("idle")
        with pytest.raises(Exception, match="unload 1"):
            await h.manager.unload("stuck")
        t0 = trio.current_time()
        async with h.manager.lease("new"):  # evicts `idle`, not the stuck one
            assert trio.current_time() - t0 == 1
        assert h.state("idle") == "unloaded" and h.state("stuck") == "unloading"
        held = await h.hold("new")
        t0 = trio.current_time()
        with pytest.raises(CapacityTimeout):  # room only from `new`'s drain; stuck never frees
            await h.manager.acquire("idle")
        assert trio.current_time() - t0 == 20
        held.release.set()


async def test_fail_never_waits_behind_an_admin_drain(autojump_clock: trio.abc.Clock) -> None:
    """Under `fail`, a request whose room is held by a model an admin unload is draining gets model_capacity at once (issue 10, scenario 5)."""
    async with running(make_config({"a": 4, "b": 4}, 6, strategy="fail")) as h:
        held = await h.hold("a")
        unload = Results()

        async def admin_unload() -> None:
            await h.manager.unload("a")
            unload.append("done")

        h.nursery.start_soon(admin_unload)
        await trio.testing.wait_all_tasks_blocked()
        assert h.state("a") == "draining"
        t0 = trio.current_time()
        with pytest.raises(ModelCapacity):
            await h.manager.acquire("b")
        with pytest.raises(ModelCapacity):  # nor for its own model's drain
            await h.manager.acquire("a")
        assert trio.current_time() == t0
        held.release.set()
        await unload.wait_for(1)


@pytest.mark.parametrize("strategy", ["wait_then_fail", "preempt", "wait_then_preempt"])
async def test_waiting_for_ones_own_model_to_drain_is_bounded(
    autojump_clock: trio.abc.Clock, strategy: str
) -> None:
    """A request for a model that an admin unload is draining waits at most wait_timeout_s."""
    cfg = make_config({"a": 4}, 6, strategy=strategy, wait_timeout_s=9, preempt_after_s=0)
    async with running(cfg) as h:
        held = await h.hold("a")
        h.nursery.start_soon(h.manager.unload, "a")
        await trio.testing.wait_all_tasks_blocked()
        t0 = trio.current_time()
        with pytest.raises(CapacityTimeout):
            await h.manager.acquire("a")
        assert trio.current_time() - t0 == 9
        held.release.set()
        await held.finished.wait()


async def test_fail_waits_for_an_evicted_idle_models_stop_only_until_it_fails(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Under `fail`, a request that evicted an idle model is refused as soon as that model's stop fails."""
    fleet = FakeFleet()
    fleet.add(FakeModel("a", 4 * GIB, load_seconds=1, unload_seconds=2, fail_unloads=ALWAYS))
    fleet.add(FakeModel("b", 4 * GIB, load_seconds=1))
    async with running(make_config({"a": 4, "b": 4}, 6, strategy="fail"), fleet) as h:
        await h.manager.load("a")
        t0 = trio.current_time()
        results = Results()
        h.spawn_acquire("b", results)
        await results.wait_for(1)
        assert isinstance(results[0], ModelCapacity)
        assert trio.current_time() - t0 == 2  # a's stop took 2 s, then failed
        assert not isinstance(results[0], Lease)
