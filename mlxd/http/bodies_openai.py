"""The response bodies of the OpenAI routes: models, completions (whole and streamed), embeddings.

One ``TypedDict`` per body (see :mod:`mlxd.http.body_schemas`): the builders
in :mod:`mlxd.http.openai_api` and :mod:`mlxd.http.embeddings_api` return
them, and ``/openapi.json`` shows the schemas generated from them. The error
envelope is :class:`mlxd.errors.ErrorEnvelope` (the errors render it).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, NotRequired

from pydantic import Field, WithJsonSchema
from typing_extensions import TypedDict

from mlxd.engines.base import Finished, FinishReason
from mlxd.errors import ErrorEnvelope
from mlxd.http.body_schemas import NonNegative
from mlxd.residency.states import State

#: a residency state's name (``State``'s values)
StateName = Annotated[str, WithJsonSchema({"type": "string", "enum": [s.value for s in State]})]


class CachedTokens(TypedDict):
    """Prompt tokens read from the prompt cache: from memory, and from its disk tier
    (mlxd's extension of usage, docs/prompt-cache.md)."""

    memory: NonNegative
    disk: NonNegative


def cached_tokens(fin: Finished) -> CachedTokens:
    """``usage.mlxd_cached_tokens`` of a generation."""
    return {"memory": fin.cached_tokens - fin.cached_from_disk, "disk": fin.cached_from_disk}


class ModelMemory(TypedDict):
    """What a load commits, by part."""

    weights: NonNegative
    kv_cache: NonNegative
    prompt_cache: NonNegative


class ModelObject(TypedDict):
    """A configured model with its residency state."""

    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    status: StateName
    loaded: bool
    pinned: bool
    memory_bytes: int | None
    memory_source: str | None
    memory: ModelMemory
    last_used_at: float | None
    last_error: str | None


class ModelList(TypedDict):
    object: Literal["list"]
    data: list[ModelObject]


class FunctionCall(TypedDict):
    name: str
    #: JSON text of an object
    arguments: str


class ToolCall(TypedDict):
    id: str
    type: Literal["function"]
    function: FunctionCall


class TopLogprob(TypedDict):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(TypedDict):
    content: list[TokenLogprob]
    refusal: None


class TextLogprobs(TypedDict):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class AssistantMessage(TypedDict):
    role: Literal["assistant"]
    content: str | None
    refusal: None
    tool_calls: NotRequired[list[ToolCall]]


class ChatChoice(TypedDict):
    index: Literal[0]
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason


class TextChoice(TypedDict):
    index: Literal[0]
    text: str
    logprobs: TextLogprobs | None
    finish_reason: FinishReason


class PromptTokensDetails(TypedDict):
    #: prompt tokens whose KV came from the model's prompt cache
    cached_tokens: NonNegative


class Usage(TypedDict):
    prompt_tokens: NonNegative
    completion_tokens: NonNegative
    total_tokens: NonNegative
    prompt_tokens_details: PromptTokensDetails
    mlxd_cached_tokens: CachedTokens


#: the one choice of a completion
_One = Field(min_length=1, max_length=1)


class ChatCompletion(TypedDict):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    system_fingerprint: None
    choices: Annotated[list[ChatChoice], _One]
    usage: Usage


class TextCompletion(TypedDict):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    system_fingerprint: None
    choices: Annotated[list[TextChoice], _One]
    usage: Usage


class ToolCallChunk(ToolCall):
    index: int


class ChatDelta(TypedDict, total=False):
    """What a chunk adds: the role (first), a piece of text, or a tool call."""

    role: Literal["assistant"]
    content: str
    tool_calls: list[ToolCallChunk]


class ChatChunkChoice(TypedDict):
    index: Literal[0]
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None


class TextChunkChoice(TypedDict):
    index: Literal[0]
    text: str
    logprobs: TextLogprobs | None
    finish_reason: FinishReason | None


class ChatCompletionChunk(TypedDict):
    """One event of a streamed chat completion; with ``include_usage``, the last one has no
    choices and the usage (the others ``usage: null``)."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    system_fingerprint: None
    choices: list[ChatChunkChoice]
    usage: NotRequired[Usage | None]


class TextCompletionChunk(TypedDict):
    """One event of a streamed text completion (the usage as in a chat chunk)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    system_fingerprint: None
    choices: list[TextChunkChoice]
    usage: NotRequired[Usage | None]


class Embedding(TypedDict):
    object: Literal["embedding"]
    index: int
    #: floats, or (encoding_format: base64) their little-endian float32 bytes in base64
    embedding: list[float] | str


class EmbeddingUsage(TypedDict):
    prompt_tokens: NonNegative
    total_tokens: NonNegative


class EmbeddingList(TypedDict):
    object: Literal["list"]
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


#: the bodies the routes answer with (their schemas become components)
BODIES: tuple[Any, ...] = (ErrorEnvelope, ModelObject, ModelList, ChatCompletion, TextCompletion,
                           ChatCompletionChunk, TextCompletionChunk, EmbeddingList)
