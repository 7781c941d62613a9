"""The sans-IO residency core: pure state, budget and policy.

Theory of operation
-------------------
:class:`Core` holds every model's residency state, the memory budget, the
queue of waiters and the live leases. It never awaits and never reads a clock:
the Trio shell (:mod:`mlxd.residency.manager`) turns happenings into :data:`Event` values
carrying ``now`` (monotonic seconds), calls :meth:`Core.step`, and carries out
the :data:`Command` values it returns, in order.

After the event's own handling, one scheduling pass
(:mod:`mlxd.residency.scheduler`) decides who is served, who loads and who
makes room (priorities, eviction rule, contention policy, anti-thrash); its
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

from mlxd.errors import (
    Conflict,
    LoadFailed,
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
from mlxd.residency.policy import ContentionPolicy
from mlxd.residency.records import ADMIN_DRAIN, SHUTDOWN_DRAIN, ModelRecord, Waiter
from mlxd.residency.scheduler import Scheduler
from mlxd.residency.states import DORMANT, SERVING, Reason, State

# ---- the core --------------------------------------------------------------------------


class Core(Scheduler):
    """Residency state machine. Feed events to :meth:`step`; carry out the commands.

    The state and the primitive moves live in :class:`~mlxd.residency.moves.CoreState`,
    the scheduling pass in :class:`~mlxd.residency.scheduler.Scheduler`; this class
    turns each event into decisions.
    """

    # -- the step function -----------------------------------------------------------

    def step(self, event: Event) -> list[Command]:
        """Apply one event; return the commands to carry out, in order.

        Raises :class:`MlxdError` (and changes nothing) for an admin request that
        cannot be honoured (unknown model, unload of a loading model, a reload
        that would replace a live model).
        """
        self.now = max(self.now, event.now)
        self._out = []
        self.victims = []
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
        p = self.policy if ev.contention is None else self.policy.at_most(ev.contention)
        keep = ev.keep_alive_s
        clamped = None if keep is None else self.rules.keep_alive(keep)
        self._wait(Waiter(ev.waiter_id, ev.model, ev.lease_id, ev.kind, ev.reason, ev.now,
                          *self._bounds(p, ev.now), policy=p, keep_alive_s=clamped))

    @staticmethod
    def _bounds(p: ContentionPolicy, now: float) -> tuple[float | None, float | None]:
        """A waiter's deadline and preempt_at under ``p``: every strategy has the deadline
        (also what `fail` waits for: a load it joins)."""
        bound, delay = p.wait_timeout_s, p.preempt_delay_s
        return (now + bound if bound is not None else None, now + delay if delay is not None else None)

    def _wait(self, w: Waiter) -> None:
        self.waiters[w.id] = w
        self.models[w.model].enqueue(w)

    def _on_ReserveKV(self, ev: ReserveKV) -> None:
        r = self.models.get(ev.model)
        if r is None or self.lease_model.get(ev.lease_id) != ev.model:
            error = refusals.kv_without_lease(ev.model)
            self._out.append(Reject(ev.waiter_id, ev.model, error))
            return
        p = self.lease_policy.get(ev.lease_id, self.policy)
        self._wait(Waiter(ev.waiter_id, ev.model, ev.lease_id, WaiterKind.KV, Reason.REQUEST,
                          ev.now, *self._bounds(p, ev.now), policy=p, kv_bytes=max(0, ev.nbytes)))

    def _on_ReturnKV(self, ev: ReturnKV) -> None:
        r = self.models.get(ev.model)
        if r is not None and r.holds_budget:
            self._return_kv(r, ev.nbytes)

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
            r.last_used = r.loaded_at = ev.now
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
        if r is None or r.state not in SERVING:
            return  # an unload already has it (stopping a dead engine succeeds)
        for lid in list(r.leases):
            self._forget_lease(lid)
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
        model = self.lease_model.get(ev.lease_id)
        if model is None:
            return
        r = self.models[model]
        r.leases.discard(ev.lease_id)
        r.last_used = ev.now
        r.keep_alive_s = self.lease_keep_alive.get(ev.lease_id)
        self._forget_lease(ev.lease_id)
        if r.state is State.DRAINING and not r.leases:
            self._move(r, State.UNLOADING, r.out_reason)
            self._start_stop(r)
        due = self._idle_due(r)
        if due is not None and due <= ev.now:  # keep_alive 0: unload as the lease ends
            self._begin_unload(r, Reason.IDLE_TIMEOUT)

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
                    timeout = w.policy.wait_timeout_s
                    self._reject(w, refusals.waited_too_long(w.model, waited, timeout, kv=w.kv_bytes))
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

    def _on_SetLoadTime(self, ev: SetLoadTime) -> None:
        r = self.models.get(ev.model)
        if r is not None and ev.load_s >= 0:
            r.spec = replace(r.spec, load_s=float(ev.load_s))

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
        live = {n for n, r in self.models.items() if r.state not in DORMANT}
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
        self.rules = ev.rules
