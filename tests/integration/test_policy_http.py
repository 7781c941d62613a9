"""Residency policy through HTTP: load progress in streams and events, keep_alive,
X-Mlxd-Contention, /admin/plan and `mlxd plan`; fake engines, the real daemon on loopback."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import httpx
import openai
import trio

from tests.integration.conftest import config_of, fake
from tests.support.daemon import Served, serving

CHAT = "/v1/chat/completions"
PROGRESS = re.compile(r"^: loading slow (\d+)% eta (\d+\.\d)s$")


def body(model: str, *, stream: bool = False, max_tokens: int = 8, **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": max_tokens, "stream": stream, **extra}


async def raw_stream(c: httpx.AsyncClient, payload: dict[str, Any]) -> tuple[list[str], str]:
    """(the comment lines, the content) of one streamed chat completion, read raw."""
    comments: list[str] = []
    content: list[str] = []
    async with c.stream("POST", CHAT, json=payload) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith(":"):
                comments.append(line)
            elif line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    content.append(choice["delta"].get("content") or "")
    return comments, "".join(content)


async def test_openai_stream_behind_a_load_is_unchanged_and_raw_sse_shows_progress(
    tmp_path: Path,
) -> None:
    """The official client streaming from a model behind a 2 s load gets its content unchanged; the raw SSE of the same request shows progress comments at least once a second."""
    cfg = config_of({"manager": {"memory_budget_gb": 2},
                     "models": [fake("slow", 0.5, load_seconds=2.0, tokens_per_second=200)]}, tmp_path)
    async with serving(cfg, tmp_path) as s, s.client() as c:
        oc = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)
        s.on_close(oc.close)

        def stream_with_openai() -> str:
            chunks = oc.chat.completions.create(**body("slow", stream=True))
            return "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)

        streamed = await trio.to_thread.run_sync(stream_with_openai)
        whole = (await c.post(CHAT, json=body("slow"))).json()["choices"][0]["message"]["content"]
        assert streamed == whole and whole  # nothing of the progress leaked into the content
        (await c.post("/admin/models/slow/unload")).raise_for_status()
        t0 = trio.current_time()
        comments, content = await raw_stream(c, body("slow", stream=True))
        took = trio.current_time() - t0
        assert content == whole
        progress = [m for line in comments if (m := PROGRESS.match(line))]
        assert len(progress) >= 2, comments
        assert len(progress) >= int(took), (took, comments)  # at least one a second
        percents = [int(m.group(1)) for m in progress]
        assert percents == sorted(percents) and percents[0] < 50


async def test_load_progress_events_are_live_and_carry_no_id(tmp_path: Path) -> None:
    """While a load runs, /admin/events sends load_progress events without an id (they are not journaled)."""
    cfg = config_of({"manager": {"memory_budget_gb": 2},
                     "models": [fake("slow", 0.5, load_seconds=2.5)]}, tmp_path)
    async with serving(cfg, tmp_path) as s, s.client() as c:
        blocks: list[str] = []

        async def follow(*, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
            async with c.stream("GET", "/admin/events") as r:
                block: list[str] = []
                async for line in r.aiter_lines():
                    if line:
                        block.append(line)
                        continue
                    blocks.append("\n".join(block))
                    block = []
                    if blocks == [": mlxd events"]:  # the stream's first frame: it is following
                        task_status.started()
                    data = blocks[-1].partition("data: ")[2]
                    if data and json.loads(data).get("to_state") == "loaded":
                        return

        with trio.fail_after(30):
            async with trio.open_nursery() as n:
                await n.start(follow)
                (await c.post("/admin/models/slow/load")).raise_for_status()
        progress = [b for b in blocks if "event: load_progress" in b]
        assert len(progress) >= 2, blocks
        assert all("id:" not in b for b in progress)
        payload = json.loads(progress[-1].split("data: ", 1)[1])
        assert payload["kind"] == "load_progress" and payload["model"] == "slow"
        assert payload["elapsed_s"] > 0
        await s.journal.wait_committed()
        kinds = {row["payload"]["kind"] for row in s.journal.events_after(0, 1000)}
        assert "load_progress" not in kinds


async def until_state(s: Served, model: str, state: str) -> None:
    with trio.fail_after(10):
        await s.until(lambda: s.manager.state_of(model).value == state)


async def test_keep_alive_in_the_body_or_the_header(tmp_path: Path) -> None:
    """keep_alive 0 (body field or X-Mlxd-Keep-Alive) unloads the model as the request ends; a bad value is a 400 naming it."""
    cfg = config_of({"manager": {"memory_budget_gb": 2}, "models": [fake("a", 0.5)]}, tmp_path)
    async with serving(cfg, tmp_path) as s, s.client() as c:
        r = await c.post(CHAT, json=body("a", keep_alive=0))
        assert r.status_code == 200
        await until_state(s, "a", "unloaded")
        r = await c.post(CHAT, json=body("a"), headers={"X-Mlxd-Keep-Alive": "0s"})
        assert r.status_code == 200
        await until_state(s, "a", "unloaded")
        r = await c.post(CHAT, json=body("a", keep_alive="5m"))
        assert r.status_code == 200 and s.manager.model_snapshot("a").keep_alive_s == 300
        bad = await c.post(CHAT, json=body("a", keep_alive="soon"))
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "keep_alive"
        bad = await c.post(CHAT, json=body("a"), headers={"X-Mlxd-Contention": "eventually"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "X-Mlxd-Contention"


async def test_contention_fail_header_fails_fast(tmp_path: Path) -> None:
    """X-Mlxd-Contention: fail answers 503 model_capacity at once where the model's policy would wait."""
    cfg = config_of(
        {"manager": {"memory_budget_gb": 1, "contention_policy": {"strategy": "wait"}},
         "models": [fake("a", 0.6, tokens_per_second=20), fake("b", 0.6)]},
        tmp_path,
    )
    async with serving(cfg, tmp_path) as s, s.client() as c:
        started = trio.Event()

        async def hold_a() -> None:
            async with c.stream("POST", CHAT, json=body("a", stream=True, max_tokens=10_000)) as r:
                async for _ in r.aiter_lines():
                    started.set()

        async with trio.open_nursery() as n:
            n.start_soon(hold_a)
            await started.wait()
            t0 = trio.current_time()
            r = await c.post(CHAT, json=body("b"), headers={"X-Mlxd-Contention": "fail"})
            assert trio.current_time() - t0 < 2
            assert r.status_code == 503 and r.json()["error"]["code"] == "model_capacity"
            assert "Retry-After" in r.headers
            n.cancel_scope.cancel()


async def test_admin_plan_and_the_plan_command(tmp_path: Path) -> None:
    """GET /admin/plan says what loading a model would do and why, changes nothing; `mlxd plan` prints it."""
    cfg = config_of({"manager": {"memory_budget_gb": 1},
                     "models": [fake("a", 0.6), fake("b", 0.6)]}, tmp_path)
    async with serving(cfg, tmp_path) as s, s.client() as c:
        (await c.post("/admin/models/a/load")).raise_for_status()
        await s.journal.wait_committed()
        seq = s.journal.committed_seq
        r = await c.get("/admin/plan", params={"model": "b"})
        assert r.status_code == 200
        assert r.json() == {
            "model": "b", "action": "evict_then_load",
            "victims": [{"model": "a", "state": "loaded", "bytes": int(0.6 * 1024**3),
                         "why": "idle_lru"}],
            "error": None, "committed_after": int(0.6 * 1024**3), "eta_s": None,
        }
        assert s.manager.state_of("a").value == "loaded" and s.journal.last_seq == seq
        failing = (await c.get("/admin/plan", params={"model": "b", "contention": "fail"})).json()
        assert failing["action"] == "evict_then_load"  # idle eviction needs no waiting
        assert (await c.get("/admin/plan")).status_code == 400
        assert (await c.get("/admin/plan", params={"model": "nope"})).status_code == 404
        out = await trio.run_process([sys.executable, "-m", "mlxd", "plan", "b", "--url", s.url],
                                     capture_stdout=True, capture_stderr=True)
        text = out.stdout.decode()
        assert out.returncode == 0, out.stderr
        assert text.startswith("plan for 'b': evict_then_load")
        assert re.search(r"^  a  loaded  614\.4 MiB  idle_lru: idle, least recently used$", text, re.M)
        out = await trio.run_process(
            [sys.executable, "-m", "mlxd", "plan", "b", "--json", "--url", s.url],
            capture_stdout=True,
        )
        assert json.loads(out.stdout)["victims"][0]["model"] == "a"
