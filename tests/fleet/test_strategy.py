"""mlxd's strategy on LiteLLM's real Router, the daemons' status served by an httpx mock transport."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pytest

pytest.importorskip("litellm", reason="the fleet extra (litellm) is not installed")

# mlxd's strategy module first: it sets LiteLLM's environment before LiteLLM is imported
from mlxd.fleet import strategy as mlxd_strategy
from mlxd.fleet.config import parse_fleet
from mlxd.fleet.proxy import deployments
from mlxd.fleet.watch import Watch
from tests.support.fleet import run_asyncio

GB = 1 << 30
FLEET = parse_fleet({"daemons": [{"name": f"d{i}", "url": f"http://d{i}.test:8080", "models": ["a"]}
                                 for i in range(3)]})


def status(state: str, busy: int = 0) -> dict[str, Any]:
    size = int(0.6 * GB)
    held = state != "unloaded"
    return {"budget_bytes": GB, "free_bytes": GB - (size if held else 0), "models": {"a": {
        "state": state, "committed_bytes": size if held else 0, "estimated_bytes": size,
        "queued": 0, "running": busy, "kv_in_use": 0, "expected_load_seconds": 1.0}}}


def routing(statuses: dict[str, dict[str, Any]]) -> mlxd_strategy.MlxdRouting:
    """The strategy over FLEET, each daemon's /admin/status answered from ``statuses``."""
    def answer(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/admin/status"
        return httpx.Response(200, json=statuses[request.url.host.split(".")[0]])

    from litellm import Router

    watch = Watch(FLEET, client=httpx.AsyncClient(transport=httpx.MockTransport(answer)))
    return mlxd_strategy.MlxdRouting(Router(model_list=deployments(FLEET)), watch)


def refusal(code: str, retry_after: str) -> Exception:
    from litellm.exceptions import ServiceUnavailableError

    response = httpx.Response(503, headers={"retry-after": retry_after},
                              content=json.dumps({"error": {"code": code}}).encode(),
                              request=httpx.Request("POST", "http://d0.test:8080/v1/chat/completions"))
    return ServiceUnavailableError(message="refused", llm_provider="openai", model="a", response=response)


def test_resident_pick_carries_the_header_and_a_retry_goes_to_the_next_daemon() -> None:
    """The daemon where a is loaded gets the request with X-Mlxd-Require-Resident: 1 (in the request's own extra_headers too); the retry of the same request goes elsewhere, without it."""
    r = routing({"d0": status("unloaded"), "d1": status("loaded", busy=2), "d2": status("loaded")})
    kwargs: dict[str, Any] = {"extra_headers": {"X-Request-Id": "r1"}}

    async def picks() -> list[dict[str, Any]]:
        return [await r.async_get_available_deployment("a", request_kwargs=kwargs) for _ in range(2)]

    first, second = run_asyncio(picks)
    assert first["model_info"]["id"] == "d2/a"
    assert first["litellm_params"]["extra_headers"]["X-Mlxd-Require-Resident"] == "1"
    assert second["model_info"]["id"] == "d1/a"  # the next resident one
    assert kwargs["extra_headers"] == {"X-Request-Id": "r1", "X-Mlxd-Require-Resident": "1"}


def test_capacity_refusals_hold_a_daemon_off_for_its_retry_after() -> None:
    """After model_capacity with Retry-After: 1, that daemon gets no pick for a for a second; when every daemon is held off, the pick waits for the first to be allowed."""
    r = routing({"d0": status("loaded"), "d1": status("loaded", busy=1), "d2": status("loaded", busy=2)})
    assert mlxd_strategy.refusal_of(refusal("model_capacity", "1")) == ("model_capacity", 1.0)

    async def scenario() -> tuple[str, str, float]:
        refused = []
        for code in ("model_capacity", "capacity_timeout", "capacity_timeout"):
            d = await r.async_get_available_deployment("a", request_kwargs={})
            r.feedback.learn({"model_id": d["model_info"]["id"], "exception": refusal(code, "1")})
            refused.append(d["model_info"]["id"])
        t0 = time.monotonic()
        waited = await r.async_get_available_deployment("a", request_kwargs={})
        return " ".join(refused), waited["model_info"]["id"], time.monotonic() - t0

    other, waited, took = run_asyncio(scenario)
    assert other == "d0/a d1/a d2/a"  # each held off in turn
    assert waited == "d0/a" and 0.5 <= took <= 2.0  # d0's hold ends first (it began first)
    assert r.feedback.refusals == {"model_capacity": 1, "capacity_timeout": 2}


def test_not_resident_refusal_may_still_load_there() -> None:
    """A daemon that answered model_not_resident to this request's resident attempt is then ranked as where a is not loaded: with free room it loads a there."""
    r = routing({"d0": status("loaded"), "d1": status("loaded", busy=1), "d2": status("loaded", busy=2)})
    kwargs: dict[str, Any] = {}

    async def picks() -> list[str]:
        out = []
        for _ in range(4):
            d = await r.async_get_available_deployment("a", request_kwargs=kwargs)
            out.append(f"{d['model_info']['id']} {d['litellm_params']['extra_headers']}")
        return out

    first, second, third, fourth = run_asyncio(picks)
    assert [first, second, third] == [f"d{i}/a {{'X-Mlxd-Require-Resident': '1'}}" for i in range(3)]
    assert fourth == "d0/a {}"  # every resident attempt refused: now a load, on the emptiest
