"""The response bodies of the Anthropic Messages routes: the message (whole and streamed),
the token count, and Anthropic's error envelope.

One ``TypedDict`` per body (see :mod:`mlxd.http.body_schemas`), returned by
:mod:`mlxd.http.anthropic_shapes` and :mod:`mlxd.http.anthropic_api`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, NotRequired

from pydantic import Field
from typing_extensions import TypedDict

from mlxd.http.bodies_openai import CachedTokens
from mlxd.http.body_schemas import NonNegative
from mlxd.http.structured import NAME_PATTERN


class AnthropicErrorDetail(TypedDict):
    type: str
    message: str


class AnthropicError(TypedDict):
    """Anthropic's error body (``/v1/messages`` and what is under it); also a stream's last event."""

    type: Literal["error"]
    error: AnthropicErrorDetail


class TextBlock(TypedDict):
    type: Literal["text"]
    text: str


class ThinkingBlock(TypedDict):
    type: Literal["thinking"]
    thinking: str
    #: clients keep it and send it back; mlxd does not check it
    signature: str


class ToolUseBlock(TypedDict):
    type: Literal["tool_use"]
    id: Annotated[str, Field(min_length=1)]
    name: Annotated[str, Field(pattern=NAME_PATTERN)]
    input: dict[str, Any]


ContentBlock = TextBlock | ThinkingBlock | ToolUseBlock

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class AnthropicUsage(TypedDict):
    """``input_tokens``: the prompt tokens not read from the prompt cache (those are
    ``cache_read_input_tokens``, by tier in ``mlxd_cached_tokens``)."""

    input_tokens: NonNegative
    output_tokens: NonNegative
    cache_creation_input_tokens: NonNegative
    cache_read_input_tokens: NonNegative
    service_tier: str
    #: absent from message_start (nothing is counted yet)
    mlxd_cached_tokens: NotRequired[CachedTokens]


class AnthropicMessage(TypedDict):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[ContentBlock]
    stop_reason: StopReason
    stop_sequence: str | None
    usage: AnthropicUsage


class TokenCount(TypedDict):
    input_tokens: NonNegative


# ---- the stream's events (each one SSE event named by its type) ---------------------------


class StartedMessage(TypedDict):
    """The message as ``message_start`` shows it: no content, no stop reason yet."""

    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: Annotated[list[ContentBlock], Field(max_length=0)]
    stop_reason: None
    stop_sequence: None
    usage: AnthropicUsage


class MessageStart(TypedDict):
    type: Literal["message_start"]
    message: StartedMessage


class Ping(TypedDict):
    type: Literal["ping"]


class ContentBlockStart(TypedDict):
    type: Literal["content_block_start"]
    index: NonNegative
    content_block: ContentBlock


class TextBlockDelta(TypedDict):
    type: Literal["text_delta"]
    text: str


class ThinkingBlockDelta(TypedDict):
    type: Literal["thinking_delta"]
    thinking: str


class SignatureDelta(TypedDict):
    type: Literal["signature_delta"]
    signature: str


class InputJsonDelta(TypedDict):
    type: Literal["input_json_delta"]
    partial_json: str


class ContentBlockDelta(TypedDict):
    type: Literal["content_block_delta"]
    index: NonNegative
    delta: TextBlockDelta | ThinkingBlockDelta | SignatureDelta | InputJsonDelta


class ContentBlockStop(TypedDict):
    type: Literal["content_block_stop"]
    index: NonNegative


class StopDelta(TypedDict):
    stop_reason: StopReason
    stop_sequence: str | None


class MessageDelta(TypedDict):
    type: Literal["message_delta"]
    delta: StopDelta
    usage: AnthropicUsage


class MessageStop(TypedDict):
    type: Literal["message_stop"]


#: one event of a streamed message, in its ``data:`` (its ``event:`` is its ``type``)
MessageEvent = (MessageStart | Ping | ContentBlockStart | ContentBlockDelta | ContentBlockStop
                | MessageDelta | MessageStop | AnthropicError)


#: the bodies the routes answer with (their schemas become components)
BODIES: tuple[Any, ...] = (AnthropicError, AnthropicMessage, TokenCount, MessageStart, Ping,
                           ContentBlockStart, ContentBlockDelta, ContentBlockStop, MessageDelta,
                           MessageStop)
