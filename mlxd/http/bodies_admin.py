"""The response bodies of the admin and operations routes: status, plan, reload, history,
health, whoami and the OpenAPI document itself.

One ``TypedDict`` per body (see :mod:`mlxd.http.body_schemas`), returned by
the builders of :mod:`mlxd.http.admin_api`, :mod:`mlxd.http.reload` and
:mod:`mlxd.http.dashboard`. The residency's own pictures (each model's
status, the waiters, the leases, the policy) are made by
:mod:`mlxd.residency.views` below the HTTP layer and are described here as
objects.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, NotRequired

from pydantic import Field, WithJsonSchema
from typing_extensions import TypeAliasType, TypedDict

from mlxd.config.model import SCOPES
from mlxd.http.body_schemas import NonNegative
from mlxd.residency.moves import VictimReason
from mlxd.residency.plan import ACTIONS, Plan

#: an object made by the residency's views (:mod:`mlxd.residency.views`)
_Object = dict[str, Any]


class JournalStatus(TypedDict):
    """The journal's writer (``enabled: false``: the daemon runs without one, and says no more)."""

    enabled: bool
    path: NotRequired[str]
    healthy: NotRequired[bool]
    last_error: NotRequired[str | None]
    run_id: NotRequired[int | None]
    last_seq: NotRequired[int]
    committed_seq: NotRequired[int]
    rejected_rows: NotRequired[NonNegative]
    writer_pid: NotRequired[int | None]
    restarts: NotRequired[NonNegative]


class DiskTierStatus(TypedDict):
    """The prompt cache's disk tier: where, its bound, and what it holds."""

    enabled: bool
    path: str
    max_bytes: NonNegative
    bytes: NonNegative
    entries: NonNegative


class AdminStatus(TypedDict):
    """Budget, committed and free bytes, every model's state, waiters, leases, the journal."""

    budget_bytes: NonNegative
    committed_bytes: NonNegative
    #: what is left of the budget: a model this size or smaller loads without evicting
    free_bytes: int
    policy: _Object
    shutting_down: bool
    load_gate: str | None
    #: per model: its state and routing facts (committed_bytes, queued, running, kv_in_use,
    #: expected_load_seconds), memory, leases and waiters
    models: dict[str, _Object]
    waiters: list[_Object]
    leases: list[_Object]
    version: str
    uptime_s: float
    journal: JournalStatus
    draining: bool
    prompt_cache_disk: DiskTierStatus


class PlanVictim(TypedDict):
    model: str
    state: Annotated[str, WithJsonSchema({"const": "loaded"})]
    bytes: NonNegative
    why: Annotated[str, WithJsonSchema({"enum": [r.value for r in VictimReason]})]


class PlanError(TypedDict):
    code: str
    message: str | None


class AdminPlan(TypedDict):
    """What acquiring the model now would do, and why (nothing changes)."""

    model: str
    action: Annotated[str, WithJsonSchema({"enum": list(ACTIONS)})]
    victims: list[PlanVictim]
    error: PlanError | None
    committed_after: NonNegative
    eta_s: Annotated[float, Field(ge=0)] | None


def plan_body(plan: Plan) -> AdminPlan:
    """``GET /admin/plan``'s answer for ``plan``."""
    return {
        "model": plan.model,
        "action": plan.action,
        "victims": [{"model": v.model, "state": v.state.value, "bytes": v.bytes,
                     "why": v.why.value} for v in plan.victims],
        "error": None if plan.error_code is None
        else {"code": plan.error_code, "message": plan.error_message},
        "committed_after": plan.committed_after,
        "eta_s": None if plan.eta_s is None else round(plan.eta_s, 3),
    }


class Reloaded(TypedDict):
    """What a reload changed: models by name, and the settings that wait for a restart."""

    reloaded: Literal[True]
    added: list[str]
    removed: list[str]
    replaced: list[str]
    unchanged: list[str]
    restart_needed: list[str]
    warnings: list[str]


#: ``/admin/history``: journal rows (transitions or leases), or where retention left each model
HistoryRows = TypeAliasType("HistoryRows", list[_Object])


HealthStatus = Literal["ok", "degraded", "shutting_down"]


class Health(TypedDict):
    """Liveness and readiness; ``shutting_down`` comes with status 503."""

    status: HealthStatus
    ready: bool
    reasons: list[str]
    #: models whose residency is being restored after a restart
    restoring: list[str]
    version: str
    uptime_s: float


class Whoami(TypedDict):
    """The key a request presented: its name (null: no keys are set) and scopes."""

    client: str | None
    scopes: list[Annotated[str, WithJsonSchema({"enum": list(SCOPES)})]]
    auth_required: bool


class OpenAPIDocument(TypedDict):
    """This document."""

    openapi: Literal["3.1.0"]
    info: dict[str, str]
    paths: dict[str, _Object]
    components: _Object


#: the bodies the routes answer with (their schemas become components)
BODIES: tuple[Any, ...] = (AdminStatus, AdminPlan, Reloaded, HistoryRows, Health, Whoami,
                           OpenAPIDocument)
