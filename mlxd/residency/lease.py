"""Leases: the right to use one loaded model's engine for one request.

A :class:`Lease` is an async context manager handed out by
:meth:`mlxd.residency.manager.Manager.acquire`; a :class:`Ticket` is an
acquire still waiting for one (:meth:`~mlxd.residency.manager.Manager.enqueue`). Work that preemption must be
able to stop runs inside ``with lease.scope():``; preemption cancels those
scopes and the holder sees :class:`mlxd.errors.Preempted` (``ShuttingDown``
when the shutdown grace ran out). A streaming response that cannot hold a
cancel scope across its ``yield``s opens ``lease.scope()`` around each await
instead. Leases and tickets see their manager only as a :class:`LeaseOwner`.

How a lease ends: one rule
--------------------------
A lease ends exactly once. Its holder ends it with ``async with lease:`` or
:meth:`Lease.finish` (``finish(exc)``: the exception the request ended with, or
None), and :func:`outcome_of` is the one rule that turns that into the
journaled outcome:

* the manager preempted it (for another model, or at the end of the shutdown
  grace) and the request did not complete: ``preempted`` / ``shutdown``,
  whatever error the holder saw;
* no exception: ``completed``;
* a cancellation (Trio's, or the response body closed before its end):
  the holder's ``cancel_outcome``, ``disconnected`` for an HTTP request (the
  client went away), ``cancelled`` otherwise;
* any other exception: ``error``.

The manager owns the end of a lease it preempted: if the holder has not ended
it :data:`LEASE_END_S` after the preemption (say its response body is stuck
writing to a client that stopped reading), the manager ends it itself with
the preemption's outcome, then runs the holder's abandon hooks
(:meth:`Lease.on_abandon`: the HTTP layer cancels the engine job and closes the
connection). A later ``finish`` by the holder changes nothing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import trio

from mlxd.engines.base import Engine
from mlxd.errors import MlxdError, Preempted, ShuttingDown
from mlxd.residency.events import LeaseReleased
from mlxd.residency.messages import WaiterKind
from mlxd.residency.states import Outcome

log = logging.getLogger("mlxd.residency.lease")

#: a preempted lease whose holder has not ended it this many seconds later is ended by the manager
LEASE_END_S = 0.25

AbandonHook = Callable[[], Awaitable[None]]


class LeaseOwner(Protocol):
    """What a lease and a ticket need of their manager (:class:`~mlxd.residency.manager.Manager`)."""

    def lease_ended(self, lease: Lease) -> None:
        """``lease`` has ended: journal it and free its room."""

    def withdraw(self, waiter_id: int) -> None:
        """Take a waiter out of its queue, if it is still waiting."""

    def load_joinable(self, model: str) -> bool:
        """Whether a new waiter of ``model`` would join its load in flight."""


def new_lease_id(salt: str, counter: Iterator[int]) -> str:
    """A lease id: time-ordered (ns, the manager's random salt, a counter).

    The journal's leases primary key grows at its end (a random uuid4 dirtied a
    random index page per lease: 3x the SQLite work), and no syscall per lease
    (os.urandom was 15% of acquire+release).
    """
    return f"{time.time_ns():016x}{salt}{next(counter):08x}"


def is_cancellation(exc: BaseException | None) -> bool:
    """Whether ``exc`` means the holder's work was cancelled (not that it failed)."""
    if isinstance(exc, trio.Cancelled | GeneratorExit):
        return True
    if isinstance(exc, BaseExceptionGroup):
        return exc.subgroup((trio.Cancelled, GeneratorExit)) is not None
    return False


def outcome_of(lease: Lease, exc: BaseException | None) -> Outcome:
    """The journaled outcome of ``lease`` when its request ended with ``exc`` (the one rule)."""
    if exc is None:
        return Outcome.COMPLETED
    if lease.preempted:
        return lease.preempt_outcome
    if is_cancellation(exc):
        return lease.cancel_outcome
    return Outcome.ERROR


class Lease:
    """The right to use one loaded model's engine, for one request."""

    def __init__(
        self,
        manager: LeaseOwner,
        lease_id: str,
        model: str,
        engine: Engine,
        request_id: str | None,
        route: str | None,
        cancel_outcome: Outcome = Outcome.CANCELLED,
    ) -> None:
        self.id = lease_id
        self.model = model
        self.engine = engine
        self.request_id = request_id
        self.route = route
        #: the outcome when the holder's work is cancelled (see :func:`outcome_of`)
        self.cancel_outcome = cancel_outcome
        #: the name of the API key the request came with (None without keys)
        self.client: str | None = None
        self.acquired_at = trio.current_time()
        self.prompt_tokens: int | None = None
        self.completion_tokens: int | None = None
        #: seconds its requests' KV reservations waited for room (None: none waited), see
        #: mlxd.residency.kv; journaled as ``leases.kv_wait_seconds``
        self.kv_wait_seconds: float | None = None
        self.preempted = False
        self.preempted_by_shutdown = False
        self.released = False
        self.outcome: Outcome | None = None
        #: set when the lease has ended (however it ended)
        self.ended = trio.Event()
        self._manager = manager
        self._scopes: set[trio.CancelScope] = set()
        self._abandon_hooks: list[AbandonHook] = []

    def adopt(self, w: Ticket) -> None:
        """Take the request's tags from its waiter: request id, route, client, cancel outcome."""
        self.request_id, self.route, self.client = w.request_id, w.route, w.client
        self.cancel_outcome = w.cancel_outcome

    @property
    def preempt_outcome(self) -> Outcome:
        return Outcome.SHUTDOWN if self.preempted_by_shutdown else Outcome.PREEMPTED

    def preempted_error(self) -> MlxdError:
        if self.preempted_by_shutdown:
            return ShuttingDown(f"'{self.model}': the request was stopped because mlxd is shutting down")
        return Preempted(
            f"'{self.model}' was preempted to make room for another model; retry the request"
        )

    @contextmanager
    def scope(self) -> Iterator[trio.CancelScope]:
        """A region that preemption cancels; raises the preemption error if it did."""
        if self.preempted:  # the engine may be gone: the region does not run at all
            raise self.preempted_error()
        with trio.CancelScope() as cs:
            self._scopes.add(cs)
            try:
                yield cs
            finally:
                self._scopes.discard(cs)
        if cs.cancelled_caught and self.preempted:
            raise self.preempted_error()

    def note_kv_wait(self, seconds: float) -> None:
        """A KV reservation of one of its requests waited ``seconds`` for room."""
        self.kv_wait_seconds = (self.kv_wait_seconds or 0.0) + seconds

    def set_usage(self, prompt_tokens: int | None, completion_tokens: int | None) -> None:
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = completion_tokens

    def on_abandon(self, hook: AbandonHook) -> None:
        """Run ``hook`` if the manager has to end this lease itself (see the module docstring)."""
        self._abandon_hooks.append(hook)

    def finish(self, exc: BaseException | None = None) -> None:
        """End the lease: the request ended with ``exc`` (None: it completed). Idempotent."""
        self.end(outcome_of(self, exc))

    def release(self) -> None:
        """End the lease as completed (the request is done). Idempotent."""
        self.finish(None)

    async def __aenter__(self) -> Lease:
        return self

    async def __aexit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        self.finish(exc)

    # -- the manager's side ------------------------------------------------------------

    def end(self, outcome: Outcome) -> None:
        """End the lease with ``outcome`` (the manager's side: a holder calls :meth:`finish`)."""
        if self.released:
            return
        self.released = True
        self.outcome = outcome
        self.ended.set()
        self._manager.lease_ended(self)

    def released_event(self, at: float) -> LeaseReleased:
        """What the manager tells its subscribers once the lease has ended (``at``: wall clock)."""
        return LeaseReleased(self.id, self.model, self.outcome or Outcome.COMPLETED, at,
                             self.prompt_tokens, self.completion_tokens,
                             trio.current_time() - self.acquired_at, self.kv_wait_seconds)

    def preempt(self, shutdown: bool) -> None:
        """Cancel the lease's scopes: preempted for another model, or by the shutdown."""
        self.preempted = True
        self.preempted_by_shutdown = shutdown
        for cs in list(self._scopes):
            cs.cancel()

    async def _abandon(self) -> None:
        """End the lease now with its preemption's outcome, then run the abandon hooks."""
        self.end(self.preempt_outcome)
        hooks, self._abandon_hooks = self._abandon_hooks, []
        for hook in hooks:
            await hook()


async def end_when_overdue(lease: Lease) -> None:
    """The manager's side of a preemption: end ``lease`` if its holder has not, LEASE_END_S on."""
    with trio.move_on_after(LEASE_END_S):
        await lease.ended.wait()
    if lease.released:
        return
    log.warning(
        "lease %s on %s (request %s): its holder did not end it %.1f s after preemption;"
        " ending it", lease.id, lease.model, lease.request_id, LEASE_END_S,
    )
    await abandon([lease])


async def abandon(leases: Iterable[Lease]) -> None:
    """End ``leases`` now (preempted, or ``shutdown`` if they were not), and run their hooks.

    Bounded: hooks that hang get LEASE_END_S in all, shielded from the caller's cancellation.
    """
    with trio.move_on_after(LEASE_END_S) as cs:
        cs.shield = True
        for lease in list(leases):
            if not lease.preempted:
                lease.preempt(shutdown=True)
            await lease._abandon()


@dataclass
class Ticket:
    """One acquire in progress: done when it got its lease (or residency) or an error.

    :meth:`Manager.enqueue` hands it out; :meth:`Manager.acquire` awaits it. A
    caller that waits on its own (a stream showing load progress) must
    :meth:`cancel` it however it ends.
    """

    manager: LeaseOwner
    id: int
    model: str
    request_id: str | None
    route: str | None
    kind: WaiterKind
    #: the lease's outcome if its holder is cancelled (see :func:`outcome_of`)
    cancel_outcome: Outcome = Outcome.CANCELLED
    done: trio.Event = field(default_factory=trio.Event)
    #: set with ``done``, or earlier when its model's load is in flight (started or joined)
    moved: trio.Event = field(default_factory=trio.Event)
    lease: Lease | None = None
    error: MlxdError | None = None
    #: a residency waiter's model status at the moment it was satisfied
    status: dict[str, Any] | None = None
    #: the name of the request's API key (journaled as ``leases.client``)
    client: str | None = None
    #: called once settled (a KV ask: hands the answer to its engine, mlxd.residency.kv)
    on_settle: Callable[[], None] | None = None

    def settle(self) -> None:
        """It got its lease, residency or error (the manager's side)."""
        self.done.set()
        self.moved.set()
        if self.on_settle is not None:
            self.on_settle()

    def result(self) -> Lease:
        """The lease (call once ``done``); raises the typed error if there is none."""
        if self.error is not None:
            raise self.error
        assert self.lease is not None
        return self.lease

    @property
    def loading(self) -> bool:
        """Whether it waits for its model's load in flight (not for room)."""
        return not self.done.is_set() and self.manager.load_joinable(self.model)

    def cancel(self, exc: BaseException | None) -> None:
        """The caller ended with ``exc`` before using its lease: leave the queue, or end
        a lease already granted with the outcome of ``exc``. Idempotent."""
        if not self.done.is_set():
            self.manager.withdraw(self.id)
        elif self.lease is not None:
            self.lease.finish(exc)
