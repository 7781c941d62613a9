"""What a generation streams: text cut at stop strings, tool calls, log probabilities.

Shared by the serial path (one generation at a time, ``mlx_lm.stream_generate``)
and the batching path (``mlx_lm``'s ``BatchGenerator``): both hand each new
token (its text, id and log-probability vector) to :func:`deliver_token`, which
updates the job's stats and emits what its :class:`Output` makes of it:
:class:`TextDelta` (text cut at the first stop string by :class:`StopText`,
with the token's :class:`TokenLogprob` when asked), :class:`ToolCallDelta`
once a tool call is complete (the model family's markers and parser, see
:mod:`mlxd.engines.text.tool_calls`), then one :class:`Finished`. Every token emits
exactly one text event (a delta, possibly empty, or :data:`TOKEN_TICK`), so
observers count tokens by events. Runs on the engine's MLX thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import trio

from mlxd.engines.base import (
    Finished,
    FinishReason,
    GenerationEvent,
    GenerationRequest,
    TextDelta,
    TokenLogprob,
    ToolCallDelta,
)
from mlxd.engines.runtime.jobs import TOKEN_TICK, PrefillProgress, TokenTick
from mlxd.engines.text.tool_calls import ToolCallSplitter, ToolFormat, parse_calls
from mlxd.errors import EngineError, MlxdError, describe_error

if TYPE_CHECKING:
    from mlxd.engines.runtime.jobs import GenerationStats, Job


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
        #: the stop string found (the earliest one at the cut)
        self.matched: str | None = None

    def feed(self, piece: str) -> tuple[str, bool]:
        """Add ``piece``; return ``(text safe to send now, stop string reached)``."""
        self.text += piece
        if not self.stops:
            return self._emit_to(len(self.text)), False
        # a match cannot start before `emitted`: its start was held back while it was a prefix
        hits = [i for s in self.stops if (i := self.text.find(s, self.emitted)) >= 0]
        if hits:
            cut = min(hits)
            self.matched = next(s for s in self.stops if self.text.find(s, self.emitted) == cut)
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


class TokenTexts:
    """A tokenizer's tokens as OpenAI's logprobs show them: the text and its exact bytes.

    A byte-level BPE token may hold part of a UTF-8 character: its decoded text
    then shows U+FFFD, and its bytes come from the BPE byte table (mlx-lm knows
    which tokenizers are byte-level).
    """

    def __init__(self, tokenizer: Any) -> None:
        from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, _byte_decoder

        self.tokenizer = tokenizer
        is_bpe = isinstance(getattr(tokenizer, "_detokenizer", None), BPEStreamingDetokenizer)
        self._byte_decoder: dict[str, int] | None = dict(_byte_decoder()) if is_bpe else None

    def __call__(self, token: int) -> tuple[str, tuple[int, ...]]:
        text = str(self.tokenizer.decode([token]))
        raw = text.encode()
        if "\ufffd" in text and self._byte_decoder is not None:
            piece = self.tokenizer.convert_ids_to_tokens(token)
            if isinstance(piece, str) and all(c in self._byte_decoder for c in piece):
                raw = bytes(self._byte_decoder[c] for c in piece)
        return text, tuple(raw)


def token_logprob(logprobs: Any, token: int, top: int, texts: TokenTexts) -> TokenLogprob:
    """The chosen token's log-probability and the ``top`` most likely tokens, in OpenAI's
    shape (text and bytes): the one place token ids become what the APIs show."""
    import mlx.core as mx

    def entry(i: int, value: float, alternatives: tuple[TokenLogprob, ...] = ()) -> TokenLogprob:
        text, raw = texts(i)
        return TokenLogprob(i, text, value, raw, alternatives)

    chosen = float(logprobs[token].item())
    if top <= 0:
        return entry(token, chosen)
    k = min(top, int(logprobs.shape[-1]))
    idx = mx.argpartition(-logprobs, kth=k - 1)[:k]
    ids: Any = idx.tolist()
    values: Any = logprobs[idx].tolist()
    pairs = sorted(zip(ids, values, strict=True), key=lambda p: -p[1])
    return entry(token, chosen, tuple(entry(int(t), float(v)) for t, v in pairs))


@dataclass
class Output:
    """What one generation sends, token by token (on the MLX thread; module docstring).

    ``texts`` turns token ids into logprob entries (None: the engine reports no
    logprobs); ``tools`` is the model's tool-call format (None: no tool support).
    """

    request: GenerationRequest
    texts: TokenTexts | None = None
    tools: ToolFormat | None = None
    stops: StopText = field(init=False)
    splitter: ToolCallSplitter | None = field(init=False, default=None)
    #: tool calls sent so far
    calls: int = 0

    def __post_init__(self) -> None:
        req = self.request
        self.stops = StopText(req.stop)
        if self.tools is not None and req.tools and req.tool_choice != "none":
            self.splitter = ToolCallSplitter(self.tools.start, self.tools.end)

    def token(
        self, text: str, token: int, logprobs: Any, *, last: bool
    ) -> tuple[list[GenerationEvent | TokenTick], bool]:
        """The events of one generated token, and whether a stop string ended the output.

        ``logprobs`` is the token's log-probability vector, or None for a token
        that gets no entry (end of sequence); ``last``: the model has finished,
        so held-back text goes out now.
        """
        piece, hit = self.stops.feed(text)
        if last and not hit:
            piece += self.stops.flush()
        want = self.request.logprobs
        lps: tuple[TokenLogprob, ...] = ()
        if want is not None and logprobs is not None and self.texts is not None:
            lps = (token_logprob(logprobs, token, want, self.texts),)
        piece, calls = self._split(piece, final=hit or last)
        events: list[GenerationEvent | TokenTick] = [
            TextDelta(piece, lps) if piece or lps else TOKEN_TICK
        ]
        events.extend(calls)
        return events, hit

    def finished(
        self, reason: Literal["stop", "length"], prompt_tokens: int, completion_tokens: int,
        cached_tokens: int, *, hit_stop: bool, started_at: float | None = None,
        disk_tokens: int = 0,
    ) -> Finished:
        """The last event: ``tool_calls`` when calls were made. Constrained output the budget
        guard closed in time ended on its own (``stop``); ``length`` is output cut by the limit."""
        final: FinishReason = reason
        if self.calls and reason == "stop":
            final = "tool_calls"
        return Finished(
            final, prompt_tokens, completion_tokens, cached_tokens,
            stop_sequence=self.stops.matched if hit_stop else None, started_at=started_at,
            cached_from_disk=disk_tokens,
        )

    def _split(self, piece: str, *, final: bool) -> tuple[str, list[ToolCallDelta]]:
        """The plain text of ``piece`` and the tool calls it completes (text that does not
        parse as a call of a declared function is given back as text, marker included)."""
        if self.splitter is None or self.tools is None:
            return piece, []
        pieces = self.splitter.feed(piece)
        if final:
            pieces += self.splitter.flush()
        text = ""
        calls: list[ToolCallDelta] = []
        for p in pieces:
            parsed = parse_calls(p.text, self.tools.parser, self.request.tools) if p.call else None
            if parsed is None:
                text += self.tools.start + p.text if p.call else p.text
                continue
            for call in parsed:
                calls.append(ToolCallDelta(self.calls, call))
                self.calls += 1
        return text, calls


def deliver_token(
    job: Job,
    out: Output,
    text: str,
    token: int,
    logprobs: Any,
    n_tokens: int,
    finish_reason: str | None,
    *,
    cached_tokens: int = 0,
    disk_tokens: int = 0,
    stop_now: Callable[[Job], bool] | None = None,
) -> bool:
    """Handle one generated token; True when the generation is over (finished or cancelled).

    ``finish_reason`` is the model's ("stop": an end-of-sequence token, which
    gets no logprob entry; "length": ``max_tokens`` reached; None: more to
    come); a stop string ends it too. ``logprobs`` is the token's
    log-probability vector (read only when the request asked for logprobs).
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
    eos = finish_reason == "stop"
    events, hit = out.token(
        text, token, None if eos else logprobs, last=finish_reason is not None
    )
    for event in events:
        job.emit(event)
    if not (hit or finish_reason is not None):
        return False
    reason: Literal["stop", "length"] = "stop" if hit or eos else "length"
    fin = out.finished(
        reason, st.prompt_tokens, n_tokens, cached_tokens, hit_stop=hit, started_at=st.started_at,
        disk_tokens=disk_tokens,
    )
    st.outcome = fin.finish_reason
    job.emit(fin)
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

    def text_so_far() -> None:
        if texts:
            out.append(TextDelta("".join(texts), tuple(logprobs)))
            texts.clear()
            logprobs.clear()

    while True:
        if isinstance(item, TextDelta):
            observe("token", job.stats)
            texts.append(item.text)
            logprobs.extend(item.logprobs)
        elif isinstance(item, ToolCallDelta):
            text_so_far()  # the text before a call goes before it
            out.append(item)
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
            raise EngineError(f"{name}: generation failed: {describe_error(item)}") from item
        try:
            item = job.sink.receive.receive_nowait()
        except (trio.WouldBlock, trio.EndOfChannel):
            item = None
            break
    text_so_far()
    if isinstance(item, Finished):
        out.append(item)
    return out


class JobEvents:
    """The events of a job already on its scheduler, as an async iterator (Trio side).

    What :meth:`MlxTextEngine.start_generation <mlxd.engines.mlx_text.MlxTextEngine.start_generation>`
    returns: the job runs from the moment it was submitted, whether or not
    anyone iterates yet. Closing it before its :class:`Finished` (``aclose``,
    which a plain object runs even if it was never iterated, unlike an async
    generator that never started) withdraws the job, which sets its cancel flag.
    """

    def __init__(
        self,
        job: Job,
        withdraw: Callable[[Job], None],
        observe: Callable[[str, GenerationStats], None],
        name: str,
    ) -> None:
        self._job = job
        self._withdraw = withdraw
        self._observe = observe
        self._name = name
        self._ready: list[GenerationEvent] = []
        self._done = False  # Finished handed out, or closed

    def __aiter__(self) -> JobEvents:
        return self

    async def __anext__(self) -> GenerationEvent:
        while not self._ready:
            if self._done:
                raise StopAsyncIteration
            try:
                item = await self._job.sink.receive.receive()
            except trio.EndOfChannel:
                await self.aclose()
                raise EngineError(f"{self._name}: generation ended without a result") from None
            try:
                events = pending_events(self._job, item, self._observe, self._name)
            except BaseException:
                await self.aclose()
                raise
            self._ready = events[::-1]
        event = self._ready.pop()
        if isinstance(event, Finished):
            self._done = True  # the job is over: nothing to withdraw
            self._job.sink.receive.close()
        return event

    async def aclose(self) -> None:
        if not self._done:
            self._done = True
            self._ready.clear()
            self._job.sink.receive.close()
            self._withdraw(self._job)
