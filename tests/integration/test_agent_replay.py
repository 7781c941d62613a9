"""Claude Code's recorded first request, replayed against the real daemon on the demo config.

The fixture (``tests/fixtures/agents/claude_code_first_request.json``, recorded
by ``python -m tests.support.agents record``) is what Claude Code sends before
its first answer: a ``system`` message inside ``messages``, ``thinking``,
``context_management``, ``output_config``, ``metadata``, ``cache_control``,
24 tools, ``max_tokens: 32000``. The default suite replays it trimmed (every
field and block kind, shorter texts and three tools: ~4,400 tokens); the whole
one (~56,000 tokens of the demo tokenizer) runs with ``--stress``.

The whole request fits because the demo models draw their KV from the memory
budget (a fixed ``kv_cache_gb`` of the old demo config held ~20,000 tokens).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

from mlxd.config import Config
from tests.support.agent_streams import check_messages_stream
from tests.support.agents import fixture, trimmed
from tests.support.daemon import serving
from tests.support.official import anthropic_client, run

pytestmark = pytest.mark.mlx


RAW_EVENTS = ("message_start", "content_block_start", "content_block_delta", "content_block_stop",
              "message_delta", "message_stop", "ping", "error")


async def replay(cfg: Config, tmp: Path, body: dict[str, Any], *, deadline: float) -> None:
    """``body`` gets a 200 whole and streamed; the stream's raw events pass Claude Code's parser's
    rules and the official client's accumulator assembles a message from them."""
    async with serving(cfg, tmp) as s:
        async with s.client(timeout=deadline) as http:
            with trio.fail_after(deadline):
                whole = await http.post("/v1/messages", json={**body, "stream": False})
            assert whole.status_code == 200, whole.text[:500]
            msg = whole.json()
            assert msg["type"] == "message" and msg["role"] == "assistant" and msg["content"]
            assert msg["stop_reason"] in ("end_turn", "max_tokens", "tool_use")
            assert msg["usage"]["input_tokens"] + msg["usage"]["cache_read_input_tokens"] > 0

        c = anthropic_client(s, timeout=deadline)
        rest = {k: v for k, v in body.items() if k not in ("model", "max_tokens", "messages", "stream")}

        def sdk() -> tuple[list[tuple[str, dict[str, Any]]], Any]:
            raw: list[tuple[str, dict[str, Any]]] = []
            with c.messages.stream(model=body["model"], max_tokens=body["max_tokens"],
                                   messages=body["messages"], extra_body=rest) as st:
                for event in st:  # the raw events, and the helper's own ("text", ...)
                    if event.type in RAW_EVENTS:
                        raw.append((event.type, event.model_dump(mode="json", exclude_none=True)))
                return raw, st.get_final_message()

        with trio.fail_after(deadline):
            raw, final = await run(sdk)
        assembled = check_messages_stream(raw)
        assert final.stop_reason == assembled["stop_reason"]
        assert [b.type for b in final.content] == [b["type"] for b in assembled["content"]]
        assert final.usage.output_tokens == assembled["usage"]["output_tokens"] > 0


async def test_claude_code_first_request_trimmed_is_served(demo: Config, tmp_path: Path) -> None:
    """Claude Code's first request (every field, trimmed texts) is served whole and streamed."""
    body = trimmed(fixture("claude_code"))
    assert body["messages"][1]["role"] == "system" and body["thinking"] == {"type": "adaptive"}
    await replay(demo, tmp_path, body, deadline=120)


@pytest.mark.stress
async def test_claude_code_first_request_whole_is_served(demo: Config, tmp_path: Path) -> None:
    """Claude Code's whole first request (~56,000 tokens, max_tokens 32,000) is served whole and streamed."""
    await replay(demo, tmp_path, fixture("claude_code"), deadline=900)


async def test_count_tokens_of_claude_codes_request_only_counts(demo: Config, tmp_path: Path) -> None:
    """count_tokens counts Claude Code's whole request although its KV exceeds the model's kv_cache_gb."""
    body = fixture("claude_code")
    async with serving(demo, tmp_path) as s, s.client(timeout=120) as http:
        r = await http.post("/v1/messages/count_tokens",
                            json={k: v for k, v in body.items() if k != "max_tokens"})
        assert r.status_code == 200, r.text[:300]
        assert r.json()["input_tokens"] > 25_000
