"""The budget guard closes constrained JSON as late as closing needs, and the answer ends ``stop``.

The random demo model writes JSON strings without end; at a tight
``max_tokens`` the guard must close them. It acts only when the tokens left
come down to the need it measured from the grammar's state (plus its slack),
so the JSON is complete, valid, ends on its own (``stop``) and uses nearly all
of the budget; a budget too small to close the JSON at all ends ``length``.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from mlxd.engines.base import Constraint, GenerationRequest
from mlxd.engines.grammar.constrained import SLACK, GrammarProcessor
from mlxd.engines.mlx_text import MlxTextEngine
from tests.engines.mlx_helpers import chat, collect
from tests.engines.test_constrained_batch import SCHEMAS, WEATHER

pytestmark = pytest.mark.mlx


def _processor(request: GenerationRequest) -> GrammarProcessor:
    (p,) = [p for p in request.logits_processors if isinstance(p, GrammarProcessor)]
    return p


@pytest.mark.parametrize("max_tokens", [40, 64, 96])
async def test_json_closed_by_the_guard_ends_stop_near_the_limit(engine: MlxTextEngine, max_tokens: int) -> None:
    """At a tight max_tokens, each schema's JSON validates and ends 'stop'; when the guard
    acted, it started within the last tokens the closing needed, not a quarter early."""
    guarded = 0
    for seed, schema in enumerate(SCHEMAS * 2):
        request = await engine.prepare(chat(
            f"describe thing {seed}", max_tokens=max_tokens, temperature=1.0, seed=seed,
            constraint=Constraint("json_schema", json.dumps(schema))))
        text, fin, _ = await collect(engine, request)
        jsonschema.validate(json.loads(text), schema)
        assert fin.finish_reason == "stop", (text, fin)
        if _processor(request).guard_used:
            guarded += 1
            assert fin.completion_tokens >= max_tokens - 3 * SLACK, (text, fin)
    assert guarded > 0  # the random model needed the guard at these budgets


async def test_a_budget_too_small_to_close_ends_length(engine: MlxTextEngine) -> None:
    """A max_tokens below what the schema's required keys need ends 'length' (the limit cut it)."""
    text, fin, _ = await collect(engine, chat(
        "describe", max_tokens=5, constraint=Constraint("json_schema", json.dumps(SCHEMAS[0]))))
    assert fin.finish_reason == "length" and fin.completion_tokens == 5
    with pytest.raises(ValueError):
        json.loads(text)


async def test_a_forced_tool_call_closed_by_the_guard_is_a_call(engine: MlxTextEngine) -> None:
    """A named tool call at a tight budget is still a call with valid arguments (finish tool_calls)."""
    request = chat("weather?", max_tokens=72, temperature=1.0, seed=7, tools=(WEATHER,),
                   tool_choice="function", tool_name="get_weather", constraint=Constraint("tool_call"))
    events: list[Any] = []
    async for ev in engine.generate(request):
        events.append(ev)
    calls = [e for e in events if hasattr(e, "call")]
    assert events[-1].finish_reason == "tool_calls" and len(calls) == 1
    jsonschema.validate(json.loads(calls[0].call.arguments), WEATHER.parameters)


async def test_closing_need_walks_to_an_accepting_state(engine: MlxTextEngine) -> None:
    """At the start, the need of a schema with required keys is a few tokens, at most the cap."""
    request = await engine.prepare(chat(
        "x", max_tokens=64, constraint=Constraint("json_schema", json.dumps(SCHEMAS[3]))))
    p = _processor(request)
    need = p.closing_need(64)
    assert 0 < need < 64
    assert p.closing_need(2) == 2  # capped: more than the limit says the limit


async def test_a_number_that_could_go_on_is_ended_in_time(engine: MlxTextEngine) -> None:
    """A top-level number is complete after each digit: near the limit the guard ends it there ('stop')."""
    schema = {"type": "integer"}
    for seed in range(3):
        text, fin, _ = await collect(engine, chat(
            "a number", max_tokens=24, temperature=1.0, seed=seed, logits_processors=(digits_first,),
            constraint=Constraint("json_schema", json.dumps(schema))))
        assert fin.finish_reason == "stop", (text, fin)
        assert isinstance(json.loads(text), int)


def digits_first(_tokens: Any, logits: Any) -> Any:
    """Makes the random model prefer to keep writing (everything but its end-of-sequence token)."""
    import mlx.core as mx

    return mx.where(mx.arange(logits.shape[-1]) == 1, logits - 30.0, logits)
