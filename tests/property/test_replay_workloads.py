"""Promise 7 on the real manager: random workloads replay, from their events and from SQLite, to its state.

A workload is a config (two to four fake models, a budget that forces
evictions more often than not, one of the five contention policies, pins, idle
timeouts, load and unload times) and a list of operations carried out in order
through the real :class:`~mlxd.residency.manager.Manager`: requests that hold their lease
for a while or give up while waiting, admin loads and unloads (with and without
preemption), scripted load and unload failures, the journal load gate, config
reloads of one model, pauses; then an optional shutdown.

Three tests share the workloads:

* pure, many examples, virtual time: the manager's events are collected in a
  list; after every operation and at the end, ``replay`` of the transitions
  equals every model's state in the core and ``check_history`` finds nothing;
* through a real :class:`~mlxd.journal.journal.Journal` under the autojump clock. This
  is sound although the journal runs a writer process (which lets virtual time jump,
  trio#456): the manager never awaits the journal (``record`` only queues), so
  the writer cannot change what the manager does; the test awaits the journal
  only once the manager has stopped, when nothing is left for a clock jump to
  fire. Then the rows read back from the file equal the events, replay to the
  final state, and ``check_journal`` finds nothing;
* the same under the real clock (time scaled down), a few examples.
"""

from __future__ import annotations

import json
import os
import random
import sqlite3
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlxd.config import Config, ContentionPolicy, FakeSettings, ManagerConfig, ModelConfig
from mlxd.engines.fake import FakeFleet
from mlxd.errors import MlxdError
from mlxd.journal.journal import Journal
from mlxd.journal.migrate import open_readonly
from mlxd.journal.replay import check_history, check_journal, replay
from mlxd.residency.events import (
    LeaseAcquired,
    LeaseReleased,
    ManagerEvent,
    MeasurementEvent,
    TransitionEvent,
)
from mlxd.residency.manager import Manager
from mlxd.residency.states import State
from mlxd.units import GIB

NAMES = ("a", "b", "c", "d")
STRATEGIES = ("fail", "wait", "wait_then_fail", "preempt", "wait_then_preempt")
#: how long (virtual seconds) the operations may take before what is still waiting is cancelled
HORIZON = 600.0
#: quiet time after the operations: idle timeouts fire, unloads finish
SETTLE = 60.0


# ---- workloads ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Setup:
    sizes: dict[str, int]  # GIB
    budget_gb: int
    strategy: str
    wait_timeout_s: float | None
    preempt_after_s: float | None
    pinned: frozenset[str]
    idle_s: dict[str, float]
    load_s: dict[str, float]
    unload_s: dict[str, float]
    fail_loads: dict[str, tuple[int, ...]]

    def config(self, scale: float = 1.0, sizes: dict[str, int] | None = None) -> Config:
        sizes = {**self.sizes, **(sizes or {})}
        return Config(
            manager=ManagerConfig(
                memory_budget_bytes=self.budget_gb * GIB,
                idle_unload_seconds=0.0,
                contention_policy=ContentionPolicy(
                    self.strategy,  # type: ignore[arg-type]
                    None if self.wait_timeout_s is None else self.wait_timeout_s * scale,
                    None if self.preempt_after_s is None else self.preempt_after_s * scale,
                ),
            ),
            models=tuple(
                ModelConfig(
                    name=m,
                    source=f"fake/{m}",
                    engine="fake",
                    estimated_memory_bytes=sizes[m] * GIB,
                    pin=m in self.pinned,
                    idle_unload_seconds=self.idle_s[m] * scale,
                    fake=FakeSettings(
                        load_seconds=self.load_s[m] * scale,
                        unload_seconds=self.unload_s[m] * scale,
                        tokens_per_second=1000.0,
                        fail_loads=self.fail_loads[m],
                    ),
                )
                for m in self.sizes
            ),
        )


@dataclass(frozen=True)
class Request:
    """Acquire a lease, hold it inside its preemptible scope, release; give up waiting after ``give_up``."""

    model: str
    hold: float
    give_up: float | None


@dataclass(frozen=True)
class AdminLoad:
    model: str


@dataclass(frozen=True)
class AdminUnload:
    model: str
    preempt: bool


@dataclass(frozen=True)
class Pause:
    seconds: float


@dataclass(frozen=True)
class FailNextLoad:
    model: str


@dataclass(frozen=True)
class FailNextUnload:
    model: str


@dataclass(frozen=True)
class LoadGate:
    closed: bool


@dataclass(frozen=True)
class Reload:
    """Reload the config with ``model`` at a new size (a conflict while it is live)."""

    model: str
    size_gb: int


Op = Request | AdminLoad | AdminUnload | Pause | FailNextLoad | FailNextUnload | LoadGate | Reload


@dataclass(frozen=True)
class Workload:
    setup: Setup
    ops: tuple[Op, ...]
    shutdown_grace: float | None


HOLDS = st.sampled_from([0.0, 0.5, 2.0, 5.0, 20.0])
GIVE_UP = st.none() | st.sampled_from([0.0, 0.3, 1.0, 4.0, 15.0])


@st.composite
def setups(draw: st.DrawFn) -> Setup:
    names = NAMES[: draw(st.integers(2, 4))]
    sizes = {m: draw(st.integers(1, 3)) for m in names}
    # From one model short of the largest (it can never load) to everything at once.
    budget = draw(st.integers(max(sizes.values()) - 1, sum(sizes.values())).filter(bool))
    strategy = draw(st.sampled_from(STRATEGIES))
    timeouts = [None, 1.0, 5.0] if strategy == "wait" else [1.0, 5.0, 30.0]
    return Setup(
        sizes=sizes,
        budget_gb=budget,
        strategy=strategy,
        wait_timeout_s=draw(st.sampled_from(timeouts)),
        preempt_after_s=(
            draw(st.sampled_from([None, 0.0, 0.5, 2.0]))
            if strategy == "wait_then_preempt"
            else None
        ),
        pinned=frozenset(draw(st.sets(st.sampled_from(names), max_size=1))),
        idle_s={m: draw(st.sampled_from([0.0, 0.0, 1.5, 7.0])) for m in names},
        load_s={m: draw(st.sampled_from([0.0, 0.5, 1.0, 3.0])) for m in names},
        unload_s={m: draw(st.sampled_from([0.0, 0.2, 2.0])) for m in names},
        fail_loads={m: draw(st.sampled_from([(), (), (), (1,), (2,)])) for m in names},
    )


def operations(names: tuple[str, ...]) -> st.SearchStrategy[Op]:
    model = st.sampled_from(names)
    request = st.builds(Request, model, HOLDS, GIVE_UP)
    return st.one_of(
        request,
        st.builds(Pause, st.sampled_from([0.0, 0.1, 0.5, 1.0, 3.0, 10.0])),
        request,
        request,
        st.builds(AdminLoad, model),
        st.builds(AdminUnload, model, st.booleans()),
        request,
        st.builds(FailNextLoad, model),
        st.builds(FailNextUnload, model),
        st.builds(LoadGate, st.booleans()),
        st.builds(Reload, model, st.integers(1, 3)),
    )


@st.composite
def workloads(draw: st.DrawFn, max_ops: int = 60) -> Workload:
    setup = draw(setups())
    ops = draw(st.lists(operations(tuple(setup.sizes)), min_size=5, max_size=max_ops))
    grace = draw(st.none() | st.sampled_from([0.0, 1.0, 10.0]))
    return Workload(setup, tuple(ops), grace)


# ---- driving the manager --------------------------------------------------------------------


@dataclass
class Run:
    manager: Manager
    events: list[ManagerEvent] = field(default_factory=list)

    def rows(self) -> list[dict[str, Any]]:
        """The transitions as journal rows, numbered in order."""
        return [
            {
                "seq": i,
                "model": e.model,
                "from_state": e.from_state.value,
                "to_state": e.to_state.value,
                "reason": e.reason.value,
            }
            for i, e in enumerate(
                (e for e in self.events if isinstance(e, TransitionEvent)), start=1
            )
        ]

    def states(self) -> dict[str, State]:
        return {name: self.manager.state_of(name) for name in self.manager.model_names()}

    def check(self) -> None:
        """Replay equals the core's state (a model without rows is unloaded); the history is legal."""
        rows = self.rows()
        replayed = {name: State.UNLOADED for name in self.manager.model_names()} | replay(rows)
        assert replayed == self.states(), rows
        assert check_history(rows) == []
        self.manager._core.check_invariants()  # white-box: the core's own invariants


async def _request(manager: Manager, op: Request, scale: float) -> None:
    with trio.move_on_after(op.give_up * scale if op.give_up is not None else float("inf")):
        try:
            async with manager.lease(op.model, request_id="w") as lease:
                with lease.scope():
                    await trio.sleep(op.hold * scale)
        except MlxdError:
            pass


async def _quietly(call: Any) -> None:
    try:
        await call
    except MlxdError:
        pass


async def drive(
    w: Workload, *, scale: float = 1.0, subscriber: Any = None, check_each_step: bool = True
) -> Run:
    """Carry out ``w`` on a fresh manager; return once the manager has stopped."""
    fleet = FakeFleet()
    config = w.setup.config(scale)
    for mc in config.models:
        fleet.for_config(mc)
    manager = Manager(config, fleet)
    run = Run(manager)
    manager.subscribe(run.events.append)
    if subscriber is not None:
        manager.subscribe(subscriber)
    sizes: dict[str, int] = {}
    async with trio.open_nursery() as outer:
        await outer.start(manager.run)
        with trio.move_on_after(HORIZON * scale):
            async with trio.open_nursery() as tasks:
                for op in w.ops:
                    if isinstance(op, Request):
                        tasks.start_soon(_request, manager, op, scale)
                    elif isinstance(op, AdminLoad):
                        tasks.start_soon(_quietly, manager.load(op.model))
                    elif isinstance(op, AdminUnload):
                        tasks.start_soon(_quietly, manager.unload(op.model, preempt=op.preempt))
                    elif isinstance(op, Pause):
                        await trio.sleep(op.seconds * scale)
                    elif isinstance(op, FailNextLoad):
                        fleet[op.model].fail_loads.add(fleet[op.model].loads_started + 1)
                    elif isinstance(op, FailNextUnload):
                        fleet[op.model].fail_unloads.add(fleet[op.model].stops + 1)
                    elif isinstance(op, LoadGate):
                        manager.set_load_gate("the journal cannot write" if op.closed else None)
                    elif isinstance(op, Reload):
                        sizes[op.model] = op.size_gb
                        await _quietly(manager.reload(w.setup.config(scale, sizes)))
                    await trio.lowlevel.checkpoint()
                    if check_each_step:
                        run.check()
        await trio.sleep(SETTLE * scale)
        run.check()
        if w.shutdown_grace is not None:
            with trio.move_on_after(HORIZON * scale):
                await manager.shutdown(w.shutdown_grace * scale)
            run.check()
        outer.cancel_scope.cancel()
    run.check()  # after the manager's own teardown too
    return run


def _run_virtual(coro_fn: Any, *args: Any) -> Any:
    return trio.run(coro_fn, *args, clock=trio.testing.MockClock(autojump_threshold=0))


# ---- the tests ---------------------------------------------------------------------------------


@settings(
    # three times the profile's examples (900 by default, 15,000 with --stress): ~15 ms each
    max_examples=settings.default.max_examples * 3,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(workloads())
def test_replay_of_random_workloads_equals_the_managers_state(w: Workload) -> None:
    """After every operation of any workload, replaying the transitions gives each model's state, legally."""
    run = _run_virtual(drive, w)
    assert run.events or not run.rows()


async def _journaled(w: Workload, path: Path, scale: float) -> tuple[Run, int]:
    journal = Journal(path, synchronous="normal")
    async with trio.open_nursery() as nursery:
        await nursery.start(journal.run)
        await journal.begin_run(os.getpid(), "test", None)
        run = await drive(w, scale=scale, subscriber=journal.record, check_each_step=False)
        # The manager has stopped: nothing is left for a virtual clock jump to fire.
        journal.end_run(clean=True)
        await journal.wait_committed()
        records = journal.last_seq
        nursery.cancel_scope.cancel()
    return run, records


def _check_file(run: Run, path: Path) -> None:
    conn: sqlite3.Connection = open_readonly(path)
    try:
        stored = [
            dict(r)
            for r in conn.execute(
                "SELECT seq, model, from_state, to_state, reason FROM transitions ORDER BY seq"
            )
        ]
        assert [{k: v for k, v in r.items() if k != "seq"} for r in stored] == [
            {k: v for k, v in r.items() if k != "seq"} for r in run.rows()
        ]
        replayed = {name: State.UNLOADED for name in run.manager.model_names()} | replay(stored)
        assert replayed == run.states()
        assert check_journal(conn) == []
        outcomes: dict[str, str | None] = {}
        for e in run.events:
            if isinstance(e, LeaseAcquired):
                outcomes[e.lease_id] = None
            elif isinstance(e, LeaseReleased):
                outcomes[e.lease_id] = e.outcome.value
        assert dict(conn.execute("SELECT id, outcome FROM leases").fetchall()) == outcomes
        # every events row is the event as JSON, byte for byte what json.dumps writes
        assert [
            tuple(r) for r in conn.execute("SELECT kind, model, payload FROM events ORDER BY seq")
        ] == [
            (e.kind, e.model, json.dumps(e.as_dict(), separators=(",", ":")))
            for e in run.events
            if not isinstance(e, MeasurementEvent)
        ]
    finally:
        conn.close()


@settings(
    # a fifth of the profile's examples (60 by default, 1,000 with --stress): each opens a file
    max_examples=max(20, settings.default.max_examples // 5),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(workloads())
def test_journaled_workloads_replay_from_the_file(w: Workload) -> None:
    """Rows written through the real journal equal the manager's events (payloads byte for byte) and replay to its state."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "journal.db"
        run, _ = _run_virtual(_journaled, w, path, 1.0)
        _check_file(run, path)


@pytest.mark.parametrize("seed", range(3))
def test_journaled_workload_under_the_real_clock(seed: int, tmp_path: Path) -> None:
    """Under real time (scaled down 50x) the journal's rows still replay to the manager's state."""
    w = _fixed_workload(seed)
    path = tmp_path / "journal.db"
    run, _ = trio.run(_journaled, w, path, 0.02)
    _check_file(run, path)


def _fixed_workload(seed: int) -> Workload:
    """A busy workload varied by ``seed``: contention, load and unload failures, drains, idling."""
    rng = random.Random(seed)
    setup = Setup(
        sizes={"a": 1, "b": 2, "c": 1, "d": 2},
        budget_gb=3,
        strategy=("wait_then_preempt", "wait_then_fail", "preempt")[seed % 3],
        wait_timeout_s=5.0,
        preempt_after_s=0.5 if seed % 3 == 0 else None,
        pinned=frozenset({"a"}) if seed == 1 else frozenset(),
        idle_s={"a": 0.0, "b": 1.5, "c": 7.0, "d": 0.0},
        load_s={"a": 0.5, "b": 1.0, "c": 0.0, "d": 3.0},
        unload_s={"a": 0.2, "b": 0.0, "c": 2.0, "d": 0.2},
        fail_loads={"a": (), "b": (2,), "c": (), "d": (1,)},
    )
    ops: list[Op] = []
    for _ in range(40):
        m = rng.choice("abcd")
        kind = rng.random()
        if kind < 0.5:
            ops.append(Request(m, rng.choice([0.0, 0.5, 2.0]), rng.choice([None, 0.3, 4.0])))
        elif kind < 0.6:
            ops.append(AdminLoad(m))
        elif kind < 0.7:
            ops.append(AdminUnload(m, rng.random() < 0.5))
        elif kind < 0.75:
            ops.append(FailNextUnload(m))
        else:
            ops.append(Pause(rng.choice([0.1, 0.5, 2.0])))
    return Workload(setup, tuple(ops), 1.0)
