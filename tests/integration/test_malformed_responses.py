"""Malformed /v1/responses requests against a live daemon (the suite of test_malformed.py, for
the Responses routes): each field's wrong values, odd stored ids, random JSON in any field;
each answer is a 4xx envelope naming the problem, and the daemon is left healthy."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.integration.malformed_clients import RESPONSES, RESPONSES_BODY, RESPONSES_MUTATIONS
from tests.integration.test_malformed import (
    JSON_CT,
    JSON_VALUES,
    MAX_BODY_MB,
    UNKNOWN,
    Bad,
    assert_healthy,
    check_envelope,
    config,
    dumps,
    mutate,
    send,
    short,
)
from tests.support.daemon import serving


def responses_cases() -> Iterator[Bad]:
    for field, values in RESPONSES_MUTATIONS.items():
        for value in values:
            code = "response_not_found" if value == "resp_missing" else None
            yield Bad(f"responses {field}={short(value)}", "POST", RESPONSES,
                      dumps(mutate(RESPONSES_BODY, field, value)), status=404 if code else 400,
                      code=code, param=field)
    for method, path in (("GET", RESPONSES + "/resp_nope"), ("DELETE", RESPONSES + "/resp_nope"),
                         ("GET", RESPONSES + "/" + "r" * 3000), ("DELETE", RESPONSES + "/%00")):
        yield Bad(f"{method} {path[:40]}", method, path, None, status=404,
                  code="response_not_found", param="response_id")
    yield Bad("responses unknown model", "POST", RESPONSES,
              dumps({**RESPONSES_BODY, "model": UNKNOWN}), status=404, code="model_not_found",
              param="model")


async def test_malformed_responses_requests_get_typed_4xx(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Every wrong value of every Responses field, and odd stored ids, get a 4xx envelope naming the field; none is a 5xx and nothing is logged as an error."""
    cases = list(responses_cases())
    assert len(cases) >= 140, len(cases)
    caplog.set_level(logging.WARNING, logger="mlxd")
    async with serving(config(tmp_path), tmp_path, max_body_mb=MAX_BODY_MB) as served, \
            served.client() as client:
        for case in cases:
            response = await send(client, case)
            check_envelope(case, response.status_code, response.headers, response.text)
        await assert_healthy(served, client)
    unexpected = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert unexpected == [], unexpected


async def test_random_json_in_any_responses_field_is_a_4xx_naming_that_field(
    tmp_path: Path, stress: bool
) -> None:
    """Random JSON in any field of a /v1/responses body is a 400 naming that field or a 404 for the model, and no lease is left."""
    examples = 2000 if stress else 200
    seen: list[int] = []
    fields = sorted(RESPONSES_MUTATIONS)
    async with serving(config(tmp_path), tmp_path, max_body_mb=MAX_BODY_MB) as served, \
            served.client() as client:

        @settings(max_examples=examples, deadline=None, database=None,
                  suppress_health_check=[HealthCheck.too_slow])
        @given(data=st.data())
        def check(data: st.DataObject) -> None:
            field = data.draw(st.sampled_from(fields), label="field")
            value = data.draw(JSON_VALUES, label="value")
            body = {**RESPONSES_BODY, "model": UNKNOWN, field: value}
            response = sync_client.post(RESPONSES, content=dumps(body), headers=dict(JSON_CT))
            seen.append(response.status_code)
            case = Bad(f"{RESPONSES} {field}={short(value)}", "POST", RESPONSES)
            check_envelope(case, response.status_code, response.headers, response.text)
            err = response.json()["error"]
            if response.status_code == 400:
                assert err["param"] is not None and err["param"].startswith(field), (field, err)
            else:
                assert response.status_code == 404 and err["code"] == "model_not_found", err

        with httpx.Client(base_url=served.url, timeout=30) as sync_client:
            await trio.to_thread.run_sync(check)
        await assert_healthy(served, client)
    assert 400 in seen and 404 in seen
