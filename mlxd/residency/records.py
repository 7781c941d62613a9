"""The residency core's records: one per configured model, one per waiter.

Plain mutable dataclasses owned by :class:`mlxd.residency.core.Core`; nothing
else mutates them. Invariants are written beside the fields they constrain.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mlxd.residency.messages import ModelSpec, WaiterKind
from mlxd.residency.states import COMMITTED, Reason, State

#: drain owners that are not waiters: these drains are never called off
ADMIN_DRAIN = -1
SHUTDOWN_DRAIN = -2


@dataclass
class ModelRecord:
    spec: ModelSpec
    state: State = State.UNLOADED
    #: bytes this residency holds or reserves (set when its load starts)
    committed_bytes: int = 0
    leases: set[str] = field(default_factory=set)
    last_used: float | None = None
    last_error: str | None = None
    load_id: int = 0
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


@dataclass
class Waiter:
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
