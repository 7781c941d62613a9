"""What a text model reads: the messages through its chat template (tools included), as token ids.

No MLX: the engine's ``prepare`` runs these on the Trio thread or a worker
thread (:func:`tokenize` sends a long prompt to one), never on the MLX thread. :func:`check_tools` is the one rule
for tools: a request that uses them (declares tools it may call, or carries
earlier calls in its history) needs a chat template with tool support, and
``tool_choice`` ``required`` or a named function needs a tool-call format that
constrained decoding can enforce.
"""

from __future__ import annotations

import contextlib
import json
import weakref
from functools import partial
from typing import Any

import trio

from mlxd.engines.base import ChatMessage, GenerationRequest, ThinkMarkers
from mlxd.engines.text import prompt_limits
from mlxd.engines.text.tool_calls import ToolFormat
from mlxd.errors import InvalidRequest, ToolsNotSupported

#: the tool-call formats mlxd can enforce: mlx-lm's ``json_tools`` parser family
#: (Hermes / Qwen 2.5 style ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``)
ENFORCEABLE_TOOL_FORMATS = ("json_tools",)
#: prompts up to this many characters are tokenized on the Trio thread (in about a
#: millisecond), longer ones on a worker thread; so short requests keep their arrival order
INLINE_TOKENIZE_CHARS = 1024


def message_text(message: ChatMessage) -> str:
    """The text of a chat message (plain string, or the ``text`` content parts joined)."""
    if isinstance(message.content, str):
        return message.content
    return "".join(str(p.get("text", "")) for p in message.content if p.get("type") == "text")


def count_image_parts(messages: tuple[ChatMessage, ...]) -> int:
    return sum(
        1
        for m in messages
        if not isinstance(m.content, str)
        for p in m.content
        if p.get("type") in ("image_url", "image", "input_image")
    )


def uses_tools(request: GenerationRequest) -> bool:
    """Whether ``request`` declares tools the model may call or has tool calls in its history."""
    return (bool(request.tools) and request.tool_choice != "none") or any(
        m.tool_calls for m in request.messages
    )


def check_tools(model: str, request: GenerationRequest, tools: ToolFormat | None) -> None:
    """Refuse tools a model cannot take (see the module docstring); ``tools``: its format."""
    if uses_tools(request) and tools is None:
        raise ToolsNotSupported(
            f"model '{model}' has no tool support in its chat template", param="tools"
        )
    c = request.constraint
    enforced = c is not None and c.kind == "tool_call"
    if enforced and tools is not None and tools.name not in ENFORCEABLE_TOOL_FORMATS:
        raise InvalidRequest(
            f"tool_choice: model '{model}' writes tool calls in the "
            f"'{tools.name}' format, which mlxd cannot enforce; use 'auto'",
            param="tool_choice",
        )


def think_markers(tokenizer: Any, request: GenerationRequest, ids: Any) -> ThinkMarkers | None:
    """A chat prompt's thinking markers when the model has them (mlx-lm's tokenizer wrapper finds
    them in the vocabulary), and whether the prompt left a thinking block open."""
    if request.kind != "chat" or not getattr(tokenizer, "has_thinking", False):
        return None
    start, end = tokenizer.think_start, tokenizer.think_end
    if not isinstance(start, str) or not isinstance(end, str):
        return None
    ids = list(ids)
    opened = tokenizer.rfind_think_start(ids) > tokenizer.rfind_think_end(ids)
    return ThinkMarkers(start, end, bool(opened))


def template_message(m: ChatMessage) -> dict[str, Any]:
    """A chat message as chat templates take it (tool calls with their arguments as objects)."""
    out: dict[str, Any] = {"role": m.role, "content": message_text(m)}
    if m.tool_calls:
        out["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.name, "arguments": json.loads(c.arguments)},
            }
            for c in m.tool_calls
        ]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.name is not None:
        out["name"] = m.name
    return out


#: per tokenizer, the Rust core that encodes a short text in its place, or None (in_place_core)
_CORES: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def in_place_core(tokenizer: Any) -> Any:
    """The fast tokenizer's Rust core (``tokenizers.Tokenizer``) that :func:`encode_prompt`
    uses for a short prompt on the Trio thread, if it gives the same ids as the tokenizer's
    own ``encode`` on probe texts (its special tokens included); else None.

    transformers encodes one text as a batch of one (``encode_batch``), which lets go of
    the GIL; the Trio thread then waits to take it back from the MLX thread, mid-step:
    measured here, 5.2 ms a call while another thread runs Python, against 80 us for the
    core's ``encode``, which keeps the GIL (a long prompt goes to a worker thread, where
    letting go is right, and keeps the tokenizer's own ``encode``).
    """
    with contextlib.suppress(KeyError, TypeError):
        return _CORES[tokenizer]
    import tokenizers  # with the model's tokenizer, not with the CLI

    core: Any = tokenizer
    for _ in range(3):  # mlx-lm's wrapper holds transformers' tokenizer, which holds the core
        if core is None or isinstance(core, tokenizers.Tokenizer):
            break
        core = getattr(core, "_tokenizer", None)
    if not isinstance(core, tokenizers.Tokenizer):
        core = None
    else:
        special = " ".join(str(t) for t in getattr(tokenizer, "all_special_tokens", ()) or ())
        probes = ("Hello, world!\n", f"{special} a {special}b\t\n  c", "é 🙂 数字 123 ", "")
        try:
            same = all(
                _core_encode(core, t, a) == _own_encode(tokenizer, t, a)
                for t in probes
                for a in (True, False)
            )
        except Exception:  # a tokenizer that fails on a probe: its own encode, as before
            same = False
        core = core if same else None
    with contextlib.suppress(TypeError):  # not weakly referenceable: decided again next time
        _CORES[tokenizer] = core  # the core does not refer back to the tokenizer's wrapper
    return core


def _own_encode(tokenizer: Any, text: str, add_special: bool) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=add_special))


def _core_encode(core: Any, text: str, add_special: bool) -> list[int]:
    return list(core.encode(text, add_special_tokens=add_special).ids)


def encode_prompt(tokenizer: Any, request: GenerationRequest, *, in_place: bool = False) -> list[int]:
    """The prompt token ids, exactly as ``mlx_lm.stream_generate`` encodes a string prompt;
    ``in_place``: a short prompt, encoded on the Trio thread (:func:`in_place_core`)."""
    if request.kind == "chat":
        messages = [template_message(m) for m in request.messages]
        extra: dict[str, Any] = {}
        if request.tools and request.tool_choice != "none":
            extra["tools"] = [t.as_openai() for t in request.tools]
        if request.thinking is not None:
            extra["enable_thinking"] = request.thinking
        try:
            prompt = tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False, **extra
            )
        except Exception as e:  # jinja errors: roles out of order, unsupported role, ...
            raise InvalidRequest(
                f"the chat template rejected the messages: {e}", param="messages"
            ) from e
    else:
        prompt = request.prompt or ""
    add_special = tokenizer.bos_token is None or not prompt.startswith(tokenizer.bos_token)
    core = in_place_core(tokenizer) if in_place else None
    if core is not None:
        ids = _core_encode(core, prompt, add_special)
    else:
        ids = _own_encode(tokenizer, prompt, add_special)
    if not ids:
        raise InvalidRequest(
            "the prompt is empty",
            param="prompt" if request.kind == "completion" else "messages",
        )
    return ids


async def tokenize(
    model: str, tokenizer: Any, request: GenerationRequest, vocab_size: int | None,
    limits: prompt_limits.PromptLimits,
) -> list[int] | tuple[int, ...]:
    """The prompt's token ids: ``prompt_ids`` checked against the vocabulary, or the prompt
    encoded (a long one on a worker thread, once its length is within the limits)."""
    if request.prompt_ids is not None:
        ids = request.prompt_ids
        vocab = vocab_size or 1 << 62
        if not ids or not all(0 <= t < vocab for t in ids):  # MLX crashes on an id out of range
            raise InvalidRequest(
                f"prompt token ids must be a non-empty list of ids below {vocab:,}",
                param="prompt",
            )
        return ids
    if prompt_limits.prompt_chars(request) <= INLINE_TOKENIZE_CHARS:
        return encode_prompt(tokenizer, request, in_place=True)  # not worth a thread
    prompt_limits.check_prompt_chars(model, request, limits)
    # the tokenizer is read-only once loaded; the work is bounded by the check above
    return await trio.to_thread.run_sync(
        partial(encode_prompt, tokenizer, request), abandon_on_cancel=True
    )
