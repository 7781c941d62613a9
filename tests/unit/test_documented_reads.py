"""Every field a route's validator reads is in the route's ``/openapi.json`` request schema, and back.

Each route's validator is handed valid bodies whose objects note every key looked up in
them (:class:`Recorder`), down to message parts, tool calls and formats; the keys read at
each place of the body must be the properties the document gives that place (over all
its variants). A field added to a validator without its documentation fails here, and so
does a documented field no validator reads.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from mlxd.http import ollama_shapes
from mlxd.http.anthropic_shapes import parse_messages
from mlxd.http.embeddings_api import parse_embeddings
from mlxd.http.openapi import openapi_document
from mlxd.http.responses_fields import parse_responses
from mlxd.http.validation import parse_request


class Recorder(dict[str, Any]):
    """An object of a body at ``path`` (``messages[].content[]``) that notes the keys read in it."""

    def __init__(self, path: str, **fields: Any) -> None:
        super().__init__(fields)
        self.path, self.seen = path, set[str]()

    def get(self, key: str, default: Any = None) -> Any:  # type: ignore[override]
        self.seen.add(key)
        return super().get(key, default)

    def __getitem__(self, key: str) -> Any:
        self.seen.add(key)
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        self.seen.add(str(key))
        return super().__contains__(key)


R = Recorder
SCHEMA = {"type": "object", "properties": {}}


def recorders(v: object) -> Iterator[Recorder]:
    if isinstance(v, Recorder):
        yield v
    if isinstance(v, dict):
        for x in v.values():
            yield from recorders(x)
    elif isinstance(v, list):
        for x in v:
            yield from recorders(x)


def alternatives(schema: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """``schema`` and every subschema a value of it may also have to match (anyOf, allOf, then...)."""
    yield schema
    for key in ("anyOf", "oneOf", "allOf"):
        for part in schema.get(key, []):
            yield from alternatives(part)
    for key in ("then", "else"):
        if key in schema:
            yield from alternatives(schema[key])


def at(schema: dict[str, Any], path: str) -> set[str]:
    """The properties the document gives the objects at ``path`` of a body of ``schema``."""
    schemas = [schema]
    for part in [p for p in path.split(".") if p]:
        key = part.removesuffix("[]")
        found = [s["properties"][key] for x in schemas for s in alternatives(x)
                 if key in s.get("properties", {})]
        if part.endswith("[]"):
            found = [s["items"] for x in found for s in alternatives(x) if "items" in s]
        schemas = found
    return {key for x in schemas for s in alternatives(x) for key in s.get("properties", {})}


def chat_bodies() -> list[Recorder]:
    user = R("messages[]", role="user", content=[R("messages[].content[]", type="text", text="hi")])
    call = R("messages[].tool_calls[]", id="c1", type="function",
             function=R("messages[].tool_calls[].function", name="f", arguments="{}"))
    tool = R("tools[]", type="function",
             function=R("tools[].function", name="f", description="d", parameters=SCHEMA))
    return [
        R("", model="m", stream=True, stream_options=R("stream_options", include_usage=True),
          messages=[R("messages[]", role="system", content="s"), user,
                    R("messages[]", role="assistant", content=None, tool_calls=[call]),
                    R("messages[]", role="tool", content="r", tool_call_id="c1", name="f")],
          tools=[tool], tool_choice=R("tool_choice", type="function",
                                      function=R("tool_choice.function", name="f"))),
        R("", model="m", messages=[R("messages[]", role="user", content="hi")],
          response_format=R("response_format", type="json_schema", json_schema=R(
              "response_format.json_schema", name="n", schema=SCHEMA, strict=True))),
    ]


def messages_bodies() -> list[Recorder]:
    block = "messages[].content[]"
    turns = [
        R("messages[]", role="system", content="s"),
        R("messages[]", role="user", content=[R(block, type="text", text="hi")]),
        R("messages[]", role="assistant", content=[
            R(block, type="thinking", thinking="t", signature="s"),
            R(block, type="redacted_thinking", data="x"),
            R(block, type="tool_use", id="t1", name="f", input={})]),
        R("messages[]", role="user", content=[
            R(block, type="tool_result", tool_use_id="t1", content="r", is_error=False)]),
    ]
    tools = [R("tools[]", type="custom", name="f", description="d", input_schema=SCHEMA)]
    fmt = {"type": "json_schema", "schema": SCHEMA}
    return [
        R("", model="m", max_tokens=4, system="s", messages=turns, tools=tools,
          tool_choice=R("tool_choice", type="tool", name="f"),
          thinking=R("thinking", type="enabled", budget_tokens=10),
          context_management=R("context_management", edits=[]),
          output_config=R("output_config", effort="low")),
        R("", model="m", max_tokens=4, messages=[R("messages[]", role="user", content="hi")],
          output_config=R("output_config", format=R("output_config.format", **fmt))),
        R("", model="m", max_tokens=4, messages=[R("messages[]", role="user", content="hi")],
          output_format=R("output_format", **fmt)),
    ]


def responses_bodies() -> list[Recorder]:
    part = "input[].content[]"
    function = R("tools[]", type="function", name="f", description="d", parameters=SCHEMA, strict=True)
    return [
        R("", model="m", instructions="i", include=["message.output_text.logprobs"], top_logprobs=1,
          input=[
              R("input[]", type="message", role="user", content=[R(part, type="input_text", text="hi")]),
              R("input[]", role="assistant", content=[R(part, type="output_text", text="x"),
                                                      R(part, type="refusal", refusal="no")]),
              R("input[]", type="function_call", call_id="c1", name="f", arguments="{}"),
              R("input[]", type="function_call_output", call_id="c1",
                output=[R("input[].output[]", type="input_text", text="r")]),
              R("input[]", type="reasoning")],
          tools=[function, R("tools[]", type="web_search")],
          tool_choice=R("tool_choice", type="function", name="f"),
          reasoning=R("reasoning", effort="low", summary="auto", generate_summary="auto"),
          text=R("text", verbosity="low")),
        R("", model="m", input="hi", tools=[function],
          tool_choice=R("tool_choice", type="allowed_tools", mode="auto",
                        tools=[R("tool_choice.tools[]", type="function", name="f")]),
          text=R("text", format=R("text.format", type="json_schema", name="n", schema=SCHEMA,
                                  strict=True, description="d"))),
    ]


def ollama_chat_bodies() -> list[Recorder]:
    call = R("messages[].tool_calls[]", id="c1",
             function=R("messages[].tool_calls[].function", name="f", arguments={}))
    choice = R("options.tool_choice", type="function", function=R("options.tool_choice.function", name="f"))
    return [
        R("", model="m", tools=[R("tools[]", type="function", function=R(
            "tools[].function", name="f", description="d", parameters=SCHEMA))],
          messages=[R("messages[]", role="user", content="hi"),
                    R("messages[]", role="assistant", content="", thinking="t", tool_calls=[call]),
                    R("messages[]", role="tool", content="r", tool_name="f", tool_call_id="c1")],
          options=R("options", tool_choice=choice)),
        R("", model="m", messages=[R("messages[]", role="user", content="hi")], format=SCHEMA,
          think=False, logprobs=True, top_logprobs=1),
    ]


def _ollama(kind: str) -> Callable[[Recorder], object]:
    return lambda body: ollama_shapes.parse(body, kind, known=lambda _: True,  # type: ignore[arg-type]
                                            allow_images=lambda _: False, request_id="r", headers={})


#: route -> (valid bodies, the route's validator)
READERS: dict[str, tuple[Callable[[], list[Recorder]], Callable[[Recorder], object]]] = {
    "/v1/chat/completions": (chat_bodies, lambda body: parse_request(body, kind="chat")),
    "/v1/completions": (lambda: [R("", model="m", prompt="hi")],
                        lambda body: parse_request(body, kind="completion")),
    "/v1/messages": (messages_bodies, lambda body: parse_messages(body, request_id="r")),
    "/v1/responses": (responses_bodies, parse_responses),
    "/v1/embeddings": (lambda: [R("", model="m", input="hi", encoding_format="float", dimensions=8,
                                  user="u")], parse_embeddings),
    "/api/chat": (ollama_chat_bodies, _ollama("chat")),
    "/api/generate": (lambda: [R("", model="m", prompt="hi", system="s", raw=False, template="",
                                 suffix="", context=[], options=R("options"))], _ollama("generate")),
}


@pytest.mark.parametrize("path", list(READERS))
def test_every_field_a_route_reads_is_documented_and_back(path: str) -> None:
    """At every place of a valid body, the keys the route's validator reads are the documented properties."""
    bodies, reader = READERS[path]
    read: dict[str, set[str]] = defaultdict(set)
    for body in bodies():
        reader(body)
        for r in recorders(body):
            read[r.path] |= r.seen
    operation = openapi_document(None)["paths"][path]["post"]
    schema = operation["requestBody"]["content"]["application/json"]["schema"]
    shown = {where: at(schema, where) for where in read}
    assert {w: read[w] - shown[w] for w in read if read[w] - shown[w]} == {}, "read, not documented"
    assert {w: shown[w] - read[w] for w in read if shown[w] - read[w]} == {}, "documented, not read"
