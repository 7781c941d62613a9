"""What a batched decode step's responses do to its sequences: tokens out, ends, failures.

The part of :class:`~mlxd.engines.scheduling.batch_loop.BatchLoop` (MLX thread only)
that carries out steps 4 and 5 of its theory of operation: each new token is
delivered through its sequence's guard (:func:`~mlxd.engines.text.streaming.deliver_token`:
stop strings, tool calls, logprobs, ``Finished``); a newcomer whose prompt ended
in the step gets its first token at once (:meth:`StepDeliveries._deliver_first`);
a finished sequence's KV goes to the prompt cache and its job is reported done;
a sequence whose own part failed ends alone (:mod:`mlxd.engines.scheduling.guard`),
and a failure of the step itself fails every job in the batch.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mlxd.engines.cache.prompt_cache import PromptCache
from mlxd.engines.runtime.jobs import Job, PrefillProgress
from mlxd.engines.scheduling.guard import Guard
from mlxd.engines.text.streaming import Output

log = logging.getLogger(__name__)

#: done(job, error or None): called on the MLX thread when a job has left the batch
DoneCallback = Callable[[Job, BaseException | None], None]


@dataclass(eq=False)
class BatchSeq:
    """One job inside the generator (MLX thread only)."""

    job: Job
    uid: int
    detok: Any
    out: Output
    cached: int
    #: the tokens that end the sequence (the generator's stop sequences, one token each)
    eos: frozenset[int]
    #: its own failures (its processors and sampler are wrapped by it)
    guard: Guard
    n_tokens: int = 0
    #: prompt tokens in its KV when it entered the generator (more than ``cached`` when it
    #: started alone, see mlxd.engines.scheduling.solo)
    offset: int = 0
    #: prompt tokens (of those not cached) prefilled so far
    prefilled: int = 0
    #: its first token went out early (:meth:`StepDeliveries._deliver_first`): the generator's
    #: response for that same token, one step later, is skipped
    first_sent: bool = False
    #: of the ``cached`` tokens, those read from the disk tier
    from_disk: int = 0


class StepDeliveries:
    """A batch loop's deliveries (module docstring)."""

    # set by BatchLoop.__init__ (and owned by the MLX thread)
    _gen: Any
    _seqs: dict[int, BatchSeq]
    _cache: PromptCache | None
    _on_done: DoneCallback
    _largest: int

    def _drop_cancelled(self) -> None:
        gone = [s for s in self._seqs.values() if s.job.cancel.is_set()]
        if not gone:
            return
        self._gen.remove([s.uid for s in gone])
        for s in gone:
            self._finish(s, "cancelled")

    def _finish(self, seq: BatchSeq, outcome: str | None = None) -> None:
        self._seqs.pop(seq.uid, None)
        st = seq.job.stats
        error = seq.guard.error
        if error is not None:
            outcome = "error"
        if outcome is not None:
            st.outcome = outcome
        st.ended_at = time.monotonic()
        self._on_done(seq.job, error)
        self._largest = max(self._largest, st.prompt_tokens + st.completion_tokens)

    def _end_failed(self, failed: list[BatchSeq]) -> None:
        """End the sequences whose own part of the step failed (module docstring): out of
        the generator (the others go on), their jobs done with their errors."""
        if not failed:
            return
        if self._gen is not None:
            self._gen.remove([s.uid for s in failed])
        for s in failed:
            log.warning("request %s failed alone: %s", s.job.request.request_id, s.guard.error)
            self._finish(s)

    def _progress(self, responses: list[Any]) -> None:
        for r in responses:
            seq = self._seqs.get(r.uid)
            if seq is None or seq.n_tokens:  # a job that began alone feeds its last token
                continue
            done, total = r.progress
            st = seq.job.stats
            st.prefill_done = seq.offset + int(done)
            if 0 < done < total:
                st.prefill_chunks += 1
                seq.job.emit(PrefillProgress(seq.offset + int(done), seq.offset + int(total)))

    def _deliver(self, responses: list[Any]) -> None:
        stopped: list[BatchSeq] = []
        failed: list[BatchSeq] = []
        for r in responses:
            seq = self._seqs.get(r.uid)
            if seq is None:
                continue
            if seq.first_sent:  # went out early, and did not end the sequence then
                seq.first_sent = False
                if r.finish_reason is None:  # always: the same rule found no end then
                    continue
            try:
                over = self._token(seq, r.token, r.logprobs, r.finish_reason)
            except Exception as e:  # its detokenizer or stop matching: it alone ends
                seq.guard.fail(e)
                if r.finish_reason is None:
                    failed.append(seq)  # still in the generator
                else:
                    self._finish(seq)
                continue
            if r.finish_reason is not None:
                if r.prompt_cache is not None and self._cache is not None:
                    self._cache.insert(r.all_tokens, r.prompt_cache)
                self._finish(seq)
            elif over:  # a stop string, or cancelled: still in the generator
                stopped.append(seq)
        if stopped:
            self._gen.remove([s.uid for s in stopped])
            for s in stopped:
                self._finish(s)
        self._end_failed(failed)

    def _token(self, seq: BatchSeq, token: int, logprobs: Any, finish_reason: str | None) -> bool:
        """Deliver one token of ``seq``; True when its generation is over."""
        seq.n_tokens += 1
        return seq.guard.deliver(seq.job, seq.out, seq.detok, token, logprobs, seq.n_tokens,
                                 finish_reason, seq.cached, seq.from_disk)

    def _deliver_first(self, uids: list[int]) -> None:
        """The first tokens of the sequences whose prompt ended in this step (module docstring, 5).

        The generator's finish rule is applied here as it would apply it one
        step later: ``stop`` on an end-of-sequence token, ``length`` at
        ``max_tokens``. Reads the generator's pending tokens (mlx-lm internals,
        checked): without them the tokens come the usual step later.
        """
        batch = getattr(self._gen, "_generation_batch", None)
        rows = getattr(batch, "uids", None)
        pending = getattr(batch, "_next_tokens", None)
        logprobs = getattr(batch, "_next_logprobs", None)
        if rows is None or pending is None or logprobs is None or len(rows) != len(logprobs):
            return
        index = {uid: i for i, uid in enumerate(rows)}
        seqs = [s for uid in uids if (s := self._seqs.get(uid)) is not None and uid in index]
        if not seqs:
            return
        tokens = pending.tolist()  # waits for this step's forward pass (the next one needs it too)
        ended: list[BatchSeq] = []
        stopped: list[BatchSeq] = []
        failed: list[BatchSeq] = []
        for seq in seqs:
            i = index[seq.uid]
            token = int(tokens[i])
            finish: str | None = None
            if seq.n_tokens + 1 >= seq.job.request.max_tokens:
                finish = "length"
            if token in seq.eos:
                finish = "stop"
            try:
                over = self._token(seq, token, logprobs[i], finish)
            except Exception as e:  # its detokenizer or stop matching: it alone ends
                seq.guard.fail(e)
                failed.append(seq)
                continue
            if finish is not None:
                ended.append(seq)
            elif over:
                stopped.append(seq)
            else:
                seq.first_sent = True
        if ended:  # their KV holds exactly the prompt (the first token was never fed back)
            caches = self._gen.remove([s.uid for s in ended], return_prompt_caches=True)
            for seq in ended:
                cache, tokens_in_kv = caches.get(seq.uid, (None, None))
                if cache is not None and tokens_in_kv is not None and self._cache is not None:
                    self._cache.insert(list(tokens_in_kv), cache)
                self._finish(seq)
        if stopped:
            self._gen.remove([s.uid for s in stopped])
            for seq in stopped:
                self._finish(seq)
        self._end_failed(failed)

    def _fail_all(self, error: BaseException) -> None:
        seqs = list(self._seqs.values())
        self._seqs.clear()
        if self._gen is not None:
            try:
                self._gen.close()
            except Exception:
                pass
        self._gen = None
        for s in seqs:
            s.job.stats.outcome = "error"
            s.job.stats.ended_at = time.monotonic()
            self._on_done(s.job, error)
