"""A model's running KV, the engine's side: admission waits for the budget's reservation.

Theory of operation. A generation's KV grows to ``prompt + max_tokens`` tokens;
a batch holds every sequence as long as its longest (:func:`mlxd.config.kv.kv_need_bytes`).
The model's load committed a floor (``kv_cache``: by default one 2,048-token
sequence); what a batch needs beyond it is reserved in the daemon's budget
through the model's :class:`~mlxd.engines.base.KvBroker` before a request joins,
and given back as the batch shrinks. :class:`GatedScheduler` admits the head of
the queue (first come, first served) when

* it has a slot (``not active`` for a serial model; ``max_batch_size`` for a
  batched one, :class:`~mlxd.engines.scheduling.batching.BatchScheduler`), and
* the batch's KV with it fits ``floor + held``; if it does not, the scheduler asks
  the broker for the difference and the head waits for the answer (room is made
  as for a load: idle models evicted, then the request's contention policy). A
  head whose batch could not fit even with every other model gone waits for the
  batch to shrink instead of asking; one refused gets the error as its event.

With ``kv_cache_gb`` set, the floor is a fixed region and the cap: nothing is
asked of the budget and a head that does not fit waits for the batch (the
behaviour before per-request reservations). Without a broker (a config built in
code, an engine in a worker process, whose parent reserves instead) or with KV
bytes per token unknown, admission is bounded by the batch size only.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import trio

from mlxd.engines.base import KvBook
from mlxd.engines.runtime.jobs import Job
from mlxd.engines.runtime.mlx_thread import MlxThread
from mlxd.engines.scheduling.serial import SerialScheduler
from mlxd.errors import MlxdError


class GatedScheduler(SerialScheduler):
    """A model's queue whose admission follows its KV reservation (module docstring).
    Serial: one generation at a time; :class:`~mlxd.engines.scheduling.batching.BatchScheduler` batches."""

    def __init__(
        self,
        thread: MlxThread,
        run_one: Callable[[Job], None] | None,
        *,
        max_queue: int,
        name: str,
        kv: KvBook | None = None,
    ) -> None:
        super().__init__(thread, run_one, max_queue=max_queue, name=name)
        self.kv = kv

    def _has_slot(self) -> bool:
        return not self._active

    def _tokens_with(self, job: Job) -> list[int]:
        return [j.kv_tokens for j in self._active] + [job.kv_tokens]

    def kv_reserved(self) -> int:
        """The KV bytes the running generations may grow to."""
        kv = self.kv
        if kv is None or not kv.bytes_per_token:
            return 0
        return kv.need([j.kv_tokens for j in self._active])

    def _admissible(self, job: Job) -> bool:
        if not self._has_slot():
            return False
        kv = self.kv
        if kv is None or not kv.bytes_per_token or kv.limit() is None:
            return True  # nothing to keep it within: the batch size bounds it
        if not self._active and not kv.draws:
            return True  # alone it fits its fixed region: prepare capped or refused it otherwise
        need = kv.need(self._tokens_with(job))
        if need <= kv.floor + kv.held:
            return True
        if not kv.draws or kv.pending is not None:
            return False  # a fixed region: the batch must shrink; or the answer is awaited
        limit = kv.limit()
        if self._active and limit is not None and need > limit:
            return False  # not with this batch, whatever is evicted: it must shrink first
        self._ask(kv, job, need - kv.floor - kv.held)
        return False

    def _ask(self, kv: KvBook, job: Job, nbytes: int) -> None:
        assert kv.broker is not None
        kv.pending = job
        kv.withdraw_ask = kv.broker.reserve(
            job.request.lease_id, nbytes, partial(self._answered, job, nbytes)
        )

    def _answered(self, job: Job, nbytes: int, error: MlxdError | None) -> None:
        kv = self.kv
        assert kv is not None
        if kv.pending is not job or self._closed:
            if error is None and kv.broker is not None:
                kv.broker.give_back(nbytes)  # asked for a head that has gone since
            return
        kv.pending = kv.withdraw_ask = None
        if error is None:
            kv.held += nbytes
        elif job in self._waiting:
            self._waiting.remove(job)
            job.stats.outcome = "refused"
            job.sink.put(error)
            job.sink.close_soon()
        self._dispatch()
        self._shrink()

    def _shrink(self) -> None:
        """Give back what the running batch no longer needs (the next heads were served first)."""
        kv = self.kv
        if kv is None or not kv.draws or kv.pending is not None:
            return
        keep = max(0, self.kv_reserved() - kv.floor)
        if kv.held > keep and kv.broker is not None:
            kv.broker.give_back(kv.held - keep)
            kv.held = keep

    def _done(self, job: Job, error: BaseException | None) -> None:
        super()._done(job, error)
        self._shrink()

    def withdraw(self, job: Job) -> None:
        kv = self.kv
        if kv is not None and kv.pending is job:
            withdraw, kv.pending, kv.withdraw_ask = kv.withdraw_ask, None, None
            if withdraw is not None:
                withdraw()
        super().withdraw(job)

    def close(self, reason: BaseException) -> None:
        kv = self.kv
        if kv is not None:
            if kv.withdraw_ask is not None:
                kv.withdraw_ask()
            kv.pending = kv.withdraw_ask = None
            kv.broker = None  # the residency ends: its KV goes with it
        super().close(reason)


class KvLedger:
    """The KV of a model whose engine runs in a worker process, reserved by the daemon side.

    The worker's queue cannot reach the residency core, so the daemon reserves before it
    forwards a request: what every request in flight (queued or running, so at least what
    the worker's batch holds) with the new one may grow to, beyond the floor and what is
    held; requests are taken in arrival order, and what the rest no longer needs is given
    back when one ends.
    """

    def __init__(self, book: KvBook) -> None:
        self.book = book
        self._tokens: dict[int, int] = {}
        self._turn = trio.Lock()  # arrival order: one reservation asked at a time

    async def hold(self, rid: int, tokens: int, lease_id: str | None) -> None:
        """Reserve for request ``rid`` (``tokens``: prompt + max_tokens); raises the refusal."""
        book = self.book
        async with self._turn:
            need = book.need([*self._tokens.values(), tokens])
            missing = need - book.floor - book.held
            if book.draws and missing > 0:
                await self._reserve(missing, lease_id)
                book.held += missing
            self._tokens[rid] = tokens

    async def _reserve(self, nbytes: int, lease_id: str | None) -> None:
        broker = self.book.broker
        assert broker is not None
        answered = trio.Event()
        box: list[MlxdError | None] = []
        gone = False

        def answer(error: MlxdError | None) -> None:
            if gone and error is None and broker is not None:
                broker.give_back(nbytes)  # granted after its request left
            box.append(error)
            answered.set()

        withdraw = broker.reserve(lease_id, nbytes, answer)
        try:
            await answered.wait()
        except BaseException:
            gone = True
            withdraw()
            raise
        if box[0] is not None:
            raise box[0]

    def release(self, rid: int) -> None:
        """Request ``rid`` has ended: give back what the others no longer need."""
        book = self.book
        if self._tokens.pop(rid, None) is None or not book.draws:
            return
        keep = max(0, book.need(list(self._tokens.values())) - book.floor)
        if book.held > keep and book.broker is not None:
            book.broker.give_back(book.held - keep)
            book.held = keep
