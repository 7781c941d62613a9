"""The Trio shell around the residency core.

:class:`Manager` owns one nursery (:meth:`Manager.run`). It turns happenings
(an acquire, a waiter cancelled, a load finished, a timer firing) into events
for :class:`mlxd.residency.core.Core`, and carries out the commands the core returns:
loads and unloads run as tasks in the manager's nursery (never in a request's
task, so a cancelled request cannot take a shared load down with it), grants
wake waiters, preemption cancels lease scopes, transitions go to subscribers.

All of that happens synchronously inside :meth:`Manager._dispatch` (an event raised
meanwhile is stepped after, see :mod:`.steps`); the only awaits are waiting (for a
grant, for a state) and the engines' own work.

``async with manager.lease("qwen") as lease:`` waits for a lease and releases
it however the block ends (:mod:`mlxd.residency.lease`). The core is private:
HTTP, metrics and the daemon read it through the queries (:meth:`Manager.snapshot`,
:meth:`Manager.model_snapshot`, ...), frozen copies that change nothing.

Shutdown (:meth:`Manager.shutdown`) has a hard limit: after the grace it preempts
what is left; at the limit it ends every lease still open, abandons the engine
stops in flight (the run is then not *whole*: no clean stop) and closes.
"""

from __future__ import annotations

import collections
import itertools
import logging
import math
import os
import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any

import trio

from mlxd.config import Config, Measurement, ModelConfig
from mlxd.engines.base import Engine, LoadProgress, loaded_weights
from mlxd.errors import EngineDied, EngineError, MlxdError, ModelNotFound
from mlxd.errors import describe_error as describe
from mlxd.residency import views
from mlxd.residency.core import Core
from mlxd.residency.estimates import Estimates
from mlxd.residency.events import (
    LeaseAcquired,
    ManagerEvent,
    MeasurementEvent,
    TransitionEvent,
)
from mlxd.residency.kv import draw_kv
from mlxd.residency.lease import Lease, Ticket, abandon, end_when_overdue, new_lease_id
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
    Preempt,
    Reconfigure,
    Reject,
    Release,
    ReserveKV,
    ReturnKV,
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
from mlxd.residency.plan import Plan, plan
from mlxd.residency.policy import ContentionPolicy
from mlxd.residency.records import ModelSnapshot, ResidencySnapshot
from mlxd.residency.registry import Registry
from mlxd.residency.states import SERVING, Outcome, Reason, State
from mlxd.residency.stats import ModelStats, totals
from mlxd.residency.steps import Steps
from mlxd.residency.stops import DeathWatch, EngineStops

log = logging.getLogger("mlxd.residency.manager")

EngineFactory = Callable[[ModelConfig], Engine]
Subscriber = Callable[[ManagerEvent], object]


class Manager:
    """Decides which models are resident; see the module docstring."""

    def __init__(
        self,
        config: Config,
        engines: EngineFactory,
        *,
        measured: Mapping[str, Measurement] | None = None,
        load_times: Mapping[str, float] | None = None,
        wall_clock: Callable[[], float] = time.time,
        stop_timeout_s: float | None = None,
    ) -> None:
        """``measured`` and ``load_times``: each model's latest measured size and load seconds.
        New loads are refused while :meth:`set_load_gate` holds a reason (the daemon sets it
        when the journal's health changes)."""
        self.config = config
        self._engines_factory = engines
        #: each model's memory estimate and measured load time
        self.estimates = Estimates(measured, load_times)
        self._wall = wall_clock
        self._stops = EngineStops(stop_timeout_s or config.manager.stop_timeout_s)
        m = config.manager
        #: the sans-IO core: private to the manager; read through the queries below
        specs = [self.estimates.spec(model, config) for model in config.models]
        self._core = Core(Registry(specs, m.memory_budget_bytes, m.contention_policy, m.rules))
        self._subscribers: tuple[Subscriber, ...] = ()
        self._lease_salt = os.urandom(4).hex()
        self._lease_counter = itertools.count()
        self._waiters: dict[int, Ticket] = {}
        self._leases: dict[str, Lease] = {}
        self._engines: dict[str, Engine] = {}
        self._loads: dict[str, views.LoadInfo] = {}
        self._load_scopes: dict[str, tuple[int, trio.CancelScope]] = {}
        self._deaths = DeathWatch(self._engine_died)
        self._ids = itertools.count(1)
        self._nursery: trio.Nursery | None = None
        self._timer_scope: trio.CancelScope | None = None
        self._changed = trio.Event()
        self._closed = trio.Event()
        self._steps = Steps(self._core, self._execute)
        self.last_transition: dict[str, Transition] = {}
        #: every transition so far is counted; the latest few are kept for waiters
        #: that must not miss a state that came and went within one step
        self._transition_count = 0
        self._recent_transitions: collections.deque[Transition] = collections.deque(maxlen=256)
        #: what happened to each configured model in this run (read by /metrics)
        self.stats: dict[str, ModelStats] = {m.name: ModelStats() for m in config.models}

    def _engine_config(self, mc: ModelConfig) -> ModelConfig:
        """The model's config with the prompt cache this load committed, for its engine (its
        KV floor is the same rule's; a ``kv_cache_gb`` left out stays out: KV is drawn)."""
        est = self.estimates.get(mc.name)
        if est is None or not mc.engine_kind.kv or not est.kv_cache:
            return mc  # unknown KV size: the engine bounds its batch by max_batch_size only
        return replace(mc, prompt_cache_bytes=est.prompt_cache)

    # -- lifecycle -------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve until :meth:`shutdown` has unloaded everything (or until cancelled)."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._timer)
                task_status.started()
                await self._closed.wait()
                nursery.cancel_scope.cancel()
        finally:
            self._nursery = None  # a lease ended after this starts no task

    async def _timer(self) -> None:
        while True:
            deadline = self._core.next_deadline()
            with trio.CancelScope(deadline=deadline if deadline is not None else math.inf) as cs:
                self._timer_scope = cs
                await trio.sleep_forever()
            self._timer_scope = None
            self._dispatch(Tick(trio.current_time()))

    def subscribe(self, callback: Subscriber) -> None:
        """Call ``callback`` synchronously with every transition, lease, measurement and KV peak."""
        self._subscribers = (*self._subscribers, callback)  # a new tuple: _emit needs no copy

    # -- public operations -----------------------------------------------------------

    def has_model(self, name: str) -> bool:
        return name in self._core.models

    async def acquire(self, model: str, **asked: Any) -> Lease:
        """Wait for a lease on ``model`` (``asked``: :meth:`enqueue`'s keywords); raises a typed
        :class:`MlxdError` if none can be had. A cancelled caller leaves the queue (the last
        waiter of a load in flight abandons it)."""
        ticket = self.enqueue(model, **asked)
        try:
            await ticket.done.wait()
        except BaseException as e:
            ticket.cancel(e)
            raise
        return ticket.result()

    def enqueue(
        self,
        model: str,
        *,
        request_id: str | None = None,
        route: str | None = None,
        cancel_outcome: Outcome = Outcome.CANCELLED,
        client: str | None = None,
        keep_alive_s: float | None = None,
        contention: ContentionPolicy | None = None,
    ) -> Ticket:
        """Queue a request for a lease on ``model`` without waiting for it (see :class:`Ticket`).
        ``cancel_outcome``: the lease's if its holder is cancelled (HTTP: ``disconnected``);
        ``client``: the request's API key name (journaled with the lease);
        ``keep_alive_s``, ``contention``: what the request asked for (see :class:`Acquire`)."""
        if not self.has_model(model):
            raise ModelNotFound(model)
        ticket = self._new_waiter(model, WaiterKind.LEASE, request_id, route)
        ticket.cancel_outcome, ticket.client = cancel_outcome, client
        lease_id = new_lease_id(self._lease_salt, self._lease_counter)
        self._dispatch(Acquire(ticket.id, model, lease_id, trio.current_time(),
                               keep_alive_s=keep_alive_s, contention=contention))
        if ticket.loading:  # it joined a load in flight
            ticket.moved.set()
        return ticket

    @asynccontextmanager
    async def lease(self, model: str, **asked: Any) -> AsyncIterator[Lease]:
        async with await self.acquire(model, **asked) as lease:
            yield lease

    async def load(self, model: str, *, reason: Reason = Reason.ADMIN) -> dict[str, Any]:
        """Make ``model`` resident. The request stays even if the caller leaves.

        Returns the model's status as it was when it became resident (by the
        time the caller runs, an unload may have begun).
        """
        w = self.request_residency(model, reason=reason)
        await w.done.wait()
        if w.error is not None:
            raise w.error
        assert w.status is not None
        return w.status

    def request_residency(self, model: str, *, reason: Reason) -> Ticket:
        """Start making ``model`` resident (preload, restore, admin); never abandoned."""
        if not self.has_model(model):
            raise ModelNotFound(model)
        w = self._new_waiter(model, WaiterKind.RESIDENT, None, None)
        self._dispatch(Acquire(w.id, model, "", trio.current_time(), kind=w.kind, reason=reason))
        return w

    async def unload(self, model: str, *, preempt: bool = False) -> None:
        """Unload ``model`` (draining live leases, or preempting them when asked).

        Returns once the model has reached ``unloaded`` since this call, even if a
        new request loads it again right after; raises if the engine stop failed.
        """
        if not self.has_model(model):
            raise ModelNotFound(model)
        mark = self._transition_count
        self._dispatch(AdminUnload(model, trio.current_time(), preempt=preempt))
        while True:
            for t in self._transitions_since(mark, model):
                if t.to_state is State.UNLOADED:
                    return
                if t.reason is Reason.UNLOAD_FAILED:
                    raise EngineError(f"unloading '{model}' failed: {t.error}")
            if self._core.state(model) is State.UNLOADED:
                return  # it was unloaded already
            mark = self._transition_count
            await self._changed.wait()

    def _transitions_since(self, mark: int, model: str) -> list[Transition]:
        newer = self._transition_count - mark
        recent = list(itertools.islice(reversed(self._recent_transitions), newer))
        return [t for t in reversed(recent) if t.model == model]

    async def reload(self, config: Config) -> dict[str, list[str]]:
        """Adopt a new config: add, remove or replace dormant models (409 for live ones)."""
        old = {m.name: m for m in self.config.models}
        new = {m.name: m for m in config.models}
        replaced = frozenset(n for n in old.keys() & new.keys() if old[n] != new[n])
        specs = tuple(self.estimates.spec(m, config) for m in config.models)
        m = config.manager
        self._dispatch(Reconfigure(specs, m.memory_budget_bytes, m.contention_policy,
                                   trio.current_time(), replaced=replaced, rules=m.rules))
        self.config = config
        self.stats = {name: self.stats.get(name) or ModelStats() for name in new}
        return {
            "added": sorted(new.keys() - old.keys()),
            "removed": sorted(old.keys() - new.keys()),
            "replaced": sorted(replaced),
            "unchanged": sorted(n for n in old.keys() & new.keys() if n not in replaced),
        }

    def set_load_gate(self, reason: str | None) -> None:
        """Refuse new loads with ``reason`` (e.g. the journal cannot write); None allows them."""
        if reason != self._core.load_gate:
            self._dispatch(SetLoadGate(reason, trio.current_time()))

    async def shutdown(self, grace_s: float, *, limit_s: float | None = None) -> bool:
        """Drain for ``grace_s``, then preempt what is left, cancel loads and unload all.

        At ``limit_s`` (default: the grace plus the stop timeout) leases still open
        are ended (``shutdown``) and engine stops in flight abandoned. True when the
        run is *whole*: every model ``unloaded``/``failed``, every lease ended, in time.
        """
        t0 = trio.current_time()
        limit = t0 + (limit_s if limit_s is not None else grace_s + self._stops.timeout_s)
        self._dispatch(Shutdown(t0))
        with trio.move_on_at(min(t0 + grace_s, limit)):
            await self._wait_until(self._whole)
        self._dispatch(ShutdownDeadline(trio.current_time()))
        with trio.move_on_at(limit):
            await self._wait_until(self._whole)
        whole = self._whole()
        if not whole:
            log.warning("shutdown: gave up after %.1f s with %d lease(s) open; status: %s",
                        trio.current_time() - t0, len(self._leases), self.status()["models"])
            self._stops.abandon_all()
            await abandon(self._leases.values())
        self._closed.set()
        return whole

    def _whole(self) -> bool:
        return self._core.shutdown_complete and not self._leases

    # -- status ----------------------------------------------------------------------

    @property
    def counters(self) -> dict[str, int]:
        """Run-wide loads, load failures, evictions and preemptions (sums of :attr:`stats`)."""
        return totals(self.stats)

    def loads_in_flight(self) -> list[views.LoadInfo]:
        return list(self._loads.values())

    def model_status(self, name: str) -> dict[str, Any]:
        """One model's residency as ``/v1/models`` and ``/admin/status`` show it."""
        return views.model_status(self, name)

    def status(self) -> dict[str, Any]:
        """The whole residency picture (``/admin/status``)."""
        return views.status(self)

    def wall_of(self, mono: float | None) -> float | None:
        """The wall-clock time of a monotonic instant (None stays None)."""
        if mono is None:
            return None
        return self._wall() - (trio.current_time() - mono)

    # -- queries: the core is private; HTTP, metrics and the daemon read these --------

    def model_names(self) -> list[str]:
        """The configured models, in config order."""
        return list(self._core.models)

    def state_of(self, name: str) -> State:
        """``name``'s residency state (KeyError if it is not configured)."""
        return self._core.state(name)

    def model_snapshot(self, name: str) -> ModelSnapshot:
        """``name``'s residency now, as a frozen copy (KeyError if it is not configured)."""
        return ModelSnapshot.of(self._core.models[name], self._core.unload_due(name))

    def snapshot(self) -> ResidencySnapshot:
        """The budget, policy, load gate, waiters and each model's state now, as a frozen copy."""
        c = self._core
        return ResidencySnapshot(c.budget, c.committed, c.policy, c.rules, c.shutting_down,
                                 c.load_gate, tuple(c.waiters.values()),
                                 tuple((n, r.state, len(r.leases), r.stop_failures)
                                       for n, r in c.models.items()))

    def plan(self, model: str, *, contention: ContentionPolicy | None = None,
             kv_bytes: int = 0) -> Plan:
        """What acquiring ``model`` now would do (:func:`mlxd.residency.plan.plan`); changes nothing."""
        return plan(self._core, model, trio.current_time(), contention=contention, kv_bytes=kv_bytes)

    def load_joinable(self, model: str) -> bool:
        """Whether a new waiter of ``model`` would join its load in flight (not wait for room)."""
        r = self._core.models.get(model)
        return r is not None and r.state is State.LOADING and not r.load_cancelling

    def kv_room(self, model: str) -> int:
        """The most KV ``model`` could hold: the budget less what its load committed."""
        r = self._core.models.get(model)
        return 0 if r is None else max(0, self._core.budget - (r.committed_bytes - r.kv_bytes))

    def engine_of(self, model: str) -> Engine | None:
        """The engine of ``model`` while one is resident (or held by a failed stop)."""
        return self._engines.get(model)

    def leases(self) -> list[Lease]:
        """The leases held now."""
        return list(self._leases.values())

    # -- what leases and KV brokers ask of the manager ----------------------------

    def withdraw(self, waiter_id: int) -> None:
        """Take waiter ``waiter_id`` out of its queue, if it is still waiting."""
        if self._waiters.pop(waiter_id, None) is not None:
            self._dispatch(CancelWaiter(waiter_id, trio.current_time()))

    def ask_kv(self, model: str, lease_id: str, nbytes: int,
               answer: Callable[[MlxdError | None], None]) -> Ticket:
        """Queue ``nbytes`` of KV for ``lease_id`` (:mod:`.kv`); ``answer(None or error)`` once settled."""
        ticket = Ticket(self, next(self._ids), model, None, None, WaiterKind.KV)
        self._waiters[ticket.id] = ticket
        ticket.on_settle = lambda: answer(ticket.error)
        self._dispatch(ReserveKV(ticket.id, model, lease_id, nbytes, trio.current_time()))
        return ticket

    def return_kv(self, model: str, nbytes: int) -> None:
        """``model``'s batch gave back ``nbytes`` of the KV it reserved."""
        self._dispatch(ReturnKV(model, nbytes, trio.current_time()))

    # -- internals -------------------------------------------------------------------

    def _new_waiter(
        self, model: str, kind: WaiterKind, request_id: str | None, route: str | None
    ) -> Ticket:
        if self._nursery is None:
            raise RuntimeError("Manager.run() must be started before use")
        w = Ticket(self, next(self._ids), model, request_id, route, kind)
        self._waiters[w.id] = w
        return w

    async def _wait_until(self, predicate: Callable[[], bool]) -> None:
        while not predicate():
            await self._changed.wait()

    def lease_ended(self, lease: Lease) -> None:
        """``lease`` has ended (its :meth:`~mlxd.residency.lease.Lease.end`): journal it, free its room."""
        if self._leases.pop(lease.id, None) is None:
            return  # ended when shutdown gave up; its outcome is journaled already
        self._emit(lease.released_event(self._wall()))
        self._dispatch(Release(lease.id, trio.current_time()))

    def _emit(self, event: ManagerEvent) -> None:
        for cb in self._subscribers:
            try:
                cb(event)
            except Exception:  # a subscriber must never break residency
                log.exception("event subscriber %r failed", cb)

    def _dispatch(self, event: Event) -> None:
        """Step the core (:class:`~mlxd.residency.steps.Steps`: a follow-up waits its turn)."""
        if self._steps.run(event) and self._timer_scope is not None:
            d = self._core.next_deadline()
            self._timer_scope.deadline = d if d is not None else math.inf

    def _execute(self, cmd: Command) -> None:
        if isinstance(cmd, Transition):
            self._on_transition(cmd)
        elif isinstance(cmd, Grant):
            w = self._waiters.pop(cmd.waiter_id, None)
            engine = self._engines[cmd.model]
            lease = Lease(self, cmd.lease_id, cmd.model, engine, None, None)
            if w is not None:
                lease.adopt(w)
            self._leases[lease.id] = lease
            self._emit(LeaseAcquired(lease.id, cmd.model, lease.request_id, lease.route,
                                     self._wall(), lease.client))
            if w is None:  # the waiter is gone; give the lease straight back
                lease.end(Outcome.CANCELLED)
            else:
                w.lease = lease
                w.settle()
        elif isinstance(cmd, (Satisfy, Reject)):
            w = self._waiters.pop(cmd.waiter_id, None)
            if w is not None:
                if isinstance(cmd, Reject):
                    w.error = cmd.error
                    if w.kind is WaiterKind.RESIDENT:
                        log.warning("residency of %s refused: %s", cmd.model, cmd.error.message)
                elif w.kind is WaiterKind.RESIDENT:
                    w.status = self.model_status(cmd.model)
                w.settle()
        elif self._nursery is None or self._closed.is_set():
            log.warning("manager closed: %s not carried out", cmd)
        elif isinstance(cmd, StartLoad):
            self._loads[cmd.model] = views.LoadInfo(cmd.model, cmd.load_id, trio.current_time())
            # The scope exists before the task runs, so a CancelLoad that comes first
            # (the only waiter left at once) still cancels this very load.
            scope = trio.CancelScope()
            self._load_scopes[cmd.model] = (cmd.load_id, scope)
            self._nursery.start_soon(self._load_task, cmd.model, cmd.load_id, scope)
            for w in [w for w in self._waiters.values() if w.model == cmd.model]:
                w.moved.set()  # streams show its progress now
        elif isinstance(cmd, CancelLoad):
            entry = self._load_scopes.get(cmd.model)
            if entry is not None and entry[0] == cmd.load_id:
                entry[1].cancel()
        elif isinstance(cmd, StartUnload):
            self._nursery.start_soon(self._unload_task, cmd.model)
        elif isinstance(cmd, Preempt):
            if not cmd.shutdown:
                self.stats.setdefault(cmd.model, ModelStats()).preemptions += len(cmd.lease_ids)
            for lid in cmd.lease_ids:
                victim = self._leases.get(lid)
                if victim is not None and not victim.preempted:
                    victim.preempt(cmd.shutdown)
                    self._nursery.start_soon(end_when_overdue, victim)

    def _on_transition(self, t: Transition) -> None:
        self.last_transition[t.model] = t
        self._transition_count += 1
        self._recent_transitions.append(t)
        self.stats.setdefault(t.model, ModelStats()).count_transition(t.to_state, t.reason)
        self._emit(TransitionEvent.of(t, self._wall()))
        self._changed.set()
        self._changed = trio.Event()

    async def _load_task(self, model: str, load_id: int, scope: trio.CancelScope) -> None:
        mc = self.config.model(model)
        info = self._loads[model]
        error: str | None = None
        died = False
        engine: Engine | None = None
        weights: str | None = None
        t0 = trio.current_time()

        def progress(p: LoadProgress) -> None:
            info.progress = p

        try:
            with scope:
                try:
                    if mc is None:
                        raise ModelNotFound(model)
                    engine = self._engines_factory(self._engine_config(mc))
                    draw_kv(self, model, engine)
                    await engine.load(progress)
                    weights = await loaded_weights(mc)
                except Exception as e:
                    log.warning("loading %s failed: %s", model, describe(e))
                    error = describe(e)
                    died = isinstance(e, EngineDied)
        except BaseException:
            # The manager itself is being torn down: free the partial engine, then go.
            if engine is not None:
                await self._stops.stop(model, engine)
            raise
        finally:
            self._load_scopes.pop(model, None)
            self._loads.pop(model, None)
        now = trio.current_time()
        if scope.cancel_called or error is not None:
            stop_error: str | None = None
            if engine is not None:
                stop_error = await self._stops.stop(model, engine)
                if stop_error is not None:  # it may hold memory: kept until a stop succeeds
                    self._engines[model] = engine
            if scope.cancel_called:
                self._dispatch(LoadAborted(model, load_id, trio.current_time(), stop_error))
            else:
                at = trio.current_time()
                self._dispatch(LoadFinished(model, load_id, at, error, stop_error, died=died))
            return
        assert engine is not None
        self._engines[model] = engine
        measured = engine.measured_bytes()
        measurement = Measurement(measured, weights) if measured else None
        size = self.estimates.loaded(model, now - t0, measurement, self.config)
        if measured:
            self._emit(MeasurementEvent(model, self._wall(), measured, now - t0, weights))
        if size is not None:
            self._dispatch(SetSize(model, size, now))
        assert self._nursery is not None
        self._deaths.watch(self._nursery, model, engine)
        self._dispatch(SetLoadTime(model, now - t0, now))
        self._dispatch(LoadFinished(model, load_id, now))

    async def _engine_died(self, model: str, engine: Engine, error: str) -> None:
        """A resident engine died on its own: the model fails; what it left is stopped."""
        if self._engines.get(model) is not engine:
            return
        log.error("the engine of %s died: %s", model, error)
        if self._core.state(model) in SERVING:
            del self._engines[model]  # the core takes the death: the engine is gone
        self._dispatch(EngineDeath(model, trio.current_time(), error))
        await self._stops.stop(model, engine)  # whatever it left (other ranks, files)

    async def _unload_task(self, model: str) -> None:
        self._deaths.forget(model)
        engine = self._engines.get(model)
        peak = views.kv_peak(self, model)  # read before the stop frees the engine's caches
        error = None if engine is None else await self._stops.stop(model, engine)
        if error is None:
            self._engines.pop(model, None)
            if peak is not None:  # one per residency: told when its memory is given back
                self._emit(peak)
        self._dispatch(UnloadFinished(model, trio.current_time(), error=error))
