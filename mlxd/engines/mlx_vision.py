"""The mlx-vlm vision engine: ``mllm: true`` models that read images (the ``vlm`` extra).

It is the text engine (:class:`~mlxd.engines.mlx_text.MlxTextEngine`) with
another loader and another generation call; the threading, queueing,
streaming, stop strings and cancellation rules are inherited unchanged.

* mlx-vlm is imported lazily, on the MLX thread, at load: without the extra a
  load fails with a typed ``model_load_failed`` that says how to install it.
* Images come from OpenAI ``image_url`` content parts (:mod:`mlxd.engines.text.images`:
  base64 ``data:`` URLs; ``file://`` only under the model's ``image_dir``).
  The HTTP layer checks every limit from their headers before the request
  waits for anything; the engine decodes them on a worker thread once the
  request holds its lease and has passed the queue check, one request at a
  time, before it is queued, so a bad image is a 400 naming the field and
  never reaches the MLX thread.
* mlx-vlm's LLaVA processor forwards tokenizer kwargs (``padding``...) to the
  image processor, which transformers 5 rejects (mlx-vlm#870); the loaded
  processor drops those keywords (docs/platform-facts.md, "mlx-vlm's LLaVA
  processor passes tokenizer arguments to the image processor").
* Generations run one at a time, whatever ``max_batch_size`` says: mlx-vlm's
  batch generator samples a whole batch with one sampler, so per-request
  temperature, top_p, seed and stop strings would be lost.
* Cancellation is checked between tokens. mlx-vlm's ``stream_generate`` has no
  prefill progress callback, so a cancel during the prefill of an image prompt
  is noticed at the first token (image prompts are short; text prompts on text
  models are chunked).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import trio

from mlxd.config import ModelConfig
from mlxd.engines.base import GenerationRequest
from mlxd.engines.injected_faults import Faults
from mlxd.engines.mlx_generation import Observer, seed_rng
from mlxd.engines.mlx_text import MlxTextEngine
from mlxd.engines.model_files import sources
from mlxd.engines.runtime.jobs import Job
from mlxd.engines.text import prompt_limits
from mlxd.engines.text.prompts import count_image_parts, message_text, uses_tools
from mlxd.errors import EngineError, InvalidRequest, LoadFailed, ToolsNotSupported

_TOKENIZER_KWARGS = ("padding", "padding_side", "add_special_tokens", "truncation", "max_length")


def patch_image_processor(processor: Any) -> None:
    """Make ``processor.image_processor`` ignore tokenizer kwargs (mlx-vlm#870 on transformers 5)."""
    ip = getattr(processor, "image_processor", None)
    if ip is None or getattr(type(ip), "_mlxd_patched", False):
        return
    base = type(ip)
    original = base.__call__

    def __call__(self: Any, images: Any, *args: Any, **kwargs: Any) -> Any:
        for key in _TOKENIZER_KWARGS:
            kwargs.pop(key, None)
        return original(self, images, *args, **kwargs)

    ip.__class__ = type(base.__name__, (base,), {"__call__": __call__, "_mlxd_patched": True})


class MlxVisionEngine(MlxTextEngine):
    """One residency of an mlx-vlm model (see the module docstring)."""

    kind = "vision"

    def __init__(
        self,
        model: ModelConfig,
        *,
        prefill_step: int | None = None,
        observer: Observer | None = None,
        faults: Faults | None = None,
    ) -> None:
        super().__init__(model, prefill_step=prefill_step, observer=observer, faults=faults)
        # owned by the MLX thread
        self._processor: Any = None
        #: image decoding, one request at a time (each can be tens of megapixels)
        self._decoding = trio.CapacityLimiter(1)

    def _allow_patterns(self) -> tuple[str, ...]:
        return sources.VISION_PATTERNS

    def _load_weights(self, path: Path) -> tuple[Any, Any]:
        try:
            load: Any = importlib.import_module("mlx_vlm").load
        except ImportError as e:
            raise LoadFailed(
                f"{self.name}: mllm models need the vlm extra (pip install 'mlxd[vlm]'): {e}"
            ) from e
        model, processor = load(str(path))
        patch_image_processor(processor)
        tokenizer = getattr(processor, "tokenizer", processor)
        self._processor = processor
        self._has_chat_template = bool(
            getattr(processor, "chat_template", None) or getattr(tokenizer, "chat_template", None)
        )
        return model, tokenizer

    def _unload_extra(self) -> None:
        self._processor = None

    def _validate(self, request: GenerationRequest) -> None:
        self._validate_common(request)
        if uses_tools(request):
            raise ToolsNotSupported(
                f"model '{self.name}' (a vision model) does not take tools", param="tools"
            )
        if request.constraint is not None:
            raise InvalidRequest(
                f"response_format: model '{self.name}' (a vision model) only writes text",
                param="response_format",
            )
        if request.logprobs is not None:
            raise InvalidRequest(
                f"logprobs: model '{self.name}' (a vision model) does not report them",
                param="logprobs",
            )
        if request.kind != "chat" and request.images:
            raise InvalidRequest(
                "images need a chat request (image_url content parts)", param="prompt"
            )

    async def prepare(self, request: GenerationRequest) -> GenerationRequest:
        """Validate, and bound the prompt by its length; mlx-vlm tokenizes it with its images."""
        if not self._ready:
            raise EngineError(f"{self.name}: the model is not loaded", retry_after=1.0)
        self._validate(request)
        prompt_limits.check_prompt_chars(self.name, request, self.limits)
        return request

    async def count_tokens(self, request: GenerationRequest) -> int:
        """Text tokens of the prompt (images count as their placeholder tokens)."""
        request = await self.prepare(request)
        prompt = self._prompt(request, count_image_parts(request.messages) + len(request.images))
        tok = getattr(self._processor, "tokenizer", self._processor)
        return len(tok.encode(prompt))

    async def _job_data(self, request: GenerationRequest) -> Any:
        if not request.images and not count_image_parts(request.messages):
            return []
        from mlxd.engines.text.images import decode_request_images

        # Under the request's admission (its lease, the queue check), one decode at a time.
        return await trio.to_thread.run_sync(
            lambda: decode_request_images(
                request.messages, request.images, image_dir=self.config.image_dir
            ),
            limiter=self._decoding,
        )

    # ---- on the MLX thread --------------------------------------------------------------------

    def _prompt(self, request: GenerationRequest, n_images: int) -> str:
        if request.kind != "chat":
            prompt = request.prompt or ""
            if not prompt:
                raise InvalidRequest("the prompt is empty", param="prompt")
            return prompt
        from mlx_vlm.prompt_utils import apply_chat_template

        messages = [{"role": m.role, "content": m.content} for m in request.messages]
        if not any(message_text(m) for m in request.messages) and n_images == 0:
            raise InvalidRequest("the prompt is empty", param="messages")
        try:
            return str(
                apply_chat_template(
                    self._processor, self._model.config, messages, num_images=n_images
                )
            )
        except Exception as e:
            raise InvalidRequest(
                f"the chat template rejected the messages: {e}", param="messages"
            ) from e

    def _generate_on_thread(self, job: Job) -> None:
        stream_generate: Any = importlib.import_module("mlx_vlm").stream_generate

        req, st = job.request, job.stats
        images = list(job.data or [])
        prompt = self._prompt(req, len(images))
        seed_rng(req.seed)
        out = self._output(req)  # no logprobs, no tools: _validate refused them
        gen = stream_generate(
            self._model,
            self._processor,
            prompt,
            image=images or None,
            max_tokens=req.max_tokens,
            temperature=max(0.0, req.temperature),
            top_p=req.top_p if 0.0 < req.top_p < 1.0 else 1.0,
            prefill_step_size=self.prefill_step,
        )
        try:
            for r in gen:
                if st.first_token_at is None:
                    st.prompt_tokens = int(r.prompt_tokens)
                if self._on_token(
                    job, out, r.text, int(r.token or 0), None, int(r.generation_tokens),
                    r.finish_reason,
                ):
                    return
        finally:
            gen.close()
