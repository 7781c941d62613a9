"""A batched model's lone request, decoded without the ``BatchGenerator`` until a second one comes.

Theory of operation. While one request is all a batched model has,
:class:`~mlxd.engines.scheduling.batch_loop.BatchLoop` runs it here: the prompt's
longest cached prefix from the prompt cache, the rest prefilled in chunks
(``solo_chunk`` tokens, each one loop step: at least 512 unless the step was
set by hand, see :func:`mlxd.engines.scheduling.prefill_pace.solo_chunk`), then one forward pass per
token on plain per-layer KV caches, the way ``mlx_lm.generate_step`` does.
mlx-lm's batch machinery (left-padded batch caches, masks, per-row
bookkeeping) costs about 0.9 ms a token and 4 ms to the first token on the
tiny demo model; a lone stream does not need it.

Between two steps :meth:`SoloRun.run` looks at the loop's inbox. When a
request is waiting it stops at a point where everything it has is exact: the
KV of the tokens fed so far, and what the model has still to be fed (the rest
of the prompt, or the last token delivered), and returns that as a
:class:`Resume`. The loop inserts it into the generator as a prompt with that
cache (``insert(caches=..., all_tokens=...)``), with the same sampler (its
random key already advanced past every token delivered) and the remaining
``max_tokens``, so the request goes on in the batch as if it had been there
from the start: at temperature 0 the tokens are the same either way (fp32 on
the CPU; the batch test compares them), and a seeded request draws the same.

A request with logits processors (structured output, tools) goes to the
generator at once: its processors keep state the handover would have to
carry. Everything here holds MLX arrays and runs on the engine's MLX thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from mlxd.config.kv import KV_STEP
from mlxd.engines.base import GenerationRequest
from mlxd.engines.runtime.jobs import Job, PrefillProgress
from mlxd.engines.scheduling.guard import Guard
from mlxd.engines.text.streaming import Output

if TYPE_CHECKING:
    from mlxd.engines.cache.prompt_cache import PromptCache


def runs_alone(request: GenerationRequest) -> bool:
    """Whether a request can start alone and be handed to the generator later."""
    return not request.logits_processors


@dataclass
class Resume:
    """Where a lone request stopped, for the generator to go on from."""

    #: tokens the model has still to be fed: the rest of the prompt, or the last token delivered
    prompt: list[int]
    #: the per-layer KV of ``tokens_in_kv``
    cache: list[Any]
    tokens_in_kv: list[int]
    #: completion tokens delivered so far
    n_tokens: int
    sampler: Any
    detok: Any
    out: Output
    cached: int
    guard: Guard
    #: of the ``cached`` tokens, those read from the disk tier
    from_disk: int = 0


def compact(kv: list[Any], slack: int = 1) -> list[Any]:
    """Cut plain KV caches holding ``slack`` or more unused positions down to their tokens.

    A cache grows 256 positions at a time, and a prefix trimmed from a longer
    prompt-cache entry keeps the entry's length: this keeps what a lone request
    holds within what batch admission counts (mlxd.engines.scheduling.batching), and a
    prompt-cache entry as large as its tokens.
    """
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    for c in kv:
        if type(c) is KVCache and c.keys is not None and c.keys.shape[2] - c.offset >= slack:
            c.keys = mx.contiguous(c.keys[..., : c.offset, :])
            c.values = mx.contiguous(c.values[..., : c.offset, :])  # type: ignore[index]
    return kv


def reserve_prompt(kv: list[Any], tokens: int) -> list[Any]:
    """Let plain KV caches make room for ``tokens`` more positions at their next update.

    A cache grows :data:`~mlxd.config.kv.KV_STEP` positions at a time by copying
    everything it holds into a larger array: prefilled in chunks of 512, a
    32,000-token prompt of the small demo model copied its KV 62 times (15-20 s of a
    440 s prefill on this CPU). Grown once to the prompt's length (rounded up to a
    step, as admission counts it), it copies at most the prefix it started with.
    :func:`step_back` restores the step for decoding and the batch.
    """
    from mlx_lm.models.cache import KVCache

    step = max(KV_STEP, -(-tokens // KV_STEP) * KV_STEP)
    for c in kv:
        if type(c) is KVCache:
            c.step = step
    return kv


def step_back(kv: list[Any]) -> list[Any]:
    """Plain KV caches grow :data:`~mlxd.config.kv.KV_STEP` positions at a time again."""
    from mlx_lm.models.cache import KVCache

    for c in kv:
        if type(c) is KVCache:
            c.step = KV_STEP
    return kv


class SoloHost(Protocol):
    """What a lone run needs of the loop that hands it its job
    (:class:`~mlxd.engines.scheduling.batch_loop.BatchLoop`)."""

    #: tokens prefilled per loop step of a lone request (mlxd.engines.scheduling.prefill_pace.solo_chunk)
    solo_chunk: int

    def model_and_tokenizer(self) -> tuple[Any, Any]: ...

    def prompt_cache(self) -> PromptCache: ...

    def note_prefill(self, tokens: int, seconds: float) -> None:
        """A step prefilled ``tokens`` in ``seconds``."""

    def note_step(self, kv: list[Any]) -> None:
        """A step is done; ``kv`` is the run's KV."""


class SoloRun:
    """One lone request on the MLX thread (see the module docstring)."""

    def __init__(self, loop: SoloHost, job: Job, sampler: Any, out: Output, guard: Guard) -> None:
        self.loop = loop
        self.job = job
        self.sampler = sampler  # wrapped by the guard
        self.out = out
        self.guard = guard
        self.model, tok = loop.model_and_tokenizer()
        self.detok = tok.detokenizer
        self.eos = frozenset(int(t) for t in tok.eos_token_ids)
        #: prompt tokens read from the disk tier (set by run)
        self.from_disk = 0

    def run(self, interrupted: Callable[[], bool]) -> Resume | None:
        """Generate until the request is over (None) or ``interrupted()`` (a :class:`Resume`)."""
        import mlx.core as mx
        from mlx_lm.generate import generation_stream
        from mlx_lm.models.cache import make_prompt_cache

        job, st, loop = self.job, self.job.stats, self.loop
        ids = list(job.request.prompt_ids or ())  # the engine's prepare() tokenized it
        st.prompt_tokens = len(ids)
        kv, rest, self.from_disk = loop.prompt_cache().fetch(ids)
        cached = len(ids) - len(rest)
        if kv is None:
            kv = make_prompt_cache(self.model)
        compact(kv, slack=KV_STEP)  # a prefix trimmed from a longer entry keeps its length
        reserve_prompt(kv, len(rest))
        fed = cached
        with mx.stream(generation_stream):
            while len(rest) > 1:  # the prompt but its last token, a chunk per step
                if job.cancel.is_set():
                    st.outcome = "cancelled"
                    return None
                if interrupted():  # the batch takes the KV as admission counts it
                    kv = compact(step_back(kv), slack=KV_STEP)
                    return Resume(rest, kv, ids[:fed], 0, self.sampler, self.detok, self.out, cached,
                                  self.guard, self.from_disk)
                n = min(loop.solo_chunk, len(rest) - 1)
                t0 = time.perf_counter()
                self.model(mx.array(rest[:n])[None], cache=kv)
                mx.eval([c.state for c in kv])
                loop.note_prefill(n, time.perf_counter() - t0)
                rest, fed = rest[n:], fed + n
                st.prefill_done, st.prefill_chunks = fed, st.prefill_chunks + 1  # as the batch counts
                job.emit(PrefillProgress(fed, len(ids)))
                loop.note_step(kv)
            return self._decode(ids[:fed], rest, step_back(kv), cached, interrupted)

    def _decode(
        self, in_kv: list[int], rest: list[int], kv: list[Any], cached: int,
        interrupted: Callable[[], bool],
    ) -> Resume | None:
        """From the prompt's last token on: one forward pass per token (module docstring).

        ``y`` is always the next token, sampled but neither delivered nor fed, and ``kv``
        holds ``in_kv``. The first token goes out before the pass that feeds it is built
        (on the CPU building it is running it); later ones while their pass runs, the way
        ``mlx_lm.generate_step`` pipelines.
        """
        import mlx.core as mx

        job, max_tokens, loop = self.job, self.job.request.max_tokens, self.loop
        y, logprobs = self._forward(mx.array(rest)[None], kv)
        mx.eval(y, logprobs)
        in_kv = in_kv + rest
        loop.note_step(kv)
        n = 0
        while True:
            last_here = n + 1 >= max_tokens or job.cancel.is_set() or interrupted()
            fed = False
            if n and not last_here:
                y_next, lp_next = self._forward(y[:, None], kv)
                mx.async_eval(y_next, lp_next)  # type: ignore[no-untyped-call]
                fed = True
            token = int(y.item())
            n += 1
            finish = "stop" if token in self.eos else ("length" if n >= max_tokens else None)
            if self._deliver(token, logprobs, n, finish, cached):
                if finish is not None:  # a stop string or a cancel leaves nothing to reuse
                    loop.prompt_cache().insert([*in_kv, token] if fed else in_kv, compact(kv))
                return None
            if last_here:  # a request is waiting (a cancel or max_tokens ended it above)
                return Resume([token], kv, in_kv, n, self.sampler, self.detok, self.out, cached,
                              self.guard, self.from_disk)
            if not fed:
                y_next, lp_next = self._forward(y[:, None], kv)
                mx.async_eval(y_next, lp_next)  # type: ignore[no-untyped-call]
            in_kv.append(token)
            y, logprobs = y_next, lp_next
            loop.note_step(kv)

    def _forward(self, tokens: Any, kv: list[Any]) -> tuple[Any, Any]:
        """The next token (sampled) and its log-probabilities, from feeding ``tokens``."""
        import mlx.core as mx

        logits = self.model(tokens, cache=kv)[:, -1, :]
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        y = self.sampler(logprobs) if self.sampler is not None else mx.argmax(logprobs, axis=-1)
        return y, logprobs[0]

    def _deliver(self, token: int, logprobs: Any, n: int, finish: str | None, cached: int) -> bool:
        if self.guard.error is not None:  # its sampler failed: alone, it ends the run
            raise self.guard.error
        return self.guard.deliver(self.job, self.out, self.detok, token, logprobs, n, finish, cached,
                                  self.from_disk)
