"""An engine that dies on its own (a killed worker process), with fake engines in virtual time.

The model goes ``failed`` with reason ``engine_died`` from ``loaded`` or
``draining``; its leases end with ``error`` (their holders get EngineDied);
the next request loads it again; a waiter that needed its room gets it.
"""

from __future__ import annotations

import pytest
import trio

from mlxd.engines.base import GenerationRequest
from mlxd.engines.fake import FakeEngine
from mlxd.errors import EngineDied, LoadFailed
from mlxd.residency import views
from mlxd.residency.core import Core
from mlxd.residency.events import LeaseReleased
from mlxd.residency.lease import Lease
from mlxd.residency.messages import Acquire, LoadFinished, ModelSpec, StartLoad
from mlxd.residency.policy import ContentionPolicy
from mlxd.residency.registry import Registry
from mlxd.residency.states import Outcome, Reason, State, is_legal
from tests.support.harness import Harness, Results, make_config, running

REQUEST = GenerationRequest(kind="completion", prompt="hi", max_tokens=1000)


def current(h: Harness, model: str) -> FakeEngine:
    engine = h.fleet[model].current
    assert engine is not None
    return engine


async def stream(
    h: Harness, model: str, got: list[object], started: trio.Event, ended: trio.Event | None = None
) -> None:
    """A request: lease, generate until the end or an error, release (as the HTTP routes do)."""
    try:
        async with h.manager.lease(model) as lease:
            with lease.scope():
                async for ev in lease.engine.generate(REQUEST):
                    got.append(ev)
                    started.set()
    except EngineDied as e:
        got.append(e)
    finally:
        if ended is not None:
            ended.set()


def outcomes(h: Harness, model: str) -> list[Outcome]:
    return [e.outcome for e in h.events if isinstance(e, LeaseReleased) and e.model == model]


async def test_a_dead_engine_fails_its_stream_and_the_model_and_the_next_request_reloads(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with running(make_config({"a": 1, "b": 1}, 4)) as h:
        other = await h.hold("b")
        got: list[object] = []
        started, ended = trio.Event(), trio.Event()
        h.nursery.start_soon(stream, h, "a", got, started, ended)
        await started.wait()
        current(h, "a").die()
        await ended.wait()
        assert isinstance(got[-1], EngineDied)
        assert h.state("a") == "failed"
        assert h.transitions("a")[-1] == ("a", "loaded", "failed", "engine_died")
        assert outcomes(h, "a") == [Outcome.ERROR]
        assert h.manager.model_snapshot("a").running == 0
        assert views.dead_engines(h.manager, h.manager.snapshot()) == [
            "the engine of 'a' died (the engine process killed by SIGKILL); "
            "the next request loads it again"
        ]
        assert h.fleet["a"].resident == 0
        # the other model never noticed
        assert h.state("b") == "loaded" and other.errors == []
        async with h.manager.lease("a") as lease:
            assert lease.engine is not None and h.state("a") == "loaded"
        assert h.fleet["a"].loads_started == 2
        assert views.dead_engines(h.manager, h.manager.snapshot()) == []
        assert h.manager.stats["a"].transitions[State.FAILED, Reason.ENGINE_DIED] == 1
        other.release.set()


async def test_a_draining_victim_that_dies_gives_its_room_to_the_waiter(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with running(make_config({"a": 4, "b": 4}, 6, strategy="wait", wait_timeout_s=None)) as h:
        got: list[object] = []
        started = trio.Event()
        h.nursery.start_soon(stream, h, "a", got, started)
        await started.wait()
        results = Results()
        h.spawn_acquire("b", results)
        await trio.sleep(1)
        assert h.state("a") == "draining"
        current(h, "a").die()
        await results.wait_for(1)
        assert isinstance(results[0], Lease)
        assert ("a", "draining", "failed", "engine_died") in h.transitions("a")
        assert isinstance(got[-1], EngineDied)
        results[0].release()


async def test_a_model_being_unloaded_by_an_admin_that_dies_ends_unloaded(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with running(make_config({"a": 1}, 4)) as h:
        got: list[object] = []
        started = trio.Event()
        h.nursery.start_soon(stream, h, "a", got, started)
        await started.wait()
        async with trio.open_nursery() as n:
            n.start_soon(h.manager.unload, "a")
            await trio.sleep(1)
            assert h.state("a") == "draining"
            current(h, "a").die()
        assert h.transitions("a")[-2:] == [
            ("a", "draining", "failed", "engine_died"),
            ("a", "failed", "unloaded", "admin"),
        ]
        assert all(is_legal(f, t, r) for _, f, t, r in h.transitions())


async def test_a_stopping_engine_is_not_reported_dead(autojump_clock: trio.abc.Clock) -> None:
    """Unloading ends the watch: an engine that then dies is just stopped."""
    async with running(make_config({"a": 1}, 4)) as h:
        await h.manager.load("a")
        engine = current(h, "a")
        await h.manager.unload("a")
        engine.die()
        await trio.sleep(1)
        assert h.state("a") == "unloaded"
        assert "engine_died" not in [t[3] for t in h.transitions("a")]


def test_a_process_that_dies_while_loading_fails_the_load_with_engine_died() -> None:
    core = Core(Registry([ModelSpec("a", 10)], 100, ContentionPolicy()))
    out = core.step(Acquire(1, "a", "l1", 0.0))
    load = next(c for c in out if isinstance(c, StartLoad))
    out = core.step(LoadFinished("a", load.load_id, 1.0, error="rank 1 killed by SIGKILL", died=True))
    assert core.state("a").value == "failed"
    transition = next(c for c in out if hasattr(c, "reason"))
    assert transition.reason.value == "engine_died"
    rejected = [c for c in out if hasattr(c, "error") and isinstance(c.error, LoadFailed)]
    assert len(rejected) == 1


@pytest.mark.parametrize("state", ["unloaded", "loading", "unloading", "failed"])
def test_a_death_outside_loaded_or_draining_changes_nothing(state: str) -> None:
    from mlxd.residency.messages import EngineDeath as Died
    from mlxd.residency.states import State

    core = Core(Registry([ModelSpec("a", 10)], 100, ContentionPolicy()))
    core.models["a"].state = State(state)
    assert core.step(Died("a", 1.0, "killed")) == []
    assert core.state("a") is State(state)
