"""Responses API items: the ``input`` of ``POST /v1/responses``, and the chat a model reads from them.

An input is a string (one user message) or a list of items; each is checked
and written in a canonical form, which is what a stored response keeps (so
a conversation continued with ``previous_response_id`` is read back without
the client's extra fields):

- ``message`` (``type`` may be left out, as OpenAI's "easy" input message):
  roles ``user``, ``assistant``, ``system``, ``developer``; content a string
  or parts ``input_text`` / ``output_text`` (any role), ``refusal``
  (assistant), ``input_image`` (user messages, ``mllm`` models only:
  ``image_url`` a data URL or a file in the model's ``image_dir``);
- ``function_call`` (``call_id``, ``name``, ``arguments`` JSON text of an
  object) and ``function_call_output`` (``call_id``, ``output`` a string or
  text parts);
- items a local model has nothing to read in (:data:`LEFT_OUT`: ``reasoning``,
  whose encrypted content only OpenAI can decrypt, and the calls of built-in
  tools mlxd does not run) are accepted and left out of the prompt.

Any other item or part type is a 400 naming it (``input[3].type``).

:func:`chat_messages` turns canonical items into the chat the model's
template reads: ``instructions`` and every ``system`` / ``developer`` message,
in order, make one system message at the start (templates take one system
prompt, first); a ``function_call`` joins the assistant message just before
it (else starts one), a ``function_call_output`` is a ``tool`` message.
"""

from __future__ import annotations

from typing import Any

from mlxd.engines.base import ChatMessage, ToolCall
from mlxd.http.fields import bad
from mlxd.http.structured import arguments_text, function_name

#: items in one request's input, and in a whole conversation (previous responses included)
MAX_ITEMS = 10_000
ROLES = ("user", "assistant", "system", "developer")
#: item types accepted and left out of the prompt (see the module docstring)
LEFT_OUT = frozenset({
    "reasoning", "web_search_call", "file_search_call", "computer_call", "computer_call_output",
    "code_interpreter_call", "image_generation_call", "local_shell_call", "local_shell_call_output",
    "shell_call", "shell_call_output", "apply_patch_call", "apply_patch_call_output",
    "mcp_list_tools", "mcp_approval_request", "mcp_approval_response", "mcp_call",
    "custom_tool_call", "custom_tool_call_output", "tool_search_call", "tool_search_output",
    "compaction",
})
ITEM_TYPES = ("message", "function_call", "function_call_output", *sorted(LEFT_OUT))
TEXT_PARTS = ("input_text", "output_text")


def input_items(v: object, *, allow_images: bool, param: str = "input") -> list[dict[str, Any]]:
    """The request's ``input``, canonical (a string is one user message)."""
    if isinstance(v, str):
        return [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": v}]}]
    if not isinstance(v, list):
        raise bad(param, "must be a string or a list of input items")
    if len(v) > MAX_ITEMS:
        raise bad(param, f"has {len(v):,} items; at most {MAX_ITEMS:,}")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(v):
        canonical = _item(item, f"{param}[{i}]", allow_images=allow_images)
        if canonical is not None:
            out.append(canonical)
    return out


def _item(v: object, p: str, *, allow_images: bool) -> dict[str, Any] | None:
    if not isinstance(v, dict):
        raise bad(p, "must be an object (an input item with a 'type')")
    kind = v.get("type", "message" if "role" in v else None)
    if kind == "message":
        return _message(v, p, allow_images=allow_images)
    if kind == "function_call":
        call_id = _id(v.get("call_id"), f"{p}.call_id")
        name = function_name(v.get("name"), f"{p}.name")
        return {"type": "function_call", "call_id": call_id, "name": name,
                "arguments": arguments_text(v.get("arguments"), f"{p}.arguments")}
    if kind == "function_call_output":
        return {"type": "function_call_output", "call_id": _id(v.get("call_id"), f"{p}.call_id"),
                "output": _output_text(v.get("output"), f"{p}.output")}
    if isinstance(kind, str) and kind in LEFT_OUT:
        return None
    if kind == "item_reference":
        raise bad(f"{p}.type", "item_reference is not supported: send the item itself "
                  "(or continue a stored response with previous_response_id)")
    shown = repr(kind)[:60] if kind is not None else "none"
    raise bad(f"{p}.type", f"must be one of message, function_call, function_call_output, "
              f"reasoning or a built-in tool's call (got {shown})")


def _id(v: object, p: str) -> str:
    if not isinstance(v, str) or not v:
        raise bad(p, "must be a non-empty string")
    return v


def _message(v: dict[str, Any], p: str, *, allow_images: bool) -> dict[str, Any]:
    role = v.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise bad(f"{p}.role", f"must be one of {', '.join(ROLES)}")
    text_type = "output_text" if role == "assistant" else "input_text"
    content = v.get("content")
    if isinstance(content, str):
        return {"type": "message", "role": role, "content": [{"type": text_type, "text": content}]}
    if not isinstance(content, list):
        raise bad(f"{p}.content", "must be a string or a list of content parts")
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        q = f"{p}.content[{j}]"
        if not isinstance(part, dict):
            raise bad(q, "must be an object with a 'type'")
        kind = part.get("type")
        if kind in TEXT_PARTS or (kind == "refusal" and role == "assistant"):
            key = "refusal" if kind == "refusal" else "text"
            if not isinstance(part.get(key), str):
                raise bad(f"{q}.{key}", "must be a string")
            parts.append({"type": text_type, "text": part[key]})
        elif kind == "input_image" and role == "user":
            if not allow_images:
                raise bad(q, "image parts are only accepted by vision (mllm) models")
            url = part.get("image_url")
            if not isinstance(url, str) or not url:
                raise bad(f"{q}.image_url", "must be a data URL or a file name in the model's "
                          "image_dir (file_id is not supported)")
            parts.append({"type": "input_image", "image_url": url})
        else:
            allowed = "input_text, output_text, refusal" if role == "assistant" else (
                "input_text, output_text, input_image" if role == "user" else "input_text, output_text")
            raise bad(f"{q}.type", f"must be one of {allowed} in a {role} message "
                      f"(got {repr(kind)[:60]})")
    return {"type": "message", "role": role, "content": parts}


def _output_text(v: object, p: str) -> str:
    """A function_call_output's ``output``: a string, or text parts joined."""
    if isinstance(v, str):
        return v
    if not isinstance(v, list):
        raise bad(p, "must be a string or a list of input_text parts")
    out: list[str] = []
    for j, part in enumerate(v):
        if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS:
            raise bad(f"{p}[{j}].type", "must be input_text (a local model reads text results only)")
        if not isinstance(part.get("text"), str):
            raise bad(f"{p}[{j}].text", "must be a string")
        out.append(part["text"])
    return "".join(out)


def message_text(item: dict[str, Any]) -> str:
    """The text parts of a canonical message item, joined."""
    return "".join(str(p["text"]) for p in item["content"] if p["type"] in TEXT_PARTS)


def chat_messages(instructions: str | None, items: list[dict[str, Any]]) -> tuple[ChatMessage, ...]:
    """The chat a template reads from canonical items (see the module docstring)."""
    system = [instructions] if instructions else []
    out: list[ChatMessage] = []
    for item in items:
        kind = item["type"]
        if kind == "function_call":
            call = ToolCall(item["call_id"], item["name"], item["arguments"])
            last = out[-1] if out else None
            if last is not None and last.role == "assistant":
                out[-1] = ChatMessage("assistant", last.content, (*last.tool_calls, call))
            else:
                out.append(ChatMessage("assistant", "", (call,)))
        elif kind == "function_call_output":
            out.append(ChatMessage("tool", item["output"], tool_call_id=item["call_id"]))
        elif item["role"] in ("system", "developer"):
            system.append(message_text(item))
        elif any(p["type"] == "input_image" for p in item["content"]):
            parts = [{"type": "image_url", "image_url": {"url": p["image_url"]}}
                     if p["type"] == "input_image" else {"type": "text", "text": p["text"]}
                     for p in item["content"]]
            out.append(ChatMessage(item["role"], parts))
        else:
            out.append(ChatMessage(item["role"], message_text(item)))
    if system:
        out.insert(0, ChatMessage("system", "\n\n".join(system)))
    return tuple(out)
