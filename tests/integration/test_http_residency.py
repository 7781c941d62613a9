"""Residency behaviour seen through HTTP, with fake engines and the real journal."""

from __future__ import annotations

import json
import re
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from mlxd.config import Config
from mlxd.journal.journal import Journal
from tests.integration.conftest import config_of, fake
from tests.support.daemon import Served, serving

CHAT = "/v1/chat/completions"


def body(model: str, *, stream: bool = False, max_tokens: int = 5) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": max_tokens, "stream": stream}


def rows(served: Served, sql: str, *args: Any) -> list[tuple[Any, ...]]:
    con = sqlite3.connect(served.journal.path)
    try:
        return con.execute(sql, args).fetchall()
    finally:
        con.close()


def transitions(served: Served, model: str) -> list[tuple[str, str, str]]:
    return [tuple(r) for r in rows(
        served, "SELECT from_state, to_state, reason FROM transitions WHERE model = ? ORDER BY seq", model
    )]  # type: ignore[misc]


def policy_config(tmp: Path, strategy: str, **policy: Any) -> Config:
    return config_of(
        {
            "manager": {"memory_budget_gb": 1,
                        "contention_policy": {"strategy": strategy, **policy}},
            "models": [fake("a", 0.6, tokens_per_second=20), fake("b", 0.6)],
        },
        tmp,
    )


async def stream_lines(client: httpx.AsyncClient, payload: dict[str, Any], sink: list[str],
                       first: trio.Event | None = None) -> None:
    async with client.stream("POST", CHAT, json=payload) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                sink.append(line[6:])
                if first is not None and len(sink) >= 2:
                    first.set()


async def test_concurrent_cold_requests_cause_one_load(tmp_path: Path) -> None:
    """Twenty concurrent requests for a cold model are served by one load: the journal has one loading row."""
    cfg = config_of({"manager": {"memory_budget_gb": 2}, "models": [fake("a", 0.5, load_seconds=1)]},
                    tmp_path)
    async with serving(cfg, tmp_path) as s, s.client() as c:
        statuses: list[int] = []

        async def one() -> None:
            statuses.append((await c.post(CHAT, json=body("a"))).status_code)

        async with trio.open_nursery() as n:
            for _ in range(20):
                n.start_soon(one)
        assert statuses == [200] * 20
        await s.journal.wait_committed()
        assert transitions(s, "a") == [("unloaded", "loading", "request"),
                                       ("loading", "loaded", "request")]
        assert rows(s, "SELECT count(*), count(DISTINCT outcome) FROM leases")[0] == (20, 1)


async def test_client_leaving_during_load_abandons_it(tmp_path: Path) -> None:
    """A client that disconnects while its model is loading, alone, leaves the model unloaded with reason abandoned."""
    cfg = config_of({"manager": {"memory_budget_gb": 2}, "models": [fake("a", 0.5, load_seconds=30)]},
                    tmp_path)
    async with serving(cfg, tmp_path) as s:
        async with s.client() as c:
            with trio.move_on_after(1):
                await c.post(CHAT, json=body("a"))
        with trio.fail_after(5):
            await s.until(lambda: s.manager.state_of("a").value == "unloaded")
        await s.journal.wait_committed()
        assert transitions(s, "a") == [("unloaded", "loading", "request"),
                                       ("loading", "unloaded", "abandoned")]


async def test_preempt_stops_a_streaming_request(tmp_path: Path) -> None:
    """Under `preempt`, a stream on A ends with a `preempted` SSE error when B is requested; B is served; the lease outcome is preempted."""
    async with serving(policy_config(tmp_path, "preempt"), tmp_path) as s, s.client() as c:
        a_lines: list[str] = []
        first = trio.Event()
        async with trio.open_nursery() as n:
            n.start_soon(stream_lines, c, body("a", stream=True, max_tokens=10_000), a_lines, first)
            await first.wait()
            rb = await c.post(CHAT, json=body("b"))
        assert rb.status_code == 200 and rb.json()["choices"][0]["message"]["content"]
        error = json.loads(a_lines[-1])["error"]
        assert error["code"] == "preempted" and "[DONE]" not in a_lines
        await s.journal.wait_committed()
        outcomes = dict(rows(s, "SELECT model, outcome FROM leases"))
        assert outcomes == {"a": "preempted", "b": "completed"}
        assert ("loaded", "draining", "preempted") in transitions(s, "a")


async def test_preempted_stream_raises_in_the_openai_client(tmp_path: Path) -> None:
    """The official client raises APIError with code `preempted` for a preempted stream."""
    import openai

    async with serving(policy_config(tmp_path, "preempt"), tmp_path) as s, s.client() as c:
        got: list[BaseException] = []
        first = trio.Event()
        token = trio.lowlevel.current_trio_token()

        def consume() -> None:
            oc = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)
            try:
                for _ in oc.chat.completions.create(**body("a", stream=True, max_tokens=10_000)):
                    trio.from_thread.run_sync(first.set, trio_token=token)
            except openai.APIError as e:
                got.append(e)
            finally:
                oc.close()

        async with trio.open_nursery() as n:
            n.start_soon(trio.to_thread.run_sync, consume)
            await first.wait()
            assert (await c.post(CHAT, json=body("b"))).status_code == 200
        assert len(got) == 1 and getattr(got[0], "code", None) == "preempted"


@pytest.mark.parametrize(
    ("strategy", "policy", "code"),
    [("fail", {}, "model_capacity"), ("wait_then_fail", {"wait_timeout_s": 0.5}, "capacity_timeout")],
)
async def test_capacity_refusals_are_typed_503s(tmp_path: Path, strategy: str, policy: dict[str, Any],
                                                code: str) -> None:
    """`fail` and `wait_then_fail` answer 503 with their code and a Retry-After header."""
    async with serving(policy_config(tmp_path, strategy, **policy), tmp_path) as s, s.client() as c:
        first = trio.Event()
        lines: list[str] = []
        async with trio.open_nursery() as n:
            n.start_soon(stream_lines, c, body("a", stream=True, max_tokens=25), lines, first)
            await first.wait()
            t0 = trio.current_time()
            r = await c.post(CHAT, json=body("b"))
            waited = trio.current_time() - t0
        assert r.status_code == 503
        assert r.json()["error"]["code"] == code
        assert r.headers["Retry-After"] == "1"
        assert waited == pytest.approx(0.5, abs=0.25) if code == "capacity_timeout" else waited < 0.25
        assert lines[-1] == "[DONE]"  # the busy model was not disturbed


async def test_disconnect_releases_the_stream_lease(tmp_path: Path) -> None:
    """A client that drops a stream releases its lease at once, journaled with outcome disconnected."""
    cfg = config_of({"manager": {"memory_budget_gb": 2},
                     "models": [fake("a", 0.5, tokens_per_second=10)]}, tmp_path)
    async with serving(cfg, tmp_path) as s, s.client() as c:
        got: list[str] = []
        first = trio.Event()
        async with trio.open_nursery() as n:
            n.start_soon(stream_lines, c, body("a", stream=True, max_tokens=1000), got, first)
            await first.wait()
            n.cancel_scope.cancel()
        with trio.fail_after(2):
            await s.until(lambda: not s.manager.status()["leases"])
        await s.journal.wait_committed()
        assert rows(s, "SELECT outcome FROM leases") == [("disconnected",)]
        assert s.manager.status()["models"]["a"]["state"] == "loaded"


async def test_admin_load_replies_after_the_journal_row_is_committed(tmp_path: Path) -> None:
    """POST /admin/models/a/load answers once loaded, and the loaded row is already in the journal file."""
    cfg = config_of({"manager": {"memory_budget_gb": 2}, "models": [fake("a", 0.5)]}, tmp_path)
    async with serving(cfg, tmp_path) as s, s.client() as c:
        r = await c.post("/admin/models/a/load")
        assert r.status_code == 200 and r.json()["status"] == "loaded"
        assert transitions(s, "a")[-1] == ("loading", "loaded", "admin")
        r = await c.post("/admin/models/a/unload")
        assert r.status_code == 200 and r.json()["status"] == "unloaded"
        assert transitions(s, "a")[-1] == ("unloading", "unloaded", "admin")
        assert (await c.post("/admin/models/zzz/load")).status_code == 404


async def test_events_resume_without_loss_or_duplicates(tmp_path: Path) -> None:
    """/admin/events with Last-Event-ID replays exactly the events after it, then follows live ones."""
    cfg = config_of({"manager": {"memory_budget_gb": 2}, "models": [fake("a", 0.5), fake("b", 0.5)]},
                    tmp_path)
    async with serving(cfg, tmp_path) as s, s.client() as c:
        await c.post("/admin/models/a/load")
        await c.post("/admin/models/a/unload")
        all_ids = [r[0] for r in rows(s, "SELECT seq FROM events ORDER BY seq")]
        assert len(all_ids) == 4
        seen: list[tuple[int, str]] = []
        backlog_sent = trio.Event()

        async def follow() -> None:
            async with c.stream("GET", "/admin/events", headers={"Last-Event-ID": str(all_ids[1])}) as r:
                event_id = None
                async for line in r.aiter_lines():
                    if not line:
                        event_id = None  # live load_progress events carry no id: not counted
                    elif line.startswith("id: "):
                        event_id = int(line[4:])
                    elif line.startswith("data: ") and event_id is not None:
                        seen.append((event_id, json.loads(line[6:])["kind"]))
                        if len(seen) == 2:
                            backlog_sent.set()
                        if len(seen) == 4:
                            return

        async with trio.open_nursery() as n:
            n.start_soon(follow)
            # b is loaded only once the stream has sent its backlog, so b's events
            # cannot be in it: they can only arrive live.
            with trio.fail_after(30):
                await backlog_sent.wait()
            assert [i for i, _ in seen] == all_ids[2:]
            await c.post("/admin/models/b/load")
        b_ids = [r[0] for r in rows(s, "SELECT seq FROM events WHERE model = 'b' ORDER BY seq")]
        assert len(b_ids) == 2 and min(b_ids) > all_ids[-1]
        assert [i for i, _ in seen] == all_ids[2:] + b_ids
        assert all(kind == "transition" for _, kind in seen)


async def test_api_key_guards_v1_and_admin_but_not_health(tmp_path: Path) -> None:
    """With an API key set, /v1 and /admin need the bearer key (401 in the envelope otherwise); /health stays open."""
    cfg = config_of({"manager": {"memory_budget_gb": 2}, "models": [fake("a", 0.5)]}, tmp_path)
    async with serving(cfg, tmp_path, api_key="s3cret") as s, s.client() as c:
        r = await c.get("/v1/models")
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert (await c.get("/admin/status", headers={"Authorization": "Bearer nope"})).status_code == 401
        assert (await c.get("/v1/models", headers={"Authorization": "Bearer s3cret"})).status_code == 200
        assert (await c.get("/health")).json()["status"] == "ok"


class HealthChanges:
    """The journal's health changes, as the journal pushes them (``Journal.on_health``)."""

    def __init__(self, journal: Journal) -> None:
        self._changed = trio.Event()
        journal.on_health(self._on_change)

    def _on_change(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def until(self, done: Callable[[], bool]) -> None:
        """Wait, change by change, until ``done()`` (bounded: the writer works in real time)."""
        with trio.fail_after(30):
            while not done():
                await self._changed.wait()


async def test_health_reports_a_journal_that_cannot_write(tmp_path: Path) -> None:
    """When the journal cannot write, the load gate closes with it (pushed, not polled): /health is degraded with the reason and new loads get a typed 503, while loaded models serve; it opens when the journal writes again."""
    cfg = config_of({"manager": {"memory_budget_gb": 2}, "models": [fake("a", 0.5), fake("b", 0.5)]},
                    tmp_path)
    async with serving(cfg, tmp_path) as s, s.client() as c:
        await c.post("/admin/models/a/load")
        changes = HealthChanges(s.journal)  # after the daemon's own listener: it has run first
        blocker = sqlite3.connect(s.journal.path, timeout=0)
        blocker.execute("BEGIN EXCLUSIVE")  # another process holds the database
        try:
            assert (await c.post(CHAT, json=body("a"))).status_code == 200  # its lease rows queue up
            await changes.until(lambda: not s.journal.healthy)
            gate = s.manager.snapshot().load_gate
            assert gate is not None and s.journal.last_error is not None
            assert s.journal.last_error in gate
            health = (await c.get("/health")).json()
            assert health["status"] == "degraded"
            assert any("journal" in reason for reason in health["reasons"])
            r = await c.post(CHAT, json=body("b"))
            assert r.status_code == 503 and r.json()["error"]["code"] == "journal_unavailable"
            assert (await c.post(CHAT, json=body("a"))).status_code == 200
        finally:
            blocker.rollback()
            blocker.close()
        await changes.until(lambda: s.journal.healthy)
        assert s.manager.snapshot().load_gate is None
        assert (await c.get("/health")).json()["status"] == "ok"
        assert (await c.post(CHAT, json=body("b"))).status_code == 200
        await s.journal.wait_committed()
        assert rows(s, "SELECT count(*) FROM leases WHERE model = 'a'") == [(2,)]


async def test_metrics_and_openapi_are_served(tmp_path: Path) -> None:
    """/metrics exposes residency, budget, generation and journal metrics (its records and the
    fewer commits that wrote them); /openapi.json describes every route."""
    cfg = config_of({"manager": {"memory_budget_gb": 2}, "models": [fake("a", 0.5)]}, tmp_path)
    async with serving(cfg, tmp_path) as s, s.client() as c:
        await c.post(CHAT, json=body("a"))
        await c.get("/admin/history")  # answers once the rows recorded before it are written
        text = (await c.get("/metrics")).text
        journal = {m[1]: float(m[2]) for m in re.finditer(r"^(mlxd_journal_\w+_total) (\S+)$", text, re.M)}
        records, commits = journal["mlxd_journal_records_total"], journal["mlxd_journal_commits_total"]
        assert records >= 4 and 1 <= commits < records, journal  # a load's transitions, a lease
        for name in ("mlxd_model_state{", "mlxd_committed_bytes", "mlxd_budget_bytes",
                     "mlxd_loads_total", "mlxd_lease_seconds_bucket",
                     "mlxd_time_to_first_token_seconds_bucket", "mlxd_decode_tokens_per_second_bucket"):
            assert name in text, name
        assert 'mlxd_model_state{model="a",state="loaded"} 1.0' in text
        paths = (await c.get("/openapi.json")).json()["paths"]
        for route in ("/v1/models", "/v1/chat/completions", "/v1/completions", "/admin/status",
                      "/admin/events", "/admin/history", "/admin/reload", "/health", "/metrics"):
            assert route in paths


async def test_reload_adds_models_and_refuses_to_replace_a_live_one(tmp_path: Path) -> None:
    """POST /admin/reload re-reads the config file: a new model appears; changing a loaded one is a 409."""
    import yaml

    from mlxd.config import load_config

    path = tmp_path / "models.yaml"
    raw = {"manager": {"memory_budget_gb": 2}, "models": [fake("a", 0.5)]}
    path.write_text(yaml.safe_dump(raw))
    async with serving(load_config(path), tmp_path, config_path=path) as s, s.client() as c:
        await c.post("/admin/models/a/load")
        raw["models"].append(fake("b", 0.5))
        path.write_text(yaml.safe_dump(raw))
        r = await c.post("/admin/reload")
        assert r.status_code == 200 and r.json()["added"] == ["b"]
        assert {m["id"] for m in (await c.get("/v1/models")).json()["data"]} == {"a", "b"}
        raw["models"][0]["estimated_memory_gb"] = 0.7
        path.write_text(yaml.safe_dump(raw))
        r = await c.post("/admin/reload")
        assert r.status_code == 409 and r.json()["error"]["code"] == "conflict"
        path.write_text("models: [")
        r = await c.post("/admin/reload")
        assert r.status_code == 400 and "not reloaded" in r.json()["error"]["message"]


async def test_stream_dropped_before_sending_releases_its_lease(tmp_path: Path) -> None:
    """A stream whose response is dropped before its body is sent (the client left at once) still releases its lease."""
    import gc

    from mlxd.http.generation import _prepend, _stream_body
    from mlxd.http.openai_api import ResponseBuilder
    from mlxd.http.validation import parse_request

    cfg = config_of({"manager": {"memory_budget_gb": 2}, "models": [fake("a", 0.5)]}, tmp_path)
    async with serving(cfg, tmp_path) as s:
        st = s.daemon.state
        parsed = parse_request(body("a", stream=True), kind="chat")
        lease = await s.manager.acquire("a")
        gen = _stream_body(st, lease, parsed.generation, ResponseBuilder("chat", "a", False),
                           trio.current_time())
        first = await gen.__anext__()  # what generate() does before returning the Response
        response_body = _prepend(first, gen)
        del gen, response_body  # the Response is dropped unsent
        gc.collect()
        with trio.fail_after(5):
            await s.until(lambda: not s.manager.status()["leases"])
        assert lease.released
