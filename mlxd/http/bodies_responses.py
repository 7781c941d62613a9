"""The response bodies of the Responses API (``/v1/responses``): the response object, its
output items, and the deletion's answer.

One ``TypedDict`` per body (see :mod:`mlxd.http.body_schemas`), built by
:mod:`mlxd.http.responses_events` (the renderer; a streamed response's
``response.*`` events carry the same object) and
:mod:`mlxd.http.responses_api`. The fields a request sets and the response
echoes (``ResponseEcho``) are gathered by :mod:`mlxd.http.responses_fields`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field
from typing_extensions import TypedDict

from mlxd.http.body_schemas import NonNegative

ItemStatus = Literal["in_progress", "completed", "incomplete"]
#: a response's status
Status = Literal["in_progress", "completed", "incomplete", "failed"]


class ResponsesTopLogprob(TypedDict):
    token: str
    bytes: list[int]
    logprob: float


class ResponsesLogprob(ResponsesTopLogprob):
    top_logprobs: list[ResponsesTopLogprob]


class OutputText(TypedDict):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]
    logprobs: list[ResponsesLogprob]


class OutputMessage(TypedDict):
    id: str
    type: Literal["message"]
    status: ItemStatus
    role: Literal["assistant"]
    content: list[OutputText]


class FunctionCallItem(TypedDict):
    id: str
    type: Literal["function_call"]
    status: ItemStatus
    call_id: str
    name: str
    #: JSON text of an object (empty while the call is in progress)
    arguments: str


OutputItem = OutputMessage | FunctionCallItem


class InputTokensDetails(TypedDict):
    #: prompt tokens whose KV came from the model's prompt cache
    cached_tokens: NonNegative


class OutputTokensDetails(TypedDict):
    reasoning_tokens: NonNegative


class ResponsesUsage(TypedDict):
    input_tokens: NonNegative
    input_tokens_details: InputTokensDetails
    output_tokens: NonNegative
    output_tokens_details: OutputTokensDetails
    total_tokens: NonNegative


class ResponseError(TypedDict):
    """Why a streamed response failed (``code``: mlxd's, e.g. ``preempted``)."""

    code: str | None
    message: str


class IncompleteDetails(TypedDict):
    reason: Literal["max_output_tokens"]


class ResponseEcho(TypedDict):
    """The request's fields as the response shows them."""

    instructions: str | None
    max_output_tokens: int | None
    metadata: dict[str, str]
    parallel_tool_calls: bool
    previous_response_id: str | None
    reasoning: dict[str, Any]
    temperature: float
    top_p: float
    #: ``format`` (``{"type": "text"}`` by default) and ``verbosity``
    text: dict[str, Any]
    tool_choice: str | dict[str, Any]
    #: the function tools (tools of other types are left out of the prompt)
    tools: list[dict[str, Any]]
    top_logprobs: int | None
    truncation: str
    user: str | None
    prompt_cache_key: str | None
    safety_identifier: str | None
    service_tier: str
    store: bool
    background: Literal[False]


class ResponseObject(ResponseEcho):
    """A response: ``completed`` or ``incomplete`` (``max_output_tokens`` cut it) when whole or
    stored; a stream's events show it ``in_progress`` first, and ``failed`` on an error."""

    id: Annotated[str, Field(pattern="^resp_")]
    object: Literal["response"]
    created_at: int
    status: Status
    completed_at: int | None
    error: ResponseError | None
    incomplete_details: IncompleteDetails | None
    model: str
    output: list[OutputItem]
    usage: ResponsesUsage | None


class DeletedResponse(TypedDict):
    id: str
    object: Literal["response"]
    deleted: Literal[True]


# ---- the stream's events (each one SSE event named by its type, numbered from 0) ------------

Lifecycle = Literal["response.created", "response.in_progress", "response.completed",
                    "response.incomplete", "response.failed"]
ItemEventKind = Literal["response.output_item.added", "response.output_item.done"]
PartEventKind = Literal["response.content_part.added", "response.content_part.done"]


class ResponseLifecycle(TypedDict):
    """The response as it stands: ``created`` and ``in_progress`` first, then ``completed``,
    ``incomplete`` or ``failed`` last."""

    type: Lifecycle
    response: ResponseObject
    sequence_number: NonNegative


class OutputItemEvent(TypedDict):
    type: ItemEventKind
    output_index: NonNegative
    item: OutputItem
    sequence_number: NonNegative


class ContentPartEvent(TypedDict):
    type: PartEventKind
    item_id: str
    output_index: NonNegative
    content_index: NonNegative
    part: OutputText
    sequence_number: NonNegative


class OutputTextDelta(TypedDict):
    type: Literal["response.output_text.delta"]
    item_id: str
    output_index: NonNegative
    content_index: NonNegative
    delta: str
    logprobs: list[ResponsesLogprob]
    sequence_number: NonNegative


class OutputTextDone(TypedDict):
    type: Literal["response.output_text.done"]
    item_id: str
    output_index: NonNegative
    content_index: NonNegative
    text: str
    logprobs: list[ResponsesLogprob]
    sequence_number: NonNegative


class ArgumentsDelta(TypedDict):
    """A call's arguments (whole: the engine parses a call once it is complete)."""

    type: Literal["response.function_call_arguments.delta"]
    item_id: str
    output_index: NonNegative
    delta: str
    sequence_number: NonNegative


class ArgumentsDone(TypedDict):
    type: Literal["response.function_call_arguments.done"]
    item_id: str
    output_index: NonNegative
    name: str
    arguments: str
    sequence_number: NonNegative


#: one event of a streamed response, in its ``data:`` (its ``event:`` is its ``type``)
ResponseEvent = (ResponseLifecycle | OutputItemEvent | ContentPartEvent | OutputTextDelta
                 | OutputTextDone | ArgumentsDelta | ArgumentsDone)
EVENTS: tuple[Any, ...] = (ResponseLifecycle, OutputItemEvent, ContentPartEvent, OutputTextDelta,
                           OutputTextDone, ArgumentsDelta, ArgumentsDone)

#: the bodies the routes answer with (their schemas become components)
BODIES: tuple[Any, ...] = (ResponseObject, DeletedResponse, *EVENTS)
