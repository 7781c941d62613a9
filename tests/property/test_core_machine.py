"""A Hypothesis state machine drives the sans-IO core with every kind of event.

After every step it checks the residency promises: committed bytes never above
the budget, at most one load per model in flight, leases only on loaded (or
draining) models, no lease granted on a draining model, every transition legal
and starting from the state the model was in, and the shell-side bookkeeping
(loads, unloads, leases, waiters) consistent with the core's.

Config reloads (``Reconfigure``: models added, removed or replaced, a new budget
and policy) and size changes (``SetSize``, as after a measured load) come in the
middle of all that: a refused reload changes nothing, a removed model leaves no
trace, and a residency keeps the bytes it reserved whatever its estimate becomes.

Faults: engine stops fail (of a loaded model, or of a failed or abandoned
load's partial engine) and are retried; loads and stops hang (they finish
only when a later rule lets them). Promises under faults: every engine that
may hold memory is in a state whose bytes are counted; a model whose stop
failed is nobody's victim until its retry; ``fail`` never waits for a drain.

The policy rules run too: random priorities, eviction (lru/cost, with measured
load times), anti-thrash (min_resident_s, max_swap_delay_s), per-request
keep_alive (with a cap) and X-Mlxd-Contention. Checked with them: a waiter
never preempts, nor keeps draining, a model of higher priority; no idle model
outlives its keep-alive; a scheduling pass is idempotent (stepping an unchanged
core changes nothing); and a plan, computed at any moment, equals what the
acquire then does.

KV reservations run too (``ReserveKV``: a lease holder asks for more KV bytes
of its model, as an engine admitting a request does; ``ReturnKV``: its batch
shrank; a lease ending leaves its KV to the engine to give back). Checked with
them: a model's ``kv_bytes`` is what was granted and not given back since its
load started, they count in "committed never exceeds the budget", a KV request
never makes its own model a victim, and a plan for a request of N tokens' KV
on a loaded model equals what its acquire and reservation then do.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

from hypothesis import event as note_event
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from mlxd.config import ContentionPolicy
from mlxd.errors import MlxdError
from mlxd.residency.core import Core
from mlxd.residency.messages import (
    Acquire,
    AdminUnload,
    CancelLoad,
    CancelWaiter,
    Command,
    EngineDeath,
    Event,
    Grant,
    LoadAborted,
    LoadFinished,
    ModelSpec,
    Preempt,
    Reconfigure,
    Reject,
    Release,
    Satisfy,
    SetLoadGate,
    SetLoadTime,
    SetSize,
    Shutdown,
    ShutdownDeadline,
    StartLoad,
    StartUnload,
    Tick,
    Transition,
    UnloadFinished,
    WaiterKind,
)
from mlxd.residency.plan import plan
from mlxd.residency.policy import ResidencyRules
from mlxd.residency.registry import Registry
from mlxd.residency.states import COMMITTED, TRANSITIONS, State
from mlxd.units import GIB
from tests.property.core_kv_rules import KvRules
from tests.property.test_plan import ASKED, fingerprint, what_acquiring_did

NAMES = ["a", "b", "c", "d"]
#: names a reload may add (and that requests may ask for before it does)
ALL_NAMES = [*NAMES, "e", "f"]
STRATEGIES = ["fail", "wait", "preempt", "wait_then_fail", "wait_then_preempt"]
FEW_NAMES = st.sets(st.sampled_from(ALL_NAMES), max_size=2)
SOME_NAMES = st.sets(st.sampled_from(ALL_NAMES))


class CoreMachine(KvRules, RuleBasedStateMachine):
    """The shell, simulated: it carries out commands the way mlxd.residency.manager does."""

    def __init__(self) -> None:
        super().__init__()
        self.core: Core | None = None
        self.now = 0.0
        self.ids = itertools.count(1)
        self.shadow: dict[str, State] = {}
        self.loads: dict[str, tuple[int, bool]] = {}  # model -> (load_id, cancel requested)
        self.unloads: set[str] = set()
        self.leases: dict[str, str] = {}  # lease id -> model
        self.preempted: set[str] = set()
        self.waiters: dict[int, str] = {}  # lease waiters the shell may cancel
        #: models whose engine may hold memory (from StartLoad until a stop succeeds)
        self.holding: set[str] = set()
        #: loads and stops that hang: they finish only after `unhang`
        self.hung: set[str] = set()
        self.orphans: set[str] = set()  # leases of a dead engine, not yet given back by holders
        self.steps = 0
        self.admin_step = False  # the current step is an admin unload (it may preempt anyone)
        self.last_commands: list[Command] = []
        #: KV requests in flight: waiter id -> (model, bytes)
        self.kv_waiters: dict[int, tuple[str, int]] = {}
        #: the lease each KV request in flight came from
        self.kv_lease: dict[int, str] = {}
        #: each model's KV granted and not given back since its last load started
        self.kv_held: dict[str, int] = {}

    @initialize(
        sizes=st.lists(st.integers(2, 6), min_size=4, max_size=4),
        budget=st.integers(6, 10),
        strategy=st.sampled_from(STRATEGIES),
        timeout=st.sampled_from([None, 5.0, 30.0]),
        preempt_after=st.sampled_from([None, 0.0, 3.0]),
        pinned=st.sets(st.sampled_from(NAMES), max_size=2),
        idle=st.sampled_from([0.0, 10.0]),
        priorities=st.lists(st.integers(0, 2), min_size=4, max_size=4),
        rules=st.builds(
            ResidencyRules,
            eviction=st.sampled_from(["lru", "cost"]),
            min_resident_s=st.sampled_from([0.0, 0.0, 4.0]),
            max_swap_delay_s=st.sampled_from([0.0, 0.0, 2.0]),
            max_keep_alive_s=st.sampled_from([None, 10.0]),
        ),
    )
    def setup(
        self,
        sizes: list[int],
        budget: int,
        strategy: str,
        timeout: float | None,
        preempt_after: float | None,
        pinned: set[str],
        idle: float,
        priorities: list[int],
        rules: ResidencyRules,
    ) -> None:
        specs = [
            ModelSpec(name, size * GIB, pinned=name in pinned, idle_unload_s=idle, priority=prio)
            for name, size, prio in zip(NAMES, sizes, priorities, strict=True)
        ]
        policy = ContentionPolicy(strategy, timeout, preempt_after)  # type: ignore[arg-type]
        self.core = Core(Registry(specs, budget * GIB, policy, rules))
        self.shadow = {name: State.UNLOADED for name in NAMES}

    # -- carrying out commands --------------------------------------------------------

    def feed(self, event: Event) -> bool:
        """Step the core and carry out its commands; True if the core refused the event."""
        assert self.core is not None
        self.last_commands = []
        try:
            commands = self.core.step(event)
        except MlxdError as e:
            note_event(f"refused {type(event).__name__}: {e.code}")
            return True  # admin refusals change nothing (checked by the invariants)
        self.last_commands = commands
        self.steps += 1
        for cmd in commands:
            note_event(type(cmd).__name__ + (f" {cmd.to_state}/{cmd.reason}" if isinstance(cmd, Transition) else ""))
            if isinstance(cmd, Reject):
                note_event(f"Reject {cmd.error.code}")
            if isinstance(cmd, Transition):
                assert self.shadow[cmd.model] is cmd.from_state, cmd
                assert cmd.to_state in TRANSITIONS[cmd.from_state], cmd
                self.shadow[cmd.model] = cmd.to_state
            elif isinstance(cmd, Grant):
                assert self.shadow[cmd.model] is State.LOADED, f"lease granted on {cmd.model} while {self.shadow[cmd.model]}"
                self.leases[cmd.lease_id] = cmd.model
                self.waiters.pop(cmd.waiter_id, None)
            elif isinstance(cmd, (Satisfy, Reject)):
                self.waiters.pop(cmd.waiter_id, None)
                kv = self.kv_waiters.pop(cmd.waiter_id, None)
                self.kv_lease.pop(cmd.waiter_id, None)
                if kv is not None and isinstance(cmd, Satisfy):
                    assert self.shadow[kv[0]] in (State.LOADED, State.DRAINING), kv
                    self.kv_held[kv[0]] = self.kv_held.get(kv[0], 0) + kv[1]
            elif isinstance(cmd, StartLoad):
                assert cmd.model not in self.loads, f"second load of {cmd.model} in flight"
                assert cmd.model not in self.holding, f"{cmd.model}: a second engine while one holds memory"
                self.loads[cmd.model] = (cmd.load_id, False)
                self.holding.add(cmd.model)
                self.kv_held[cmd.model] = 0  # a residency starts with no KV beyond its load's
            elif isinstance(cmd, CancelLoad):
                load_id, _ = self.loads[cmd.model]
                assert load_id == cmd.load_id
                self.loads[cmd.model] = (load_id, True)
            elif isinstance(cmd, StartUnload):
                assert cmd.model not in self.unloads
                self.unloads.add(cmd.model)
            elif isinstance(cmd, Preempt):
                for lid in cmd.lease_ids:
                    assert self.leases[lid] == cmd.model
                    self.preempted.add(lid)
                kv_for = {m for m, _ in self.kv_waiters.values()}
                assert cmd.shutdown or self.admin_step or not (
                    cmd.model in kv_for and cmd.model in self.core.models
                    and cmd.model in self.core.models[cmd.model].claims
                ), f"{cmd.model} preempted for its own KV"
                if not (cmd.shutdown or self.admin_step):  # a waiter preempts: never upwards
                    victim = self.core.models[cmd.model].priority
                    assert any(
                        cmd.model in r.claims and r.priority >= victim
                        for r in self.core.models.values()
                    ), cmd
        return False

    # -- rules -----------------------------------------------------------------------

    @precondition(lambda self: self.core is not None)
    @rule(
        model=st.sampled_from(ALL_NAMES),
        resident=st.booleans(),
        keep_alive=st.sampled_from([None, None, 0.0, 5.0, -1.0, 3600.0]),
        asked=st.sampled_from(ASKED),
    )
    def acquire(
        self, model: str, resident: bool, keep_alive: float | None, asked: ContentionPolicy | None
    ) -> None:
        self.feed(self.acquire_event(model, resident, keep_alive, asked))

    def acquire_event(
        self, model: str, resident: bool, keep_alive: float | None, asked: ContentionPolicy | None
    ) -> Acquire:
        wid = next(self.ids)
        kind = WaiterKind.RESIDENT if resident else WaiterKind.LEASE
        if not resident:
            self.waiters[wid] = model
        return Acquire(wid, model, f"L{wid}", self.now, kind=kind, keep_alive_s=keep_alive,
                       contention=asked)

    @precondition(
        lambda self: self.core is not None and not self.core.shutting_down and bool(self.core.models)
    )
    @rule(data=st.data(), asked=st.sampled_from(ASKED))
    def plan_then_acquire(self, data: st.DataObject, asked: ContentionPolicy | None) -> None:
        """The plan changes nothing, and says what the acquire then does."""
        core = self.core
        assert core is not None
        model = data.draw(st.sampled_from(sorted(core.models)), label="model")
        before = fingerprint(core)
        p = plan(core, model, self.now, contention=asked)
        assert fingerprint(core) == before
        event = self.acquire_event(model, False, None, asked)
        self.feed(event)
        did = what_acquiring_did(core, event.waiter_id, model, self.last_commands)
        assert (p.action, [(v.model, v.bytes) for v in p.victims], p.error_code) == did

    @precondition(lambda self: self.core is not None)
    @rule(model=st.sampled_from(ALL_NAMES), seconds=st.sampled_from([0.5, 2.0, 8.0]))
    def measure(self, model: str, seconds: float) -> None:
        self.feed(SetLoadTime(model, seconds, self.now))

    @precondition(lambda self: bool(self.waiters))
    @rule(data=st.data())
    def cancel_waiter(self, data: st.DataObject) -> None:
        wid = data.draw(st.sampled_from(sorted(self.waiters)))
        del self.waiters[wid]
        self.feed(CancelWaiter(wid, self.now))

    @precondition(lambda self: bool(self.leases))
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        lid = data.draw(st.sampled_from(sorted(self.leases)))
        del self.leases[lid]
        self.preempted.discard(lid)
        self._lease_ended(lid)
        self.feed(Release(lid, self.now))

    @precondition(lambda self: bool(set(self.loads) - self.hung))
    @rule(data=st.data(), ok=st.booleans(), stop_ok=st.booleans())
    def load_finishes(self, data: st.DataObject, ok: bool, stop_ok: bool) -> None:
        """A load ends; a failed or cancelled one's partial engine may fail to stop."""
        model = data.draw(st.sampled_from(sorted(set(self.loads) - self.hung)))
        load_id, cancelled = self.loads.pop(model)
        stop_error = None if stop_ok else "partial stop failed"
        if (cancelled or not ok) and stop_ok:
            self.holding.discard(model)
        if cancelled:  # the shell always reports a cancelled load as aborted
            self.feed(LoadAborted(model, load_id, self.now, stop_error))
        else:
            self.feed(LoadFinished(model, load_id, self.now, None if ok else "boom", stop_error))

    @precondition(lambda self: bool(self.unloads - self.hung))
    @rule(data=st.data(), ok=st.booleans())
    def unload_finishes(self, data: st.DataObject, ok: bool) -> None:
        model = data.draw(st.sampled_from(sorted(self.unloads - self.hung)))
        self.unloads.discard(model)
        if ok:
            self.holding.discard(model)
        self.feed(UnloadFinished(model, self.now, error=None if ok else "stuck"))

    @precondition(lambda self: bool((set(self.loads) | self.unloads) - self.hung))
    @rule(data=st.data())
    def hang(self, data: st.DataObject) -> None:
        """The load or stop in flight of a model hangs (ignores cancellation too)."""
        self.hung.add(data.draw(st.sampled_from(sorted((set(self.loads) | self.unloads) - self.hung))))

    @precondition(lambda self: bool(self.hung))
    @rule(data=st.data())
    def unhang(self, data: st.DataObject) -> None:
        self.hung.discard(data.draw(st.sampled_from(sorted(self.hung))))
    @precondition(
        lambda self: any(s in (State.LOADED, State.DRAINING) for s in self.shadow.values())
    )
    @rule(data=st.data())
    def engine_dies(self, data: st.DataObject) -> None:
        """A worker process dies: the model fails, its leases are the holders' to give back."""
        live = sorted(n for n, s in self.shadow.items() if s in (State.LOADED, State.DRAINING))
        model = data.draw(st.sampled_from(live))
        for lid in [lid for lid, m in self.leases.items() if m == model]:
            del self.leases[lid]
            self.preempted.discard(lid)
            self.orphans.add(lid)
            self._lease_ended(lid)
        self.holding.discard(model)  # its memory went with the process
        self.feed(EngineDeath(model, self.now, "killed by SIGKILL"))
        # failed (then unloaded if it was on its way out, or loading again for a waiter)
        assert self.shadow[model] in (State.FAILED, State.UNLOADED, State.LOADING)

    @precondition(lambda self: bool(self.orphans))
    @rule(data=st.data())
    def orphan_released(self, data: st.DataObject) -> None:
        lid = data.draw(st.sampled_from(sorted(self.orphans)))
        self.orphans.discard(lid)
        self.feed(Release(lid, self.now))

    @precondition(lambda self: self.core is not None)
    @rule(dt=st.sampled_from([0.5, 1.0, 3.0, 5.0, 11.0, 31.0]))
    def tick(self, dt: float) -> None:
        self.now += dt
        self.feed(Tick(self.now))
        assert self.core is not None
        for w in self.core.waiters.values():  # every acquire resolves within its bound
            r = self.core.models[w.model]
            joining = r.state is State.LOADING and not r.load_cancelling
            assert joining or w.deadline is None or w.deadline > self.now, (w, r.state)

    @precondition(lambda self: self.core is not None)
    @rule(model=st.sampled_from(NAMES), preempt=st.booleans())
    def admin_unload(self, model: str, preempt: bool) -> None:
        self.admin_step = True
        try:
            self.feed(AdminUnload(model, self.now, preempt=preempt))
        finally:
            self.admin_step = False

    @precondition(lambda self: self.core is not None)
    @rule(closed=st.booleans())
    def load_gate(self, closed: bool) -> None:
        self.feed(SetLoadGate("journal down" if closed else None, self.now))

    # Strategies are module constants and sets are cut down to what exists here:
    # strategies built per call (st.sampled_from(current)...) cost ~20 ms a draw.
    @precondition(lambda self: self.core is not None and not self.core.shutting_down)
    @rule(
        removed=FEW_NAMES,
        added=FEW_NAMES,
        replaced=SOME_NAMES,
        resized=SOME_NAMES,
        pinned=FEW_NAMES,
        sizes=st.lists(st.integers(1, 6), min_size=len(ALL_NAMES), max_size=len(ALL_NAMES)),
        idle=st.sampled_from([0.0, 10.0]),
        budget=st.integers(4, 10),
        strategy=st.sampled_from(STRATEGIES),
        timeout=st.sampled_from([None, 5.0, 30.0]),
        preempt_after=st.sampled_from([None, 0.0, 3.0]),
    )
    def reconfigure(
        self,
        removed: set[str],
        added: set[str],
        replaced: set[str],
        resized: set[str],
        pinned: set[str],
        sizes: list[int],
        idle: float,
        budget: int,
        strategy: str,
        timeout: float | None,
        preempt_after: float | None,
    ) -> None:
        """A config reload, the way the manager builds it: replaced models get new specs,
        unchanged ones may get a new (measured) size, removed ones go, new ones come."""
        core = self.core
        assert core is not None
        current = set(core.models)
        keep = current - removed
        added = added - current
        replaced = replaced & keep
        size_of = dict(zip(ALL_NAMES, sizes, strict=True))
        specs = []
        for name in sorted(keep | added):
            if name in added or name in replaced:
                specs.append(ModelSpec(name, size_of[name] * GIB, pinned=name in pinned, idle_unload_s=idle,
                                       priority=size_of[name] % 3))
            elif name in resized:  # a measured size since the last reload
                specs.append(replace(core.models[name].spec, size_bytes=size_of[name] * GIB))
            else:
                specs.append(core.models[name].spec)
        before = self._snapshot()
        refused = self.feed(
            Reconfigure(tuple(specs), budget * GIB, ContentionPolicy(strategy, timeout, preempt_after),  # type: ignore[arg-type]
                        self.now, replaced=frozenset(replaced), rules=core.rules)
        )
        if refused:
            assert self._snapshot() == before, "a refused reload changed the core"
            return
        assert set(core.models) == keep | added
        note_event(f"Reconfigure applied: {len(added)} added, {len(current - keep)} removed")
        for name in list(self.shadow):
            if name not in core.models:
                del self.shadow[name]  # gone, with no lease, load, unload or waiter left behind
                assert name not in self.loads and name not in self.unloads, name
                assert name not in self.leases.values() and name not in self.waiters.values(), name
        for name in core.models:
            self.shadow.setdefault(name, State.UNLOADED)
        assert core.budget == budget * GIB and core.policy.strategy == strategy

    @precondition(lambda self: self.core is not None)
    @rule(model=st.sampled_from(ALL_NAMES), size=st.sampled_from([0, 1, 2, 3, 5, 7, 12]))
    def size_changes(self, model: str, size: int) -> None:
        """A new estimate (a measured load): it applies to the next reservation only."""
        core = self.core
        assert core is not None
        reserved = {n: (r.load_id, r.committed_bytes) for n, r in core.models.items() if r.holds_budget}
        self.feed(SetSize(model, size * GIB, self.now))
        for name, (load_id, committed) in reserved.items():
            r = core.models[name]
            if r.holds_budget and r.load_id == load_id:
                assert r.committed_bytes == committed, f"{name}'s residency changed its reserved bytes"
        if model in core.models and size > 0:
            assert core.models[model].spec.size_bytes == size * GIB

    def _snapshot(self) -> tuple[object, ...]:
        core = self.core
        assert core is not None
        return (
            core.budget, core.policy, core.committed, sorted(core.waiters),
            {n: (r.state, r.spec, r.committed_bytes, sorted(r.leases)) for n, r in core.models.items()},
        )

    # Shutdown ends the interesting part of a run, so it comes late.
    @precondition(lambda self: self.core is not None and not self.core.shutting_down and self.steps >= 40)
    @rule()
    def shutdown(self) -> None:
        self.feed(Shutdown(self.now))

    @precondition(lambda self: self.core is not None and self.core.shutting_down)
    @rule()
    def shutdown_deadline(self) -> None:
        self.feed(ShutdownDeadline(self.now))

    # -- invariants ------------------------------------------------------------------

    @invariant()
    def promises_hold(self) -> None:
        core = self.core
        if core is None:
            return
        core.check_invariants()
        assert core.committed <= core.budget
        for name, r in core.models.items():
            assert r.state is self.shadow[name]
            assert (name in self.loads) == (r.state is State.LOADING and r.teardown is None), name
            assert (name in self.unloads) == r.stopping, name
            assert not (r.stopping and r.stuck), name
            if r.state is State.UNLOADING:
                assert r.stopping or r.stuck, name  # its stop is in flight or will be retried
            if name in self.holding:  # an engine that may hold memory is counted
                assert r.state in COMMITTED, (name, r.state)
            for victim in r.claims:  # a model whose stop failed is nobody's victim
                assert not core.models[victim].stuck, (name, victim)
            if r.queue and r.fail_waiters == len(r.queue):  # `fail` never waits for a drain
                assert not r.claims and r.state is not State.DRAINING, name  # (asked for, too)
            if r.state is State.DRAINING:
                # a draining model has live leases, or its unload is already on its way
                assert r.leases, name
        assert set(self.leases) == set(core.lease_model)
        for w in core.waiters.values():  # nobody is left waiting on a model it could have
            assert w.kind is WaiterKind.KV or core.models[w.model].state is not State.LOADED, w
        for name, r in core.models.items():  # KV: what was granted and not given back
            if r.holds_budget:
                assert r.kv_bytes == self.kv_held.get(name, 0), (name, r.kv_bytes, self.kv_held)
        # a KV request waits until answered, or until its lease ends (the core forgets it then)
        assert set(self.kv_waiters) == {w.id for w in core.waiters.values() if w.kind is WaiterKind.KV}
        for lid in self.preempted:
            # preempted leases are on a victim, or on one whose drain was called off after
            assert core.models[self.leases[lid]].state in (State.DRAINING, State.LOADED)
        if core.shutting_down:
            assert not core.waiters
        for v in core.models.values():  # a busy model drains only for a waiter of its priority or more
            if v.state is State.DRAINING and v.drain_owner is None:
                assert any(
                    v.spec.name in r.claims and r.priority >= v.priority
                    for r in core.models.values()
                ), v.spec.name
        for r in core.models.values():  # no idle model outlives its keep-alive (or idle time)
            due = core.books.idle_due(r)
            assert due is None or due > core.now, (r.spec.name, due, core.now)

    @invariant()
    def a_pass_is_idempotent(self) -> None:
        """Stepping an unchanged core (a no-op event) decides nothing new."""
        if self.core is None:
            return
        copy = self.core.copy()
        assert copy.step(SetLoadGate(copy.load_gate, copy.now)) == []


CoreMachine.TestCase.settings = settings(stateful_step_count=80)
TestCoreMachine = CoreMachine.TestCase
