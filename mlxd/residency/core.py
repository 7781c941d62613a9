"""The sans-IO residency core: pure state, budget and policy.

Theory of operation
-------------------
:class:`Core` holds every model's residency state, the memory budget, the
queue of waiters and the live leases. It never awaits and never reads a clock:
the Trio shell (:mod:`mlxd.residency.manager`) turns happenings into :data:`Event` values
carrying ``now`` (monotonic seconds), calls :meth:`Core.step`, and carries out
the :data:`Command` values it returns, in order.

Each event has one handler, chosen in one place (the ``match`` of
:meth:`Core.step`, exhaustive for mypy by ``assert_never``); an admin request
that cannot be honoured is refused before anything changes. After the
handler, the scheduling pass (:mod:`mlxd.residency.scheduler`), repeated to a
fixed point, decides who is served, who loads and who makes room (priorities, eviction rule, contention policy, anti-thrash); its
docstring is the theory of the pass. :mod:`mlxd.residency.plan` runs the same
step on a copy of the core to say what an acquire would do, without doing it.

Requests may ask for less than the manager's policy, never more: an
:class:`Acquire`'s ``contention`` is combined with the manager's by
:meth:`ContentionPolicy.at_most`, and its ``keep_alive_s`` is clamped by
``max_keep_alive_s``. When a lease ends, its keep_alive (if it had one) decides
how long the idle model stays: 0 unloads it at once (reason ``idle_timeout``),
-1 keeps it until it is evicted.

Every waiter, under every strategy, has the deadline ``wait_timeout_s`` (none
only for ``wait`` without one) for whatever it waits on: room, its own model's
drain or unload, a stuck stop.

An engine stop that fails keeps the model counted and lease-free until a
retried stop succeeds (see "Engine stops that fail" in :mod:`.states`); until
the retry the model is *stuck*: nobody's victim, and ``fail`` does not wait for it.

Invariants (checked by :meth:`~mlxd.residency.registry.Registry.check_invariants`,
used by the property test):

* committed bytes (``loading + loaded + draining + unloading``) never exceed the budget;
* at most one load per model is in flight;
* leases exist only on ``loaded`` or ``draining`` models, and a ``draining``
  model is granted none;
* every state change goes through :func:`mlxd.residency.states.check_transition`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import assert_never

from mlxd.errors import (
    Conflict,
    LoadFailed,
    MlxdError,
    ModelNotFound,
    ShuttingDown,
)
from mlxd.residency import refusals
from mlxd.residency.messages import (
    Acquire,
    AdminUnload,
    CancelLoad,
    CancelWaiter,
    Command,
    EngineDeath,
    Event,
    LoadAborted,
    LoadFinished,
    Reconfigure,
    Reject,
    Release,
    ReserveKV,
    ReturnKV,
    SetLoadGate,
    SetLoadTime,
    SetSize,
    Shutdown,
    ShutdownDeadline,
    Tick,
    UnloadFinished,
    WaiterKind,
)
from mlxd.residency.moves import Moves, Victim
from mlxd.residency.policy import ContentionPolicy, ResidencyRules
from mlxd.residency.records import ADMIN_DRAIN, SHUTDOWN_DRAIN, ModelRecord, Waiter
from mlxd.residency.registry import Registry
from mlxd.residency.scheduler import Scheduler
from mlxd.residency.states import DORMANT, SERVING, Reason, State

# ---- the core ----------------------------------------------------------------------------


class Core:
    """Residency state machine. Feed events to :meth:`step`; carry out the commands.

    It is made of three parts: the books (:class:`~mlxd.residency.registry.Registry`:
    records, budget, policies, and the questions asked of them), the primitive moves
    that change them (:class:`~mlxd.residency.moves.Moves`) and the scheduling pass
    that chooses moves (:class:`~mlxd.residency.scheduler.Scheduler`); this class
    turns each event into decisions, in one place (:meth:`step`'s ``match``). The
    properties below are the books' read-only face, for the shell, views and tests.
    """

    def __init__(self, books: Registry) -> None:
        """A core over ``books`` (``Core(Registry(specs, budget_bytes, policy, rules))``),
        which it alone changes from now on."""
        self.books = books
        self.moves = Moves(books)
        self.scheduler = Scheduler(books, self.moves)

    def copy(self) -> Core:
        """An independent core over a copy of the books, to step on (what a plan does)."""
        return Core(self.books.copy())

    # -- the step function -----------------------------------------------------------

    def step(self, event: Event) -> list[Command]:
        """Apply one event; return the commands to carry out, in order.

        Raises :class:`MlxdError` (and changes nothing) for an admin request that
        cannot be honoured (unknown model, unload of a loading model, a reload
        that would replace a live model): :meth:`_refusal` checks before anything moves.
        """
        refused = self._refusal(event)
        if refused is not None:
            raise refused
        self.books.now = max(self.books.now, event.now)
        self.moves.out = []
        self.scheduler.victims = []
        match event:
            case Acquire():
                self._on_acquire(event)
            case ReserveKV():
                self._on_reserve_kv(event)
            case ReturnKV():
                self._on_return_kv(event)
            case CancelWaiter():
                self._on_cancel_waiter(event)
            case LoadFinished():
                self._on_load_finished(event)
            case EngineDeath():
                self._on_engine_death(event)
            case LoadAborted():
                self._on_load_aborted(event)
            case UnloadFinished():
                self._on_unload_finished(event)
            case Release():
                self._on_release(event)
            case Tick():
                self._on_tick(event)
            case AdminUnload():
                self._on_admin_unload(event)
            case SetLoadGate():
                self.books.load_gate = event.reason
            case SetSize():
                self._on_set_size(event)
            case SetLoadTime():
                self._on_set_load_time(event)
            case Shutdown():
                self._begin_shutdown()
            case ShutdownDeadline():
                self._on_shutdown_deadline()
            case Reconfigure():
                self._on_reconfigure(event)
            case _:
                assert_never(event)
        if not self.books.shutting_down:
            self.scheduler.schedule()
        else:
            self.moves.reject_all_waiters()
        out, self.moves.out = self.moves.out, []
        return out

    # -- the books, read-only ----------------------------------------------------------

    @property
    def models(self) -> dict[str, ModelRecord]:
        return self.books.models

    @property
    def waiters(self) -> dict[int, Waiter]:
        return self.books.waiters

    @property
    def lease_model(self) -> dict[str, str]:
        return self.books.lease_model

    @property
    def budget(self) -> int:
        return self.books.budget

    @property
    def policy(self) -> ContentionPolicy:
        return self.books.policy

    @property
    def rules(self) -> ResidencyRules:
        return self.books.rules

    @property
    def load_gate(self) -> str | None:
        return self.books.load_gate

    @property
    def shutting_down(self) -> bool:
        return self.books.shutting_down

    @property
    def now(self) -> float:
        return self.books.now

    @property
    def committed(self) -> int:
        return self.books.committed

    @property
    def shutdown_complete(self) -> bool:
        return self.books.shutdown_complete

    @property
    def victims(self) -> list[Victim]:
        """The victims the last step's scheduling sent out, in order, with their why."""
        return self.scheduler.victims

    def state(self, model: str) -> State:
        return self.books.state(model)

    def next_deadline(self) -> float | None:
        return self.books.next_deadline()

    def unload_due(self, model: str) -> float | None:
        return self.books.unload_due(model)

    def check_invariants(self) -> None:
        self.books.check_invariants()

    def _refusal(self, event: Event) -> MlxdError | None:
        """Why an admin request cannot be honoured (None: it can); changes nothing."""
        models = self.books.models
        match event:
            case AdminUnload(model=name):
                r = models.get(name)
                if r is None:
                    return ModelNotFound(name)
                if r.state is State.LOADING:
                    return Conflict(f"'{name}' is loading; unload it once it is loaded")
            case Reconfigure():
                live = {n for n, r in models.items() if r.state not in DORMANT}
                removed = set(models) - {s.name for s in event.specs}
                busy = sorted((removed | (event.replaced & set(models))) & live)
                if busy:
                    return refusals.live_models_in_reload([(n, models[n].state) for n in busy])
                if event.budget_bytes < self.books.committed:
                    return refusals.budget_below_committed(event.budget_bytes, self.books.committed)
        return None

    # -- event handlers --------------------------------------------------------------

    def _on_acquire(self, ev: Acquire) -> None:
        if ev.model not in self.books.models:
            self.moves.out.append(Reject(ev.waiter_id, ev.model, ModelNotFound(ev.model)))
            return
        if self.books.shutting_down:
            self.moves.out.append(
                Reject(ev.waiter_id, ev.model, ShuttingDown("mlxd is shutting down"))
            )
            return
        p = self.books.policy if ev.contention is None else self.books.policy.at_most(ev.contention)
        keep = ev.keep_alive_s
        clamped = None if keep is None else self.books.rules.keep_alive(keep)
        self._wait(Waiter(ev.waiter_id, ev.model, ev.lease_id, ev.kind, ev.reason, ev.now,
                          *self._bounds(p, ev.now), policy=p, keep_alive_s=clamped))

    @staticmethod
    def _bounds(p: ContentionPolicy, now: float) -> tuple[float | None, float | None]:
        """A waiter's deadline and preempt_at under ``p``: every strategy has the deadline
        (also what `fail` waits for: a load it joins)."""
        bound, delay = p.wait_timeout_s, p.preempt_delay_s
        return (now + bound if bound is not None else None, now + delay if delay is not None else None)

    def _wait(self, w: Waiter) -> None:
        self.books.waiters[w.id] = w
        self.books.models[w.model].enqueue(w)

    def _on_reserve_kv(self, ev: ReserveKV) -> None:
        r = self.books.models.get(ev.model)
        if r is None or self.books.lease_model.get(ev.lease_id) != ev.model:
            error = refusals.kv_without_lease(ev.model)
            self.moves.out.append(Reject(ev.waiter_id, ev.model, error))
            return
        p = self.books.lease_policy.get(ev.lease_id, self.books.policy)
        self._wait(Waiter(ev.waiter_id, ev.model, ev.lease_id, WaiterKind.KV, Reason.REQUEST,
                          ev.now, *self._bounds(p, ev.now), policy=p, kv_bytes=max(0, ev.nbytes)))

    def _on_return_kv(self, ev: ReturnKV) -> None:
        r = self.books.models.get(ev.model)
        if r is not None and r.holds_budget:
            self.moves.return_kv(r, ev.nbytes)

    def _on_cancel_waiter(self, ev: CancelWaiter) -> None:
        w = self.books.waiters.get(ev.waiter_id)
        if w is not None:
            self.moves.drop(w)
            self.moves.maybe_abandon_load(w.model)

    def _on_load_finished(self, ev: LoadFinished) -> None:
        r = self.books.models.get(ev.model)
        if r is None or r.state is not State.LOADING or r.load_id != ev.load_id:
            return
        if ev.error is None:
            self.moves.move(r, State.LOADED, r.load_reason)
            r.last_used = r.loaded_at = ev.now
            r.last_error = None
            return
        for w in list(r.queue.values()):
            self.moves.reject(w, LoadFailed(f"loading '{w.model}' failed: {ev.error}"))
        if ev.stop_error is not None:  # the partial engine may hold memory: stay `loading`
            r.load_cancelling = True
            r.teardown = (State.FAILED, ev.error)
            self.moves.stop_failed(r, ev.stop_error)
            return
        r.last_error = ev.error
        reason = Reason.ENGINE_DIED if ev.died else Reason.LOAD_FAILED
        self.moves.move(r, State.FAILED, reason, error=ev.error)

    def _on_engine_death(self, ev: EngineDeath) -> None:
        r = self.books.models.get(ev.model)
        if r is None or r.state not in SERVING:
            return  # an unload already has it (stopping a dead engine succeeds)
        for lid in list(r.leases):
            self.moves.forget_lease(lid)
        r.leases.clear()
        r.last_error = ev.error
        owner, reason = r.drain_owner, r.out_reason
        r.drain_owner = None
        r.preempted = False
        self.moves.move(r, State.FAILED, Reason.ENGINE_DIED, error=ev.error)
        if owner in (ADMIN_DRAIN, SHUTDOWN_DRAIN):
            self.moves.move(r, State.UNLOADED, reason)  # it was on its way out anyway

    def _on_load_aborted(self, ev: LoadAborted) -> None:
        r = self.books.models.get(ev.model)
        if r is None or r.state is not State.LOADING or r.load_id != ev.load_id:
            return
        if ev.stop_error is not None:  # the partial engine may hold memory: stay `loading`
            r.teardown = (State.UNLOADED, None)
            self.moves.stop_failed(r, ev.stop_error)
            return
        r.load_cancelling = False
        self.moves.move(r, State.UNLOADED, r.abort_reason)

    def _on_unload_finished(self, ev: UnloadFinished) -> None:
        r = self.books.models.get(ev.model)
        if r is None or not r.stopping:
            return
        r.stopping = False
        if ev.error is not None:
            self.moves.stop_failed(r, ev.error)
            if r.state is State.UNLOADING:
                # Shown in the journal; both rows in this one step, so no lease comes between.
                self.moves.move(r, State.LOADED, Reason.UNLOAD_FAILED, error=ev.error)
                self.moves.move(r, State.UNLOADING, Reason.UNLOAD_FAILED)
            return
        r.stop_failures = 0
        r.retry_at = None
        if r.teardown is not None:  # a failed or abandoned load's partial engine
            to, error = r.teardown
            r.teardown = None
            r.load_cancelling = False
            reason = Reason.LOAD_FAILED if to is State.FAILED else r.abort_reason
            if error is not None:
                r.last_error = error
            self.moves.move(r, to, reason, error=error)
        else:
            self.moves.move(r, State.UNLOADED, r.out_reason)

    def _on_release(self, ev: Release) -> None:
        model = self.books.lease_model.get(ev.lease_id)
        if model is None:
            return
        r = self.books.models[model]
        r.leases.discard(ev.lease_id)
        r.last_used = ev.now
        r.keep_alive_s = self.books.lease_keep_alive.get(ev.lease_id)
        self.moves.forget_lease(ev.lease_id)
        if r.state is State.DRAINING and not r.leases:
            self.moves.move(r, State.UNLOADING, r.out_reason)
            self.moves.start_stop(r)
        due = self.books.idle_due(r)
        if due is not None and due <= ev.now:  # keep_alive 0: unload as the lease ends
            self.moves.begin_unload(r, Reason.IDLE_TIMEOUT)

    def _on_tick(self, ev: Tick) -> None:
        for r in self.books.models.values():
            if r.retry_at is not None and ev.now >= r.retry_at:
                self.moves.retry_stop(r)
        for r in self.books.models.values():
            if not r.blocked or r.queue_deadline is None or ev.now < r.queue_deadline:
                continue
            for w in list(r.queue.values()):
                if w.deadline is not None and ev.now >= w.deadline:
                    waited = ev.now - w.since
                    timeout = w.policy.wait_timeout_s
                    self.moves.reject(w, refusals.waited_too_long(w.model, waited, timeout, kv=w.kv_bytes))
            deadlines = [w.deadline for w in r.queue.values() if w.deadline is not None]
            r.queue_deadline = min(deadlines) if deadlines else None
            self.moves.maybe_abandon_load(r.spec.name)
        for r in self.books.models.values():
            due = self.books.idle_due(r)
            if due is not None and ev.now >= due:
                self.moves.begin_unload(r, Reason.IDLE_TIMEOUT)

    def _on_admin_unload(self, ev: AdminUnload) -> None:
        r = self.books.models[ev.model]  # known, not loading: see _refusal
        if r.stuck:
            self.moves.retry_stop(r)  # an operator asking again: do not wait for the backoff
        self.moves.vacate(r, Reason.ADMIN, ADMIN_DRAIN)
        if ev.preempt and r.state is State.DRAINING:
            self.moves.preempt(r, shutdown=False)

    def _on_set_size(self, ev: SetSize) -> None:
        r = self.books.models.get(ev.model)
        if r is not None and ev.size_bytes > 0:
            r.spec = replace(r.spec, size_bytes=int(ev.size_bytes))

    def _on_set_load_time(self, ev: SetLoadTime) -> None:
        r = self.books.models.get(ev.model)
        if r is not None and ev.load_s >= 0:
            r.spec = replace(r.spec, load_s=float(ev.load_s))

    def _begin_shutdown(self) -> None:
        if self.books.shutting_down:
            return
        self.books.shutting_down = True
        for r in self.books.models.values():
            if r.state is State.LOADING and not r.load_cancelling:
                r.load_cancelling = True
                r.abort_reason = Reason.SHUTDOWN
                self.moves.out.append(CancelLoad(r.spec.name, r.load_id))
            elif r.state is State.LOADING:
                r.abort_reason = Reason.SHUTDOWN
            else:
                self.moves.vacate(r, Reason.SHUTDOWN, SHUTDOWN_DRAIN)
            if r.stuck:
                self.moves.retry_stop(r)

    def _on_shutdown_deadline(self) -> None:
        self._begin_shutdown()  # if it had not begun
        for r in self.books.models.values():
            if r.state is State.DRAINING and r.leases:
                self.moves.preempt(r, shutdown=True)

    def _on_reconfigure(self, ev: Reconfigure) -> None:
        new = {s.name: s for s in ev.specs}
        removed = set(self.books.models) - set(new)
        for name in sorted(removed | (ev.replaced & set(self.books.models))):
            r = self.books.models[name]
            if r.state is State.FAILED:
                self.moves.move(r, State.UNLOADED, Reason.CONFIG_RELOAD)
        for name in sorted(removed):
            for w in list(self.books.models[name].queue.values()):
                self.moves.reject(w, ModelNotFound(name))
            del self.books.models[name]
        for name, spec in new.items():
            if name in self.books.models:
                self.books.models[name].spec = spec
            else:
                self.books.models[name] = ModelRecord(spec)
        self.books.budget = ev.budget_bytes
        self.books.policy = ev.policy
        self.books.rules = ev.rules
