"""Long prompts on the default demo config: KV drawn from the budget, not from a fixed region.

The daemon runs in-process (real journal, manager, hypercorn on loopback) on
``etc/models.demo.yaml`` with its demo models written under a temporary state
dir; requests go through the official-shaped HTTP API. The tiny demo model has
a 65,536-token context and 1 KiB of KV a token; its load reserves one
2,048-token sequence, and a longer request's KV is reserved in the budget.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import pytest
import trio

from mlxd.config import load_config
from mlxd.resources import demo_config_path
from tests.support.daemon import serving


def _prompt(tokens: int) -> str:
    """About ``tokens`` tokens of the demo tokenizer (12.9 tokens per repeat, measured)."""
    return " ".join(f"item {i % 97} of the list" for i in range(int(tokens / 12.8) + 1))


@pytest.fixture
def demo_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("MLXD_STATE_DIR", str(tmp_path / "state"))
    return load_config(demo_config_path())


async def _complete(c: Any, tokens: int) -> dict[str, Any]:
    r = await c.post("/v1/completions", json={
        "model": "demo", "prompt": _prompt(tokens), "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


async def test_a_20k_token_prompt_is_served_on_the_default_demo_config(
    demo_config: Any, tmp_path: Path
) -> None:
    """A 20,000-token prompt on the tiny demo model is served (its KV reserved in the budget,
    given back afterwards), and a prompt over its 65,536-token context is a 400 naming both."""
    async with serving(demo_config, tmp_path) as s, s.client(timeout=600) as c:
        body = await _complete(c, 20_000)
        assert body["usage"]["prompt_tokens"] >= 20_000
        r = await c.post("/v1/completions", json={
            "model": "demo", "prompt": _prompt(70_000), "max_tokens": 4})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "context_length_exceeded"
        assert "65,536" in err["message"] and "70," in err["message"], err["message"]
        plan = (await c.get("/admin/plan", params={"model": "demo", "tokens": "70000"})).json()
        assert plan["error"]["code"] == "context_length_exceeded", plan
        with trio.fail_after(10):
            await s.until(lambda: s.manager.model_snapshot("demo").kv_bytes == 0)


@pytest.mark.stress
async def test_a_60k_token_prompt_is_served_on_the_default_demo_config(
    demo_config: Any, tmp_path: Path
) -> None:
    """A 60,000-token prompt on the tiny demo model is served on the default demo config."""
    async with serving(demo_config, tmp_path) as s, s.client(timeout=1800) as c:
        body = await _complete(c, 60_000)
        assert body["usage"]["prompt_tokens"] >= 60_000


async def test_an_idle_model_is_evicted_for_kv_and_the_journal_says_why(
    demo_config: Any, tmp_path: Path
) -> None:
    """With fake-a (busy, least recently used) and demo-small (idle) loaded and a budget that
    cannot hold both and a long request's KV, the idle one is evicted for the KV; the
    journal's transition row says ``evicted`` and its event says for what; the plan said so
    beforehand."""
    from dataclasses import replace

    async with serving(demo_config, tmp_path) as s, s.client(timeout=600) as c:
        for name in ("fake-a", "demo-small", "demo"):
            assert (await c.post(f"/admin/models/{name}/load")).status_code == 200
        # the budget now holds the three and 1 MiB more (a reload, as POST /admin/reload)
        tight = s.manager.snapshot().committed_bytes + (1 << 20)
        await s.manager.reload(replace(demo_config, manager=replace(
            demo_config.manager, memory_budget_bytes=tight)))
        async with s.manager.lease("fake-a"):  # busy: not an idle victim
            plan = (await c.get("/admin/plan", params={"model": "demo", "tokens": "12000"})).json()
            assert plan["action"] == "evict_then_load", plan
            assert [v["model"] for v in plan["victims"]] == ["demo-small"], plan
            await _complete(c, 12_000)
            assert s.manager.state_of("fake-a").value == "loaded"
        history = (await c.get("/admin/history", params={"model": "demo-small"})).json()
    db = sqlite3.connect(tmp_path / "journal.db")
    rows = db.execute(
        "SELECT t.reason, json_extract(e.payload, '$.cause') FROM transitions t JOIN events e "
        "ON e.seq = t.seq WHERE t.model = 'demo-small' AND t.to_state = 'unloading'").fetchall()
    assert rows and rows[0][0] == "evicted", (rows, history)
    assert "KV of a request on 'demo'" in rows[0][1], rows
