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
from mlxd.http.fields import Boolean, Integer, Kind, Number, Stops, bad, read
from mlxd.http.generation import Collected
from mlxd.http.structured import (
    ToolChoice,
    arguments_text,
    constraint,
    function_name,
    is_model_name,
    make_tool,
    named_tool,
)
from mlxd.http.thinking import ThinkingSplitter, split_whole
from mlxd.http.validation import MAX_TOKENS_LIMIT

MAX_STOP_SEQUENCES = 16
ROLES = ("user", "assistant")
BLOCKS = ("text", "tool_use", "tool_result", "thinking", "redacted_thinking")

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


def _text_blocks(v: object, param: str) -> str:
    """A string, or a list of text blocks joined."""
    if isinstance(v, str):
        return v
    if not isinstance(v, list):
        raise bad(param, "must be a string or a list of text blocks")
    out = []
    for i, b in enumerate(v):
        if not isinstance(b, dict) or b.get("type") != "text":
            got = json.dumps(b.get("type") if isinstance(b, dict) else b)[:40]
            raise bad(f"{param}[{i}].type", f"must be 'text' (got {got})")
        if not isinstance(b.get("text"), str):
            raise bad(f"{param}[{i}].text", "must be a string")
        out.append(b["text"])
    return "".join(out)


def _message(m: object, p: str) -> list[ChatMessage]:
    if not isinstance(m, dict):
        raise bad(p, "must be an object with 'role' and 'content'")
    role = m.get("role")
    if role not in ROLES:
        raise bad(f"{p}.role", "must be 'user', 'assistant', 'system' or 'developer'")
    content = m.get("content")
    if isinstance(content, str):
        return [ChatMessage(role, content)]
    if not isinstance(content, list) or not content:
        raise bad(f"{p}.content", "must be a string or a non-empty list of content blocks")
    text: list[str] = []
    calls: list[ToolCall] = []
    results: list[ChatMessage] = []
    for j, b in enumerate(content):
        q = f"{p}.content[{j}]"
        if not isinstance(b, dict):
            raise bad(q, "must be an object with a 'type'")
        kind = b.get("type")
        if kind not in BLOCKS:
            raise bad(f"{q}.type", f"must be one of {', '.join(BLOCKS)} (got {json.dumps(kind)[:40]})")
        if kind == "text":
            if not isinstance(b.get("text"), str):
                raise bad(f"{q}.text", "must be a string")
            text.append(b["text"])
        elif kind in ("thinking", "redacted_thinking"):
            if role != "assistant":
                raise bad(f"{q}.type", f"{kind} blocks belong in assistant messages")
            for key in ("thinking", "signature") if kind == "thinking" else ("data",):
                if (key in b or key == "thinking") and not isinstance(b.get(key), str):
                    raise bad(f"{q}.{key}", "must be a string")
        elif kind == "tool_use":
            if role != "assistant":
                raise bad(f"{q}.type", "tool_use blocks belong in assistant messages")
            cid = b.get("id")
            if not isinstance(cid, str) or not cid:
                raise bad(f"{q}.id", "must be a non-empty string")
            name = function_name(b.get("name"), f"{q}.name")
            calls.append(ToolCall(cid, name, arguments_text(b.get("input"), f"{q}.input")))
        else:
            if role != "user":
                raise bad(f"{q}.type", "tool_result blocks belong in user messages")
            tid = b.get("tool_use_id")
            if not isinstance(tid, str) or not tid:
                raise bad(f"{q}.tool_use_id", "must be a non-empty string")
            if b.get("is_error") is not None and not isinstance(b["is_error"], bool):
                raise bad(f"{q}.is_error", "must be a boolean")
            body = _text_blocks(b.get("content", ""), f"{q}.content")
            results.append(ChatMessage("tool", body, tool_call_id=tid))
    # a turn of thinking blocks only is still a turn (empty); tool results alone are not
    own = [ChatMessage(role, "".join(text), tuple(calls))] if text or calls or not results else []
    return [*results, *own]


def _tools(body: dict[str, Any]) -> tuple[Any, ...]:
    raw = body.get("tools")
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise bad("tools", "must be a list of {\"name\", \"input_schema\"}")
    tools: list[Any] = []
    for i, t in enumerate(raw):
        p = f"tools[{i}]"
        if not isinstance(t, dict):
            raise bad(p, "must be an object")
        if t.get("type") not in (None, "custom"):
            raise bad(f"{p}.type", "only custom tools (name, input_schema) are served here")
        name = function_name(t.get("name"), f"{p}.name")
        if any(x.name == name for x in tools):
            raise bad(f"{p}.name", f"'{name}' is declared twice")
        if "input_schema" not in t:
            raise bad(f"{p}.input_schema", "is required")
        tools.append(make_tool(name, t.get("description"), t["input_schema"], p, key="input_schema"))
    return tuple(tools)


def _tool_choice(body: dict[str, Any], tools: tuple[Any, ...]) -> tuple[ToolChoice, str | None]:
    v = body.get("tool_choice")
    if v is None:
        return "auto", None
    if not isinstance(v, dict) or v.get("type") not in ("auto", "any", "tool", "none"):
        raise bad("tool_choice", "must be {\"type\": \"auto\" | \"any\" | \"tool\" | \"none\"}")
    kind = v["type"]
    if kind in ("any", "tool") and not tools:
        raise bad("tool_choice", f"'{kind}' needs at least one tool in tools")
    if kind == "tool":
        return "function", named_tool(v.get("name"), tools, "tool_choice.name")
    return {"auto": "auto", "any": "required", "none": "none"}[kind], None  # type: ignore[return-value]


def parse_messages(body: object, *, request_id: str, counting: bool = False) -> ParsedMessages:
    """Validate a Messages body (``counting``: a count_tokens body, no max_tokens)."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    model = body.get("model")
    if not is_model_name(model):
        raise bad("model", "is required: a non-empty string")
    max_tokens: Any = 1  # counting ignores max_tokens
    if not counting:
        max_tokens = read(body, "max_tokens", MAX_TOKENS, None)
        if max_tokens is None:
            raise bad("max_tokens", "is required")
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages", "must be a non-empty list")
    messages: list[ChatMessage] = []
    system = [] if body.get("system") is None else [_text_blocks(body["system"], "system")]
    for i, m in enumerate(msgs):
        if isinstance(m, dict) and anthropic_fields.is_system_role(m.get("role")):
            system.append(_text_blocks(m.get("content"), f"messages[{i}].content"))
        else:
            messages.extend(_message(m, f"messages[{i}]"))
    if not messages:
        raise bad("messages", "must hold at least one user or assistant message")
    if system:
        messages.insert(0, ChatMessage("system", "\n\n".join(system)))
    given = {key: read(body, key, kind, None) for key, kind in FIELDS.items()}
    anthropic_fields.check_accepted(body)
    tools = _tools(body)
    choice, name = _tool_choice(body, tools)
    fmt = anthropic_fields.output_format(body)
    gen = GenerationRequest(
        kind="chat",
        messages=tuple(messages),
        max_tokens=int(max_tokens),
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
