"""The primitive moves every decision of the residency core is made of.

:class:`Moves` works on the core's books (a
:class:`~mlxd.residency.registry.Registry`: models, waiters, leases, budget,
policies) and makes the few changes there are: grant or refuse a waiter,
start a load, send a model on its way out (unload, drain, preempt; stop its
engine, retry a failed stop), and :meth:`Moves.move`, the one place a state
changes (checked against the table of :mod:`mlxd.residency.states`, and
emitted as a :class:`~mlxd.residency.messages.Transition`). Each move checks
its transition before it changes anything: a move the table refuses raises
:class:`~mlxd.residency.states.IllegalTransition` and leaves the books as
they were. The commands the moves make collect in :attr:`Moves.out`.

The scheduling pass (:mod:`mlxd.residency.scheduler`) decides *which* moves
to make; the event handlers (:mod:`mlxd.residency.core`) decide *when*.
Pure: no await, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from mlxd.errors import MlxdError, ShuttingDown
from mlxd.residency.messages import (
    CancelLoad,
    Command,
    Grant,
    Preempt,
    Reject,
    Satisfy,
    StartLoad,
    StartUnload,
    Transition,
    WaiterKind,
)
from mlxd.residency.policy import stop_retry_delay
from mlxd.residency.records import ModelRecord, Waiter
from mlxd.residency.registry import Registry
from mlxd.residency.states import DORMANT, Reason, State, check_transition


class VictimReason(StrEnum):
    """Why the scheduling pass took a victim (``GET /admin/plan``'s ``victims[].why``)."""

    #: an idle model, least recently used first (eviction rule ``lru``)
    IDLE_LRU = "idle_lru"
    #: an idle model, fewest reload seconds per byte first (eviction rule ``cost``)
    IDLE_COST = "idle_cost"
    #: a busy model whose leases finish first (the waiters do not preempt)
    DRAIN = "drain"
    #: a busy model whose leases are preempted, its priority equal to the waiter's
    PREEMPT = "preempt"
    #: a busy model whose leases are preempted, its priority lower than the waiter's
    PRIORITY = "priority"


#: victims with leases: they drain (or are preempted) before their room is free
BUSY_REASONS: frozenset[VictimReason] = frozenset(
    {VictimReason.DRAIN, VictimReason.PREEMPT, VictimReason.PRIORITY}
)


@dataclass(frozen=True, slots=True)
class Victim:
    """A model the scheduling pass sent on its way out to make room, and why."""

    model: str
    state: State
    bytes: int
    why: VictimReason
    #: the model whose waiters needed the room
    for_model: str


class Moves:
    """The primitive moves on the core's books (see the module docstring)."""

    def __init__(self, books: Registry) -> None:
        self.books = books
        #: the commands of the step in progress, in order
        self.out: list[Command] = []

    # -- waiters ---------------------------------------------------------------------

    def drop(self, w: Waiter) -> None:
        del self.books.waiters[w.id]
        r = self.books.models.get(w.model)
        if r is not None:
            r.dequeue(w)

    def satisfy(self, w: Waiter, r: ModelRecord) -> None:
        self.drop(w)
        if w.kind is WaiterKind.LEASE:
            r.leases.add(w.lease_id)
            self.books.lease_model[w.lease_id] = r.spec.name
            self.books.lease_policy[w.lease_id] = w.policy
            if w.keep_alive_s is not None:
                self.books.lease_keep_alive[w.lease_id] = w.keep_alive_s
            r.last_used = self.books.now
            self.out.append(Grant(w.id, r.spec.name, w.lease_id))
        else:
            self.out.append(Satisfy(w.id, r.spec.name))

    def grant_kv(self, w: Waiter, r: ModelRecord) -> None:
        """Commit the KV bytes ``w`` asked for to its model's residency."""
        self.drop(w)
        r.kv_bytes += w.kv_bytes
        r.committed_bytes += w.kv_bytes
        r.last_used = self.books.now
        self.out.append(Satisfy(w.id, r.spec.name))

    def return_kv(self, r: ModelRecord, nbytes: int) -> None:
        """Give back up to ``nbytes`` of its KV reservation (never what its load committed)."""
        back = min(max(0, nbytes), r.kv_bytes)
        r.kv_bytes -= back
        r.committed_bytes -= back

    def forget_lease(self, lid: str) -> None:
        """A lease has ended: its bookkeeping goes, and so do KV requests it left waiting."""
        self.books.lease_model.pop(lid, None)
        self.books.lease_keep_alive.pop(lid, None)
        self.books.lease_policy.pop(lid, None)
        for w in [w for w in self.books.waiters.values() if w.kind is WaiterKind.KV and w.lease_id == lid]:
            self.drop(w)

    def reject(self, w: Waiter, error: MlxdError) -> None:
        self.drop(w)
        self.out.append(Reject(w.id, w.model, error))

    def reject_queue(self, r: ModelRecord, error: MlxdError) -> None:
        for w in list(r.queue.values()):
            self.reject(w, error)

    def reject_all_waiters(self) -> None:
        for w in list(self.books.waiters.values()):
            self.reject(w, ShuttingDown("mlxd is shutting down"))

    # -- loads -----------------------------------------------------------------------

    def start_load(self, r: ModelRecord) -> None:
        check_transition(r.spec.name, r.state, State.LOADING)  # before any field changes
        head = r.head
        reason = head.reason if head is not None else Reason.REQUEST
        self.books.last_load_id += 1
        r.load_id = self.books.last_load_id
        r.load_started = self.books.now
        r.load_reason = reason
        r.committed_bytes = r.spec.size_bytes
        r.kv_bytes = 0
        r.load_cancelling = False
        r.abort_reason = Reason.ABANDONED
        self.move(r, State.LOADING, reason)
        r.blocked = False
        self.out.append(StartLoad(r.spec.name, r.load_id))

    def maybe_abandon_load(self, model: str) -> None:
        r = self.books.models.get(model)
        if r is None or r.state is not State.LOADING or r.load_cancelling:
            return
        if r.queue:
            return
        r.load_cancelling = True
        r.abort_reason = Reason.ABANDONED
        self.out.append(CancelLoad(model, r.load_id))

    # -- on the way out --------------------------------------------------------------

    def vacate(self, r: ModelRecord, reason: Reason, owner: int) -> None:
        """Send a model on its way out for an admin unload or shutdown (never called off)."""
        if r.state is State.FAILED:
            self.move(r, State.UNLOADED, reason)
        elif r.state is State.LOADED:
            if r.leases:
                self.begin_drain(r, reason, owner)
            else:
                self.begin_unload(r, reason)
        elif r.state is State.DRAINING:
            r.drain_owner = owner
            r.out_reason = reason

    def begin_unload(self, r: ModelRecord, reason: Reason, cause: str | None = None) -> None:
        check_transition(r.spec.name, r.state, State.UNLOADING)  # before any field changes
        r.out_reason = reason
        self.move(r, State.UNLOADING, reason, cause=cause)
        self.start_stop(r)

    def start_stop(self, r: ModelRecord) -> None:
        r.stopping = True
        self.out.append(StartUnload(r.spec.name))

    def stop_failed(self, r: ModelRecord, error: str) -> None:
        """The engine stop failed: keep its bytes, retry after a growing delay."""
        r.stop_failures += 1
        r.last_error = error
        r.retry_at = self.books.now + stop_retry_delay(r.stop_failures)

    def retry_stop(self, r: ModelRecord) -> None:
        r.retry_at = None
        self.start_stop(r)

    def begin_drain(
        self, r: ModelRecord, reason: Reason, owner: int | None, cause: str | None = None
    ) -> None:
        check_transition(r.spec.name, r.state, State.DRAINING)  # before any field changes
        r.out_reason = reason
        r.drain_owner = owner
        r.preempted = False
        self.move(r, State.DRAINING, reason, cause=cause)

    def preempt(self, r: ModelRecord, *, shutdown: bool) -> None:
        r.preempted = True
        if shutdown:
            r.out_reason = Reason.SHUTDOWN
        if r.leases:
            self.out.append(Preempt(r.spec.name, tuple(sorted(r.leases)), shutdown=shutdown))

    def move(
        self,
        r: ModelRecord,
        to: State,
        reason: Reason,
        *,
        error: str | None = None,
        cause: str | None = None,
    ) -> None:
        check_transition(r.spec.name, r.state, to)
        frm, r.state = r.state, to
        if to in (State.UNLOADED, State.LOADED, State.LOADING):
            r.drain_owner = None
        if to in DORMANT:  # no longer resident
            r.keep_alive_s = None
            r.loaded_at = None
        self.out.append(Transition(r.spec.name, frm, to, reason, r.committed_bytes, error, cause))

