"""The messages of the residency core: events in, commands out.

The Trio shell (:mod:`mlxd.residency.manager`) turns happenings into these events (each
carrying ``now``, monotonic seconds) and carries out the commands that
:meth:`mlxd.residency.core.Core.step` returns, in order. All are frozen dataclasses.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from mlxd.errors import MlxdError
from mlxd.residency.policy import ContentionPolicy, ResidencyRules
from mlxd.residency.states import Reason, State

# ---- inputs ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """What the core needs to know about a configured model."""

    name: str
    size_bytes: int
    pinned: bool = False
    #: seconds without a lease before an idle unload; 0 = never
    idle_unload_s: float = 0.0
    #: higher is served first and may preempt lower (never the reverse)
    priority: int = 0
    #: seconds its last load took (measured), or None if never measured
    load_s: float | None = None


class WaiterKind(StrEnum):
    LEASE = "lease"  # a request: gets a lease, may leave at any time
    RESIDENT = "resident"  # preload, admin load, restore: wants residency, never leaves
    KV = "kv"  # a lease holder's request for more KV bytes of its loaded model


@dataclass(frozen=True, slots=True)
class Acquire:
    waiter_id: int
    model: str
    lease_id: str
    now: float
    kind: WaiterKind = WaiterKind.LEASE
    reason: Reason = Reason.REQUEST
    #: the request's ``keep_alive`` (seconds; 0 = unload when it ends; -1 = no idle
    #: unload); None = the model's ``idle_unload_seconds``. Clamped by the rules' cap.
    keep_alive_s: float | None = None
    #: the policy the request asked for (``X-Mlxd-Contention``); it gets at most its model's
    contention: ContentionPolicy | None = None


@dataclass(frozen=True, slots=True)
class ReserveKV:
    """The holder of lease ``lease_id`` needs ``nbytes`` more KV on its (loaded) model.

    It waits in the model's queue like an acquire, with the lease's contention policy:
    granted (:class:`Satisfy`) once the bytes are committed, refused (:class:`Reject`)
    when they could not fit even with every other model gone, or by the policy.
    """

    waiter_id: int
    model: str
    lease_id: str
    nbytes: int
    now: float


@dataclass(frozen=True, slots=True)
class ReturnKV:
    """``nbytes`` of ``model``'s KV reservation are given back (its batch shrank)."""

    model: str
    nbytes: int
    now: float


@dataclass(frozen=True, slots=True)
class CancelWaiter:
    """The waiter left (cancelled, disconnected, timed out on its side)."""

    waiter_id: int
    now: float


@dataclass(frozen=True, slots=True)
class LoadFinished:
    """A load ended; ``error`` if it failed, and ``stop_error`` if stopping its
    partial engine failed too (the engine may still hold memory)."""

    model: str
    load_id: int
    now: float
    error: str | None = None
    stop_error: str | None = None
    #: the failure was the engine's process dying (reason ``engine_died``, not ``load_failed``)
    died: bool = False


@dataclass(frozen=True, slots=True)
class EngineDeath:
    """A resident model's engine died on its own (its worker process crashed or was killed).

    Its memory is gone with the process: the model goes ``failed`` and its leases are
    dropped (their holders see the engine's error and release them with ``error``).
    """

    model: str
    now: float
    error: str


@dataclass(frozen=True, slots=True)
class LoadAborted:
    """A cancelled load has ended and its partial engine is stopped (``stop_error``: it is not)."""

    model: str
    load_id: int
    now: float
    stop_error: str | None = None


@dataclass(frozen=True, slots=True)
class UnloadFinished:
    """An engine stop (of a loaded model, or of a failed load's partial engine) ended."""

    model: str
    now: float
    error: str | None = None


@dataclass(frozen=True, slots=True)
class Release:
    lease_id: str
    now: float


@dataclass(frozen=True, slots=True)
class Tick:
    now: float


@dataclass(frozen=True, slots=True)
class AdminUnload:
    model: str
    now: float
    preempt: bool = False


@dataclass(frozen=True, slots=True)
class SetLoadGate:
    """``reason`` None allows loads; a string refuses new loads with that reason."""

    reason: str | None
    now: float


@dataclass(frozen=True, slots=True)
class SetSize:
    """A new memory estimate for a model (e.g. measured by its last load).

    It applies to the model's next reservation; a residency keeps the bytes it reserved.
    """

    model: str
    size_bytes: int
    now: float


@dataclass(frozen=True, slots=True)
class SetLoadTime:
    """How long ``model``'s last load took (seconds): cost eviction and plan ETAs use it."""

    model: str
    load_s: float
    now: float


@dataclass(frozen=True, slots=True)
class Shutdown:
    now: float


@dataclass(frozen=True, slots=True)
class ShutdownDeadline:
    """The grace period is over: preempt every remaining lease."""

    now: float


@dataclass(frozen=True, slots=True)
class Reconfigure:
    """Replace the registry and the manager settings (config reload).

    ``replaced`` names models whose configuration changed; they and removed
    models must be dormant (``unloaded``/``failed``), else :class:`Conflict`.
    """

    specs: tuple[ModelSpec, ...]
    budget_bytes: int
    policy: ContentionPolicy
    now: float
    replaced: frozenset[str] = frozenset()
    rules: ResidencyRules = field(default_factory=ResidencyRules)


Event = (
    Acquire
    | ReserveKV
    | ReturnKV
    | CancelWaiter
    | LoadFinished
    | EngineDeath
    | LoadAborted
    | UnloadFinished
    | Release
    | Tick
    | AdminUnload
    | SetLoadGate
    | SetSize
    | SetLoadTime
    | Shutdown
    | ShutdownDeadline
    | Reconfigure
)


# ---- outputs ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StartLoad:
    model: str
    load_id: int


@dataclass(frozen=True, slots=True)
class CancelLoad:
    model: str
    load_id: int


@dataclass(frozen=True, slots=True)
class StartUnload:
    model: str


@dataclass(frozen=True, slots=True)
class Grant:
    waiter_id: int
    model: str
    lease_id: str


@dataclass(frozen=True, slots=True)
class Satisfy:
    waiter_id: int
    model: str


@dataclass(frozen=True, slots=True)
class Reject:
    waiter_id: int
    model: str
    error: MlxdError


@dataclass(frozen=True, slots=True)
class Preempt:
    model: str
    lease_ids: tuple[str, ...]
    shutdown: bool = False


@dataclass(frozen=True, slots=True)
class Transition:
    model: str
    from_state: State
    to_state: State
    reason: Reason
    memory_bytes: int
    error: str | None = None
    #: what another model needed, when that caused the move (victims of a scheduling pass)
    cause: str | None = None


Command = StartLoad | CancelLoad | StartUnload | Grant | Satisfy | Reject | Preempt | Transition
