"""A batched request's own failures: what it brings to a decode step, wrapped so it fails alone.

Theory of operation. A batch shares each decode step: mlx-lm's
``BatchGenerator.next()`` runs one forward pass for every sequence, then each
sequence's logits processors (the grammar of structured output) and sampler;
mlxd then detokenizes each new token and matches stop strings
(:func:`deliver`). Before this module, an exception in any of these, raised for
one request (a grammar the parser gives up on, a detokenizer bug), came out of
``next()`` or the delivery loop and failed every request of the batch.

Now each request gets a :class:`Guard` when it enters the loop
(:mod:`mlxd.engines.scheduling.batch_loop`, :mod:`mlxd.engines.scheduling.solo`). Its logits
processors and sampler are wrapped: an exception is kept in
:attr:`Guard.error` and the wrapper returns something harmless (the logits
unchanged, the greedy token), so the step completes for everyone; after the
step, the loop takes every guarded request with an error out of the batch and
ends it with that error. Exceptions in its detokenizer and stop matching are
caught around its delivery, with the same result. Only a failure of the step
itself (the forward pass, out of memory) still fails the whole batch: nothing
tells which sequence caused it.

A request whose error is its input's fault (its grammar proved too complex
for the parser: :class:`~mlxd.errors.InvalidRequest`) gets that error; any
other becomes the engine's error with a bounded message
(:func:`mlxd.errors.describe_error`). Injected faults (:meth:`Faults.poison
<mlxd.engines.injected_faults.Faults.poison>`) strike at these same points.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from mlxd.engines.injected_faults import Poison, PoisonPoint
from mlxd.engines.runtime.jobs import Job
from mlxd.engines.text.streaming import Output, deliver_token


class Guard:
    """One request's failure, kept for the loop to act on (MLX thread only)."""

    def __init__(self, poison: Poison | None = None) -> None:
        #: the first exception raised for this request; the loop ends it once set
        self.error: BaseException | None = None
        self._poison = poison
        self._calls: dict[PoisonPoint, int] = {}

    def strike(self, point: PoisonPoint, n: int | None = None) -> None:
        """An injected fault at ``point`` for token ``n`` (default: count this point's calls)."""
        if self._poison is None:
            return
        if n is None:
            n = self._calls[point] = self._calls.get(point, 0) + 1
        self._poison.strike(point, n)

    def fail(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error

    def processors(self, processors: Sequence[Any]) -> list[Any]:
        """``processors`` wrapped: one that raises leaves the logits as they are."""
        return [self._processor(p, first=i == 0) for i, p in enumerate(processors)]

    def _processor(self, processor: Any, *, first: bool) -> Callable[[Any, Any], Any]:
        def guarded(tokens: Any, logits: Any) -> Any:
            if self.error is not None:
                return logits
            try:
                if first:
                    self.strike("logits")
                return processor(tokens, logits)
            except Exception as e:
                self.fail(e)
                return logits

        return guarded

    def sampler(self, sampler: Any) -> Any:
        """``sampler`` wrapped (None, greedy, stays None unless a fault is injected there):
        one that raises gives the greedy token."""
        if sampler is None and (self._poison is None or self._poison.point != "sampler"):
            return None

        def guarded(logprobs: Any) -> Any:
            import mlx.core as mx

            if self.error is None:
                try:
                    self.strike("sampler")
                    if sampler is not None:
                        return sampler(logprobs)
                except Exception as e:
                    self.fail(e)
            return mx.argmax(logprobs, axis=-1)

        return guarded

    def deliver(
        self, job: Job, out: Output, detok: Any, token: int, logprobs: Any, n: int,
        finish: str | None, cached: int, from_disk: int = 0,
    ) -> bool:
        """Detokenize token ``n`` and deliver it (stop strings, tool calls, ``Finished``);
        True when the generation is over. Raises what they raise (the loop catches it)."""
        self.strike("detokenizer", n)
        if finish != "stop":  # an end-of-sequence token has no text
            detok.add_token(token)
        if finish is not None:
            detok.finalize()
        self.strike("stop", n)
        return deliver_token(job, out, detok.last_segment, token, logprobs, n, finish,
                             cached_tokens=cached, disk_tokens=from_disk)
