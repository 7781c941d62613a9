"""Continuous batching, the Trio side: which queued generations join the running batch.

A batched model (mlx-lm text model, ``max_batch_size`` > 1, a KV cache that
mlx-lm can batch) runs its generations in one :class:`~mlxd.engines.batch_loop.BatchLoop`
on its MLX thread. :class:`BatchScheduler` keeps the model's queue (arrival
order, ``max_queue``) and admits the head of the queue into the batch when

* fewer than ``max_batch_size`` generations are running, and
* the batch's KV, with the newcomer, fits the model's committed ``kv_cache``.

KV of a batch: mlx-lm's ``BatchKVCache`` keeps every sequence as long as the
longest one (left padding) and grows by 256 tokens when full. It grows from
wherever it starts: a batch made from caches of other lengths (a prompt-cache
hit, a request that began alone, a newcomer joining) starts at their longest
length, not at a multiple of 256. So a batch of ``n`` sequences whose longest
may grow to ``L`` tokens (prompt + ``max_tokens``) holds up to
``n x (L + 255) x KV bytes per token``; that is the figure admission keeps
within ``kv_cache`` (:func:`batch_kv_bytes`). A
request that does not fit waits in the queue (first come, first served: the
head is never overtaken) until running generations finish. A request that
could not fit even alone is capped before queueing (:func:`cap_to_kv`): it
generates as many tokens as fit, or is refused if its prompt alone does not.
When the KV bytes per token are unknown (``kv_cache`` 0: a model whose
config.json was not on disk when its memory was estimated) admission is
bounded by ``max_batch_size`` only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from mlxd.engines.batch_loop import BatchLoop, OutputFactory
from mlxd.engines.faults import Faults
from mlxd.engines.memory import KV_STEP
from mlxd.engines.mlx_thread import Job, MlxThread, Outbox, SerialScheduler, call_soon
from mlxd.errors import InvalidRequest
from mlxd.units import format_bytes

if TYPE_CHECKING:
    from mlxd.engines.prompt_disk import PromptDisk


def batch_kv_bytes(kv_tokens: list[int], bytes_per_token: int) -> int:
    """The most KV a batch of sequences growing to ``kv_tokens`` tokens can hold (module docstring)."""
    if not kv_tokens:
        return 0
    longest = max(kv_tokens) + KV_STEP - 1  # the last growth step may be all but one unused
    return len(kv_tokens) * longest * bytes_per_token


def cap_to_kv(
    prompt_tokens: int, max_tokens: int, bytes_per_token: int | None, kv_budget: int
) -> int:
    """The ``max_tokens`` a request may run with so that its KV fits ``kv_cache`` even alone.

    A prompt whose KV alone does not fit is refused (400); a request whose prompt
    + ``max_tokens`` would not fit generates as many tokens as do (it ends with
    finish_reason ``length``, as at a context limit). Unknown sizes: unchanged.
    """
    if not bytes_per_token or kv_budget <= 0:
        return max_tokens
    room = kv_budget // bytes_per_token - (KV_STEP - 1)  # tokens that fit, with a growth step
    if prompt_tokens >= room:
        raise InvalidRequest(
            f"the prompt's KV cache ({prompt_tokens:,} tokens, "
            f"{format_bytes(prompt_tokens * bytes_per_token)}) does not fit the model's "
            f"kv_cache_gb ({format_bytes(kv_budget)}, {room:,} tokens); shorten the prompt",
            param="messages",
        )
    return min(max_tokens, room - prompt_tokens)


class BatchScheduler(SerialScheduler):
    """The queue of a batched model (module docstring); all methods on the Trio thread."""

    def __init__(
        self,
        thread: MlxThread,
        loop: BatchLoop,
        *,
        max_queue: int,
        max_batch: int,
        kv_budget: int,
        kv_bytes_per_token: int | None,
        name: str,
        outbox: Outbox | None = None,
    ) -> None:
        super().__init__(thread, None, max_queue=max_queue, name=name)
        self.loop = loop
        #: the engine's outbox: a job's completion rides in the wake-up that carries its events
        self._outbox = outbox
        self.max_batch = max_batch
        self.kv_budget = kv_budget
        self.kv_bytes_per_token = kv_bytes_per_token

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
        kv_budget: int,
        kv_bytes_per_token: int | None,
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
                kv_budget=kv_budget,
                kv_bytes_per_token=kv_bytes_per_token,
                name=name,
                outbox=outbox,
            )
        )
        return box[0]

    def kv_reserved(self) -> int:
        """The KV bytes the running batch may grow to (what admission keeps within ``kv_budget``)."""
        if not self.kv_bytes_per_token:
            return 0
        return batch_kv_bytes([j.kv_tokens for j in self._active], self.kv_bytes_per_token)

    def _admissible(self, job: Job) -> bool:
        if len(self._active) >= self.max_batch:
            return False
        if not self.kv_bytes_per_token or self.kv_budget <= 0 or not self._active:
            return True  # alone it fits: check_fits_alone refused it otherwise
        tokens = [j.kv_tokens for j in self._active] + [job.kv_tokens]
        return batch_kv_bytes(tokens, self.kv_bytes_per_token) <= self.kv_budget

    def _start(self, job: Job) -> None:
        self.loop.add(job)

    def done_on_thread(self, job: Job, error: BaseException | None) -> None:
        """The loop's completion callback (MLX thread): hand the job back to Trio, after the
        events it emitted (in the same wake-up of the Trio thread, when there is an outbox)."""
        if self._outbox is not None:
            self._outbox.call(self._done, job, error)
        else:
            call_soon(self._token, self._done, job, error)
