"""The generation side of the mlx-lm text engine: ``prepare``, ``generate`` and the serial decode.

:class:`TextGeneration` is the part of :class:`~mlxd.engines.mlx_text.MlxTextEngine`
that serves requests once the model is loaded (the load, the caches and the
scheduler are :mod:`mlxd.engines.mlx_text`'s).

``prepare`` validates the request, tokenizes it (a long prompt on a Trio
worker thread, never on the MLX thread: it does not hold up the model's other
requests, and a client that leaves stops waiting at once) and checks it against the model's
prompt limits (:mod:`mlxd.engines.text.prompt_limits`). ``generate`` prepares a
request that was not prepared yet, hands a
:class:`~mlxd.engines.runtime.jobs.Job` to the scheduler (arrival order, one at a
time, ``max_queue`` admission: :class:`~mlxd.errors.Overloaded` before anything
is yielded) and relays what the MLX thread emits. When the consumer leaves
(``trio.Cancelled`` at its await, or ``aclose()``), the job's cancel flag is
set; the MLX thread checks it after every token and, during prefill, after
every ``prefill_step_size`` chunk (the progress callback raises).

What a generation sends goes through :class:`~mlxd.engines.text.streaming.Output`
(stop strings, tool calls in the model family's format, log probabilities),
the same on the serial and the batched path. A request with a
:class:`~mlxd.engines.base.Constraint` (structured output, ``tool_choice``
required or named) gets its grammar logits processor in ``prepare``
(:mod:`mlxd.engines.grammar.constrained`), where the model is: in a worker process
under ``isolation: process``.
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncGenerator, Callable
from contextlib import AbstractContextManager, aclosing, nullcontext
from dataclasses import replace
from typing import Any

from mlxd.engines.base import GenerationEvent, GenerationRequest, KvBook
from mlxd.engines.grammar.constrained import GrammarCache, with_grammar
from mlxd.engines.injected_faults import Faults
from mlxd.engines.runtime import memory
from mlxd.engines.runtime.jobs import GenerationStats, Job, Outbox, PrefillProgress, Sink
from mlxd.engines.scheduling.batching import BatchScheduler
from mlxd.engines.scheduling.serial import SerialScheduler
from mlxd.engines.text import prompt_limits
from mlxd.engines.text.prompts import check_tools, count_image_parts, think_markers, tokenize
from mlxd.engines.text.streaming import JobEvents, Output, TokenTexts, deliver_token
from mlxd.engines.text.tool_calls import ToolFormat
from mlxd.errors import EngineError, InvalidRequest

#: observer(event, stats): called on the Trio thread for "prefill", "token" and "end"; one
#: "token" event may carry several tokens (``stats.completion_tokens`` counts them)
Observer = Callable[[str, GenerationStats], None]


class _PrefillAborted(Exception):
    """Raised from the prefill progress callback to stop a cancelled prompt at a chunk boundary."""


class TextGeneration:
    """A text engine's requests (module docstring); its state is set by ``MlxTextEngine``."""

    # set by MlxTextEngine.__init__ and its load
    name: str
    faults: Faults | None
    prefill_step: int | None
    observer: Observer | None
    limits: prompt_limits.PromptLimits
    kv: KvBook
    _ready: bool
    _scheduler: SerialScheduler | None
    _outbox: Outbox | None
    _has_chat_template: bool
    _tools: ToolFormat | None
    _vocab_size: int
    _grammar: GrammarCache
    _texts: TokenTexts | None
    # owned by the MLX thread
    _model: Any
    _tokenizer: Any

    # ---- protocol: generate ----------------------------------------------------------------

    def _validate_common(self, request: GenerationRequest) -> None:
        """The checks every engine makes: token budget, messages, a chat template for chat."""
        if request.max_tokens < 1:
            raise InvalidRequest("max_tokens must be at least 1", param="max_tokens")
        if request.kind == "chat":
            if not request.messages:
                raise InvalidRequest("messages must not be empty", param="messages")
            if not self._has_chat_template:
                raise InvalidRequest(
                    f"model '{self.name}' has no chat template; use /v1/completions with a plain prompt",
                    param="messages",
                )

    def _validate(self, request: GenerationRequest) -> None:
        self._validate_common(request)
        if request.images or count_image_parts(request.messages):
            raise InvalidRequest(
                f"model '{self.name}' does not accept images (it is not an mllm model)",
                param="messages",
            )
        check_tools(self.name, request, self._tools)

    async def _job_data(self, request: GenerationRequest) -> Any:
        """Engine-specific input prepared off the MLX thread (the vision engine decodes images)."""
        return None

    async def prepare(self, request: GenerationRequest) -> GenerationRequest:
        """Validate, tokenize off the MLX thread, check the prompt limits, cap ``max_tokens`` to
        the KV room, and add the grammar processor of a constraint (module docstring)."""
        ids = await self._prompt_ids(request)
        room = prompt_limits.fit_prompt_tokens(self.name, request, len(ids), self.limits)
        # what admission reserves is prompt + max_tokens: a request that could not fit even
        # alone generates what fits (before its grammar processor plans its budget)
        capped = self.kv.fit(self.name, len(ids), room)
        request = replace(request, prompt_ids=tuple(ids), max_tokens=capped,
                          think_markers=think_markers(self._tokenizer, request, ids))
        return await with_grammar(request, self._tokenizer, self._vocab_size, self._grammar)

    async def _prompt_ids(self, request: GenerationRequest) -> list[int] | tuple[int, ...]:
        """The prompt's token ids (validated; tokenized off the MLX thread when long)."""
        if not self._ready:
            raise EngineError(f"{self.name}: the model is not loaded", retry_after=1.0)
        self._validate(request)
        return await tokenize(self.name, self._tokenizer, request, self._vocab_size, self.limits)

    async def count_tokens(self, request: GenerationRequest) -> int:
        """The prompt's tokens, as :meth:`prepare` counts them; counting refuses nothing for
        the context or the KV room (only a malformed or oversized-text prompt)."""
        return len(await self._prompt_ids(request))

    async def start_generation(self, request: GenerationRequest) -> JobEvents:
        """Prepare ``request`` and put its job on the scheduler now; its events follow.

        A streaming route calls this before it writes its response's first
        bytes, so the model prefills while they go out; ``generate`` is this
        and the events. Closing the events early withdraws the job.
        """
        scheduler = self._scheduler
        if not self._ready or scheduler is None:
            raise EngineError(f"{self.name}: the model is not loaded", retry_after=1.0)
        request = await self.prepare(request)
        kv_tokens = 0  # what batch admission reserves: prompt + max_tokens (text models)
        if request.prompt_ids is not None:
            kv_tokens = len(request.prompt_ids) + request.max_tokens  # prepare capped it
        scheduler.check_capacity()
        data = await self._job_data(request)
        job = Job(request=request, sink=Sink(self._outbox), data=data, kv_tokens=kv_tokens)
        job.stats.request_id = request.request_id
        scheduler.submit(job)
        return JobEvents(job, scheduler.withdraw, self._observe, self.name)

    def expecting(self) -> AbstractContextManager[None]:
        """While this runs, a request is on its way to :meth:`start_generation` (a batched
        model prefills the requests on their way together: mlxd.engines.scheduling.batch_loop)."""
        s = self._scheduler
        return s.loop.expecting() if isinstance(s, BatchScheduler) else nullcontext()

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[GenerationEvent, None]:
        async with aclosing(await self.start_generation(request)) as events:
            async for event in events:
                yield event

    def _observe(self, event: str, stats: GenerationStats) -> None:
        if self.observer is not None:
            self.observer(event, stats)

    # ---- on the MLX thread --------------------------------------------------------------------

    def _output(self, request: GenerationRequest) -> Output:
        """What a generation of ``request`` sends (both decode paths; MLX thread)."""
        return Output(request, self._texts, self._tools)

    def _stop_now(self, job: Job) -> bool:
        """On the MLX thread, at each point a generation may stop (its start, each prefill
        chunk, each token): whether it stops. The distributed engine makes every rank
        agree on the answer (:mod:`mlxd.engines.workers.lockstep`). An injected generation fault
        (``faults: generate``) strikes here, once ``after_tokens`` tokens are out."""
        if self.faults is not None and self.faults.on_token(job.stats.completion_tokens) == "hang":
            self.faults.hang_thread()  # wedged: the cancel flag is not looked at
        return job.cancel.is_set()

    def _run_one(self, job: Job) -> None:
        st = job.stats
        st.started_at = time.monotonic()
        try:
            if self._stop_now(job):
                st.outcome = "cancelled"
                return
            self._generate_on_thread(job)
        finally:
            st.ended_at = time.monotonic()
            memory.after_generation(st.prompt_tokens + st.completion_tokens)

    def _generate_on_thread(self, job: Job) -> None:
        from mlx_lm import stream_generate
        from mlx_lm.sample_utils import make_sampler

        req, st = job.request, job.stats
        ids = list(req.prompt_ids or ())  # generate() prepared it
        st.prompt_tokens = len(ids)
        seed_rng(req.seed)
        top_p = req.top_p if 0.0 < req.top_p < 1.0 else 0.0
        top_k = req.top_k if 0 < req.top_k < self._vocab_size else 0  # past the vocabulary: no limit
        sampler = make_sampler(temp=max(0.0, req.temperature), top_p=top_p, top_k=top_k)

        def on_prefill(done: int, total: int) -> None:
            st.prefill_done = done
            if self._stop_now(job):
                raise _PrefillAborted
            if 0 < done < total:
                st.prefill_chunks += 1
                job.emit(PrefillProgress(done, total))

        out = self._output(req)
        gen = stream_generate(
            self._model,
            self._tokenizer,
            ids,
            max_tokens=req.max_tokens,
            sampler=sampler,
            logits_processors=list(req.logits_processors) or None,
            prefill_step_size=self.prefill_step,
            prompt_progress_callback=on_prefill,
        )
        try:
            for r in gen:
                if self._on_token(
                    job, out, r.text, int(r.token), r.logprobs, r.generation_tokens, r.finish_reason
                ):
                    return
        except _PrefillAborted:
            st.outcome = "cancelled"
        finally:
            gen.close()  # runs mlx-lm's cleanup (wired_limit -> mx.synchronize) here and now

    def _on_token(
        self,
        job: Job,
        out: Output,
        text: str,
        token: int,
        logprobs: Any,
        n_tokens: int,
        finish_reason: str | None,
    ) -> bool:
        """Handle one generated token; True when the generation is over (finished or cancelled)."""
        return deliver_token(
            job, out, text, token, logprobs, n_tokens, finish_reason, stop_now=self._stop_now
        )


def seed_rng(seed: int | None) -> None:
    """Seed this MLX thread's generator: the request's seed, or fresh entropy without one.

    MLX's random state is per thread, and every new thread starts from the same
    process-wide state, so without reseeding each residency of a model would
    sample the same "random" text on its first unseeded request.
    """
    import mlx.core as mx

    mx.random.seed(seed if seed is not None else int.from_bytes(os.urandom(4), "little"))
