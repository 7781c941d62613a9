"""Anthropic Messages: request bodies into engine requests, and the response shapes.

Validation follows :mod:`mlxd.http.validation`: every problem is an
:class:`~mlxd.errors.InvalidRequest` whose ``param`` names the field
(``messages[1].content[0].type``); the one error handler renders it in
Anthropic's envelope on these routes. Content blocks: ``text``,
``tool_use`` and ``thinking`` / ``redacted_thinking`` (assistant; earlier
thinking is dropped, as chat templates drop it), ``tool_result`` (user); any
other block type is a 400 naming it; ``cache_control`` on any block is
accepted. ``system`` is a string or text blocks; ``system`` and ``developer``
messages inside ``messages`` join it, in order. ``top_k`` is accepted and not
used; the other newer fields are read by :mod:`mlxd.http.anthropic_fields`.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from mlxd.engines.base import (
    ChatMessage,
    Finished,
    FinishReason,
    GenerationRequest,
    TextDelta,
    ThinkMarkers,
    ToolCall,
    ToolCallDelta,
)
from mlxd.errors import InvalidRequest, MlxdError
from mlxd.http import anthropic_fields, sse
from mlxd.http.bodies_anthropic import (
    AnthropicError,
    AnthropicMessage,
    AnthropicUsage,
    ContentBlock,
    MessageEvent,
    StartedMessage,
    StopReason,
    TextBlockDelta,
    ThinkingBlockDelta,
)
from mlxd.http.bodies_openai import cached_tokens
from mlxd.http.fields import Boolean, Integer, Kind, Number, Stops, Text, bad, read
from mlxd.http.generation import Collected
from mlxd.http.shapes import AnyOf, Array, Const, Obj, Tagged, check
from mlxd.http.structured import (
    ARGUMENTS,
    MAX_TOOLS,
    NAME,
    OBJECT_SCHEMA,
    ToolChoice,
    arguments_text,
    constraint,
    is_model_name,
    make_tool,
    named_tool,
)
from mlxd.http.thinking import ThinkingSplitter, split_whole
from mlxd.http.validation import MAX_TOKENS_LIMIT

MAX_STOP_SEQUENCES = 16
ROLES = ("user", "assistant")

#: HTTP status -> Anthropic error type
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
               503: "overloaded_error", 529: "overloaded_error"}
STOP_REASONS: dict[FinishReason, StopReason] = {"stop": "end_turn", "length": "max_tokens",
                                                "tool_calls": "tool_use"}
#: the signature of a thinking block: clients keep it and send it back; mlxd does not check it
SIGNATURE = "mlxd"


def error_body(err: MlxdError) -> AnthropicError:
    """Anthropic's error envelope (``{"type": "error", "error": {"type", "message"}}``)."""
    kind = ERROR_TYPES.get(err.http_status, "api_error" if err.http_status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": err.message}}


@dataclass(frozen=True, slots=True)
class ParsedMessages:
    model: str
    generation: GenerationRequest
    stream: bool


#: ``max_tokens``: required (except when counting tokens)
MAX_TOKENS = Integer(1, MAX_TOKENS_LIMIT)
#: the optional scalar fields of a Messages body (read here, documented from this table)
FIELDS: dict[str, Kind] = {
    "temperature": Number(0, 1),
    "top_p": Number(0, 1),
    "top_k": Integer(0),
    "stream": Boolean(),
    "stop_sequences": Stops(MAX_STOP_SEQUENCES, one_string=False),
}


_TEXT = Obj({"text": Text()}, required=("text",))
#: ``system``, a system message's content, a tool result: a string or text blocks
TEXT_BLOCKS = AnyOf((Text(), Array(Tagged("type", {"text": _TEXT}))),
                    hint="must be a string or a list of text blocks")
_BLOCKS: dict[str, Obj | Tagged] = {
    "text": _TEXT,
    "tool_use": Obj({"id": Text(1), "name": NAME, "input": ARGUMENTS}, required=("id", "name", "input")),
    "thinking": Obj({"thinking": Text(), "signature": Text()}, required=("thinking",),
                    not_null=("signature",)),
    "redacted_thinking": Obj({"data": Text()}, not_null=("data",)),
    "tool_result": Obj({"tool_use_id": Text(1), "content": TEXT_BLOCKS, "is_error": Boolean()},
                       required=("tool_use_id",), not_null=("content",)),
}
#: the blocks of each role's turns; without tools (the document's variant), no tool blocks
_ROLE_BLOCKS = {"user": ("text", "tool_result"),
                "assistant": ("text", "tool_use", "thinking", "redacted_thinking")}
#: at least one user or assistant message (:func:`parse_messages`)
A_TURN = {"properties": {"messages": {"contains": {"properties": {"role": {"enum": list(ROLES)}}}}}}
#: 'any' and 'tool' need tools (:func:`_tool_choice`); a null tool_choice is no choice
FORCING_NEEDS_TOOLS = {
    "if": {"required": ["tool_choice"],
           "properties": {"tool_choice": {"type": "object", "required": ["type"],
                                          "properties": {"type": {"enum": ["any", "tool"]}}}}},
    "then": {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}},
}


def _turn(role: str, tools: bool) -> Obj:
    blocks = {b: _BLOCKS[b] for b in _ROLE_BLOCKS[role] if tools or not b.startswith("tool_")}
    other = "assistant" if role == "user" else "user"
    theirs = ", ".join(b for b in _ROLE_BLOCKS[other] if b not in blocks)
    kind = Tagged("type", blocks, expected=f"one of {', '.join(blocks)} in a {role} message "
                  f"({theirs} blocks belong in {other} messages)")
    return Obj({"content": AnyOf((Text(), Array(kind, min_items=1)),
                                 hint="must be a string or a non-empty list of content blocks")},
               required=("content",))


def body_kind(*, tools: bool = True, counting: bool = False) -> Obj:
    """A Messages body but its model (``counting``: a count_tokens body, no ``max_tokens``); the
    validator checks the variant with tools, the document shows one without for fake engines."""
    system = Obj({"content": TEXT_BLOCKS}, required=("content",))
    messages = Tagged("role", {"user": _turn("user", tools), "assistant": _turn("assistant", tools),
                               **dict.fromkeys(anthropic_fields.SYSTEM_ROLES, system)},
                      hint="must be an object with 'role' and 'content'",
                      expected="'user', 'assistant', 'system' or 'developer'")
    tool = Obj({"type": Const("custom"), "name": NAME, "description": Text(), "input_schema": OBJECT_SCHEMA},
               required=("name", "input_schema"), notes={"type": "only custom tools are served here"})
    choices = {"auto": Obj({}), "none": Obj({})}
    if tools:
        choices |= {"any": Obj({}), "tool": Obj({"name": NAME}, required=("name",))}
    return Obj({
        **({} if counting else {"max_tokens": MAX_TOKENS}),
        "messages": Array(messages, min_items=1, hint="must be a non-empty list"),
        "system": TEXT_BLOCKS,
        **FIELDS,
        **anthropic_fields.fields_kinds(grammar=tools),
        "tools": Array(tool, max_items=MAX_TOOLS if tools else 0,
                       hint=f'must be a list of at most {MAX_TOOLS} {{"name", "input_schema"}}'),
        "tool_choice": Tagged("type", choices),
    }, required=("messages",) if counting else ("max_tokens", "messages"),
        hint="the request body must be a JSON object", rules=(A_TURN, FORCING_NEEDS_TOOLS),
        notes={"messages": "system and developer messages join the system prompt, in order",
               "tool_choice": "'any' and 'tool' need tools; a named tool must be declared"})


BODY, COUNTING_BODY = body_kind(), body_kind(counting=True)


def _text_blocks(v: str | list[dict[str, Any]]) -> str:
    """A string, or text blocks joined (checked against :data:`TEXT_BLOCKS`)."""
    return v if isinstance(v, str) else "".join(b["text"] for b in v)


def _message(m: dict[str, Any], p: str) -> list[ChatMessage]:
    role, content = m["role"], m["content"]
    if isinstance(content, str):
        return [ChatMessage(role, content)]
    text: list[str] = []
    calls: list[ToolCall] = []
    results: list[ChatMessage] = []
    for j, b in enumerate(content):
        if b["type"] == "text":
            text.append(b["text"])
        elif b["type"] == "tool_use":
            calls.append(ToolCall(b["id"], b["name"], arguments_text(b["input"], f"{p}.content[{j}].input")))
        elif b["type"] == "tool_result":
            results.append(ChatMessage("tool", _text_blocks(b.get("content", "")), tool_call_id=b["tool_use_id"]))
    # a turn of thinking blocks only is still a turn (empty); tool results alone are not
    own = [ChatMessage(role, "".join(text), tuple(calls))] if text or calls or not results else []
    return [*results, *own]


def _tools(body: dict[str, Any]) -> tuple[Any, ...]:
    tools: list[Any] = []
    for i, t in enumerate(body.get("tools") or ()):
        if any(x.name == t["name"] for x in tools):
            raise bad(f"tools[{i}].name", f"'{t['name']}' is declared twice")
        tools.append(make_tool(t["name"], t.get("description"), t["input_schema"], f"tools[{i}]",
                               key="input_schema"))
    return tuple(tools)


def _tool_choice(body: dict[str, Any], tools: tuple[Any, ...]) -> tuple[ToolChoice, str | None]:
    v = body.get("tool_choice")
    if v is None:
        return "auto", None
    kind = v["type"]
    if kind in ("any", "tool") and not tools:
        raise bad("tool_choice", f"'{kind}' needs at least one tool in tools")
    if kind == "tool":
        return "function", named_tool(v["name"], tools, "tool_choice.name")
    return {"auto": "auto", "any": "required", "none": "none"}[kind], None  # type: ignore[return-value]


def parse_messages(body: object, *, request_id: str, counting: bool = False) -> ParsedMessages:
    """Validate a Messages body (``counting``: a count_tokens body, no max_tokens)."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    model = body.get("model")
    if not is_model_name(model):
        raise bad("model", "is required: a non-empty string")
    check(COUNTING_BODY if counting else BODY, body)
    messages: list[ChatMessage] = []
    system = [] if body.get("system") is None else [_text_blocks(body["system"])]
    for i, m in enumerate(body["messages"]):
        if anthropic_fields.is_system_role(m["role"]):
            system.append(_text_blocks(m["content"]))
            continue
        messages.extend(_message(m, f"messages[{i}]"))
    if not messages:
        raise bad("messages", "must hold at least one user or assistant message")
    if system:
        messages.insert(0, ChatMessage("system", "\n\n".join(system)))
    given = {key: read(body, key, kind, None) for key, kind in FIELDS.items()}
    tools = _tools(body)
    choice, name = _tool_choice(body, tools)
    fmt = anthropic_fields.output_format(body)
    gen = GenerationRequest(
        kind="chat",
        messages=tuple(messages),
        max_tokens=1 if counting else read(body, "max_tokens", MAX_TOKENS, 1),  # counting ignores it
        temperature=1.0 if given["temperature"] is None else given["temperature"],
        top_p=1.0 if given["top_p"] is None else given["top_p"],
        stop=given["stop_sequences"] or (),
        request_id=request_id,
        tools=tools,
        tool_choice=choice,
        tool_name=name,
        constraint=(grammar := constraint(choice, tools, fmt, format_param="output_config.format")),
        # constrained output starts at its first token: no thinking block before it
        thinking=anthropic_fields.thinking(body) and grammar is None,
    )
    return ParsedMessages(model, gen, bool(given["stream"]))


class MessagesRenderer:
    """Anthropic's shapes of one generation: the event stream, or the whole message."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.id = "msg_" + uuid.uuid4().hex[:24]
        self.input_tokens = 0
        #: a thinking model's markers (from the prepared request): its reasoning becomes
        #: thinking blocks
        self.markers: ThinkMarkers | None = None
        self._splitter: ThinkingSplitter | None = None
        self._index = -1
        self._open: str | None = None  # the type of the open content block
        self.created = time.time()

    def _event(self, obj: MessageEvent) -> bytes:
        return sse.event(obj, name=obj["type"])

    def first(self) -> bytes:
        message: StartedMessage = {
            "id": self.id, "type": "message", "role": "assistant", "model": self.model,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": self.input_tokens, "output_tokens": 0,
                      "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0,
                      "service_tier": "standard"}}
        return self._event({"type": "message_start", "message": message}) + self._event({"type": "ping"})

    def _start(self, block: ContentBlock) -> list[bytes]:
        out = self._close()
        self._index += 1
        self._open = block["type"]
        return [*out, self._event({"type": "content_block_start", "index": self._index,
                                   "content_block": block})]

    def _close(self) -> list[bytes]:
        if self._open is None:
            return []
        out = []
        if self._open == "thinking":  # Anthropic ends a thinking block with its signature
            out.append(self._event({"type": "content_block_delta", "index": self._index,
                                    "delta": {"type": "signature_delta", "signature": SIGNATURE}}))
        self._open = None
        return [*out, self._event({"type": "content_block_stop", "index": self._index})]

    def text(self, ev: TextDelta) -> list[bytes]:
        if not ev.text:
            return []
        if self.markers is None:
            return self._piece(False, ev.text)
        if self._splitter is None:
            self._splitter = ThinkingSplitter(self.markers)
        return [b for thinking, text in self._splitter.feed(ev.text) for b in self._piece(thinking, text)]

    def _piece(self, thinking: bool, text: str) -> list[bytes]:
        kind = "thinking" if thinking else "text"
        out = [] if self._open == kind else self._start(
            {"type": "thinking", "thinking": "", "signature": ""} if thinking else {"type": "text", "text": ""})
        delta: ThinkingBlockDelta | TextBlockDelta = (
            {"type": "thinking_delta", "thinking": text} if thinking else {"type": "text_delta", "text": text})
        return [*out, self._event({"type": "content_block_delta", "index": self._index, "delta": delta})]

    def _flush(self) -> list[bytes]:
        held = self._splitter.flush() if self._splitter is not None else []
        return [b for thinking, text in held for b in self._piece(thinking, text)]

    def call(self, ev: ToolCallDelta) -> list[bytes]:
        c = ev.call
        out = [*self._flush(), *self._start({"type": "tool_use", "id": c.id, "name": c.name, "input": {}})]
        out.append(self._event({"type": "content_block_delta", "index": self._index,
                                "delta": {"type": "input_json_delta", "partial_json": c.arguments}}))
        return [*out, *self._close()]

    def finish(self, fin: Finished) -> list[bytes]:
        reason, stop = stop_reason(fin)
        return [*self._flush(), *self._close(),
                self._event({"type": "message_delta",
                             "delta": {"stop_reason": reason, "stop_sequence": stop},
                             "usage": usage(fin)}),
                self._event({"type": "message_stop"})]

    def error(self, err: MlxdError) -> bytes:
        return self._event(error_body(err))

    def whole(self, out: Collected, fin: Finished) -> AnthropicMessage:
        content: list[ContentBlock] = [
            {"type": "thinking", "thinking": piece, "signature": SIGNATURE} if thinking
            else {"type": "text", "text": piece}
            for thinking, piece in split_whole(self.markers, "".join(out.text))
        ]
        if not content and not out.calls:
            content.append({"type": "text", "text": ""})
        content += [{"type": "tool_use", "id": c.call.id, "name": c.call.name,
                     "input": json.loads(c.call.arguments)} for c in out.calls]
        reason, stop = stop_reason(fin)
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": content, "stop_reason": reason, "stop_sequence": stop,
                "usage": usage(fin)}


def usage(fin: Finished) -> AnthropicUsage:
    """Anthropic's usage: ``input_tokens`` are the prompt tokens not read from the prompt cache
    (those are ``cache_read_input_tokens``, from memory or disk: ``mlxd_cached_tokens``);
    mlxd's cache writes cost nothing extra (0)."""
    return {"input_tokens": fin.prompt_tokens - fin.cached_tokens, "output_tokens": fin.completion_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": fin.cached_tokens,
            "service_tier": "standard", "mlxd_cached_tokens": cached_tokens(fin)}


def stop_reason(fin: Finished) -> tuple[StopReason, str | None]:
    if fin.stop_sequence is not None and fin.finish_reason == "stop":
        return "stop_sequence", fin.stop_sequence
    return STOP_REASONS[fin.finish_reason], None
