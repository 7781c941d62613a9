"""What the manager tells its subscribers: transitions, leases, measurements and KV peaks.

The manager calls every subscriber synchronously, in order, for each of these
(see :meth:`mlxd.residency.manager.Manager.subscribe`). The journal persists them, the
metrics count them, ``/admin/events`` streams them. Times are wall-clock unix
seconds from the manager's injected clock.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from mlxd.residency.messages import Transition
from mlxd.residency.states import Outcome, Reason, State


@dataclass(frozen=True, slots=True)
class TransitionEvent:
    model: str
    from_state: State
    to_state: State
    reason: Reason
    at: float
    memory_bytes: int | None = None
    error: str | None = None
    #: what the move was for, when another model's need caused it (an eviction or drain:
    #: ``load of 'big'``, ``KV of a request on 'tiny'``); in the events payload
    cause: str | None = None

    kind = "transition"

    @classmethod
    def of(cls, t: Transition, at: float) -> TransitionEvent:
        """The event of the core's transition ``t``, stamped ``at`` (wall clock)."""
        return cls(t.model, t.from_state, t.to_state, t.reason, at, t.memory_bytes, t.error, t.cause)

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, **asdict(self)}


@dataclass(frozen=True, slots=True)
class LeaseAcquired:
    lease_id: str
    model: str
    request_id: str | None
    route: str | None
    at: float
    #: the name of the API key that took the lease (never the key); None without keys
    client: str | None = None

    kind = "lease_acquired"

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, **asdict(self)}


@dataclass(frozen=True, slots=True)
class LeaseReleased:
    lease_id: str
    model: str
    outcome: Outcome
    at: float
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    #: seconds the lease was held (monotonic)
    held_seconds: float = 0.0
    #: seconds its requests' KV reservations waited for room (None: none waited)
    kv_wait_seconds: float | None = None

    kind = "lease_released"

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, **asdict(self)}


@dataclass(frozen=True, slots=True)
class MeasurementEvent:
    """The footprint and load time measured after a successful load."""

    model: str
    at: float
    memory_bytes: int
    load_seconds: float
    #: the fingerprint of the weights measured (``mlxd.config.weights_fingerprint``):
    #: the measurement applies only while the model's weights have this one
    weights: str | None = None

    kind = "measurement"

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, **asdict(self)}


@dataclass(frozen=True, slots=True)
class KvPeakEvent:
    """How much of its KV budgets a residency used, told once when the residency ends.

    Only for engines that measure their KV (batched mlx-lm models): the peak is
    the most KV bytes the running generations held at once since the load, next
    to ``kv_cache`` (``kv_cache_gb`` or its default) that the load committed.
    """

    model: str
    #: when the engine stop that ended the residency began (wall clock)
    at: float
    #: when the residency became ``loaded`` (wall clock)
    loaded_at: float
    kv_peak_bytes: int
    #: the ``kv_cache`` part of what the load committed
    kv_budget_bytes: int
    #: what the prompt cache held at the end (it evicts beyond its budget, so about its most)
    prompt_cache_bytes: int
    #: the ``prompt_cache`` part of what the load committed
    prompt_cache_budget_bytes: int

    kind = "kv_peak"

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, **asdict(self)}


ManagerEvent = TransitionEvent | LeaseAcquired | LeaseReleased | MeasurementEvent | KvPeakEvent
