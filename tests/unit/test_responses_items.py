"""The Responses API's request rules and shapes, without a server: items to chat, fields, events."""

from __future__ import annotations

import json
from typing import Any

import pytest

from mlxd.engines.base import ChatMessage, Finished, TextDelta, ToolCall, ToolCallDelta
from mlxd.errors import InvalidRequest, Preempted
from mlxd.http.generation import Collected
from mlxd.http.responses_events import ResponsesRenderer
from mlxd.http.responses_fields import DEFAULT_MAX_OUTPUT_TOKENS, parse_responses
from mlxd.http.responses_items import chat_messages, input_items

FN = {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}


def parse(**fields: Any) -> Any:
    return parse_responses({"model": "m", "input": "hi", **fields})


def test_items_become_the_chat_a_template_reads() -> None:
    """System and developer messages join the instructions in one first system message, in order; a call joins the assistant message before it; outputs are tool messages; reasoning is left out."""
    items = input_items([
        {"role": "developer", "content": "d1"},
        {"role": "user", "content": [{"type": "input_text", "text": "q"}]},
        {"type": "reasoning", "id": "rs", "summary": [], "encrypted_content": "opaque"},
        {"role": "assistant", "content": [{"type": "output_text", "text": "let me look"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{\"a\": 1}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": {"b": 2}},
        {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "r1"}]},
        {"type": "web_search_call", "id": "ws", "status": "completed"},
        {"role": "system", "content": "s2"},
    ], allow_images=False)
    assert chat_messages("inst", items) == (
        ChatMessage("system", "inst\n\nd1\n\ns2"),
        ChatMessage("user", "q"),
        ChatMessage("assistant", "let me look",
                    (ToolCall("c1", "f", '{"a": 1}'), ToolCall("c2", "g", '{"b": 2}'))),
        ChatMessage("tool", "r1", tool_call_id="c1"),
    )
    assert chat_messages(None, input_items("hello", allow_images=False)) == (ChatMessage("user", "hello"),)


def test_fields_defaults_and_what_they_become() -> None:
    """Defaults (store, 4,096 output tokens), top_p 0 is greedy, built-in tools are left out, allowed_tools narrows the functions, the logprobs include turns logprobs on."""
    p = parse()
    assert p.store and p.max_output_tokens == DEFAULT_MAX_OUTPUT_TOKENS and p.tool_choice == "auto"
    assert p.echo["tools"] == [] and p.echo["text"] == {"format": {"type": "text"}}
    assert parse(top_p=0, temperature=1.5).temperature == 0.0
    g = {**FN, "name": "g"}
    p = parse(tools=[{"type": "web_search"}, FN, g, {"type": "namespace", "name": "ns", "tools": []}],
              tool_choice={"type": "allowed_tools", "mode": "required",
                           "tools": [{"type": "function", "name": "g"}, {"type": "web_search"}]})
    assert [t.name for t in p.tools] == ["g"] and p.tool_choice == "required"
    assert p.constraint is not None and p.constraint.kind == "tool_call"
    assert [t["name"] for t in p.echo["tools"]] == ["f", "g"]
    assert parse(include=["message.output_text.logprobs"], top_logprobs=3).logprobs == 3
    assert parse(include=["reasoning.encrypted_content"]).logprobs is None


@pytest.mark.parametrize(("fields", "param"), [
    ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
    ({"tools": [{"type": "web_search"}], "tool_choice": "required"}, "tool_choice"),
    ({"tools": [FN], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name"),
    ({"tools": [FN], "tool_choice": "required",
      "text": {"format": {"type": "json_object"}}}, "text.format"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"background": True}, "background"),
    ({"background": 0}, "background"),
    ({"input": None}, "input"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}]},
     "input[0].content[0]"),
])
def test_refusals_name_their_field(fields: dict[str, Any], param: str) -> None:
    """Each refused request is an InvalidRequest whose param names the field."""
    with pytest.raises(InvalidRequest) as e:
        parse(**fields)
    assert e.value.param == param


def events(frames: list[bytes]) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for f in frames for line in f.decode().split("\n")
            if line.startswith("data: ")]


def test_the_stream_numbers_every_event_and_matches_the_whole() -> None:
    """Text, then a call, then the end: every event numbered in order, and the last response's output equals the whole response's."""
    stored: list[dict[str, Any]] = []
    r = ResponsesRenderer(parse(), on_done=stored.append)
    call = ToolCallDelta(0, ToolCall("call_1", "f", "{}"))
    fin = Finished("tool_calls", 5, 3)
    frames = [r.first(), *r.text(TextDelta("he")), *r.text(TextDelta("")), *r.text(TextDelta("y")),
              *r.call(call), *r.finish(fin)]
    evs = events(frames)
    assert [e["sequence_number"] for e in evs] == list(range(len(evs)))
    assert evs[-1]["type"] == "response.completed" and stored == [evs[-1]["response"]]
    whole = ResponsesRenderer(parse()).whole(Collected(False, ["he", "y"], calls=[call]), fin)
    strip = [{k: v for k, v in o.items() if k != "id"} for o in whole["output"]]
    assert strip == [{k: v for k, v in o.items() if k != "id"} for o in evs[-1]["response"]["output"]]
    assert whole["usage"] == evs[-1]["response"]["usage"]
    failed = ResponsesRenderer(parse())
    evs = events([failed.first(), *failed.text(TextDelta("x")), failed.error(Preempted("gone"))])
    assert evs[-1]["type"] == "response.failed" and evs[-1]["response"]["error"]["code"] == "preempted"
    assert evs[-1]["response"]["output"][0]["status"] == "incomplete"
    assert [e["sequence_number"] for e in evs] == list(range(len(evs)))


def test_reasoning_effort_sets_the_templates_thinking_switch() -> None:
    """`reasoning.effort` none/minimal turns a template's thinking off, low and up turn it on, absent leaves the default."""
    from mlxd.http.responses_api import _thinking

    assert _thinking(None) is None
    assert _thinking("none") is False and _thinking("minimal") is False
    assert all(_thinking(e) is True for e in ("low", "medium", "high", "xhigh"))
