"""The official `openai` client against the real daemon on the tiny demo model: tools, structured output, logprobs.

The demo model has random weights, so every structured answer below is valid
only because decoding is grammar-constrained; the answers are checked with
the ``jsonschema`` validator. The default run sends a few requests of each
kind; ``--stress`` sends the acceptance counts (100 of each).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import jsonschema
import openai
import pydantic
import pytest
import trio

from mlxd.engines.model_files.demo_model import write_demo_model
from tests.integration.conftest import config_of
from tests.support.daemon import serving
from tests.support.official import openai_client as client
from tests.support.official import run

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
}
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
        "role": {"enum": ["admin", "user"]},
    },
    "required": ["name", "age", "tags", "role"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "what is the weather in Paris?"}]


def count(stress: bool) -> int:
    """Requests per acceptance check: 100 under --stress, a handful by default."""
    return 100 if stress else 8


@pytest.fixture(scope="session")
def plain_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny demo model whose chat template has no tool support."""
    path = tmp_path_factory.mktemp("models") / "plain"
    write_demo_model(path, "tiny", tools=False)
    return path


@pytest.fixture
def cfg(tiny_model: Path, plain_model: Path, tmp_path: Path) -> Any:
    return config_of(
        {
            "manager": {"memory_budget_gb": 2},
            "models": [
                {"name": "tiny", "path": str(tiny_model), "estimated_memory_gb": 0.01},
                {"name": "plain", "path": str(plain_model), "estimated_memory_gb": 0.01},
            ],
        },
        tmp_path,
    )


#: requests in flight at once in the acceptance loops: the model decodes them in one batch
WIDTH = 4


async def each_seed(n: int, check: Any) -> None:
    """``check(seed)`` (a blocking client call and its asserts) for seeds 0..n-1, WIDTH at a time."""
    limit = trio.CapacityLimiter(WIDTH)

    async def one(seed: int) -> None:
        async with limit:
            await run(lambda: check(seed))

    async with trio.open_nursery() as nursery:
        for seed in range(n):
            nursery.start_soon(one, seed)


async def test_json_schema_and_json_object_answers_validate(cfg: Any, tmp_path: Path, stress: bool) -> None:
    """Every json_schema answer of the random model validates against its schema, and every
    json_object answer is a JSON object, with requests decoded together in batches."""
    n = count(stress)
    async with serving(cfg, tmp_path) as s:
        c = client(s)
        fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}

        def ask(seed: int, response_format: Any) -> Any:
            return c.chat.completions.create(model="tiny", messages=ASK, max_tokens=160, seed=seed,
                                             response_format=response_format)

        def check(seed: int) -> None:
            r = ask(seed, fmt)
            jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
            o = ask(seed, {"type": "json_object"})
            assert isinstance(json.loads(o.choices[0].message.content), dict)

        await each_seed(n, check)


async def test_named_tool_choice_calls_that_function_with_valid_arguments(cfg: Any, tmp_path: Path, stress: bool) -> None:
    """A named tool_choice always yields one call of that function whose arguments validate
    against its parameters, with requests decoded together in batches."""
    n = count(stress)
    async with serving(cfg, tmp_path) as s:
        c = client(s)

        def check(seed: int) -> None:
            r = c.chat.completions.create(
                model="tiny", messages=ASK, tools=[WEATHER, CLOCK], max_tokens=96, seed=seed,
                tool_choice={"type": "function", "function": {"name": "get_weather"}})
            choice = r.choices[0]
            assert choice.finish_reason == "tool_calls"
            assert len(choice.message.tool_calls) == 1
            call = choice.message.tool_calls[0]
            assert call.type == "function" and call.function.name == "get_weather"
            assert call.id.startswith("call_")
            jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])

        await each_seed(n, check)


async def test_streamed_tool_calls_equal_the_whole_response(cfg: Any, tmp_path: Path) -> None:
    """With the same seed, the tool calls the openai client assembles from deltas equal the whole response's."""
    async with serving(cfg, tmp_path) as s:
        c = client(s)
        args = dict(model="tiny", messages=ASK, tools=[WEATHER, CLOCK], max_tokens=96, seed=11,
                    tool_choice="required")
        whole = await run(lambda: c.chat.completions.create(**args))

        def streamed() -> Any:
            with c.chat.completions.stream(**args) as stream:
                for _ in stream:
                    pass
                return stream.get_final_completion()

        final = await run(streamed)
        w, f = whole.choices[0], final.choices[0]
        assert f.finish_reason == w.finish_reason == "tool_calls"
        assert [(t.function.name, t.function.arguments) for t in f.message.tool_calls] == [
            (t.function.name, t.function.arguments) for t in w.message.tool_calls
        ]


async def test_parse_with_a_pydantic_model(cfg: Any, tmp_path: Path) -> None:
    """client.chat.completions.parse returns an instance of the pydantic model given as response_format."""

    class Reading(pydantic.BaseModel):
        city: str = pydantic.Field(max_length=12)
        unit: Literal["celsius", "fahrenheit"]
        hot: bool

    async with serving(cfg, tmp_path) as s:
        c = client(s)
        r = await run(lambda: c.chat.completions.parse(
            model="tiny", messages=ASK, response_format=Reading, max_tokens=96, seed=5))
        parsed = r.choices[0].message.parsed
        assert isinstance(parsed, Reading) and len(parsed.city) <= 12


async def test_logprobs_whole_and_streamed(cfg: Any, tmp_path: Path) -> None:
    """Chat logprobs and top_logprobs come per token, whole and streamed alike; completions carry the legacy shape."""
    async with serving(cfg, tmp_path) as s:
        c = client(s)
        args = dict(model="tiny", messages=ASK, max_tokens=6, seed=2, logprobs=True, top_logprobs=3)
        whole = await run(lambda: c.chat.completions.create(**args))
        content = whole.choices[0].logprobs.content
        assert len(content) == whole.usage.completion_tokens == 6
        text = bytes(b for t in content for b in t.bytes).decode(errors="replace")
        assert text == whole.choices[0].message.content  # random weights write broken UTF-8 too
        for t in content:
            assert t.logprob <= 0 and len(t.top_logprobs) == 3
            assert t.top_logprobs[0].logprob >= t.logprob - 1e-5  # the most likely comes first
            assert t.top_logprobs[0].logprob >= t.top_logprobs[-1].logprob
        chunks = await run(lambda: list(c.chat.completions.create(**args, stream=True)))
        streamed = [t for ch in chunks if ch.choices and ch.choices[0].logprobs
                    for t in ch.choices[0].logprobs.content]
        assert [(t.token, round(t.logprob, 4)) for t in streamed] == [
            (t.token, round(t.logprob, 4)) for t in content]
        comp = await run(lambda: c.completions.create(model="tiny", prompt="the quick", max_tokens=5,
                                                      logprobs=2, seed=1))
        lp = comp.choices[0].logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]


async def test_tool_errors_are_400s_naming_the_field(cfg: Any, tmp_path: Path) -> None:
    """Non-object tool parameters, an unknown named function, an invalid json_schema and a model without tool support each get a 400 naming the field."""
    bad_params = {"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}
    cases: list[tuple[dict[str, Any], str, str | None]] = [
        ({"tools": [bad_params]}, "tools[0].function.parameters", None),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice.function.name", None),
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}},
         "response_format.json_schema.schema", None),
        ({"tools": [WEATHER], "model": "plain"}, "tools", "tools_not_supported"),
    ]
    async with serving(cfg, tmp_path) as s:
        c = client(s)
        for extra, param, code in cases:
            body = {"model": "tiny", "messages": ASK, "max_tokens": 4, **extra}
            with pytest.raises(openai.BadRequestError) as exc:
                await run(lambda body=body: c.chat.completions.create(**body))
            assert exc.value.param == param, exc.value.body
            if code is not None:
                assert exc.value.code == code


async def test_ten_turn_agent_loop(cfg: Any, tmp_path: Path) -> None:
    """An agent loop: the model calls a tool, gets the result, calls again (10 turns), then answers in text."""
    async with serving(cfg, tmp_path) as s:
        c = client(s)
        messages: list[dict[str, Any]] = list(ASK)
        for turn in range(10):
            r = await run(lambda turn=turn: c.chat.completions.create(
                model="tiny", messages=messages, tools=[WEATHER, CLOCK], tool_choice="required",
                max_tokens=64, seed=turn))
            msg = r.choices[0].message
            assert r.choices[0].finish_reason == "tool_calls" and msg.tool_calls
            messages.append(msg.model_dump(exclude_none=True))
            for call in msg.tool_calls:
                messages.append({"role": "tool", "tool_call_id": call.id,
                                 "content": json.dumps({"turn": turn, "result": "sunny"})})
        final = await run(lambda: c.chat.completions.create(
            model="tiny", messages=messages, tools=[WEATHER, CLOCK], tool_choice="none",
            max_tokens=8, seed=99))
        assert final.choices[0].message.tool_calls is None
        assert final.choices[0].message.content
        assert final.usage.prompt_tokens > 300  # the whole history went into the prompt
