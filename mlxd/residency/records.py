"""The residency core's records: one per configured model, one per waiter.

Plain mutable dataclasses owned by :class:`mlxd.residency.core.Core`; nothing
else mutates them. Invariants are written beside the fields they constrain.
Outside the core they are read as frozen copies, :class:`ModelSnapshot` and
:class:`ResidencySnapshot`, which the manager hands to HTTP, metrics and the daemon.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mlxd.residency.messages import ModelSpec, WaiterKind
from mlxd.residency.policy import ContentionPolicy, ResidencyRules
from mlxd.residency.states import COMMITTED, Reason, State

#: drain owners that are not waiters: these drains are never called off
ADMIN_DRAIN = -1
SHUTDOWN_DRAIN = -2


@dataclass
class ModelRecord:
    spec: ModelSpec
    state: State = State.UNLOADED
    #: bytes this residency holds or reserves: what its load committed (set when the load
    #: starts) plus ``kv_bytes``
    committed_bytes: int = 0
    #: KV reserved for its running requests beyond what its load committed; invariant:
    #: ``0 <= kv_bytes <= committed_bytes``; 0 whenever a load starts
    kv_bytes: int = 0
    leases: set[str] = field(default_factory=set)
    last_used: float | None = None
    #: when its current residency became ``loaded`` (min_resident_s, max_swap_delay_s)
    loaded_at: float | None = None
    #: the ``keep_alive`` of the lease that ended last (None: the model's idle_unload_s);
    #: forgotten when the model unloads
    keep_alive_s: float | None = None
    last_error: str | None = None
    load_id: int = 0
    #: when the load in flight (or the last one) started
    load_started: float | None = None
    load_reason: Reason = Reason.REQUEST
    #: a CancelLoad was issued for the load in flight; it cannot be joined
    load_cancelling: bool = False
    abort_reason: Reason = Reason.ABANDONED
    #: why it is draining / unloading (the reason of the row that ends it)
    out_reason: Reason = Reason.EVICTED
    #: ADMIN_DRAIN / SHUTDOWN_DRAIN when the drain must not be called off
    drain_owner: int | None = None
    #: its leases were preempted during this drain
    preempted: bool = False
    #: the waiters of this model, in arrival order
    queue: dict[int, Waiter] = field(default_factory=dict)
    #: its waiters wait for room (subject to their deadlines), not for a load in flight
    blocked: bool = False
    #: no waiter of this model has a deadline before this (a lower bound; may be stale-early)
    queue_deadline: float | None = None
    #: draining victims its waiters claimed in the last pass
    claims: list[str] = field(default_factory=list)
    #: an engine stop is in flight (StartUnload issued, UnloadFinished not yet in)
    stopping: bool = False
    #: stops of this residency's engine that failed in a row (reset when one succeeds)
    stop_failures: int = 0
    #: when the next stop attempt is due, while the last one failed. Until then the
    #: model is *stuck*: its bytes stay counted, it is nobody's victim (no waiter
    #: counts on its room), and its own waiters wait (or, under ``fail``, are refused)
    retry_at: float | None = None
    #: a load that failed or was abandoned, whose partial engine is still being
    #: stopped: the model stays ``loading`` (bytes counted) until a stop succeeds,
    #: then moves to this state (``failed`` with the load's error, or ``unloaded``)
    teardown: tuple[State, str | None] | None = None
    #: its waiters wait for a victim to become available (anti-thrash) until then
    defer_until: float | None = None
    #: waiters in its queue whose policy never waits (they fail when room is not at hand)
    fail_waiters: int = 0
    #: waiters in its queue whose policy is ``preempt`` (their victims drain as ``preempted``)
    preempters: int = 0
    #: the earliest ``preempt_at`` of its waiters (None: none of them preempts)
    preempt_at: float | None = None
    #: waiters in its queue that ask for KV (``WaiterKind.KV``), not for a lease
    kv_waiters: int = 0

    @property
    def holds_budget(self) -> bool:
        """Whether its bytes count against the budget (its state is one of ``COMMITTED``)."""
        return self.state in COMMITTED

    @property
    def stuck(self) -> bool:
        """Its last engine stop failed and the next attempt is not due yet."""
        return self.retry_at is not None

    @property
    def head(self) -> Waiter | None:
        return next(iter(self.queue.values()), None)

    @property
    def priority(self) -> int:
        return self.spec.priority

    def enqueue(self, w: Waiter) -> None:
        """Add a waiter and keep the queue's summaries (deadline, policy counts) true."""
        self.queue[w.id] = w
        if w.deadline is not None and (self.queue_deadline is None or w.deadline < self.queue_deadline):
            self.queue_deadline = w.deadline
        self._count(w, 1)
        if w.preempt_at is not None and (self.preempt_at is None or w.preempt_at < self.preempt_at):
            self.preempt_at = w.preempt_at

    def dequeue(self, w: Waiter) -> None:
        """Remove a waiter (if queued) and keep the queue's summaries true."""
        if self.queue.pop(w.id, None) is None:
            return
        self._count(w, -1)
        if not self.queue:
            self.blocked = False
            self.queue_deadline = None
            self.claims = []
            self.defer_until = None
            self.preempt_at = None
        elif w.preempt_at is not None and w.preempt_at == self.preempt_at:
            times = [x.preempt_at for x in self.queue.values() if x.preempt_at is not None]
            self.preempt_at = min(times) if times else None

    def _count(self, w: Waiter, n: int) -> None:
        if w.kind is WaiterKind.KV:
            self.kv_waiters += n
        if not w.policy.waits:
            self.fail_waiters += n
        if w.policy.strategy == "preempt":
            self.preempters += n


@dataclass(frozen=True)
class Waiter:
    """One acquire waiting in its model's queue; never changed once made (copies share it)."""

    id: int
    model: str
    lease_id: str
    kind: WaiterKind
    reason: Reason
    since: float
    #: capacity bound (None = unbounded)
    deadline: float | None
    #: when this waiter may preempt its victims (None = never)
    preempt_at: float | None
    #: its contention policy: the manager's, or less if the request asked for less
    policy: ContentionPolicy = field(default_factory=ContentionPolicy)
    #: the request's keep_alive, already clamped (None: the model's default)
    keep_alive_s: float | None = None
    #: KV bytes it asks for (``WaiterKind.KV`` only)
    kv_bytes: int = 0


@dataclass(frozen=True, slots=True)
class ModelSnapshot:
    """One model's residency at one moment, copied off its :class:`ModelRecord`."""

    spec: ModelSpec
    state: State
    #: what it holds or reserves of the budget (counted only when ``holds_budget``)
    committed_bytes: int
    holds_budget: bool
    kv_bytes: int
    #: waiters in its queue
    queued: int
    #: leases held on it
    running: int
    #: its waiters wait for room, not for a load in flight
    blocked: bool
    #: a CancelLoad was issued for its load in flight (it cannot be joined)
    load_cancelling: bool
    last_used: float | None
    loaded_at: float | None
    keep_alive_s: float | None
    last_error: str | None
    stop_failures: int
    retry_at: float | None
    #: when it unloads for want of leases if none comes (None: not while it stays as it is)
    unload_due: float | None

    @classmethod
    def of(cls, r: ModelRecord, unload_due: float | None) -> ModelSnapshot:
        return cls(
            r.spec, r.state, r.committed_bytes, r.holds_budget, r.kv_bytes, len(r.queue),
            len(r.leases), r.blocked, r.load_cancelling, r.last_used, r.loaded_at,
            r.keep_alive_s, r.last_error, r.stop_failures, r.retry_at, unload_due,
        )


@dataclass(frozen=True, slots=True)
class ResidencySnapshot:
    """The whole budget at one moment: what ``/admin/status``, ``/metrics`` and the daemon read."""

    budget_bytes: int
    committed_bytes: int
    policy: ContentionPolicy
    rules: ResidencyRules
    shutting_down: bool
    #: None, or why new loads are refused (the journal cannot write)
    load_gate: str | None
    #: every waiter, in arrival order (frozen records: shared, not copied)
    waiters: tuple[Waiter, ...]
    #: ``(name, state, leases held, stop failures)`` of every model, in config order: one
    #: cheap pass (``/metrics``, ``/health`` of 10,000 models); :class:`ModelSnapshot` has
    #: the rest of one model
    models: tuple[tuple[str, State, int, int], ...]

    @property
    def free_bytes(self) -> int:
        """What is left of the budget: a model this size or smaller loads without evicting."""
        return max(0, self.budget_bytes - self.committed_bytes)
