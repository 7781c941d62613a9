"""A distributed model (two ranks on 127.0.0.1) through HTTP: residency treats it as one model.

It loads, serves, is evicted for another model, is preempted by another
model, is unloaded by an admin; killing one of its ranks fails it cleanly
(``engine_died``) and the next request starts both ranks again. Every rank
process is gone whenever the model is not resident.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import psutil
import pytest
import trio

from tests.integration.conftest import config_of, fake
from tests.integration.test_http_residency import CHAT, body, stream_lines, transitions
from tests.support.daemon import Served, serving

pytestmark = pytest.mark.mlx


def ranks(served: Served) -> list[int]:
    engine = served.manager.model_status("d")["engine"]
    return [w["pid"] for w in engine["workers"]] if engine else []


def all_gone(pids: list[int]) -> bool:
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                return False
        except psutil.NoSuchProcess:
            continue
    return True


@pytest.mark.stress
async def test_a_distributed_model_lives_like_any_model(tmp_path: Path, tiny_model: Path) -> None:
    cfg = config_of(
        {
            "manager": {"memory_budget_gb": 1,
                        "contention_policy": {"strategy": "wait_then_preempt", "preempt_after_s": 0}},
            "models": [
                {"name": "d", "path": str(tiny_model), "estimated_memory_gb": 0.6,
                 "distributed": {"hosts": ["127.0.0.1", "127.0.0.1"]}},
                fake("f", 0.6, tokens_per_second=50),
            ],
        },
        tmp_path,
    )
    async with serving(cfg, tmp_path) as s, s.client(timeout=120) as c:
        # loads and serves: two ranks, one model
        r = await c.post(CHAT, json={**body("d", max_tokens=8), "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
        first = ranks(s)
        assert len(first) == 2
        # evicted (idle) for f: both ranks end
        assert (await c.post(CHAT, json=body("f"))).status_code == 200
        assert s.manager.state_of("d").value == "unloaded" and all_gone(first)
        # preempted (busy) for f
        assert (await c.post("/admin/models/f/unload")).status_code == 200
        lines: list[str] = []
        started = trio.Event()
        async with trio.open_nursery() as n:
            n.start_soon(stream_lines, c, body("d", stream=True, max_tokens=60_000), lines, started)
            await started.wait()
            second = ranks(s)
            assert (await c.post(CHAT, json=body("f"))).status_code == 200
        assert json.loads(lines[-1])["error"]["code"] == "preempted"
        assert all_gone(second)
        # killing one rank fails it cleanly; the next request starts both again
        assert (await c.post("/admin/models/f/unload")).status_code == 200
        assert (await c.post("/admin/models/d/load")).status_code == 200
        third = ranks(s)
        os.kill(third[1], signal.SIGKILL)
        with trio.fail_after(30):
            await s.until(lambda: s.manager.state_of("d").value == "failed")
        assert all_gone(third)
        assert "rank 1 killed by SIGKILL" in (await c.get("/v1/models/d")).json()["last_error"]
        r = await c.post(CHAT, json=body("d", max_tokens=4))
        assert r.status_code == 200
        fourth = ranks(s)
        assert len(fourth) == 2 and set(fourth).isdisjoint(third)
        # unloaded by an admin
        assert (await c.post("/admin/models/d/unload")).status_code == 200
        assert all_gone(fourth) and ranks(s) == []
        await s.journal.wait_committed()
        moves = transitions(s, "d")
        for move in [
            ("loaded", "unloading", "evicted"),
            ("draining", "unloading", "preempted"),  # wait_then_preempt: drained, then preempted
            ("loaded", "failed", "engine_died"),
            ("loaded", "unloading", "admin"),
        ]:
            assert move in moves, (move, moves)


async def test_the_plan_counts_no_request_kv_on_a_distributed_model(tmp_path: Path, tiny_model: Path) -> None:
    """``/admin/plan?tokens=N`` adds a request's KV for a text model but none for a distributed
    one, whose ranks book no KV per request (the eligibility rule, mlxd.config.kv)."""
    common = {"path": str(tiny_model), "estimated_memory_gb": 0.1}
    cfg = config_of({"manager": {"memory_budget_gb": 1}, "models": [
        {"name": "d", **common, "distributed": {"hosts": ["127.0.0.1", "127.0.0.1"]}},
        {"name": "t", **common}]}, tmp_path)
    async with serving(cfg, tmp_path) as s, s.client(timeout=60) as c:
        async def committed(model: str, **tokens: str) -> int:
            r = await c.get("/admin/plan", params={"model": model, **tokens})
            assert r.status_code == 200, r.text
            return int(r.json()["committed_after"])

        assert await committed("t", tokens="20000") > await committed("t")
        assert await committed("d", tokens="20000") == await committed("d")
