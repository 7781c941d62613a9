"""What a generation streams: stop strings trimmed from the text, and one token's delivery.

Shared by the serial path (one generation at a time, ``mlx_lm.stream_generate``)
and the batching path (``mlx_lm``'s ``BatchGenerator``): both hand each new token's
text to :func:`deliver_token`, which trims stop strings (:class:`StopText`),
attaches logprobs when asked, updates the job's stats and emits ``TextDelta`` /
``Finished`` events to the consumer. Runs on the engine's MLX thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

import trio

from mlxd.engines.base import Finished, GenerationEvent, TextDelta, TokenLogprob
from mlxd.engines.mlx_thread import TOKEN_TICK, PrefillProgress, TokenTick
from mlxd.errors import EngineError, MlxdError

if TYPE_CHECKING:
    from mlxd.engines.mlx_thread import GenerationStats, Job


class StopText:
    """Accumulates generated text; trims it at the first stop string without leaking a prefix.

    Generation stops after the first token that completes any stop string; the
    output is cut where the earliest stop string present at that moment begins
    (as OpenAI servers do, the result can depend on how the text was tokenized
    when stop strings overlap). Until then, a tail that could still grow into a
    stop string is held back, so no sent text ever contains part of one.
    """

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = tuple(s for s in stops if s)
        self._longest = max((len(s) for s in self.stops), default=0)
        self.text = ""
        self.emitted = 0  # invariant: text[:emitted] was sent and holds no stop string

    def feed(self, piece: str) -> tuple[str, bool]:
        """Add ``piece``; return ``(text safe to send now, stop string reached)``."""
        self.text += piece
        if not self.stops:
            return self._emit_to(len(self.text)), False
        # a match cannot start before `emitted`: its start was held back while it was a prefix
        hits = [i for s in self.stops if (i := self.text.find(s, self.emitted)) >= 0]
        if hits:
            cut = min(hits)
            out = self._emit_to(cut)
            self.text = self.text[:cut]
            return out, True
        return self._emit_to(len(self.text) - self._held()), False

    def flush(self) -> str:
        """The held-back tail, once no more text will come."""
        return self._emit_to(len(self.text))

    def _held(self) -> int:
        limit = min(self._longest - 1, len(self.text) - self.emitted)
        for k in range(limit, 0, -1):
            tail = self.text[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0

    def _emit_to(self, end: int) -> str:
        out = self.text[self.emitted : end]
        self.emitted = max(self.emitted, end)
        return out


def deliver_token(
    job: Job,
    stops: StopText,
    text: str,
    n_tokens: int,
    finish_reason: str | None,
    *,
    cached_tokens: int = 0,
    logprob: TokenLogprob | None = None,
    stop_now: Callable[[Job], bool] | None = None,
) -> bool:
    """Handle one generated token; True when the generation is over (finished or cancelled).

    ``finish_reason`` is the model's ("stop": an end-of-sequence token; "length":
    ``max_tokens`` reached; None: more to come); a stop string ends it too.
    Every token emits exactly one event (a ``TextDelta``, possibly empty, or a
    ``TOKEN_TICK`` when it produced no text to send), then ``Finished`` at the end.
    ``stop_now(job)`` decides whether a cancelled job stops here (default: its
    cancel flag; the distributed engine makes its ranks agree).
    """
    st = job.stats
    now = time.monotonic()
    if st.first_token_at is None:
        st.first_token_at = now
        st.prefill_done = st.prompt_tokens
    st.completion_tokens = n_tokens
    if st.cancel_requested_at is not None and st.cancel_requested_at < now:
        st.tokens_after_cancel += 1
    if stop_now(job) if stop_now is not None else job.cancel.is_set():
        st.outcome = "cancelled"
        return True
    piece, hit = stops.feed(text)
    done = hit or finish_reason is not None
    if done and not hit:
        piece += stops.flush()
    lps = (logprob,) if logprob is not None else ()
    job.emit(TextDelta(piece, lps) if piece or lps else TOKEN_TICK)
    if not done:
        return False
    reason: Literal["stop", "length"] = "stop" if hit or finish_reason == "stop" else "length"
    st.outcome = reason
    job.emit(Finished(reason, st.prompt_tokens, n_tokens, cached_tokens))
    return True


def pending_events(
    job: Job, item: object, observe: Callable[[str, GenerationStats], None], name: str
) -> list[GenerationEvent]:
    """What the consumer gets for ``item`` and the items already waiting behind it.

    Text that has piled up while the consumer was busy (a slow client, many
    streams on one event loop) goes out as one delta, so a lagging stream
    catches up in one write instead of one per token; a consumer that keeps
    up still gets one delta per token.
    """
    out: list[GenerationEvent] = []
    texts: list[str] = []
    logprobs: list[TokenLogprob] = []
    while True:
        if isinstance(item, TextDelta):
            observe("token", job.stats)
            texts.append(item.text)
            logprobs.extend(item.logprobs)
        elif isinstance(item, TokenTick):
            observe("token", job.stats)
        elif isinstance(item, PrefillProgress):
            observe("prefill", job.stats)
        elif isinstance(item, Finished):
            observe("end", job.stats)
            break
        elif isinstance(item, MlxdError):
            raise item
        elif isinstance(item, BaseException):
            raise EngineError(f"{name}: generation failed: {type(item).__name__}: {item}") from item
        try:
            item = job.sink.receive.receive_nowait()
        except (trio.WouldBlock, trio.EndOfChannel):
            item = None
            break
    if texts:
        out.append(TextDelta("".join(texts), tuple(logprobs)))
    if isinstance(item, Finished):
        out.append(item)
    return out
