"""The OpenAI-compatible routes: models, chat completions, completions.

A generation runs under a lease through :func:`mlxd.http.generation.run`
(whole or streamed; see there for how the lease ends); this module gives it
the OpenAI shapes (:class:`ResponseBuilder`). A preempted stream ends between
two tokens with an SSE error event ``{"error": {..., "code": "preempted"}}``
that the OpenAI client raises.
"""

from __future__ import annotations

import json
import logging
import sys
import time
import uuid
from dataclasses import replace
from typing import Any

import trio
from quart import Blueprint, request

from mlxd.config import ModelConfig
from mlxd.engines.base import (
    Finished,
    FinishReason,
    GenerationRequest,
    TextDelta,
    TokenLogprob,
    ToolCall,
    ToolCallDelta,
)
from mlxd.engines.text.prompt_limits import check_chars, check_prompt_chars, limits_for
from mlxd.errors import InvalidRequest, MlxdError, ModelNotFound, ShuttingDown
from mlxd.http import bodyscan, generation, sse
from mlxd.http.bodies_openai import (
    AssistantMessage,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatLogprobs,
    ModelList,
    ModelObject,
    TextChunkChoice,
    TextCompletion,
    TextCompletionChunk,
    TextLogprobs,
    TopLogprob,
    Usage,
    cached_tokens,
)
from mlxd.http.bodies_openai import ToolCall as ToolCallBody
from mlxd.http.context import AppState, state
from mlxd.http.generation import Collected
from mlxd.http.structured import schema_checks_off_loop
from mlxd.http.text import check_text
from mlxd.http.validation import ParsedRequest, parse_request

log = logging.getLogger("mlxd.http")

bp = Blueprint("openai", __name__)


def model_object(st: AppState, name: str, status: dict[str, Any] | None = None) -> ModelObject:
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
async def list_models() -> ModelList:
    st = state()
    return {"object": "list", "data": [model_object(st, n) for n in st.manager.model_names()]}


@bp.get("/v1/models/<path:model_id>")
async def get_model(model_id: str) -> ModelObject:
    st = state()
    if not st.manager.has_model(model_id):
        raise ModelNotFound(model_id)
    return model_object(st, model_id)


async def read_json_body() -> object:
    """The request's JSON body, checked: the one place where every route reads one."""
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
        body = json.loads(raw)
    except ValueError as e:  # bad UTF-8, bad JSON, or an integer past Python's 4300 digits
        raise InvalidRequest(f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise InvalidRequest("the request body is nested too deeply") from None
    check_text(raw, body)  # every string of every route: valid Unicode (mlxd.http.text)
    return body


#: the routes whose bodies carry a prompt, and the field it is in
GENERATION_ROUTES = {"/v1/chat/completions": "messages", "/v1/completions": "prompt",
                     "/v1/messages": "messages"}


async def _check_large_body(raw: bytes, param: str) -> None:
    """Refuse a large body whose prompt cannot fit its model, from facts read in a child process
    (as many at once as the app's ``large_body_readers`` let)."""
    async with state().large_body_readers:
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
    rid, headers = request_id(), request.headers
    parsed = await schema_checks_off_loop(lambda: parse_request(
        body, kind=kind, allow_images=bool(mc and mc.mllm), request_id=rid, headers=headers,
    ), request.content_length or 0, st.schema_checkers)
    if not st.manager.has_model(parsed.model):
        raise ModelNotFound(parsed.model)
    if mc is not None and mc.embedding:
        raise InvalidRequest(f"model '{mc.name}' is an embedding model: use POST /v1/embeddings",
                             param="model")
    if mc is not None:  # before the lease: no model is loaded for a prompt that cannot fit
        check_prompt_chars(parsed.model, parsed.generation, limits_for(mc))
    if mc is not None:
        parsed = replace(parsed, generation=await with_checked_images(mc, parsed.generation))
    return parsed


async def with_checked_images(mc: ModelConfig, gen: GenerationRequest) -> GenerationRequest:
    """A vision model's chat request with its images checked (sizes, count; headers only:
    the engine decodes them once the request is admitted and holds its lease)."""
    if not mc.mllm or gen.kind != "chat":
        return gen
    from mlxd.engines.text.images import check_request_images, image_parts

    if not image_parts(gen.messages):
        return gen
    images = await trio.to_thread.run_sync(
        lambda: check_request_images(gen.messages, image_dir=mc.image_dir)
    )
    return replace(gen, images=tuple(images))


def request_id() -> str:
    rid = request.headers.get("X-Request-Id", "")
    if rid and len(rid) <= 128 and rid.isprintable():
        return rid
    return "req-" + uuid.uuid4().hex[:24]


class ResponseBuilder:
    """Builds the OpenAI response objects of one generation: stream chunks or the whole reply."""

    def __init__(self, kind: str, model: str, include_usage: bool) -> None:
        self.kind = kind
        self.model = model
        self.include_usage = include_usage
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self._offset = 0  # completions logprobs: text_offset of the next token

    def _chat_chunk(self, choices: list[ChatChunkChoice]) -> ChatCompletionChunk:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.model, "system_fingerprint": None, "choices": choices}

    def _text_chunk(self, choices: list[TextChunkChoice]) -> TextCompletionChunk:
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model, "system_fingerprint": None, "choices": choices}

    def chunk(
        self,
        text: str | None,
        finish: FinishReason | None = None,
        *,
        first: bool = False,
        logprobs: tuple[TokenLogprob, ...] = (),
        call: ToolCallDelta | None = None,
    ) -> bytes:
        obj: ChatCompletionChunk | TextCompletionChunk
        if self.kind == "chat":
            delta: ChatDelta = {}
            if first:
                delta = {"role": "assistant", "content": ""}
            elif call is not None:
                delta = {"tool_calls": [{"index": call.index, **tool_call(call.call)}]}
            elif text is not None:
                delta = {"content": text}
            obj = self._chat_chunk([{"index": 0, "delta": delta, "finish_reason": finish,
                                     "logprobs": self.chat_logprobs(logprobs) if logprobs else None}])
        else:
            obj = self._text_chunk([{"index": 0, "text": text or "", "finish_reason": finish,
                                     "logprobs": self.text_logprobs(logprobs) if logprobs else None}])
        if self.include_usage:
            obj["usage"] = None
        return sse.data(obj)

    def usage_chunk(self, fin: Finished) -> bytes:
        obj = self._chat_chunk([]) if self.kind == "chat" else self._text_chunk([])
        obj["usage"] = usage(fin)
        return sse.data(obj)

    # ---- the Renderer protocol (mlxd.http.generation) ------------------------------------

    def first(self) -> bytes:
        """The role delta (chat), or a comment (completions)."""
        return self.chunk(None, first=True) if self.kind == "chat" else sse.comment("mlxd")

    def text(self, ev: TextDelta) -> list[bytes]:
        return [self.chunk(ev.text, logprobs=ev.logprobs)] if ev.text or ev.logprobs else []

    def call(self, ev: ToolCallDelta) -> list[bytes]:
        return [self.chunk(None, call=ev)]

    def finish(self, fin: Finished) -> list[bytes]:
        out = [self.chunk(None, fin.finish_reason)]
        if self.include_usage:
            out.append(self.usage_chunk(fin))
        return [*out, sse.DONE]

    def error(self, err: MlxdError) -> bytes:
        return sse.data(err.body())

    def whole(self, out: Collected, fin: Finished) -> ChatCompletion | TextCompletion:
        text = "".join(out.text)
        entries = tuple(out.logprobs)
        if self.kind == "chat":
            message: AssistantMessage = {"role": "assistant", "content": text, "refusal": None}
            if out.calls:
                message["content"] = text or None
                message["tool_calls"] = [tool_call(c.call) for c in out.calls]
            return {"id": self.id, "object": "chat.completion", "created": self.created,
                    "model": self.model, "system_fingerprint": None,
                    "choices": [{"index": 0, "message": message, "finish_reason": fin.finish_reason,
                                 "logprobs": self.chat_logprobs(entries) if out.wants_logprobs else None}],
                    "usage": usage(fin)}
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model, "system_fingerprint": None,
                "choices": [{"index": 0, "text": text, "finish_reason": fin.finish_reason,
                             "logprobs": self.text_logprobs(entries) if out.wants_logprobs else None}],
                "usage": usage(fin)}

    def chat_logprobs(self, entries: tuple[TokenLogprob, ...]) -> ChatLogprobs:
        """OpenAI's chat shape (``content``)."""
        return {"content": [{**_entry(e), "top_logprobs": [_entry(t) for t in e.top]} for e in entries],
                "refusal": None}

    def text_logprobs(self, entries: tuple[TokenLogprob, ...]) -> TextLogprobs:
        """The completions shape (``tokens``, ...); ``text_offset`` counts on from the last call."""
        offsets = []
        for e in entries:
            offsets.append(self._offset)
            self._offset += len(e.token)
        return {
            "tokens": [e.token for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{t.token: t.logprob for t in e.top} for e in entries],
            "text_offset": offsets,
        }


def _entry(e: TokenLogprob) -> TopLogprob:
    return {"token": e.token, "logprob": e.logprob, "bytes": list(e.bytes)}


def tool_call(call: ToolCall) -> ToolCallBody:
    return {"id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


def usage(fin: Finished) -> Usage:
    return {
        "prompt_tokens": fin.prompt_tokens,
        "completion_tokens": fin.completion_tokens,
        "total_tokens": fin.prompt_tokens + fin.completion_tokens,
        # prompt tokens whose KV came from the model's prompt cache (OpenAI's field)
        "prompt_tokens_details": {"cached_tokens": fin.cached_tokens},
        "mlxd_cached_tokens": cached_tokens(fin),
    }


async def generate(kind: str) -> Any:
    if state().draining:
        raise ShuttingDown("mlxd is shutting down")
    parsed = await parse(kind)
    builder = ResponseBuilder(kind, parsed.model, parsed.include_usage)
    return await generation.run(
        parsed.model, parsed.generation, builder, stream=parsed.stream, prefs=parsed.preferences
    )


@bp.post("/v1/chat/completions")
async def chat_completions() -> Any:
    return await generate("chat")


@bp.post("/v1/completions")
async def completions() -> Any:
    return await generate("completion")
