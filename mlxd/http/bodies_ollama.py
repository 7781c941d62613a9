"""The response bodies of Ollama's API (``/api/*``): the catalog (version, tags, ps, show),
the chat and generate replies, embeddings, pull's progress and ``{"error": "..."}``.

One ``TypedDict`` per body (see :mod:`mlxd.http.body_schemas`), returned by
:mod:`mlxd.http.ollama_catalog`, :mod:`mlxd.http.ollama_render`,
:mod:`mlxd.http.ollama_pull` and :mod:`mlxd.http.ollama_api`. A streamed
reply is NDJSON: one ``OllamaReply`` a line (the last one ``done: true``),
or an ``OllamaError``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, NotRequired

from pydantic import Field
from typing_extensions import TypedDict

from mlxd.http.bodies_openai import ModelMemory
from mlxd.http.body_schemas import NonNegative
from mlxd.http.structured import NAME_PATTERN


class OllamaError(TypedDict):
    """Ollama's error body (every ``/api/`` route); also a stream's last line."""

    error: str


class OllamaVersion(TypedDict):
    version: str
    #: mlxd's own version
    mlxd: str


class OllamaDetails(TypedDict):
    parent_model: str
    format: str
    family: str
    families: list[str] | None
    parameter_size: str
    quantization_level: str


class OllamaTag(TypedDict):
    name: str
    model: str
    modified_at: str
    size: NonNegative
    digest: Annotated[str, Field(pattern="^[0-9a-f]{64}$")]
    details: OllamaDetails


class OllamaTags(TypedDict):
    models: list[OllamaTag]


class RunningFacts(TypedDict):
    """mlxd's residency of a running model."""

    state: str
    active_leases: NonNegative
    waiters: NonNegative
    pinned: bool
    keep_alive_s: float | None
    idle_unload_seconds: float | None
    memory: ModelMemory


class OllamaRunning(TypedDict):
    name: str
    model: str
    size: NonNegative
    digest: Annotated[str, Field(pattern="^[0-9a-f]{64}$")]
    details: OllamaDetails
    #: when keep_alive unloads it
    expires_at: str
    size_vram: NonNegative
    context_length: int
    mlxd: RunningFacts


class OllamaRunningList(TypedDict):
    models: list[OllamaRunning]


Capability = Literal["completion", "tools", "vision", "embedding", "thinking"]


class ShowFacts(TypedDict):
    source: str
    engine: str
    mllm: bool
    embedding: bool
    on_disk: bool


class OllamaShow(TypedDict):
    modelfile: str
    parameters: str
    template: str
    details: OllamaDetails
    model_info: dict[str, Any]
    capabilities: list[Capability]
    modified_at: str
    mlxd: ShowFacts


class OllamaFunction(TypedDict):
    index: NonNegative
    name: Annotated[str, Field(pattern=NAME_PATTERN)]
    arguments: dict[str, Any]


class OllamaToolCall(TypedDict):
    id: str
    function: OllamaFunction


class OllamaMessage(TypedDict):
    role: Literal["assistant"]
    content: str
    thinking: NotRequired[str]
    tool_calls: NotRequired[list[OllamaToolCall]]


class OllamaTopLogprob(TypedDict):
    token: str
    logprob: float
    bytes: list[int]


class OllamaLogprob(OllamaTopLogprob):
    top_logprobs: list[OllamaTopLogprob]


class OllamaCounters(TypedDict, total=False):
    """The durations (nanoseconds) and token counts of a finished reply (the last one)."""

    total_duration: NonNegative
    load_duration: NonNegative
    prompt_eval_count: NonNegative
    prompt_eval_duration: NonNegative
    eval_count: NonNegative
    eval_duration: NonNegative


class OllamaReply(OllamaCounters):
    """A reply of ``/api/chat`` (``message``) or ``/api/generate`` (``response``), or one line
    of its stream; the last one has ``done: true``, its ``done_reason`` and the counters."""

    model: str
    created_at: str
    message: NotRequired[OllamaMessage]
    response: NotRequired[str]
    thinking: NotRequired[str]
    logprobs: NotRequired[list[OllamaLogprob]]
    done: bool
    done_reason: NotRequired[Literal["stop", "length", "load", "unload"]]


class OllamaEmbed(TypedDict):
    model: str
    embeddings: list[list[float]]
    total_duration: NonNegative
    load_duration: NonNegative
    prompt_eval_count: NonNegative


class OllamaEmbedding(TypedDict):
    embedding: list[float]


class PullOutcome(TypedDict):
    repo: str
    #: the configured models that use the repo
    models: list[str]
    #: what to do for mlxd to serve it (null: a configured model does)
    next: str | None


class PullProgress(TypedDict):
    """One progress object of a pull (a line of its stream; the last one without ``stream``)."""

    status: str
    digest: NotRequired[str]
    total: NotRequired[int | None]
    completed: NotRequired[int | None]
    mlxd: NotRequired[PullOutcome]


#: the bodies the routes answer with (their schemas become components)
BODIES: tuple[Any, ...] = (OllamaError, OllamaVersion, OllamaTags, OllamaRunningList, OllamaShow,
                           OllamaReply, OllamaEmbed, OllamaEmbedding, PullProgress)
