"""Ollama's request bodies (``/api/chat``, ``/api/generate``) validated into engine requests.

The translation, field by field (every problem is a 400 whose message names
the field, rendered as Ollama's ``{"error": "..."}``):

* ``model``: a configured name; ``name:latest`` is the same model
  (:func:`model_name`).
* ``messages`` (chat): roles ``system``, ``user``, ``assistant``, ``tool``;
  ``images`` (base64) on ``mllm`` models only; an assistant's ``tool_calls``
  with ``arguments`` as an object; a ``tool`` message answers the earlier call
  it names with ``tool_name`` (else the first one unanswered). ``thinking`` in
  the history is accepted and not sent to the model.
* ``prompt``, ``system``, ``images``, ``raw`` (generate): ``raw: true`` sends
  the prompt without the chat template; ``template``, ``suffix`` and
  ``context`` are refused (400 naming them): mlxd uses the model's own
  template, has no fill-in-the-middle, and does not hand out token contexts.
* An empty ``messages`` / ``prompt`` is Ollama's load call, or its unload call
  with ``keep_alive: 0`` (:attr:`OllamaRequest.load_call`).
* ``format``: ``"json"`` or a JSON Schema, enforced by the grammar.
* ``tools``: as OpenAI's (``{"type": "function", "function": {...}}``).
  Ollama has no ``tool_choice``; mlxd takes one (OpenAI's values) in
  ``options.tool_choice`` (Ollama's clients pass unknown options through), so
  a client can force a call.
* ``options``: ``temperature``, ``top_p``, ``top_k`` (``1``: greedy; not used
  by vision models), ``seed``, ``num_predict``, ``stop``, ``num_ctx`` (a cap on
  the prompt's tokens); other options are ignored, as Ollama does.
* ``think``: a boolean or a level; a model without thinking markers refuses
  ``true`` (400), as Ollama does.
* ``keep_alive``: Ollama's forms (:mod:`mlxd.http.preferences`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from mlxd.engines.base import ChatMessage, Constraint, GenerationRequest, Tool, ToolCall
from mlxd.errors import InvalidRequest, ModelNotFound
from mlxd.http.embeddings_api import TEXTS
from mlxd.http.fields import (
    Boolean,
    Choice,
    Integer,
    Kind,
    Number,
    Stops,
    Text,
    bad,
    nullable,
    read,
)
from mlxd.http.preferences import Headers, Preferences, preferences
from mlxd.http.shapes import AnyOf, Anything, Array, Const, Obj, Tagged, check
from mlxd.http.structured import (
    CHAT_FIELDS,
    MAX_TOOLS,
    NAME,
    TOOL,
    TOOLS,
    TOP_NEEDS_LOGPROBS,
    ToolChoice,
    chat_logprobs,
    check_schema,
    constraint,
    is_model_name,
    openai_tool_choice,
    openai_tools,
    tool_choice_kind,
)
from mlxd.http.validation import MAX_TOKENS_LIMIT

#: what a generation may produce when ``num_predict`` is not set (Ollama's default is
#: "until the context is full"; mlxd reserves KV for max_tokens, so it asks for a bound)
DEFAULT_NUM_PREDICT = 2048
MAX_STOP = 16
ROLES = ("system", "user", "assistant", "tool")
THINK_LEVELS = ("low", "medium", "high", "max")
#: the first base64 characters of image formats, for the data URL's media type
_IMAGE_MAGIC = (("iVBOR", "image/png"), ("/9j/", "image/jpeg"), ("R0lGOD", "image/gif"),
                ("UklGR", "image/webp"))


@dataclass(frozen=True, slots=True)
class OllamaRequest:
    """A validated ``/api/chat`` or ``/api/generate`` body."""

    model: str
    generation: GenerationRequest
    #: Ollama's load call (or unload call, with keep_alive 0): no messages, no prompt
    load_call: bool
    stream: bool
    prefs: Preferences
    #: the client asked for the model's thinking apart (``think``)
    think: bool
    #: ``options.num_ctx``: the prompt may have at most this many tokens
    num_ctx: int | None


def resolve(raw: object, known: Callable[[str], bool], param: str = "model") -> str | None:
    """The configured model ``raw`` names (itself, or ``name`` for ``name:latest``); None when
    no model has that name; a 400 when it is not a model name at all."""
    if not is_model_name(raw):
        raise bad(param, "is required: a model name")
    if known(raw):
        return raw
    base, colon, tag = raw.rpartition(":")
    return base if colon and tag == "latest" and known(base) else None


def model_name(raw: object, known: Callable[[str], bool], param: str = "model") -> str:
    """The configured model ``raw`` names, or a 404."""
    name = resolve(raw, known, param)
    if name is None:
        raise ModelNotFound(str(raw))
    return name


_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
#: ``options``' fields mlxd reads (read here, documented from this table); others are ignored
OPTIONS: dict[str, Kind] = {
    "temperature": Number(0, 2),
    "top_p": Number(0, 1),
    "top_k": Integer(0, _INT64_MAX),
    "seed": Integer(_INT64_MIN, _INT64_MAX),
    "num_predict": Integer(_INT64_MIN, MAX_TOKENS_LIMIT),
    "num_ctx": Integer(1, _INT64_MAX),
    "stop": Stops(MAX_STOP),
}
#: the top-level scalar fields of ``/api/generate`` (``/api/chat`` has ``stream`` only)
GENERATE: dict[str, Kind] = {"stream": Boolean(), "prompt": Text(), "system": Text(),
                             "raw": Boolean()}
#: the other routes' scalar fields (``/api/embed``, ``/api/pull``, ``/api/show``)
EMBED: dict[str, Kind] = {"truncate": Boolean(),
                          "dimensions": Integer(1, hint="must be a positive integer")}
#: ``/api/embed`` and the older ``/api/embeddings`` bodies but their model and ``keep_alive``
EMBED_BODY = Obj({"input": TEXTS, **EMBED, "options": Obj({})}, required=("input",),
                 hint="the request body must be a JSON object",
                 notes={"input": "over the model's context: 400", "dimensions": "only the model's own"})
EMBEDDINGS_BODY = Obj({"prompt": Text(1), "options": Obj({})}, required=("prompt",),
                      hint="the request body must be a JSON object")
PULL: dict[str, Kind] = {"insecure": Boolean(), "stream": Boolean()}
SHOW: dict[str, Kind] = {"verbose": Boolean()}


@dataclass(frozen=True, slots=True)
class Options:
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    max_tokens: int
    stop: tuple[str, ...]
    num_ctx: int | None


def options(body: dict[str, Any]) -> Options:
    """``options`` (checked against the body's description) mapped onto mlxd's sampling (see
    the module doc)."""
    opts = body.get("options") or {}
    given = {key: read(opts, key, kind, None) for key, kind in OPTIONS.items()}
    temperature, top_p, top_k = given["temperature"], given["top_p"], given["top_k"]
    if top_p == 0.0 or top_k == 1:
        temperature = 0.0  # only the most likely token remains: greedy
    seed, num_predict = given["seed"], given["num_predict"]
    return Options(
        temperature=1.0 if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p,
        top_k=top_k or 0,
        seed=None if seed is None else seed % 2**32,
        max_tokens=num_predict if num_predict is not None and num_predict > 0 else DEFAULT_NUM_PREDICT,
        stop=given["stop"] or (),
        num_ctx=given["num_ctx"],
    )


def response_format(v: str | dict[str, Any] | None) -> Constraint | None:
    """``format``: ``"json"`` (any JSON object) or a JSON Schema; ``""`` or null: free text."""
    if v is None or v == "":
        return None
    if v == "json":
        return Constraint("json_object", param="format")
    return Constraint("json_schema", json.dumps(check_schema(v, "format")), param="format")


def _tools(body: dict[str, Any]) -> tuple[Tool, ...]:
    return openai_tools({"tools": body.get("tools")})


def _tool_choice(body: dict[str, Any], tools: tuple[Tool, ...]) -> tuple[ToolChoice, str | None]:
    """``options.tool_choice`` (mlxd's extension: Ollama's clients pass ``options`` through)."""
    choice = (body.get("options") or {}).get("tool_choice")
    try:
        return openai_tool_choice({"tool_choice": choice}, tools)
    except InvalidRequest as e:
        raise bad("options.tool_choice", e.message.removeprefix("tool_choice: ")) from None


_IMAGES = Array(Text(1, hint="must be a base64-encoded image"), hint="must be a list of base64-encoded images")
_NO_IMAGES = Array(Anything(), max_items=0)
#: a call in an assistant message of the history: arguments as an object, the id optional
_CALL = Obj({"id": Text(), "function": Obj({"name": NAME, "arguments": Obj({})}, required=("name",),
                                           not_null=("arguments",))},
            required=("function",), hint="must be an object with 'function': {'name', 'arguments'}")
#: Ollama's clients may leave out a tool's "type": it can only be a function
_TOOL = Tagged("type", TOOL.variants, default="function")
#: only an assistant message carries tool calls (:func:`messages`)
_CALLS_RULE = {"if": {"properties": {"role": {"not": {"const": "assistant"}}}},
               "then": {"properties": {"tool_calls": nullable(_NO_IMAGES.schema())}}}
#: a forced call (``options.tool_choice``) needs tools, and takes no format (:func:`parse`)
_FORCED_RULE = {"if": {"properties": {"options": {"type": "object", "required": ["tool_choice"],
                                                  "properties": {"tool_choice": {"anyOf": [
                                                      {"const": "required"}, {"type": "object"}]}}}},
                       "required": ["options"]},
                "then": {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1},
                                                               "format": nullable({"const": ""})}}}
#: raw: true takes no system prompt and no images (:func:`_generate_prompt`)
_RAW_RULE = {"if": {"required": ["raw"], "properties": {"raw": {"const": True}}},
             "then": {"properties": {"system": nullable({"const": ""}),
                                     "images": nullable(_NO_IMAGES.schema())}}}
_OPTION_NOTES = {"top_k": "0: no limit; 1: greedy", "num_predict": f"0 or negative: {DEFAULT_NUM_PREDICT}",
                 "num_ctx": "a prompt of more tokens is a 400"}


def body_kind(kind: Literal["chat", "generate"], *, images: bool = True, tools: bool = True,
              thinking: bool = True) -> Obj:
    """A chat or generate body but ``model`` and ``keep_alive``. The validator checks the variant
    with everything; the document shows one per group of models (images; tools and format) and
    ``think: false`` only (the demo models have no thinking markers)."""
    common: dict[str, Kind] = {
        "stream": GENERATE["stream"],
        "format": AnyOf((Const(""), Const("json"), Obj({})) if tools else (Const(""),),
                        hint='must be "json" or a JSON Schema object'),
        "think": AnyOf((Boolean(), Choice(THINK_LEVELS)), hint=f"must be a boolean or one of "
                       f"{', '.join(THINK_LEVELS)}") if thinking else Const(False),
        "logprobs": CHAT_FIELDS["logprobs"], "top_logprobs": CHAT_FIELDS["top_logprobs"],
    }
    notes = {"stream": "default true (NDJSON)", "options": "other options are ignored, as Ollama does",
             "think": "true or a level: models with thinking"}
    if kind == "chat":
        message = Obj({"role": Choice(ROLES), "content": Text(), "images": _IMAGES if images else _NO_IMAGES,
                       "thinking": Text(),
                       "tool_calls": Array(_CALL, hint="must be a list of tool calls") if tools else _NO_IMAGES,
                       "tool_name": Text(), "tool_call_id": Text()},
                      required=("role",), hint="must be an object with 'role' and 'content'", rules=(_CALLS_RULE,))
        return Obj({
            **common,
            "options": Obj({**OPTIONS, "tool_choice": tool_choice_kind(tools)}, notes=_OPTION_NOTES),
            "messages": Array(message, hint="must be a list of messages"),
            "tools": Array(_TOOL, max_items=MAX_TOOLS if tools else 0, hint=TOOLS.hint),
        }, hint="the request body must be a JSON object", rules=(_FORCED_RULE, TOP_NEEDS_LOGPROBS),
            notes={**notes, "messages": "empty: the load call"})
    return Obj({
        **common,
        "options": Obj(OPTIONS, notes=_OPTION_NOTES),
        **GENERATE,
        "images": _IMAGES if images else _NO_IMAGES,
        "template": Const("", hint="mlxd applies the model's own chat template; send no template"),
        "suffix": Const("", hint="fill-in-the-middle is not supported"),
        "context": Array(Anything(), max_items=0,
                         hint="mlxd does not take token contexts; send the history to /api/chat"),
    }, hint="the request body must be a JSON object", rules=(TOP_NEEDS_LOGPROBS, _RAW_RULE),
        notes={**notes, "prompt": "empty: the load call", "template": "refused: mlxd uses the model's own "
               "template", "suffix": "refused: no fill-in-the-middle",
               "context": "refused: send the history to /api/chat"})


BODIES = {"chat": body_kind("chat"), "generate": body_kind("generate")}


def image_part(v: str) -> dict[str, Any]:
    """An Ollama image (base64 text, or a data URL) as an OpenAI ``image_url`` content part."""
    if not v.startswith("data:"):
        media = next((m for prefix, m in _IMAGE_MAGIC if v.startswith(prefix)), "image/png")
        v = f"data:{media};base64,{v}"
    return {"type": "image_url", "image_url": {"url": v}}


def _content(text: str, images: list[str] | None, param: str, allow_images: bool) -> str | list[dict[str, Any]]:
    if not images:
        return text
    if not allow_images:
        raise bad(param, "images are only accepted by vision (mllm) models")
    parts = [image_part(x) for x in images]
    return [{"type": "text", "text": text}, *parts] if text else parts


def _calls(v: list[dict[str, Any]] | None, i: int) -> tuple[ToolCall, ...]:
    return tuple(ToolCall(c.get("id") or f"call_{i}_{j}", c["function"]["name"],
                          json.dumps(c["function"].get("arguments", {})))
                 for j, c in enumerate(v or ()))


def messages(raw: list[dict[str, Any]] | None, *, allow_images: bool) -> tuple[ChatMessage, ...]:
    """``messages`` (checked against the body's description) into chat messages (an empty list
    is allowed: the load call)."""
    out: list[ChatMessage] = []
    pending: list[ToolCall] = []  # calls of the latest assistant message not answered yet
    for i, m in enumerate(raw or ()):
        p = f"messages[{i}]"
        role = m["role"]
        content = _content(m.get("content") or "", m.get("images"), f"{p}.images", allow_images)
        calls = _calls(m.get("tool_calls"), i)
        if calls and role != "assistant":
            raise bad(f"{p}.tool_calls", "only assistant messages carry tool calls")
        if role == "assistant":
            pending = list(calls)
        if role != "tool":
            out.append(ChatMessage(role, content, calls))
            continue
        name, call_id = m.get("tool_name"), m.get("tool_call_id")
        answered = next((c for c in pending if c.id == call_id or (call_id is None and c.name == name)),
                        pending[0] if pending and call_id is None else None)
        if answered is not None:
            pending.remove(answered)
        out.append(ChatMessage("tool", content, tool_call_id=call_id or (answered.id if answered else f"call_{i}"),
                               name=name or (answered.name if answered else None)))
    return tuple(out)


def _stream(body: dict[str, Any]) -> bool:
    return read(body, "stream", GENERATE["stream"], True)  # Ollama streams unless told not to


def parse(
    body: object,
    kind: Literal["chat", "generate"],
    *,
    known: Callable[[str], bool],
    allow_images: Callable[[str], bool],
    request_id: str,
    headers: Headers,
) -> OllamaRequest:
    """Validate a chat or generate body (``known``: is a model configured;
    ``allow_images``: is it a vision model)."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    name = resolve(body.get("model"), known)  # every field is checked before an unknown model's 404
    check(BODIES[kind], body)
    stream = _stream(body)
    prefs = preferences(body, headers)
    wants_thinking = body.get("think") not in (None, False)
    opts = options(body)
    images_ok = name is not None and allow_images(name)
    if kind == "chat":
        msgs = messages(body.get("messages"), allow_images=images_ok)
        prompt: str | None = None
        empty = not msgs
    else:
        prompt, msgs, empty = _generate_prompt(body, images_ok)
    tools = _tools(body) if kind == "chat" else ()
    choice, tool = _tool_choice(body, tools) if kind == "chat" else ("auto", None)
    c = constraint(choice, tools, response_format(body.get("format")), format_param="format")
    logprobs = chat_logprobs(body)
    if name is None:
        raise ModelNotFound(str(body["model"]))
    gen = GenerationRequest(
        kind="completion" if prompt is not None else "chat",
        prompt=prompt,
        messages=msgs,
        max_tokens=opts.max_tokens,
        temperature=opts.temperature,
        top_p=opts.top_p,
        top_k=opts.top_k,
        stop=opts.stop,
        seed=opts.seed,
        request_id=request_id,
        tools=tools,
        tool_choice=choice,
        tool_name=tool,
        constraint=c,
        logprobs=logprobs,
    )
    return OllamaRequest(name, gen, empty, stream, prefs, wants_thinking, opts.num_ctx)


def _generate_prompt(body: dict[str, Any], images_ok: bool) -> tuple[str | None, tuple[ChatMessage, ...], bool]:
    """``prompt``, ``system``, ``images`` and ``raw``: a raw prompt, or chat messages; and
    whether the body is the load call (no prompt, no images)."""
    prompt, system, raw = (read(body, key, GENERATE[key], None) for key in ("prompt", "system", "raw"))
    prompt = prompt or ""
    images = body.get("images")
    empty = not prompt and not images
    if raw:
        if system:
            raise bad("system", "is not used with raw: true (the prompt is sent as it is)")
        if images:
            raise bad("images", "cannot be sent with raw: true (images need the chat template)")
        return prompt, (), empty
    msgs = [ChatMessage("system", system)] if system else []
    msgs.append(ChatMessage("user", _content(prompt, images, "images", images_ok)))
    return None, tuple(msgs), empty
