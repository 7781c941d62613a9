"""Every text field of every route refuses a lone surrogate with a 400 naming it (issue 32, finding 4).

Nine of these gave 500 before the one check where bodies are read
(:mod:`mlxd.http.text`): each route validated its own fields, and the
fields it forgot reached a tokenizer, a template or a UTF-8 encoder.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from mlxd.engines.model_files.demo_model import write_demo_model
from tests.integration.conftest import config_of
from tests.support.daemon import serving

BAD = "hi \ud800 there"
USER = {"role": "user", "content": "hello"}
OPENAI_TOOL = {"type": "function", "function": {"name": "get_weather", "description": BAD,
                                                "parameters": {"type": "object", "properties": {}}}}
CALL = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"c": "\ud800"}'}}]}
ANTHROPIC_TOOL = {"name": "get_weather", "description": BAD, "input_schema": {"type": "object"}}

#: (route, body, the JSON path the error must name)
CASES: list[tuple[str, dict[str, Any], str]] = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": BAD}]}, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [USER], "tools": [OPENAI_TOOL]}, "tools[0].function.description"),
    ("/v1/chat/completions", {"messages": [USER, CALL, {"role": "tool", "tool_call_id": "c1", "content": "x"}]},
     "messages[1].tool_calls[0].function.arguments"),
    ("/v1/messages", {"messages": [{"role": "user", "content": BAD}]}, "messages[0].content"),
    ("/v1/messages", {"messages": [USER], "system": BAD}, "system"),
    ("/v1/messages", {"messages": [{"role": "user", "content": [{"type": "text", "text": BAD}]}]},
     "messages[0].content[0].text"),
    ("/v1/messages", {"messages": [{"role": "user", "content": BAD}], "stream": True}, "messages[0].content"),
    ("/v1/messages", {"messages": [USER], "tools": [ANTHROPIC_TOOL]}, "tools[0].description"),
    ("/v1/messages/count_tokens", {"messages": [{"role": "user", "content": BAD}]}, "messages[0].content"),
    ("/v1/embeddings", {"model": "bert", "input": ["fine", BAD]}, "input[1]"),
    ("/v1/embeddings", {"model": "bert", "input": BAD}, "input"),
    ("/v1/chat/completions", {"messages": [USER], "metadata": {"k\udc00": "v"}}, 'metadata["k\\udc00"]'),
]


@pytest.fixture(scope="module")
def bert_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("models") / "bert"
    write_demo_model(path, "embedding")
    return path


@pytest.mark.parametrize(("route", "body", "path"), CASES, ids=[f"{r} {p}" for r, _, p in CASES])
async def test_a_lone_surrogate_is_a_400_naming_its_field(
    tiny_model: Path, bert_model: Path, tmp_path: Path, route: str, body: dict[str, Any], path: str
) -> None:
    """A lone surrogate in this field is a 400 whose error names the field's JSON path, in the route's own envelope."""
    cfg = config_of({"manager": {"memory_budget_gb": 2}, "models": [
        {"name": "tiny", "path": str(tiny_model), "estimated_memory_gb": 0.01},
        {"name": "bert", "path": str(bert_model), "embedding": True, "estimated_memory_gb": 0.01},
    ]}, tmp_path)
    body = {"model": "tiny", "max_tokens": 4, **body}
    if route == "/v1/messages/count_tokens" or route == "/v1/embeddings":
        body.pop("max_tokens")
    async with serving(cfg, tmp_path) as s, s.client() as c:
        r = await c.post(route, content=json.dumps(body),  # ASCII: the surrogate as \\ud800
                         headers={"Content-Type": "application/json"})
        assert r.status_code == 400, r.text
        if route.startswith("/v1/messages"):
            assert r.json()["type"] == "error"
            message = r.json()["error"]["message"]
        else:
            assert r.json()["error"]["param"] == path, r.text
            message = r.json()["error"]["message"]
        assert message.startswith(f"{path}: ") and "lone surrogate" in message, message
        assert s.manager.snapshot().committed_bytes == 0, "nothing was loaded for a refused body"
