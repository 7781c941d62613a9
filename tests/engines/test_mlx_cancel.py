"""Cancellation reaches the MLX thread: mid stream within one token, during prefill at the next chunk."""

from __future__ import annotations

from contextlib import aclosing
from pathlib import Path

import pytest
import trio

from mlxd.engines.base import LoadProgress, TextDelta
from mlxd.engines.mlx_text import MlxTextEngine
from mlxd.engines.runtime.jobs import GenerationStats
from tests.engines.mlx_helpers import collect, completion, tiny_config
from tests.support.engines import RecordedTextEngine, mlx_thread_drained

pytestmark = pytest.mark.mlx


async def _consume_then_leave(eng: MlxTextEngine, how: str, n: int) -> GenerationStats:
    """Stream a long generation, leave it after ``n`` deltas by ``how``; return its stats."""
    req = completion("once upon a time", max_tokens=5000, temperature=0.0)
    seen = 0
    if (
        how == "cancel"
    ):  # the consuming task is cancelled at its await (client disconnect, preemption)
        with trio.CancelScope() as scope:
            async for ev in eng.generate(req):
                if isinstance(ev, TextDelta):
                    seen += 1
                    if seen == n:
                        scope.cancel()
        assert scope.cancelled_caught
    else:  # the iterator is closed (a consumer that stops reading)
        async with aclosing(eng.generate(req)) as agen:
            async for ev in agen:
                if isinstance(ev, TextDelta):
                    seen += 1
                    if seen == n:
                        break
    return eng.history[-1]


@pytest.mark.parametrize("how", ["cancel", "aclose"])
async def test_cancel_mid_stream_stops_within_one_token(engine: MlxTextEngine, how: str) -> None:
    """Leaving a stream stops the MLX thread within one token, and the next request is served."""
    stats = await _consume_then_leave(engine, how, n=5)
    # the next request runs only once the MLX thread is free, so the stats are final after it
    _, fin, _ = await collect(engine, completion("hello", max_tokens=3, temperature=0.0))
    assert fin.completion_tokens == 3
    assert stats.outcome == "cancelled"
    assert stats.cancel_requested_at is not None
    assert stats.tokens_after_cancel <= 1
    assert stats.completion_tokens < 5000
    token_time = (stats.cancel_requested_at - stats.first_token_at) / max(
        1, stats.completion_tokens
    )  # type: ignore[operator]
    latency = stats.cancel_latency_s
    assert latency is not None and latency < max(0.25, 3 * token_time), latency


async def test_cancel_during_prefill_stops_at_the_next_chunk(tiny_model_dir: Path) -> None:
    """Cancelling during a long prefill stops it at the next chunk, before any token."""
    step = 16
    prefill_seen = trio.Event()
    done_at_cancel: list[int] = []

    def observer(event: str, stats: GenerationStats) -> None:
        if event == "prefill" and stats.prefill_done >= 4 * step:
            prefill_seen.set()

    eng = RecordedTextEngine(tiny_config(tiny_model_dir), prefill_step=step, observer=observer)
    await eng.load(lambda _p: None)
    try:
        prompt = "hello world this is a tiny model " * 400  # ~3,200 tokens: 200 chunks
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:

                async def cancel_when_prefilling() -> None:
                    await prefill_seen.wait()
                    done_at_cancel.append(eng.history[-1].prefill_done)
                    scope.cancel()

                nursery.start_soon(cancel_when_prefilling)
                async for _ev in eng.generate(completion(prompt, max_tokens=5)):
                    pytest.fail("a token was produced although the prefill was cancelled")
        _, fin, _ = await collect(eng, completion("hello", max_tokens=2))
        assert fin.completion_tokens == 2
        stats = eng.history[-2]
        assert stats.outcome == "cancelled"
        assert stats.first_token_at is None and stats.completion_tokens == 0
        assert stats.prompt_tokens > 100 * step
        assert stats.prefill_done < stats.prompt_tokens
        # at most the chunk in flight when the flag was set, plus the one already reported
        assert stats.prefill_done - done_at_cancel[0] <= 2 * step
        chunk_time = (stats.cancel_requested_at - stats.started_at) / max(1, stats.prefill_chunks)  # type: ignore[operator]
        assert stats.cancel_latency_s is not None
        assert stats.cancel_latency_s < max(0.25, 3 * chunk_time), stats.cancel_latency_s
    finally:
        await eng.stop()


async def test_cancel_while_queued_never_reaches_the_thread(tiny_model_dir: Path) -> None:
    """A request cancelled while it waits in the queue (behind a running one: max_batch_size 1)
    is withdrawn and never runs."""
    engine = RecordedTextEngine(tiny_config(tiny_model_dir, max_batch_size=1), prefill_step=16)
    await engine.load(lambda _p: None)
    try:
        await _cancel_while_queued(engine)
    finally:
        await engine.stop()


async def _cancel_while_queued(engine: MlxTextEngine) -> None:
    first_token = trio.Event()

    async def long_one() -> None:
        async for ev in engine.generate(completion("hello", max_tokens=200, temperature=0.0)):
            if isinstance(ev, TextDelta):
                first_token.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(long_one)
        await first_token.wait()
        with trio.CancelScope() as scope:
            nursery.start_soon(lambda: _cancel_soon(scope))
            async for _ev in engine.generate(completion("queued", max_tokens=5)):
                pytest.fail("the queued request produced an event")
        queued = engine.history[-1]
        assert queued.outcome == "withdrawn" and queued.started_at is None
        assert engine.queue_depth() == 1
    await mlx_thread_drained(engine)
    assert engine.queue_depth() == 0


async def _cancel_soon(scope: trio.CancelScope) -> None:
    await trio.testing.wait_all_tasks_blocked()
    scope.cancel()


async def test_stop_during_a_generation_ends_it_and_the_thread(tiny_model_dir: Path) -> None:
    """stop() while a stream runs cancels it, unloads, and ends the MLX thread."""
    eng = RecordedTextEngine(tiny_config(tiny_model_dir))
    await eng.load(lambda _p: None)
    thread = eng._thread
    assert thread is not None
    got_token = trio.Event()
    errors: list[BaseException] = []

    async def stream() -> None:
        try:
            async for ev in eng.generate(completion("hello", max_tokens=5000, temperature=0.0)):
                if isinstance(ev, TextDelta):
                    got_token.set()
        except Exception as e:
            errors.append(e)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(stream)
        await got_token.wait()
        await eng.stop()
    assert thread.exited.is_set()
    assert eng.history[-1].outcome == "cancelled"
    assert len(errors) == 1 and "generation ended" in str(errors[0])


async def test_cancelled_load_returns_at_once_and_stop_frees_it(tmp_path: Path) -> None:
    """A load cancelled while its MLX thread works returns at once; the thread skips the weights, stop() ends it."""
    import mlx.core as mx

    before = mx.get_active_memory()
    eng = MlxTextEngine(tiny_config(tmp_path / "demo", name="demo", demo="tiny"))
    with trio.CancelScope() as scope:

        def progress(p: LoadProgress) -> None:
            if (p.detail or "").startswith("demo model:"):  # the MLX thread is busy writing it
                scope.cancel()

        await eng.load(progress)
    assert scope.cancelled_caught
    assert eng.measured_bytes() is None
    thread = eng._thread
    assert thread is not None
    await eng.stop()
    assert thread.exited.is_set()
    assert eng._model is None and eng.measured_bytes() is None  # the weights were never loaded
    assert mx.get_active_memory() - before < 100_000
