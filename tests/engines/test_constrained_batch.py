"""Constrained decoding and tool calls on both decode paths: inside a batch and one at a time.

The tiny demo model has random weights: its output is valid JSON, or a call
of the declared function, only because each request's own grammar processor
masks its logits, whoever shares the batch with it.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import trio

from mlxd.engines.base import (
    Constraint,
    Finished,
    GenerationRequest,
    TextDelta,
    Tool,
    ToolCallDelta,
)
from mlxd.engines.mlx_text import MlxTextEngine
from tests.engines.mlx_helpers import batched_engine, chat, tiny_config

pytestmark = pytest.mark.mlx

#: four different schemas, one per request of the batch
SCHEMAS: list[dict[str, Any]] = [
    {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
        "required": ["tags"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "score": {"type": "number"}},
        "required": ["ok", "score"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"point": {"type": "object", "properties": {
            "x": {"type": "integer"}, "y": {"type": "integer"}},
            "required": ["x", "y"], "additionalProperties": False}},
        "required": ["point"],
        "additionalProperties": False,
    },
]
WEATHER = Tool(
    "get_weather",
    "The weather in a city",
    {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
)


@pytest.fixture
async def batched(tiny_model_dir: Path) -> AsyncIterator[MlxTextEngine]:
    async with batched_engine(tiny_model_dir, prefill_step=16) as eng:
        yield eng


async def _run(eng: MlxTextEngine, request: GenerationRequest) -> tuple[str, list[ToolCallDelta], Finished]:
    text: list[str] = []
    calls: list[ToolCallDelta] = []
    fin: Finished | None = None
    async for ev in eng.generate(request):
        if isinstance(ev, TextDelta):
            text.append(ev.text)
        elif isinstance(ev, ToolCallDelta):
            calls.append(ev)
        else:
            fin = ev
    assert fin is not None
    return "".join(text), calls, fin


async def test_four_schemas_in_one_batch_each_stay_valid(batched: MlxTextEngine) -> None:
    """Four requests with four different JSON schemas, decoded together at temperature 1,
    each return JSON valid against its own schema (jsonschema checks it)."""
    requests = [
        chat(f"describe thing {i}", max_tokens=96, temperature=1.0, seed=i,
             constraint=Constraint("json_schema", json.dumps(schema)))
        for i, schema in enumerate(SCHEMAS)
    ]
    out: list[tuple[str, list[ToolCallDelta], Finished] | None] = [None] * len(requests)

    async def one(i: int) -> None:
        out[i] = await _run(batched, requests[i])

    assert batched.batch is not None
    steps_before = batched.batch.steps
    async with trio.open_nursery() as nursery:
        for i in range(len(requests)):
            nursery.start_soon(one, i)
    tokens = 0
    for result, schema in zip(out, SCHEMAS, strict=True):
        assert result is not None
        text, calls, fin = result
        jsonschema.validate(json.loads(text), schema)
        assert not calls and fin.finish_reason in ("stop", "length")
        tokens += fin.completion_tokens
    # they shared decode steps: fewer steps than the tokens produced
    assert batched.batch.steps - steps_before < tokens


@pytest.mark.parametrize("batch_size", [1, 4])
async def test_tool_calls_are_split_out_on_both_paths(tiny_model_dir: Path, batch_size: int) -> None:
    """A named tool_choice gives a ToolCallDelta (not text) whose arguments are valid against
    the function's parameters, and finish_reason tool_calls, batched or one at a time."""
    eng = MlxTextEngine(tiny_config(tiny_model_dir, max_batch_size=batch_size), prefill_step=16)
    await eng.load(lambda _p: None)
    try:
        assert (eng.batch is not None) == (batch_size > 1)
        request = chat(
            "what is the weather in Paris?", max_tokens=96, temperature=1.0, seed=3,
            tools=(WEATHER,), tool_choice="function", tool_name="get_weather",
            constraint=Constraint("tool_call"),
        )
        text, calls, fin = await _run(eng, request)
    finally:
        await eng.stop()
    assert fin.finish_reason == "tool_calls"
    assert [c.call.name for c in calls] == ["get_weather"] and calls[0].index == 0
    jsonschema.validate(json.loads(calls[0].call.arguments), WEATHER.parameters)
    assert "<tool_call>" not in text
