"""Request fields of the real clients: tools, tool_choice, response_format, logprobs, tool history.

Shared by the OpenAI, Responses, Anthropic and Ollama routes. Their shapes are
described here once (:data:`TOOL`, :func:`tools_kind`, :func:`tool_choice_kind`,
:func:`response_format_kind`, :data:`TOOL_CALL`, :data:`NAME`,
:data:`OBJECT_SCHEMA`, with :mod:`mlxd.http.shapes`): a route checks its body
against them, then the readers here convert it and check what is not structure
(a name declared twice, a named tool that is not declared). Every problem raises
:class:`~mlxd.errors.InvalidRequest` whose ``param`` names the field. A JSON
Schema (tool parameters, ``response_format.json_schema.schema``) is checked
against its meta-schema with the ``jsonschema`` library; whether the grammar
library can enforce it is checked by the engine before any token is spent.

A schema costs CPU in proportion to its size (``check_schema`` of a 1.8 MB
schema took 11 s), so the schemas of one request hold at most
:data:`MAX_SCHEMA_VALUES` JSON values together, counted as they are read
(a larger request is refused before any check starts), and a route that reads
its body inside :func:`schema_checks_off_loop` gets the meta-schema checks run
after the body is read, on a worker thread (:data:`SCHEMA_CHECKS_AT_ONCE` at once:
the limiter is the app's, ``AppState.schema_checkers``),
while the event loop goes on serving everyone else; a large body is read
there too.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Literal, TypeGuard, TypeVar

import trio

from mlxd.engines.base import Constraint, Tool, ToolCall
from mlxd.errors import quote
from mlxd.http.fields import Boolean, Choice, Integer, Kind, Text, bad, read
from mlxd.http.shapes import AnyOf, Array, Const, Obj, Pattern, Tagged

#: OpenAI's rule for function names
NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
MAX_TOOLS = 128
#: chat ``top_logprobs`` (OpenAI's bound) and completions ``logprobs`` (the legacy bound)
MAX_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5
#: JSON nesting allowed in a schema (deeper is refused before any library recurses into it)
MAX_SCHEMA_DEPTH = 32
#: JSON values (objects, lists, strings, numbers...) all the schemas of one request may hold
#: together: about 1 MB of schema, 2-3 s of meta-schema checking on this machine's CPU
#: (OpenAI's structured outputs take 5,000 properties; 128 tools of 400 parameters are 150k)
MAX_SCHEMA_VALUES = 50_000
#: meta-schema checks running at once on worker threads (each holds the GIL between switches)
SCHEMA_CHECKS_AT_ONCE = 2
#: bodies larger than this are validated on a worker thread too (their schemas and messages
#: take milliseconds to walk); smaller ones on the event loop, without a thread hop
INLINE_VALIDATION_BYTES = 64 * 1024

ToolChoice = Literal["auto", "none", "required", "function"]


def _shape(v: object, depth_limit: int, count_limit: int) -> tuple[int, int]:
    """(deepest nesting, values) of ``v``; stops counting past either limit."""
    stack: list[tuple[object, int]] = [(v, 1)]
    deepest = values = 0
    while stack:
        item, d = stack.pop()
        deepest, values = max(deepest, d), values + 1
        if deepest > depth_limit or values > count_limit:
            break
        if isinstance(item, dict):
            stack.extend((x, d + 1) for x in item.values())
        elif isinstance(item, list):
            stack.extend((x, d + 1) for x in item)
    return deepest, values


@dataclass
class SchemaChecks:
    """The schemas of the request being read: their values so far, and the meta-schema
    checks left for :func:`schema_checks_off_loop` to run."""

    values: int = 0
    pending: list[tuple[dict[str, Any], str]] = field(default_factory=list)

    def run(self) -> None:
        for schema, param in self.pending:
            _meta_check(schema, param)


_checks: ContextVar[SchemaChecks | None] = ContextVar("mlxd_schema_checks", default=None)
T = TypeVar("T")


async def schema_checks_off_loop(
    read: Callable[[], T], body_bytes: int, limiter: trio.CapacityLimiter
) -> T:
    """``read()`` (a body's validation) on the event loop, then the meta-schema checks of
    the schemas it met on a worker thread; both on the thread for a body over
    :data:`INLINE_VALIDATION_BYTES` (module docstring). ``limiter``: the app's threads for
    these checks (``AppState.schema_checkers``)."""
    checks = SchemaChecks()

    def validate(run_checks: bool) -> T:
        token = _checks.set(checks)
        try:
            result = read()
        finally:
            _checks.reset(token)
        if run_checks:
            checks.run()
        return result

    if body_bytes > INLINE_VALIDATION_BYTES:
        return await trio.to_thread.run_sync(validate, True, limiter=limiter,
                                             abandon_on_cancel=True)
    result = validate(False)
    if checks.pending:
        await trio.to_thread.run_sync(checks.run, limiter=limiter, abandon_on_cancel=True)
    return result


def check_schema(schema: object, param: str) -> dict[str, Any]:
    """A valid JSON Schema (a JSON object), or a 400 naming ``param``; the meta-schema check
    is left for :func:`schema_checks_off_loop` when a route reads its body in one."""
    if not isinstance(schema, dict):
        raise bad(param, "must be a JSON Schema object")
    checks = _checks.get()
    used = checks.values if checks is not None else 0
    depth, values = _shape(schema, MAX_SCHEMA_DEPTH, MAX_SCHEMA_VALUES - used)
    if depth > MAX_SCHEMA_DEPTH:
        raise bad(param, f"is nested more than {MAX_SCHEMA_DEPTH} levels deep")
    if used + values > MAX_SCHEMA_VALUES:
        raise bad(param, f"the request's schemas hold more than {MAX_SCHEMA_VALUES:,} JSON values "
                         "together; send smaller schemas or fewer tools")
    if checks is None:
        _meta_check(schema, param)
    else:
        checks.values += values
        checks.pending.append((schema, param))
    return schema


def _meta_check(schema: dict[str, Any], param: str) -> None:
    """``schema`` against its meta-schema (``jsonschema``), or a 400 naming ``param``."""
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        where = quote("/".join(str(p) for p in e.absolute_path))
        raise bad(param, f"is not a valid JSON Schema: {quote(e.message)}"
                  + (f" (at {where})" if where else "")) from None
    except (jsonschema.exceptions.UnknownType, ValueError, TypeError) as e:
        raise bad(param, f"is not a valid JSON Schema: {quote(str(e))}") from None
    except RecursionError:
        raise bad(param, "is nested too deeply") from None


#: a function or tool name
NAME = Pattern(NAME_PATTERN, "must be 1-64 letters, digits, '_' or '-'")
#: a JSON Schema of type object (tool parameters); :func:`check_schema` checks its meta-schema
OBJECT_SCHEMA = Obj({"type": Const("object"), "properties": Obj({})}, not_null=("type", "properties"), whole=True,
                    hint="must be a JSON Schema of type 'object'")
_FUNCTION = Obj({"name": NAME, "description": Text(), "parameters": OBJECT_SCHEMA}, required=("name",),
                hint="must be an object with a 'name'", notes={"parameters": "a JSON Schema of type object"})
#: one declared tool of an OpenAI body (also Ollama's)
TOOL = Tagged("type", {"function": Obj({"function": _FUNCTION}, required=("function",))})
_TOOLS_HINT = f'must be a list of at most {MAX_TOOLS} {{"type": "function", "function": {{...}}}}'


def tools_kind(tools: bool = True) -> Array:
    """``tools``; for models that take none (the document's variant), an empty list."""
    return Array(TOOL, max_items=MAX_TOOLS, hint=_TOOLS_HINT) if tools else Array(TOOL, max_items=0)


def tool_choice_kind(tools: bool = True) -> Kind:
    """OpenAI's ``tool_choice`` (also Ollama's ``options.tool_choice``); without tools, only
    ``auto`` and ``none``."""
    if not tools:
        return Choice(("auto", "none"))
    named = Tagged("type", {"function": Obj({"function": Obj({"name": NAME}, required=("name",))},
                                            required=("function",))})
    return AnyOf((Choice(("auto", "none", "required")), named),
                 hint="must be 'auto', 'none', 'required' or "
                      '{"type": "function", "function": {"name": ...}}')


def response_format_kind(grammar: bool = True) -> Tagged:
    """``response_format``; for models without grammars (the document's variant), only text."""
    json_schema = Obj({"name": NAME, "schema": Obj({}, hint="must be a JSON Schema object"),
                       "strict": Boolean()}, required=("name",),
                      hint="must be an object with 'name' and 'schema'")
    formats = {"text": Obj({})}
    if grammar:
        formats |= {"json_object": Obj({}),
                    "json_schema": Obj({"json_schema": json_schema}, required=("json_schema",))}
    return Tagged("type", formats)


#: what a validator checks: everything any model may be sent
TOOLS, TOOL_CHOICE, RESPONSE_FORMAT = tools_kind(), tool_choice_kind(), response_format_kind()
#: a call's arguments: JSON text of an object, or the object (:func:`arguments_text`)
ARGUMENTS = AnyOf((Text(), Obj({})), hint="must be an object (or JSON text of one)")
#: a call in an assistant message of the history
TOOL_CALL = Tagged("type", {"function": Obj({
    "id": Text(1),
    "function": Obj({"name": NAME, "arguments": ARGUMENTS},
                    required=("name", "arguments"), hint="must be an object with 'name' and 'arguments'"),
}, required=("id", "function"))}, default="function", hint="must be an object with 'id', 'type' and 'function'")


def make_tool(
    name: str, description: str | None, parameters: object, param: str, *, key: str = "parameters"
) -> Tool:
    """One declared function (its shape checked against :data:`OBJECT_SCHEMA` and the like by
    the caller); ``param`` is where its fields sit (``tools[2].function``), ``key`` the name of
    its schema field there."""
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    return Tool(name, description, check_schema(parameters, f"{param}.{key}"))


def openai_tools(body: dict[str, Any]) -> tuple[Tool, ...]:
    """``tools`` of a body checked against :data:`TOOLS` (by the caller)."""
    tools: list[Tool] = []
    for i, item in enumerate(body.get("tools") or ()):
        fn = item["function"]
        name = fn["name"]
        if any(t.name == name for t in tools):
            raise bad(f"tools[{i}].function.name", f"'{name}' is declared twice")
        tools.append(make_tool(name, fn.get("description"), fn.get("parameters"), f"tools[{i}].function"))
    return tuple(tools)


def openai_tool_choice(body: dict[str, Any], tools: tuple[Tool, ...]) -> tuple[ToolChoice, str | None]:
    """``tool_choice`` of a body checked against :func:`tool_choice_kind` (by the caller)."""
    v = body.get("tool_choice")
    if v is None:
        return "auto", None
    if isinstance(v, str):
        if v == "required" and not tools:
            raise bad("tool_choice", "'required' needs at least one tool in tools")
        return v, None  # type: ignore[return-value]
    return "function", named_tool(v["function"]["name"], tools, "tool_choice.function.name")


def named_tool(name: object, tools: tuple[Tool, ...], param: str) -> str:
    if not isinstance(name, str) or not any(t.name == name for t in tools):
        known = ", ".join(t.name for t in tools) or "none declared"
        raise bad(param, f"names no declared tool (got {json.dumps(name)[:80]}; tools: {known})")
    return name


def constraint(
    tool_choice: ToolChoice, tools: tuple[Tool, ...], response: Constraint | None, *, format_param: str
) -> Constraint | None:
    """The grammar of a request: a tool call (required / named) or the response format."""
    if tool_choice in ("required", "function") and tools:
        if response is not None:
            raise bad(format_param, "cannot be combined with a required or named tool_choice")
        return Constraint("tool_call")
    return response


def response_format(body: dict[str, Any]) -> Constraint | None:
    """``response_format`` of a body checked against :func:`response_format_kind` (by the caller)."""
    v = body.get("response_format")
    if v is None or v["type"] == "text":
        return None
    if v["type"] == "json_object":
        return Constraint("json_object")
    schema = check_schema(v["json_schema"].get("schema", {}), "response_format.json_schema.schema")
    return Constraint("json_schema", json.dumps(schema))


#: the scalar fields of a chat body beside sampling (:data:`mlxd.http.validation.SAMPLING`)
CHAT_FIELDS: dict[str, Kind] = {
    "parallel_tool_calls": Boolean(),
    "logprobs": Boolean(),
    "top_logprobs": Integer(0, MAX_TOP_LOGPROBS),
}
#: a text completion's ``logprobs``: how many alternatives per token
COMPLETION_FIELDS: dict[str, Kind] = {"logprobs": Integer(0, MAX_COMPLETION_LOGPROBS)}


#: top_logprobs only with logprobs: true (:func:`chat_logprobs`)
TOP_NEEDS_LOGPROBS = {
    "if": {"required": ["top_logprobs"],
           "properties": {"top_logprobs": {"type": "integer"}}},
    "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}},
}
#: 'required' needs tools (:func:`openai_tool_choice`)
REQUIRED_NEEDS_TOOLS = {
    "if": {"required": ["tool_choice"], "properties": {"tool_choice": {"const": "required"}}},
    "then": {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}},
}


def chat_logprobs(body: dict[str, Any]) -> int | None:
    """None (off), or the number of alternatives per token (``top_logprobs``, 0 without it)."""
    lp = read(body, "logprobs", CHAT_FIELDS["logprobs"], None)
    top = read(body, "top_logprobs", CHAT_FIELDS["top_logprobs"], None)
    if top is not None and not lp:
        raise bad("top_logprobs", "needs logprobs: true")
    return int(top or 0) if lp else None


def completion_logprobs(body: dict[str, Any]) -> int | None:
    return read(body, "logprobs", COMPLETION_FIELDS["logprobs"], None)


#: what makes a model name not blank: one character other than ASCII white space, spelled
#: out because regex engines disagree on ``\s`` (Python's takes U+001C, ECMA's does not)
MODEL_NAME_PATTERN = r"[^ \t\n\r\f\v]"
MAX_MODEL_NAME = 256


def is_model_name(v: object) -> TypeGuard[str]:
    """1 to 256 characters, not all white space: the Open API document's model name."""
    return isinstance(v, str) and 0 < len(v) <= MAX_MODEL_NAME \
        and re.search(MODEL_NAME_PATTERN, v) is not None


def assistant_tool_calls(v: list[dict[str, Any]] | None, param: str) -> tuple[ToolCall, ...]:
    """An assistant message's ``tool_calls`` in the history, checked against :data:`TOOL_CALL`."""
    return tuple(ToolCall(c["id"], c["function"]["name"],
                          arguments_text(c["function"].get("arguments"), f"{param}[{i}].function.arguments"))
                 for i, c in enumerate(v or ()))


def arguments_text(v: object, param: str) -> str:
    """Arguments as OpenAI sends them (JSON text of an object), or as an object (Anthropic)."""
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except ValueError:
            raise bad(param, "must be JSON text of an object") from None
        except RecursionError:
            raise bad(param, "is nested too deeply") from None
    if not isinstance(v, dict):
        raise bad(param, "must be an object (or JSON text of one)")
    return json.dumps(v)


@dataclass(frozen=True, slots=True)
class ClientFields:
    """The client fields of one OpenAI request, validated."""

    tools: tuple[Tool, ...]
    tool_choice: ToolChoice
    tool_name: str | None
    constraint: Constraint | None
    logprobs: int | None


def openai_fields(body: dict[str, Any], *, chat: bool) -> ClientFields:
    """The client fields of a body checked against its description (by the caller)."""
    if not chat:
        return ClientFields((), "auto", None, None, completion_logprobs(body))
    tools = openai_tools(body)
    choice, name = openai_tool_choice(body, tools)
    c = constraint(choice, tools, response_format(body), format_param="response_format")
    return ClientFields(tools, choice, name, c, chat_logprobs(body))
