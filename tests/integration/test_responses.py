"""The official `openai` client's Responses API against the real daemon on the demo config.

The daemon runs in-process on loopback with the built-in demo config
(``mlxd serve``'s, its demo models written under a temporary state dir): the
tiny random-weight llama ``demo`` answers gibberish, so structured answers
and tool calls are valid only because decoding is grammar-constrained.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import jsonschema
import openai
import pydantic
import pytest

from mlxd.config import Config, builtin_demo_config
from tests.support.daemon import serving
from tests.support.official import openai_client as client
from tests.support.official import run

MODEL = "demo"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12},
                       "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}
#: a schema whose every answer is short: the grammar ends it well before max_output_tokens
READING = {
    "type": "object",
    "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}, "hot": {"type": "boolean"}},
    "required": ["unit", "hot"],
    "additionalProperties": False,
}
READING_FORMAT = {"format": {"type": "json_schema", "name": "reading", "schema": READING,
                             "strict": True}}
#: the events of a streamed text message, in order, between the response's first two and its last
TEXT_EVENTS = ["response.output_item.added", "response.content_part.added",
               "response.output_text.delta", "response.output_text.done",
               "response.content_part.done", "response.output_item.done"]
CALL_EVENTS = ["response.output_item.added", "response.function_call_arguments.delta",
               "response.function_call_arguments.done", "response.output_item.done"]


@pytest.fixture(scope="module")
def demo_config(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Config]:
    """The built-in demo config, its demo models written under a state dir of this module."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLXD_STATE_DIR", str(tmp_path_factory.mktemp("state")))
        yield builtin_demo_config()


def collapse(types: list[str]) -> list[str]:
    """Event types with runs of deltas made one (the order is what is checked)."""
    out: list[str] = []
    for t in types:
        if not (out and out[-1] == t and t.endswith(".delta")):
            out.append(t)
    return out


async def test_create_with_a_string_and_with_items(demo_config: Config, tmp_path: Path) -> None:
    """responses.create takes a string or message items (all four roles, instructions) and answers a response object with usage."""
    async with serving(demo_config, tmp_path) as s:
        c = client(s)
        r = await run(lambda: c.responses.create(model=MODEL, input="hello", max_output_tokens=6,
                                                 temperature=0))
        assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
        assert [o.type for o in r.output] == ["message"]
        assert r.output[0].role == "assistant" and r.output[0].content[0].type == "output_text"
        assert r.output_text == r.output[0].content[0].text
        assert r.usage.output_tokens == 6 and r.usage.input_tokens > 0
        assert r.usage.total_tokens == r.usage.input_tokens + 6
        items = [
            {"role": "developer", "content": "answer briefly"},
            {"role": "system", "content": [{"type": "input_text", "text": "you are terse"}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
            {"role": "assistant", "content": [{"type": "output_text", "text": "hello"}]},
            {"role": "user", "content": "and again"},
            {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "opaque"},
        ]
        r2 = await run(lambda: c.responses.create(model=MODEL, input=items, instructions="be kind",
                                                  max_output_tokens=4, temperature=0,
                                                  metadata={"k": "v"}, user="u1"))
        assert r2.usage.input_tokens > r.usage.input_tokens  # every item went into the prompt
        assert r2.instructions == "be kind" and r2.metadata == {"k": "v"} and r2.user == "u1"


async def test_stream_sends_every_event_in_order_and_equals_the_whole(
    demo_config: Config, tmp_path: Path
) -> None:
    """responses.stream sends created, in_progress, the item/part/text events and completed, numbered in order; its text equals the whole response's at temperature 0."""
    args: dict[str, Any] = dict(model=MODEL, input="is it hot?", text=READING_FORMAT,
                                max_output_tokens=200, temperature=0)
    async with serving(demo_config, tmp_path) as s:
        c = client(s)
        whole = await run(lambda: c.responses.create(**args))

        def streamed() -> tuple[list[Any], Any]:
            with c.responses.stream(**args) as stream:
                events = list(stream)
                return events, stream.get_final_response()

        events, final = await run(streamed)
        types = [e.type for e in events]
        assert collapse(types) == ["response.created", "response.in_progress", *TEXT_EVENTS,
                                   "response.completed"], types
        assert [e.sequence_number for e in events] == list(range(len(events)))
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert whole.status == final.status == "completed"
        assert text == final.output_text == whole.output_text
        jsonschema.validate(json.loads(text), READING)
        assert events[-1].response.usage.output_tokens == whole.usage.output_tokens


async def test_streamed_function_call_events(demo_config: Config, tmp_path: Path) -> None:
    """A forced function call streams output_item.added, function_call_arguments.delta/.done and output_item.done, and completes."""
    async with serving(demo_config, tmp_path) as s:
        c = client(s)

        def streamed() -> tuple[list[Any], Any]:
            with c.responses.stream(model=MODEL, input="weather in Paris?", tools=[WEATHER],
                                    tool_choice="required", max_output_tokens=96,
                                    temperature=0) as stream:
                return list(stream), stream.get_final_response()

        events, final = await run(streamed)
        types = collapse([e.type for e in events])
        assert types == ["response.created", "response.in_progress", *CALL_EVENTS,
                         "response.completed"], types
        call = final.output[-1]
        assert call.type == "function_call" and call.name == "get_weather"
        assert call.call_id.startswith("call_")
        jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
        done = next(e for e in events if e.type == "response.function_call_arguments.done")
        assert done.arguments == call.arguments


async def test_parse_with_a_pydantic_model(demo_config: Config, tmp_path: Path) -> None:
    """responses.parse returns an instance of the pydantic model given as text_format, with status completed."""

    class Reading(pydantic.BaseModel):
        city: str = pydantic.Field(max_length=12)
        unit: Literal["celsius", "fahrenheit"]
        hot: bool

    async with serving(demo_config, tmp_path) as s:
        c = client(s)
        r = await run(lambda: c.responses.parse(model=MODEL, input="weather?", text_format=Reading,
                                                temperature=0))
        assert r.status == "completed"
        assert isinstance(r.output_parsed, Reading) and len(r.output_parsed.city) <= 12


async def test_function_call_round_trip_stored_and_resent(demo_config: Config, tmp_path: Path) -> None:
    """A function call continued with previous_response_id reads the same prompt as the history resent with store: false, and only stored responses can be read back."""
    async with serving(demo_config, tmp_path) as s:
        c = client(s)
        first = await run(lambda: c.responses.create(
            model=MODEL, input="weather in Paris?", tools=[WEATHER], tool_choice="required",
            max_output_tokens=96, temperature=0))
        call = first.output[-1]
        assert first.status == "completed" and call.type == "function_call"
        result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21C"}
        chained = await run(lambda: c.responses.create(
            model=MODEL, previous_response_id=first.id, input=[result], tools=[WEATHER],
            max_output_tokens=5, temperature=0))
        assert chained.previous_response_id == first.id
        history = [{"role": "user", "content": "weather in Paris?"},
                   {"type": "function_call", "call_id": call.call_id, "name": call.name,
                    "arguments": call.arguments}, result]
        resent = await run(lambda: c.responses.create(
            model=MODEL, input=history, tools=[WEATHER], max_output_tokens=5, temperature=0,
            store=False))
        assert chained.usage.input_tokens == resent.usage.input_tokens > first.usage.input_tokens
        assert resent.output_text == chained.output_text  # the same prompt, greedy
        # the conversation's prefix came from the prompt cache
        assert resent.usage.input_tokens_details.cached_tokens > 0
        got = await run(lambda: c.responses.retrieve(chained.id))
        assert got.model_dump() == chained.model_dump()
        with pytest.raises(openai.NotFoundError) as exc:
            await run(lambda: c.responses.retrieve(resent.id))
        assert exc.value.code == "response_not_found"
        journal = sqlite3.connect(tmp_path / "journal.db")
        rows = journal.execute("SELECT id, previous_response_id FROM responses ORDER BY created_at").fetchall()
        assert rows == [(first.id, None), (chained.id, first.id)]
        routes = {r[0] for r in journal.execute("SELECT route FROM leases")}
        assert routes == {"/v1/responses"}


async def test_not_found_and_bad_request_shapes(demo_config: Config, tmp_path: Path) -> None:
    """Unknown and deleted ids are 404 response_not_found; a forced built-in tool and a bad item are 400s naming the field."""
    async with serving(demo_config, tmp_path) as s:
        c = client(s)
        r = await run(lambda: c.responses.create(model=MODEL, input="hi", max_output_tokens=2))
        deleted = await run(lambda: c.responses.delete(r.id))
        assert deleted is None  # the client returns nothing for a 200 delete
        for call in (lambda: c.responses.retrieve(r.id), lambda: c.responses.delete(r.id),
                     lambda: c.responses.retrieve("resp_nope")):
            with pytest.raises(openai.NotFoundError) as exc:
                await run(call)
            assert exc.value.code == "response_not_found" and exc.value.param == "response_id"
            assert exc.value.body["type"] == "invalid_request_error"
        with pytest.raises(openai.NotFoundError) as exc:
            await run(lambda: c.responses.create(model=MODEL, input="hi", previous_response_id=r.id))
        assert exc.value.param == "previous_response_id" and r.id in exc.value.message
        cases: list[tuple[dict[str, Any], str, str]] = [
            ({"tools": [{"type": "web_search"}], "tool_choice": {"type": "web_search_preview"}},
             "tool_choice", "web_search_preview"),
            ({"tools": [WEATHER], "tool_choice": {"type": "mcp", "server_label": "deepwiki"}},
             "tool_choice", "deepwiki"),
            ({"input": [{"type": "hologram"}]}, "input[0].type", "hologram"),
            ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
             "input[0].content[0].type", "input_file"),
            ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}},
             "text.format.schema", "JSON Schema"),
            ({"model": "no-such-model"}, "model", "no-such-model"),
        ]
        for extra, param, named in cases:
            body = {"model": MODEL, "input": "hi", "max_output_tokens": 2, **extra}
            with pytest.raises((openai.BadRequestError, openai.NotFoundError)) as bad:
                await run(lambda body=body: c.responses.create(**body))
            assert bad.value.param == param and named in bad.value.message, bad.value.body
        # built-in tools that are only offered are left out of the prompt: the request is served
        ok = await run(lambda: c.responses.create(
            model=MODEL, input="hi", max_output_tokens=2,
            tools=[{"type": "web_search"}, {"type": "code_interpreter", "container": {"type": "auto"}},
                   WEATHER]))
        assert ok.status == "incomplete" and [t.name for t in ok.tools] == ["get_weather"]
