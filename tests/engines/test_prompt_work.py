"""What a long prompt costs the engine: tokenizing off the MLX thread, memory given back after."""

from __future__ import annotations

import time

import trio

from mlxd.engines.mlx_text import MlxTextEngine
from tests.engines.mlx_helpers import collect, completion


async def test_a_long_tokenization_neither_blocks_the_model_nor_outlives_its_client(
    engine: MlxTextEngine,
) -> None:
    """While a 1.5M-character prompt tokenizes, a small request to the same model is served; the long one's client leaves at once."""
    await collect(engine, completion("warm up", max_tokens=2))
    long_prompt = "hello world this is a tiny model, " * 45_000  # ~1.5M characters, ~2 s to tokenize
    started = trio.Event()

    async def long_client() -> None:
        with trio.move_on_after(0.3) as scope:
            started.set()
            await collect(engine, completion(long_prompt, max_tokens=2))
        assert scope.cancelled_caught

    async with trio.open_nursery() as nursery:
        t_start = time.monotonic()
        nursery.start_soon(long_client)
        await started.wait()
        t0 = time.monotonic()
        _text, fin, _ = await collect(engine, completion("hello", max_tokens=4, temperature=0))
        small_took = time.monotonic() - t0
        assert fin.completion_tokens == 4
    # the long client left at its deadline, not when the tokenizer finished
    assert time.monotonic() - t_start < 1.0
    # the small request did not wait for the long prompt's tokenizing (~2 s)
    assert small_took < 0.5, small_took
    assert not any(st.prompt_tokens > 100_000 for st in engine.history)


async def test_memory_of_a_large_request_is_given_back(engine: MlxTextEngine) -> None:
    """After a 2,100-token request, MLX's buffer cache is empty and its active memory is what it was before."""
    import mlx.core as mx

    def counters() -> tuple[int, int]:
        return int(mx.get_active_memory()), int(mx.get_cache_memory())

    await collect(engine, completion("warm up " * 20, max_tokens=8))
    assert engine._thread is not None and engine._scheduler is not None
    active_before, _ = await engine._thread.run(counters)
    _text, fin, _ = await collect(
        engine, completion("hello world this is a tiny model, " * 234, max_tokens=8)
    )
    assert fin.prompt_tokens >= 2100
    await engine._scheduler.wait_idle()
    active_after, cache_after = await engine._thread.run(counters)
    assert cache_after == 0
    assert active_after == active_before
