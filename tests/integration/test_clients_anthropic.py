"""The official `anthropic` client against the real daemon on the tiny demo model: /v1/messages."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anthropic
import jsonschema
import pytest
import trio

from tests.integration.conftest import config_of, fake
from tests.support.daemon import serving
from tests.support.official import anthropic_client as client
from tests.support.official import run

WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"],
    },
}
HI = [{"role": "user", "content": "hello there"}]


@pytest.fixture
def cfg(tiny_model: Path, tmp_path: Path) -> Any:
    return config_of(
        {
            "manager": {"memory_budget_gb": 1, "contention_policy": {"strategy": "fail"}},
            "models": [
                {"name": "tiny", "path": str(tiny_model), "estimated_memory_gb": 0.01},
                fake("slow", 0.6, tokens_per_second=20),
                fake("other", 0.6),
            ],
        },
        tmp_path,
    )


async def test_create_and_stream(cfg: Any, tmp_path: Path) -> None:
    """messages.create answers a text message with usage; messages.stream yields the same text and a final message with usage."""
    async with serving(cfg, tmp_path) as s:
        c = client(s)
        whole = await run(lambda: c.messages.create(model="tiny", max_tokens=8, messages=HI,
                                                    system="be brief", extra_body={"temperature": 0}))
        assert whole.type == "message" and whole.role == "assistant"
        assert whole.stop_reason == "max_tokens" and whole.usage.output_tokens == 8
        assert whole.usage.input_tokens > 0 and whole.content[0].type == "text"

        def stream() -> tuple[list[str], Any, list[str]]:
            kinds: list[str] = []
            with c.messages.stream(model="tiny", max_tokens=8, messages=HI, system="be brief",
                                   extra_body={"temperature": 0}) as st:
                texts = []
                for event in st:
                    kinds.append(event.type)
                    if event.type == "text":
                        texts.append(event.text)
                return texts, st.get_final_message(), kinds

        texts, final, kinds = await run(stream)
        assert "".join(texts) == final.content[0].text == whole.content[0].text
        assert final.usage.output_tokens == 8
        # the same prompt again: its tokens are read from the prompt cache, as Anthropic counts them
        prompt = whole.usage.input_tokens + whole.usage.cache_read_input_tokens
        assert final.usage.cache_read_input_tokens > 0
        assert final.usage.input_tokens + final.usage.cache_read_input_tokens == prompt
        assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
        assert "content_block_start" in kinds and "message_delta" in kinds


async def test_raw_event_order_includes_ping(cfg: Any, tmp_path: Path) -> None:
    """The stream's events come in Anthropic's order: message_start, ping, block start/deltas/stop, message_delta, message_stop."""
    async with serving(cfg, tmp_path) as s, s.client() as h:
        body = {"model": "tiny", "max_tokens": 4, "messages": HI, "stream": True, "temperature": 0}
        async with h.stream("POST", "/v1/messages", json=body) as r:
            names = [line[len("event: "):] async for line in r.aiter_lines()
                     if line.startswith("event: ")]
        assert names[:3] == ["message_start", "ping", "content_block_start"]
        assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
        assert set(names[3:-3]) == {"content_block_delta"}


async def test_tool_use_round_trip(cfg: Any, tmp_path: Path) -> None:
    """A forced tool gives a tool_use block with valid input; sending its tool_result back gets an answer."""
    async with serving(cfg, tmp_path) as s:
        c = client(s)
        first = await run(lambda: c.messages.create(
            model="tiny", max_tokens=64, messages=HI, tools=[WEATHER],
            tool_choice={"type": "tool", "name": "get_weather"}, extra_body={"temperature": 0}))
        assert first.stop_reason == "tool_use"
        use = next(b for b in first.content if b.type == "tool_use")
        assert use.name == "get_weather"
        jsonschema.validate(use.input, WEATHER["input_schema"])
        history = [*HI, {"role": "assistant", "content": [b.model_dump() for b in first.content]},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                 "content": "sunny, 21 degrees"}]}]
        second = await run(lambda: c.messages.create(
            model="tiny", max_tokens=6, messages=history, tools=[WEATHER],
            tool_choice={"type": "none"}, extra_body={"temperature": 0}))
        assert second.stop_reason == "max_tokens" and second.content[0].type == "text"
        n = await run(lambda: c.messages.count_tokens(model="tiny", messages=history, tools=[WEATHER],
                                                      tool_choice={"type": "none"}))
        assert n.input_tokens == second.usage.input_tokens


async def test_errors_in_anthropics_envelope(cfg: Any, tmp_path: Path) -> None:
    """Errors are raised as the client's APIStatusError subclasses, with Anthropic's envelope, status and Retry-After."""
    async with serving(cfg, tmp_path) as s:
        c = client(s)
        with pytest.raises(anthropic.NotFoundError) as nf:
            await run(lambda: c.messages.create(model="nope", max_tokens=4, messages=HI))
        assert nf.value.body["type"] == "error" and nf.value.body["error"]["type"] == "not_found_error"
        with pytest.raises(anthropic.BadRequestError) as bad:
            await run(lambda: c.messages.create(
                model="tiny", max_tokens=4,
                messages=[{"role": "user", "content": [{"type": "hologram", "x": 1}]}]))
        assert "messages[0].content[0].type" in bad.value.body["error"]["message"]
        async with s.client() as h, trio.open_nursery() as n:
            started = trio.Event()

            async def hold() -> None:
                body = {"model": "slow", "max_tokens": 40, "messages": HI, "stream": True}
                async with h.stream("POST", "/v1/messages", json=body) as r:
                    async for _ in r.aiter_lines():
                        started.set()

            n.start_soon(hold)
            await started.wait()
            with pytest.raises(anthropic.InternalServerError) as busy:
                await run(lambda: c.messages.create(model="other", max_tokens=4, messages=HI))
            assert busy.value.status_code == 503
            assert busy.value.response.headers["Retry-After"] == "1"
            assert busy.value.body["error"]["type"] == "overloaded_error"
            n.cancel_scope.cancel()


async def test_auth_by_x_api_key_or_bearer_and_route_on_the_lease(cfg: Any, tmp_path: Path) -> None:
    """With an API key set, x-api-key (the anthropic client) and Bearer both work; the lease row records /v1/messages."""
    async with serving(cfg, tmp_path, api_key="sekret") as s:
        with pytest.raises(anthropic.AuthenticationError) as exc:
            await run(lambda: client(s, api_key="wrong").messages.create(
                model="other", max_tokens=2, messages=HI))
        assert exc.value.body["error"]["type"] == "authentication_error"
        ok = await run(lambda: client(s, api_key="sekret").messages.create(
            model="other", max_tokens=2, messages=HI))
        assert ok.usage.output_tokens == 2
        async with s.client(headers={"Authorization": "Bearer sekret"}) as h:
            r = await h.post("/v1/messages", json={"model": "other", "max_tokens": 2, "messages": HI})
        assert r.status_code == 200, r.text
        await s.journal.wait_committed()
        leases = s.journal.leases(model="other")
        assert len(leases) == 2 and {row["route"] for row in leases} == {"/v1/messages"}
