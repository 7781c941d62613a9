"""Continuous batching, the Trio side: which queued generations join the running batch.

A batched model (the eligibility rule of :mod:`mlxd.config.kv`: an mlx-lm text
model, ``max_batch_size`` > 1, a KV cache that mlx-lm can batch) runs its
generations in one :class:`~mlxd.engines.scheduling.batch_loop.BatchLoop` on its MLX thread.
:class:`BatchScheduler` keeps the model's queue (arrival order, ``max_queue``) and
admits the head of the queue into the batch when fewer than ``max_batch_size``
generations are running and the batch's KV with the newcomer is reserved
(:mod:`mlxd.engines.scheduling.kv_gate`: the floor its load committed, plus what the
budget granted for its requests; with ``kv_cache_gb`` set, that fixed region).

KV of a batch: mlx-lm's ``BatchKVCache`` keeps every sequence as long as the
longest one (left padding) and grows by 256 tokens when full. It grows from
wherever it starts: a batch made from caches of other lengths (a prompt-cache
hit, a request that began alone, a newcomer joining) starts at their longest
length, not at a multiple of 256. So a batch of ``n`` sequences whose longest
may grow to ``L`` tokens (prompt + ``max_tokens``) holds up to
``n x (L + 255) x KV bytes per token`` (:func:`mlxd.config.kv.kv_need_bytes`).
A request that does not fit waits in the queue (first come, first served: the
head is never overtaken).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from mlxd.engines.base import KvBook
from mlxd.engines.injected_faults import Faults
from mlxd.engines.runtime.jobs import Job, Outbox
from mlxd.engines.runtime.mlx_thread import MlxThread, call_soon
from mlxd.engines.scheduling.batch_loop import BatchLoop, OutputFactory
from mlxd.engines.scheduling.kv_gate import GatedScheduler

if TYPE_CHECKING:
    from mlxd.engines.cache.prompt_disk import PromptDisk


class BatchScheduler(GatedScheduler):
    """The queue of a batched model (module docstring); all methods on the Trio thread."""

    def __init__(
        self,
        thread: MlxThread,
        loop: BatchLoop,
        *,
        max_queue: int,
        max_batch: int,
        kv: KvBook | None,
        name: str,
        outbox: Outbox | None = None,
    ) -> None:
        super().__init__(thread, None, max_queue=max_queue, name=name, kv=kv)
        self.loop = loop
        #: the engine's outbox: a job's completion rides in the wake-up that carries its events
        self._outbox = outbox
        self.max_batch = max_batch

    @classmethod
    def start(
        cls,
        thread: MlxThread,
        model: Callable[[], tuple[Any, Any]],
        *,
        name: str,
        max_queue: int,
        max_batch: int,
        prefill_step: int,
        kv: KvBook | None,
        prompt_cache_bytes: int,
        outbox: Outbox,
        output: OutputFactory,
        prefill_adapts: bool = False,
        disk: PromptDisk | None = None,
        faults: Faults | None = None,
    ) -> BatchScheduler:
        """A scheduler and its :class:`BatchLoop` on ``thread`` (``model() -> (model, tokenizer)``,
        ``output(request)``: what the engine streams for a request)."""
        box: list[BatchScheduler] = []
        loop = BatchLoop(
            lambda fn: thread.submit(fn),
            model=model,
            max_batch=max_batch,
            prefill_step=prefill_step,
            prompt_cache_bytes=prompt_cache_bytes,
            on_done=lambda job, error: box[0].done_on_thread(job, error),
            outbox=outbox,
            output=output,
            prefill_adapts=prefill_adapts,
            disk=disk,
            faults=faults,
        )
        box.append(
            cls(
                thread,
                loop,
                max_queue=max_queue,
                max_batch=max_batch,
                kv=kv,
                name=name,
                outbox=outbox,
            )
        )
        return box[0]

    def _has_slot(self) -> bool:
        return len(self._active) < self.max_batch

    def _start(self, job: Job) -> None:
        self.loop.add(job)

    def done_on_thread(self, job: Job, error: BaseException | None) -> None:
        """The loop's completion callback (MLX thread): hand the job back to Trio, after the
        events it emitted (in the same wake-up of the Trio thread, when there is an outbox)."""
        if self._outbox is not None:
            self._outbox.call(self._done, job, error)
        else:
            call_soon(self._token, self._done, job, error)
