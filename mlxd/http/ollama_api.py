"""Ollama's API on mlxd: ``/api/version``, ``/api/tags``, ``/api/show``, ``/api/ps``,
``/api/chat``, ``/api/generate``, ``/api/embed``, ``/api/embeddings``, ``/api/pull``.

A translation layer, not a second server: a generation runs through
:func:`mlxd.http.generation.run` (the same residency, leases with the route
recorded, contention errors with ``Retry-After``, journal, access log and
metrics as the OpenAI routes) with Ollama's request fields
(:mod:`.ollama_shapes`) and response shapes (:mod:`.ollama_render`);
embeddings take a lease as ``/v1/embeddings`` does. Discovery is
:mod:`.ollama_catalog`, pulls :mod:`.ollama_pull`.

Ollama's load call (``/api/chat`` with no messages, ``/api/generate`` with no
prompt) takes a lease with no tokens, so the model loads and the call's
``keep_alive`` applies as any request's; with ``keep_alive: 0`` it is the
unload call: mlxd's unload (as ``POST /admin/models/{id}/unload``; a model in
use drains first). ``keep_alive: 0`` on a generation unloads the model when
it ends (reason ``idle_timeout``), negative keeps it until evicted; without
one, the model's ``idle_unload_seconds`` applies (not Ollama's 5 minutes:
mlxd's config decides).

Errors are Ollama's ``{"error": "..."}`` with mlxd's status codes (the app's one
handler renders them on these paths: :data:`mlxd.http.envelopes.FAMILIES`). ``/api/delete``,
``/api/copy``, ``/api/create``, ``/api/push`` and ``/api/blobs``: 501, since
mlxd reads its models from its config.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any, Literal

from quart import Blueprint, request

from mlxd.engines.base import GenerationRequest
from mlxd.engines.text.prompt_limits import check_prompt_chars, limits_for
from mlxd.engines.text.prompts import uses_tools
from mlxd.errors import (
    ContextLengthExceeded,
    InvalidRequest,
    MlxdError,
    ModelNotFound,
    NotImplementedHere,
    ShuttingDown,
    ToolsNotSupported,
)
from mlxd.http import access_log, generation, ollama_catalog
from mlxd.http.bodies_ollama import (
    OllamaEmbed,
    OllamaEmbedding,
    OllamaError,
    OllamaRunningList,
    OllamaShow,
    OllamaTags,
    OllamaVersion,
    PullProgress,
)
from mlxd.http.context import AppState, state
from mlxd.http.embeddings_api import embed_under_lease, parse_input
from mlxd.http.fields import bad, read
from mlxd.http.ollama_pull import pull_events, repo_of
from mlxd.http.ollama_render import (
    OllamaRenderer,
    ThinkingSplit,
    line,
    load_reply,
    ndjson_response,
    ns,
)
from mlxd.http.ollama_shapes import (
    EMBED,
    EMBED_BODY,
    EMBEDDINGS_BODY,
    PULL,
    SHOW,
    OllamaRequest,
    model_name,
    parse,
    resolve,
)
from mlxd.http.openai_api import read_json_body, request_id, with_checked_images
from mlxd.http.preferences import preferences
from mlxd.http.shapes import check
from mlxd.http.structured import is_model_name, schema_checks_off_loop
from mlxd.residency.lease import Lease

bp = Blueprint("ollama", __name__)

PREFIX = "/api/"
FROM_CONFIG = ("mlxd reads its models from its config: edit the models: list there and "
               "POST /admin/reload (or send SIGHUP)")


def _arrived() -> float:
    entry = access_log.current()
    return entry.arrived if entry is not None and entry.arrived else time.monotonic()


async def _body() -> dict[str, Any]:
    if state().draining:
        raise ShuttingDown("mlxd is shutting down")
    body = await read_json_body()
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    return body


def _named(body: dict[str, Any]) -> object:
    """The model a show or pull body names: ``model``, or the older ``name`` (Continue sends it)
    when ``model`` is absent; a ``name`` beside ``model`` must still be a model name."""
    if body.get("model") is None:
        return body.get("name")
    if body.get("name") is not None and not is_model_name(body["name"]):
        raise bad("name", "must be a model name")
    return body["model"]


# ---- discovery ----------------------------------------------------------------------------


@bp.get("/api/version")
async def version() -> OllamaVersion:
    return ollama_catalog.version()


@bp.get("/api/tags")
async def tags() -> OllamaTags:
    return await ollama_catalog.tags(state())


@bp.get("/api/ps")
async def ps() -> OllamaRunningList:
    return await ollama_catalog.ps(state())


@bp.post("/api/show")
async def show() -> OllamaShow:
    st = state()
    body = await _body()
    read(body, "verbose", SHOW["verbose"], None)
    mc = st.config.model(model_name(_named(body), st.manager.has_model))
    assert mc is not None  # model_name found it
    return await ollama_catalog.show(st, mc)


# ---- generation ---------------------------------------------------------------------------


async def _load_call(st: AppState, parsed: OllamaRequest, *, chat: bool) -> Any:
    """Ollama's load call (a lease with no tokens), or its unload call (keep_alive 0)."""
    access_log.note(model=parsed.model)
    if parsed.prefs.keep_alive_s == 0:
        await st.manager.unload(parsed.model)
        if st.journal is not None:
            await st.journal.wait_committed()
        return load_reply(parsed.model, chat=chat, unloaded=True)
    lease = await generation.acquire(st, parsed.model, request_id(), parsed.prefs)
    async with lease:
        lease.set_usage(0, 0)
    return load_reply(parsed.model, chat=chat, unloaded=False)


def _no_grammar(model: str, gen: GenerationRequest) -> None:
    """What a fake or vision engine refuses, refused here in Ollama's field names (and on the
    load call too: it is checked as the generation it stands for)."""
    if uses_tools(gen):
        raise ToolsNotSupported(f"tools: model '{model}' takes no tools (its engine has no tool support)",
                                param="tools")
    if gen.constraint is not None:
        raise bad("format", f"model '{model}' has no grammar-constrained decoding")


async def _thinking_split(st: AppState, model: str) -> ThinkingSplit:
    mc = st.config.model(model)
    template = await ollama_catalog.template_of(mc) if mc is not None else None
    if template is None or not template.thinking:
        raise bad("think", f"model '{model}' does not support thinking (its tokenizer has no thinking markers)")
    return ThinkingSplit(template.think_start, template.think_end)


async def _generate(kind: Literal["chat", "generate"]) -> Any:
    st = state()
    t0 = _arrived()
    body = await _body()

    def vision(name: str) -> bool:
        mc = st.config.model(name)
        return mc is not None and mc.mllm

    rid, headers = request_id(), request.headers
    parsed = await schema_checks_off_loop(lambda: parse(
        body, kind, known=st.manager.has_model, allow_images=vision, request_id=rid,
        headers=headers,
    ), request.content_length or 0, st.schema_checkers)
    mc = st.config.model(parsed.model)
    if mc is not None and mc.embedding:
        raise bad("model", f"'{mc.name}' is an embedding model: use POST /api/embed")
    gen = parsed.generation
    if mc is not None and (mc.mllm or not mc.engine_kind.constrains):
        _no_grammar(mc.name, gen)  # named as Ollama's clients know the fields
    split = await _thinking_split(st, parsed.model) if parsed.think else None
    if parsed.load_call:
        return await _load_call(st, parsed, chat=kind == "chat")
    if mc is not None:  # before the lease: no model is loaded for a prompt that cannot fit
        check_prompt_chars(parsed.model, gen, limits_for(mc))
        gen = await with_checked_images(mc, gen)
    renderer = OllamaRenderer(parsed.model, kind, split=split, t0=t0)
    num_ctx = parsed.num_ctx

    async def prepare(lease: Lease, prepared: GenerationRequest) -> None:
        renderer.lease_at = time.monotonic()
        if num_ctx is None:
            return
        n = len(prepared.prompt_ids) if prepared.prompt_ids is not None \
            else await lease.engine.count_tokens(prepared)
        if n > num_ctx:
            raise ContextLengthExceeded(
                f"options.num_ctx: the prompt has {n} tokens, more than num_ctx ({num_ctx})",
                param="options.num_ctx")

    return await generation.run(parsed.model, gen, renderer, stream=parsed.stream,
                                prefs=parsed.prefs, prepare=prepare)


@bp.post("/api/chat")
async def chat() -> Any:
    return await _generate("chat")


@bp.post("/api/generate")
async def generate() -> Any:
    return await _generate("generate")


# ---- embeddings ---------------------------------------------------------------------------


def _found(name: str | None, body: dict[str, Any]) -> str:
    if name is None:
        raise ModelNotFound(str(body["model"]))
    return name


async def _embed(inputs: list[str], name: str | None, body: dict[str, Any],
                 t0: float, dims: int | None = None) -> OllamaEmbed:
    """The vectors of ``inputs`` under a lease on the model ``name`` resolved to (None: a 404,
    once the body's other fields are checked)."""
    prefs = preferences(body, request.headers)
    model = _found(name, body)
    vectors, tokens, lease_at = await embed_under_lease(model, inputs, prefs, dims)
    return {"model": model, "embeddings": vectors, "total_duration": ns(time.monotonic() - t0),
            "load_duration": ns(lease_at - t0), "prompt_eval_count": tokens}


@bp.post("/api/embed")
async def embed() -> OllamaEmbed:
    st = state()
    t0 = _arrived()
    body = await _body()
    name = resolve(body.get("model"), st.manager.has_model)
    check(EMBED_BODY, body)
    inputs = parse_input(body["input"])
    dims = read(body, "dimensions", EMBED["dimensions"], None)
    return await _embed(inputs, name, body, t0, dims)  # type: ignore[arg-type]


@bp.post("/api/embeddings")
async def embeddings() -> OllamaEmbedding:
    """The older route: one ``prompt``, one ``embedding``."""
    st = state()
    t0 = _arrived()
    body = await _body()
    name = resolve(body.get("model"), st.manager.has_model)
    check(EMBEDDINGS_BODY, body)
    return {"embedding": (await _embed([body["prompt"]], name, body, t0))["embeddings"][0]}


# ---- pull, and what mlxd does not do --------------------------------------------------------


async def _pull_lines(events: AsyncIterator[PullProgress]) -> AsyncIterator[bytes]:
    async with aclosing(events) as it:  # type: ignore[type-var]
        try:
            async for ev in it:
                yield line(ev)
        except MlxdError as e:
            error: OllamaError = {"error": e.message}
            yield line(error)


@bp.post("/api/pull")
async def pull() -> Any:
    st = state()
    body = await _body()
    repo = repo_of(_named(body))
    for key, kind in PULL.items():
        read(body, key, kind, None)
    if body.get("stream", True) is not False:
        return ndjson_response(_pull_lines(pull_events(st.config, repo)))
    last: PullProgress = {"status": ""}
    async with aclosing(pull_events(st.config, repo)) as events:  # type: ignore[type-var]
        async for ev in events:
            last = ev
    return last


@bp.route("/api/delete", methods=["DELETE"])
@bp.post("/api/copy")
@bp.post("/api/create")
@bp.post("/api/push")
async def not_here() -> Any:
    raise NotImplementedHere(f"{request.method} {request.path} is not served: {FROM_CONFIG}")


@bp.route("/api/blobs/<digest>", methods=["HEAD", "POST"])
async def blobs(digest: str) -> Any:
    raise NotImplementedHere(f"{request.method} /api/blobs is not served: {FROM_CONFIG}")
