"""What a text model reads: the messages through its chat template (tools included), as token ids.

Pure (no MLX): the engine's ``prepare`` runs these on the Trio thread or a
worker thread, never on the MLX thread. :func:`check_tools` is the one rule
for tools: a request that uses them (declares tools it may call, or carries
earlier calls in its history) needs a chat template with tool support, and
``tool_choice`` ``required`` or a named function needs a tool-call format that
constrained decoding can enforce.
"""

from __future__ import annotations

import json
from typing import Any

from mlxd.engines.base import ChatMessage, GenerationRequest
from mlxd.engines.tool_calls import ToolFormat
from mlxd.errors import InvalidRequest, ToolsNotSupported

#: the tool-call formats mlxd can enforce: mlx-lm's ``json_tools`` parser family
#: (Hermes / Qwen 2.5 style ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``)
ENFORCEABLE_TOOL_FORMATS = ("json_tools",)


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


def encode_prompt(tokenizer: Any, request: GenerationRequest) -> list[int]:
    """The prompt token ids, exactly as ``mlx_lm.stream_generate`` encodes a string prompt."""
    if request.kind == "chat":
        messages = [template_message(m) for m in request.messages]
        extra: dict[str, Any] = {}
        if request.tools and request.tool_choice != "none":
            extra["tools"] = [t.as_openai() for t in request.tools]
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
    ids = list(tokenizer.encode(prompt, add_special_tokens=add_special))
    if not ids:
        raise InvalidRequest(
            "the prompt is empty",
            param="prompt" if request.kind == "completion" else "messages",
        )
    return ids
