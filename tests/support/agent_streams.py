"""What the agents' stream parsers require of a Messages stream, as checks (test support).

:func:`check_messages_stream` holds an Anthropic Messages event stream to the
rules Claude Code's reader and the Anthropic SDKs' accumulators rely on: one
``message_start`` first (a message with ``id``, ``role``, ``content: []``,
``usage.input_tokens``), blocks numbered from 0, each opened by
``content_block_start`` before its deltas, deltas of the block's own kind
(``text_delta`` on text, ``input_json_delta`` on tool_use, ``thinking_delta`` /
``signature_delta`` on thinking), each block closed once and none left open,
then one ``message_delta`` (``stop_reason``, ``usage.output_tokens``) and
``message_stop`` last; ``ping`` anywhere. It returns the message the events
assemble (tool inputs parsed), for comparison with the whole response.
"""

from __future__ import annotations

import json
from typing import Any

DELTA_OF = {"text": ("text_delta",), "tool_use": ("input_json_delta",),
            "thinking": ("thinking_delta", "signature_delta")}
STOP_REASONS = ("end_turn", "max_tokens", "stop_sequence", "tool_use")


def sse_events(raw: str) -> list[tuple[str, dict[str, Any]]]:
    """``(event name, data)`` of each event of an SSE body."""
    out: list[tuple[str, dict[str, Any]]] = []
    for chunk in raw.replace("\r\n", "\n").split("\n\n"):
        name, data = "", []
        for line in chunk.split("\n"):
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].lstrip())
        if data:
            out.append((name, json.loads("\n".join(data))))
    return out


def check_messages_stream(events: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """Assert the rules of the module docstring; the assembled message."""
    events = [(n, d) for n, d in events if d.get("type") != "ping"]
    assert events, "an empty stream"
    for name, data in events:
        assert name == data.get("type"), f"event name {name!r} differs from its type {data.get('type')!r}"
    kinds = [d["type"] for _, d in events]
    assert kinds[0] == "message_start", kinds[:3]
    assert kinds[-2:] == ["message_delta", "message_stop"], kinds[-3:]
    assert "error" not in kinds
    msg = events[0][1]["message"]
    for key in ("id", "type", "role", "model", "content", "usage"):
        assert key in msg, f"message_start lacks message.{key}"
    assert msg["role"] == "assistant" and msg["content"] == []
    assert isinstance(msg["usage"]["input_tokens"], int)
    blocks: list[dict[str, Any]] = []
    partial: dict[int, str] = {}
    open_index: int | None = None
    for _, d in events[1:-2]:
        kind = d["type"]
        if kind == "content_block_start":
            assert open_index is None, f"block {d['index']} starts while block {open_index} is open"
            assert d["index"] == len(blocks), f"block index {d['index']}, expected {len(blocks)}"
            block = dict(d["content_block"])
            assert block["type"] in DELTA_OF, block
            if block["type"] == "tool_use":
                assert block["id"] and block["name"] and block["input"] == {}
            blocks.append(block)
            open_index = d["index"]
        elif kind == "content_block_delta":
            assert d["index"] == open_index, f"a delta for block {d['index']}, open: {open_index}"
            block, delta = blocks[d["index"]], d["delta"]
            assert delta["type"] in DELTA_OF[block["type"]], (block["type"], delta["type"])
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            elif delta["type"] == "thinking_delta":
                block["thinking"] += delta["thinking"]
            elif delta["type"] == "signature_delta":
                block["signature"] = delta["signature"]
            else:
                partial[d["index"]] = partial.get(d["index"], "") + delta["partial_json"]
        elif kind == "content_block_stop":
            assert d["index"] == open_index, f"block {d['index']} stops, open: {open_index}"
            if blocks[open_index]["type"] == "tool_use":
                blocks[open_index]["input"] = json.loads(partial.get(open_index) or "{}")
            open_index = None
        else:
            raise AssertionError(f"unexpected event {kind!r} between the blocks")
    assert open_index is None, f"block {open_index} is never stopped"
    delta = events[-2][1]
    assert delta["delta"]["stop_reason"] in STOP_REASONS, delta
    assert isinstance(delta["usage"]["output_tokens"], int)
    return {**msg, "content": blocks, "stop_reason": delta["delta"]["stop_reason"],
            "usage": {**msg["usage"], **delta["usage"]}}
