"""Residency behaviours of the Trio manager with fake engines, in virtual time."""

from __future__ import annotations

import re

import pytest
import trio
import trio.testing

from mlxd.engines.fake import FakeFleet, FakeModel
from mlxd.errors import (
    CapacityTimeout,
    Conflict,
    LoadFailed,
    ModelCapacity,
    ModelExceedsBudget,
    ModelNotFound,
    Preempted,
    ShuttingDown,
)
from mlxd.residency.lease import Lease
from mlxd.residency.states import Outcome
from mlxd.units import GIB
from tests.support.harness import Results, make_config, running


async def test_concurrent_acquires_share_one_load(autojump_clock: trio.abc.Clock) -> None:
    """Ten concurrent acquires of a cold model cause exactly one load and all get leases."""
    async with running(make_config({"a": 1}, 4)) as h:
        results = Results()
        for _ in range(10):
            h.spawn_acquire("a", results)
        t0 = trio.current_time()
        await results.wait_for(10)
        assert all(isinstance(r, Lease) for r in results)
        assert h.fleet["a"].loads_started == 1
        assert trio.current_time() - t0 == 1
        assert h.transitions("a") == [
            ("a", "unloaded", "loading", "request"),
            ("a", "loading", "loaded", "request"),
        ]
        for r in results:
            assert isinstance(r, Lease)
            r.release()


async def test_lru_eviction_loads_third_by_evicting_least_recent(autojump_clock: trio.abc.Clock) -> None:
    """With a 9 GB budget and models of 4/4/5 GB, loading the third evicts the least recently used idle one."""
    async with running(make_config({"a": 4, "b": 4, "c": 5}, 9)) as h:
        async with h.manager.lease("a"):
            pass
        await trio.sleep(10)
        async with h.manager.lease("b"):
            pass
        await trio.sleep(10)
        async with h.manager.lease("a"):  # a is now the most recently used
            pass
        async with h.manager.lease("c"):
            assert h.state("b") == "unloaded"
            assert h.state("a") == "loaded"
            assert h.state("c") == "loaded"
        assert ("b", "loaded", "unloading", "evicted") in h.transitions("b")
        assert h.manager.snapshot().committed_bytes == 9 * GIB


async def test_fail_strategy_errors_at_once(autojump_clock: trio.abc.Clock) -> None:
    """Under `fail`, a model that does not fit next to a busy one is refused at once with model_capacity."""
    async with running(make_config({"a": 4, "b": 4}, 6, strategy="fail")) as h:
        held = await h.hold("a")
        t0 = trio.current_time()
        with pytest.raises(ModelCapacity) as exc:
            await h.manager.acquire("b")
        assert trio.current_time() == t0
        assert exc.value.http_status == 503 and exc.value.retry_after is not None
        assert h.state("a") == "loaded" and h.state("b") == "unloaded"
        held.release.set()


async def test_wait_strategy_waits_until_busy_victim_drains(autojump_clock: trio.abc.Clock) -> None:
    """Under `wait`, the request waits (unbounded) until the busy victim's lease ends, then loads."""
    async with running(make_config({"a": 4, "b": 4}, 6, strategy="wait", wait_timeout_s=None)) as h:
        held = await h.hold("a")
        results = Results()
        h.spawn_acquire("b", results)
        await trio.sleep(500)  # far beyond any default timeout
        assert results == []
        assert h.state("a") == "draining"
        t_release = trio.current_time()
        held.release.set()
        await results.wait_for(1)
        assert isinstance(results[0], Lease)
        assert trio.current_time() - t_release == 1  # b's load time
        assert h.transitions("a")[-3:] == [
            ("a", "loaded", "draining", "evicted"),
            ("a", "draining", "unloading", "evicted"),
            ("a", "unloading", "unloaded", "evicted"),
        ]
        assert held.errors == [] and held.lease.outcome is Outcome.COMPLETED
        results[0].release()  # type: ignore[union-attr]


async def test_wait_then_fail_times_out_at_exactly_wait_timeout(autojump_clock: trio.abc.Clock) -> None:
    """Under `wait_then_fail`, the request fails with capacity_timeout at exactly wait_timeout_s, and the victim keeps serving."""
    async with running(make_config({"a": 4, "b": 4}, 6, wait_timeout_s=7)) as h:
        held = await h.hold("a")
        t0 = trio.current_time()
        with pytest.raises(CapacityTimeout):
            await h.manager.acquire("b")
        assert trio.current_time() - t0 == 7
        assert h.state("a") == "loaded"  # the drain was called off
        assert h.transitions("a")[-1] == ("a", "draining", "loaded", "abandoned")
        held.release.set()


async def test_preempt_cancels_the_victims_lease_at_once(autojump_clock: trio.abc.Clock) -> None:
    """Under `preempt`, the victim's lease holder is cancelled at once with Preempted, and the new model loads."""
    async with running(make_config({"a": 4, "b": 4}, 6, strategy="preempt")) as h:
        held = await h.hold("a")
        t0 = trio.current_time()
        async with h.manager.lease("b"):
            assert trio.current_time() - t0 == 1  # only b's load time
        await held.finished.wait()
        assert len(held.errors) == 1 and isinstance(held.errors[0], Preempted)
        assert held.lease.outcome is Outcome.PREEMPTED
        assert ("a", "loaded", "draining", "preempted") in h.transitions("a")
        assert h.manager.counters["preemptions"] == 1


async def test_wait_then_preempt_preempts_at_exactly_preempt_after(autojump_clock: trio.abc.Clock) -> None:
    """Under `wait_then_preempt`, the victim is preempted at exactly preempt_after_s after the waiter arrived."""
    cfg = make_config({"a": 4, "b": 4}, 6, strategy="wait_then_preempt", preempt_after_s=5)
    async with running(cfg) as h:
        held = await h.hold("a")
        t0 = trio.current_time()
        results = Results()
        h.spawn_acquire("b", results)
        await held.finished.wait()
        assert trio.current_time() - t0 == 5
        assert isinstance(held.errors[0], Preempted)
        await results.wait_for(1)
        assert isinstance(results[0], Lease)
        assert h.transitions("a")[-2:] == [
            ("a", "draining", "unloading", "preempted"),
            ("a", "unloading", "unloaded", "preempted"),
        ]
        results[0].release()  # type: ignore[union-attr]


async def test_draining_victim_refuses_new_leases_until_waiter_gives_up(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A draining victim grants no new lease while a waiter needs its room, and grants again once the waiter leaves."""
    async with running(make_config({"a": 4, "b": 4}, 6, strategy="wait", wait_timeout_s=None)) as h:
        held = await h.hold("a")
        b_results = Results()
        b_scope = h.spawn_acquire("b", b_results)
        await trio.sleep(1)
        assert h.state("a") == "draining"
        a_results = Results()
        h.spawn_acquire("a", a_results)
        await trio.sleep(100)
        assert a_results == []  # new traffic to the victim waits
        b_scope.cancel()  # the waiter that needed the room gives up
        await trio.sleep(0.01)
        assert h.state("a") == "loaded"
        assert len(a_results) == 1 and isinstance(a_results[0], Lease)
        assert h.fleet["b"].loads_started == 0
        a_results[0].release()  # type: ignore[union-attr]
        held.release.set()


async def test_last_waiter_leaving_cancels_the_load(autojump_clock: trio.abc.Clock) -> None:
    """When the only waiter of a load leaves, the load is cancelled, the partial engine stopped, the model unloaded (abandoned)."""
    async with running(make_config({"a": 1}, 4, load_seconds=10)) as h:
        results = Results()
        scope = h.spawn_acquire("a", results)
        await trio.sleep(3)
        scope.cancel()
        await trio.sleep(0.01)
        fake = h.fleet["a"]
        assert fake.loads_cancelled == 1 and fake.stops == 1 and fake.resident == 0
        assert h.state("a") == "unloaded"
        assert h.transitions("a")[-1] == ("a", "loading", "unloaded", "abandoned")
        assert h.manager.snapshot().committed_bytes == 0


async def test_one_of_two_waiters_leaving_keeps_the_load(autojump_clock: trio.abc.Clock) -> None:
    """When one of two waiters leaves, the load goes on and the other waiter gets the model."""
    async with running(make_config({"a": 1}, 4, load_seconds=10)) as h:
        first = Results()
        second = Results()
        scope = h.spawn_acquire("a", first)
        h.spawn_acquire("a", second)
        await trio.sleep(3)
        scope.cancel()
        await second.wait_for(1)
        assert first == [] and isinstance(second[0], Lease)
        assert h.fleet["a"].loads_started == 1 and h.fleet["a"].loads_cancelled == 0
        second[0].release()  # type: ignore[union-attr]


async def test_cancelled_leader_leaks_nothing_and_others_get_the_model(
    autojump_clock: trio.abc.Clock,
) -> None:
    """The task whose acquire started a load is cancelled: no reservation leaks and the other waiters still get the model."""
    async with running(make_config({"a": 3, "b": 3}, 6, load_seconds=10)) as h:
        leader = Results()
        others = Results()
        leader_scope = h.spawn_acquire("a", leader)
        await trio.sleep(1)
        h.spawn_acquire("a", others)
        h.spawn_acquire("a", others)
        await trio.testing.wait_all_tasks_blocked()  # both joined the load
        leader_scope.cancel()
        await others.wait_for(2)
        assert all(isinstance(o, Lease) for o in others)
        assert h.fleet["a"].loads_started == 1
        for o in others:
            o.release()  # type: ignore[union-attr]
        assert h.manager.snapshot().committed_bytes == 3 * GIB  # a's residency only, no leaked reservation
        async with h.manager.lease("b"):
            assert h.manager.snapshot().committed_bytes == 6 * GIB


async def test_late_joiner_of_abandoned_load_starts_a_fresh_one(autojump_clock: trio.abc.Clock) -> None:
    """A request arriving while an abandoned load tears down starts a fresh load rather than inheriting the cancellation."""
    fleet = FakeFleet()
    fleet.add(FakeModel("a", GIB, load_seconds=10, unload_seconds=2))
    async with running(make_config({"a": 1}, 4), fleet) as h:
        first = Results()
        scope = h.spawn_acquire("a", first)
        await trio.sleep(3)
        scope.cancel()
        await trio.sleep(0.5)  # the partial engine is still stopping (2 s)
        assert h.state("a") == "loading"
        lease = await h.manager.acquire("a")
        assert isinstance(lease, Lease)
        assert h.fleet["a"].loads_started == 2 and h.fleet["a"].loads_cancelled == 1
        assert [t[1:] for t in h.transitions("a")] == [
            ("unloaded", "loading", "request"),
            ("loading", "unloaded", "abandoned"),
            ("unloaded", "loading", "request"),
            ("loading", "loaded", "request"),
        ]
        lease.release()


async def test_load_failure_gives_failed_and_next_acquire_retries(autojump_clock: trio.abc.Clock) -> None:
    """A failed load leaves the model `failed` with last_error; the next acquire retries and succeeds."""
    fleet = FakeFleet()
    fleet.add(FakeModel("a", GIB, load_seconds=1, fail_loads={1}))
    async with running(make_config({"a": 1}, 4), fleet) as h:
        with pytest.raises(LoadFailed) as exc:
            await h.manager.acquire("a")
        assert exc.value.http_status == 502
        assert h.state("a") == "failed"
        assert "scripted failure of load 1" in (h.manager.model_snapshot("a").last_error or "")
        assert h.manager.snapshot().committed_bytes == 0 and fleet["a"].resident == 0
        async with h.manager.lease("a"):
            assert h.state("a") == "loaded"
        assert h.manager.model_snapshot("a").last_error is None
        assert [t[2] for t in h.transitions("a")] == ["loading", "failed", "loading", "loaded"]


async def test_unload_failure_keeps_bytes_counted_and_retries(autojump_clock: trio.abc.Clock) -> None:
    """A failed stop keeps the model `unloading` with its bytes counted and no lease on it; the stop is retried 1 s later."""
    fleet = FakeFleet()
    fleet.add(FakeModel("a", GIB, load_seconds=1, fail_unloads={1}))
    async with running(make_config({"a": 1}, 4), fleet) as h:
        await h.manager.load("a")
        t0 = trio.current_time()
        with pytest.raises(Exception, match="scripted failure of unload 1"):
            await h.manager.unload("a")
        assert h.state("a") == "unloading"
        assert "unload 1" in (h.manager.model_snapshot("a").last_error or "")
        assert h.manager.snapshot().committed_bytes == GIB and fleet["a"].resident == 1
        lease = await h.manager.acquire("a")  # waits for the retry, then a fresh load
        assert trio.current_time() - t0 == 1 + 1  # retry after 1 s, load 1 s
        assert fleet["a"].stops == 2 and fleet["a"].loads_started == 2
        lease.release()
        assert h.transitions("a")[2:] == [
            ("a", "loaded", "unloading", "admin"),
            ("a", "unloading", "loaded", "unload_failed"),
            ("a", "loaded", "unloading", "unload_failed"),
            ("a", "unloading", "unloaded", "admin"),
            ("a", "unloaded", "loading", "request"),
            ("a", "loading", "loaded", "request"),
        ]


async def test_idle_unload_at_exactly_the_configured_second(autojump_clock: trio.abc.Clock) -> None:
    """A model unloads exactly idle_unload_seconds after its last lease ended, never while a lease is held."""
    async with running(make_config({"a": 1}, 4, idle_unload_seconds=300)) as h:
        held = await h.hold("a")
        await trio.sleep(1000)  # held far longer than the idle period
        assert h.state("a") == "loaded"
        t_release = trio.current_time()
        held.release.set()
        await held.finished.wait()
        await trio.sleep(299.9)
        assert h.state("a") == "loaded"
        await trio.sleep(0.2)
        assert h.state("a") == "unloaded"
        unload_at = next(t for t in h.fleet["a"].log if t[1] == "stop 1 start")[0]
        assert unload_at - t_release == 300
        assert h.transitions("a")[-2] == ("a", "loaded", "unloading", "idle_timeout")


async def test_per_model_idle_override(autojump_clock: trio.abc.Clock) -> None:
    """A model's own idle_unload_seconds overrides the global one (and 0 turns it off)."""
    cfg = make_config({"a": 1, "b": 1}, 4, idle_unload_seconds=100, model_idle={"a": 20, "b": 0})
    async with running(cfg) as h:
        async with h.manager.lease("a"):
            pass
        async with h.manager.lease("b"):
            pass
        await trio.sleep(21)
        assert h.state("a") == "unloaded" and h.state("b") == "loaded"
        await trio.sleep(1000)
        assert h.state("b") == "loaded"


async def test_pinned_models_are_never_evicted(autojump_clock: trio.abc.Clock) -> None:
    """A pinned model is never a victim: the least recently used unpinned one goes instead, and idle unload skips it."""
    cfg = make_config({"p": 4, "a": 2, "b": 3}, 7, pinned=["p"], idle_unload_seconds=5)
    async with running(cfg) as h:
        await h.manager.load("p")  # p is the least recently used from here on
        await trio.sleep(1)
        async with h.manager.lease("a"):
            pass
        async with h.manager.lease("b"):
            assert h.state("p") == "loaded" and h.state("a") == "unloaded"
        await trio.sleep(10_000)
        assert h.state("p") == "loaded" and h.state("b") == "unloaded"
        assert not any(t[0] == "p" and t[2] in ("draining", "unloading") for t in h.transitions())


async def test_pinned_busy_model_is_not_a_victim(autojump_clock: trio.abc.Clock) -> None:
    """With a busy pinned model filling the room, `preempt` does not touch it; the request times out."""
    cfg = make_config({"p": 4, "b": 3}, 6, pinned=["p"], strategy="preempt", wait_timeout_s=10)
    async with running(cfg) as h:
        held = await h.hold("p")
        t0 = trio.current_time()
        with pytest.raises(CapacityTimeout):
            await h.manager.acquire("b")
        assert trio.current_time() - t0 == 10
        assert held.errors == [] and h.state("p") == "loaded"
        held.release.set()


async def test_model_bigger_than_budget_fails_at_once(autojump_clock: trio.abc.Clock) -> None:
    """A model larger than the whole budget fails at once with model_exceeds_budget (400)."""
    async with running(make_config({"huge": 10, "a": 1}, 8)) as h:
        t0 = trio.current_time()
        with pytest.raises(ModelExceedsBudget) as exc:
            await h.manager.acquire("huge")
        assert trio.current_time() == t0 and exc.value.http_status == 400
        assert h.fleet["huge"].loads_started == 0


async def test_unknown_model_is_not_found(autojump_clock: trio.abc.Clock) -> None:
    """Acquiring a model that is not configured raises model_not_found."""
    async with running(make_config({"a": 1}, 4)) as h:
        with pytest.raises(ModelNotFound):
            await h.manager.acquire("nope")


async def test_shutdown_unloads_everything(autojump_clock: trio.abc.Clock) -> None:
    """Shutdown with a live lease, a load in flight and an idle model ends with every model unloaded and the lease preempted."""
    fleet = FakeFleet()
    fleet.add(FakeModel("busy", GIB, load_seconds=1))
    fleet.add(FakeModel("idle", GIB, load_seconds=1))
    fleet.add(FakeModel("slow", GIB, load_seconds=100))
    cfg = make_config({"busy": 1, "idle": 1, "slow": 1}, 8)
    async with running(cfg, fleet) as h:
        held = await h.hold("busy")
        await h.manager.load("idle")
        slow = Results()
        h.spawn_acquire("slow", slow)
        await trio.sleep(2)
        assert h.state("slow") == "loading"
        t0 = trio.current_time()
        await h.manager.shutdown(grace_s=5)
        assert trio.current_time() - t0 == 5
        for name in ("busy", "idle", "slow"):
            assert h.state(name) == "unloaded", name
            assert fleet[name].resident == 0
        assert isinstance(slow[0], ShuttingDown)
        await held.finished.wait()
        assert isinstance(held.errors[0], ShuttingDown)
        assert held.lease.outcome is Outcome.SHUTDOWN
        assert h.transitions("slow")[-1] == ("slow", "loading", "unloaded", "shutdown")
        assert h.transitions("busy")[-1] == ("busy", "unloading", "unloaded", "shutdown")
        with pytest.raises(ShuttingDown):
            await h.manager.acquire("idle")


async def test_shutdown_lets_leases_finish_within_grace(autojump_clock: trio.abc.Clock) -> None:
    """A lease that ends within the shutdown grace completes normally and shutdown returns right after."""
    async with running(make_config({"a": 1}, 4)) as h:
        held = await h.hold("a")

        async def finish_soon() -> None:
            await trio.sleep(2)
            held.release.set()

        h.nursery.start_soon(finish_soon)
        t0 = trio.current_time()
        await h.manager.shutdown(grace_s=10)
        assert trio.current_time() - t0 == 2
        assert held.lease.outcome is Outcome.COMPLETED


async def test_admin_load_survives_its_caller_leaving(autojump_clock: trio.abc.Clock) -> None:
    """An admin load counts as a waiter that never leaves: cancelling the caller does not abandon the load."""
    async with running(make_config({"a": 1}, 4, load_seconds=10)) as h:
        with trio.move_on_after(2):
            await h.manager.load("a")
        await trio.sleep(9)
        assert h.state("a") == "loaded"
        assert h.transitions("a")[0] == ("a", "unloaded", "loading", "admin")


async def test_admin_unload_of_busy_model_drains_or_preempts(autojump_clock: trio.abc.Clock) -> None:
    """Admin unload of a busy model waits for its lease to end; with preempt=True it stops the lease at once."""
    async with running(make_config({"a": 1}, 4)) as h:
        held = await h.hold("a")

        async def release_later() -> None:
            await trio.sleep(4)
            held.release.set()

        h.nursery.start_soon(release_later)
        t0 = trio.current_time()
        await h.manager.unload("a")
        assert trio.current_time() - t0 == 4
        assert held.lease.outcome is Outcome.COMPLETED
        held2 = await h.hold("a")
        t0 = trio.current_time()
        await h.manager.unload("a", preempt=True)
        assert trio.current_time() == t0
        await held2.finished.wait()
        assert isinstance(held2.errors[0], Preempted)
        assert h.transitions("a")[-2:] == [
            ("a", "draining", "unloading", "admin"),
            ("a", "unloading", "unloaded", "admin"),
        ]


async def test_admin_unload_of_loading_model_is_a_conflict(autojump_clock: trio.abc.Clock) -> None:
    """Unloading a model while it loads is refused with 409 and changes nothing."""
    async with running(make_config({"a": 1}, 4, load_seconds=5)) as h:
        results = Results()
        h.spawn_acquire("a", results)
        await trio.sleep(1)
        with pytest.raises(Conflict):
            await h.manager.unload("a")
        await results.wait_for(1)
        assert isinstance(results[0], Lease)
        results[0].release()  # type: ignore[union-attr]


async def test_reload_adds_and_removes_dormant_models_only(autojump_clock: trio.abc.Clock) -> None:
    """A config reload adds and removes dormant models; removing or resizing a live one is a 409 that changes nothing."""
    async with running(make_config({"a": 1, "b": 1}, 4)) as h:
        await h.manager.load("a")
        with pytest.raises(Conflict):
            await h.manager.reload(make_config({"b": 1}, 4))
        with pytest.raises(Conflict):
            await h.manager.reload(make_config({"a": 2, "b": 1}, 4))
        assert set(h.manager.model_names()) == {"a", "b"}
        report = await h.manager.reload(make_config({"a": 1, "c": 2}, 4))
        assert report["added"] == ["c"] and report["removed"] == ["b"]
        assert set(h.manager.model_names()) == {"a", "c"}
        async with h.manager.lease("c"):
            assert h.state("c") == "loaded"


async def test_load_gate_refuses_new_loads_but_serves_resident_models(
    autojump_clock: trio.abc.Clock,
) -> None:
    """While the load gate is closed (journal cannot write), resident models serve and new loads get a typed 503."""
    from mlxd.errors import JournalError

    async with running(make_config({"a": 1, "b": 1}, 4)) as h:
        await h.manager.load("a")
        h.manager.set_load_gate("the journal cannot write: disk full")
        async with h.manager.lease("a"):
            pass
        with pytest.raises(JournalError) as exc:
            await h.manager.acquire("b")
        assert exc.value.http_status == 503 and "disk full" in exc.value.message
        h.manager.set_load_gate(None)
        async with h.manager.lease("b"):
            pass


async def test_fifo_room_is_kept_for_the_earlier_waiter(autojump_clock: trio.abc.Clock) -> None:
    """Room freed for a waiting model goes to it, not to a later request for a smaller model."""
    cfg = make_config({"a": 4, "b": 4, "c": 1}, 6, strategy="wait", wait_timeout_s=None)
    async with running(cfg) as h:
        held = await h.hold("a")
        b_res = Results()
        h.spawn_acquire("b", b_res)
        await trio.sleep(1)
        c_res = Results()
        h.spawn_acquire("c", c_res)  # c (1 GB) would fit in the 2 GB left, but b came first
        await trio.sleep(1)
        assert c_res == [] and h.state("c") == "unloaded"
        held.release.set()
        await b_res.wait_for(1)
        await c_res.wait_for(1)
        b_lease, c_lease = b_res[0], c_res[0]
        assert isinstance(b_lease, Lease) and isinstance(c_lease, Lease)
        b_loaded = next(t for t in h.fleet["b"].log if t[1] == "load 1 done")[0]
        c_loaded = next(t for t in h.fleet["c"].log if t[1] == "load 1 done")[0]
        assert b_loaded <= c_loaded
        b_lease.release()
        c_lease.release()


async def test_wait_checks_committed_never_exceeds_budget(autojump_clock: trio.abc.Clock) -> None:
    """Under a burst of requests for many models the committed bytes never exceed the budget."""
    cfg = make_config({f"m{i}": 1 + i % 3 for i in range(8)}, 6, strategy="wait", wait_timeout_s=None)
    async with running(cfg) as h:
        # Recorded, not asserted, in the subscriber: the manager logs and swallows
        # a subscriber's exceptions, so an assert there could never fail the test.
        committed: list[int] = []
        h.manager.subscribe(lambda _event: committed.append(h.manager.snapshot().committed_bytes))

        async def user(i: int) -> None:
            for k in range(5):
                async with h.manager.lease(f"m{(i + k) % 8}") as lease:
                    with lease.scope():
                        await trio.sleep(0.5 + (i % 3))

        async with trio.open_nursery() as n:
            for i in range(12):
                n.start_soon(user, i)
        await trio.testing.wait_all_tasks_blocked()
        assert len(committed) > 100  # every transition and lease event was watched
        assert 0 < max(committed) <= 6 * GIB == h.manager.snapshot().budget_bytes


async def test_lease_ids_are_unique_and_time_ordered(autojump_clock: trio.abc.Clock) -> None:
    """Lease ids are 32 hex digits that increase, so the journal's leases key grows at its end."""
    async with running(make_config({"a": 1}, 4)) as h:
        ids = []
        for _ in range(200):
            lease = await h.manager.acquire("a")
            ids.append(lease.id)
            lease.release()
        assert all(re.fullmatch("[0-9a-f]{32}", i) for i in ids), ids[:3]
        assert ids == sorted(ids) and len(set(ids)) == len(ids)


async def test_admin_unload_returns_even_if_the_model_is_reloaded_at_once(
    autojump_clock: trio.abc.Clock,
) -> None:
    """An admin unload returns once the model was unloaded, even when a queued request loads it again in the same instant."""
    async with running(make_config({"a": 1}, 4)) as h:
        held = await h.hold("a")
        unloaded = trio.Event()

        async def unload() -> None:
            await h.manager.unload("a")
            unloaded.set()

        h.nursery.start_soon(unload)
        await trio.testing.wait_all_tasks_blocked()
        queued = Results()
        h.spawn_acquire("a", queued)  # waits: a is draining
        await trio.testing.wait_all_tasks_blocked()
        held.release.set()
        with trio.fail_after(60):
            await unloaded.wait()
            await queued.wait_for(1)
        assert isinstance(queued[0], Lease)
        assert [t[2] for t in h.transitions("a")][-4:] == ["unloading", "unloaded", "loading", "loaded"]
        queued[0].release()  # type: ignore[union-attr]

