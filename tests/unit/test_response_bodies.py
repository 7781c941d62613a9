"""The response bodies are described once: every JSON answer in /openapi.json is a schema
generated from a TypedDict, and what the builders make validates against it."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from mlxd.config import builtin_demo_config
from mlxd.engines.base import (
    Finished,
    TextDelta,
    ThinkMarkers,
    TokenLogprob,
    ToolCall,
    ToolCallDelta,
)
from mlxd.errors import ErrorEnvelope, Preempted
from mlxd.http.anthropic_shapes import MessagesRenderer
from mlxd.http.bodies_admin import plan_body
from mlxd.http.body_schemas import bodies, components, generate
from mlxd.http.envelopes import error_body
from mlxd.http.generation import Collected
from mlxd.http.ollama_render import OllamaRenderer, load_reply
from mlxd.http.openai_api import ResponseBuilder
from mlxd.http.openapi import openapi_document
from mlxd.http.responses_events import ResponsesRenderer
from mlxd.http.responses_fields import parse_responses
from mlxd.residency.moves import Victim, VictimReason
from mlxd.residency.plan import Plan
from mlxd.residency.states import State

BODIES = bodies()
#: the media types whose schema is a JSON body, and those whose events or lines carry one
JSON_TYPES = ("application/json",)
STREAM_TYPES = ("text/event-stream", "application/x-ndjson")
#: streams whose events are not built by the HTTP layer: /admin/events sends the journal's
#: event payloads (the residency's events, docs/journal.md) and live load progress
OTHER_STREAMS = ("/admin/events",)


def _content_schemas(schema: Any) -> list[Any]:
    """Every ``contentSchema`` inside ``schema`` (what a stream's events hold)."""
    if isinstance(schema, list):
        return [s for item in schema for s in _content_schemas(item)]
    if not isinstance(schema, dict):
        return []
    found = [schema["contentSchema"]] if "contentSchema" in schema else []
    return found + [s for key, v in schema.items() if key != "contentSchema" for s in _content_schemas(v)]


def _refs(schema: dict[str, Any]) -> list[str]:
    """The components ``schema`` points at (a hand-written schema points at none: ``""``)."""
    return [r.get("$ref", "") for r in schema.get("anyOf", [schema])]


@pytest.mark.parametrize("config", [None, builtin_demo_config()], ids=["no config", "demo config"])
def test_every_json_answer_is_a_generated_typeddict(config: Any) -> None:
    """Each operation's JSON body (2xx and errors) and each stream's event payload is a $ref to
    a component, and the components are exactly what pydantic generates from the bodies' TypedDicts."""
    doc = openapi_document(config)
    names = {body.__name__ for body in BODIES}
    assert doc["components"]["schemas"] == generate(BODIES)
    seen: set[str] = set()
    for path, operations in doc["paths"].items():
        for method, op in operations.items():
            for status, response in op["responses"].items():
                where = f"{method.upper()} {path} {status}"
                for media, content in response.get("content", {}).items():
                    if media in JSON_TYPES:
                        refs = _refs(content["schema"])
                    elif media in STREAM_TYPES and path not in OTHER_STREAMS:
                        refs = [r for cs in _content_schemas(content["schema"]) for r in _refs(cs)]
                        assert refs, f"{where} {media}: its events name no body"
                    else:
                        continue
                    for ref in refs:
                        assert ref.startswith("#/components/schemas/"), f"{where}: {ref}"
                        name = ref.rsplit("/", 1)[1]
                        assert name in names, f"{where}: {name} is not a registered body"
                        seen.add(name)
    assert seen == names  # every registered body is some route's answer


def _check(body: object, name: str) -> None:
    schema = {"$ref": f"#/components/schemas/{name}", "components": {"schemas": components()}}
    jsonschema.Draft202012Validator(schema).validate(json.loads(json.dumps(body)))


def _sse(frames: list[bytes]) -> list[Any]:
    return [json.loads(line[6:]) for f in frames for line in f.decode().split("\n")
            if line.startswith("data: {")]


LP = TokenLogprob(1, "he", -0.5, (104, 101), top=(TokenLogprob(2, "ha", -1.5, (104, 97)),))
CALL = ToolCallDelta(0, ToolCall("call_1", "lookup", '{"q": "x"}'))
FIN = Finished("tool_calls", 7, 4, cached_tokens=3, cached_from_disk=1, stop_sequence=None)
STOPPED = Finished("stop", 7, 2, stop_sequence="END")


def _collected() -> Collected:
    return Collected(True, ["<think>hm</think>he", "llo"], logprobs=[LP], calls=[CALL])


def test_openai_builders_make_what_the_document_says() -> None:
    """Chat and text completions, whole and chunked (tool calls, logprobs, usage), validate."""
    for kind, whole, chunk in (("chat", "ChatCompletion", "ChatCompletionChunk"),
                               ("completion", "TextCompletion", "TextCompletionChunk")):
        b = ResponseBuilder(kind, "m", include_usage=True)
        _check(b.whole(_collected(), FIN), whole)
        frames = [b.first(), *b.text(TextDelta("he", (LP,))), *b.finish(FIN)]
        if kind == "chat":
            frames += b.call(CALL)
        for event in _sse(frames):
            _check(event, chunk)
        _check(json.loads(b.error(Preempted("gone"))[6:]), "ErrorEnvelope")


def test_anthropic_builders_make_what_the_document_says() -> None:
    """The whole message (thinking, text, tool use) and every event of its stream validate."""
    r = MessagesRenderer("m")
    r.markers = ThinkMarkers("<think>", "</think>", open=False)
    _check(r.whole(_collected(), FIN), "AnthropicMessage")
    _check(r.whole(Collected(False, ["done END"]), STOPPED), "AnthropicMessage")
    s = MessagesRenderer("m")
    s.markers = ThinkMarkers("<think>", "</think>", open=False)
    frames = [s.first(), *s.text(TextDelta("<think>hm</think>he")), *s.call(CALL), *s.finish(FIN),
              s.error(Preempted("gone"))]
    events = _sse(frames)
    assert {e["type"] for e in events} >= {"message_start", "ping", "content_block_start",
                                           "content_block_delta", "content_block_stop",
                                           "message_delta", "message_stop", "error"}
    for event in events:
        _check(event, "MessageStart" if event["type"] == "message_start" else
               "AnthropicError" if event["type"] == "error" else
               "".join(part.capitalize() for part in event["type"].split("_")))


def test_ollama_and_responses_builders_make_what_the_document_says() -> None:
    """Ollama's replies (whole, streamed lines, load calls) and the Responses object validate."""
    for kind in ("chat", "generate"):
        r = OllamaRenderer("m", kind)
        _check(r.whole(_collected(), FIN), "OllamaReply")
        lines = [r.first(), *r.text(TextDelta("he", (LP,))), *r.call(CALL), *r.finish(FIN),
                 r.error(Preempted("gone"))]
        for line in b"".join(lines).splitlines():
            body = json.loads(line)
            _check(body, "OllamaError" if "error" in body else "OllamaReply")
        _check(load_reply("m", chat=kind == "chat", unloaded=True), "OllamaReply")
    parsed = parse_responses({"model": "m", "input": "hi", "include": ["message.output_text.logprobs"],
                              "tools": [{"type": "function", "name": "lookup"}]})
    _check(ResponsesRenderer(parsed).whole(_collected(), FIN), "ResponseObject")
    streamed = ResponsesRenderer(parsed)
    frames = [streamed.first(), *streamed.text(TextDelta("he", (LP,))), *streamed.call(CALL),
              *streamed.finish(FIN)]
    kinds = {"response.output_item.added": "OutputItemEvent", "response.output_item.done":
             "OutputItemEvent", "response.content_part.added": "ContentPartEvent",
             "response.content_part.done": "ContentPartEvent",
             "response.output_text.delta": "OutputTextDelta", "response.output_text.done":
             "OutputTextDone", "response.function_call_arguments.delta": "ArgumentsDelta",
             "response.function_call_arguments.done": "ArgumentsDone"}
    events = _sse([*frames, ResponsesRenderer(parsed).error(Preempted("gone"))])
    assert {e["type"] for e in events} >= {*kinds, "response.created", "response.failed"}
    for event in events:
        _check(event, kinds.get(event["type"], "ResponseLifecycle"))


@pytest.mark.parametrize("path,name", [("/v1/chat/completions", "ErrorEnvelope"),
                                       ("/v1/messages", "AnthropicError"),
                                       ("/api/chat", "OllamaError")])
def test_error_bodies_and_the_plan_make_what_the_document_says(path: str, name: str) -> None:
    """Each family's error envelope, and the plan's answer, validate against their schemas."""
    _check(error_body(Preempted("gone"), path), name)
    envelope: ErrorEnvelope = Preempted("gone").body()
    _check(envelope, "ErrorEnvelope")
    victim = Victim("a", State.LOADED, 10, VictimReason.IDLE_LRU, "b")
    _check(plan_body(Plan("b", "evict_then_load", (victim,), None, None, 10, 1.23456)), "AdminPlan")
    _check(plan_body(Plan("b", "fail", (), "model_capacity", "no room", 0, None)), "AdminPlan")
