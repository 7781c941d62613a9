"""End to end with the official `openai` client against the real daemon on loopback.

The daemon runs in-process (real journal, manager, hypercorn on 127.0.0.1 port 0);
the synchronous OpenAI client runs in a worker thread, as a user's program would.
Text generation is real mlx-lm on a tiny demo model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest
import trio

from tests.integration.conftest import config_of, fake
from tests.support.daemon import Served, serving


def client(served: Served, **kw: Any) -> openai.OpenAI:
    """A client whose connections close with the test (idle keep-alives would hold shutdown)."""
    c = openai.OpenAI(base_url=served.url + "/v1", api_key="unused", **kw)
    served.on_close(c.close)
    return c


async def in_thread(fn: Any, *args: Any) -> Any:
    return await trio.to_thread.run_sync(fn, *args)


@pytest.fixture
def mixed_config(tiny_model: Path, tmp_path: Path) -> Any:
    return config_of(
        {
            "manager": {"memory_budget_gb": 2},
            "models": [
                {"name": "tiny", "path": str(tiny_model), "estimated_memory_gb": 0.01},
                fake("fake-a", 0.5),
            ],
        },
        tmp_path,
    )


async def test_models_list_and_retrieve(mixed_config: Any, tmp_path: Path) -> None:
    """The client lists every model with its residency state and retrieves one; an unknown one raises NotFoundError."""
    async with serving(mixed_config, tmp_path) as s:
        c = client(s)
        page = await in_thread(c.models.list)
        by_id = {m.id: m for m in page.data}
        assert set(by_id) == {"tiny", "fake-a"}
        assert by_id["tiny"].model_extra["status"] == "unloaded"
        assert by_id["tiny"].model_extra["loaded"] is False
        one = await in_thread(c.models.retrieve, "fake-a")
        assert one.id == "fake-a" and one.model_extra["memory_source"] == "config"
        with pytest.raises(openai.NotFoundError) as exc:
            await in_thread(c.models.retrieve, "nope")
        assert exc.value.code == "model_not_found"


async def test_chat_whole_and_streamed_with_real_mlx(mixed_config: Any, tmp_path: Path) -> None:
    """A real mlx-lm chat completion works whole and streamed, with usage that adds up, and the model shows as loaded."""
    async with serving(mixed_config, tmp_path) as s:
        c = client(s)
        msgs = [{"role": "user", "content": "hello there"}]
        whole = await in_thread(
            lambda: c.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, seed=3)
        )
        assert whole.object == "chat.completion"
        assert whole.choices[0].finish_reason in ("length", "stop")
        assert whole.usage.completion_tokens <= 8 and whole.usage.prompt_tokens > 0
        assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens

        def stream() -> list[Any]:
            return list(
                c.chat.completions.create(
                    model="tiny", messages=msgs, max_tokens=8, seed=3, stream=True,
                    stream_options={"include_usage": True},
                )
            )

        chunks = await in_thread(stream)
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        assert text == whole.choices[0].message.content  # same seed, same text
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
        assert all(ch.usage is None for ch in chunks[:-1])
        retrieved = await in_thread(c.models.retrieve, "tiny")
        assert retrieved.model_extra["status"] == "loaded"


async def test_completion_whole_and_streamed(mixed_config: Any, tmp_path: Path) -> None:
    """/v1/completions works whole and streamed through the client, with a stop string ending it."""
    async with serving(mixed_config, tmp_path) as s:
        c = client(s)
        whole = await in_thread(
            lambda: c.completions.create(model="tiny", prompt="the quick brown", max_tokens=6)
        )
        assert whole.object == "text_completion" and whole.usage.completion_tokens <= 6
        chunks = await in_thread(
            lambda: list(c.completions.create(model="fake-a", prompt="hi", max_tokens=50,
                                              stream=True, stop=["fake"]))
        )
        text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
        assert text == "This is mlxd's "
        assert chunks[-1].choices[0].finish_reason == "stop"


async def test_capacity_errors_raise_with_status_code_and_retry_after(tmp_path: Path) -> None:
    """Under `fail`, a model that cannot fit next to a busy one raises InternalServerError 503 model_capacity with Retry-After."""
    cfg = config_of(
        {
            "manager": {"memory_budget_gb": 1, "contention_policy": {"strategy": "fail"}},
            "models": [fake("a", 0.6, tokens_per_second=20), fake("b", 0.6)],
        },
        tmp_path,
    )
    async with serving(cfg, tmp_path) as s, trio.open_nursery() as n:
        c = client(s, max_retries=0)
        started = trio.Event()

        def long_stream() -> None:
            stream = c.chat.completions.create(
                model="a", messages=[{"role": "user", "content": "x"}], max_tokens=30, stream=True
            )
            for _ in stream:
                started_from_thread()

        token = trio.lowlevel.current_trio_token()

        def started_from_thread() -> None:
            trio.from_thread.run_sync(started.set, trio_token=token)

        n.start_soon(in_thread, long_stream)
        await started.wait()
        with pytest.raises(openai.InternalServerError) as exc:
            await in_thread(
                lambda: c.chat.completions.create(
                    model="b", messages=[{"role": "user", "content": "x"}], max_tokens=2
                )
            )
        assert exc.value.status_code == 503
        assert exc.value.code == "model_capacity"
        assert exc.value.response.headers["Retry-After"] == "1"


async def test_model_exceeding_budget_is_a_bad_request(tmp_path: Path) -> None:
    """A model larger than the whole budget raises BadRequestError model_exceeds_budget, and the client does not retry."""
    cfg = config_of(
        {"manager": {"memory_budget_gb": 1}, "models": [fake("big", 2)]}, tmp_path
    )
    async with serving(cfg, tmp_path) as s:
        with pytest.raises(openai.BadRequestError) as exc:
            await in_thread(
                lambda: client(s).chat.completions.create(
                    model="big", messages=[{"role": "user", "content": "x"}]
                )
            )
        assert exc.value.code == "model_exceeds_budget"
