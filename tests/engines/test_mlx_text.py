"""The mlx-lm text engine on a tiny random llama: loading, generation, stop strings, seeds, queueing."""

from __future__ import annotations

import gc
import shutil
import weakref
from pathlib import Path

import pytest
import trio
from transformers import AutoTokenizer

from mlxd.engines.base import (
    ChatMessage,
    Engine,
    Finished,
    GenerationRequest,
    LoadProgress,
    TextDelta,
)
from mlxd.engines.mlx_text import MlxTextEngine
from mlxd.errors import InvalidRequest, LoadFailed, Overloaded
from tests.engines.mlx_helpers import chat, collect, completion, tiny_config
from tests.support.engines import mlx_thread_drained

pytestmark = pytest.mark.mlx


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_model_dir: Path):  # type: ignore[no-untyped-def]
    """The tiny model's tokenizer read by transformers directly (the peer the counts must match)."""
    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


async def test_load_reports_phases_and_the_measured_footprint(tiny_model_dir: Path) -> None:
    """A load reports its phases in order and measures the weights' bytes."""
    eng = MlxTextEngine(tiny_config(tiny_model_dir))
    assert isinstance(eng, Engine)
    seen: list[LoadProgress] = []
    await eng.load(seen.append)
    try:
        phases = [p.phase for p in seen]
        assert phases[0] == "starting" and phases[-1] == "done"
        assert phases.index("loading") < phases.index("measuring") < phases.index("done")
        size = eng.measured_bytes()
        weights = (tiny_model_dir / "model.safetensors").stat().st_size
        assert size is not None and weights * 0.9 < size < weights * 1.5
        assert seen[-1].bytes_done == size
    finally:
        await eng.stop()
    assert eng.queue_depth() == 0


class _Node:
    """An object in a reference cycle (only a garbage collection frees it)."""

    def __init__(self) -> None:
        self.me = self


async def test_a_loaded_models_heap_is_out_of_full_collections_until_its_unload(
    tiny_model_dir: Path,
) -> None:
    """After a load every object alive is frozen (``gc.freeze``: full collections skip them);
    a cycle that was alive then and dropped later is freed by the unload's collection."""
    gc.unfreeze()
    node = _Node()
    gone = weakref.ref(node)
    eng = MlxTextEngine(tiny_config(tiny_model_dir))
    await eng.load(lambda _p: None)
    try:
        assert gc.get_freeze_count() > 10_000  # mlx-lm, transformers, the model's modules
        del node
        gc.collect()
        assert gone() is not None  # frozen with the model: no collection looks at it
    finally:
        await eng.stop()
    assert gone() is None and gc.get_freeze_count() > 0  # collected, and what is left refrozen
    gc.unfreeze()


async def test_chat_stream_counts_match_the_tokenizer(engine: MlxTextEngine, hf_tokenizer) -> None:  # type: ignore[no-untyped-def]
    """A streamed chat yields deltas then Finished, with prompt tokens as the chat template encodes them."""
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello world"},
    ]
    req = GenerationRequest(
        kind="chat",
        messages=tuple(ChatMessage(m["role"], m["content"]) for m in messages),
        max_tokens=24,
        temperature=0.0,
    )
    text, fin, deltas = await collect(engine, req)
    prompt = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("assistant:")
    assert fin == Finished("length", len(hf_tokenizer.encode(prompt)), 24)
    assert len(deltas) >= 2 and text  # streamed in pieces, not in one lump
    # the stream decodes to what the tokens decode to
    assert engine.history[-1].outcome == "length"


async def test_completion_is_deterministic_when_greedy(engine: MlxTextEngine, hf_tokenizer) -> None:  # type: ignore[no-untyped-def]
    """A greedy completion counts its prompt as the tokenizer does and repeats exactly."""
    prompt = "the quick brown fox"
    first, fin1, _ = await collect(engine, completion(prompt, max_tokens=16, temperature=0.0))
    second, fin2, _ = await collect(engine, completion(prompt, max_tokens=16, temperature=0.0))
    n = len(hf_tokenizer.encode(prompt))
    assert fin1 == Finished("length", n, 16)
    # the second run finds the first one's KV in the prompt cache: all but the last prompt token
    assert fin2 == Finished("length", n, 16, cached_tokens=n - 1)
    assert first == second


async def test_seed_makes_sampled_runs_identical(engine: MlxTextEngine) -> None:
    """Two sampled runs with the same seed are identical; another seed differs."""
    req = chat("tell me something", max_tokens=40, temperature=1.0, seed=1234)
    a, _, _ = await collect(engine, req)
    b, _, _ = await collect(engine, req)
    c, _, _ = await collect(
        engine, chat("tell me something", max_tokens=40, temperature=1.0, seed=4321)
    )
    assert a == b
    assert a != c


async def test_stop_string_ends_generation_and_is_trimmed(engine: MlxTextEngine) -> None:
    """A stop string ends the generation with finish_reason stop; no part of it is ever streamed."""
    base = chat("tell me something", max_tokens=60, temperature=1.0, seed=7)
    full, _, _ = await collect(engine, base)
    # a stop string that starts mid-output and spans several tokens
    start = len(full) // 2
    stop = full[start : start + 5]
    expected = full[: full.find(stop)]
    req = chat(
        "tell me something", max_tokens=60, temperature=1.0, seed=7, stop=("never-there", stop)
    )
    text, fin, deltas = await collect(engine, req)
    assert fin.finish_reason == "stop"
    assert text == expected
    assert fin.completion_tokens < 60
    assert all(stop not in d for d in deltas)


async def test_eos_or_length_finish_with_one_token(engine: MlxTextEngine) -> None:
    """max_tokens=1 gives exactly one completion token and finish_reason length."""
    _, fin, _ = await collect(engine, completion("hello", max_tokens=1, temperature=0.0))
    assert fin.completion_tokens == 1 and fin.finish_reason == "length"


async def test_requests_are_served_in_arrival_order_and_the_queue_is_bounded(
    tiny_model_dir: Path,
) -> None:
    """With max_batch_size 1 (as before batching), requests run one at a time in arrival order;
    beyond max_queue the next one is Overloaded."""
    eng = MlxTextEngine(tiny_config(tiny_model_dir, max_queue=3, max_batch_size=1))
    await eng.load(lambda _p: None)
    order: list[str] = []
    first_token = trio.Event()

    async def run(tag: str, n: int) -> None:
        async for ev in eng.generate(completion("hello", max_tokens=n, temperature=0.0)):
            if isinstance(ev, TextDelta) and tag == "a":
                first_token.set()
            if isinstance(ev, Finished):
                order.append(tag)

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run, "a", 300)
            await first_token.wait()
            nursery.start_soon(run, "b", 5)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(run, "c", 5)
            await trio.testing.wait_all_tasks_blocked()
            assert eng.queue_depth() == 3
            with pytest.raises(Overloaded) as err:
                async for _ev in eng.generate(completion("hello", max_tokens=5)):
                    pytest.fail("an overloaded request yielded an event")
            assert err.value.http_status == 503 and err.value.headers()["Retry-After"]
        assert order == ["a", "b", "c"]
        assert eng.batch is None  # the serial path: no batch loop, no prompt cache
        await mlx_thread_drained(eng)
        assert eng.queue_depth() == 0
    finally:
        await eng.stop()


async def test_chat_without_a_chat_template_is_a_clear_error(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A model without a chat template refuses chat (naming the way out) but serves completions."""
    bare = tmp_path / "bare"
    shutil.copytree(tiny_model_dir, bare)
    (bare / "chat_template.jinja").unlink()
    eng = MlxTextEngine(tiny_config(bare, name="bare"))
    await eng.load(lambda _p: None)
    try:
        with pytest.raises(InvalidRequest, match=r"no chat template.*completions"):
            await collect(eng, chat("hello", max_tokens=3))
        _, fin, _ = await collect(eng, completion("hello", max_tokens=3))
        assert fin.completion_tokens == 3
    finally:
        await eng.stop()


async def test_bad_requests_are_refused_before_queueing(engine: MlxTextEngine) -> None:
    """Images on a text model, max_tokens < 1, an empty prompt and bad token ids are InvalidRequest
    naming the field."""
    image_msg = ChatMessage(
        "user", [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]
    )
    with pytest.raises(InvalidRequest) as err:
        await collect(engine, GenerationRequest(kind="chat", messages=(image_msg,)))
    assert err.value.param == "messages" and "images" in err.value.message
    with pytest.raises(InvalidRequest) as err:
        await collect(engine, completion("hello", max_tokens=0))
    assert err.value.param == "max_tokens"
    with pytest.raises(InvalidRequest) as err:
        await collect(engine, completion("", max_tokens=3))
    assert err.value.param == "prompt"
    for ids in ((), (10**6,), (-1,)):  # token ids given by a caller: an id out of range crashes MLX
        with pytest.raises(InvalidRequest) as err:
            await collect(engine, completion("x", prompt_ids=ids))
        assert err.value.param == "prompt" and "token ids" in err.value.message
    # and the engine still serves
    _, fin, _ = await collect(engine, completion("hello", max_tokens=2))
    assert fin.completion_tokens == 2


async def test_demo_model_is_made_on_first_load(tmp_path: Path) -> None:
    """A demo model config whose directory holds no model writes one there, then loads it."""
    target = tmp_path / "state" / "demo-tiny"
    eng = MlxTextEngine(tiny_config(target, name="demo", demo="tiny"))
    details: list[str] = []
    await eng.load(lambda p: details.append(p.detail or ""))
    try:
        assert (target / "config.json").is_file()
        assert any(d.startswith("demo model:") for d in details)
        _, fin, _ = await collect(eng, chat("hello", max_tokens=4))
        assert fin.completion_tokens == 4
    finally:
        await eng.stop()


async def test_missing_local_model_fails_with_a_readable_reason(tmp_path: Path) -> None:
    """A source that is neither a model directory nor a repo id fails to load with LoadFailed."""
    empty = tmp_path / "empty"
    empty.mkdir()
    for source, pattern in [(empty, "no config.json"), (tmp_path / "nope", "no such directory")]:
        eng = MlxTextEngine(tiny_config(source, name="missing"))
        with pytest.raises(LoadFailed, match=pattern):
            await eng.load(lambda _p: None)
        await eng.stop()


async def test_corrupt_weights_fail_the_load_and_stop_frees_the_thread(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Weights that do not parse fail the load with LoadFailed; stop() then ends the MLX thread."""
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    eng = MlxTextEngine(tiny_config(broken, name="broken"))
    with pytest.raises(LoadFailed, match="broken: cannot load"):
        await eng.load(lambda _p: None)
    thread = eng._thread
    assert thread is not None
    await eng.stop()
    assert thread.exited.is_set() and not thread.is_alive()


async def test_generate_before_load_or_after_stop_is_refused(tiny_model_dir: Path) -> None:
    """An engine that is not loaded refuses generation with a retryable EngineError."""
    from mlxd.errors import EngineError

    eng = MlxTextEngine(tiny_config(tiny_model_dir))
    with pytest.raises(EngineError, match="not loaded"):
        await collect(eng, completion("hello", max_tokens=2))
    await eng.load(lambda _p: None)
    await eng.stop()
    with pytest.raises(EngineError, match="not loaded"):
        await collect(eng, completion("hello", max_tokens=2))


async def test_unseeded_sampling_differs_between_residencies(tiny_model_dir: Path) -> None:
    """Without a seed, two residencies of a model do not sample the same text (fresh entropy per request)."""
    texts = []
    for _ in range(2):
        eng = MlxTextEngine(tiny_config(tiny_model_dir))
        await eng.load(lambda _p: None)
        try:
            text, _, _ = await collect(
                eng, chat("tell me something", max_tokens=30, temperature=1.0)
            )
            texts.append(text)
        finally:
            await eng.stop()
    assert texts[0] != texts[1]
