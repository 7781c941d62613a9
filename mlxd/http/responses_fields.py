"""Responses API request fields (``POST /v1/responses``), validated like the chat route's.

Every problem is an :class:`~mlxd.errors.InvalidRequest` whose ``param``
names the field (``text.format.schema``, ``tools[2].name``). What mlxd acts
on: ``input`` and ``instructions`` (:mod:`mlxd.http.responses_items`),
``max_output_tokens``, ``temperature``, ``top_p``, ``seed`` (an extension),
function ``tools`` and ``tool_choice``, ``text.format``, ``include``
(``message.output_text.logprobs``, with ``top_logprobs``), ``stream``,
``store`` and ``previous_response_id``. Accepted, checked and echoed in the
response, without changing what the model does: ``metadata``, ``user``,
``parallel_tool_calls``, ``truncation``, ``reasoning``, ``prompt_cache_key``,
``safety_identifier``, ``service_tier``, ``max_tool_calls``,
``stream_options``, ``text.verbosity``. Refused because mlxd cannot do them:
``background: true``, a stored ``prompt``, a ``conversation``.

Tools: ``function`` tools go to the model's chat template, with the chat
route's parsing and grammar; every other tool type (OpenAI's built-ins,
``custom`` and ``namespace`` tools) is left out of the prompt, so a client
that offers them by default still works, and forcing one with
``tool_choice`` is a 400 naming it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from mlxd.engines.base import Constraint, Tool
from mlxd.errors import InvalidRequest
from mlxd.http.bodies_responses import ResponseEcho
from mlxd.http.fields import Boolean, Choice, Integer, Kind, Text, bad, read
from mlxd.http.preferences import Headers, Preferences, preferences
from mlxd.http.responses_items import input_items, input_kind
from mlxd.http.shapes import AnyOf, Array, Const, Map, Obj, Refused, Tagged, check
from mlxd.http.structured import (
    MAX_TOOLS,
    MAX_TOP_LOGPROBS,
    NAME,
    OBJECT_SCHEMA,
    ToolChoice,
    check_schema,
    constraint,
    is_model_name,
    make_tool,
    named_tool,
)
from mlxd.http.validation import MAX_TOKENS_LIMIT, SAMPLING

#: max_output_tokens when the request gives none: room for an agent's answer; the model
#: stops earlier at its end-of-turn token
DEFAULT_MAX_OUTPUT_TOKENS = 4096
#: OpenAI's bounds on metadata
MAX_METADATA_KEYS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512
MAX_RESPONSE_ID = 128
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
SUMMARIES = ("auto", "concise", "detailed")
LOGPROBS_INCLUDE = "message.output_text.logprobs"


@dataclass(frozen=True, slots=True)
class ParsedResponses:
    """A validated Responses request: what the model gets, and what the response echoes."""

    model: str
    #: this request's own input items, canonical (what a stored response keeps)
    items: list[dict[str, Any]]
    instructions: str | None
    max_output_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    tools: tuple[Tool, ...]
    tool_choice: ToolChoice
    tool_name: str | None
    constraint: Constraint | None
    logprobs: int | None
    stream: bool
    store: bool
    previous_response_id: str | None
    #: the request's fields as the response object shows them (tools, tool_choice, text, ...)
    echo: ResponseEcho
    preferences: Preferences = field(default_factory=Preferences)


#: the scalar fields of a Responses body (read here, documented from this table); the
#: sampling ones are the chat route's
FIELDS: dict[str, Kind] = {
    **{key: SAMPLING[key] for key in ("temperature", "top_p", "seed", "stream")},
    "max_output_tokens": Integer(1, MAX_TOKENS_LIMIT),
    "top_logprobs": Integer(0, MAX_TOP_LOGPROBS),
    "max_tool_calls": Integer(1, 2**31 - 1),
    "store": Boolean(),
    "parallel_tool_calls": Boolean(),
    "previous_response_id": Text(1, MAX_RESPONSE_ID),
    "truncation": Choice(("auto", "disabled")),
    **{key: Text() for key in ("instructions", "user", "prompt_cache_key", "safety_identifier",
                               "service_tier")},
}
#: ``reasoning``'s fields (accepted and echoed)
REASONING: dict[str, Kind] = {"effort": Choice(EFFORTS), "summary": Choice(SUMMARIES),
                              "generate_summary": Choice(SUMMARIES)}
#: ``text``'s scalar field (``format`` is read by :func:`_text`)
VERBOSITY = Choice(("low", "medium", "high"))


_FUNCTION = Obj({"name": NAME, "description": Text(), "parameters": OBJECT_SCHEMA, "strict": Boolean()},
                required=("name",))
#: a tool mlxd does not run (a built-in, custom or namespace tool): left out of the prompt
_OTHER = Obj({})
_NAMED = Obj({"name": NAME}, required=("name",))


def body_kind(*, images: bool = True, functions: bool = True, grammar: bool = True) -> Obj:
    """A Responses body but ``model`` and ``keep_alive``; the validator checks the variant with
    everything, the document shows one per group of models (:mod:`mlxd.http.openapi_responses`)."""
    # for models without function tools (the document's variant), a function is no tool at all
    no_function = {} if functions else {"function": "needs a model that takes function tools"}
    tool = Tagged("type", {"function": _FUNCTION} if functions else {}, others=_OTHER, refused=no_function)
    listed = Tagged("type", {"function": _NAMED} if functions else {}, others=_OTHER, refused=no_function)
    allowed = Obj({"mode": Choice(("auto", "required") if functions else ("auto",)),
                   "tools": Array(listed, hint='must be a list of {"type": "function", "name"}')},
                  required=("mode", "tools"))
    choices = {"function": _NAMED, "allowed_tools": allowed} if functions else {"allowed_tools": allowed}
    formats: dict[str, Obj | Tagged] = {"text": Obj({})}
    if grammar:
        formats |= {"json_object": Obj({}), "json_schema": Obj({
            "name": NAME, "schema": Obj({}, hint="must be a JSON Schema object"), "strict": Boolean(),
            "description": Text()}, required=("name", "schema"))}
    return Obj({
        **FIELDS,
        "input": input_kind(images=images, calls=functions),
        "tools": Array(tool, max_items=MAX_TOOLS,
                       hint=f"must be a list of at most {MAX_TOOLS} tools ({{\"type\": \"function\", "
                       "\"name\", \"parameters\"}})"),
        "tool_choice": AnyOf((Choice(("auto", "none", "required") if functions else ("auto", "none")),
                              Tagged("type", choices)),
                             hint="must be 'auto', 'none', 'required' or an object with a 'type'"),
        "text": Obj({"format": Tagged("type", formats), "verbosity": VERBOSITY}),
        "include": Array(Text(), hint="must be a list of strings", whole=True),
        "metadata": Map(Text(0, MAX_METADATA_VALUE), MAX_METADATA_KEYS, MAX_METADATA_KEY,
                        hint=f"must be an object of at most {MAX_METADATA_KEYS} string values"),
        "reasoning": Obj(REASONING),
        "stream_options": Obj({}),
        "background": Const(False),
        "prompt": Refused("stored prompts are not supported"),
        "conversation": Refused("conversations are not supported: use previous_response_id"),
    }, required=("input",), hint="the request body must be a JSON object",
        rules=(TOP_NEEDS_INCLUDE, REQUIRED_NEEDS_FUNCTION),
        notes={"tool_choice": "'required' needs a function tool; a named function must be declared; "
               "forcing a tool of another type is a 400 naming it",
               "background": "background responses are not supported"})


#: top_logprobs only with include: ["message.output_text.logprobs"] (:func:`parse_responses`)
TOP_NEEDS_INCLUDE = {
    "if": {"required": ["top_logprobs"], "properties": {"top_logprobs": {"type": "integer"}}},
    "then": {"required": ["include"],
             "properties": {"include": {"type": "array", "contains": {"const": LOGPROBS_INCLUDE}}}},
}
#: 'required' needs a function tool (:func:`_tool_choice`)
REQUIRED_NEEDS_FUNCTION = {
    "if": {"required": ["tool_choice"], "properties": {"tool_choice": {"const": "required"}}},
    "then": {"required": ["tools"], "properties": {"tools": {
        "type": "array", "contains": {"type": "object", "properties": {"type": {"const": "function"}}}}}},
}

BODY = body_kind()


def _field(body: dict[str, Any], key: str, default: Any = None) -> Any:
    return read(body, key, FIELDS[key], default)


def _reasoning(body: dict[str, Any]) -> dict[str, Any]:
    v = body.get("reasoning") or {}
    return {"effort": v.get("effort"), "summary": v.get("summary")}


def _text(body: dict[str, Any]) -> tuple[Constraint | None, dict[str, Any]]:
    """``text.format`` as a grammar constraint, and the ``text`` the response echoes."""
    v = body.get("text") or {}
    echo: dict[str, Any] = {"format": {"type": "text"}}
    if v.get("verbosity") is not None:
        echo["verbosity"] = v["verbosity"]
    fmt = v.get("format") or {"type": "text"}
    if fmt["type"] == "text":
        return None, echo
    if fmt["type"] == "json_object":
        echo["format"] = {"type": "json_object"}
        return Constraint("json_object", param="text.format"), echo
    schema = check_schema(fmt["schema"], "text.format.schema")
    echo["format"] = {"type": "json_schema", "name": fmt["name"], "schema": schema,
                      "strict": fmt.get("strict"), "description": fmt.get("description")}
    return Constraint("json_schema", json.dumps(schema), param="text.format.schema"), echo


def _tools(body: dict[str, Any]) -> tuple[tuple[Tool, ...], list[Any]]:
    """The function tools (the rest are left out), and the ``tools`` the response echoes."""
    tools: list[Tool] = []
    functions = [(i, t) for i, t in enumerate(body.get("tools") or ()) if t["type"] == "function"]
    for i, t in functions:
        if any(x.name == t["name"] for x in tools):
            raise bad(f"tools[{i}].name", f"'{t['name']}' is declared twice")
        tools.append(make_tool(t["name"], t.get("description"), t.get("parameters"), f"tools[{i}]"))
    echo = [{"type": "function", "name": tool.name, "description": tool.description,
             "parameters": tool.parameters, "strict": t.get("strict")}
            for tool, (_, t) in zip(tools, functions, strict=True)]
    return tuple(tools), echo


def _forced_other(body: dict[str, Any]) -> None:
    """A ``tool_choice`` forcing a tool mlxd does not run is refused, naming it (before the
    body's structure is checked, which would only say the type is not a function)."""
    v = body.get("tool_choice")
    if isinstance(v, dict) and isinstance(v.get("type"), str) and v["type"] not in (
            "function", "allowed_tools"):
        kind = v["type"]
        forced = v.get("name") or v.get("server_label") or kind
        raise bad("tool_choice", f"forces the tool {json.dumps(forced)[:80]} (type {json.dumps(kind)[:40]}), "
                  "which mlxd does not run: only function tools are offered to a local model")


def _tool_choice(body: dict[str, Any], tools: tuple[Tool, ...]) -> tuple[ToolChoice, str | None, tuple[Tool, ...], Any]:
    """(choice, named function, the tools the model gets, the tool_choice the response echoes)."""
    v = body.get("tool_choice")
    if v is None:
        return "auto", None, tools, "auto"
    if isinstance(v, str):
        if v == "required" and not tools:
            raise bad("tool_choice", "'required' needs at least one function tool "
                      "(mlxd runs no built-in tools)")
        return v, None, tools, v  # type: ignore[return-value]
    if v["type"] == "function":
        name = named_tool(v["name"], tools, "tool_choice.name")
        return "function", name, tools, {"type": "function", "name": name}
    mode = v["mode"]
    names = [named_tool(t["name"], tools, f"tool_choice.tools[{i}].name")
             for i, t in enumerate(v["tools"]) if t["type"] == "function"]
    allowed = tuple(t for t in tools if t.name in names)
    if mode == "required" and not allowed:
        raise bad("tool_choice.tools", "mode 'required' needs at least one declared function tool")
    echoed = [{"type": "function", "name": name} for name in names]  # never the client's raw objects
    return mode, None, allowed, {"type": "allowed_tools", "mode": mode, "tools": echoed}


def parse_responses(
    body: object, *, allow_images: bool = False, headers: Headers | None = None
) -> ParsedResponses:
    """Validate a ``POST /v1/responses`` body (see the module docstring)."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    model = body.get("model")
    if not is_model_name(model):
        raise bad("model", "is required: a non-empty string")
    if body.get("background") is True:
        raise bad("background", "background responses are not supported: stream, or wait for the answer")
    _forced_other(body)
    check(BODY, body)
    previous = _field(body, "previous_response_id")
    items = input_items(body["input"], allow_images=allow_images)
    instructions = _field(body, "instructions")
    top_p = _field(body, "top_p", 1.0)
    temperature = _field(body, "temperature", 1.0)
    if top_p == 0.0:
        temperature = 0.0  # the nucleus holds only the most likely token: greedy
    max_output = _field(body, "max_output_tokens")
    seed = _field(body, "seed")
    tools, tools_echo = _tools(body)
    choice, name, offered, choice_echo = _tool_choice(body, tools)
    response_format, text_echo = _text(body)
    include = body.get("include") or []
    top = _field(body, "top_logprobs")
    if top is not None and LOGPROBS_INCLUDE not in include:
        raise bad("top_logprobs", f"needs include: [\"{LOGPROBS_INCLUDE}\"]")
    stream = _field(body, "stream", False)
    truncation = _field(body, "truncation")
    echo: ResponseEcho = {
        "instructions": instructions,
        "max_output_tokens": max_output,
        "metadata": dict(body.get("metadata") or {}),
        "parallel_tool_calls": _field(body, "parallel_tool_calls", True),
        "previous_response_id": previous,
        "reasoning": _reasoning(body),
        "temperature": temperature,
        "top_p": top_p,
        "text": text_echo,
        "tool_choice": choice_echo,
        "tools": tools_echo,
        "top_logprobs": top,
        "truncation": truncation or "disabled",
        "user": _field(body, "user"),
        "prompt_cache_key": _field(body, "prompt_cache_key"),
        "safety_identifier": _field(body, "safety_identifier"),
        "service_tier": _field(body, "service_tier") or "default",
        "store": _field(body, "store", True),
        "background": False,
    }
    return ParsedResponses(
        model=model,
        items=items,
        instructions=instructions,
        max_output_tokens=max_output or DEFAULT_MAX_OUTPUT_TOKENS,
        temperature=temperature,
        top_p=top_p,
        seed=None if seed is None else seed % (2**32),
        tools=offered if choice != "none" else (),
        tool_choice=choice,
        tool_name=name,
        constraint=constraint(choice, offered, response_format, format_param="text.format"),
        logprobs=(top or 0) if LOGPROBS_INCLUDE in include else None,
        stream=stream,
        store=echo["store"],
        previous_response_id=previous,
        echo=echo,
        preferences=preferences(body, headers or {}),
    )

