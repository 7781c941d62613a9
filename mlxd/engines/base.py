"""The one protocol every engine implements, and the request/response shapes.

An engine instance is one residency of one model: the manager makes a fresh
engine for each load (``factory(model_config) -> Engine``), calls
:meth:`Engine.load` once, hands it to leases while ``loaded``, and calls
:meth:`Engine.stop` once to unload (also after a failed or cancelled load, to
free a partial load).

Cancellation contract (what the manager and HTTP layer rely on):

* ``load()`` is cancellable: on ``trio.Cancelled`` it stops as soon as it can
  and leaves the engine in a state where ``stop()`` frees everything.
* ``generate()`` is an async iterator; when the task iterating it is
  cancelled (client disconnect, preemption, shutdown) or the iterator is closed,
  generation stops within one token (during prefill: at the next chunk).
* ``stop()`` frees the engine's memory. It may raise; the manager then keeps
  the engine as ``loaded`` and records ``last_error``.
* ``wait_died()`` returns only if the residency ends on its own (its worker
  process crashed or was killed, ``isolation: process``); the manager then
  fails the model (reason ``engine_died``). Generations in flight end with
  :class:`mlxd.errors.EngineDied`, and so does every later ``generate()``.

Requests to one engine are admitted in arrival order; beyond ``max_queue``
waiting requests ``generate()`` raises :class:`mlxd.errors.Overloaded`.
A batching engine serves up to ``max_batch_size`` at once (sharing decode
steps) without changing this interface.

The residency shell sees engines only through this module (an import-linter
contract in ``pyproject.toml`` holds it): the protocol, the shapes, what a
loaded engine holds of KV (:class:`KvBook`) and what a load has measured
(:func:`loaded_weights`).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

import trio

from mlxd.config import weights_fingerprint
from mlxd.config.kv import kv_need_bytes
from mlxd.errors import InvalidRequest, MlxdError, ModelExceedsBudget
from mlxd.units import format_bytes

if TYPE_CHECKING:
    from mlxd.config import ModelConfig

#: mlx-lm's logits processor: ``(generated tokens so far, logits (1, vocab)) -> logits``
LogitsProcessor = Callable[[Any, Any], Any]


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A call of a declared function: in an assistant message of the history, or generated."""

    id: str
    name: str
    #: the arguments as JSON text (OpenAI's shape), an object
    arguments: str


@dataclass(frozen=True, slots=True)
class Tool:
    """A function the model may call (OpenAI ``tools[i].function``)."""

    name: str
    description: str | None = None
    #: a JSON Schema of type object
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object"})

    def as_openai(self) -> dict[str, Any]:
        """The shape chat templates receive (``{"type": "function", "function": {...}}``)."""
        fn: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description is not None:
            fn["description"] = self.description
        return {"type": "function", "function": fn}


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str
    #: plain text, or OpenAI content parts (``{"type": "text"|"image_url", ...}``)
    content: str | list[dict[str, Any]]
    #: an assistant message's earlier calls
    tool_calls: tuple[ToolCall, ...] = ()
    #: a ``tool`` message: the call it answers
    tool_call_id: str | None = None
    #: a ``tool`` message: the function's name (if the client gave it)
    name: str | None = None


@dataclass(frozen=True, slots=True)
class Constraint:
    """What grammar-constrained decoding must produce (see :mod:`mlxd.engines.grammar.constrained`).

    ``json_object``: any JSON object. ``json_schema``: JSON valid against
    ``schema``. ``tool_call``: one call, in the model's tool-call format, of
    one of ``tools`` (``tool_choice`` ``required``) or of the one named.
    """

    kind: Literal["json_object", "json_schema", "tool_call"]
    #: the JSON Schema as JSON text (json_schema); empty otherwise
    schema: str = ""
    #: the request field that asked for it, named by refusals (empty: chat's ``response_format``)
    param: str = ""


@dataclass(frozen=True, slots=True)
class ThinkMarkers:
    """How a thinking model marks its reasoning in the text it writes (``<think>`` ... ``</think>``)."""

    start: str
    end: str
    #: the prompt ends inside a thinking block (the template opened it): the output starts in one
    open: bool


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """One generation, already validated by the HTTP layer."""

    kind: Literal["chat", "completion"]
    #: for ``completion``
    prompt: str | None = None
    #: for ``chat``
    messages: tuple[ChatMessage, ...] = ()
    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    #: sample among the k most likely tokens only (0: no such limit; Ollama's ``top_k``)
    top_k: int = 0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    #: decoded images (PIL images or raw bytes) for ``mllm`` models
    images: tuple[Any, ...] = ()
    request_id: str | None = None
    #: the prompt's token ids, once the engine's ``prepare`` has tokenized it
    prompt_ids: tuple[int, ...] | None = None
    #: functions passed to the chat template (empty with ``tool_choice: none``)
    tools: tuple[Tool, ...] = ()
    #: ``auto`` | ``none`` | ``required`` | ``function`` (``tool_name`` then names it)
    tool_choice: Literal["auto", "none", "required", "function"] = "auto"
    tool_name: str | None = None
    #: grammar-constrained decoding (response_format, or tool_choice required / named): plain
    #: data, so it crosses to a worker process; the engine's ``prepare`` turns it into
    #: :attr:`logits_processors` where the model is
    constraint: Constraint | None = None
    #: the chat template's thinking switch (``enable_thinking``; templates without one ignore
    #: it): None leaves the template's default (mlx-lm's: on when the vocabulary has think tokens)
    thinking: bool | None = None
    #: set by a text engine's ``prepare`` when the model's vocabulary has thinking markers, so
    #: that a route can tell the reasoning from the answer (Anthropic's thinking blocks)
    think_markers: ThinkMarkers | None = None
    #: per-request logits processors, mlx-lm's ``(tokens, logits) -> logits`` (both ``mx.array``;
    #: ``logits`` has shape ``(1, vocab)``), applied in order before sampling each token, on the
    #: model's MLX thread, batched or not. Callables: they never cross a process boundary
    logits_processors: tuple[LogitsProcessor, ...] = ()
    #: report each generated token's log-probability and this many top alternatives
    #: (:attr:`TextDelta.logprobs`); None: off (no per-token cost)
    logprobs: int | None = None
    #: the lease the request runs under (set by the HTTP layer): its KV is reserved for it
    lease_id: str | None = None


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One token's log-probability: its id, its text and exact bytes (OpenAI's ``token`` /
    ``bytes``: a byte-level BPE token may hold part of a character), and, for a generated
    token, the most likely alternatives (each a :class:`TokenLogprob` without ``top``)."""

    id: int
    token: str
    logprob: float
    bytes: tuple[int, ...]
    #: the ``logprobs`` most likely tokens at this step, most likely first
    top: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True, slots=True)
class TextDelta:
    """New text produced by the model (may be empty while a byte sequence completes)."""

    text: str
    #: the tokens behind this delta, when the request asked for ``logprobs``
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """A complete tool call parsed from the output (``index`` counts calls from 0)."""

    index: int
    call: ToolCall


FinishReason = Literal["stop", "length", "tool_calls"]


@dataclass(frozen=True, slots=True)
class Finished:
    """The last item of every generation."""

    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    #: prompt tokens whose KV was reused from the model's prompt cache (memory or disk)
    cached_tokens: int = 0
    #: the stop string that ended the output (finish_reason "stop"), if one did
    stop_sequence: str | None = None
    #: ``time.monotonic()`` when the engine took the generation off its queue (the access
    #: log's ``queue_ms``); None when the engine does not say. A timing, not part of the
    #: result: two generations that ended alike compare equal
    started_at: float | None = field(default=None, compare=False)
    #: of ``cached_tokens``, those read from the prompt cache's disk tier (mlxd.engines.cache.prompt_disk)
    cached_from_disk: int = 0


GenerationEvent = TextDelta | ToolCallDelta | Finished


@dataclass(slots=True)
class LoadProgress:
    """What a load reports while it runs (download bytes, phase)."""

    phase: str = "starting"  # starting | downloading | loading | measuring | done
    bytes_done: int = 0
    bytes_total: int | None = None
    detail: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


ProgressCallback = Callable[[LoadProgress], None]


KvAnswer = Callable[[MlxdError | None], None]


class KvBroker(Protocol):
    """The residency's side of a model's KV (``mlxd.residency.kv``), as an engine sees it.

    All on the Trio thread. ``reserve`` asks for ``nbytes`` more for the request of
    ``lease_id`` and returns a function that withdraws the ask; ``answer`` is called
    later (never from inside ``reserve``) with None once they are committed, or the
    typed error that refused them (the lease's contention policy applies).
    """

    def floor(self) -> int:
        """The KV bytes its load committed (its ``kv_cache`` part: 0 when the model's KV
        bytes per token were unknown when it was estimated)."""
        ...

    def room(self) -> int:
        """The most KV bytes beyond what its load committed that the budget could ever give
        this model (every other model evicted)."""
        ...

    def reserve(self, lease_id: str | None, nbytes: int, answer: KvAnswer) -> Callable[[], None]: ...

    def give_back(self, nbytes: int) -> None: ...


@dataclass
class KvBook:
    """What a model's engine holds of KV beyond the floor its load committed."""

    floor: int
    bytes_per_token: int | None
    #: ``kv_cache_gb`` was set: the floor is the cap, nothing is reserved per request
    fixed: bool = False
    broker: KvBroker | None = None
    #: bytes reserved beyond the floor (granted, not given back)
    held: int = 0
    #: the head of the queue (its job) whose reservation is asked for, and how to withdraw the ask
    pending: object | None = None
    withdraw_ask: Callable[[], None] | None = field(default=None, repr=False)

    @classmethod
    def of(
        cls, config: ModelConfig, per_token: int | None, kv_cache: int, broker: KvBroker | None
    ) -> KvBook:
        """A residency's book: ``kv_cache_gb`` set is a fixed region of ``kv_cache`` bytes;
        else the floor is what its load committed (the residency's figure, via ``broker``)."""
        fixed = config.kv_cache_bytes is not None
        floor = kv_cache if fixed or broker is None else broker.floor()
        return cls(floor, per_token, fixed, broker)

    @property
    def draws(self) -> bool:
        """Whether KV beyond the floor is reserved in the budget per request."""
        return bool(self.bytes_per_token) and not self.fixed and self.broker is not None

    def need(self, tokens: list[int]) -> int:
        return kv_need_bytes(tokens, self.bytes_per_token or 0)

    def limit(self) -> int | None:
        """The most KV the model's running generations may hold (None: unbounded here)."""
        if self.fixed:
            return self.floor
        if self.broker is None or not self.bytes_per_token:
            return None
        return self.floor + self.broker.room()

    def fit(self, model: str, prompt_tokens: int, max_tokens: int) -> int:
        """The ``max_tokens`` a request may run with so its KV fits even alone (fewer than
        asked: it ends with finish_reason ``length``); a prompt that cannot fit is a 400."""
        limit, per = self.limit(), self.bytes_per_token
        if limit is None or not per:
            return max_tokens
        room = limit // per - (self.need([0]) // per)  # tokens that fit, with a growth step
        if prompt_tokens < room:
            return min(max_tokens, room - prompt_tokens)
        short = format_bytes((prompt_tokens - room + 1) * per)
        where = (
            f"the model's kv_cache_gb ({format_bytes(limit)})"
            if self.fixed
            else f"the memory budget, with every other model evicted ({format_bytes(limit)} "
            f"for the KV of '{model}')"
        )
        error = InvalidRequest if self.fixed else ModelExceedsBudget
        raise error(
            f"the prompt's KV cache ({prompt_tokens:,} tokens, "
            f"{format_bytes(prompt_tokens * per)}) does not fit {where}: {room:,} tokens fit, "
            f"{short} short; shorten the prompt",
            param="messages",
        )


@runtime_checkable
class Engine(Protocol):
    """One residency of one model."""

    #: the model name (API id)
    name: str

    async def load(self, progress: ProgressCallback) -> None:
        """Load the weights; cancellable (see module docstring)."""
        ...

    async def stop(self) -> None:
        """Free everything the engine holds. Safe after a failed or cancelled load."""
        ...

    def measured_bytes(self) -> int | None:
        """The footprint measured by the last load, or None if it was not measured."""
        ...

    async def prepare(self, request: GenerationRequest) -> GenerationRequest:
        """Check ``request`` against this model before generating (cancellable).

        Validates it, tokenizes it where the engine can (never on the model's
        MLX thread) and raises :class:`mlxd.errors.ContextLengthExceeded` when
        the prompt is over the model's limits; returns the request with
        ``prompt_ids`` filled in. The HTTP layer calls it before a response
        starts, so these errors are plain 400s; ``generate`` calls it itself
        for a request that was not prepared.
        """
        ...

    async def count_tokens(self, request: GenerationRequest) -> int:
        """The prompt tokens ``request`` would take (chat template and tools applied)."""
        ...

    def generate(self, request: GenerationRequest) -> AsyncGenerator[GenerationEvent, None]:
        """Stream a generation; the last item is a :class:`Finished`."""
        ...

    def queue_depth(self) -> int:
        """Requests waiting for or in generation on this engine."""
        ...

    async def wait_died(self) -> str:
        """Return a one-line description if this residency dies on its own (never, in-process)."""
        ...


async def loaded_weights(model: ModelConfig) -> str:
    """What a load of ``model`` has just measured (:func:`mlxd.config.weights_fingerprint`; its
    measurement applies while that is unchanged): a stat walk of the model's files, on a thread;
    a fake's is its settings (no thread: fakes run in virtual-time tests)."""
    if model.engine == "fake":
        return weights_fingerprint(model)
    return await trio.to_thread.run_sync(weights_fingerprint, model, abandon_on_cancel=True)
