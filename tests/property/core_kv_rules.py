"""The KV rules of the core's state machine (tests/property/test_core_machine.py).

A lease holder asks for KV of its model (``ReserveKV``, as an engine admitting a
request does), withdraws the ask, gives KV back (``ReturnKV``: its batch
shrank); a request comes with its KV at once; and the plan for a request of N
tokens' KV on a loaded model is compared with what its acquire and reservation
then do. The machine's shell state (leases, KV asks in flight, KV held per
model) and its ``feed`` are the machine's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hypothesis import event as note_event
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from mlxd.residency.messages import CancelWaiter, Reject, ReserveKV, ReturnKV, Satisfy
from mlxd.residency.plan import plan
from mlxd.residency.states import State
from mlxd.units import GIB
from tests.property.test_plan import fingerprint

if TYPE_CHECKING:
    from mlxd.residency.core import Core

NAMES = ["a", "b", "c", "d"]


class KvRules:
    """Rules and shell bookkeeping of KV reservations (mixed into the core's machine)."""

    core: Core | None
    now: float
    leases: dict[str, str]
    preempted: set[str]
    kv_waiters: dict[int, tuple[str, int]]
    kv_lease: dict[int, str]
    kv_held: dict[str, int]
    last_commands: list[Any]
    ids: Any

    def feed(self, event: Any) -> bool: ...  # the machine's

    def acquire_event(self, model: str, resident: bool, keep_alive: Any, asked: Any) -> Any: ...

    def _lease_ended(self, lid: str) -> None:
        """The KV requests a lease left waiting are dropped with it."""
        for wid in [w for w, x in self.kv_lease.items() if x == lid]:
            del self.kv_waiters[wid], self.kv_lease[wid]

    @precondition(lambda self: bool(set(self.leases) - self.preempted))
    @rule(data=st.data(), gib=st.sampled_from([0.5, 1, 2, 3, 12]))
    def reserve_kv(self, data: st.DataObject, gib: float) -> None:
        """A lease holder's engine admits its request: it asks for KV beyond its model's."""
        lid = data.draw(st.sampled_from(sorted(set(self.leases) - self.preempted)))
        wid = next(self.ids)
        model, nbytes = self.leases[lid], int(gib * GIB)
        self.kv_waiters[wid], self.kv_lease[wid] = (model, nbytes), lid
        self.feed(ReserveKV(wid, model, lid, nbytes, self.now))
        assert self.core is not None
        for v in self.core.victims:
            assert v.model != v.for_model, f"{v.model} was made a victim of its own waiters"
        answer = [c for c in self.last_commands if isinstance(c, Satisfy | Reject) and c.waiter_id == wid]
        outcome = type(answer[0]).__name__ if answer else "waits"
        note_event(f"KV {outcome}" + (" after evicting" if self.core.victims else ""))

    @precondition(lambda self: self.core is not None and not self.core.shutting_down)
    @rule(model=st.sampled_from(NAMES), gib=st.sampled_from([0.5, 1, 2, 3]), data=st.data())
    def request_with_kv(self, model: str, gib: float, data: st.DataObject) -> None:
        """A request on a loaded model: its lease at once, then its KV (idle models may go)."""
        assert self.core is not None
        r = self.core.models.get(model)
        if r is None or r.state is not State.LOADED:
            return
        self.feed(self.acquire_event(model, False, None, None))
        if set(self.leases) - self.preempted:
            self.reserve_kv(data, gib)

    @precondition(lambda self: bool(self.kv_waiters))
    @rule(data=st.data())
    def cancel_kv(self, data: st.DataObject) -> None:
        wid = data.draw(st.sampled_from(sorted(self.kv_waiters)))
        del self.kv_waiters[wid], self.kv_lease[wid]
        self.feed(CancelWaiter(wid, self.now))

    @precondition(lambda self: any(self.kv_held.values()))
    @rule(data=st.data(), part=st.sampled_from([0.25, 0.5, 1.0, 2.0]))
    def return_kv(self, data: st.DataObject, part: float) -> None:
        """A batch shrank (its requests ended): the engine gives KV back."""
        model = data.draw(st.sampled_from(sorted(m for m, n in self.kv_held.items() if n)))
        nbytes = int(self.kv_held[model] * part)
        self.kv_held[model] -= min(nbytes, self.kv_held[model])
        self.feed(ReturnKV(model, nbytes, self.now))

    @precondition(
        lambda self: self.core is not None and not self.core.shutting_down and bool(self.core.models)
    )
    @rule(data=st.data(), gib=st.sampled_from([0.5, 1, 3, 12]))
    def plan_kv_then_reserve(self, data: st.DataObject, gib: int) -> None:
        """The plan for a request with KV on a loaded model says what its acquire and its
        reservation then do, and changes nothing."""
        core = self.core
        assert core is not None
        loaded = sorted(n for n, r in core.models.items() if r.state is State.LOADED and not r.queue)
        if not loaded:
            return
        model, nbytes = data.draw(st.sampled_from(loaded), label="model"), int(gib * GIB)
        before = fingerprint(core)
        p = plan(core, model, self.now, kv_bytes=nbytes)
        assert fingerprint(core) == before
        event = self.acquire_event(model, False, None, None)
        self.feed(event)
        if event.lease_id not in self.leases:
            return  # refused or queued behind another waiter: the KV part is not reached
        wid = next(self.ids)
        self.kv_waiters[wid], self.kv_lease[wid] = (model, nbytes), event.lease_id
        self.feed(ReserveKV(wid, model, event.lease_id, nbytes, self.now))
        answer = [c for c in self.last_commands if isinstance(c, Satisfy | Reject) and c.waiter_id == wid]
        victims = [(v.model, v.bytes) for v in core.victims]
        if answer and isinstance(answer[0], Satisfy):
            assert (p.action, p.error_code) == ("ready", None), p
        elif answer:
            assert isinstance(answer[0], Reject)
            assert (p.action, p.error_code) == ("fail", answer[0].error.code), p
        else:
            assert p.action in ("evict_then_load", "drain_then_load", "wait"), p
        assert [(v.model, v.bytes) for v in p.victims] == victims

