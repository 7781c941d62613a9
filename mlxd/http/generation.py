"""One generation under a lease, whole or streamed, for any API shape (OpenAI, Anthropic).

A generation holds a lease for its whole life. Whole: the handler holds it
inside ``lease.scope()``. Streamed: the response body (an async generator,
which must not hold a cancel scope across ``yield``) owns the lease, opens
``lease.scope()`` around each wait for the next event, and ends the lease in
its ``finally`` -- which runs the moment the client disconnects (Quart cancels
the body at its current await). Preemption cancels the scope, so the stream
ends between two tokens with the API's error event. Either way the lease ends
with ``lease.finish(exc)`` (the one outcome rule is
:func:`mlxd.residency.lease.outcome_of`; a cancelled request is ``disconnected``).

A body that cannot send (the client stopped reading) does not hold the model
hostage: the manager ends a preempted lease itself, and the body's abandon hook
(:func:`_abandon_stream`) closes the engine's iterator (cancelling its job) and
the connection.

The routes differ only in their :class:`Renderer`: how the stream starts,
how each event and the end are written, how an error mid-stream looks, and
the shape of a whole response.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping
from contextlib import AbstractContextManager, aclosing
from dataclasses import dataclass, field
from typing import Any, Protocol

import trio
from quart import Response, request

from mlxd.engines.base import (
    Finished,
    GenerationEvent,
    GenerationRequest,
    TextDelta,
    TokenLogprob,
    ToolCallDelta,
)
from mlxd.errors import EngineError, MlxdError, ModelNotResident, Overloaded, ShuttingDown
from mlxd.http import access_log, auth, sse
from mlxd.http.context import AppState, state
from mlxd.http.preferences import Preferences
from mlxd.http.server import Connections, Key
from mlxd.residency import views
from mlxd.residency.lease import Lease, Ticket
from mlxd.residency.states import Outcome, State

log = logging.getLogger("mlxd.http")


@dataclass
class Collected:
    """What a whole (non-streamed) response gathers from the engine's events."""

    wants_logprobs: bool
    text: list[str] = field(default_factory=list)
    #: ``time.monotonic()`` of the first token or call (None: the reply had none)
    first_token_at: float | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    calls: list[ToolCallDelta] = field(default_factory=list)


class Renderer(Protocol):
    """An API's shapes for one generation."""

    model: str

    def first(self) -> bytes:
        """The first bytes of a stream (sent once its job is queued, before its first event)."""
        ...

    def text(self, ev: TextDelta) -> list[bytes]: ...

    def call(self, ev: ToolCallDelta) -> list[bytes]: ...

    def finish(self, fin: Finished) -> list[bytes]: ...

    def error(self, err: MlxdError) -> bytes: ...

    def whole(self, out: Collected, fin: Finished) -> Mapping[str, object]:
        """The whole reply: the body its family's ``TypedDict`` describes (mlxd.http.body_schemas)."""
        ...


def _progress_comments(renderer: Renderer) -> bool:
    """Whether a stream may start while its model loads, with progress comments (SSE routes);
    a renderer that says ``progress_comments = False`` (NDJSON) starts once the lease is had."""
    return bool(getattr(renderer, "progress_comments", True))


def _stream_response(renderer: Renderer, body: AsyncIterator[bytes], headers: dict[str, str]) -> Response:
    """The streamed response: SSE, or the renderer's own (``respond(body, headers)``)."""
    respond = getattr(renderer, "respond", None)
    return respond(body, headers) if respond is not None else sse.response(body, headers)


def _check_queue(st: AppState, lease: Lease) -> None:
    mc = st.config.model(lease.model)
    limit = mc.max_queue if mc is not None else 64
    if lease.engine.queue_depth() >= limit:
        raise Overloaded(f"'{lease.model}' already has {limit} requests queued; retry shortly")


async def prepare_under(st: AppState, lease: Lease, gen: GenerationRequest) -> GenerationRequest:
    """After the lease, before any response: the queue bound and the engine's checks
    (tools, grammar, prompt limits; tokenizing is cancellable and preemptible).

    A refusal here is a plain HTTP error (400 ``context_length_exceeded`` or
    ``tools_not_supported``, 503 ``overloaded``), also for a stream, and
    ends the lease.
    """
    try:
        _check_queue(st, lease)
        with lease.scope():  # the lease's KV is reserved under it (mlxd.residency.kv)
            return await lease.engine.prepare(dataclasses.replace(gen, lease_id=lease.id))
    except BaseException as e:
        lease.finish(e)
        raise


#: a stream waiting for its model's load gets a progress comment this often (at least once a second)
PROGRESS_EVERY_S = 0.5

#: what a request passes to a model's checks beyond the engine's: the Anthropic stream
#: counts its prompt tokens there
Prepare = Callable[[Lease, GenerationRequest], Awaitable[None]]


def _asked(st: AppState, model: str, request_id: str | None, prefs: Preferences) -> dict[str, Any]:
    """What every model route asks of the manager with its lease (one place).

    ``X-Mlxd-Require-Resident`` is checked here, right before the (synchronous)
    enqueue: no checkpoint lies between the check and the queue, so a model seen
    ``loaded`` is the one the lease is granted on, and a refusal loads nothing.
    """
    if prefs.require_resident and st.manager.has_model(model):
        resident = st.manager.state_of(model)
        if resident is not State.LOADED:
            raise ModelNotResident(model, resident.value)
    return {
        "request_id": request_id,
        "route": request.path,
        "cancel_outcome": Outcome.DISCONNECTED,  # a cancelled request: its client went away
        "client": auth.client(),
        "keep_alive_s": prefs.keep_alive_s,
        "contention": prefs.contention,
    }


async def acquire(
    st: AppState, model: str, request_id: str | None, prefs: Preferences | None = None
) -> Lease:
    """A lease on ``model`` for this request (routes without a generation: count_tokens,
    embeddings); the model and lease go to the access log."""
    access_log.note(model=model)
    lease = await st.manager.acquire(model, **_asked(st, model, request_id, prefs or Preferences()))
    access_log.note(lease=lease)
    return lease


def _lease_of(ticket: Ticket) -> Lease:
    lease = ticket.result()
    access_log.note(lease=lease)  # a stream body runs in the request's context too
    return lease


async def _checked(
    st: AppState, lease: Lease, gen: GenerationRequest, prepare: Prepare | None
) -> GenerationRequest:
    """The engine's checks, then the route's ``prepare``; a refusal ends the lease."""
    gen = await prepare_under(st, lease, gen)
    if prepare is not None:
        try:
            with lease.scope():
                await prepare(lease, gen)
        except BaseException as e:
            lease.finish(e)
            raise
    return gen


async def run(
    model: str,
    gen: GenerationRequest,
    renderer: Renderer,
    *,
    stream: bool,
    prefs: Preferences | None = None,
    prepare: Prepare | None = None,
) -> Any:
    """Acquire ``model``, check the request against the loaded engine, and generate.

    ``prefs``: the request's keep_alive and X-Mlxd-Contention. A stream whose
    model is loading starts at once and gets the load's progress as SSE comment
    lines (``: loading demo 40% eta 1.2s``) until its lease comes; a request
    refused before that gets its error status as usual. ``prepare(lease,
    request)`` runs after the engine's checks, before the response starts.
    """
    st = state()
    if st.draining:
        raise ShuttingDown("mlxd is shutting down")
    t_request = trio.current_time()
    access_log.note(model=model)
    ticket = st.manager.enqueue(model, **_asked(st, model, gen.request_id, prefs or Preferences()))
    # A resident model's lease comes with the ticket: from here until the job is queued
    # (for a whole response: its checks are done), the engine expects it.
    with _on_its_way(ticket.lease):
        try:
            await (ticket.moved if stream and _progress_comments(renderer) else ticket.done).wait()
        except BaseException as e:
            ticket.cancel(e)
            raise
        if not stream:
            lease = _lease_of(ticket)
            gen = await _checked(st, lease, gen, prepare)
        elif ticket.done.is_set():  # served or refused at once: a refusal keeps its status code
            lease = _lease_of(ticket)
            gen = await _checked(st, lease, gen, prepare)
            body = _stream_body(st, lease, gen, renderer, t_request, Connections.key_of(request.scope))
        else:  # the model is loading: stream its progress as SSE comments until the lease comes
            body = _stream_after_load(st, ticket, gen, renderer, t_request,
                                      Connections.key_of(request.scope), prepare)
        # A stream's body starts now, up to its first chunk (its job queued): a started
        # generator always runs its ``finally`` (Quart closes it, or Trio's finalizer does
        # when it is dropped), so the lease is released even if the client leaves before
        # the body is sent.
        first = await body.__anext__() if stream else b""
    headers = {"X-Request-Id": gen.request_id or ""}
    if not stream:
        out, fin, t_first = await _whole(lease, gen)
        _observe(st, model, t_request, t_first, fin)
        return Response(json.dumps(renderer.whole(out, fin)), mimetype="application/json", headers=headers)
    return _stream_response(renderer, _prepend(first, body), headers)


def _on_its_way(lease: Lease | None) -> AbstractContextManager[None]:
    """Tells a batched engine that this request is on its way to its queue, so that the
    requests of a burst prefill together (``expecting``: mlxd.engines.scheduling.batch_loop)."""
    expecting = getattr(lease.engine, "expecting", None) if lease is not None else None
    return expecting() if expecting is not None else contextlib.nullcontext()


async def _stream_after_load(
    st: AppState,
    ticket: Ticket,
    gen: GenerationRequest,
    renderer: Renderer,
    t_request: float,
    connection: Key | None,
    prepare: Prepare | None,
) -> AsyncGenerator[bytes, None]:
    """Load progress as SSE comments while ``ticket`` waits, then the generation's stream."""
    error: BaseException | None = None
    try:
        while not ticket.done.is_set():
            yield progress_comment(st, ticket.model)
            with trio.move_on_after(PROGRESS_EVERY_S):
                await ticket.done.wait()
        try:
            lease = _lease_of(ticket)
            gen = await _checked(st, lease, gen, prepare)
        except MlxdError as e:  # the load failed, shutdown, a prompt too long: in-band now
            yield renderer.error(e)
            return
        async with aclosing(_stream_body(st, lease, gen, renderer, t_request, connection)) as body:
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


async def _whole(lease: Lease, gen: GenerationRequest) -> tuple[Collected, Finished, float | None]:
    """Gather the whole generation; the lease ends with it (completed, or however it failed)."""
    out = Collected(gen.logprobs is not None)
    fin: Finished | None = None
    t_first: float | None = None
    try:
        async with lease:
            with lease.scope():
                async with aclosing(lease.engine.generate(gen)) as events:
                    async for ev in events:
                        if out.first_token_at is None and not isinstance(ev, Finished):
                            out.first_token_at = time.monotonic()
                        if isinstance(ev, TextDelta):
                            if t_first is None:
                                t_first = trio.current_time()
                                access_log.note(first_token=True)
                            out.text.append(ev.text)
                            out.logprobs.extend(ev.logprobs)
                        elif isinstance(ev, ToolCallDelta):
                            access_log.note(first_token=True)  # a reply that is all calls
                            out.calls.append(ev)
                        else:
                            fin = ev
            if fin is None:
                raise EngineError("the engine ended the generation unexpectedly")
            lease.set_usage(fin.prompt_tokens, fin.completion_tokens)
            access_log.note(engine_started=fin.started_at)
    except MlxdError:
        raise
    except Exception as e:
        raise engine_failed(e) from e
    return out, fin, t_first


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


class Events(Protocol):
    """A generation's events, as an engine streams them: closing them early stops it."""

    def __anext__(self) -> Awaitable[GenerationEvent]: ...

    async def aclose(self) -> None: ...


async def _start(lease: Lease, gen: GenerationRequest) -> Events:
    """The generation's events, its job already queued where the engine can do that
    ahead of iteration (``start_generation``: mlx-lm text models), so the model
    prefills while the stream's first bytes go out; else the engine's generator."""
    start = getattr(lease.engine, "start_generation", None)
    if start is None:
        return lease.engine.generate(gen)
    events: Events = await start(gen)
    return events


async def _abandon_stream(st: AppState, events: Events | None, connection: Key | None) -> None:
    """The manager ended this stream's lease: cancel the engine's job, close the connection."""
    if events is not None:
        with contextlib.suppress(RuntimeError):  # in the body's task: its scope is cancelled
            await events.aclose()
    if connection is not None:
        st.connections.abort(connection)


async def _stream_body(
    st: AppState,
    lease: Lease,
    gen: GenerationRequest,
    renderer: Renderer,
    t_request: float,
    connection: Key | None = None,
) -> AsyncGenerator[bytes, None]:
    error: BaseException | None = None
    t_first: float | None = None
    events: Events | None = None
    try:
        with lease.scope():  # the job goes on the model's queue before the first bytes go out
            events = await _start(lease, gen)
        lease.on_abandon(lambda: _abandon_stream(st, events, connection))
        yield renderer.first()
        while True:
            with lease.scope():  # preemption cancels this wait and raises Preempted
                ev: GenerationEvent = await events.__anext__()
            if isinstance(ev, TextDelta):
                if t_first is None:
                    t_first = trio.current_time()
                    access_log.note(first_token=True)
                if frames := renderer.text(ev):
                    yield b"".join(frames)
                continue
            if isinstance(ev, ToolCallDelta):
                access_log.note(first_token=True)  # a reply that is all calls
                if frames := renderer.call(ev):
                    yield b"".join(frames)
                continue
            lease.set_usage(ev.prompt_tokens, ev.completion_tokens)
            access_log.note(engine_started=ev.started_at)
            # the last frames (finish, usage, [DONE] or message_stop) in one write: each
            # body chunk is a socket write, which a short request feels
            yield b"".join(renderer.finish(ev))
            _observe(st, renderer.model, t_request, t_first, ev)
            return
    except StopAsyncIteration:
        log.error("engine for %s ended without a Finished event", lease.model)
        error = EngineError("the engine ended the generation unexpectedly")
        yield renderer.error(error)
    except MlxdError as e:
        error = e
        yield renderer.error(e)
    except Exception as e:
        error = e
        yield renderer.error(engine_failed(e))
    except BaseException as e:  # cancelled, or closed before its end: the client left
        error = e
        raise
    finally:
        # Closing the engine's iterator sets its stop flag; bounded, as every shield is.
        if events is not None:
            with (
                trio.CancelScope(shield=True),
                trio.move_on_after(5),
                contextlib.suppress(RuntimeError),
            ):
                await events.aclose()
        lease.finish(error)
