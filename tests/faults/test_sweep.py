"""The fault sweep: every engine fault, under every contention strategy, with the promises checked after every step.

The real manager with fake engines in virtual time. Four models share a tight
budget (one of them pinned); the faulty one raises or hangs where its
``faults:`` script says (load, stop, generate). A seeded script drives
requests (held, streamed, abandoned by their client while waiting, while the
model loads, mid-stream), admin loads and unloads and idle time, then shuts
down. After every step:

* committed bytes never exceed the budget, and cover every engine that may
  still hold memory (a fake engine holds from its load until a stop succeeds);
  no model ever has two engines;
* every request resolves within its bound: one still waiting longer than
  ``wait_timeout_s`` must be joining a load in flight (loads are not bounded
  by the policy; its client's own timeout is); under ``fail`` none waits for a drain;
* an engine whose stop failed is never handed to a request;
* every transition is legal and the journal's replay gives the core's states;
* no lease leaks: every lease ends, each with one outcome.

The default run takes a few seeds per (scenario, strategy); ``--stress`` many more.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import pytest
import trio
import trio.testing

from mlxd.config import FaultSettings
from mlxd.engines.base import GenerationRequest
from mlxd.engines.fake import FakeFleet, FakeModel
from mlxd.engines.injected_faults import Faults
from mlxd.errors import MlxdError
from mlxd.journal.replay import check_history, replay
from mlxd.residency.events import LeaseAcquired, LeaseReleased, ManagerEvent, TransitionEvent
from mlxd.residency.manager import Manager
from mlxd.residency.policy import STRATEGIES
from mlxd.residency.states import COMMITTED, State
from mlxd.units import GIB
from tests.support.harness import make_config

#: the faulty model's script in each scenario
SCENARIOS: dict[str, FaultSettings] = {
    "load raises": FaultSettings(load="raise"),
    "load raises once": FaultSettings(load="raise_once"),
    "load hangs": FaultSettings(load="hang"),
    "load ignores cancel": FaultSettings(load="ignore_cancel", delay_s=7.0),
    "stop raises once": FaultSettings(stop="raise_once"),
    "stop always raises": FaultSettings(stop="raise"),
    "stop hangs": FaultSettings(stop="hang"),
    "load and stop raise": FaultSettings(load="raise", stop="raise"),
    "generate raises": FaultSettings(generate="raise", after_tokens=2),
    "generate hangs": FaultSettings(generate="hang", after_tokens=2),
}
SIZES = {"x": 2.0, "y": 2.0, "p": 1.0, "z": 3.0}  # x is the faulty one, p is pinned
BUDGET_GB = 5.0
WAIT_TIMEOUT_S = 8.0
STOP_TIMEOUT_S = 5.0
CLIENT_TIMEOUT_S = 40.0
STEPS = 30


@dataclass
class Request:
    model: str
    started: float
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    granted: bool = False
    done: bool = False
    outcome: str | None = None


@dataclass
class Run:
    manager: Manager
    fleet: FakeFleet
    events: list[ManagerEvent]
    nursery: trio.Nursery
    requests: list[Request] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    steps: int = 0

    def check(self, where: str) -> None:
        """The promises of the module docstring, now."""
        self.steps += 1
        core = self.manager._core  # white-box: the sweep checks the core's own books
        now = trio.current_time()
        bad: list[str] = []
        if core.committed > core.budget:
            bad.append(f"committed {core.committed} > budget {core.budget}")
        held = 0
        for name, r in core.models.items():
            resident = self.fleet[name].resident
            if resident > 1:
                bad.append(f"{name}: {resident} engines hold memory")
            if resident and r.state not in COMMITTED:
                bad.append(f"{name}: an engine holds memory while {r.state} (not counted)")
            held += resident * r.spec.size_bytes
            if r.leases and r.state not in (State.LOADED, State.DRAINING):
                bad.append(f"{name}: leases while {r.state}")
            if core.policy.strategy == "fail" and r.queue and (r.claims or r.state is State.DRAINING):
                bad.append(f"{name}: under `fail`, a request waits for a drain")
        for lease in self.manager.leases():
            if getattr(lease.engine, "stop_failed", False):
                bad.append(f"{lease.model}: an engine whose stop failed was handed to a request")
        if held > core.committed:
            bad.append(f"engines hold {held} bytes, {core.committed} are counted")
        for req in self.requests:
            if req.done or req.granted or now - req.started <= WAIT_TIMEOUT_S + 1e-6:
                continue
            r = core.models[req.model]
            if not (r.state is State.LOADING and not r.load_cancelling):
                bad.append(f"a request for {req.model} waits {now - req.started:.1f} s ({r.state})")
        rows = [e.as_dict() for e in self.events if isinstance(e, TransitionEvent)]
        bad += check_history(rows)
        states = replay(rows)
        bad += [f"{n}: replay says {states.get(n)}, core {r.state}" for n, r in core.models.items()
                if states.get(n, State.UNLOADED) is not r.state]
        self.violations += [f"{where}: {b}" for b in bad]

    def leases_whole(self) -> None:
        acquired = {e.lease_id for e in self.events if isinstance(e, LeaseAcquired)}
        released = [e.lease_id for e in self.events if isinstance(e, LeaseReleased)]
        if len(released) != len(set(released)):
            self.violations.append("a lease was released twice")
        if acquired != set(released):
            self.violations.append(f"leases never released: {sorted(acquired - set(released))}")
        if self.manager.leases():
            self.violations.append(f"the manager still holds {len(self.manager.leases())} leases")
        if not all(req.done for req in self.requests):
            self.violations.append("requests still pending after shutdown")


async def request(run: Run, req: Request, tokens: int, hold_s: float) -> None:
    """A client: acquire (giving up after CLIENT_TIMEOUT_S), generate ``tokens``, hold, release."""
    with req.scope, trio.move_on_after(CLIENT_TIMEOUT_S):
        try:
            async with run.manager.lease(req.model, request_id=f"r{len(run.requests)}") as lease:
                req.granted = True
                with lease.scope():
                    gen = lease.engine.generate(GenerationRequest("completion", prompt="hi", max_tokens=tokens))
                    async for _ in gen:
                        pass
                    await trio.sleep(hold_s)
            req.outcome = "completed"
        except MlxdError as e:
            req.outcome = e.code or type(e).__name__
        except Exception as e:  # an injected generate fault
            req.outcome = type(e).__name__
    req.done = True


async def admin(fn: Callable[..., Any], *args: Any, **kw: Any) -> None:
    try:
        await fn(*args, **kw)
    except MlxdError:
        pass  # refusals and failed stops are answers too


async def drive(run: Run, rng: random.Random) -> None:
    m, nursery = run.manager, run.nursery
    for i in range(STEPS):
        roll = rng.random()
        model = rng.choice(list(SIZES))
        if roll < 0.55:
            req = Request(model, trio.current_time())
            run.requests.append(req)
            nursery.start_soon(request, run, req, rng.choice([1, 5, 40]), rng.choice([0.0, 0.5, 4.0]))
        elif roll < 0.68:
            pending = [r for r in run.requests if not r.done]
            if pending:
                rng.choice(pending).scope.cancel()  # the client goes away
        elif roll < 0.76:
            nursery.start_soon(partial(admin, m.unload, model, preempt=rng.random() < 0.3))
            await trio.testing.wait_all_tasks_blocked()
            other = Request(rng.choice(list(SIZES)), trio.current_time())  # wants its room
            run.requests.append(other)
            nursery.start_soon(request, run, other, 5, 1.0)
        elif roll < 0.82:
            nursery.start_soon(admin, m.load, model)
        await trio.sleep(rng.choice([0.0, 0.1, 1.0, 3.0]))
        await trio.testing.wait_all_tasks_blocked()
        run.check(f"step {i}")
    await trio.sleep(2 * CLIENT_TIMEOUT_S)  # every client gives up or is served by now
    await trio.testing.wait_all_tasks_blocked()
    run.check("quiet")


async def sweep_one(scenario: str, strategy: str, seed: int) -> Run:
    fleet = FakeFleet()
    for name, gb in SIZES.items():
        faults = Faults(name, SCENARIOS[scenario]) if name == "x" else None
        fleet.add(FakeModel(name, int(gb * GIB), load_seconds=1.0, unload_seconds=0.2,
                            tokens_per_second=20, faults=faults))
    cfg = make_config(SIZES, BUDGET_GB, strategy=strategy, wait_timeout_s=WAIT_TIMEOUT_S,
                      preempt_after_s=2.0, pinned={"p"}, idle_unload_seconds=30,
                      stop_timeout_s=STOP_TIMEOUT_S)
    manager = Manager(cfg, fleet)
    events: list[ManagerEvent] = []
    manager.subscribe(events.append)
    async with trio.open_nursery() as nursery:
        await nursery.start(manager.run)
        run = Run(manager, fleet, events, nursery)
        await drive(run, random.Random(f"{scenario}/{strategy}/{seed}"))
        await manager.shutdown(5.0, limit_s=5.0 + 3 * STOP_TIMEOUT_S)
        await trio.testing.wait_all_tasks_blocked()
        run.check("after shutdown")
        run.leases_whole()
        nursery.cancel_scope.cancel()
    return run


def seeds(stress: bool) -> range:
    return range(25) if stress else range(2)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("scenario", list(SCENARIOS))
async def test_fault_sweep(
    scenario: str, strategy: str, stress: bool, autojump_clock: trio.abc.Clock
) -> None:
    """Under this engine fault and this strategy, every step keeps the promises of the module docstring."""
    steps = 0
    for seed in seeds(stress):
        run = await sweep_one(scenario, strategy, seed)
        assert run.violations == [], run.violations[:5]
        steps += run.steps
    assert steps >= len(seeds(stress)) * STEPS
