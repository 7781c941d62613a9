"""The sans-IO residency core: pure state, budget and policy.

Theory of operation
-------------------
:class:`Core` holds every model's residency state, the memory budget, the
queue of waiters and the live leases. It never awaits and never reads a clock:
the Trio shell (:mod:`mlxd.residency.manager`) turns happenings into :data:`Event` values
carrying ``now`` (monotonic seconds), calls :meth:`Core.step`, and carries out
the :data:`Command` values it returns, in order.

Waiters are served first come, first served. After every event one pass
(:meth:`Core._schedule`) walks the queue and, for each waiter:

* grants a lease (or satisfies a residency waiter) when its model is ``loaded``;
* joins the load when its model is ``loading`` (single flight);
* waits when its model is on its way out (``draining``, ``unloading``, or a
  failed or cancelled load still tearing down): a late joiner starts a fresh
  load. Under ``fail`` it does not wait for a drain, nor for a stuck stop (below);
* otherwise needs a load of ``need`` bytes. The pass tracks ``free`` (budget
  minus committed bytes, minus what earlier waiters already claimed) and
  ``incoming`` (bytes of models already on their way out, not yet claimed;
  under ``fail`` only those whose engine stop is in flight, never a drain). A
  load starts only when ``need <= free``. Otherwise the waiter claims room:
  first idle ``loaded`` models are evicted (least recently used first, never
  pinned), then the contention policy picks busy victims (LRU, never pinned)
  and marks them ``draining``; preempting policies cancel their leases once
  the waiter's ``preempt_at`` has come. A waiter whose room is on its way keeps
  it: later waiters cannot take it (liveness). A waiter that cannot be helped by
  any victim claims nothing, so it does not block the queue behind it.
* A ``draining`` victim that no waiter claims at the end of a pass goes back to
  ``loaded`` (the drain is called off), unless an admin unload or shutdown
  drains it.

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

import itertools
from collections.abc import Iterable
from dataclasses import replace

from mlxd.errors import (
    Conflict,
    JournalError,
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
from mlxd.residency.policy import ContentionPolicy, stop_retry_delay
from mlxd.residency.records import ADMIN_DRAIN, SHUTDOWN_DRAIN, ModelRecord, Waiter
from mlxd.residency.registry import Registry
from mlxd.residency.states import Reason, State, check_transition

# ---- the core --------------------------------------------------------------------------


class Core(Registry):
    """Residency state machine. Feed events to :meth:`step`; carry out the commands."""

    def __init__(self, specs: Iterable[ModelSpec], budget_bytes: int, policy: ContentionPolicy) -> None:
        super().__init__(specs, budget_bytes, policy)
        self._load_ids = itertools.count(1)
        self._out: list[Command] = []

    # -- the step function -----------------------------------------------------------

    def step(self, event: Event) -> list[Command]:
        """Apply one event; return the commands to carry out, in order.

        Raises :class:`MlxdError` (and changes nothing) for an admin request that
        cannot be honoured (unknown model, unload of a loading model, a reload
        that would replace a live model).
        """
        self.now = max(self.now, event.now)
        self._out = []
        handler = getattr(self, "_on_" + type(event).__name__)
        handler(event)
        if not self.shutting_down:
            self._schedule()
        else:
            self._reject_all_waiters()
        out, self._out = self._out, []
        return out

    # -- event handlers --------------------------------------------------------------

    def _on_Acquire(self, ev: Acquire) -> None:
        if ev.model not in self.models:
            self._out.append(Reject(ev.waiter_id, ev.model, ModelNotFound(ev.model)))
            return
        if self.shutting_down:
            self._out.append(
                Reject(ev.waiter_id, ev.model, ShuttingDown("mlxd is shutting down"))
            )
            return
        p = self.policy
        bound = p.wait_timeout_s
        delay = p.preempt_delay_s
        w = Waiter(
            id=ev.waiter_id,
            model=ev.model,
            lease_id=ev.lease_id,
            kind=ev.kind,
            reason=ev.reason,
            since=ev.now,
            deadline=ev.now + bound if bound is not None else None,
            preempt_at=ev.now + delay if delay is not None else None,
        )
        r = self.models[ev.model]
        self.waiters[w.id] = w
        r.queue[w.id] = w
        if w.deadline is not None and (r.queue_deadline is None or w.deadline < r.queue_deadline):
            r.queue_deadline = w.deadline

    def _on_CancelWaiter(self, ev: CancelWaiter) -> None:
        w = self.waiters.get(ev.waiter_id)
        if w is not None:
            self._drop(w)
            self._maybe_abandon_load(w.model)

    def _on_LoadFinished(self, ev: LoadFinished) -> None:
        r = self.models.get(ev.model)
        if r is None or r.state is not State.LOADING or r.load_id != ev.load_id:
            return
        if ev.error is None:
            self._move(r, State.LOADED, r.load_reason)
            r.last_used = ev.now
            r.last_error = None
            return
        for w in list(r.queue.values()):
            self._reject(w, LoadFailed(f"loading '{w.model}' failed: {ev.error}"))
        if ev.stop_error is not None:  # the partial engine may hold memory: stay `loading`
            r.load_cancelling = True
            r.teardown = (State.FAILED, ev.error)
            self._stop_failed(r, ev.stop_error)
            return
        r.last_error = ev.error
        reason = Reason.ENGINE_DIED if ev.died else Reason.LOAD_FAILED
        self._move(r, State.FAILED, reason, error=ev.error)

    def _on_EngineDeath(self, ev: EngineDeath) -> None:
        r = self.models.get(ev.model)
        if r is None or r.state not in (State.LOADED, State.DRAINING):
            return  # an unload already has it (stopping a dead engine succeeds)
        for lid in r.leases:
            self.lease_model.pop(lid, None)
        r.leases.clear()
        r.last_error = ev.error
        owner, reason = r.drain_owner, r.out_reason
        r.drain_owner = None
        r.preempted = False
        self._move(r, State.FAILED, Reason.ENGINE_DIED, error=ev.error)
        if owner in (ADMIN_DRAIN, SHUTDOWN_DRAIN):
            self._move(r, State.UNLOADED, reason)  # it was on its way out anyway

    def _on_LoadAborted(self, ev: LoadAborted) -> None:
        r = self.models.get(ev.model)
        if r is None or r.state is not State.LOADING or r.load_id != ev.load_id:
            return
        if ev.stop_error is not None:  # the partial engine may hold memory: stay `loading`
            r.teardown = (State.UNLOADED, None)
            self._stop_failed(r, ev.stop_error)
            return
        r.load_cancelling = False
        self._move(r, State.UNLOADED, r.abort_reason)

    def _on_UnloadFinished(self, ev: UnloadFinished) -> None:
        r = self.models.get(ev.model)
        if r is None or not r.stopping:
            return
        r.stopping = False
        if ev.error is not None:
            self._stop_failed(r, ev.error)
            if r.state is State.UNLOADING:
                # Shown in the journal; both rows in this one step, so no lease comes between.
                self._move(r, State.LOADED, Reason.UNLOAD_FAILED, error=ev.error)
                self._move(r, State.UNLOADING, Reason.UNLOAD_FAILED)
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
            self._move(r, to, reason, error=error)
        else:
            self._move(r, State.UNLOADED, r.out_reason)

    def _on_Release(self, ev: Release) -> None:
        model = self.lease_model.pop(ev.lease_id, None)
        if model is None:
            return
        r = self.models[model]
        r.leases.discard(ev.lease_id)
        r.last_used = ev.now
        if r.state is State.DRAINING and not r.leases:
            self._move(r, State.UNLOADING, r.out_reason)
            self._start_stop(r)

    def _on_Tick(self, ev: Tick) -> None:
        for r in self.models.values():
            if r.retry_at is not None and ev.now >= r.retry_at:
                self._retry_stop(r)
        for r in self.models.values():
            if not r.blocked or r.queue_deadline is None or ev.now < r.queue_deadline:
                continue
            for w in list(r.queue.values()):
                if w.deadline is not None and ev.now >= w.deadline:
                    waited = ev.now - w.since
                    self._reject(w, refusals.waited_too_long(w.model, waited, self.policy.wait_timeout_s))
            deadlines = [w.deadline for w in r.queue.values() if w.deadline is not None]
            r.queue_deadline = min(deadlines) if deadlines else None
            self._maybe_abandon_load(r.spec.name)
        for r in self.models.values():
            due = self._idle_due(r)
            if due is not None and ev.now >= due:
                self._begin_unload(r, Reason.IDLE_TIMEOUT)

    def _on_AdminUnload(self, ev: AdminUnload) -> None:
        r = self.models.get(ev.model)
        if r is None:
            raise ModelNotFound(ev.model)
        if r.state is State.LOADING:
            raise Conflict(f"'{ev.model}' is loading; unload it once it is loaded")
        if r.stuck:
            self._retry_stop(r)  # an operator asking again: do not wait for the backoff
        self._vacate(r, Reason.ADMIN, ADMIN_DRAIN)
        if ev.preempt and r.state is State.DRAINING:
            self._preempt(r, shutdown=False)

    def _on_SetLoadGate(self, ev: SetLoadGate) -> None:
        self.load_gate = ev.reason

    def _on_SetSize(self, ev: SetSize) -> None:
        r = self.models.get(ev.model)
        if r is not None and ev.size_bytes > 0:
            r.spec = replace(r.spec, size_bytes=int(ev.size_bytes))

    def _on_Shutdown(self, ev: Shutdown) -> None:
        if self.shutting_down:
            return
        self.shutting_down = True
        for r in self.models.values():
            if r.state is State.LOADING and not r.load_cancelling:
                r.load_cancelling = True
                r.abort_reason = Reason.SHUTDOWN
                self._out.append(CancelLoad(r.spec.name, r.load_id))
            elif r.state is State.LOADING:
                r.abort_reason = Reason.SHUTDOWN
            else:
                self._vacate(r, Reason.SHUTDOWN, SHUTDOWN_DRAIN)
            if r.stuck:
                self._retry_stop(r)

    def _on_ShutdownDeadline(self, ev: ShutdownDeadline) -> None:
        if not self.shutting_down:
            self._on_Shutdown(Shutdown(ev.now))
        for r in self.models.values():
            if r.state is State.DRAINING and r.leases:
                self._preempt(r, shutdown=True)

    def _on_Reconfigure(self, ev: Reconfigure) -> None:
        new = {s.name: s for s in ev.specs}
        live = {n for n, r in self.models.items() if r.state not in (State.UNLOADED, State.FAILED)}
        removed = set(self.models) - set(new)
        busy = sorted((removed | (ev.replaced & set(self.models))) & live)
        if busy:
            raise refusals.live_models_in_reload([(n, self.models[n].state) for n in busy])
        if ev.budget_bytes < self.committed:
            raise refusals.budget_below_committed(ev.budget_bytes, self.committed)
        for name in sorted(removed | (ev.replaced & set(self.models))):
            r = self.models[name]
            if r.state is State.FAILED:
                self._move(r, State.UNLOADED, Reason.CONFIG_RELOAD)
        for name in sorted(removed):
            for w in list(self.models[name].queue.values()):
                self._reject(w, ModelNotFound(name))
            del self.models[name]
        for name, spec in new.items():
            if name in self.models:
                self.models[name].spec = spec
            else:
                self.models[name] = ModelRecord(spec)
        self.budget = ev.budget_bytes
        self.policy = ev.policy

    # -- scheduling ------------------------------------------------------------------

    def _schedule(self) -> None:
        # A drain called off turns a victim back to ``loaded``; its waiters are
        # served by the next pass. Passes converge: a called-off victim was
        # claimed by nobody, and nothing else changed in between.
        for _ in range(4):
            if not self._pass():
                break

    def _pass(self) -> bool:
        """One first-come-first-served pass over the models with waiters.

        Models are taken in the order of their earliest waiter; all waiters of a
        model share its fate (lease, load, or wait), so a pass costs O(models).
        Returns True if a drain was called off.
        """
        free = self.budget - self.committed
        incoming = sum(r.committed_bytes for r in self.models.values() if self._outgoing(r))
        claimed: dict[str, str] = {}  # victim on its way out -> model whose waiters claimed it
        waiting = sorted(
            (r for r in self.models.values() if r.queue), key=lambda r: next(iter(r.queue))
        )
        for r in waiting:
            r.claims = []
            if r.state is State.LOADED:
                for w in list(r.queue.values()):
                    self._satisfy(w, r)
                continue
            if r.state is State.LOADING and not r.load_cancelling:
                r.blocked = False
                continue
            r.blocked = True
            if r.state not in (State.UNLOADED, State.FAILED):
                # on its way out, or a failed or cancelled load still tearing down
                if not self.policy.waits and (r.state is State.DRAINING or r.stuck):
                    self._reject_queue(r, refusals.model_leaving(r.spec.name, r.state, r.retry_at, self.now))
                continue
            name, need = r.spec.name, r.spec.size_bytes
            if need > self.budget:
                self._reject_queue(r, refusals.exceeds_budget(name, need, self.budget))
                continue
            if self.load_gate is not None:
                self._reject_queue(r, JournalError(f"new loads are refused: {self.load_gate}"))
                continue
            if need <= free:
                free -= need
                self._start_load(r)
                continue
            free, incoming = self._make_room(r, need, free, incoming, claimed)
        called_off = self._call_off_unclaimed(claimed)
        self._preempt_due()
        return called_off

    def _make_room(
        self, r: ModelRecord, need: int, free: int, incoming: int, claimed: dict[str, str]
    ) -> tuple[int, int]:
        """``r``'s waiters need ``need`` bytes more than are free: evict, drain or refuse.

        Returns the pass's ``free`` and ``incoming`` after ``r`` claimed its room.
        """
        name = r.spec.name
        idle = self._lru(busy=False, exclude=name)
        busy = self._lru(busy=True, exclude=name) if self.policy.waits else []
        idle_bytes = sum(v.committed_bytes for v in idle)
        busy_bytes = sum(v.committed_bytes for v in busy)
        if free + incoming + idle_bytes < need and not self.policy.waits:
            self._reject_queue(r, refusals.no_room(name, need, self.committed, self.budget))
            return free, incoming
        if free + incoming + idle_bytes + busy_bytes < need:
            return free, incoming  # no victim can make room now: claim nothing, touch nothing
        # Room is short: idle victims first (LRU), then busy ones per the policy.
        for v in idle:
            if free + incoming >= need:
                break
            incoming += v.committed_bytes
            self._begin_unload(v, Reason.EVICTED)
        drain_reason = Reason.PREEMPTED if self.policy.strategy == "preempt" else Reason.EVICTED
        for v in busy:
            if free + incoming >= need:
                break
            incoming += v.committed_bytes
            self._begin_drain(v, drain_reason, owner=None)
        take_free = min(free, need)
        free -= take_free
        incoming -= need - take_free
        self._claim_victims(r, need - take_free, claimed)
        return free, incoming

    def _drop(self, w: Waiter) -> None:
        del self.waiters[w.id]
        r = self.models.get(w.model)
        if r is not None:
            r.queue.pop(w.id, None)
            if not r.queue:
                r.blocked = False
                r.queue_deadline = None
                r.claims = []

    def _satisfy(self, w: Waiter, r: ModelRecord) -> None:
        self._drop(w)
        if w.kind is WaiterKind.LEASE:
            r.leases.add(w.lease_id)
            self.lease_model[w.lease_id] = r.spec.name
            r.last_used = self.now
            self._out.append(Grant(w.id, r.spec.name, w.lease_id))
        else:
            self._out.append(Satisfy(w.id, r.spec.name))

    def _reject(self, w: Waiter, error: MlxdError) -> None:
        self._drop(w)
        self._out.append(Reject(w.id, w.model, error))

    def _reject_queue(self, r: ModelRecord, error: MlxdError) -> None:
        for w in list(r.queue.values()):
            self._reject(w, error)

    def _reject_all_waiters(self) -> None:
        for w in list(self.waiters.values()):
            self._reject(w, ShuttingDown("mlxd is shutting down"))

    def _start_load(self, r: ModelRecord) -> None:
        head = r.head
        reason = head.reason if head is not None else Reason.REQUEST
        r.load_id = next(self._load_ids)
        r.load_reason = reason
        r.committed_bytes = r.spec.size_bytes
        r.load_cancelling = False
        r.abort_reason = Reason.ABANDONED
        self._move(r, State.LOADING, reason)
        r.blocked = False
        self._out.append(StartLoad(r.spec.name, r.load_id))

    def _maybe_abandon_load(self, model: str) -> None:
        r = self.models.get(model)
        if r is None or r.state is not State.LOADING or r.load_cancelling:
            return
        if r.queue:
            return
        r.load_cancelling = True
        r.abort_reason = Reason.ABANDONED
        self._out.append(CancelLoad(model, r.load_id))

    def _lru(self, busy: bool, exclude: str) -> list[ModelRecord]:
        cands = [
            r
            for name, r in self.models.items()
            if name != exclude
            and r.state is State.LOADED
            and not r.spec.pinned
            and bool(r.leases) == busy
        ]
        return sorted(cands, key=lambda r: (r.last_used or 0.0, r.spec.name))

    def _outgoing(self, v: ModelRecord) -> bool:
        """Whether a waiter may count on ``v``'s bytes coming free (claim them)."""
        if v.stuck:
            return False  # its stop failed; not until the retry
        if v.state is State.UNLOADING:
            return True
        return v.state is State.DRAINING and self.policy.waits  # `fail` never waits for a drain

    def _claim_victims(self, r: ModelRecord, rest: int, claimed: dict[str, str]) -> None:
        """Let ``r``'s waiters claim unclaimed bytes on their way out, unloading ones first."""
        if rest <= 0:
            return
        outgoing = sorted(
            (v for v in self.models.values() if self._outgoing(v) and v.spec.name not in claimed),
            key=lambda v: (v.state is State.DRAINING, v.last_used or 0.0, v.spec.name),
        )
        for v in outgoing:
            if rest <= 0:
                break
            claimed[v.spec.name] = r.spec.name
            rest -= v.committed_bytes
            if v.state is State.DRAINING:
                r.claims.append(v.spec.name)

    def _call_off_unclaimed(self, claimed: dict[str, str]) -> bool:
        called_off = False
        for r in self.models.values():
            if r.state is State.DRAINING and r.drain_owner is None and r.spec.name not in claimed:
                r.preempted = False
                self._move(r, State.LOADED, Reason.ABANDONED)
                called_off = True
        return called_off

    def _preempt_due(self) -> None:
        for r in self.models.values():
            head = r.head
            if head is None or head.preempt_at is None or self.now < head.preempt_at:
                continue
            for name in r.claims:
                v = self.models[name]
                if v.state is State.DRAINING and not v.preempted:
                    v.out_reason = Reason.PREEMPTED
                    self._preempt(v, shutdown=False)

    # -- moves -----------------------------------------------------------------------

    def _vacate(self, r: ModelRecord, reason: Reason, owner: int) -> None:
        """Send a model on its way out for an admin unload or shutdown (never called off)."""
        if r.state is State.FAILED:
            self._move(r, State.UNLOADED, reason)
        elif r.state is State.LOADED:
            if r.leases:
                self._begin_drain(r, reason, owner)
            else:
                self._begin_unload(r, reason)
        elif r.state is State.DRAINING:
            r.drain_owner = owner
            r.out_reason = reason

    def _begin_unload(self, r: ModelRecord, reason: Reason) -> None:
        r.out_reason = reason
        self._move(r, State.UNLOADING, reason)
        self._start_stop(r)

    def _start_stop(self, r: ModelRecord) -> None:
        r.stopping = True
        self._out.append(StartUnload(r.spec.name))

    def _stop_failed(self, r: ModelRecord, error: str) -> None:
        """The engine stop failed: keep its bytes, retry after a growing delay."""
        r.stop_failures += 1
        r.last_error = error
        r.retry_at = self.now + stop_retry_delay(r.stop_failures)

    def _retry_stop(self, r: ModelRecord) -> None:
        r.retry_at = None
        self._start_stop(r)

    def _begin_drain(self, r: ModelRecord, reason: Reason, owner: int | None) -> None:
        r.out_reason = reason
        r.drain_owner = owner
        r.preempted = False
        self._move(r, State.DRAINING, reason)

    def _preempt(self, r: ModelRecord, *, shutdown: bool) -> None:
        r.preempted = True
        if shutdown:
            r.out_reason = Reason.SHUTDOWN
        if r.leases:
            self._out.append(Preempt(r.spec.name, tuple(sorted(r.leases)), shutdown=shutdown))

    def _move(
        self, r: ModelRecord, to: State, reason: Reason, *, error: str | None = None
    ) -> None:
        check_transition(r.spec.name, r.state, to)
        frm, r.state = r.state, to
        if to in (State.UNLOADED, State.LOADED, State.LOADING):
            r.drain_owner = None
        self._out.append(Transition(r.spec.name, frm, to, reason, r.committed_bytes, error))

