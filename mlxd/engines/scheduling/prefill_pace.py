"""How long a batched model's prefill chunks are: sized to its measured prefill rate.

A chunk is one loop step of a newcomer's prompt (:mod:`mlxd.engines.scheduling.batch_loop`):
how long the running streams wait for their next token, and how late a
cancel is heard. The configured ``prefill_step`` suits a slow model; a
model whose prefill is fast (the rate is measured from the steps' own
chunks, and from a lone request's, :mod:`mlxd.engines.scheduling.solo`) gets chunks
sized to take about :data:`PREFILL_CHUNK_S`, when the step is the default
one. :class:`PrefillPacing` is the part of :class:`~mlxd.engines.scheduling.batch_loop.BatchLoop`
that does it (MLX thread); it reads the loop's generator and sequences.
"""

from __future__ import annotations

from typing import Any

#: a model whose prefill is fast gets chunks sized to take about this long (at its measured
#: rate), never fewer tokens than its ``prefill_step`` nor more than PREFILL_CHUNK_MAX: a
#: chunk is how long the running streams wait and how late a cancel is heard, in seconds
PREFILL_CHUNK_S = 0.05
#: mlx-lm's own default chunk (what mlx_lm.server prefills with)
PREFILL_CHUNK_MAX = 2048
#: a step that prefilled fewer tokens than this says little about the rate
_RATE_MIN_TOKENS = 16
#: the least chunk of a lone request (mlxd.engines.scheduling.solo) when the step is the default one:
#: with nothing else running, a chunk only bounds how late a cancel or a second request is
#: heard, and every chunk reads the whole KV again. 6,144 tokens of the small demo model on
#: the CPU: 30.3 s of CPU in chunks of 64, 23.9 s in 512, 25.8 s in 2,048 (mlx-lm's default,
#: whose attention also computes the masked half of a long chunk)
SOLO_CHUNK_MIN = 512


def solo_chunk(prefill_chunk: int, adapts: bool) -> int:
    """A lone request's chunk: the batch's, but at least :data:`SOLO_CHUNK_MIN` unless the
    step was set by hand (``MLXD_PREFILL_STEP``)."""
    return max(prefill_chunk, SOLO_CHUNK_MIN) if adapts else prefill_chunk


class PrefillPacing:
    """The prefill rate and chunk of a batch loop (module docstring)."""

    # set by BatchLoop.__init__
    prefill_step: int
    prefill_chunk: int
    solo_chunk: int
    prefill_rate: float | None
    _prefill_adapts: bool
    _gen: Any
    _seqs: dict[int, Any]

    def _measure_prefill(self, responses: list[Any], seconds: float) -> None:
        """The prefill rate from a step's chunks, and the chunk it sets (PREFILL_CHUNK_S)."""
        tokens = 0
        for r in responses:
            seq = self._seqs.get(r.uid)
            if seq is not None and not r.end_of_prompt:
                done = int(r.progress[0])
                tokens, seq.prefilled = tokens + done - seq.prefilled, done
        self.note_prefill(tokens, seconds)

    def note_prefill(self, tokens: int, seconds: float) -> None:
        """A step prefilled ``tokens`` in ``seconds``: the rate, and the chunk it sets."""
        if tokens < _RATE_MIN_TOKENS or seconds <= 0:
            return
        rate = tokens / seconds  # the step's decode rows count as prefill time: a lower bound
        self.prefill_rate = rate if self.prefill_rate is None else (self.prefill_rate + rate) / 2
        if self._prefill_adapts:
            fits = int(self.prefill_rate * PREFILL_CHUNK_S)
            self.prefill_chunk = max(self.prefill_step, min(PREFILL_CHUNK_MAX, fits))
            self.solo_chunk = solo_chunk(self.prefill_chunk, True)
        if self._prefill_adapts and self._gen is not None:
            # read at each step, and by the prompt batch (which mlx-lm 0.32 gives its own copy)
            self._gen.prefill_step_size = self.prefill_chunk
            prompts: Any = getattr(self._gen, "_prompt_batch", None)
            if hasattr(prompts, "prefill_step_size"):
                prompts.prefill_step_size = self.prefill_chunk
