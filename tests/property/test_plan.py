"""The plan tells the truth: for random core states and a model X, ``plan(X)`` equals
what acquiring X then does when nothing else happens, and planning changes nothing.

A random state is reached by a random history (acquires with and without
``X-Mlxd-Contention``, leases released, loads and unloads finishing or failing,
time passing, admin unloads) under random priorities, eviction rules,
anti-thrash settings and contention policies. Then the plan is computed, and the
real core steps the same acquire. What it did is read off its commands with
this test's own reading (the transitions it emitted, the answer to the waiter,
the model's state), not the plan's: the action, the victims in order (with
their bytes) and the error code must match. 1,000 examples by default, 10,000
under ``--stress``.
"""

from __future__ import annotations

import pickle
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import event as note_event
from hypothesis import strategies as st

from mlxd.errors import MlxdError
from mlxd.residency.core import Core
from mlxd.residency.messages import (
    Acquire,
    AdminUnload,
    CancelLoad,
    CancelWaiter,
    Event,
    Grant,
    LoadAborted,
    LoadFinished,
    ModelSpec,
    Reject,
    Release,
    Satisfy,
    SetLoadTime,
    StartLoad,
    StartUnload,
    Tick,
    Transition,
    UnloadFinished,
    WaiterKind,
)
from mlxd.residency.plan import plan
from mlxd.residency.policy import STRATEGIES, ContentionPolicy, ResidencyRules
from mlxd.residency.registry import Registry
from mlxd.residency.states import State

GB = 1024**3
NAMES = ("a", "b", "c", "d")

policies = st.builds(
    ContentionPolicy,
    strategy=st.sampled_from(STRATEGIES),
    wait_timeout_s=st.sampled_from([None, 5.0, 30.0]),
    preempt_after_s=st.sampled_from([None, 0.0, 3.0]),
)
rules = st.builds(
    ResidencyRules,
    eviction=st.sampled_from(["lru", "cost"]),
    min_resident_s=st.sampled_from([0.0, 4.0]),
    max_swap_delay_s=st.sampled_from([0.0, 2.0]),
    max_keep_alive_s=st.sampled_from([None, 10.0]),
)
specs = st.tuples(
    *(
        st.builds(
            ModelSpec,
            name=st.just(name),
            size_bytes=st.integers(2, 6).map(lambda g: g * GB),
            pinned=st.booleans() if name == "d" else st.just(False),
            idle_unload_s=st.sampled_from([0.0, 10.0]),
            priority=st.integers(0, 2),
            load_s=st.sampled_from([None, 1.0, 2.0, 5.0]),
        )
        for name in NAMES
    )
)
KINDS = ("acquire", "acquire", "acquire", "acquire", "cancel", "release", "release", "load",
         "load", "load", "unload", "unload", "tick", "admin", "measure", "load")
ASKED = (None, None, None, None, ContentionPolicy.of("fail"), ContentionPolicy.of("wait"),
         ContentionPolicy.of("wait_then_fail", wait_timeout_s=5.0), ContentionPolicy.of("preempt"))
#: one step of a history, packed in one integer (cheap to draw, still shrinkable):
#: bits 0-3 the kind, 4-7 a number that picks the target, 8 a flag, 9-11 the policy asked
steps = st.lists(st.integers(0, 2**12 - 1), min_size=8, max_size=50)


def unpack(v: int) -> tuple[str, int, bool, ContentionPolicy | None]:
    return KINDS[v & 15], (v >> 4) & 15, bool(v >> 8 & 1), ASKED[v >> 9 & 7]


class Shell:
    """The manager, simulated: carries out commands and knows what may happen next."""

    def __init__(self, core: Core) -> None:
        self.core = core
        self.now = 0.0
        self.next_id = 1
        self.loads: dict[str, tuple[int, bool]] = {}
        self.unloads: set[str] = set()
        self.leases: list[str] = []
        self.waiters: list[int] = []

    def feed(self, event: Event) -> list[Any]:
        try:
            commands = self.core.step(event)
        except MlxdError:
            return []
        for c in commands:
            if isinstance(c, Grant):
                self.leases.append(c.lease_id)
            if isinstance(c, Grant | Satisfy | Reject) and c.waiter_id in self.waiters:
                self.waiters.remove(c.waiter_id)
            elif isinstance(c, StartLoad):
                self.loads[c.model] = (c.load_id, False)
            elif isinstance(c, CancelLoad):
                self.loads[c.model] = (c.load_id, True)
            elif isinstance(c, StartUnload):
                self.unloads.add(c.model)
        return commands

    def acquire_event(self, model: str, contention: ContentionPolicy | None, resident: bool = False) -> Acquire:
        wid, self.next_id = self.next_id, self.next_id + 1
        kind = WaiterKind.RESIDENT if resident else WaiterKind.LEASE
        if not resident:
            self.waiters.append(wid)
        return Acquire(wid, model, f"L{wid}", self.now, kind=kind, contention=contention)

    def play(self, kind: str, n: int, flag: bool, policy: ContentionPolicy | None) -> None:
        model = NAMES[n % len(NAMES)]
        if kind == "acquire":
            self.feed(self.acquire_event(model, policy, resident=flag and n % 3 == 0))
        elif kind == "cancel" and self.waiters:
            self.feed(CancelWaiter(self.waiters.pop(n % len(self.waiters)), self.now))
        elif kind == "release" and self.leases:
            self.feed(Release(self.leases.pop(n % len(self.leases)), self.now))
        elif kind == "load" and self.loads:
            name = sorted(self.loads)[n % len(self.loads)]
            load_id, cancelled = self.loads.pop(name)
            if cancelled:
                self.feed(LoadAborted(name, load_id, self.now))
            else:
                self.feed(LoadFinished(name, load_id, self.now, error=None if flag or n % 4 else "boom"))
        elif kind == "unload" and self.unloads:
            name = sorted(self.unloads)[n % len(self.unloads)]
            self.unloads.discard(name)
            self.feed(UnloadFinished(name, self.now, error=None if flag or n % 5 else "stuck"))
        elif kind == "tick":
            self.now += (0.5, 1.0, 2.5, 5.0)[n % 4]
            self.feed(Tick(self.now))
        elif kind == "admin":
            self.feed(AdminUnload(model, self.now, preempt=flag))
        elif kind == "measure":
            self.feed(SetLoadTime(model, float(n % 6), self.now))


def fingerprint(core: Core) -> bytes:
    """Everything the core knows, serialized (to prove that planning changed nothing)."""
    return pickle.dumps(core.__dict__)


def what_acquiring_did(core: Core, wid: int, model: str, commands: list[Any]) -> tuple[str, list[tuple[str, int]], str | None]:
    """This test's own reading of one acquire step: (action, victims with bytes, error code)."""
    victims = [
        (c.model, c.memory_bytes)
        for c in commands
        if isinstance(c, Transition)
        and c.from_state is State.LOADED
        and c.to_state in (State.UNLOADING, State.DRAINING)
    ]
    drained = any(
        isinstance(c, Transition) and c.from_state is State.LOADED and c.to_state is State.DRAINING
        for c in commands
    )
    for c in commands:
        if isinstance(c, Reject) and c.waiter_id == wid:
            return "fail", victims, c.error.code
        if isinstance(c, Grant) and c.waiter_id == wid:
            return "ready", victims, None
    r = core.models[model]
    if r.state is State.LOADING and not r.load_cancelling:
        return "load", victims, None
    if drained:
        return "drain_then_load", victims, None
    return ("evict_then_load" if victims else "wait"), victims, None


def check_plan_is_true(core: Core, shell: Shell, x: str, contention: ContentionPolicy | None) -> None:
    before = fingerprint(core)
    p = plan(core, x, shell.now, contention=contention)
    assert fingerprint(core) == before, "planning changed the core"
    event = shell.acquire_event(x, contention)
    commands = shell.feed(event)
    action, victims, code = what_acquiring_did(core, event.waiter_id, x, commands)
    assert (p.action, [(v.model, v.bytes) for v in p.victims], p.error_code) == (action, victims, code)
    assert all(v.state is State.LOADED for v in p.victims)
    note_event(f"{p.action} {p.error_code or ''} {sorted({v.why for v in p.victims})}")
    core.check_invariants()


@pytest.mark.parametrize("examples", [1_000, pytest.param(10_000, marks=pytest.mark.stress)])
def test_plan_equals_what_acquiring_then_does(examples: int) -> None:
    """For random core states and a model X, plan(X) equals what acquiring X then does."""

    @settings(max_examples=examples, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(
        specs=specs,
        budget=st.integers(6, 10),
        policy=policies,
        rules=rules,
        history=steps,
        x=st.sampled_from(NAMES),
        contention=st.none() | policies,
    )
    def run(
        specs: tuple[ModelSpec, ...],
        budget: int,
        policy: ContentionPolicy,
        rules: ResidencyRules,
        history: list[int],
        x: str,
        contention: ContentionPolicy | None,
    ) -> None:
        core = Core(Registry(specs, budget * GB, policy, rules))
        shell = Shell(core)
        for v in history:
            shell.play(*unpack(v))
        check_plan_is_true(core, shell, x, contention)

    run()
