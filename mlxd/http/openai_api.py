"""The OpenAI-compatible routes: models, chat completions, completions.

A generation holds a lease for its whole life. Non-streaming: the handler
holds it inside ``lease.scope()``. Streaming: the response body (an async
generator, which must not hold a cancel scope across ``yield``) owns the lease,
opens ``lease.scope()`` around each wait for the next token, and ends the
lease in its ``finally`` -- which runs the moment the client disconnects
(Quart cancels the body at its current await). A streamed request whose model
is loading starts its stream at once and receives the load's progress as SSE
comment lines (``: loading demo 40% eta 1.2s``) until its lease comes; a
request refused before that gets its error status as usual. Preemption cancels the scope,
so the stream ends between two tokens with an SSE error event
``{"error": {..., "code": "preempted"}}`` that the OpenAI client raises.
Either way the lease ends with ``lease.finish(exc)`` (the one outcome rule is
:func:`mlxd.residency.lease.outcome_of`; a cancelled request is ``disconnected``).

A body that cannot send (the client stopped reading) does not hold the model
hostage: the manager ends a preempted lease itself, and the body's abandon hook
(:func:`_abandon_stream`) closes the engine's iterator (cancelling its job) and
the connection.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from dataclasses import replace
from typing import Any

import trio
from quart import Blueprint, Response, request

from mlxd.engines.base import Finished, GenerationEvent, TextDelta
from mlxd.engines.prompt_limits import check_chars, check_prompt_chars, limits_for
from mlxd.errors import (
    EngineError,
    InvalidRequest,
    MlxdError,
    ModelNotFound,
    Overloaded,
    ShuttingDown,
)
from mlxd.http import access_log, auth, bodyscan, sse
from mlxd.http.context import AppState, state
from mlxd.http.server import Connections, Key
from mlxd.http.validation import ParsedRequest, parse_request
from mlxd.residency import views
from mlxd.residency.lease import Lease, Ticket
from mlxd.residency.states import Outcome

log = logging.getLogger("mlxd.http")

bp = Blueprint("openai", __name__)

#: a stream waiting for its model's load gets a progress comment this often (at least once a second)
PROGRESS_EVERY_S = 0.5


def model_object(st: AppState, name: str, status: dict[str, Any] | None = None) -> dict[str, Any]:
    """The OpenAI model object of ``name``: its current status, or the ``status`` given."""
    if status is None:
        status = st.manager.model_status(name)
    return {
        "id": name,
        "object": "model",
        "created": int(st.started_at),
        "owned_by": "mlxd",
        "status": status["state"],
        "loaded": status["loaded"],
        "pinned": status["pinned"],
        "memory_bytes": status["memory_bytes"],
        "memory_source": status["memory_source"],
        "memory": status["memory"],
        "last_used_at": status["last_used_at"],
        "last_error": status["last_error"],
    }


@bp.get("/v1/models")
async def list_models() -> Any:
    st = state()
    return {"object": "list", "data": [model_object(st, n) for n in st.manager.core.models]}


@bp.get("/v1/models/<path:model_id>")
async def get_model(model_id: str) -> Any:
    st = state()
    if not st.manager.has_model(model_id):
        raise ModelNotFound(model_id)
    return model_object(st, model_id)


async def read_json_body() -> object:
    if request.mimetype != "application/json":
        from mlxd.errors import UnsupportedMediaType

        raise UnsupportedMediaType(
            f"send the body as JSON with 'Content-Type: application/json' (got '{request.mimetype or 'none'}')"
        )
    raw = await request.get_data(as_text=False)
    if not raw:
        raise InvalidRequest("the request body is empty; send a JSON object")
    param = GENERATION_ROUTES.get(request.path)
    if param is not None and isinstance(raw, bytes) and len(raw) > bodyscan.INLINE_BYTES:
        await _check_large_body(raw, param)
    try:
        return json.loads(raw)
    except ValueError as e:  # bad UTF-8, bad JSON, or an integer past Python's 4300 digits
        raise InvalidRequest(f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise InvalidRequest("the request body is nested too deeply") from None


#: the routes whose bodies carry a prompt, and the field it is in
GENERATION_ROUTES = {"/v1/chat/completions": "messages", "/v1/completions": "prompt"}
#: child processes reading large bodies at once (each holds a copy of its body)
_LARGE_BODY_READERS = trio.CapacityLimiter(2)


async def _check_large_body(raw: bytes, param: str) -> None:
    """Refuse a large body whose prompt cannot fit its model, from facts read in a child process."""
    async with _LARGE_BODY_READERS:
        done = await trio.run_process(
            [sys.executable, "-I", "-S", bodyscan.__file__],
            stdin=raw, capture_stdout=True, capture_stderr=True, check=False,
        )
    try:
        found = json.loads(done.stdout)
    except ValueError:
        log.warning("reading a large request body failed (exit %s): %s", done.returncode,
                    done.stderr.decode(errors="replace")[-300:])
        return  # the daemon parses it itself
    if "error" in found:
        raise InvalidRequest(found["error"])
    mc = state().config.model(found["model"]) if found["model"] is not None else None
    if mc is not None:
        check_chars(mc.name, found["prompt_chars"], limits_for(mc), param)


async def parse(kind: str) -> ParsedRequest:
    st = state()
    body = await read_json_body()
    name = body.get("model") if isinstance(body, dict) else None
    mc = st.config.model(name) if isinstance(name, str) else None
    parsed = parse_request(
        body,
        kind=kind,
        allow_images=bool(mc and mc.mllm),
        request_id=request_id(),
        headers=request.headers,
    )
    if not st.manager.has_model(parsed.model):
        raise ModelNotFound(parsed.model)
    if mc is not None:  # before the lease: no model is loaded for a prompt that cannot fit
        check_prompt_chars(parsed.model, parsed.generation, limits_for(mc))
    if mc is not None and mc.mllm and parsed.generation.kind == "chat":
        from mlxd.engines.images import check_request_images, image_parts

        if image_parts(parsed.generation.messages):
            # Headers only: the engine decodes once the request is admitted (holds its lease).
            images = await trio.to_thread.run_sync(
                lambda: check_request_images(parsed.generation.messages, image_dir=mc.image_dir)
            )
            parsed = replace(parsed, generation=replace(parsed.generation, images=tuple(images)))
    return parsed


def request_id() -> str:
    rid = request.headers.get("X-Request-Id", "")
    if rid and len(rid) <= 128 and rid.isprintable():
        return rid
    return "req-" + uuid.uuid4().hex[:24]


def _check_queue(st: AppState, lease: Lease) -> None:
    mc = st.config.model(lease.model)
    limit = mc.max_queue if mc is not None else 64
    if lease.engine.queue_depth() >= limit:
        raise Overloaded(f"'{lease.model}' already has {limit} requests queued; retry shortly")


async def _prepare(st: AppState, lease: Lease, parsed: ParsedRequest) -> ParsedRequest:
    """After the lease, before any response: the queue bound and the engine's prompt checks.

    A refusal here is a plain HTTP error (400 ``context_length_exceeded``, 503
    ``overloaded``), also for a stream, and ends the lease.
    """
    try:
        _check_queue(st, lease)
        with lease.scope():  # tokenizing a long prompt is cancellable, and preemptible
            generation = await lease.engine.prepare(parsed.generation)
    except BaseException as e:
        lease.finish(e)
        raise
    return replace(parsed, generation=generation)


class ResponseBuilder:
    """Builds the OpenAI response objects of one generation: stream chunks or the whole reply."""

    def __init__(self, kind: str, model: str, include_usage: bool) -> None:
        self.kind = kind
        self.model = model
        self.include_usage = include_usage
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())

    def _base(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": None}

    def chunk(self, text: str | None, finish: str | None = None, *, first: bool = False) -> bytes:
        if self.kind == "chat":
            delta: dict[str, Any] = {}
            if first:
                delta = {"role": "assistant", "content": ""}
            elif text is not None:
                delta = {"content": text}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            obj = self._base("chat.completion.chunk")
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            obj = self._base("text_completion")
        obj["choices"] = [choice]
        if self.include_usage:
            obj["usage"] = None
        return sse.data(obj)

    def usage_chunk(self, fin: Finished) -> bytes:
        obj = self._base("chat.completion.chunk" if self.kind == "chat" else "text_completion")
        obj["choices"] = []
        obj["usage"] = usage(fin)
        return sse.data(obj)

    def whole(self, text: str, fin: Finished) -> dict[str, Any]:
        if self.kind == "chat":
            obj = self._base("chat.completion")
            message = {"role": "assistant", "content": text, "refusal": None}
            obj["choices"] = [{"index": 0, "message": message, "logprobs": None,
                               "finish_reason": fin.finish_reason}]
        else:
            obj = self._base("text_completion")
            obj["choices"] = [{"index": 0, "text": text, "logprobs": None,
                               "finish_reason": fin.finish_reason}]
        obj["usage"] = usage(fin)
        return obj


def usage(fin: Finished) -> dict[str, Any]:
    return {
        "prompt_tokens": fin.prompt_tokens,
        "completion_tokens": fin.completion_tokens,
        "total_tokens": fin.prompt_tokens + fin.completion_tokens,
        # prompt tokens whose KV came from the model's prompt cache (OpenAI's field)
        "prompt_tokens_details": {"cached_tokens": fin.cached_tokens},
    }


async def generate(kind: str) -> Any:
    st = state()
    if st.draining:
        raise ShuttingDown("mlxd is shutting down")
    parsed = await parse(kind)
    t_request = trio.current_time()
    access_log.note(model=parsed.model)
    prefs = parsed.preferences
    ticket = st.manager.enqueue(
        parsed.model,
        request_id=parsed.generation.request_id,
        route=request.path,
        cancel_outcome=Outcome.DISCONNECTED,  # a cancelled request: its client went away
        client=auth.client(),
        keep_alive_s=prefs.keep_alive_s,
        contention=prefs.contention,
    )
    try:
        await (ticket.moved if parsed.stream else ticket.done).wait()
    except BaseException as e:
        ticket.cancel(e)
        raise
    builder = ResponseBuilder(kind, parsed.model, parsed.include_usage)
    if parsed.stream:
        connection = Connections.key_of(request.scope)
        if ticket.done.is_set():  # served or refused at once: a refusal keeps its status code
            lease = ticket.result()
            access_log.note(lease=lease)
            parsed = await _prepare(st, lease, parsed)
            body = stream_body(st, lease, parsed, builder, t_request, connection)
        else:  # the model is loading: stream its progress as SSE comments until the lease comes
            body = stream_after_load(st, ticket, parsed, builder, t_request, connection)
        # Start the body now, up to its first chunk: a started generator always runs
        # its ``finally`` (Quart closes it, or Trio's finalizer does when it is dropped),
        # so the lease is released even if the client leaves before the body is sent.
        first = await body.__anext__()
        return sse.response(
            _prepend(first, body), {"X-Request-Id": parsed.generation.request_id or ""}
        )
    lease = ticket.result()
    access_log.note(lease=lease)
    parsed = await _prepare(st, lease, parsed)
    text: list[str] = []
    fin: Finished | None = None
    t_first: float | None = None
    try:
        async with lease:
            with lease.scope():
                async with aclosing(lease.engine.generate(parsed.generation)) as events:
                    async for ev in events:
                        if isinstance(ev, TextDelta):
                            if t_first is None:
                                t_first = trio.current_time()
                            text.append(ev.text)
                        else:
                            fin = ev
            if fin is None:
                raise EngineError("the engine ended the generation unexpectedly")
            lease.set_usage(fin.prompt_tokens, fin.completion_tokens)
    except MlxdError:
        raise
    except Exception as e:
        raise engine_failed(e) from e
    _observe(st, parsed.model, t_request, t_first, fin)
    return Response(
        json.dumps(builder.whole("".join(text), fin)),
        mimetype="application/json",
        headers={"X-Request-Id": parsed.generation.request_id or ""},
    )


def engine_failed(e: Exception) -> EngineError:
    """An engine's own exception, logged with an id, as the 502 its client gets."""
    ref = uuid.uuid4().hex[:12]
    log.error("generation failed (error id %s)", ref, exc_info=e)
    return EngineError(f"the engine failed: {type(e).__name__} (error id {ref})")


def _observe(st: AppState, model: str, t0: float, t_first: float | None, fin: Finished) -> None:
    now = trio.current_time()
    st.metrics.observe_generation(
        model,
        None if t_first is None else t_first - t0,
        fin.completion_tokens,
        now - (t_first if t_first is not None else t0),
    )


async def _prepend(first: bytes, rest: AsyncGenerator[bytes, None]) -> AsyncIterator[bytes]:
    try:
        yield first
        async for chunk in rest:
            yield chunk
    finally:
        await rest.aclose()


async def _abandon_stream(
    st: AppState, events: AsyncGenerator[GenerationEvent, None], connection: Key | None
) -> None:
    """The manager ended this stream's lease: cancel the engine's job, close the connection."""
    with contextlib.suppress(RuntimeError):  # running in the body's task: its scope is cancelled
        await events.aclose()
    if connection is not None:
        st.connections.abort(connection)


async def stream_after_load(
    st: AppState,
    ticket: Ticket,
    parsed: ParsedRequest,
    builder: ResponseBuilder,
    t_request: float,
    connection: Key | None,
) -> AsyncGenerator[bytes, None]:
    """Load progress as SSE comments while ``ticket`` waits, then the generation's stream."""
    error: BaseException | None = None
    try:
        while not ticket.done.is_set():
            yield progress_comment(st, ticket.model)
            with trio.move_on_after(PROGRESS_EVERY_S):
                await ticket.done.wait()
        try:
            lease = ticket.result()
            access_log.note(lease=lease)  # the body runs in the request's context
            parsed = await _prepare(st, lease, parsed)
        except MlxdError as e:  # the load failed, shutdown, a prompt too long: in-band now
            yield sse.data(e.body())
            return
        async with aclosing(stream_body(st, lease, parsed, builder, t_request, connection)) as body:
            async for chunk in body:
                yield chunk
    except BaseException as e:  # cancelled, or closed before its end: the client left
        error = e
        raise
    finally:
        ticket.cancel(error)  # leaves the queue, or ends a lease no body took


def progress_comment(st: AppState, model: str) -> bytes:
    """``: loading demo 40% eta 1.2s`` (an SSE comment, which clients ignore)."""
    est = views.load_estimate(st.manager, model)
    return sse.comment(est.describe() if est is not None else f"waiting for {model}")


async def stream_body(
    st: AppState,
    lease: Lease,
    parsed: ParsedRequest,
    builder: ResponseBuilder,
    t_request: float,
    connection: Key | None = None,
) -> AsyncGenerator[bytes, None]:
    error: BaseException | None = None
    t_first: float | None = None
    events = lease.engine.generate(parsed.generation)
    lease.on_abandon(lambda: _abandon_stream(st, events, connection))
    try:
        # The first chunk needs no await (see generate()): the role delta, or a comment.
        yield builder.chunk(None, first=True) if builder.kind == "chat" else sse.comment("mlxd")
        while True:
            with lease.scope():  # preemption cancels this wait and raises Preempted
                ev: GenerationEvent = await events.__anext__()
            if isinstance(ev, TextDelta):
                if t_first is None:
                    t_first = trio.current_time()
                if ev.text:
                    yield builder.chunk(ev.text)
                continue
            lease.set_usage(ev.prompt_tokens, ev.completion_tokens)
            yield builder.chunk(None, ev.finish_reason)
            if parsed.include_usage:
                yield builder.usage_chunk(ev)
            yield sse.DONE
            _observe(st, builder.model, t_request, t_first, ev)
            return
    except StopAsyncIteration:
        log.error("engine for %s ended without a Finished event", lease.model)
        error = EngineError("the engine ended the generation unexpectedly")
        yield sse.data(error.body())
    except MlxdError as e:
        error = e
        yield sse.data(e.body())
    except Exception as e:
        error = e
        yield sse.data(engine_failed(e).body())
    except BaseException as e:  # cancelled, or closed before its end: the client left
        error = e
        raise
    finally:
        # Closing the engine's iterator sets its stop flag; bounded, as every shield is.
        with trio.CancelScope(shield=True), trio.move_on_after(5), contextlib.suppress(RuntimeError):
            await events.aclose()
        lease.finish(error)


@bp.post("/v1/chat/completions")
async def chat_completions() -> Any:
    return await generate("chat")


@bp.post("/v1/completions")
async def completions() -> Any:
    return await generate("completion")
