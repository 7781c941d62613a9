"""The Responses routes under abuse: huge item lists, long and broken previous_response_id
chains, a stored response deleted while it is read, preemption mid-stream. Each ends in a
typed answer (never a 5xx), in bounded time, with no lease left behind."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import httpx
import trio

from mlxd.config import Config
from mlxd.http.responses_items import MAX_ITEMS
from mlxd.http.responses_store import MAX_CHAIN
from mlxd.journal.responses import ResponseStored
from tests.integration.conftest import config_of, fake
from tests.support.daemon import Served, serving

RESPONSES = "/v1/responses"


def cfg(tmp: Path, strategy: str = "fail") -> Config:
    return config_of(
        {"manager": {"memory_budget_gb": 1, "contention_policy": {"strategy": strategy}},
         "models": [fake("a", 0.6, load_seconds=0.01, tokens_per_second=20),
                    fake("b", 0.6, load_seconds=0.01, tokens_per_second=5000)]},
        tmp,
    )


def body(**fields: Any) -> dict[str, Any]:
    return {"model": "b", "input": "hi", "max_output_tokens": 3, **fields}


async def chain(served: Served, length: int) -> list[str]:
    """``length`` stored responses, each continuing the one before, journaled as the route does."""
    ids: list[str] = []
    previous: str | None = None
    for i in range(length):
        rid = f"resp_chain{i:06d}"
        output = [{"id": f"msg_{i}", "type": "message", "role": "assistant", "status": "completed",
                   "content": [{"type": "output_text", "text": f"answer {i}"}]}]
        response = {"id": rid, "object": "response", "model": "b", "status": "completed",
                    "output": output, "previous_response_id": previous}
        items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": f"turn {i}"}]}]
        served.journal.record(ResponseStored(rid, 1.0 + i, "b", previous, "completed",
                                             json.dumps(items), json.dumps(response)))
        ids.append(rid)
        previous = rid
    await served.journal.wait_committed()
    return ids


async def assert_no_lease(served: Served) -> None:
    assert served.manager.status()["leases"] == []
    await served.journal.wait_committed()
    con = sqlite3.connect(served.journal.path)
    try:
        assert con.execute("SELECT count(*) FROM leases WHERE released_at IS NULL").fetchone() == (0,)
    finally:
        con.close()


async def test_a_thousand_long_chain_is_continued_and_a_longer_one_refused(tmp_path: Path) -> None:
    """A previous_response_id chain 1,000 long is read in one bounded walk and served; one past the chain limit is a 400 naming previous_response_id."""
    async with serving(cfg(tmp_path), tmp_path) as s, s.client() as c:
        ids = await chain(s, 1000)
        with trio.fail_after(30):
            r = await c.post(RESPONSES, json=body(previous_response_id=ids[-1]))
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["input_tokens"] >= 4 * 1000  # every turn's words were read
        longer = await chain(s, MAX_CHAIN + 1)
        with trio.fail_after(30):
            r = await c.post(RESPONSES, json=body(previous_response_id=longer[-1]))
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "previous_response_id" and "longer" in err["message"]
        await assert_no_lease(s)


async def test_a_broken_chain_names_the_missing_response(tmp_path: Path) -> None:
    """When a response inside a chain was deleted, continuing the chain is a 404 naming the one that is gone."""
    async with serving(cfg(tmp_path), tmp_path) as s, s.client() as c:
        ids = await chain(s, 5)
        assert (await c.delete(f"{RESPONSES}/{ids[2]}")).status_code == 200
        r = await c.post(RESPONSES, json=body(previous_response_id=ids[-1]))
        assert r.status_code == 404 and r.json()["error"]["code"] == "response_not_found"
        assert ids[2] in r.json()["error"]["message"]
        ok = await c.post(RESPONSES, json=body(previous_response_id=ids[1]))
        assert ok.status_code == 200, ok.text
        await assert_no_lease(s)


async def test_huge_item_lists(tmp_path: Path) -> None:
    """The item limit holds for a request's input and for input plus its stored conversation: at the limit served, past it a 400 naming the field."""
    async with serving(cfg(tmp_path), tmp_path) as s, s.client(timeout=60) as c:
        item = {"role": "user", "content": "x"}
        with trio.fail_after(60):
            at = await c.post(RESPONSES, json=body(input=[item] * MAX_ITEMS, store=False))
            assert at.status_code == 200, at.text
            past = await c.post(RESPONSES, json=body(input=[item] * (MAX_ITEMS + 1)))
            assert past.status_code == 400 and past.json()["error"]["param"] == "input"
            ids = await chain(s, 10)  # 20 items stored
            over = await c.post(RESPONSES, json=body(input=[item] * (MAX_ITEMS - 10),
                                                     previous_response_id=ids[-1]))
            assert over.status_code == 400 and over.json()["error"]["param"] == "input", over.text
        await assert_no_lease(s)


async def test_a_stored_response_deleted_while_it_is_read(tmp_path: Path) -> None:
    """GETs and continuations racing a DELETE of the same response each get 200 or 404, never a 5xx; afterwards it is gone."""
    async with serving(cfg(tmp_path), tmp_path) as s, s.client() as c:
        rid = (await c.post(RESPONSES, json=body())).json()["id"]
        statuses: list[int] = []

        async def get() -> None:
            statuses.append((await c.get(f"{RESPONSES}/{rid}")).status_code)

        async def cont() -> None:
            statuses.append((await c.post(RESPONSES, json=body(previous_response_id=rid))).status_code)

        async def delete() -> None:
            statuses.append((await c.delete(f"{RESPONSES}/{rid}")).status_code)

        with trio.fail_after(30):
            async with trio.open_nursery() as n:
                for i in range(40):
                    n.start_soon(get if i % 2 else cont)
                    if i == 20:
                        n.start_soon(delete)
        assert set(statuses) <= {200, 404} and 200 in statuses, statuses
        assert (await c.get(f"{RESPONSES}/{rid}")).status_code == 404
        await assert_no_lease(s)


async def test_a_preempted_stream_ends_with_response_failed(tmp_path: Path) -> None:
    """Under preempt, a streamed response on A ends with response.failed whose error code is preempted, and nothing is stored for it."""
    async with serving(cfg(tmp_path, "preempt"), tmp_path) as s, s.client() as c:
        events: list[dict[str, Any]] = []
        first = trio.Event()

        async def stream_a() -> None:
            async with c.stream("POST", RESPONSES, json={"model": "a", "input": "hi", "stream": True,
                                                         "max_output_tokens": 10_000}) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        events.append(json.loads(line[6:]))
                        if any(e["type"] == "response.output_text.delta" for e in events):
                            first.set()

        with trio.fail_after(30):
            async with trio.open_nursery() as n:
                n.start_soon(stream_a)
                await first.wait()
                assert (await c.post(RESPONSES, json=body())).status_code == 200
        last = events[-1]
        assert last["type"] == "response.failed", last
        assert last["response"]["error"]["code"] == "preempted"
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        got = await c.get(f"{RESPONSES}/{last['response']['id']}")
        assert got.status_code == 404
        await assert_no_lease(s)


async def test_wrong_types_in_stored_ids_and_routes_are_4xx(tmp_path: Path) -> None:
    """Odd ids on GET/DELETE and odd previous_response_id values are 4xx in the OpenAI envelope, with no lease taken."""
    async with serving(cfg(tmp_path), tmp_path) as s, s.client() as c:
        for rid in ("x", "resp_" + "9" * 120, "%00", "a/b/c", "..%2F..", "%ff", "' OR 1=1 --"):
            for method in ("GET", "DELETE"):
                r = await c.request(method, f"{RESPONSES}/{rid}")
                assert r.status_code == 404 and r.json()["error"]["code"] == "response_not_found", r.text
        for prev in ("' OR 1=1 --", "resp_" + "0" * 100, "\u00e9"):
            r = await c.post(RESPONSES, json=body(previous_response_id=prev))
            assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"
        r = await c.post(RESPONSES, content=b'{"model": "b", "input": [' + b"[" * 5000 + b"]" * 5000 + b"]}",
                         headers={"Content-Type": "application/json"})
        assert 400 <= r.status_code < 500, r.text
        assert isinstance(c, httpx.AsyncClient)
        await assert_no_lease(s)


async def test_the_routes_need_the_inference_scope_and_journal_the_key(tmp_path: Path) -> None:
    """POST, GET and DELETE /v1/responses need a key with the inference scope (401 without one, 403 with another scope); the lease row names the key; metrics count the route and its generation."""
    from mlxd.config.keys import ResolvedKey

    keys = [ResolvedKey("laptop", "k-inference", frozenset({"inference"})),
            ResolvedKey("ops", "k-read", frozenset({"read", "admin"}))]
    async with serving(cfg(tmp_path), tmp_path, keys=keys) as s, s.client() as c:
        good = {"Authorization": "Bearer k-inference"}
        r = await c.post(RESPONSES, json=body(), headers=good)
        assert r.status_code == 200, r.text
        rid = r.json()["id"]
        for method, path, payload in (("POST", RESPONSES, body()), ("GET", f"{RESPONSES}/{rid}", None),
                                      ("DELETE", f"{RESPONSES}/{rid}", None)):
            assert (await c.request(method, path, json=payload)).status_code == 401
            wrong = await c.request(method, path, json=payload, headers={"Authorization": "Bearer k-read"})
            assert wrong.status_code == 403 and wrong.json()["error"]["code"] == "insufficient_scope"
        assert (await c.get(f"{RESPONSES}/{rid}", headers=good)).status_code == 200
        metrics = (await c.get("/metrics", headers={"Authorization": "Bearer k-read"})).text
        assert 'mlxd_http_requests_total{route="/v1/responses",status="200"} 1.0' in metrics
        assert 'mlxd_time_to_first_token_seconds_count{model="b"} 1.0' in metrics
        await s.journal.wait_committed()
        con = sqlite3.connect(s.journal.path)
        try:
            assert con.execute("SELECT route, client FROM leases").fetchall() == [("/v1/responses", "laptop")]
        finally:
            con.close()
        await assert_no_lease(s)
