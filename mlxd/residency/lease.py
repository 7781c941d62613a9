"""Leases: the right to use one loaded model's engine for one request.

A :class:`Lease` is an async context manager handed out by
:meth:`mlxd.residency.manager.Manager.acquire`. Work that preemption must be
able to stop runs inside ``with lease.scope():``; preemption cancels those
scopes and the holder sees :class:`mlxd.errors.Preempted` (``ShuttingDown``
when the shutdown grace ran out). The outcome a lease is journaled with is
decided here, in :func:`outcome_of`, for every way a request can end.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import trio

from mlxd.engines.base import Engine
from mlxd.errors import MlxdError, Preempted, ShuttingDown
from mlxd.residency.states import Outcome

if TYPE_CHECKING:
    from mlxd.residency.manager import Manager


class Lease:
    """The right to use one loaded model's engine, for one request."""

    def __init__(
        self,
        manager: Manager,
        lease_id: str,
        model: str,
        engine: Engine,
        request_id: str | None,
        route: str | None,
    ) -> None:
        self.id = lease_id
        self.model = model
        self.engine = engine
        self.request_id = request_id
        self.route = route
        self.acquired_at = trio.current_time()
        self.prompt_tokens: int | None = None
        self.completion_tokens: int | None = None
        self.preempted = False
        self.preempted_by_shutdown = False
        self.released = False
        self.outcome: Outcome | None = None
        self._manager = manager
        self._scopes: set[trio.CancelScope] = set()

    def preempted_error(self) -> MlxdError:
        if self.preempted_by_shutdown:
            return ShuttingDown(f"'{self.model}': the request was stopped because mlxd is shutting down")
        return Preempted(
            f"'{self.model}' was preempted to make room for another model; retry the request"
        )

    @contextmanager
    def scope(self) -> Iterator[trio.CancelScope]:
        """A region that preemption cancels; raises the preemption error if it did."""
        with trio.CancelScope() as cs:
            self._scopes.add(cs)
            if self.preempted:
                cs.cancel()
            try:
                yield cs
            finally:
                self._scopes.discard(cs)
        if cs.cancelled_caught and self.preempted:
            raise self.preempted_error()

    def set_usage(self, prompt_tokens: int | None, completion_tokens: int | None) -> None:
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = completion_tokens

    def _preempt(self, shutdown: bool) -> None:
        self.preempted = True
        self.preempted_by_shutdown = shutdown
        for cs in list(self._scopes):
            cs.cancel()

    def release(self, outcome: Outcome | None = None) -> None:
        """Give the lease back (idempotent; safe in ``finally`` and under cancellation)."""
        if self.released:
            return
        self.released = True
        if outcome is None:
            outcome = self._preempt_outcome() if self.preempted else Outcome.COMPLETED
        self.outcome = outcome
        self._manager._release(self)

    def _preempt_outcome(self) -> Outcome:
        return Outcome.SHUTDOWN if self.preempted_by_shutdown else Outcome.PREEMPTED

    async def __aenter__(self) -> Lease:
        return self

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc is None:
            self.release(Outcome.COMPLETED)
        elif isinstance(exc, (Preempted, ShuttingDown)) and self.preempted:
            self.release(self._preempt_outcome())
        elif isinstance(exc, trio.Cancelled) or (
            isinstance(exc, BaseExceptionGroup) and exc.subgroup(trio.Cancelled) is not None
        ):
            self.release(self._preempt_outcome() if self.preempted else Outcome.CANCELLED)
        else:
            self.release(Outcome.ERROR)
