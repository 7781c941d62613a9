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
from mlxd.http.fields import Boolean, Integer, Kind, Number, Stops, Text, bad, read
from mlxd.http.preferences import Headers, Preferences, preferences
from mlxd.http.shapes import check
from mlxd.http.structured import (
    TOOL_CHOICE,
    TOOLS,
    ToolChoice,
    chat_logprobs,
    check_schema,
    constraint,
    function_name,
    is_model_name,
    openai_tool_choice,
    openai_tools,
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
    """``options`` mapped onto mlxd's sampling (see the module doc)."""
    opts = body.get("options")
    if opts is None:
        opts = {}
    if not isinstance(opts, dict):
        raise bad("options", "must be an object")
    given = {key: read(opts, key, kind, None, prefix="options.") for key, kind in OPTIONS.items()}
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


def response_format(v: object) -> Constraint | None:
    """``format``: ``"json"`` (any JSON object) or a JSON Schema; ``""`` or null: free text."""
    if v is None or v == "":
        return None
    if v == "json":
        return Constraint("json_object", param="format")
    if not isinstance(v, dict):
        raise bad("format", 'must be "json" or a JSON Schema object')
    return Constraint("json_schema", json.dumps(check_schema(v, "format")), param="format")


def _tools(body: dict[str, Any]) -> tuple[Tool, ...]:
    raw = body.get("tools")
    if isinstance(raw, list):  # Ollama's clients may leave out "type": it can only be a function
        raw = [{"type": "function", **t} if isinstance(t, dict) and "type" not in t else t for t in raw]
    if raw is not None:
        check(TOOLS, raw, "tools")
    return openai_tools({"tools": raw})


def _tool_choice(body: dict[str, Any], tools: tuple[Tool, ...]) -> tuple[ToolChoice, str | None]:
    """``options.tool_choice`` (mlxd's extension: Ollama's clients pass ``options`` through)."""
    opts = body.get("options")
    choice = opts.get("tool_choice") if isinstance(opts, dict) else None
    if choice is not None:
        check(TOOL_CHOICE, choice, "options.tool_choice")
    try:
        return openai_tool_choice({"tool_choice": choice}, tools)
    except InvalidRequest as e:
        raise bad("options.tool_choice", e.message.removeprefix("tool_choice: ")) from None


def think(v: object) -> bool:
    if v is None or isinstance(v, bool):
        return bool(v)
    if isinstance(v, str) and v in THINK_LEVELS:
        return True
    raise bad("think", f"must be a boolean or one of {', '.join(THINK_LEVELS)}")


def image_part(v: object, param: str) -> dict[str, Any]:
    """An Ollama image (base64 text, or a data URL) as an OpenAI ``image_url`` content part."""
    if not isinstance(v, str) or not v:
        raise bad(param, "must be a base64-encoded image")
    if not v.startswith("data:"):
        media = next((m for prefix, m in _IMAGE_MAGIC if v.startswith(prefix)), "image/png")
        v = f"data:{media};base64,{v}"
    return {"type": "image_url", "image_url": {"url": v}}


def _content(text: str, images: object, param: str, allow_images: bool) -> str | list[dict[str, Any]]:
    if images is None or images == []:
        return text
    if not isinstance(images, list):
        raise bad(param, "must be a list of base64-encoded images")
    if not allow_images:
        raise bad(param, "images are only accepted by vision (mllm) models")
    parts = [image_part(x, f"{param}[{i}]") for i, x in enumerate(images)]
    return [{"type": "text", "text": text}, *parts] if text else parts


def _calls(v: object, p: str, i: int) -> tuple[ToolCall, ...]:
    if v is None:
        return ()
    if not isinstance(v, list):
        raise bad(p, "must be a list of tool calls")
    out = []
    for j, c in enumerate(v):
        q = f"{p}[{j}]"
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict):
            raise bad(q, "must be an object with 'function': {'name', 'arguments'}")
        cid = c.get("id")
        if cid is not None and not isinstance(cid, str):
            raise bad(f"{q}.id", "must be a string")
        name = function_name(fn.get("name"), f"{q}.function.name")
        args = fn.get("arguments", {})
        if not isinstance(args, dict):
            raise bad(f"{q}.function.arguments", "must be an object")
        args = json.dumps(args)
        out.append(ToolCall(cid or f"call_{i}_{j}", name, args))
    return tuple(out)


def messages(raw: object, *, allow_images: bool) -> tuple[ChatMessage, ...]:
    """``messages`` into chat messages (an empty list is allowed: the load call)."""
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise bad("messages", "must be a list of messages")
    out: list[ChatMessage] = []
    pending: list[ToolCall] = []  # calls of the latest assistant message not answered yet
    for i, m in enumerate(raw):
        p = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(p, "must be an object with 'role' and 'content'")
        role = m.get("role")
        if role not in ROLES:
            raise bad(f"{p}.role", f"must be one of {', '.join(ROLES)}")
        text = m.get("content")
        if text is None:
            text = ""
        if not isinstance(text, str):
            raise bad(f"{p}.content", "must be a string")
        if m.get("thinking") is not None and not isinstance(m["thinking"], str):
            raise bad(f"{p}.thinking", "must be a string")
        content = _content(text, m.get("images"), f"{p}.images", allow_images)
        calls = _calls(m.get("tool_calls"), f"{p}.tool_calls", i)
        if calls and role != "assistant":
            raise bad(f"{p}.tool_calls", "only assistant messages carry tool calls")
        if role == "assistant":
            pending = list(calls)
        if role != "tool":
            out.append(ChatMessage(role, content, calls))
            continue
        name = m.get("tool_name")
        if name is not None and not isinstance(name, str):
            raise bad(f"{p}.tool_name", "must be a string")
        call_id = m.get("tool_call_id")
        if call_id is not None and not isinstance(call_id, str):
            raise bad(f"{p}.tool_call_id", "must be a string")
        answered = next((c for c in pending if c.id == call_id or (call_id is None and c.name == name)),
                        pending[0] if pending and call_id is None else None)
        if answered is not None:
            pending.remove(answered)
        out.append(ChatMessage("tool", content, tool_call_id=call_id or (answered.id if answered else f"call_{i}"),
                               name=name or (answered.name if answered else None)))
    return tuple(out)


def _stream(body: dict[str, Any]) -> bool:
    return read(body, "stream", GENERATE["stream"], True)  # Ollama streams unless told not to


def _refused(body: dict[str, Any]) -> None:
    """Generate fields mlxd cannot honour: a 400 naming them, never silently ignored."""
    for key, why in (("template", "mlxd applies the model's own chat template; send no template"),
                     ("suffix", "fill-in-the-middle is not supported")):
        if body.get(key) is not None and body[key] != "":
            raise bad(key, why)
    if body.get("context") is not None and body["context"] != []:
        raise bad("context", "mlxd does not take token contexts; send the history to /api/chat")


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
    stream = _stream(body)
    prefs = preferences(body, headers)
    wants_thinking = think(body.get("think"))
    opts = options(body)
    images_ok = name is not None and allow_images(name)
    if kind == "chat":
        msgs = messages(body.get("messages"), allow_images=images_ok)
        prompt: str | None = None
        empty = not msgs
    else:
        _refused(body)
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
