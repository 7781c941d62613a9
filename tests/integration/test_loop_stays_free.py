"""An oversized request never freezes the daemon: its checking runs off the event loop, or is refused first.

Each test holds one step of a big request's checking (the schema's
meta-schema check, rendering and tokenizing a prompt with many tools,
tokenizing embedding inputs) at a gate, and asks ``/health`` on another
connection meanwhile: the probe must be answered before the gate opens (an
ordering, not a timing). Had the step run on the event loop, the loop would
sit in the gate and the probe would come after it. Requests past the size
bounds are refused before any of that work starts.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import trio

from mlxd.engines.model_files.demo_model import write_demo_model
from mlxd.engines.text import prompts
from mlxd.http.structured import MAX_SCHEMA_VALUES
from tests.integration.conftest import config_of
from tests.support.daemon import Served, serving

#: the longest a gate holds its step (a step on the event loop would hold the loop this long)
GATE_S = 5.0


class Gate:
    """Wraps a function: each call says it has started, then waits for :meth:`open`."""

    def __init__(self, fn: Callable[..., Any], order: list[str], name: str) -> None:
        self.fn, self.order, self.name = fn, order, name
        self.entered = threading.Event()
        self.released = threading.Event()
        self.calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        self.entered.set()
        self.released.wait(GATE_S)
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.order.append(self.name)

    def open(self) -> None:
        self.released.set()


def props(n: int, prefix: str = "p") -> dict[str, Any]:
    return {"type": "object", "properties": {f"{prefix}{i}": {"type": "string"} for i in range(n)}}


def chat(**kw: Any) -> dict[str, Any]:
    return {"model": "tiny", "max_tokens": 2, "temperature": 0,
            "messages": [{"role": "user", "content": "hi"}], **kw}


def schema_chat(schema: dict[str, Any]) -> dict[str, Any]:
    return chat(response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})


def tools_chat(n_tools: int, n_params: int, **kw: Any) -> dict[str, Any]:
    tools = [{"type": "function", "function": {"name": f"f{t}", "description": f"tool {t}",
                                               "parameters": props(n_params, "a")}}
             for t in range(n_tools)]
    return chat(tools=tools, **kw)


async def probe_while_held(s: Served, gate: Gate, path: str, body: dict[str, Any]) -> int:
    """Send ``body``; once its step is at ``gate``, ask /health; then open the gate.
    Returns the big request's status; ``gate.order`` says what came first."""
    status: list[int] = []

    async def big() -> None:
        async with s.client(timeout=60) as c:
            r = await c.post(path, json=body)
            status.append(r.status_code)
            assert r.status_code == 200, r.text

    async with trio.open_nursery() as n:
        n.start_soon(big)
        await trio.to_thread.run_sync(gate.entered.wait, GATE_S)
        try:
            async with s.client(timeout=60) as probe:
                assert (await probe.get("/health")).status_code == 200
            gate.order.append("health")
        finally:
            gate.open()
    return status[0]


@pytest.fixture
def cfg(tiny_model: Path, tmp_path: Path) -> Any:
    return config_of({"manager": {"memory_budget_gb": 2},
                      "models": [{"name": "tiny", "path": str(tiny_model),
                                  "estimated_memory_gb": 0.01}]}, tmp_path)


def gate_meta_schema_check(monkeypatch: pytest.MonkeyPatch, order: list[str]) -> Gate:
    cls = jsonschema.validators.Draft202012Validator
    gate = Gate(cls.check_schema, order, "schema checked")
    monkeypatch.setattr(cls, "check_schema", gate)
    return gate


BIG_SCHEMA: dict[str, Any] = {"type": "object",
                              "properties": {f"o{j}": props(200) for j in range(20)}}
#: the same big schema as each other route takes it
OTHER_ROUTES: dict[str, tuple[str, dict[str, Any]]] = {
    "responses": ("/v1/responses", {"model": "tiny", "input": "hi", "max_output_tokens": 2,
                                    "temperature": 0, "text": {"format": {
                                        "type": "json_schema", "name": "s", "schema": BIG_SCHEMA}}}),
    "ollama": ("/api/chat", {"model": "tiny", "stream": False, "format": BIG_SCHEMA,
                             "messages": [{"role": "user", "content": "hi"}],
                             "options": {"num_predict": 2, "temperature": 0}}),
}


@pytest.mark.parametrize("route", sorted(OTHER_ROUTES))
async def test_health_is_answered_while_another_routes_big_schema_is_checked(
    cfg: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, route: str
) -> None:
    """The Responses and Ollama routes check a large schema off the event loop too: /health is answered meanwhile."""
    order: list[str] = []
    gate = gate_meta_schema_check(monkeypatch, order)
    path, body = OTHER_ROUTES[route]
    async with serving(cfg, tmp_path) as s:
        status = await probe_while_held(s, gate, path, body)
    assert status == 200
    assert order[0] == "health", order


@pytest.mark.parametrize("kind", ["json_schema", "tools"])
async def test_health_is_answered_while_a_big_schema_is_checked(
    cfg: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """While a large schema (or many tools' schemas) is checked against its meta-schema, /health is answered."""
    order: list[str] = []
    gate = gate_meta_schema_check(monkeypatch, order)
    body = (schema_chat({"type": "object", "properties": {f"o{j}": props(200) for j in range(20)}})
            if kind == "json_schema" else tools_chat(6, 30))
    async with serving(cfg, tmp_path) as s:
        status = await probe_while_held(s, gate, "/v1/chat/completions", body)
    assert status == 200
    assert order[0] == "health", order


async def test_health_is_answered_while_a_prompt_with_many_tools_is_rendered(
    cfg: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rendering and tokenizing a short message with many tools runs on a worker thread: /health is answered meanwhile."""
    order: list[str] = []
    gate = Gate(prompts.encode_prompt, order, "prompt tokenized")
    monkeypatch.setattr(prompts, "encode_prompt", gate)
    async with serving(cfg, tmp_path) as s:
        async with s.client(timeout=60) as c:  # loaded first: the gate holds this request only
            assert (await c.post("/admin/models/tiny/load")).status_code == 200
        status = await probe_while_held(s, gate, "/v1/chat/completions", tools_chat(10, 10))
    assert status == 200
    assert order[0] == "health", order


async def test_schemas_past_the_bound_are_refused_before_any_check(
    cfg: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 60,000-property schema, or 128 tools of 400 parameters, is a 400 naming the field before any meta-schema check starts."""
    order: list[str] = []
    gate = gate_meta_schema_check(monkeypatch, order)
    gate.open()
    async with serving(cfg, tmp_path) as s, s.client(timeout=60) as c:
        r = await c.post("/v1/chat/completions", json=schema_chat(props(60_000)))
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "response_format.json_schema.schema"
        assert f"{MAX_SCHEMA_VALUES:,} JSON values" in r.json()["error"]["message"]
        r = await c.post("/v1/chat/completions", json=tools_chat(128, 400))
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"].startswith("tools[")
    assert gate.calls == 0


@pytest.fixture
def bert_cfg(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> Any:
    pytest.importorskip("mlx_embeddings", reason="the embeddings extra is not installed")
    path = tmp_path_factory.mktemp("models") / "bert"
    write_demo_model(path, "embedding")
    return config_of({"manager": {"memory_budget_gb": 2},
                      "models": [{"name": "bert", "path": str(path), "embedding": True,
                                  "estimated_memory_gb": 0.01}]}, tmp_path)


async def test_embedding_inputs_too_long_by_their_length_are_refused_before_tokenizing(
    bert_cfg: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """2,000 inputs of 10,000 characters are a 400 naming input[0] before anything is tokenized;
    while many short inputs are tokenized, /health is answered."""
    from mlxd.engines.mlx_embed import MlxEmbeddingEngine

    order: list[str] = []
    gate = Gate(MlxEmbeddingEngine.tokenize, order, "tokenized")
    monkeypatch.setattr(MlxEmbeddingEngine, "tokenize", lambda self, texts: gate(self, texts))
    async with serving(bert_cfg, tmp_path) as s:
        async with s.client(timeout=60) as c:
            r = await c.post("/v1/embeddings", json={"model": "bert", "input": ["lorem " * 1700] * 2000})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == "input[0]"
            assert gate.calls == 0
            assert (await c.post("/admin/models/bert/load")).status_code == 200
        status = await probe_while_held(s, gate, "/v1/embeddings",
                                        {"model": "bert", "input": ["hello world"] * 500})
    assert status == 200
    assert order[0] == "health", order


async def test_ollamas_embed_refuses_inputs_too_long_by_length_before_any_load(
    bert_cfg: Any, tmp_path: Path
) -> None:
    """/api/embed shares the embeddings route's rule: inputs too long by their length alone are a 400 before the lease, and nothing loads."""
    async with serving(bert_cfg, tmp_path) as s, s.client(timeout=60) as c:
        r = await c.post("/api/embed", json={"model": "bert", "input": ["lorem " * 1700] * 2000})
        assert r.status_code == 400, r.text
        assert "10,200 characters" in r.json()["error"], r.json()
        assert s.manager.model_snapshot("bert").state.value == "unloaded"
