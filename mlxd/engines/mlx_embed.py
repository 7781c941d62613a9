"""The embedding engine: one residency of an ``embedding: true`` model, through mlx-embeddings.

Decision (README "Embeddings"): mlx-embeddings installs here (it rides on
mlx-vlm, the vision extra) and loads BERT-family encoders, which is what
embedding models are; the random-weight BERT that ``mlxd demo-model
--embedding`` writes loads with it. Pooled hidden states of a decoder
through mlx-lm would only imitate an embedding model. The package is the
``embeddings`` extra; without it an embedding model fails to load with a
message that names the extra.

The engine reuses the text engine's residency machinery (source, demo model on
first use, the MLX thread, the measured footprint, unload). Each request is
one batch on the MLX thread: inputs padded to the longest, the model's pooled
and normalised ``text_embeds`` returned as plain floats. Inputs longer than
the model's ``max_position_embeddings`` are a 400 naming the input.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import AsyncGenerator, Callable
from pathlib import Path
from typing import Any

import trio

from mlxd.engines.base import GenerationEvent, GenerationRequest, LoadProgress
from mlxd.engines.mlx_text import MlxTextEngine
from mlxd.engines.model_files import sources
from mlxd.errors import EngineError, InvalidRequest, LoadFailed, Overloaded

#: what a request may embed at once
MAX_INPUTS = 2048


class MlxEmbeddingEngine(MlxTextEngine):
    """An encoder model behind ``POST /v1/embeddings`` (see the module docstring)."""

    kind = "embedding"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.context: int | None = None
        self._busy = 0

    def _allow_patterns(self) -> tuple[str, ...]:
        return sources.TEXT_PATTERNS

    def _write_demo(self, path: Path, report: Callable[[LoadProgress], None]) -> None:
        from mlxd.engines.model_files.demo_model import (
            DemoModelError,
            is_model_dir,
            write_demo_model,
        )

        if is_model_dir(path):
            return
        try:
            write_demo_model(path, "embedding", report=lambda m: report(
                LoadProgress(phase="loading", detail=f"demo model: {m}")))
        except DemoModelError as e:
            raise LoadFailed(f"{self.name}: cannot make the demo model: {e}") from e

    def _load_weights(self, path: Path) -> tuple[Any, Any]:
        try:
            mlx_embeddings: Any = importlib.import_module("mlx_embeddings")
        except ImportError as e:
            raise LoadFailed(
                f"{self.name}: embedding models need the embeddings extra "
                f"(pip install 'mlxd[embeddings]'): {e}"
            ) from e
        model, tokenizer = mlx_embeddings.load(str(path))
        args = getattr(model, "config", None) or getattr(model, "args", None)
        self.context = getattr(args, "max_position_embeddings", None)
        return model, tokenizer

    async def prepare(self, request: GenerationRequest) -> GenerationRequest:
        raise InvalidRequest(
            f"model '{self.name}' is an embedding model: use POST /v1/embeddings", param="model"
        )

    async def count_tokens(self, request: GenerationRequest) -> int:
        await self.prepare(request)
        return 0

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[GenerationEvent, None]:
        await self.prepare(request)
        yield  # type: ignore[misc]  # unreachable: an async generator, as the protocol says

    def queue_depth(self) -> int:
        return self._busy

    # ---- embeddings ---------------------------------------------------------------------------

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, with the model's special tokens (pure: any thread); the
        first text over the model's context is refused before the next is tokenized."""
        tok = getattr(self._tokenizer, "_tokenizer", self._tokenizer)
        out: list[list[int]] = []
        for t in texts:
            out.append(list(tok.encode(t)))
            self._check_length(len(out) - 1, out[-1])
        return out

    def _check_length(self, i: int, seq: list[int]) -> None:
        if self.context is not None and len(seq) > self.context:
            raise InvalidRequest(
                f"input[{i}]: {len(seq)} tokens, over the model's context of {self.context}",
                param=f"input[{i}]",
            )

    async def embed(self, inputs: list[str] | list[list[int]]) -> tuple[list[list[float]], int]:
        """Embeddings of ``inputs`` (texts, or token ids) and the tokens they took."""
        thread = self._thread
        if not self._ready or thread is None:
            raise EngineError(f"{self.name}: the model is not loaded", retry_after=1.0)
        if self._busy >= self.config.max_queue:
            raise Overloaded(f"{self.name}: {self._busy} requests are already queued")
        if inputs and isinstance(inputs[0], str):
            ids = await trio.to_thread.run_sync(self.tokenize, inputs, abandon_on_cancel=True)
        else:
            ids = inputs  # type: ignore[assignment]
        vocab = len(getattr(self._tokenizer, "_tokenizer", self._tokenizer))
        for i, seq in enumerate(ids):
            if not seq:
                raise InvalidRequest(f"input[{i}]: is empty", param=f"input[{i}]")
            self._check_length(i, seq)
            if vocab and any(not 0 <= t < vocab for t in seq):
                raise InvalidRequest(f"input[{i}]: token ids must be from 0 to {vocab - 1}",
                                     param=f"input[{i}]")
        self._busy += 1
        cancel = threading.Event()
        try:
            vectors = await thread.run(self._embed_on_thread, ids, cancel=cancel)
        finally:
            self._busy -= 1
        return vectors, sum(len(s) for s in ids)

    def _embed_on_thread(self, ids: list[list[int]]) -> list[list[float]]:
        import mlx.core as mx

        width = max(len(s) for s in ids)
        pad = int(getattr(self._tokenizer, "pad_token_id", None) or 0)
        tokens = mx.array([s + [pad] * (width - len(s)) for s in ids])
        mask = mx.array([[1] * len(s) + [0] * (width - len(s)) for s in ids])
        out = self._model(tokens, attention_mask=mask)
        vectors = out.text_embeds.astype(mx.float32)
        mx.eval(vectors)
        result: list[list[float]] = vectors.tolist()
        return result
