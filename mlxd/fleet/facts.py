"""What a router knows of each daemon, and the choice it makes from that (pure: no I/O, no clock).

A daemon's facts come from its ``GET /admin/status`` (the routing facts of
DESIGN.md "Wave 3 contracts / Fleet": per model ``state``,
``committed_bytes``, ``queued``, ``running``, ``kv_in_use``,
``expected_load_seconds``; the daemon's ``free_bytes``), read without loading
anything.

:func:`rank` orders the daemons that may serve a model, best first:

1. where it is ``loaded``, least queued (queued + running) first: the request
   is sent with ``X-Mlxd-Require-Resident: 1``, so a daemon that has lost it
   since says so (503 ``model_not_resident``) instead of loading it;
2. where it is ``loading``: the request joins that load (one load per model);
3. else where loading it evicts the least (:func:`load_cost`): first room that
   is free, then idle models (least recently used first, as the daemon picks
   them) by the seconds it would take to load them back, then bytes; a
   daemon that would have to wait for busy models comes last.

Among equal costs the less busy, then the emptier daemon wins (models spread
over the fleet), then the daemon listed first, so that concurrent requests for
a model agree on where it should live, and it settles there. :func:`with_request`
writes a routed request into the facts at once (the status shows it only at
the next refresh), so that the next choice already sees it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

#: reload seconds assumed for a model never loaded on that daemon (it reports none)
DEFAULT_LOAD_S = 5.0
_RESIDENT = "loaded"
_HOLDING = ("loading", "loaded", "draining", "unloading")


@dataclass(frozen=True, slots=True)
class ModelFacts:
    state: str
    committed_bytes: int
    estimated_bytes: int
    queued: int
    running: int
    kv_in_use: int
    expected_load_seconds: float | None
    last_used_at: float | None
    pinned: bool

    @property
    def busy(self) -> int:
        return self.queued + self.running


@dataclass(frozen=True, slots=True)
class DaemonFacts:
    name: str
    budget_bytes: int
    free_bytes: int
    models: Mapping[str, ModelFacts]

    @classmethod
    def from_status(cls, name: str, body: Mapping[str, Any]) -> DaemonFacts:
        """The facts of ``GET /admin/status``; a field it lacks reads as zero or None.
        ValueError if ``body`` is not such a status (another service, or a proxy, at that URL)."""
        try:
            return cls._from_status(name, body)
        except (AttributeError, TypeError, ValueError, OverflowError) as e:
            raise ValueError(f"not an mlxd /admin/status ({type(e).__name__}: {e})") from e

    @classmethod
    def _from_status(cls, name: str, body: Mapping[str, Any]) -> DaemonFacts:
        models = {}
        for model, m in (body.get("models") or {}).items():
            models[model] = ModelFacts(
                state=str(m.get("state", "unloaded")),
                committed_bytes=int(m.get("committed_bytes") or 0),
                estimated_bytes=int(m.get("estimated_bytes") or m.get("memory_bytes") or 0),
                queued=int(m.get("queued", m.get("waiters")) or 0),
                running=int(m.get("running", m.get("active_leases")) or 0),
                kv_in_use=int(m.get("kv_in_use") or 0),
                expected_load_seconds=_seconds(m.get("expected_load_seconds")),
                last_used_at=_seconds(m.get("last_used_at")),
                pinned=bool(m.get("pinned")),
            )
        budget = int(body.get("budget_bytes") or 0)
        free = body.get("free_bytes")
        if free is None:
            free = max(0, budget - int(body.get("committed_bytes") or 0))
        return cls(name, budget, int(free), models)


def _seconds(v: Any) -> float | None:
    return None if v is None else float(v)


@dataclass(frozen=True, slots=True)
class Cost:
    """What loading a model on a daemon would cost, compared field by field (lower is better)."""

    busy_bytes: int  # room only busy models hold: the load would wait for them (or fail)
    reload_s: float  # seconds to load back the idle models it evicts
    evicted_bytes: int

    def key(self) -> tuple[int, float, int]:
        return (self.busy_bytes, self.reload_s, self.evicted_bytes)


FREE = Cost(0, 0.0, 0)


def _victims(facts: DaemonFacts, model: str) -> tuple[list[str], int]:
    """The idle models loading ``model`` would evict (least recently used first, as the daemon
    picks them), and the bytes still missing after them (held by busy or pinned models)."""
    need = facts.models[model].estimated_bytes - facts.free_bytes
    idle = sorted(
        (
            (name, v) for name, v in facts.models.items()
            if name != model and v.state == _RESIDENT and v.busy == 0 and not v.pinned
        ),
        key=lambda nv: (nv[1].last_used_at or 0.0, nv[0]),
    )
    victims = []
    for name, v in idle:
        if need <= 0:
            break
        victims.append(name)
        need -= v.committed_bytes
    return victims, max(0, need)


def load_cost(facts: DaemonFacts, model: str) -> Cost:
    """What loading ``model`` on this daemon would evict, or wait for."""
    if model not in facts.models:
        return Cost(1 << 62, 0.0, 0)
    victims, missing = _victims(facts, model)
    reload_s = sum(
        s if (s := facts.models[v].expected_load_seconds) is not None else DEFAULT_LOAD_S
        for v in victims
    )
    return Cost(missing, reload_s, sum(facts.models[v].committed_bytes for v in victims))


@dataclass(frozen=True, slots=True)
class Choice:
    """One daemon for a request: ``resident`` means the model is loaded there (send the header)."""

    daemon: str
    resident: bool
    why: str


def _rank_key(facts: DaemonFacts, model: str, order: int) -> tuple[Any, ...]:
    m = facts.models[model]
    if m.state == _RESIDENT:
        return (0, m.busy, order)
    if m.state == "loading":
        return (1, m.busy, order)
    # then the less busy, then the emptier daemon: models spread over the fleet
    busy = sum(v.busy for v in facts.models.values())
    return (2, *load_cost(facts, model).key(), busy, -facts.free_bytes, order)


def rank(model: str, daemons: Sequence[DaemonFacts]) -> list[Choice]:
    """The daemons (in the order given, which breaks ties) that know ``model``, best first."""
    known = [(i, f) for i, f in enumerate(daemons) if model in f.models]
    known.sort(key=lambda it: _rank_key(it[1], model, it[0]))
    out = []
    for _i, f in known:
        m = f.models[model]
        if m.state == _RESIDENT:
            out.append(Choice(f.name, True, f"resident, {m.busy} queued or running"))
        elif m.state == "loading":
            out.append(Choice(f.name, False, "loading: joins the load"))
        else:
            c = load_cost(f, model)
            why = ("fits in free memory" if c == FREE
                   else f"evicts {c.evicted_bytes} idle bytes ({c.reload_s:.1f} s to reload)"
                   + (f", waits for {c.busy_bytes} busy bytes" if c.busy_bytes else ""))
            out.append(Choice(f.name, False, why))
    return out


def with_request(facts: DaemonFacts, model: str, *, resident: bool) -> DaemonFacts:
    """``facts`` once a request for ``model`` was routed here: one more queued request, and
    for a request that loads it, the model ``loading`` in the room it takes (idle victims gone)."""
    m = facts.models.get(model)
    if m is None:
        return facts
    models = dict(facts.models)
    if resident or m.state in _HOLDING:
        models[model] = replace(m, queued=m.queued + 1)
        return replace(facts, models=models)
    free = facts.free_bytes
    for name in _victims(facts, model)[0]:
        v = models[name]
        models[name] = replace(v, state="unloaded", committed_bytes=0)
        free += v.committed_bytes
    models[model] = replace(m, state="loading", committed_bytes=m.estimated_bytes,
                            queued=m.queued + 1)
    return replace(facts, free_bytes=max(0, free - m.estimated_bytes), models=models)


def without_model(facts: DaemonFacts, model: str) -> DaemonFacts:
    """``facts`` once the daemon said ``model_not_resident``: not loaded there after all."""
    m = facts.models.get(model)
    if m is None or m.state != _RESIDENT:
        return facts
    models = dict(facts.models)
    models[model] = replace(m, state="unloaded", committed_bytes=0)
    return replace(facts, free_bytes=facts.free_bytes + m.committed_bytes, models=models)
