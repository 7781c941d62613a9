"""Plain helpers of the engine tests (requests, collecting a generation)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import trio

from mlxd.config import ModelConfig
from mlxd.engines.base import ChatMessage, Finished, GenerationEvent, GenerationRequest, TextDelta
from mlxd.engines.mlx_text import MlxTextEngine
from tests.support.engines import RecordedTextEngine


@asynccontextmanager
async def batched_engine(path: Path, *, prefill_step: int | None) -> AsyncIterator[MlxTextEngine]:
    """A loaded tiny model batching up to 4 generations, stopped afterwards (``prefill_step``
    None: the default one, which adapts)."""
    eng = RecordedTextEngine(tiny_config(path, max_batch_size=4), prefill_step=prefill_step)
    await eng.load(lambda _p: None)
    assert eng.batch is not None
    try:
        yield eng
    finally:
        await eng.stop()


async def empty_prompt_cache(eng: MlxTextEngine) -> None:
    """Drop a batched engine's prompt cache once its loop is off the MLX thread (a finished
    job's KV is filed there after the job's last event reached the consumer)."""
    assert eng.batch is not None
    with trio.fail_after(30):
        while eng.batch.busy:  # noqa: ASYNC110 (an MLX-thread flag)
            await trio.sleep(0.001)
    eng.batch.close()


def tiny_config(path: Path, **kw: object) -> ModelConfig:
    return ModelConfig(name=str(kw.pop("name", "tiny")), source=str(path), **kw)  # type: ignore[arg-type]


def no_eos(_tokens: object, logits: object) -> object:
    """A logits processor that keeps the random model from ever ending (token 1 is its EOS)."""
    import mlx.core as mx

    assert isinstance(logits, mx.array)
    return mx.where(mx.arange(logits.shape[-1]) == 1, -mx.inf, logits)


#: Requests here are greedy unless a test asks for sampling: at the API's default temperature
#: of 1 the random demo model (512 tokens) draws its EOS about once in 500 tokens, so a test
#: that counts tokens would fail about once a hundred runs.
GREEDY = {"temperature": 0.0}


def chat(text: str, **kw: object) -> GenerationRequest:
    return GenerationRequest(kind="chat", messages=(ChatMessage("user", text),), **{**GREEDY, **kw})  # type: ignore[arg-type]


def completion(prompt: str, **kw: object) -> GenerationRequest:
    return GenerationRequest(kind="completion", prompt=prompt, **{**GREEDY, **kw})  # type: ignore[arg-type]


async def collect(
    eng: MlxTextEngine, request: GenerationRequest
) -> tuple[str, Finished, list[str]]:
    """Run a generation to its end: (joined text, the Finished event, the deltas)."""
    deltas: list[str] = []
    finished: Finished | None = None
    event: GenerationEvent
    async for event in eng.generate(request):
        if isinstance(event, TextDelta):
            assert finished is None, "a delta after Finished"
            deltas.append(event.text)
        elif isinstance(event, Finished):
            finished = event
    assert finished is not None, "the generation ended without Finished"
    return "".join(deltas), finished, deltas
