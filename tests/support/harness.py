"""Helpers to run a real Manager with fake engines under Trio's virtual clock."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import trio

from mlxd.config import (
    Config,
    ContentionPolicy,
    FakeSettings,
    ManagerConfig,
    ModelConfig,
)
from mlxd.engines.fake import FakeFleet
from mlxd.errors import MlxdError
from mlxd.residency.events import TransitionEvent
from mlxd.residency.lease import Lease
from mlxd.residency.manager import Manager
from mlxd.residency.policy import ResidencyRules
from mlxd.units import GIB


def make_config(
    sizes: dict[str, float],
    budget_gb: float,
    *,
    strategy: str = "wait_then_fail",
    wait_timeout_s: float | None = 30.0,
    preempt_after_s: float | None = None,
    pinned: Iterable[str] = (),
    idle_unload_seconds: float = 0.0,
    model_idle: dict[str, float] | None = None,
    load_seconds: float = 1.0,
    tokens_per_second: float = 10.0,
    stop_timeout_s: float = 60.0,
    priorities: dict[str, int] | None = None,
    rules: ResidencyRules | None = None,
    model_load_seconds: dict[str, float] | None = None,
) -> Config:
    """A config of fake models with the given sizes in GB."""
    model_idle = model_idle or {}
    priorities = priorities or {}
    model_load_seconds = model_load_seconds or {}
    pinned = set(pinned)
    models = tuple(
        ModelConfig(
            name=name,
            source=f"fake/{name}",
            engine="fake",
            estimated_memory_bytes=int(gb * GIB),
            pin=name in pinned,
            idle_unload_seconds=model_idle.get(name),
            priority=priorities.get(name, 0),
            fake=FakeSettings(
                load_seconds=model_load_seconds.get(name, load_seconds),
                tokens_per_second=tokens_per_second,
            ),
        )
        for name, gb in sizes.items()
    )
    return Config(
        manager=ManagerConfig(
            memory_budget_bytes=int(budget_gb * GIB),
            idle_unload_seconds=idle_unload_seconds,
            contention_policy=ContentionPolicy(strategy, wait_timeout_s, preempt_after_s),  # type: ignore[arg-type]
            stop_timeout_s=stop_timeout_s,
            rules=rules or ResidencyRules(),
        ),
        models=models,
    )


class Results(list[object]):
    """What background acquires produced (leases or errors), awaitable by count."""

    def __init__(self) -> None:
        super().__init__()
        self._changed = trio.Event()

    def append(self, item: object) -> None:
        super().append(item)
        self._changed.set()
        self._changed = trio.Event()

    async def wait_for(self, n: int = 1) -> None:
        while len(self) < n:
            await self._changed.wait()


@dataclass
class Held:
    """A lease held by a background task until ``release`` is set."""

    lease: Lease
    release: trio.Event
    errors: list[BaseException] = field(default_factory=list)
    finished: trio.Event = field(default_factory=trio.Event)


@dataclass
class Harness:
    manager: Manager
    fleet: FakeFleet
    #: every event the manager told its subscribers, awaitable by count
    events: Results
    nursery: trio.Nursery

    def transitions(self, model: str | None = None) -> list[tuple[str, str, str, str]]:
        return [
            (e.model, e.from_state.value, e.to_state.value, e.reason.value)
            for e in self.events
            if isinstance(e, TransitionEvent) and (model is None or e.model == model)
        ]

    def state(self, model: str) -> str:
        return self.manager.state_of(model).value

    async def until_state(self, model: str, state: str) -> None:
        """Wait, event by event of the manager, until ``model`` is in ``state``."""
        while self.state(model) != state:
            await self.events.wait_for(len(self.events) + 1)

    async def hold(self, model: str) -> Held:
        """Acquire ``model`` in a background task and hold the lease inside its scope."""

        async def holder(task_status: trio.TaskStatus[Held] = trio.TASK_STATUS_IGNORED) -> None:
            release = trio.Event()
            held: Held | None = None
            try:
                async with self.manager.lease(model, request_id=f"hold-{model}") as lease:
                    held = Held(lease, release)
                    task_status.started(held)
                    with lease.scope():
                        await release.wait()
            except MlxdError as e:
                if held is None:
                    raise
                held.errors.append(e)
            finally:
                if held is not None:
                    held.finished.set()

        return await self.nursery.start(holder)

    def spawn_acquire(self, model: str, results: Results) -> trio.CancelScope:
        """Start an acquire in the background; append the lease or error; return its scope."""
        scope = trio.CancelScope()

        async def waiter() -> None:
            with scope:
                try:
                    lease = await self.manager.acquire(model)
                except MlxdError as e:
                    results.append(e)
                    return
                results.append(lease)

        self.nursery.start_soon(waiter)
        return scope


@asynccontextmanager
async def running(config: Config, fleet: FakeFleet | None = None) -> AsyncIterator[Harness]:
    fleet = fleet or FakeFleet()
    for model in config.models:
        fleet.for_config(model)  # every fake exists (with zeroed counters) from the start
    manager = Manager(config, fleet)
    events = Results()
    manager.subscribe(events.append)
    async with trio.open_nursery() as nursery:
        await nursery.start(manager.run)
        harness = Harness(manager, fleet, events, nursery)
        yield harness
        manager._core.check_invariants()  # white-box: the core's own invariants
        nursery.cancel_scope.cancel()
