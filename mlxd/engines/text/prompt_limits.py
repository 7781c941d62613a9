"""How long a prompt may be: the model's context, the configured cap, and the checks.

Theory of operation. A request's prompt is checked twice, both times before
any generation work:

1. **Before the lease** (:func:`check_prompt_chars`, called by the HTTP layer
   right after validation): a cheap bound with no tokenizer. A token covers at
   most :data:`MAX_CHARS_PER_TOKEN` characters of text in practice, so a prompt
   with more than ``limit x MAX_CHARS_PER_TOKEN`` characters certainly has more
   than ``limit`` tokens. Such a prompt (a 30 MB one, say) is a 400
   ``context_length_exceeded`` at once: no model is loaded or evicted for it,
   and nothing tokenizes it.
2. **After the lease, before generation** (the engine's ``prepare``): the
   prompt is tokenized on a worker thread (not the model's MLX thread, so the
   model keeps serving; the wait is cancellable, and the work is bounded by
   check 1) and :func:`fit_prompt_tokens` compares the exact count:
   ``prompt_tokens > max_prompt_tokens``, or a prompt that fills the context,
   is a 400 ``context_length_exceeded``; a ``max_tokens`` past what the context
   leaves after the prompt is lowered to it (agents such as Claude Code send
   ``max_tokens: 32000`` whatever the model, and local servers answer them).

The context comes from the model's ``config.json`` (:func:`context_length`):
``max_position_embeddings`` and the names other architectures use for it,
at the top level or in ``text_config``; with a YaRN-style ``rope_scaling``
whose ``original_max_position_embeddings`` equals it, times the factor. The
cap is the model's ``max_prompt_tokens`` (config); without one it is the
context, and without either :data:`DEFAULT_MAX_PROMPT_TOKENS`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from mlxd.config import ModelConfig
from mlxd.engines.base import GenerationRequest
from mlxd.errors import ContextLengthExceeded

#: the prompt cap of a model whose config.json states no context and whose config no cap
DEFAULT_MAX_PROMPT_TOKENS = 131_072
#: characters one token may stand for, for the tokenizer-free bound (English averages ~4,
#: code ~3; long runs of spaces or punctuation can merge further, but not 16 on average)
MAX_CHARS_PER_TOKEN = 16
#: the keys architectures use for their context length, in order of preference
CONTEXT_KEYS = (
    "max_position_embeddings",
    "max_sequence_length",
    "max_seq_len",
    "seq_length",
    "n_positions",
    "n_ctx",
)


@dataclass(frozen=True, slots=True)
class PromptLimits:
    """What one model accepts: its context (None: unknown) and its prompt cap in tokens."""

    context: int | None
    max_prompt_tokens: int

    @property
    def max_prompt_chars(self) -> int:
        return self.max_prompt_tokens * MAX_CHARS_PER_TOKEN


def context_from_config(cfg: dict[str, Any]) -> int | None:
    """The context length a model's parsed ``config.json`` states, or None."""
    for section in (cfg, cfg.get("text_config"), cfg.get("llm_config")):
        if not isinstance(section, dict):
            continue
        for key in CONTEXT_KEYS:
            value = section.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value * _rope_factor(section, value)
    return None


def _rope_factor(section: dict[str, Any], positions: int) -> int:
    scaling = section.get("rope_scaling")
    if not isinstance(scaling, dict):
        return 1
    factor = scaling.get("factor")
    if scaling.get("original_max_position_embeddings") != positions:
        return 1  # the stated length is already the scaled one (llama3, deepseek...)
    if not isinstance(factor, (int, float)) or isinstance(factor, bool) or factor <= 1:
        return 1
    return int(factor)


def context_length(model_dir: Path) -> int | None:
    """The context of the model in ``model_dir`` (from its ``config.json``), or None."""
    file = model_dir / "config.json"
    try:
        mtime = file.stat().st_mtime_ns
    except OSError:
        return None
    return _context_cached(str(file), mtime)


@lru_cache(maxsize=256)
def _context_cached(file: str, mtime_ns: int) -> int | None:
    try:
        cfg = json.loads(Path(file).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return context_from_config(cfg) if isinstance(cfg, dict) else None


def model_dir_if_known(model: ModelConfig) -> Path | None:
    """The model's directory when it is on disk already (local, or in the Hugging Face cache)."""
    if not model.engine_kind.weights:
        return None
    path = Path(model.source).expanduser()
    if path.is_dir():
        return path
    if model.source_kind == "local":
        return None
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(model.source, "config.json")
    except Exception:  # an odd repo id or cache layout: the cap alone applies
        return None
    return Path(found).parent if isinstance(found, str) else None


def limits_of(model: ModelConfig, context: int | None) -> PromptLimits:
    """The limits of ``model`` given its context (None: unknown)."""
    cap = model.max_prompt_tokens
    if cap is None:
        cap = context if context is not None else DEFAULT_MAX_PROMPT_TOKENS
    elif context is not None:
        cap = min(cap, context)
    return PromptLimits(context=context, max_prompt_tokens=cap)


def limits_for(model: ModelConfig) -> PromptLimits:
    """The limits of ``model`` as far as they are known without loading it."""
    where = model_dir_if_known(model)
    return limits_of(model, context_length(where) if where is not None else None)


def prompt_chars(request: GenerationRequest) -> int:
    """Characters of text in the prompt (the chat template adds more, never fewer tokens),
    the declared tools included: the template writes them into the prompt."""
    if request.kind == "completion":
        return len(request.prompt or "")
    total = sum(len(t.name) + len(t.description or "") + len(json.dumps(t.parameters))
                for t in request.tools)
    for m in request.messages:
        if isinstance(m.content, str):
            total += len(m.content)
        else:
            total += sum(len(str(p.get("text", ""))) for p in m.content if p.get("type") == "text")
    return total


def _param(request: GenerationRequest) -> str:
    return "messages" if request.kind == "chat" else "prompt"


def check_prompt_chars(model: str, request: GenerationRequest, limits: PromptLimits) -> None:
    """Refuse a prompt too long to fit by its length alone (check 1 of the module docstring)."""
    check_chars(model, prompt_chars(request), limits, _param(request))


def check_chars(model: str, chars: int, limits: PromptLimits, param: str) -> None:
    """Refuse ``chars`` characters of prompt text if they cannot fit in ``limits``."""
    if chars > limits.max_prompt_chars:
        raise ContextLengthExceeded(
            f"the prompt has {chars:,} characters, more than the {limits.max_prompt_tokens:,} "
            f"tokens model '{model}' accepts can hold (at most {MAX_CHARS_PER_TOKEN} characters "
            "a token)",
            param=param,
        )


def fit_prompt_tokens(
    model: str, request: GenerationRequest, prompt_tokens: int, limits: PromptLimits
) -> int:
    """The ``max_tokens`` the request runs with: a tokenized prompt over the cap, or one that
    leaves the context no room for a token, is refused; a ``max_tokens`` past what the context
    leaves is lowered to it (the answer then ends ``length`` there, as at any limit)."""
    if prompt_tokens > limits.max_prompt_tokens:
        raise ContextLengthExceeded(
            f"the prompt has {prompt_tokens:,} tokens; model '{model}' accepts at most "
            f"{limits.max_prompt_tokens:,}",
            param=_param(request),
        )
    context = limits.context
    if context is None:
        return request.max_tokens
    if prompt_tokens >= context:
        raise ContextLengthExceeded(
            f"model '{model}' has a context of {context:,} tokens; the prompt has "
            f"{prompt_tokens:,}, which leaves no room to answer: shorten the prompt",
            param=_param(request),
        )
    return min(request.max_tokens, context - prompt_tokens)
