"""Codex CLI's recorded first request (``tests/fixtures/agents/codex_first_request.json``),
replayed against the demo config and checked with the rules of Codex's own stream parser.

Codex (codex-rs ``codex-api/src/sse/responses.rs``, ``process_sse``) reads
``data:`` JSON events by ``type``: it needs ``response.created`` to carry a
``response``; every ``response.output_item.done`` item to be a ResponseItem
it can deserialize (a ``message`` with ``role`` and ``output_text`` parts, or
a ``function_call`` with ``name``, ``arguments`` as a string and
``call_id``); and a ``response.completed`` whose ``response`` has an ``id``
and, if any, ``usage`` with integer ``input_tokens``, ``output_tokens``,
``total_tokens`` (and ``cached_tokens`` / ``reasoning_tokens`` in their
details). A stream that ends without ``response.completed`` is an error to it.

The recorded prompt is ~41 KB (about 30,000 tokens on the demo model's byte
tokenizer): a minute and more of CPU prefill. So the default suite replays it
with every string cut to 200 characters (every item, tool, field and nesting
kept as recorded); ``--stress`` replays it verbatim. Both add ``seed`` (an
mlxd extension) so the run repeats; the demo model's random weights then end
their answer with their end token, as a real model would.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from mlxd.config import Config, builtin_demo_config
from tests.support.daemon import serving

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "agents" / "codex_first_request.json"
SEED = 2


@pytest.fixture(scope="module")
def demo_config(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Config]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLXD_STATE_DIR", str(tmp_path_factory.mktemp("state")))
        yield builtin_demo_config()


def recorded() -> dict[str, Any]:
    body: dict[str, Any] = json.loads(FIXTURE.read_text())
    return body


def cut(v: Any, n: int = 200) -> Any:
    """``v`` with every string cut to ``n`` characters (its structure unchanged)."""
    if isinstance(v, str):
        return v[:n]
    if isinstance(v, list):
        return [cut(x, n) for x in v]
    if isinstance(v, dict):
        return {k: cut(x, n) for k, x in v.items()}
    return v


def sse_events(text: str) -> list[tuple[str | None, dict[str, Any]]]:
    """(event name, data) of each SSE frame with data (comments skipped)."""
    out: list[tuple[str | None, dict[str, Any]]] = []
    for frame in text.split("\n\n"):
        name, data = None, []
        for line in frame.split("\n"):
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data.append(line[6:])
        if data:
            out.append((name, json.loads("\n".join(data))))
    return out


def check_response_item(item: dict[str, Any]) -> None:
    """What codex_protocol's ResponseItem needs of the two items mlxd writes."""
    if item["type"] == "message":
        assert item["role"] == "assistant"
        assert all(p["type"] == "output_text" and isinstance(p["text"], str) for p in item["content"])
    else:
        assert item["type"] == "function_call"
        assert isinstance(item["name"], str) and isinstance(item["call_id"], str)
        assert isinstance(item["arguments"], str)


def check_usage(usage: dict[str, Any]) -> None:
    for key in ("input_tokens", "output_tokens", "total_tokens"):
        assert isinstance(usage[key], int), usage
    assert isinstance(usage["input_tokens_details"]["cached_tokens"], int)
    assert isinstance(usage["output_tokens_details"]["reasoning_tokens"], int)


def check_codex_stream(text: str) -> dict[str, Any]:
    """The stream as Codex parses it; returns the completed response."""
    events = sse_events(text)
    types = [data["type"] for _, data in events]
    assert all(name == data["type"] for name, data in events)  # event: names match the type
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    assert types[:2] == ["response.created", "response.in_progress"], types
    assert isinstance(events[0][1]["response"], dict)
    assert types[-1] == "response.completed" and types.count("response.completed") == 1, types
    for _, data in events:
        if data["type"] == "response.output_item.done":
            check_response_item(data["item"])
    completed = events[-1][1]["response"]
    assert isinstance(completed["id"], str) and completed["status"] == "completed"
    check_usage(completed["usage"])
    deltas = "".join(d["delta"] for _, d in events if d["type"] == "response.output_text.delta")
    message = next(o for o in completed["output"] if o["type"] == "message")
    assert deltas == message["content"][0]["text"]
    return dict(completed)


async def replay(config: Config, tmp: Path, body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The body served whole, then streamed (as Codex sends it); both must be answered 200."""
    async with serving(config, tmp) as s, s.client(timeout=900) as c:
        whole = await c.post("/v1/responses", json={**body, "stream": False})
        assert whole.status_code == 200, whole.text[:500]
        streamed = await c.post("/v1/responses", json=body)
        assert streamed.status_code == 200, streamed.text[:500]
        assert streamed.headers["content-type"].startswith("text/event-stream")
        completed = check_codex_stream(streamed.text)
        assert s.manager.status()["leases"] == []
    return whole.json(), completed


def check_pair(whole: dict[str, Any], completed: dict[str, Any]) -> None:
    assert whole["status"] == "completed" and whole["store"] is False
    for item in whole["output"]:
        check_response_item(item)
    check_usage(whole["usage"])
    # the same prompt and seed: the same answer
    assert [o["content"][0]["text"] for o in whole["output"] if o["type"] == "message"] == [
        o["content"][0]["text"] for o in completed["output"] if o["type"] == "message"]
    assert completed["usage"]["input_tokens"] == whole["usage"]["input_tokens"]
    # the built-in web_search and the namespace tool were left out; the function tools offered
    assert {t["name"] for t in completed["tools"]} == {
        t["name"] for t in recorded()["tools"] if t["type"] == "function"}


async def test_codex_first_request_is_served_whole_and_streamed(demo_config: Config, tmp_path: Path) -> None:
    """Codex's recorded request, its strings cut short, gets 200 whole and a stream Codex's parser accepts, ending in response.completed."""
    body = {**cut(recorded()), "seed": SEED}
    assert body["stream"] is True and body["store"] is False
    with trio.fail_after(300):
        whole, completed = await replay(demo_config, tmp_path, body)
    check_pair(whole, completed)
    # the stream's prompt came from the prompt cache the whole request filled (the verbatim
    # prompt is larger than the demo model's prompt_cache_gb holds)
    assert completed["usage"]["input_tokens_details"]["cached_tokens"] > 0


@pytest.mark.stress
async def test_codex_first_request_verbatim(demo_config: Config, tmp_path: Path) -> None:
    """Codex's recorded request, verbatim (its whole ~41 KB prompt), is served whole and streamed as Codex's parser expects."""
    with trio.fail_after(1800):
        whole, completed = await replay(demo_config, tmp_path, {**recorded(), "seed": SEED})
    check_pair(whole, completed)
