"""Hostile strings in every string of every JSON body the OpenAPI document describes (issue 32).

For each route with a JSON body in ``/openapi.json`` (new routes join by being
documented), schemathesis generates valid bodies; Hypothesis picks one string
in it (a value or a key, a declared field or an extra one) and makes it
hostile: a lone surrogate (a 400 naming its JSON path, in the route's
envelope), a NUL, or 20,000 characters (never a 5xx). The daemon is a real
``mlxd serve`` with a tiny real text model, a tiny BERT and a fake model.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlxd.engines.model_files.demo_model import write_demo_model
from mlxd.http.envelopes import family_of
from mlxd.http.openapi import openapi_document
from mlxd.http.text import Part, json_path
from mlxd.http.validation import MAX_TOKENS_LIMIT
from tests.support.daemon import DaemonProcess, write_config

pytest.importorskip("mlx_embeddings", reason="the embeddings extra (mlx-embeddings) is not installed")

#: the routes whose requests carry a JSON body, from the document itself
JSON_ROUTES = sorted(
    (path, method)
    for path, operations in openapi_document(None)["paths"].items()
    for method, op in operations.items()
    if "application/json" in op.get("requestBody", {}).get("content", {})
)
HOSTILE = {
    "surrogate": lambda s: s[: len(s) // 2] + "\ud800" + s[len(s) // 2:],
    "nul": lambda s: s + "\x00",
    "overlong": lambda s: (s or "x") * (20_000 // max(1, len(s))) + "x",
}
FEW_TOKENS = 4
#: examples per route in the default suite (a NUL or a long string may reach the model, a
#: surrogate never does); --stress runs 20 times as many
EXAMPLES = {"surrogate": 15, "nul": 4, "overlong": 4}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, schemathesis.BaseSchema]]:
    state = tmp_path_factory.mktemp("hostile-strings")
    write_demo_model(state / "tiny", "tiny")
    write_demo_model(state / "bert", "embedding")
    raw = {
        "server": {"shutdown_grace_s": 2},
        "journal": {"path": str(state / "journal.db"), "synchronous": "normal"},
        "manager": {"memory_budget_gb": 4, "contention_policy": {"strategy": "wait"}},
        "models": [
            {"name": "tiny", "path": str(state / "tiny"), "estimated_memory_gb": 0.01},
            {"name": "bert", "path": str(state / "bert"), "embedding": True, "estimated_memory_gb": 0.01},
            {"name": "fake", "engine": "fake", "estimated_memory_gb": 0.1,
             "fake": {"load_seconds": 0.01, "tokens_per_second": 100_000}},
        ],
    }
    with DaemonProcess(write_config(state / "models.yaml", raw), state) as d:
        document = httpx.get(d.url + "/openapi.json", timeout=10).json()
        yield d.url, schemathesis.openapi.from_dict(document)


def strings(value: Any, path: tuple[Part, ...] = ()) -> Iterator[tuple[tuple[Part, ...], bool]]:
    """Every string of a JSON value: (its path, whether it is a key)."""
    if isinstance(value, str):
        yield path, False
    elif isinstance(value, dict):
        for key, item in value.items():
            yield (*path, key), True
            yield from strings(item, (*path, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from strings(item, (*path, i))


def mutated(body: Any, path: tuple[Part, ...], is_key: bool, hostile: Any) -> tuple[Any, tuple[Part, ...]]:
    """A copy of ``body`` with the string at ``path`` made hostile, and the new string's path."""
    copy = json.loads(json.dumps(body))
    parent = copy
    for part in path[:-1]:
        parent = parent[part]
    last = path[-1]
    if is_key:
        assert isinstance(last, str)
        items = list(parent.items())
        parent.clear()
        new_key = hostile(last)
        parent.update((new_key if k == last else k, v) for k, v in items)
        return copy, (*path[:-1], new_key)
    parent[last] = hostile(parent[last])
    return copy, path


def few_tokens(body: Any) -> None:
    """Generations stay a few tokens long (a valid max_tokens stays valid)."""
    if not isinstance(body, dict):
        return
    for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        v = body.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= MAX_TOKENS_LIMIT:
            body[key] = min(v, FEW_TOKENS)


@pytest.mark.parametrize("kind", sorted(HOSTILE))
@pytest.mark.parametrize(("route", "method"), JSON_ROUTES)
def test_a_hostile_string_anywhere_in_a_body_is_never_a_server_error(
    daemon: tuple[str, schemathesis.BaseSchema], route: str, method: str, kind: str, stress: bool
) -> None:
    """A lone surrogate in any string of a valid body is a 400 naming its JSON path in the route's envelope; a NUL or 20,000 characters never give a 5xx."""
    url, schema = daemon
    operation = schema[route][method.upper()]
    hostile = HOSTILE[kind]

    @settings(max_examples=EXAMPLES[kind] * (20 if stress else 1), deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(), data=st.data())
    def check(case: schemathesis.Case, data: st.DataObject) -> None:
        few_tokens(case.body)
        where = data.draw(st.sampled_from(list(strings(case.body))), label="string")
        body, path = mutated(case.body, *where, hostile)
        r = httpx.request(method, url + route, content=json.dumps(body),
                          headers={"Content-Type": "application/json"}, timeout=60)
        assert r.status_code < 500, (path, r.status_code, r.text[:500])
        if kind != "surrogate":
            return
        assert r.status_code == 400, (path, r.text[:500])
        reply = r.json()
        if family_of(route) is None:  # OpenAI's envelope
            assert reply["error"]["param"] == json_path(path), (path, reply)
            message = reply["error"]["message"]
        elif route.startswith("/api/"):  # Ollama's {"error": "..."}
            assert set(reply) == {"error"} and isinstance(reply["error"], str), reply
            message = reply["error"]
        else:  # Anthropic's envelope
            assert reply["type"] == "error", reply
            message = reply["error"]["message"]
        assert message.startswith(f"{json_path(path) or 'the body'}: "), (path, message)

    check()
