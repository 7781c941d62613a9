"""Status views of the manager: what ``/admin/status``, ``/v1/models`` and ``mlxd status`` show.

Read-only: these functions read a :class:`~mlxd.residency.manager.Manager`
through its public queries (frozen snapshots of its core) and build plain dicts (and :func:`kv_peak`, the event the manager
emits when a residency ends: what it used of its KV budgets); they never
change anything.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import trio

from mlxd.engines.base import LoadProgress
from mlxd.residency.events import KvPeakEvent
from mlxd.residency.progress import LoadEstimate
from mlxd.residency.records import ResidencySnapshot
from mlxd.residency.states import Reason, State
from mlxd.units import format_bytes

if TYPE_CHECKING:
    from mlxd.residency.manager import Manager


@dataclass
class LoadInfo:
    """A load in flight, for status and health."""

    model: str
    load_id: int
    started: float
    progress: LoadProgress = field(default_factory=LoadProgress)


def load_estimate(manager: Manager, model: str) -> LoadEstimate | None:
    """How far ``model``'s load in flight is, by its measured load time (None: not loading)."""
    info = next((i for i in manager.loads_in_flight() if i.model == model), None)
    if info is None:
        return None
    p = info.progress
    return LoadEstimate(
        model,
        trio.current_time() - info.started,
        manager.estimates.load_seconds(model),
        p.phase,
        p.bytes_done,
        p.bytes_total,
    )


def model_status(manager: Manager, name: str) -> dict[str, Any]:
    r = manager.model_snapshot(name)
    est = load_estimate(manager, name)
    in_use = _in_use(manager, name)
    return {
        "state": r.state.value,
        # the routing facts a fleet router reads (mlxd.fleet), cheap and read-only:
        #: what this model holds of the budget now (0 unless loading, loaded, draining or unloading)
        "committed_bytes": r.committed_bytes if r.holds_budget else 0,
        #: requests waiting for a lease on it (its load, or room)
        "queued": r.queued,
        #: requests holding a lease on it (generating, or queued in its engine)
        "running": r.running,
        #: KV bytes its running generations hold now (engines that measure it; else 0)
        "kv_in_use": int(in_use.get("kv_cache", 0)) if in_use is not None else 0,
        #: how long its last measured load took (journaled: survives restarts; None: never loaded)
        "expected_load_seconds": _rounded(manager.estimates.load_seconds(name)),
        "loaded": r.state is State.LOADED,
        "pinned": r.spec.pinned,
        "memory_bytes": r.committed_bytes if r.holds_budget else r.spec.size_bytes,
        "memory_source": manager.estimates.source(name),
        #: what a load commits, by part (weights + kv_cache + prompt_cache = estimated_bytes)
        "memory": manager.estimates.memory_parts(name),
        #: what a resident engine holds now beyond its weights (batched mlx-lm models)
        "memory_in_use": in_use,
        "estimated_bytes": r.spec.size_bytes,
        "last_used_at": manager.wall_of(r.last_used),
        "last_error": r.last_error,
        "stop_failures": r.stop_failures,
        "stop_retry_in_s": None
        if r.retry_at is None
        else round(max(0.0, r.retry_at - trio.current_time()), 3),
        "active_leases": r.running,
        "waiters": r.queued,
        "idle_unload_seconds": r.spec.idle_unload_s,
        "engine": _engine(manager, name),
        "loading": None if est is None else {
            "seconds": round(est.elapsed_s, 3),
            "phase": est.phase,
            "bytes_done": est.bytes_done,
            "bytes_total": est.bytes_total,
            "percent": est.percent,
            "eta_s": None if est.eta_s is None else round(est.eta_s, 3),
        },
        "priority": r.spec.priority,
    }


def _in_use(manager: Manager, name: str) -> dict[str, int] | None:
    """``{kv_cache, kv_cache_peak, prompt_cache}`` bytes of an engine that reports them, else None."""
    usage = getattr(manager.engine_of(name), "memory_usage", None)
    held = usage() if callable(usage) else None
    return dict(held) if held is not None else None


def kv_peak(manager: Manager, name: str) -> KvPeakEvent | None:
    """What ``name``'s residency used of its KV budgets, read before its engine stops.

    None unless its engine measures its KV (``memory_usage()`` with
    ``kv_cache_peak``: batched mlx-lm models) and it reached ``loaded`` (not
    the partial engine of a failed load). The budgets are the ``kv_cache`` and
    ``prompt_cache`` parts its load committed (what ``/v1/models`` shows).
    """
    if not manager.has_model(name):
        return None
    r = manager.model_snapshot(name)
    usage = _in_use(manager, name)
    if r.loaded_at is None or usage is None or "kv_cache_peak" not in usage:
        return None
    parts = manager.estimates.memory_parts(name)
    loaded_at, now = manager.wall_of(r.loaded_at), manager.wall_of(trio.current_time())
    assert loaded_at is not None and now is not None
    return KvPeakEvent(
        model=name,
        at=now,
        loaded_at=loaded_at,
        kv_peak_bytes=int(usage["kv_cache_peak"]),
        kv_budget_bytes=parts["kv_cache"],
        prompt_cache_bytes=int(usage.get("prompt_cache", 0)),
        prompt_cache_budget_bytes=parts["prompt_cache"],
    )


def dead_engines(manager: Manager, res: ResidencySnapshot) -> list[str]:
    """One line per model failed because its engine died (until it loads again), for /health."""
    lines = []
    for name, state, _, _ in res.models:
        t = manager.last_transition.get(name)
        if state is State.FAILED and t is not None and t.reason is Reason.ENGINE_DIED:
            error = manager.model_snapshot(name).last_error
            lines.append(f"the engine of '{name}' died ({error}); the next request loads it again")
    return lines


def _engine(manager: Manager, name: str) -> dict[str, Any] | None:
    """Where a resident model's engine runs (worker pids for ``isolation: process``)."""
    engine = manager.engine_of(name)
    if engine is None:
        return None
    describe = getattr(engine, "describe", None)
    return describe() if describe is not None else {"isolation": "thread"}


def status(manager: Manager) -> dict[str, Any]:
    res = manager.snapshot()
    return {
        "budget_bytes": res.budget_bytes,
        "committed_bytes": res.committed_bytes,
        #: what is left of the budget: a model this size or smaller loads without evicting
        "free_bytes": res.free_bytes,
        "policy": {
            "strategy": res.policy.strategy,
            "wait_timeout_s": res.policy.wait_timeout_s,
            "preempt_after_s": res.policy.preempt_after_s,
            **asdict(res.rules),
        },
        "shutting_down": res.shutting_down,
        "load_gate": res.load_gate,
        "models": {name: model_status(manager, name) for name in manager.model_names()},
        "waiters": [
            {
                "model": w.model,
                "kind": w.kind.value,
                "reason": w.reason.value,
                "waiting_s": round(trio.current_time() - w.since, 3),
                "blocked": manager.model_snapshot(w.model).blocked,
                "deadline_in_s": None
                if w.deadline is None
                else round(w.deadline - trio.current_time(), 3),
            }
            for w in res.waiters
        ],
        "leases": [
            {
                "id": lease.id,
                "model": lease.model,
                "request_id": lease.request_id,
                "route": lease.route,
                "held_s": round(trio.current_time() - lease.acquired_at, 3),
                "preempted": lease.preempted,
            }
            for lease in manager.leases()
        ],
    }


def failing_stops(manager: Manager, res: ResidencySnapshot) -> list[str]:
    """One line per model whose engine failed to stop and still holds its memory (for /health)."""
    lines = []
    now = trio.current_time()
    for name, _, _, stop_failures in res.models:
        if stop_failures == 0:
            continue
        r = manager.model_snapshot(name)
        retry = (
            "being retried now"
            if r.retry_at is None
            else f"retried in {max(0.0, r.retry_at - now):.0f} s; not a victim until then"
        )
        lines.append(
            f"'{name}': stopping its engine failed {r.stop_failures} time(s) ({r.last_error});"
            f" its {format_bytes(r.committed_bytes)} stay counted ({r.state}); {retry}"
        )
    return lines


def _rounded(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 3)
