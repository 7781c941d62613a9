"""The residency core's books: models, waiters and leases, and what they add up to.

:class:`Registry` holds the records (:mod:`.records`) and answers questions
about them (committed bytes, the next deadline, whether shutdown is complete)
without changing anything; :meth:`Registry.check_invariants` states the
promises they must keep. :class:`mlxd.residency.core.Core` holds them and is
the only thing that changes them (through :class:`mlxd.residency.moves.Moves`),
one event at a time. Pure: no Trio, no I/O, no clock.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

from mlxd.residency.messages import ModelSpec, WaiterKind
from mlxd.residency.policy import ContentionPolicy, ResidencyRules
from mlxd.residency.records import ModelRecord, Waiter
from mlxd.residency.states import DORMANT, SERVING, State


class Registry:
    """The core's books and the questions asked of them; :class:`~mlxd.residency.core.Core` changes them."""

    def __init__(
        self,
        specs: Iterable[ModelSpec],
        budget_bytes: int,
        policy: ContentionPolicy,
        rules: ResidencyRules | None = None,
    ) -> None:
        self.budget = int(budget_bytes)
        self.policy = policy
        self.rules = rules or ResidencyRules()
        self.models: dict[str, ModelRecord] = {s.name: ModelRecord(s) for s in specs}
        #: every waiter by id; each model's ``queue`` holds its own in arrival order
        self.waiters: dict[int, Waiter] = {}
        #: every live lease's model; invariant: lease ``l`` is in ``models[lease_model[l]].leases``
        self.lease_model: dict[str, str] = {}
        #: the clamped keep_alive of live leases that asked for one
        self.lease_keep_alive: dict[str, float] = {}
        #: the contention policy each live lease was granted under: its KV requests wait by it
        self.lease_policy: dict[str, ContentionPolicy] = {}
        #: None, or why new loads are refused (the journal cannot write)
        self.load_gate: str | None = None
        self.shutting_down = False
        #: the latest ``now`` of any event (monotonic seconds); never goes back
        self.now = 0.0
        #: the id of the last load started (load ids only grow)
        self.last_load_id = 0

    def copy(self) -> Registry:
        """An independent copy (what a plan steps on): every container is copied, records
        one by one; frozen values (specs, policies, waiters) are shared."""
        new = copy.copy(self)
        for name, value in vars(self).items():
            if isinstance(value, list | set | dict):
                setattr(new, name, _shallow(value))
        new.models = {name: _copy_record(r) for name, r in self.models.items()}
        return new

    # -- queries ---------------------------------------------------------------------

    @property
    def committed(self) -> int:
        return sum(r.committed_bytes for r in self.models.values() if r.holds_budget)

    def state(self, model: str) -> State:
        return self.models[model].state

    @property
    def shutdown_complete(self) -> bool:
        return self.shutting_down and all(
            r.state in DORMANT for r in self.models.values()
        )

    def next_deadline(self) -> float | None:
        """The earliest time at which a :class:`Tick` could change something."""
        times: list[float] = []
        for r in self.models.values():
            if not r.queue:
                continue
            if r.blocked and r.queue_deadline is not None:
                times.append(r.queue_deadline)
            if r.blocked and r.defer_until is not None:
                times.append(r.defer_until)
            if r.preempt_at is not None and any(
                not self.models[v].preempted for v in r.claims if v in self.models
            ):
                times.append(r.preempt_at)
        for r in self.models.values():
            due = self.idle_due(r)
            if due is not None:
                times.append(due)
            if r.retry_at is not None:
                times.append(r.retry_at)
        return min(times) if times else None

    def unload_due(self, model: str) -> float | None:
        """When ``model`` unloads for want of leases if none comes (monotonic seconds); None:
        not while it stays as it is (in use, pinned, kept until evicted, or not loaded)."""
        return self.idle_due(self.models[model])

    def idle_due(self, r: ModelRecord) -> float | None:
        """When ``r`` unloads for want of leases: its last lease's keep_alive, else its idle_unload_s."""
        if (
            r.state is not State.LOADED
            or r.leases
            or r.spec.pinned
            or r.last_used is None
            or self.shutting_down
        ):
            return None
        if r.keep_alive_s is not None:
            return None if r.keep_alive_s < 0 else r.last_used + r.keep_alive_s
        if r.spec.idle_unload_s > 0:
            return r.last_used + r.spec.idle_unload_s
        return None

    def check_invariants(self) -> None:
        """Raise AssertionError if a promise of the module docstring is broken."""
        assert self.committed <= self.budget, (self.committed, self.budget)
        for name, r in self.models.items():
            assert 0 <= r.kv_bytes <= r.committed_bytes, (name, r.kv_bytes, r.committed_bytes)
            if r.leases:
                assert r.state in SERVING, (name, r.state)
            for lid in r.leases:
                assert self.lease_model[lid] == name
        assert len(self.lease_model) == sum(len(r.leases) for r in self.models.values())
        assert self.lease_keep_alive.keys() <= self.lease_model.keys()
        assert self.lease_policy.keys() <= self.lease_model.keys()
        for w in self.waiters.values():  # KV is asked for by a live lease of its own model
            if w.kind is WaiterKind.KV:
                assert self.lease_model.get(w.lease_id) == w.model, (w.lease_id, w.model)


def _shallow(value: list[Any] | set[Any] | dict[Any, Any]) -> list[Any] | set[Any] | dict[Any, Any]:
    return value.copy()


def _copy_record(r: ModelRecord) -> ModelRecord:
    new = copy.copy(r)
    for name, value in vars(r).items():
        if isinstance(value, list | set | dict):
            setattr(new, name, _shallow(value))
    return new
