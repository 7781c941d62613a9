"""Residency policy beyond the anchors, in virtual time with fake engines: priorities,
keep_alive and its cap, X-Mlxd-Contention, cost eviction, anti-thrash, the plan."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from mlxd.errors import CapacityTimeout, ModelCapacity, Preempted
from mlxd.http.bodies_admin import plan_body
from mlxd.residency.core import Core
from mlxd.residency.lease import Lease
from mlxd.residency.messages import (
    Acquire,
    AdminUnload,
    LoadFinished,
    ModelSpec,
    Reconfigure,
    Release,
    StartLoad,
    StartUnload,
    Tick,
    UnloadFinished,
)
from mlxd.residency.plan import Plan
from mlxd.residency.policy import ContentionPolicy, ResidencyRules
from mlxd.residency.registry import Registry
from mlxd.residency.states import Outcome, State
from mlxd.units import GIB
from tests.support.harness import Harness, Results, make_config, running

# ---- priorities -----------------------------------------------------------------------------


async def test_higher_priority_preempts_a_lower_priority_stream(autojump_clock: trio.abc.Clock) -> None:
    """Under `preempt`, a waiter of higher priority preempts a lower-priority model's stream at once."""
    cfg = make_config({"low": 4, "high": 4}, 6, strategy="preempt", priorities={"high": 5})
    async with running(cfg) as h:
        held = await h.hold("low")
        t0 = trio.current_time()
        async with h.manager.lease("high"):
            assert trio.current_time() - t0 == 1.0  # high's load only
        await held.finished.wait()
        assert len(held.errors) == 1 and isinstance(held.errors[0], Preempted)
        assert held.lease.outcome is Outcome.PREEMPTED
        assert ("low", "loaded", "draining", "preempted") in h.transitions("low")


async def test_lower_priority_never_preempts_a_higher_priority_stream(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Under `preempt`, a waiter of lower priority neither preempts nor drains a busy higher-priority model: it times out."""
    cfg = make_config({"low": 4, "high": 4}, 6, strategy="preempt", wait_timeout_s=5,
                      priorities={"high": 5})
    async with running(cfg) as h:
        held = await h.hold("high")
        t0 = trio.current_time()
        with pytest.raises(CapacityTimeout):
            await h.manager.acquire("low")
        assert trio.current_time() - t0 == 5
        assert held.errors == [] and not held.lease.preempted
        assert h.transitions("high") == [
            ("high", "unloaded", "loading", "request"),
            ("high", "loading", "loaded", "request"),
        ]
        held.release.set()


async def test_higher_priority_waiter_is_served_first(autojump_clock: trio.abc.Clock) -> None:
    """When room frees up, a later waiter of higher priority loads before an earlier one of lower priority."""
    cfg = make_config({"busy": 4, "low": 4, "high": 4}, 6, strategy="wait", wait_timeout_s=None,
                      priorities={"high": 5, "busy": 5})
    async with running(cfg) as h:
        held = await h.hold("busy")
        low, high = Results(), Results()
        h.spawn_acquire("low", low)
        await trio.sleep(1)
        h.spawn_acquire("high", high)
        await trio.sleep(1)
        held.release.set()
        await high.wait_for(1)
        assert isinstance(high[0], Lease) and low == []
        assert h.state("low") == "unloaded"
        high[0].release()
        await low.wait_for(1)
        assert isinstance(low[0], Lease)
        low[0].release()


# ---- keep_alive and X-Mlxd-Contention -------------------------------------------------------


async def test_keep_alive_zero_unloads_when_the_lease_ends(autojump_clock: trio.abc.Clock) -> None:
    """A request with keep_alive 0 unloads its model as its lease ends (reason idle_timeout), even with idle unload off."""
    async with running(make_config({"a": 1}, 4)) as h:
        lease = await h.manager.acquire("a", keep_alive_s=0)
        await trio.sleep(3)
        assert h.state("a") == "loaded"
        t_release = trio.current_time()
        lease.release()
        await trio.testing.wait_all_tasks_blocked()
        assert trio.current_time() == t_release
        assert h.state("a") == "unloaded"
        assert h.transitions("a")[-2:] == [
            ("a", "loaded", "unloading", "idle_timeout"),
            ("a", "unloading", "unloaded", "idle_timeout"),
        ]


async def test_keep_alive_over_the_cap_is_clamped(autojump_clock: trio.abc.Clock) -> None:
    """keep_alive 1 h (or -1, until evicted) under max_keep_alive_s 60 unloads 60 s after the lease ends."""
    rules = ResidencyRules(max_keep_alive_s=60)
    async with running(make_config({"a": 1, "b": 1}, 4, rules=rules)) as h:
        for model, asked in (("a", 3600.0), ("b", -1.0)):
            lease = await h.manager.acquire(model, keep_alive_s=asked)
            t_release = trio.current_time()
            lease.release()
            await h.until_state(model, "unloaded")
            assert trio.current_time() - t_release == 60
            assert h.transitions(model)[-1] == (model, "unloading", "unloaded", "idle_timeout")


async def test_keep_alive_of_the_last_lease_decides(autojump_clock: trio.abc.Clock) -> None:
    """The last lease to end sets the idle time: keep_alive 5 s after a model default of 100 s, then back to 100 s."""
    async with running(make_config({"a": 1}, 4, idle_unload_seconds=100)) as h:
        (await h.manager.acquire("a", keep_alive_s=5)).release()
        t0 = trio.current_time()
        await h.until_state("a", "unloaded")
        assert trio.current_time() - t0 == 5
        (await h.manager.acquire("a")).release()
        t1 = trio.current_time()
        await h.until_state("a", "unloaded")
        assert trio.current_time() - t1 == 100


async def test_contention_fail_fails_fast_under_a_waiting_policy(autojump_clock: trio.abc.Clock) -> None:
    """X-Mlxd-Contention: fail gets model_capacity at once where the model's policy would wait."""
    cfg = make_config({"a": 4, "b": 4}, 6, strategy="wait", wait_timeout_s=None)
    async with running(cfg) as h:
        held = await h.hold("a")
        t0 = trio.current_time()
        with pytest.raises(ModelCapacity):
            await h.manager.acquire("b", contention=ContentionPolicy.of("fail"))
        assert trio.current_time() == t0 and h.state("a") == "loaded"
        held.release.set()


def test_contention_fail_evicts_idle_rather_than_wait_for_a_drain() -> None:
    """A request that asked for `fail` under a waiting policy never counts on a drain: it evicts the idle model."""
    core = Core(Registry([ModelSpec(n, 3 * GIB) for n in "abd"], 8 * GIB, ContentionPolicy.of("wait")))
    core.step(Acquire(1, "a", "L1", 0.0))
    core.step(LoadFinished("a", 1, 0.5))
    core.step(Acquire(2, "b", "L2", 1.0))
    core.step(LoadFinished("b", 2, 1.5))
    core.step(Release("L2", 2.0))
    core.step(AdminUnload("a", 2.5))  # a drains (its lease L1 is live); b is idle
    out = core.step(Acquire(4, "d", "L4", 3.0, contention=ContentionPolicy.of("fail")))
    assert core.state("b") is State.UNLOADING and StartUnload("b") in out
    assert core.models["d"].claims == []  # it claimed b's bytes, not a's drain


def test_a_waiter_keeps_its_drain_when_a_reload_switches_the_policy_to_fail() -> None:
    """A waiter queued under `wait` keeps waiting for the drain it started after a reload makes
    the manager's policy `fail`: the drain is not called off and restarted on every event
    (found by the state machine: each pass drained `a` and called the drain off again)."""
    specs = (ModelSpec("a", 4 * GIB), ModelSpec("b", 4 * GIB))
    core = Core(Registry(list(specs), 6 * GIB, ContentionPolicy.of("wait", wait_timeout_s=None)))
    core.step(Acquire(1, "a", "L1", 0.0))
    core.step(LoadFinished("a", 1, 0.5))
    core.step(Acquire(2, "b", "L2", 1.0))
    assert core.state("a") is State.DRAINING
    assert core.step(Reconfigure(specs, 6 * GIB, ContentionPolicy.of("fail"), 2.0)) == []
    assert core.step(Tick(3.0)) == [] and core.state("a") is State.DRAINING
    assert core.models["b"].claims == ["a"]
    assert StartUnload("a") in core.step(Release("L1", 4.0))
    assert StartLoad("b", 2) in core.step(UnloadFinished("a", 5.0))


async def test_a_request_cannot_ask_for_more_preemption(autojump_clock: trio.abc.Clock) -> None:
    """X-Mlxd-Contention: preempt under a `wait_then_fail` policy does not preempt: the request times out."""
    cfg = make_config({"a": 4, "b": 4}, 6, strategy="wait_then_fail", wait_timeout_s=5)
    async with running(cfg) as h:
        held = await h.hold("a")
        with pytest.raises(CapacityTimeout):
            await h.manager.acquire("b", contention=ContentionPolicy.of("preempt"))
        assert held.errors == [] and not held.lease.preempted
        held.release.set()


# ---- cost eviction and min_resident_s --------------------------------------------------------


def plan_of(h: Harness, model: str, contention: ContentionPolicy | None = None) -> Plan:
    """What acquiring ``model`` now would do (the plan /admin/plan shows)."""
    return h.manager.plan(model, contention=contention)


async def _use(h: Harness, *models: str) -> None:
    for model in models:
        async with h.manager.lease(model):
            await trio.sleep(1)


@pytest.mark.parametrize(("eviction", "victim"), [("lru", "slow"), ("cost", "quick")])
async def test_cost_evicts_the_cheap_to_reload_victim(
    autojump_clock: trio.abc.Clock, eviction: str, victim: str
) -> None:
    """`cost` evicts the idle model with the fewest measured reload seconds per byte; `lru` the least recently used."""
    cfg = make_config({"slow": 4, "quick": 4, "c": 4}, 9, model_load_seconds={"slow": 8, "quick": 1},
                      rules=ResidencyRules(eviction=eviction))  # type: ignore[arg-type]
    async with running(cfg) as h:
        await _use(h, "slow", "quick")  # slow is the least recently used
        plan = plan_of(h, "c")
        assert plan.action == "evict_then_load"
        assert [(v.model, v.why) for v in plan.victims] == [(victim, f"idle_{eviction}")]
        await _use(h, "c")
        assert h.state(victim) == "unloaded"
        assert {"slow", "quick"} - {victim} == {m for m in ("slow", "quick") if h.state(m) == "loaded"}


async def test_min_resident_protects_a_fresh_model_from_idle_eviction(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A model loaded less than min_resident_s ago is not an idle victim: the waiter loads when the protection ends."""
    cfg = make_config({"a": 4, "b": 4}, 6, rules=ResidencyRules(min_resident_s=10))
    async with running(cfg) as h:
        await _use(h, "a")  # loaded at t=1 (1 s load), used until t=2
        assert plan_of(h, "b").action == "wait"
        t0 = trio.current_time()
        async with h.manager.lease("b"):
            # a loaded at t0 - 1, so protected for 9 s more; then b's 1 s load
            assert trio.current_time() - t0 == 9 + 1
        assert ("a", "loaded", "unloading", "evicted") in h.transitions("a")


# ---- anti-thrash: max_swap_delay_s -----------------------------------------------------------


async def _alternate(h: Harness, seconds: float) -> tuple[int, float]:
    """Two clients, one per model, each sending back-to-back 0.3 s requests; (swaps, longest wait)."""
    waits: list[float] = []
    end = trio.current_time() + seconds

    async def client(model: str, start: float) -> None:
        await trio.sleep(start)
        while trio.current_time() < end:
            t0 = trio.current_time()
            async with h.manager.lease(model) as lease:
                waits.append(trio.current_time() - t0)
                with lease.scope():
                    await trio.sleep(0.3)

    async with trio.open_nursery() as n:
        n.start_soon(client, "a", 0.0)
        n.start_soon(client, "b", 0.1)
    return h.fleet["a"].loads_started + h.fleet["b"].loads_started - 1, max(waits)


async def test_max_swap_delay_groups_alternating_traffic(autojump_clock: trio.abc.Clock) -> None:
    """A/B traffic under a budget for one model: max_swap_delay_s 2 swaps at most half as often, and no request waits more than 2 s plus one load longer."""
    results = {}
    for delay in (0.0, 2.0):
        cfg = make_config({"a": 4, "b": 4}, 6, strategy="wait", wait_timeout_s=None,
                          rules=ResidencyRules(max_swap_delay_s=delay))
        async with running(cfg) as h:
            results[delay] = await _alternate(h, 60.0)
    (swaps_without, wait_without), (swaps_with, wait_with) = results[0.0], results[2.0]
    assert swaps_with * 2 <= swaps_without, results
    assert wait_with <= wait_without + 2.0 + 1.0, results  # delay + one (1 s) load


async def test_swap_delay_lets_the_resident_model_serve_before_the_swap(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Within max_swap_delay_s a busy resident model keeps granting new requests; then it drains and the waiter loads."""
    cfg = make_config({"a": 4, "b": 4}, 6, strategy="wait", wait_timeout_s=None,
                      rules=ResidencyRules(max_swap_delay_s=3))
    async with running(cfg) as h:
        held = await h.hold("a")
        b = Results()
        t0 = trio.current_time()
        h.spawn_acquire("b", b)
        await trio.sleep(2.5)
        async with h.manager.lease("a"):  # still granted at once: the swap waits
            assert h.state("a") == "loaded"
        await trio.sleep_until(t0 + 3)
        await trio.testing.wait_all_tasks_blocked()
        assert h.state("a") == "draining"  # 3 s after b came
        assert plan_of(h, "a").action == "wait"
        held.release.set()
        await b.wait_for(1)
        assert isinstance(b[0], Lease)
        assert trio.current_time() - t0 == 3 + 1
        b[0].release()


# ---- the plan --------------------------------------------------------------------------------


async def test_plan_names_the_victims_and_changes_nothing(autojump_clock: trio.abc.Clock) -> None:
    """The plan of a model that needs a busy model's room says drain_then_load with that victim, and nothing moves."""
    cfg = make_config({"a": 4, "b": 4, "c": 1}, 6, strategy="wait", wait_timeout_s=None)
    async with running(cfg) as h:
        assert plan_body(plan_of(h, "c")) == {
            "model": "c", "action": "load", "victims": [], "error": None,
            "committed_after": 1 * GIB, "eta_s": None,
        }
        held = await h.hold("a")
        events = len(h.events)
        p = plan_body(plan_of(h, "b"))
        assert p["action"] == "drain_then_load"
        assert p["victims"] == [{"model": "a", "state": "loaded", "bytes": 4 * GIB, "why": "drain"}]
        assert p["committed_after"] == 4 * GIB and p["eta_s"] is None
        assert len(h.events) == events and h.state("a") == "loaded"
        assert plan_of(h, "a").action == "ready"
        failing = plan_body(plan_of(h, "b", contention=ContentionPolicy.of("fail")))
        assert failing["action"] == "fail" and failing["error"]["code"] == "model_capacity"
        held.release.set()


# ---- victims: only as many as the room needs -------------------------------------------------


async def test_an_early_victim_made_unnecessary_by_a_later_one_stays(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Issue 32's demo case: idle models of 0.04, 0.26 and 0.32 GB fill 0.63 GB; loading another 0.32 GB model evicts only the 0.32 GB one, whose room alone suffices, though the two smaller ones are less recently used."""
    async with running(make_config({"tiny": 0.04, "small": 0.26, "a": 0.32, "b": 0.32}, 0.63)) as h:
        await _use(h, "tiny", "small", "a")
        plan = plan_of(h, "b")
        assert [(v.model, v.why) for v in plan.victims] == [("a", "idle_lru")]
        await _use(h, "b")
        assert [m for m in ("tiny", "small", "a", "b") if h.state(m) == "loaded"] == ["tiny", "small", "b"]
        assert h.transitions("tiny")[-1][2] == "loaded" and h.transitions("small")[-1][2] == "loaded"


async def test_victims_are_taken_in_lru_order_until_the_room_suffices(
    autojump_clock: trio.abc.Clock,
) -> None:
    """When two victims are needed, the least recently used ones go, and the most recently used stays."""
    async with running(make_config({"x": 2, "y": 2, "z": 2, "w": 4}, 6)) as h:
        await _use(h, "x", "y", "z")
        assert [v.model for v in plan_of(h, "w").victims] == ["x", "y"]
        await _use(h, "w")
        assert [m for m in ("x", "y", "z", "w") if h.state(m) == "loaded"] == ["z", "w"]


async def test_a_busy_victim_that_makes_the_room_alone_spares_the_idle_one(
    autojump_clock: trio.abc.Clock,
) -> None:
    """When a busy model must drain anyway and its room suffices alone, the idle model looked at first is not evicted for nothing."""
    async with running(make_config({"idle": 1, "busy": 4, "w": 4}, 5)) as h:
        await _use(h, "idle")
        held = await h.hold("busy")
        assert [(v.model, v.why) for v in plan_of(h, "w").victims] == [("busy", "drain")]
        held.release.set()
        await _use(h, "w")
        assert h.state("idle") == "loaded" and h.state("busy") == "unloaded"
