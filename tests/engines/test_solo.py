"""A batched model's lone request runs without the BatchGenerator and hands over exactly."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio

from mlxd.config.kv import kv_need_bytes as batch_kv_bytes
from mlxd.engines.base import GenerationRequest, TextDelta
from mlxd.engines.mlx_text import MlxTextEngine
from mlxd.engines.scheduling import prefill_pace
from mlxd.engines.scheduling.prefill_pace import SOLO_CHUNK_MIN
from tests.engines.mlx_helpers import (
    batched_engine,
    collect,
    completion,
    empty_prompt_cache,
    no_eos,
)

pytestmark = pytest.mark.mlx


@pytest.fixture
async def batched(tiny_model_dir: Path) -> AsyncIterator[MlxTextEngine]:
    async with batched_engine(tiny_model_dir, prefill_step=8) as eng:
        yield eng


async def _joined(eng: MlxTextEngine, first: GenerationRequest, second: GenerationRequest,
                  *, after_steps: int) -> tuple[str, str]:
    """``first`` alone, and ``second`` sent once ``first`` has run ``after_steps`` steps: their texts."""
    assert eng.batch is not None
    texts = ["", ""]

    async def run(i: int, req: GenerationRequest) -> None:
        texts[i] = (await collect(eng, req))[0]

    steps = eng.batch.steps
    async with trio.open_nursery() as nursery:
        nursery.start_soon(run, 0, first)
        with trio.fail_after(30):
            while eng.batch.steps < steps + after_steps:  # noqa: ASYNC110 (an MLX-thread counter)
                await trio.sleep(0.0005)
        nursery.start_soon(run, 1, second)
    return texts[0], texts[1]


@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 0.8, "seed": 7}])
async def test_a_lone_request_handed_to_the_batch_mid_decode_gives_the_same_tokens(
    batched: MlxTextEngine, sampling: dict[str, float]
) -> None:
    """A request runs alone until a second arrives, then goes on in the batch: its text is
    the one it gives alone from start to end (greedy, and seeded sampling: its key went on)."""
    assert batched.batch is not None
    long = completion("the quick brown fox", max_tokens=300, **sampling)
    short = completion("hello world", max_tokens=20)
    alone, _, _ = await collect(batched, long)
    short_alone, _, _ = await collect(batched, short)
    assert (batched.batch.alone, batched.batch.handed_over) == (2, 0)
    await empty_prompt_cache(batched)  # the second run decodes exactly as the first
    first, second = await _joined(batched, long, short, after_steps=40)
    assert batched.batch.handed_over == 1
    assert first == alone and second == short_alone


async def test_a_request_arriving_during_a_lone_prefill_takes_the_rest_of_it_along(
    batched: MlxTextEngine,
) -> None:
    """Handed over between two prefill chunks, the rest of the prompt is prefilled in the batch;
    the text, the prompt tokens and the prefill progress are those of a run alone."""
    assert batched.batch is not None
    long = completion(" ".join(["fox"] * 300), max_tokens=12)
    alone, fin_alone, _ = await collect(batched, long)
    await empty_prompt_cache(batched)
    first, _second = await _joined(batched, long, completion("hello", max_tokens=4), after_steps=5)
    assert batched.batch.handed_over == 1
    runs = [s for s in batched.history if s.prompt_tokens == fin_alone.prompt_tokens]
    assert len(runs) == 2 and first == alone
    chunks = -(-(fin_alone.prompt_tokens - 1) // 8)  # prefill_step 8; the last token decodes
    for stats in runs:  # alone, then handed over: the same prefill seen from outside
        assert (stats.prefill_done, stats.prefill_chunks) == (fin_alone.prompt_tokens, chunks)


async def test_a_lone_prompt_is_prefilled_in_chunks_of_512_at_least_on_the_default_step(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the default (adapting) step a lone request prefills in chunks of SOLO_CHUNK_MIN tokens
    (each chunk reads the whole KV again), where a batch step would be 64 (the CPU default, kept
    there by a time target nothing meets); a step set by hand is kept as it is."""
    monkeypatch.setattr(prefill_pace, "PREFILL_CHUNK_S", 1e-9)
    prompt = completion(" ".join(["fox"] * 1500), max_tokens=2)
    for step in (None, 8):
        async with batched_engine(tiny_model_dir, prefill_step=step) as eng:
            assert eng.batch is not None
            _, fin, _ = await collect(eng, prompt)
            (stats,) = [s for s in eng.history if s.prompt_tokens == fin.prompt_tokens]
            assert fin.prompt_tokens > 2 * SOLO_CHUNK_MIN
            if step is None:
                assert eng.batch.prefill_chunk == 64 and eng.batch.solo_chunk == SOLO_CHUNK_MIN
                assert stats.prefill_chunks == -(-(fin.prompt_tokens - 1) // SOLO_CHUNK_MIN)
            else:
                assert stats.prefill_chunks == -(-(fin.prompt_tokens - 1) // step)
                assert eng.batch.solo_chunk == step


async def test_a_request_with_logits_processors_goes_to_the_batch_at_once(
    batched: MlxTextEngine,
) -> None:
    """Processors keep state a handover would have to carry: such a request never runs alone."""
    assert batched.batch is not None
    _, fin, _ = await collect(batched, completion("hello", max_tokens=6, logits_processors=(no_eos,)))
    assert fin.completion_tokens == 6 and batched.batch.alone == 0


async def test_cancelling_a_lone_request_stops_it_within_a_step(batched: MlxTextEngine) -> None:
    """Leaving a lone stream stops it within one token, and the next request is served."""
    with trio.CancelScope() as scope:
        async for ev in batched.generate(completion("once upon a time", max_tokens=5000)):
            if isinstance(ev, TextDelta):
                scope.cancel()
    _, fin, _ = await collect(batched, completion("hello", max_tokens=3))
    assert fin.completion_tokens == 3
    stats = next(s for s in batched.history if s.outcome == "cancelled")
    assert stats.tokens_after_cancel <= 1 and stats.completion_tokens < 100


async def test_a_lone_request_holds_no_more_kv_than_admission_counts(
    batched: MlxTextEngine,
) -> None:
    """A prefix reused from a longer prompt-cache entry is cut to its tokens: the lone request's
    KV stays within what batch admission reserved for it, and so does a prompt-cache entry."""
    assert batched.batch is not None
    loop = batched.batch
    await collect(batched, completion(" ".join(["fox"] * 1000) + " cat", max_tokens=1))
    loop.kv_peak_bytes = 0
    _, fin, _ = await collect(batched, completion(" ".join(["fox"] * 20) + " dog", max_tokens=5))
    assert fin.cached_tokens >= 20
    per_token = batched.kv_bytes_per_token
    assert per_token
    assert 0 < loop.kv_peak_bytes <= batch_kv_bytes([fin.prompt_tokens + 5], per_token)


def test_a_lone_prefill_grows_its_kv_once_and_decodes_in_steps_again() -> None:
    """reserve_prompt: a prompt of 2,000 tokens fed in chunks of 512 allocates its KV once
    (a cache grown 256 at a time copies all it holds at each chunk), keeps what was fed, and
    stays within what admission counts; step_back: decoding grows 256 at a time again."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from mlxd.config.kv import KV_STEP
    from mlxd.engines.scheduling.solo import reserve_prompt, step_back

    cache = KVCache()
    (kv,) = reserve_prompt([cache], 2000)
    chunks = [mx.full((1, 2, n, 4), float(i)) for i, n in enumerate([512, 512, 512, 464])]
    capacities = []
    for chunk in chunks:
        kv.update_and_fetch(chunk, chunk)
        capacities.append(kv.keys.shape[2])
    assert capacities == [2048] * 4  # one allocation, never a copy
    assert 2000 <= capacities[0] < 2000 + KV_STEP
    assert kv.offset == 2000
    assert mx.array_equal(kv.keys[..., :2000, :], mx.concatenate(chunks, axis=2))
    (kv,) = step_back([kv])
    more = mx.zeros((1, 2, 49, 4))
    kv.update_and_fetch(more, more)
    assert kv.keys.shape[2] == 2000 + KV_STEP  # the 2,000 held, and one step more
