"""Continuous batching on the tiny model: equal outputs, cancellation, prompt cache, KV admission."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import trio

from mlxd.config import Config, ContentionPolicy, ManagerConfig
from mlxd.config.kv import kv_need_bytes as batch_kv_bytes
from mlxd.engines.base import ChatMessage, Finished, GenerationRequest, KvBook, TextDelta
from mlxd.engines.mlx_text import MlxTextEngine
from mlxd.engines.scheduling.batching import BatchScheduler
from mlxd.errors import InvalidRequest, Preempted
from mlxd.residency.manager import Manager
from tests.engines.mlx_helpers import (
    chat,
    collect,
    completion,
    empty_prompt_cache,
    no_eos,
    tiny_config,
)
from tests.support.engines import RecordedTextEngine

pytestmark = pytest.mark.mlx

PROMPTS = ("the quick brown fox", "hello world", "once upon a time in a land far away", "a")


async def _loaded(path: Path, **kw: object) -> MlxTextEngine:
    eng = RecordedTextEngine(tiny_config(path, **kw), prefill_step=8)
    await eng.load(lambda _p: None)
    return eng


@pytest.fixture
async def batched(tiny_model_dir: Path) -> AsyncIterator[MlxTextEngine]:
    eng = await _loaded(tiny_model_dir, max_batch_size=4)
    assert eng.batch is not None and isinstance(eng._scheduler, BatchScheduler)
    try:
        yield eng
    finally:
        await eng.stop()


async def _together(
    eng: MlxTextEngine, requests: list[GenerationRequest]
) -> list[tuple[str, Finished]]:
    """Run ``requests`` concurrently on ``eng``; their (text, Finished) in order."""
    out: list[tuple[str, Finished] | None] = [None] * len(requests)

    async def one(i: int) -> None:
        text, fin, _ = await collect(eng, requests[i])
        out[i] = (text, fin)

    async with trio.open_nursery() as nursery:
        for i in range(len(requests)):
            nursery.start_soon(one, i)
    assert all(o is not None for o in out)
    return [o for o in out if o is not None]


async def test_batched_greedy_outputs_equal_serial_ones(
    tiny_model_dir: Path, batched: MlxTextEngine
) -> None:
    """At temperature 0, four prompts decoded together give exactly the text each gives alone
    (one at a time, max_batch_size 1): fp32 on the CPU, the batched matmuls reduce each row the
    same way, so no tolerance is needed."""
    requests = [completion(p, max_tokens=40, temperature=0.0) for p in PROMPTS]
    serial = await _loaded(tiny_model_dir, max_batch_size=1)
    try:
        assert serial.batch is None
        alone = [await collect(serial, r) for r in requests]
    finally:
        await serial.stop()
    assert batched.batch is not None
    steps_before = batched.batch.steps
    together = await _together(batched, requests)
    assert [t for t, _ in together] == [t for t, _, _ in alone]
    assert [f.completion_tokens for _, f in together] == [40] * 4
    # they shared decode steps: far fewer steps than the 160 tokens produced
    assert batched.batch.steps - steps_before < 100


async def test_a_first_token_goes_out_in_the_step_that_ends_its_prompt(
    batched: MlxTextEngine,
) -> None:
    """A newcomer's first token is delivered in the step that ends its prompt: a 1-token request
    takes its prompt's prefill chunks plus one step (no forward pass past its token), gives the
    first token of a longer run, and leaves its prompt's KV in the prompt cache."""
    assert batched.batch is not None
    prompt = PROMPTS[2]
    longer, _, _ = await collect(batched, completion(prompt, max_tokens=5, temperature=0.0))
    await empty_prompt_cache(batched)  # the next request prefills its whole prompt
    steps_before = batched.batch.steps
    text, fin, _ = await collect(batched, completion(prompt, max_tokens=1, temperature=0.0))
    chunks = -(-(fin.prompt_tokens - 1) // 8)  # prefill_step 8; the last token starts decoding
    assert batched.batch.steps - steps_before == chunks + 1
    assert (fin.finish_reason, fin.completion_tokens) == ("length", 1)
    assert longer.startswith(text) and text
    again, fin2, _ = await collect(batched, completion(prompt, max_tokens=1, temperature=0.0))
    assert again == text and fin2.cached_tokens == fin.prompt_tokens - 1


async def test_a_started_generation_runs_before_its_events_are_read(
    batched: MlxTextEngine,
) -> None:
    """``start_generation`` queues the job at once (a stream's first bytes go out while the
    model prefills): its tokens are made before anyone reads them, the events then give the
    same text as ``generate``; events closed without being read cancel their job."""
    assert batched.batch is not None
    request = completion(PROMPTS[2], max_tokens=12, temperature=0.0, logits_processors=(no_eos,))
    expected, _, _ = await collect(batched, request)
    sampling = threading.Event()  # set on the MLX thread as a token is being made

    def noting(tokens: object, logits: object) -> object:
        sampling.set()
        return no_eos(tokens, logits)

    queued_at = time.monotonic()
    events = await batched.start_generation(replace(request, logits_processors=(noting,)))
    assert await trio.to_thread.run_sync(sampling.wait, 30)  # made while nobody reads
    got = [ev async for ev in events]
    assert "".join(ev.text for ev in got if isinstance(ev, TextDelta)) == expected
    assert isinstance(got[-1], Finished) and got[-1].completion_tokens == 12
    started = got[-1].started_at  # when the MLX thread took it (the access log's queue_ms)
    assert started is not None and queued_at <= started <= time.monotonic()

    long = await batched.start_generation(
        completion(PROMPTS[2], max_tokens=400, logits_processors=(no_eos,))
    )
    await events.aclose()  # closing a finished stream is a no-op
    await long.aclose()  # never read: withdrawn
    with trio.fail_after(30):
        while batched.queue_depth():  # noqa: ASYNC110 (the job leaves on the MLX thread)
            await trio.sleep(0.01)
    last = batched.history[-1]
    assert last.outcome == "cancelled" and last.completion_tokens < 400


async def test_one_cancelled_request_in_a_batch_of_four_stops_within_a_step(
    batched: MlxTextEngine,
) -> None:
    """Cancelling one of four batched streams stops it within one decode step; the other
    three finish with exactly the text they give without it."""
    requests = [completion(p, max_tokens=60, temperature=0.0) for p in PROMPTS]
    reference = await _together(batched, requests[1:])
    results: list[tuple[str, Finished] | None] = [None] * 4
    got = trio.Event()

    async def victim(scope: trio.CancelScope) -> None:
        with scope:
            async for ev in batched.generate(requests[0]):
                if isinstance(ev, TextDelta):
                    got.set()

    async def other(i: int) -> None:
        text, fin, _ = await collect(batched, requests[i])
        results[i] = (text, fin)

    async with trio.open_nursery() as nursery:
        scope = trio.CancelScope()
        nursery.start_soon(victim, scope)
        for i in (1, 2, 3):
            nursery.start_soon(other, i)
        await got.wait()
        scope.cancel()
    victim_stats = next(s for s in batched.history if s.outcome == "cancelled")
    assert victim_stats.tokens_after_cancel <= 1
    assert victim_stats.completion_tokens < 60
    # (the reference runs filled the prompt cache: compare the texts and token counts)
    assert [(t, f.completion_tokens) for t, f in results[1:]] == [
        (t, f.completion_tokens) for t, f in reference
    ]


async def test_a_prompt_cache_hit_gives_the_same_output_as_a_miss(batched: MlxTextEngine) -> None:
    """A chat whose prefix is in the prompt cache reports cached_tokens and generates the same
    text as the first (uncached) run; the next turn reuses the whole first exchange."""
    req = chat("tell me about the sea", max_tokens=24, temperature=0.0)
    first, fin1, _ = await collect(batched, req)
    second, fin2, _ = await collect(batched, req)
    assert fin1.cached_tokens == 0 and fin2.cached_tokens == fin1.prompt_tokens - 1
    assert second == first
    turn2 = GenerationRequest(
        kind="chat",
        messages=(
            ChatMessage("user", "tell me about the sea"),
            ChatMessage("assistant", first),
            ChatMessage("user", "and the sky?"),
        ),
        max_tokens=8,
        temperature=0.0,
    )
    _, fin3, _ = await collect(batched, turn2)
    assert fin3.cached_tokens >= fin1.prompt_tokens
    assert batched.batch is not None and batched.batch.usage()["prompt_cache"] > 0


async def test_seeded_sampling_does_not_depend_on_the_neighbours(batched: MlxTextEngine) -> None:
    """A seeded request samples the same text alone and next to three others (its own key)."""
    seeded = chat("tell me something", max_tokens=30, temperature=1.0, top_p=0.9, seed=42)
    alone, _, _ = await collect(batched, seeded)
    others = [chat(p, max_tokens=30, temperature=0.7) for p in PROMPTS[:3]]
    together = await _together(batched, [seeded, *others])
    assert together[0][0] == alone
    different, _, _ = await collect(
        batched, chat("tell me something", max_tokens=30, temperature=1.0, seed=7)
    )
    assert different != alone


async def test_logits_processors_and_logprobs_are_per_request(batched: MlxTextEngine) -> None:
    """A request's logits processor constrains only that request; logprobs come per token."""
    import mlx.core as mx

    forced = 300  # a token id the processor forces

    def only_forced(_tokens: mx.array, logits: mx.array) -> mx.array:
        mask = mx.arange(logits.shape[-1]) == forced
        return mx.where(mask, logits, -mx.inf)

    constrained = completion(
        "hello", max_tokens=5, temperature=0.0, logits_processors=(only_forced,), logprobs=2
    )
    free = completion("hello", max_tokens=5, temperature=0.0)
    deltas: list[TextDelta] = []

    async def run_constrained() -> None:
        async for ev in batched.generate(constrained):
            if isinstance(ev, TextDelta):
                deltas.append(ev)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_constrained)
        free_text, _, _ = await collect(batched, free)
    tokens = [lp.id for d in deltas for lp in d.logprobs]
    assert tokens == [forced] * 5
    for d in deltas:
        for lp in d.logprobs:
            assert lp.logprob == pytest.approx(0.0, abs=1e-4)  # all the mass on the forced token
            assert len(lp.top) == 2 and lp.top[0].id == forced
    alone, _, _ = await collect(batched, free)
    assert free_text == alone


async def test_kv_admission_keeps_the_batch_within_kv_cache(tiny_model_dir: Path) -> None:
    """With kv_cache_gb set (a fixed region) holding two sequences' KV, four requests run at most
    two at a time and all finish;
    a request that could not fit even alone is capped to the room, or refused if its prompt
    alone does not fit."""
    eng = MlxTextEngine(tiny_config(tiny_model_dir, max_batch_size=4), prefill_step=8)
    await eng.load(lambda _p: None)
    try:
        assert eng.kv_bytes_per_token == 1024  # 2 x 2 layers x 4 KV heads x 16 x fp32
        longest = max([await eng.count_tokens(completion(p)) for p in PROMPTS]) + 100
        eng.kv_cache_bytes = batch_kv_bytes([longest] * 2, 1024)  # two of them, not three
        sched = eng._scheduler
        assert isinstance(sched, BatchScheduler)
        sched.kv = eng.kv = KvBook(eng.kv_cache_bytes, 1024, fixed=True)
        most = 0

        def watch(_event: str, _stats: object) -> None:
            nonlocal most
            most = max(most, len(sched._active))
            assert sched.kv_reserved() <= eng.kv_cache_bytes

        eng.observer = watch
        results = await _together(eng, [completion(p, max_tokens=100) for p in PROMPTS])
        assert most == 2 and len(results) == 4
        peak = eng.memory_usage()["kv_cache_peak"]
        assert 0 < peak <= eng.kv_cache_bytes  # what mlx-lm really held stayed within the room
        # more than fits even alone: capped to the room (finish_reason length) ...
        _, fin, _ = await collect(
            eng, completion("hello", max_tokens=5000, logits_processors=(no_eos,))
        )
        room = eng.kv_cache_bytes // 1024 - 255  # tokens, leaving the last growth step
        assert (fin.finish_reason, fin.prompt_tokens + fin.completion_tokens) == ("length", room)
        # ... and a prompt that alone does not fit is refused
        with pytest.raises(InvalidRequest) as err:
            await collect(eng, completion("hello world " * 400, max_tokens=5))
        assert err.value.param == "messages" and "kv_cache_gb" in err.value.message
    finally:
        await eng.stop()


def test_batch_kv_bytes_pads_every_sequence_to_the_longest() -> None:
    """A batch holds n x (longest + a growth step but one token) x bytes per token: it grows
    by 256 tokens from whatever length it was merged at."""
    assert batch_kv_bytes([], 10) == 0
    assert batch_kv_bytes([10], 2) == (10 + 255) * 2
    assert batch_kv_bytes([10, 300, 5], 2) == 3 * (300 + 255) * 2


async def test_preempting_a_batched_model_stops_all_its_leases(tiny_model_dir: Path) -> None:
    """Three streams batched on one model are all preempted by an unload with preempt."""
    model = tiny_config(tiny_model_dir, max_batch_size=4, estimated_memory_bytes=1 << 20)
    config = Config(
        manager=ManagerConfig(1 << 30, contention_policy=ContentionPolicy("preempt")),
        models=(model,),
    )
    manager = Manager(config, RecordedTextEngine)
    errors: list[BaseException] = []
    endless = completion("hi", max_tokens=1000, logits_processors=(no_eos,))
    streaming = [trio.Event() for _ in range(3)]

    async def stream(i: int) -> None:
        async with manager.lease("tiny") as lease:
            try:
                with lease.scope():
                    async for ev in lease.engine.generate(replace(endless, lease_id=lease.id)):
                        if isinstance(ev, TextDelta):
                            streaming[i].set()
            except Exception as e:
                errors.append(e)

    async with trio.open_nursery() as nursery:
        await nursery.start(manager.run)
        async with trio.open_nursery() as streams:
            for i in range(3):
                streams.start_soon(stream, i)
            for ev in streaming:
                await ev.wait()
            engine = manager.engine_of("tiny")
            assert isinstance(engine, RecordedTextEngine) and engine.batch is not None
            await manager.unload("tiny", preempt=True)
        assert len(errors) == 3, errors
        assert all(isinstance(e, Preempted) for e in errors), errors
        assert manager.state_of("tiny").value == "unloaded"
        outcomes = [s.outcome for s in engine.history]
        assert outcomes.count("cancelled") == 3
        await manager.shutdown(1.0)
        nursery.cancel_scope.cancel()


async def test_a_long_prompt_is_prefilled_between_the_running_streams_tokens(
    batched: MlxTextEngine,
) -> None:
    """A newcomer's long prompt is prefilled in chunks between decode steps: the running
    stream keeps getting tokens while the newcomer's prefill progresses."""
    seen: list[tuple[str, str | None]] = []
    batched.observer = lambda event, stats: seen.append((event, stats.request_id))
    running = completion("once", max_tokens=400, logits_processors=(no_eos,), request_id="a")
    long_prompt = " ".join(["the quick brown fox jumps over the lazy dog"] * 20)
    newcomer = completion(long_prompt, max_tokens=4, request_id="b")
    started = trio.Event()

    async def stream_a() -> None:
        async for ev in batched.generate(running):
            if isinstance(ev, TextDelta):
                started.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(stream_a)
        await started.wait()
        _, fin, _ = await collect(batched, newcomer)
        nursery.cancel_scope.cancel()
    assert fin.prompt_tokens > 100
    chunks = [i for i, (ev, rid) in enumerate(seen) if ev == "prefill" and rid == "b"]
    assert len(chunks) >= 10  # prompt_tokens / prefill_step chunks
    during = [rid for ev, rid in seen[chunks[0] : chunks[-1]] if ev == "token"]
    # about one token of "a" between every two chunks of "b" (give or take the step where "b"
    # joined the generation batch)
    assert during.count("a") >= len(chunks) - 2


async def test_a_failing_logits_processor_fails_its_request_and_the_engine_goes_on(
    batched: MlxTextEngine,
) -> None:
    """An exception inside a decode step ends the batch's requests with an EngineError (none is
    left hanging) and the next request is served by a fresh generator."""
    from mlxd.errors import EngineError

    def broken(_tokens: object, _logits: object) -> object:
        raise RuntimeError("grammar exploded")

    with pytest.raises(EngineError, match="grammar exploded"):
        await collect(batched, completion("hello", max_tokens=5, logits_processors=(broken,)))
    _, fin, _ = await collect(batched, completion("hello", max_tokens=5))
    assert fin.completion_tokens == 5


async def test_a_fast_models_prefill_chunks_grow_to_the_time_target(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the default prefill step, a model that prefills fast gets chunks sized to take
    about PREFILL_CHUNK_S at its measured rate (the tiny model: far more than 64 tokens), so
    a long prompt takes fewer steps; a step set by MLXD_PREFILL_STEP stays as set."""
    from mlxd.engines.scheduling.prefill_pace import PREFILL_CHUNK_MAX, PREFILL_CHUNK_S

    monkeypatch.delenv("MLXD_PREFILL_STEP", raising=False)
    eng = MlxTextEngine(tiny_config(tiny_model_dir, max_batch_size=4))
    await eng.load(lambda _p: None)
    try:
        batch = eng.batch
        assert batch is not None and batch.prefill_chunk == eng.prefill_step == 64
        await collect(eng, completion(" ".join(["fox"] * 400), max_tokens=1))
        assert batch.prefill_rate is not None
        expected = max(64, min(PREFILL_CHUNK_MAX, int(batch.prefill_rate * PREFILL_CHUNK_S)))
        assert batch.prefill_chunk == expected > 64
        steps = batch.steps
        _, fin, _ = await collect(eng, completion(" ".join(["dog"] * 400), max_tokens=1))
        assert fin.prompt_tokens > 400 and fin.cached_tokens < 10
        assert batch.steps - steps < -(-fin.prompt_tokens // 64)  # fewer than 64-token chunks
    finally:
        await eng.stop()

    monkeypatch.setenv("MLXD_PREFILL_STEP", "64")
    fixed = MlxTextEngine(tiny_config(tiny_model_dir, max_batch_size=4))
    await fixed.load(lambda _p: None)
    try:
        assert fixed.batch is not None
        await collect(fixed, completion(" ".join(["fox"] * 400), max_tokens=1))
        assert fixed.batch.prefill_rate is not None and fixed.batch.prefill_chunk == 64
    finally:
        await fixed.stop()


class ParkWatch(threading.Condition):
    """A batch loop's arrival condition that notes (jobs in its inbox, requests on their way)
    each time the MLX thread parks on it: the event "the loop saw them and chose to wait"."""

    def __init__(self, loop: Any) -> None:
        super().__init__(loop._lock)
        self.loop = loop
        self.parks: queue.SimpleQueue[tuple[int, int]] = queue.SimpleQueue()

    def wait(self, timeout: float | None = None) -> bool:
        self.parks.put((len(self.loop._inbox), self.loop._expected))  # under the loop's lock
        return super().wait(timeout)

    async def until(self, *, jobs: int, on_the_way: int) -> None:
        """Return once the loop has parked with ``jobs`` and ``on_the_way`` (queue.Empty: never)."""

        def seen() -> None:
            while self.parks.get(timeout=30) != (jobs, on_the_way):
                pass

        await trio.to_thread.run_sync(seen)


async def test_requests_on_their_way_prefill_together_with_the_first(
    batched: MlxTextEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A burst: the first job of a busy period waits for the requests its engine expects
    (``expecting``: leased, being checked), so that they all start in one step instead of
    the first running alone; one that leaves without a job (refused) ends the wait too."""
    from mlxd.engines.scheduling import batch_loop

    monkeypatch.setattr(batch_loop, "GATHER_S", 60.0)  # only the requests themselves end it
    loop = batched.batch
    assert loop is not None
    alone = loop.alone
    requests = [completion(p, max_tokens=6, temperature=0.0) for p in PROMPTS[:3]]
    on_the_way = [batched.expecting() for _ in range(4)]
    for w in on_the_way:
        w.__enter__()
    loop._arrival = parks = ParkWatch(loop)  # type: ignore[misc]
    started = []
    for i, request in enumerate(requests):
        started.append(await batched.start_generation(request))
        on_the_way[i].__exit__(None, None, None)
        await parks.until(jobs=i + 1, on_the_way=3 - i)  # it saw this job and chose to wait
    released_at = time.monotonic()
    on_the_way[3].__exit__(None, None, None)  # the fourth was refused before its job
    with trio.fail_after(30):
        finished = [[ev async for ev in events][-1] for events in started]
    assert [f.completion_tokens for f in finished] == [6, 6, 6]
    assert all(f.started_at is not None and f.started_at >= released_at for f in finished)
    assert loop.alone == alone and loop._expected == 0
