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
from mlxd.http.responses_items import input_items
from mlxd.http.structured import (
    MAX_TOOLS,
    MAX_TOP_LOGPROBS,
    ToolChoice,
    check_schema,
    constraint,
    function_name,
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


def _field(body: dict[str, Any], key: str, default: Any = None) -> Any:
    return read(body, key, FIELDS[key], default)


def _metadata(body: dict[str, Any]) -> dict[str, str]:
    v = body.get("metadata")
    if v is None:
        return {}
    if not isinstance(v, dict) or len(v) > MAX_METADATA_KEYS:
        raise bad("metadata", f"must be an object of at most {MAX_METADATA_KEYS} string values")
    for k, value in v.items():
        if len(k) > MAX_METADATA_KEY:
            raise bad("metadata", f"keys are at most {MAX_METADATA_KEY} characters")
        if not isinstance(value, str) or len(value) > MAX_METADATA_VALUE:
            raise bad(f"metadata.{k[:MAX_METADATA_KEY]}", f"must be a string of at most {MAX_METADATA_VALUE} characters")
    return dict(v)


def _reasoning(body: dict[str, Any]) -> dict[str, Any]:
    v = body.get("reasoning")
    if v is None:
        return {"effort": None, "summary": None}
    if not isinstance(v, dict):
        raise bad("reasoning", "must be an object")
    given = {key: read(v, key, kind, None, prefix="reasoning.") for key, kind in REASONING.items()}
    return {"effort": given["effort"], "summary": given["summary"]}


def _include(body: dict[str, Any]) -> list[str]:
    v = body.get("include")
    if v is None:
        return []
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise bad("include", "must be a list of strings")
    return list(v)


def _text(body: dict[str, Any]) -> tuple[Constraint | None, dict[str, Any]]:
    """``text.format`` as a grammar constraint, and the ``text`` the response echoes."""
    v = body.get("text")
    if v is None:
        return None, {"format": {"type": "text"}}
    if not isinstance(v, dict):
        raise bad("text", "must be an object")
    verbosity = read(v, "verbosity", VERBOSITY, None, prefix="text.")
    echo: dict[str, Any] = {"format": {"type": "text"}}
    if verbosity is not None:
        echo["verbosity"] = verbosity
    fmt = v.get("format")
    if fmt is None:
        return None, echo
    if not isinstance(fmt, dict):
        raise bad("text.format", "must be an object with a 'type'")
    kind = fmt.get("type")
    if kind == "text":
        return None, echo
    if kind == "json_object":
        echo["format"] = {"type": "json_object"}
        return Constraint("json_object", param="text.format"), echo
    if kind != "json_schema":
        raise bad("text.format.type", "must be 'text', 'json_object' or 'json_schema'")
    name = function_name(fmt.get("name"), "text.format.name")
    strict = fmt.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad("text.format.strict", "must be a boolean")
    description = fmt.get("description")
    if description is not None and not isinstance(description, str):
        raise bad("text.format.description", "must be a string")
    if "schema" not in fmt:
        raise bad("text.format.schema", "is required")
    schema = check_schema(fmt["schema"], "text.format.schema")
    echo["format"] = {"type": "json_schema", "name": name, "schema": schema, "strict": strict,
                      "description": description}
    return Constraint("json_schema", json.dumps(schema), param="text.format.schema"), echo


def _tools(body: dict[str, Any]) -> tuple[tuple[Tool, ...], list[Any]]:
    """The function tools (the rest are left out), and the ``tools`` the response echoes."""
    raw = body.get("tools")
    if raw is None:
        return (), []
    if not isinstance(raw, list):
        raise bad("tools", "must be a list of tools ({\"type\": \"function\", \"name\", \"parameters\"})")
    if len(raw) > MAX_TOOLS:
        raise bad("tools", f"at most {MAX_TOOLS} tools")
    tools: list[Tool] = []
    for i, t in enumerate(raw):
        p = f"tools[{i}]"
        if not isinstance(t, dict) or not isinstance(t.get("type"), str):
            raise bad(p, "must be an object with a 'type'")
        if t["type"] != "function":
            continue  # a built-in or custom tool mlxd does not run: left out of the prompt
        name = function_name(t.get("name"), f"{p}.name")
        if any(x.name == name for x in tools):
            raise bad(f"{p}.name", f"'{name}' is declared twice")
        if t.get("strict") is not None and not isinstance(t["strict"], bool):
            raise bad(f"{p}.strict", "must be a boolean")
        tools.append(make_tool(name, t.get("description"), t.get("parameters"), p))
    echo = [{"type": "function", "name": t.name, "description": t.description,
             "parameters": t.parameters, "strict": raw_t.get("strict")}
            for t, raw_t in zip(tools, (x for x in raw if x["type"] == "function"), strict=True)]
    return tuple(tools), echo


def _tool_choice(body: dict[str, Any], tools: tuple[Tool, ...]) -> tuple[ToolChoice, str | None, tuple[Tool, ...], Any]:
    """(choice, named function, the tools the model gets, the tool_choice the response echoes)."""
    v = body.get("tool_choice")
    if v is None:
        return "auto", None, tools, "auto"
    if isinstance(v, str):
        if v not in ("auto", "none", "required"):
            raise bad("tool_choice", "must be 'auto', 'none', 'required' or an object")
        if v == "required" and not tools:
            raise bad("tool_choice", "'required' needs at least one function tool "
                      "(mlxd runs no built-in tools)")
        return v, None, tools, v  # type: ignore[return-value]
    if not isinstance(v, dict) or not isinstance(v.get("type"), str):
        raise bad("tool_choice", "must be 'auto', 'none', 'required' or an object with a 'type'")
    kind = v["type"]
    if kind == "function":
        name = named_tool(v.get("name"), tools, "tool_choice.name")
        return "function", name, tools, {"type": "function", "name": name}
    if kind == "allowed_tools":
        return _allowed_tools(v, tools)
    forced = v.get("name") or v.get("server_label") or kind
    raise bad("tool_choice", f"forces the tool {json.dumps(forced)[:80]} (type {json.dumps(kind)[:40]}), "
              "which mlxd does not run: only function tools are offered to a local model")


def _allowed_tools(v: dict[str, Any], tools: tuple[Tool, ...]) -> tuple[ToolChoice, str | None, tuple[Tool, ...], Any]:
    mode = v.get("mode")
    if mode not in ("auto", "required"):
        raise bad("tool_choice.mode", "must be 'auto' or 'required'")
    listed = v.get("tools")
    if not isinstance(listed, list):
        raise bad("tool_choice.tools", "must be a list of {\"type\": \"function\", \"name\"}")
    names: list[str] = []
    for i, t in enumerate(listed):
        if not isinstance(t, dict) or not isinstance(t.get("type"), str):
            raise bad(f"tool_choice.tools[{i}]", "must be an object with a 'type'")
        if t["type"] == "function":
            names.append(named_tool(t.get("name"), tools, f"tool_choice.tools[{i}].name"))
    allowed = tuple(t for t in tools if t.name in names)
    if mode == "required" and not allowed:
        raise bad("tool_choice.tools", "mode 'required' needs at least one declared function tool")
    echoed = [{"type": "function", "name": name} for name in names]  # never the client's raw objects
    return mode, None, allowed, {"type": "allowed_tools", "mode": mode, "tools": echoed}


def _refused(body: dict[str, Any]) -> None:
    background = body.get("background")
    if background is True:
        raise bad("background", "background responses are not supported: stream, or wait for the answer")
    if background is not None and background is not False:
        raise bad("background", "must be a boolean")
    for key, what in (("prompt", "stored prompts are not supported"),
                      ("conversation", "conversations are not supported: use previous_response_id")):
        if body.get(key) is not None:
            raise bad(key, what)


def parse_responses(
    body: object, *, allow_images: bool = False, headers: Headers | None = None
) -> ParsedResponses:
    """Validate a ``POST /v1/responses`` body (see the module docstring)."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    model = body.get("model")
    if not is_model_name(model):
        raise bad("model", "is required: a non-empty string")
    _refused(body)
    previous = _field(body, "previous_response_id")
    if "input" not in body or body["input"] is None:
        raise bad("input", "is required: a string or a list of input items")
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
    include = _include(body)
    top = _field(body, "top_logprobs")
    if top is not None and LOGPROBS_INCLUDE not in include:
        raise bad("top_logprobs", f"needs include: [\"{LOGPROBS_INCLUDE}\"]")
    stream = _field(body, "stream", False)
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise bad("stream_options", "must be an object")
    truncation = _field(body, "truncation")
    _field(body, "max_tool_calls")
    echo: ResponseEcho = {
        "instructions": instructions,
        "max_output_tokens": max_output,
        "metadata": _metadata(body),
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
