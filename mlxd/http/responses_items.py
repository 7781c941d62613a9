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
from mlxd.http.fields import Text, bad
from mlxd.http.shapes import AnyOf, Array, Obj, Tagged
from mlxd.http.structured import ARGUMENTS, NAME, arguments_text

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
TEXT_PARTS = ("input_text", "output_text")


_TEXT = Obj({"text": Text()}, required=("text",))
_IMAGE = Obj({"image_url": Text(1, hint="must be a data URL or a file name in the model's image_dir "
                                       "(file_id is not supported)")},
             required=("image_url",), notes={"image_url": "a data URL, or a file in the model's image_dir"})


def _message(role: str, parts: dict[str, Obj]) -> Obj:
    kind = Tagged("type", parts, expected=f"one of {', '.join(parts)} in a {role} message")
    return Obj({"content": AnyOf((Text(), Array(kind)), hint="must be a string or a list of content parts")},
               required=("content",))


def item_kind(*, images: bool = True, calls: bool = True) -> Tagged:
    """One input item; the document's variants for models without images or function tools
    leave them out."""
    text = dict.fromkeys(TEXT_PARTS, _TEXT)
    user = {**text, "input_image": _IMAGE} if images else text
    roles = {"user": _message("user", user),
             "assistant": _message("assistant", {**text, "refusal": Obj({"refusal": Text()},
                                                                      required=("refusal",))}),
             **{role: _message(role, text) for role in ("system", "developer")}}
    outputs = Array(Tagged("type", text, expected="input_text (a local model reads text results only)"))
    items: dict[str, Obj | Tagged] = {
        "message": Tagged("role", roles, expected=f"one of {', '.join(ROLES)}"),
        "function_call_output": Obj({"call_id": Text(1), "output": AnyOf(
            (Text(), outputs), hint="must be a string or a list of input_text parts")},
            required=("call_id", "output")),
    }
    if calls:
        items["function_call"] = Obj({"call_id": Text(1), "name": NAME, "arguments": ARGUMENTS},
                                     required=("call_id", "name", "arguments"))
    return Tagged("type", {**items, **dict.fromkeys(sorted(LEFT_OUT), Obj({}))}, default="message",
                  hint="must be an object (an input item with a 'type')",
                  expected="one of message, function_call, function_call_output, reasoning or a "
                  "built-in tool's call",
                  refused={"item_reference": "item_reference is not supported: send the item itself "
                           "(or continue a stored response with previous_response_id)"})


def input_kind(*, images: bool = True, calls: bool = True) -> AnyOf:
    """A request's ``input``: a string (one user message) or items."""
    return AnyOf((Text(), Array(item_kind(images=images, calls=calls), max_items=MAX_ITEMS)),
                 hint=f"must be a string or a list of at most {MAX_ITEMS:,} input items")


def input_items(v: str | list[dict[str, Any]], *, allow_images: bool, param: str = "input") -> list[dict[str, Any]]:
    """The request's ``input`` (checked against :func:`input_kind`), canonical (a string is one
    user message)."""
    if isinstance(v, str):
        return [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": v}]}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(v):
        kind = item.get("type", "message")
        if kind == "message":
            out.append(_canonical_message(item, f"{param}[{i}]", allow_images=allow_images))
        elif kind == "function_call":
            out.append({"type": "function_call", "call_id": item["call_id"], "name": item["name"],
                        "arguments": arguments_text(item["arguments"], f"{param}[{i}].arguments")})
        elif kind == "function_call_output":
            output = item["output"]
            out.append({"type": "function_call_output", "call_id": item["call_id"],
                        "output": output if isinstance(output, str) else "".join(p["text"] for p in output)})
    return out


def _canonical_message(v: dict[str, Any], p: str, *, allow_images: bool) -> dict[str, Any]:
    role, content = v["role"], v["content"]
    text_type = "output_text" if role == "assistant" else "input_text"
    if isinstance(content, str):
        return {"type": "message", "role": role, "content": [{"type": text_type, "text": content}]}
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        if part["type"] != "input_image":
            parts.append({"type": text_type, "text": part["refusal" if part["type"] == "refusal" else "text"]})
        elif not allow_images:
            raise bad(f"{p}.content[{j}]", "image parts are only accepted by vision (mllm) models")
        else:
            parts.append({"type": "input_image", "image_url": part["image_url"]})
    return {"type": "message", "role": role, "content": parts}


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
