"""The Anthropic Messages routes: ``POST /v1/messages`` and ``/v1/messages/count_tokens``.

Same residency, leases and journal as the OpenAI routes (the lease row's
``route`` is ``/v1/messages``); a generation runs through
:func:`mlxd.http.generation.run` with Anthropic's shapes
(:class:`~mlxd.http.anthropic_shapes.MessagesRenderer`). A stream sends
``message_start`` (with the prompt's token count, so it is counted before the
stream starts), ``ping``, then per content block ``content_block_start``,
``content_block_delta``..., ``content_block_stop``, and ends with
``message_delta`` (stop reason, usage) and ``message_stop``; an error mid-stream
is an ``error`` event. Errors before the stream are rendered in Anthropic's
envelope by the app's one error handler (:mod:`mlxd.http.envelopes`).
"""

from __future__ import annotations

from typing import Any

from quart import Blueprint, request

from mlxd.engines.base import GenerationRequest
from mlxd.errors import ModelNotFound, ShuttingDown
from mlxd.http import generation
from mlxd.http.anthropic_shapes import MessagesRenderer, ParsedMessages, parse_messages
from mlxd.http.bodies_anthropic import TokenCount
from mlxd.http.context import state
from mlxd.http.openai_api import read_json_body, request_id
from mlxd.http.preferences import preferences
from mlxd.http.structured import schema_checks_off_loop
from mlxd.residency.lease import Lease

bp = Blueprint("anthropic", __name__)

async def _parse(*, counting: bool) -> ParsedMessages:
    st = state()
    if st.draining:
        raise ShuttingDown("mlxd is shutting down")
    body, rid = await read_json_body(), request_id()
    parsed = await schema_checks_off_loop(
        lambda: parse_messages(body, request_id=rid, counting=counting), request.content_length or 0,
        st.schema_checkers)
    if not st.manager.has_model(parsed.model):
        raise ModelNotFound(parsed.model)
    return parsed


@bp.post("/v1/messages")
async def messages() -> Any:
    parsed = await _parse(counting=False)
    renderer = MessagesRenderer(parsed.model)

    async def count(lease: Lease, prepared: GenerationRequest) -> None:
        renderer.markers = prepared.think_markers  # a thinking model's reasoning: thinking blocks
        if parsed.stream:  # message_start carries the prompt's size
            renderer.input_tokens = (
                len(prepared.prompt_ids) if prepared.prompt_ids is not None
                else await lease.engine.count_tokens(prepared)
            )

    prefs = preferences({}, request.headers)  # X-Mlxd-Keep-Alive, -Contention, -Require-Resident
    return await generation.run(
        parsed.model, parsed.generation, renderer, stream=parsed.stream, prefs=prefs, prepare=count
    )


@bp.post("/v1/messages/count_tokens")
async def count_tokens() -> TokenCount:
    """The prompt's tokens under the model's own template (the model is loaded to count)."""
    parsed = await _parse(counting=True)
    st = state()
    lease = await generation.acquire(
        st, parsed.model, parsed.generation.request_id, preferences({}, request.headers)
    )
    async with lease:  # ends with the one outcome rule (mlxd.residency.lease.outcome_of)
        with lease.scope():
            n = await lease.engine.count_tokens(parsed.generation)
        lease.set_usage(n, 0)
    return {"input_tokens": n}
