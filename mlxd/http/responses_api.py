"""OpenAI's Responses API: ``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``.

A response is a chat generation under a lease, through
:func:`mlxd.http.generation.run` like ``/v1/chat/completions``: the same
residency, queue, contention errors, journal (the lease row's ``route`` is
``/v1/responses``), scope (``inference``), access log and metrics. The
request's items become the chat the model's template reads
(:mod:`mlxd.http.responses_items`, fields in :mod:`mlxd.http.responses_fields`);
the Responses shapes and events are :mod:`mlxd.http.responses_events`.

``store`` (default true) keeps a finished response in the journal database
(:mod:`mlxd.http.responses_store`), readable with ``GET``, removable with
``DELETE``, and continued by a later request's ``previous_response_id``: the
stored conversation (each earlier response's input and output items) comes
before the new input; ``instructions`` and tools are the new request's own, as
on OpenAI. Errors before a stream starts use the OpenAI envelope; an unknown,
deleted or pruned id is a 404 ``response_not_found``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import trio
from quart import Blueprint, current_app, request

from mlxd.engines.base import GenerationRequest
from mlxd.engines.text.prompt_limits import check_prompt_chars, limits_for
from mlxd.errors import InvalidRequest, ModelNotFound, ShuttingDown
from mlxd.http import generation
from mlxd.http.bodies_responses import DeletedResponse, ResponseObject
from mlxd.http.context import state
from mlxd.http.openai_api import read_json_body, request_id
from mlxd.http.responses_events import ResponsesRenderer
from mlxd.http.responses_fields import ParsedResponses, parse_responses
from mlxd.http.responses_items import MAX_ITEMS, chat_messages
from mlxd.http.responses_store import ResponseStore
from mlxd.http.structured import schema_checks_off_loop

bp = Blueprint("responses", __name__)

_EXTENSION = "mlxd.responses"


def store() -> ResponseStore:
    """This app's stored responses (made on first use, beside the journal)."""
    found: ResponseStore | None = current_app.extensions.get(_EXTENSION)
    if found is None:
        st = state()
        found = ResponseStore(st.journal, max_chars=st.config.server.max_body_bytes)
        current_app.extensions[_EXTENSION] = found
    return found


def _thinking(effort: str | None) -> bool | None:
    """A template's thinking switch from ``reasoning.effort``: off for none/minimal, on from
    low up; unset (the template's default) when the request names no effort."""
    return None if effort is None else effort not in ("none", "minimal")


async def _generation(parsed: ParsedResponses) -> GenerationRequest:
    """The chat of this request: the stored conversation (previous_response_id), then its input."""
    st = state()
    items = parsed.items
    if parsed.previous_response_id is not None:
        items = await store().history(parsed.previous_response_id) + items
        if len(items) > MAX_ITEMS:
            raise InvalidRequest(f"input: with the conversation before it, {len(items):,} items; "
                                 f"at most {MAX_ITEMS:,}", param="input")
    gen = GenerationRequest(
        kind="chat",
        messages=chat_messages(parsed.instructions, items),
        max_tokens=parsed.max_output_tokens,
        temperature=parsed.temperature,
        top_p=parsed.top_p,
        seed=parsed.seed,
        request_id=request_id(),
        tools=parsed.tools,
        tool_choice=parsed.tool_choice,
        tool_name=parsed.tool_name,
        constraint=parsed.constraint,
        logprobs=parsed.logprobs,
        thinking=_thinking(parsed.echo.get("reasoning", {}).get("effort")),
    )
    mc = st.config.model(parsed.model)
    if mc is None:
        return gen
    check_prompt_chars(parsed.model, gen, limits_for(mc))  # before the lease: nothing loads for it
    if mc.mllm:
        from mlxd.engines.text.images import check_request_images, image_parts

        if image_parts(gen.messages):
            images = await trio.to_thread.run_sync(
                lambda: check_request_images(gen.messages, image_dir=mc.image_dir))
            gen = replace(gen, images=tuple(images))
    return gen


@bp.post("/v1/responses")
async def create_response() -> Any:
    st = state()
    if st.draining:
        raise ShuttingDown("mlxd is shutting down")
    body = await read_json_body()
    name = body.get("model") if isinstance(body, dict) else None
    mc = st.config.model(name) if isinstance(name, str) else None
    headers = request.headers
    parsed = await schema_checks_off_loop(
        lambda: parse_responses(body, allow_images=bool(mc and mc.mllm), headers=headers),
        request.content_length or 0,
        st.schema_checkers,
    )
    if not st.manager.has_model(parsed.model):
        raise ModelNotFound(parsed.model)
    if mc is not None and mc.embedding:
        raise InvalidRequest(f"model '{mc.name}' is an embedding model: use POST /v1/embeddings",
                             param="model")
    gen = await _generation(parsed)
    stored = store()
    renderer = ResponsesRenderer(parsed)
    renderer.on_done = lambda response: stored.save(parsed.items, response, renderer.created_at)
    try:
        return await generation.run(parsed.model, gen, renderer, stream=parsed.stream,
                                    prefs=parsed.preferences)
    except InvalidRequest as e:  # the engine's checks name the chat field of a grammar
        if e.param == "response_format":
            e.param, e.message = "text.format", e.message.replace("response_format", "text.format")
        raise


@bp.get("/v1/responses/<path:response_id>")
async def get_response(response_id: str) -> ResponseObject:
    return await store().get(response_id)


@bp.delete("/v1/responses/<path:response_id>")
async def delete_response(response_id: str) -> DeletedResponse:
    await store().delete(response_id)
    return {"id": response_id, "object": "response", "deleted": True}
