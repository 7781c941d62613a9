"""/v1/messages takes what current Claude Code sends: system-role messages, thinking, the newer fields.

Real daemon, tiny demo models: ``tiny`` (no thinking markers) and ``thinker``
(``<think>`` / ``</think>`` in its vocabulary and a thinking switch in its
chat template, :func:`tests.support.demo.write_thinking_model`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.integration.conftest import config_of
from tests.support.agent_streams import check_messages_stream, sse_events
from tests.support.daemon import serving
from tests.support.demo import write_thinking_model
from tests.support.official import anthropic_client, run

pytestmark = pytest.mark.mlx

HI = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="session")
def thinking_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_thinking_model(tmp_path_factory.mktemp("models") / "thinker")


@pytest.fixture
def cfg(tiny_model: Path, thinking_model: Path, tmp_path: Path) -> Any:
    return config_of({"manager": {"memory_budget_gb": 1}, "models": [
        {"name": "tiny", "path": str(tiny_model), "estimated_memory_gb": 0.01},
        {"name": "thinker", "path": str(thinking_model), "estimated_memory_gb": 0.01},
    ]}, tmp_path)


async def test_system_and_developer_messages_join_the_system_prompt_in_order(cfg: Any, tmp_path: Path) -> None:
    """system and developer messages inside messages count exactly as the same texts joined into system."""
    inside = {"model": "tiny", "system": [{"type": "text", "text": "A", "cache_control": {"type": "ephemeral"}}],
              "messages": [HI[0], {"role": "system", "content": "B"},
                           {"role": "developer", "content": [{"type": "text", "text": "C"}]}]}
    joined = {"model": "tiny", "system": "A\n\nB\n\nC", "messages": HI}
    swapped = {"model": "tiny", "system": "A\n\nC\n\nB", "messages": HI}
    async with serving(cfg, tmp_path) as s, s.client() as http:
        counts = []
        for body in (inside, joined, swapped):
            r = await http.post("/v1/messages/count_tokens", json=body)
            assert r.status_code == 200, r.text
            counts.append(r.json()["input_tokens"])
        assert counts[0] == counts[1]
        r = await http.post("/v1/messages", json={**inside, "max_tokens": 4})
        assert r.status_code == 200, r.text


async def test_claude_codes_fields_are_accepted_and_unknown_ones_ignored(cfg: Any, tmp_path: Path) -> None:
    """thinking, context_management, output_config.effort, metadata, service_tier, cache_control and
    unknown top-level fields get a 200; thinking blocks in the history are accepted."""
    body = {
        "model": "tiny", "max_tokens": 4, "stream": False,
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "x"},
                                              {"type": "redacted_thinking", "data": "abc"},
                                              {"type": "text", "text": "hello"}]},
            {"role": "user", "content": "again"},
        ],
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"}, "metadata": {"user_id": "u"}, "service_tier": "auto",
        "some_future_field": {"x": 1}, "betas": ["y"],
    }
    async with serving(cfg, tmp_path) as s, s.client() as http:
        r = await http.post("/v1/messages", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["service_tier"] == "standard"


@pytest.mark.parametrize(("change", "param", "named"), [
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
     "messages[0].content[0].type", "document"),
    ({"messages": [{"role": "user", "content": [{"type": "thinking", "thinking": "x"}]}]},
     "messages[0].content[0].type", "assistant"),
    ({"system": [{"type": "image"}]}, "system[0].type", "image"),
    ({"thinking": {"type": "sometimes"}}, "thinking", "adaptive"),
    ({"output_config": {"effort": "extreme"}}, "output_config.effort", "high"),
    ({"output_config": {"format": {"type": "regex"}}}, "output_config.format.type", "json_schema"),
    ({"output_config": {"format": {"type": "json_schema", "schema": 3}}}, "output_config.format.schema", "schema"),
    ({"service_tier": "priority"}, "service_tier", "standard_only"),
    ({"output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}},
      "output_format": {"type": "json_schema", "schema": {"type": "object"}}}, "output_format", "once"),
    ({"messages": [{"role": "system", "content": "only a system message"}]}, "messages", "user or assistant"),
])
async def test_bad_fields_are_400s_naming_them(cfg: Any, tmp_path: Path, change: dict[str, Any],
                                               param: str, named: str) -> None:
    """Unknown block types and malformed newer fields are 400s in Anthropic's envelope naming the field."""
    async with serving(cfg, tmp_path) as s, s.client() as http:
        r = await http.post("/v1/messages", json={"model": "tiny", "max_tokens": 4, "messages": HI, **change})
        assert r.status_code == 400, r.text
        err = r.json()
        assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
        assert param in err["error"]["message"] and named in err["error"]["message"]


async def test_a_thinking_model_streams_thinking_blocks(cfg: Any, tmp_path: Path) -> None:
    """With thinking on, a model whose template has the switch answers in thinking blocks (markers
    removed), whole and streamed alike; with thinking off or a model without markers, text only."""
    async with serving(cfg, tmp_path) as s, s.client() as http:
        def body(model: str, thinking: str, stream: bool) -> dict[str, Any]:
            return {"model": model, "max_tokens": 12, "messages": HI, "temperature": 0,
                    "thinking": {"type": thinking}, "stream": stream}

        streamed = await http.post("/v1/messages", json=body("thinker", "adaptive", True))
        msg = check_messages_stream(sse_events(streamed.text))
        whole = (await http.post("/v1/messages", json=body("thinker", "adaptive", False))).json()
        assert msg["content"][0]["type"] == whole["content"][0]["type"] == "thinking"
        assert [b["type"] for b in msg["content"]] == [b["type"] for b in whole["content"]]
        for kind, key in (("thinking", "thinking"), ("text", "text")):
            assert "".join(b[key] for b in msg["content"] if b["type"] == kind) == "".join(
                b[key] for b in whole["content"] if b["type"] == kind)
        # markers end blocks and are not text (a "<think>" inside a thinking block is only text)
        assert all("</think>" not in b.get("thinking", "") for b in msg["content"]), msg["content"]
        assert all("<think>" not in b.get("text", "") for b in msg["content"]), msg["content"]
        assert whole["content"][0]["signature"]

        for model, thinking in (("thinker", "disabled"), ("tiny", "enabled")):
            off = check_messages_stream(sse_events(
                (await http.post("/v1/messages", json=body(model, thinking, True))).text))
            assert {b["type"] for b in off["content"]} == {"text"}

    async with serving(cfg, tmp_path) as s:
        c = anthropic_client(s)

        def sdk() -> Any:
            with c.messages.stream(model="thinker", max_tokens=12, messages=HI,
                                   thinking={"type": "enabled", "budget_tokens": 1024}) as st:
                return st.get_final_message()

        final = await run(sdk)
        assert final.content[0].type == "thinking" and final.content[0].thinking


@pytest.mark.parametrize("isolation", ["thread", "process"])
async def test_count_tokens_counts_a_prompt_whose_kv_does_not_fit(tiny_model: Path, tmp_path: Path,
                                                                  isolation: str) -> None:
    """count_tokens counts a prompt over the model's KV room (kv_cache_gb 0.001: ~1,000 tokens of
    the tiny model's 1 KB each), in-process and in a worker process."""
    cfg = config_of({"manager": {"memory_budget_gb": 1}, "models": [
        {"name": "tiny", "path": str(tiny_model), "estimated_memory_gb": 0.01, "kv_cache_gb": 0.001,
         "isolation": isolation}]}, tmp_path)
    long = [{"role": "user", "content": "the quick brown fox jumps over the lazy dog " * 300}]
    async with serving(cfg, tmp_path) as s, s.client(timeout=120) as http:
        r = await http.post("/v1/messages/count_tokens", json={"model": "tiny", "messages": long})
        assert r.status_code == 200, r.text
        assert r.json()["input_tokens"] > 1_100
