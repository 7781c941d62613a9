"""How the residency core steps (h11's discipline): every check before any change, the
scheduling pass to a fixed point with a bound that raises, and the manager stepping an
event raised while it carries out commands only after them."""

from __future__ import annotations

import pickle
from collections.abc import Callable

import pytest
import trio

from mlxd.errors import Conflict, MlxdError, ModelNotFound
from mlxd.residency.core import Core
from mlxd.residency.events import LeaseReleased, ManagerEvent, TransitionEvent
from mlxd.residency.messages import (
    Acquire,
    AdminUnload,
    CancelWaiter,
    Command,
    Event,
    Grant,
    LoadFinished,
    ModelSpec,
    Reconfigure,
    Release,
    StartLoad,
    Tick,
    Transition,
)
from mlxd.residency.policy import ContentionPolicy
from mlxd.residency.records import ADMIN_DRAIN, ModelRecord
from mlxd.residency.registry import Registry
from mlxd.residency.scheduler import MAX_PASSES, SchedulingDiverged
from mlxd.residency.states import IllegalTransition, Outcome, Reason, State
from mlxd.residency.steps import Steps
from tests.support.harness import make_config, running


def books(core: Core) -> bytes:
    """Everything the core knows and the commands it has made, serialized."""
    return pickle.dumps((core.books, core.moves.out))


def loaded(core: Core, model: str, lease: str, now: float) -> list[Command]:
    """Acquire ``model`` for ``lease`` and finish its load; the commands of both steps."""
    out = core.step(Acquire(len(core.waiters) + 100 + int(now), model, lease, now))
    load = next(c for c in out if isinstance(c, StartLoad))
    return out + core.step(LoadFinished(model, load.load_id, now + 1))


# ---- every check before any change ------------------------------------------------------

MOVES: dict[str, tuple[State, Callable[[Core, ModelRecord], None]]] = {
    # each primitive move that sets fields of its own, from a state whose edge the table
    # refuses, with values other than the record's (so a field set too early shows)
    "start_load": (State.LOADED, lambda core, r: core.moves.start_load(r)),
    "begin_unload": (State.UNLOADED, lambda core, r: core.moves.begin_unload(r, Reason.ADMIN)),
    "begin_drain": (
        State.UNLOADING,
        lambda core, r: core.moves.begin_drain(r, Reason.ADMIN, ADMIN_DRAIN),
    ),
}


@pytest.mark.parametrize("name", sorted(MOVES))
def test_a_refused_move_changes_nothing(name: str) -> None:
    """A primitive move whose transition the table refuses raises and leaves the books,
    the record and the commands as they were."""
    state, move = MOVES[name]
    core = Core(Registry([ModelSpec("a", 10)], 100, ContentionPolicy()))
    r = core.models["a"]
    r.state = state
    before = books(core)
    with pytest.raises(IllegalTransition):
        move(core, r)
    assert books(core) == before


@pytest.mark.parametrize(
    ("event", "error"),
    [
        (AdminUnload("nope", 5.0), ModelNotFound),
        (AdminUnload("a", 5.0), Conflict),  # "a" is loading
        (Reconfigure((ModelSpec("b", 10),), 100, ContentionPolicy(), 5.0), Conflict),  # removes a live "a"
        (Reconfigure((ModelSpec("a", 10),), 5, ContentionPolicy(), 5.0), MlxdError),  # under committed
    ],
)
def test_a_refused_admin_request_changes_nothing(event: Event, error: type[MlxdError]) -> None:
    """An admin request the core cannot honour raises its typed error before the step
    changes anything, its clock included."""
    core = Core(Registry([ModelSpec("a", 10)], 100, ContentionPolicy()))
    core.step(Acquire(1, "a", "l1", 1.0))
    assert core.state("a") is State.LOADING
    before = books(core)
    with pytest.raises(error):
        core.step(event)
    assert books(core) == before
    assert core.now == 1.0


# ---- scheduling to a fixed point ------------------------------------------------------


def test_a_drain_called_off_serves_its_waiters_in_the_same_step() -> None:
    """When the waiter a drain was for leaves, the drain is called off and the model's own
    waiters are granted in that very step (the pass is repeated until nothing is left)."""
    core = Core(Registry([ModelSpec("a", 60), ModelSpec("b", 60)], 100, ContentionPolicy.of("wait")))
    loaded(core, "a", "held", 0.0)
    out = core.step(Acquire(2, "b", "for-b", 5.0))  # a drains for b
    assert core.state("a") is State.DRAINING and not any(isinstance(c, StartLoad) for c in out)
    core.step(Acquire(3, "a", "for-a", 6.0))  # a draining model grants none: it waits
    out = core.step(CancelWaiter(2, 7.0))
    assert Transition("a", State.DRAINING, State.LOADED, Reason.ABANDONED, 60) in out
    assert Grant(3, "a", "for-a") in out
    assert core.state("a") is State.LOADED and core.lease_model["for-a"] == "a"
    core.check_invariants()


def test_a_pass_that_never_settles_is_an_internal_error() -> None:
    """Scheduling that still finds more to do after MAX_PASSES passes raises
    SchedulingDiverged instead of stopping without a word."""
    core = Core(Registry([ModelSpec("a", 10)], 100, ContentionPolicy()))
    passes = 0

    def restless() -> bool:
        nonlocal passes
        passes += 1
        return True

    core.scheduler._pass = restless  # type: ignore[method-assign]
    with pytest.raises(SchedulingDiverged):
        core.step(Tick(1.0))
    assert passes == MAX_PASSES


# ---- follow-up events, after the commands -----------------------------------------------


def test_a_follow_up_is_stepped_after_every_command_of_the_step_that_raised_it() -> None:
    """A Release raised while a Grant is carried out (the lease given straight back) is
    stepped after the step's later commands, not between them."""
    core = Core(Registry([ModelSpec("a", 10)], 100, ContentionPolicy()))
    log: list[tuple[str, object]] = []
    step = core.step

    def logged_step(event: Event) -> list[Command]:
        log.append(("step", type(event).__name__))
        return step(event)

    def execute(cmd: Command) -> None:
        log.append(("carry out", cmd))
        if isinstance(cmd, Grant) and cmd.lease_id == "l1":
            assert not steps.run(Release("l1", 2.0))  # queued, not stepped

    core.step = logged_step  # type: ignore[method-assign]
    steps = Steps(core, execute)
    assert steps.run(Acquire(1, "a", "l1", 0.0)) and steps.run(Acquire(2, "a", "l2", 0.0))
    del log[:]
    assert steps.run(LoadFinished("a", 1, 1.0))
    assert [what if kind == "step" else type(what).__name__ for kind, what in log] == [
        "LoadFinished", "Transition", "Grant", "Grant", "Release",
    ]
    assert core.lease_model == {"l2": "a"}
    core.check_invariants()


async def test_an_event_raised_while_commands_are_carried_out_is_stepped_after_them(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A waiter cancelled by a subscriber of its model's ``loaded`` row is granted in that
    same step: the lease goes straight back, and the cancel and the release are stepped
    after the step's commands are carried out, never inside their loop."""
    async with running(make_config({"a": 1}, 4)) as h:
        m = h.manager
        executing = False
        nested: list[Event] = []
        stepped: list[str] = []
        step, execute = m._core.step, m._steps.execute

        def spied_step(event: Event) -> list[Command]:
            if executing:
                nested.append(event)
            stepped.append(type(event).__name__)
            return step(event)

        def spied_execute(cmd: Command) -> None:
            nonlocal executing
            executing = True
            try:
                execute(cmd)
            finally:
                executing = False

        m._core.step = spied_step  # type: ignore[method-assign]
        m._steps.execute = spied_execute
        ticket = m.enqueue("a")
        released_once = trio.Event()

        def cancel_when_loaded(ev: ManagerEvent) -> None:
            if isinstance(ev, TransitionEvent) and ev.to_state is State.LOADED:
                ticket.cancel(None)
            if isinstance(ev, LeaseReleased):
                released_once.set()

        m.subscribe(cancel_when_loaded)
        await released_once.wait()
        assert nested == []
        assert stepped[-3:] == ["LoadFinished", "CancelWaiter", "Release"]
        released = [e for e in h.events if isinstance(e, LeaseReleased)]
        assert [e.outcome for e in released] == [Outcome.CANCELLED]
        assert m.state_of("a") is State.LOADED and not m.model_snapshot("a").running
        assert not ticket.done.is_set()
