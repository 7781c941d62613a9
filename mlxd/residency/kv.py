"""A model's KV drawn from the budget: the Trio shell's side of ``ReserveKV`` / ``ReturnKV``.

An engine that reserves its requests' KV (:mod:`mlxd.engines.scheduling.kv_gate`) is handed
a :class:`ModelKv` before its load (``engine.use_kv_broker``). Its asks become
:class:`~mlxd.residency.messages.ReserveKV` events: a waiter in the model's queue
like an acquire, under the contention policy of the lease the request holds, so
room is made exactly as for a load (idle models evicted LRU, then the policy),
never by the model itself. The answer is handed back on a later turn of the
Trio loop (an engine's callback never runs inside a core step), and what the
batch no longer needs comes back as :class:`~mlxd.residency.messages.ReturnKV`.

A reservation that evicts or drains is journaled on its victims: their
``unloading`` / ``draining`` transition (reason ``evicted`` or ``preempted``)
carries ``cause``: ``KV of a request on 'M' (N bytes)``, in the events payload.
One that was not granted at once (it waited for an eviction, a drain or other
requests' KV) adds its wait to its lease, journaled as
``leases.kv_wait_seconds`` (NULL when no reservation of the lease waited).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import trio

from mlxd.config.kv import eligibility, kv_need_bytes, resolve_cache_sizes
from mlxd.engines.base import KvAnswer, KvBook

if TYPE_CHECKING:
    from mlxd.errors import MlxdError
    from mlxd.residency.manager import Manager


class ModelKv:
    """The :class:`~mlxd.engines.base.KvBroker` of one model's residency."""

    def __init__(self, manager: Manager, model: str) -> None:
        self._manager = manager
        self.model = model
        self._token = trio.lowlevel.current_trio_token()

    def floor(self) -> int:
        return self._manager.estimates.memory_parts(self.model)["kv_cache"]

    def room(self) -> int:
        return self._manager.kv_room(self.model)

    def reserve(self, lease_id: str | None, nbytes: int, answer: KvAnswer) -> Callable[[], None]:
        m = self._manager
        asked, queued = trio.current_time(), False

        def settled(error: MlxdError | None) -> None:
            if queued:  # not granted (or refused) at once: it waited, its lease says how long
                lease = next((x for x in m.leases() if x.id == lease_id), None)
                if lease is not None:
                    lease.note_kv_wait(trio.current_time() - asked)
            self._token.run_sync_soon(answer, error)

        ticket = m.ask_kv(self.model, lease_id or "", nbytes, settled)
        queued = True

        def withdraw() -> None:
            ticket.on_settle = None
            m.withdraw(ticket.id)

        return withdraw

    def give_back(self, nbytes: int) -> None:
        if nbytes > 0:
            self._manager.return_kv(self.model, nbytes)


def draw_kv(manager: Manager, model: str, engine: object) -> None:
    """Hand ``engine`` its model's broker, if it reserves KV per request."""
    use = getattr(engine, "use_kv_broker", None)
    if callable(use):
        use(ModelKv(manager, model))


def kv_bytes_for(manager: Manager, model: str, tokens: int) -> int:
    """The KV bytes beyond its model's floor a request of ``tokens`` tokens (prompt +
    max_tokens) would reserve, as if it ran alone: what ``GET /admin/plan?tokens=N`` plans.
    0 where nothing is drawn per request (``kv_cache_gb`` set, fake, embedding, distributed,
    unknown size: :func:`mlxd.config.kv.eligibility`)."""
    book = getattr(manager.engine_of(model), "kv", None)
    if isinstance(book, KvBook):  # loaded: its own book (the floor and what it holds)
        if not book.draws:
            return 0
        return max(0, book.need([tokens]) - book.floor - book.held)
    mc = manager.config.model(model)
    if mc is None or mc.kv_cache_bytes is not None or tokens <= 0 or not eligibility(mc).per_request:
        return 0
    sizes = resolve_cache_sizes(mc)  # reads config.json: a plan, never per request
    if not sizes.kv_bytes_per_token:
        return 0
    return max(0, kv_need_bytes([tokens], sizes.kv_bytes_per_token) - sizes.kv_cache)
