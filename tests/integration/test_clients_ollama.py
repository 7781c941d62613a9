"""The official `ollama` Python client against the real daemon: a tiny demo llama, a tiny BERT, a fake.

The demo model has random weights: its tool calls and JSON answers are valid
only because decoding is grammar-constrained, and are checked with
``jsonschema``. The default run sends a few schema requests; ``--stress``
sends the acceptance count (100).
"""

from __future__ import annotations

import json
import logging
import re
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import ollama
import pytest
import trio

from mlxd.engines.model_files.demo_model import BERT_SHAPE
from tests.integration.conftest import config_of, fake
from tests.integration.test_clients_openai import PERSON
from tests.support.daemon import DaemonProcess, Served, fake_models_config, serving, write_config
from tests.support.logs import logged
from tests.support.official import run

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
        },
    },
}
ASK = [{"role": "user", "content": "what is the weather in Paris?"}]
GREEDY = {"temperature": 0, "num_predict": 12}


@pytest.fixture
def cfg(tiny_model: Path, bert_model: Path, tmp_path: Path) -> Any:
    return config_of(
        {"manager": {"memory_budget_gb": 2},
         "models": [{"name": "tiny", "path": str(tiny_model), "estimated_memory_gb": 0.05},
                    {"name": "bert", "path": str(bert_model), "embedding": True,
                     "estimated_memory_gb": 0.01},
                    fake("fake-a", 0.1)]},
        tmp_path,
    )


def client(served: Served, url: str | None = None) -> ollama.Client:
    c = ollama.Client(host=url or served.url, timeout=60)
    served.on_close(c.close)
    return c


def seconds_from_now(stamp: Any) -> float:
    at = stamp if isinstance(stamp, datetime) else datetime.fromisoformat(str(stamp))
    return at.timestamp() - time.time()


async def test_list_show_and_version_describe_every_configured_model(cfg: Any, tmp_path: Path) -> None:
    """list names every model with size, digest and details; show gives the real capabilities,
    the context length and the template (also asked with the older ``name``); ``name:latest`` is
    the same model."""
    async with serving(cfg, tmp_path) as s:
        c = client(s)
        listed = {m.model: m for m in (await run(c.list)).models}
        assert set(listed) == {"tiny", "bert", "fake-a"}
        tiny = listed["tiny"]
        assert tiny.size and tiny.size > 0 and len(tiny.digest or "") == 64
        assert tiny.details is not None and tiny.details.family == "llama"
        assert tiny.details.format == "safetensors" and tiny.details.parameter_size
        assert listed["bert"].details is not None and listed["bert"].details.family == "bert"
        shown = await run(lambda: c.show("tiny:latest"))
        assert shown.capabilities == ["completion", "tools"]
        assert shown.modelinfo is not None and shown.modelinfo["llama.context_length"] > 0
        assert "tool_call" in (shown.template or "")
        assert (await run(lambda: c.show("bert"))).capabilities == ["embedding"]
        assert (await run(lambda: c.show("fake-a"))).capabilities == ["completion"]
        async with s.client() as h:
            v = (await h.get("/api/version")).json()
            older = (await h.post("/api/show", json={"name": "tiny"})).json()  # as Continue asks
        assert v["version"] and v["mlxd"]
        assert older["capabilities"] == ["completion", "tools"]
        assert older["model_info"]["general.basename"] == "tiny"  # what Copilot names it
        assert s.manager.state_of("tiny").value == "unloaded"  # discovery loads nothing


async def test_ps_lists_resident_models_with_expiry_from_keep_alive(cfg: Any, tmp_path: Path) -> None:
    """ps is empty before a load; after one it shows the model, its size and an expires_at that
    follows each request's keep_alive (10m, then 1h; -1 is far in the future)."""
    async with serving(cfg, tmp_path) as s:
        c = client(s)
        assert (await run(c.ps)).models == []
        await run(lambda: c.chat("tiny", ASK, options=GREEDY, keep_alive="10m"))
        (entry,) = (await run(c.ps)).models
        assert entry.model == "tiny" and entry.size and entry.size == entry.size_vram
        assert seconds_from_now(entry.expires_at) == pytest.approx(600, abs=30)
        await run(lambda: c.chat("tiny", ASK, options=GREEDY, keep_alive="1h"))
        (entry,) = (await run(c.ps)).models
        assert seconds_from_now(entry.expires_at) == pytest.approx(3600, abs=30)
        await run(lambda: c.generate("tiny", keep_alive=-1))  # the load call
        (entry,) = (await run(c.ps)).models
        assert seconds_from_now(entry.expires_at) > 100 * 365 * 86400
        async with s.client() as h:
            raw = (await h.get("/api/ps")).json()["models"][0]
        assert raw["mlxd"]["state"] == "loaded" and raw["mlxd"]["keep_alive_s"] == -1


async def test_chat_whole_and_streamed_with_ollama_counters(cfg: Any, tmp_path: Path) -> None:
    """A whole chat reply and a streamed one (NDJSON by default) say the same greedy text; the last
    part has done_reason and the counters in nanoseconds."""
    async with serving(cfg, tmp_path) as s:
        c = client(s)
        whole = await run(lambda: c.chat("tiny", ASK, options=GREEDY, stream=False))
        assert whole.message.role == "assistant" and whole.done and whole.done_reason == "length"
        assert whole.eval_count == 12 and whole.prompt_eval_count and whole.prompt_eval_count > 0
        assert whole.total_duration and whole.eval_duration and whole.load_duration is not None
        assert whole.total_duration >= whole.eval_duration + (whole.prompt_eval_duration or 0)
        sampled = await run(lambda: c.chat("tiny", ASK, options={"top_k": 3, "temperature": 1.5,
                                                                   "seed": 3, "num_predict": 6}))
        assert sampled.eval_count == 6
        parts = await run(lambda: list(c.chat("tiny", ASK, options=GREEDY, stream=True)))
        assert all(not p.done for p in parts[:-1]) and parts[-1].done
        assert "".join(p.message.content or "" for p in parts) == whole.message.content
        assert parts[-1].eval_count == 12 and parts[-1].done_reason == "length"
        assert datetime.fromisoformat(str(parts[0].created_at)).tzinfo == UTC
        async with s.client() as h:
            r = await h.post("/api/chat", json={"model": "tiny", "messages": ASK, "options": GREEDY})
        assert r.headers["content-type"] == "application/x-ndjson"
        assert [json.loads(x)["done"] for x in r.text.splitlines()][-1] is True


async def test_forced_tool_call_has_arguments_as_an_object(cfg: Any, tmp_path: Path) -> None:
    """tool_choice (through options) forces a call, whole and streamed, in Ollama's shape with
    arguments that validate against the tool's schema; then the tool's answer is accepted."""
    async with serving(cfg, tmp_path) as s:
        c = client(s)
        forced = {"tool_choice": "required", "num_predict": 64}
        whole = await run(lambda: c.chat("tiny", ASK, tools=[WEATHER], options=forced))
        (call,) = whole.message.tool_calls or []
        assert call.function.name == "get_weather"
        jsonschema.validate(dict(call.function.arguments), WEATHER["function"]["parameters"])
        parts = await run(lambda: list(c.chat("tiny", ASK, tools=[WEATHER], options=forced, stream=True)))
        calls = [tc for p in parts for tc in (p.message.tool_calls or [])]
        assert [tc.function.name for tc in calls] == ["get_weather"]
        history = [*ASK, {"role": "assistant", "content": "", "tool_calls": [call.model_dump()]},
                   {"role": "tool", "content": "sunny, 21 C", "tool_name": "get_weather"}]
        after = await run(lambda: c.chat("tiny", history, tools=[WEATHER], options=GREEDY))
        assert after.done and after.message.role == "assistant"


async def test_format_schema_answers_validate(cfg: Any, tmp_path: Path, stress: bool) -> None:
    """format with a JSON Schema: every answer is valid (100 of 100 under --stress), and "json"
    gives a JSON object."""
    async with serving(cfg, tmp_path) as s:
        c = client(s)
        n = 100 if stress else 6
        for i in range(n):
            r = await run(lambda i=i: c.chat("tiny", [{"role": "user", "content": f"person {i}"}],
                                             format=PERSON, options={"seed": i, "num_predict": 96}))
            jsonschema.validate(json.loads(r.message.content or ""), PERSON)
        r = await run(lambda: c.generate("tiny", "an object", format="json", options={"num_predict": 48}))
        assert isinstance(json.loads(r.response), dict)


async def test_generate_whole_streamed_raw_and_refused_fields(cfg: Any, tmp_path: Path) -> None:
    """generate answers whole and streamed, raw sends the prompt as it is, and template or suffix
    is a 400 naming the field."""
    async with serving(cfg, tmp_path) as s:
        c = client(s)
        whole = await run(lambda: c.generate("tiny", "once upon", options=GREEDY, stream=False))
        assert whole.done and whole.eval_count == 12 and whole.response
        parts = await run(lambda: list(c.generate("tiny", "once upon", options=GREEDY, stream=True)))
        assert "".join(p.response or "" for p in parts) == whole.response and parts[-1].done
        raw = await run(lambda: c.generate("tiny", "once upon", raw=True, options=GREEDY))
        assert raw.prompt_eval_count and raw.prompt_eval_count < (whole.prompt_eval_count or 0)
        for field, value in (("template", "{{ .Prompt }}"), ("suffix", "end")):
            with pytest.raises(ollama.ResponseError) as e:
                await run(lambda f=field, v=value: c.generate("tiny", "x", **{f: v}))
            assert e.value.status_code == 400 and field in e.value.error


async def test_embed_and_the_older_embeddings_route(cfg: Any, tmp_path: Path) -> None:
    """embed gives one unit vector per input, embeddings the same vector for one prompt; a
    generator model is a 400 naming the model; the lease rows name each route."""
    pytest.importorskip("mlx_embeddings", reason="the embeddings extra (mlx-embeddings) is not installed")
    async with serving(cfg, tmp_path) as s:
        c = client(s)
        r = await run(lambda: c.embed("bert", ["hello world", "the quick fox"]))
        assert len(r.embeddings) == 2 and len(r.embeddings[0]) == BERT_SHAPE["hidden_size"]
        assert abs(sum(x * x for x in r.embeddings[0]) - 1) < 1e-4
        one = await run(lambda: c.embeddings("bert", "hello world"))
        assert list(one.embedding) == pytest.approx(list(r.embeddings[0]), abs=1e-5)
        with pytest.raises(ollama.ResponseError) as e:
            await run(lambda: c.embed("tiny", "x"))
        assert e.value.status_code == 400 and "embedding model" in e.value.error
        await s.journal.wait_committed()
        assert {row["route"] for row in s.journal.leases(model="bert")} == {"/api/embed", "/api/embeddings"}


async def test_pull_offline_ends_with_a_clear_error(cfg: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Offline, a pull of a repo not in the cache ends at once with an error naming the cause
    (streamed and whole); an Ollama library name is a 400 saying what mlxd pulls."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf"))  # an empty cache
    async with serving(cfg, tmp_path) as s:
        c = client(s)
        with trio.fail_after(20):
            with pytest.raises(ollama.ResponseError) as streamed:
                await run(lambda: list(c.pull("mlx-community/not-cached-here", stream=True)))
            assert "HF_HUB_OFFLINE" in streamed.value.error
            with pytest.raises(ollama.ResponseError) as whole:
                await run(lambda: c.pull("mlx-community/not-cached-here"))
            assert whole.value.status_code == 502 and "HF_HUB_OFFLINE" in whole.value.error
            with pytest.raises(ollama.ResponseError) as library:
                await run(lambda: c.pull("llama3.2"))
            assert library.value.status_code == 400 and "repo id" in library.value.error


async def test_keep_alive_zero_unloads_and_the_unload_call(cfg: Any, tmp_path: Path) -> None:
    """keep_alive 0 unloads the model when its request ends (journal: idle_timeout); the empty
    request with keep_alive 0 is Ollama's unload call (journal: admin)."""
    async with serving(cfg, tmp_path) as s:
        c = client(s)
        await run(lambda: c.chat("tiny", ASK, options=GREEDY, keep_alive=0))
        with trio.fail_after(10):
            await s.until(lambda: s.manager.state_of("tiny").value == "unloaded")
        loaded = await run(lambda: c.generate("tiny", keep_alive="5m"))
        assert loaded.done_reason == "load" and s.manager.state_of("tiny").value == "loaded"
        unloaded = await run(lambda: c.chat("tiny", [], keep_alive=0))
        assert unloaded.done_reason == "unload" and s.manager.state_of("tiny").value == "unloaded"
        await s.journal.wait_committed()
        rows = [(r["from_state"], r["to_state"], r["reason"]) for r in s.journal.history(model="tiny", limit=20)]
        assert ("loaded", "unloading", "idle_timeout") in rows
        assert ("loaded", "unloading", "admin") in rows


async def test_unknown_model_errors_and_routes_mlxd_does_not_serve(cfg: Any, tmp_path: Path) -> None:
    """An unknown model is a 404 on every route, in Ollama's {"error"} shape; delete, copy, create
    and push are 501 saying mlxd reads its models from its config."""
    async with serving(cfg, tmp_path) as s:
        c = client(s)
        for call in (lambda: c.chat("nope", ASK), lambda: c.generate("nope", "x"),
                     lambda: c.show("nope"), lambda: c.embed("nope", "x"), lambda: c.chat("tiny:7b", ASK)):
            with pytest.raises(ollama.ResponseError) as e:
                await run(call)
            assert e.value.status_code == 404 and "does not exist" in e.value.error
        for call in (lambda: c.delete("tiny"), lambda: c.copy("tiny", "other"),
                     lambda: c.create("x", from_="tiny"), lambda: c.push("tiny")):
            with pytest.raises(ollama.ResponseError) as e:
                await run(call)
            assert e.value.status_code == 501 and "config" in e.value.error
        async with s.client() as h:
            r = await h.post("/api/chat", json={"model": "tiny", "messages": "hi"})
        assert r.status_code == 400 and r.json() == {"error": "messages: must be a list of messages"}


async def test_lease_route_access_log_metrics_and_the_ollama_port(cfg: Any, tmp_path: Path) -> None:
    """The lease row names /api/chat, the access log and /metrics count the route, and
    server.ollama_port serves the same API on a second port."""
    with logged("mlxd.access", "route=/api/chat", logging.INFO) as access_line:
        async with serving(cfg, tmp_path, ollama_port=0) as s:
            urls = s.daemon.urls
            assert len(urls) == 2 and urls[0] != urls[1]
            c = client(s, urls[1])
            await run(lambda: c.chat("tiny", ASK, options=GREEDY))
            await s.journal.wait_committed()
            (lease,) = s.journal.leases(model="tiny")
            assert lease["route"] == "/api/chat" and lease["completion_tokens"] == 12
            async with s.client() as h:
                metrics = (await h.get("/metrics")).text
            assert 'mlxd_http_requests_total{route="/api/chat",status="200"} 1.0' in metrics
            with trio.fail_after(10):
                await access_line.wait()  # the line follows the reply


def test_serve_ollama_port_flag_opens_a_second_listener(tmp_path: Path) -> None:
    """``mlxd serve --ollama-port`` serves the same app on a second port, announced in the log."""
    cfg_path = write_config(tmp_path / "models.yaml", fake_models_config({"a": 0.1}, budget_gb=1))
    with DaemonProcess(cfg_path, tmp_path, args=("--ollama-port", "0")) as d:
        found = re.search(r"Ollama clients: (http://\S+)", d.log())
        assert found is not None, d.log()[-2000:]
        assert found.group(1) != d.url
        tags = httpx.get(found.group(1) + "/api/tags", timeout=10).json()
    assert [m["name"] for m in tags["models"]] == ["a"]


def fake_hub_cache(root: Path, repo: str) -> None:
    """A Hugging Face cache holding ``repo`` (refs/main -> one snapshot with a config.json)."""
    folder = root / ("models--" + repo.replace("/", "--"))
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text("0123456789abcdef0123456789abcdef01234567")
    snapshot = folder / "snapshots" / "0123456789abcdef0123456789abcdef01234567"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text('{"model_type": "llama"}')


async def test_pull_of_a_cached_repo_succeeds_and_says_how_to_serve_it(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pull of a repo the cache holds ends in success; for a repo no model names, a status line
    says how to add it; for a configured one, success names the model."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf"))  # read at import otherwise
    for repo in ("org/cached", "org/served"):
        fake_hub_cache(tmp_path / "hf", repo)
    cfg = config_of({"manager": {"memory_budget_gb": 2},
                     "models": [{"name": "tiny", "path": str(tiny_model), "estimated_memory_gb": 0.05},
                                {"name": "served", "path": "org/served", "estimated_memory_gb": 0.05}]},
                    tmp_path)
    async with serving(cfg, tmp_path) as s:
        c = client(s)
        with trio.fail_after(20):
            lines = await run(lambda: [p.status for p in c.pull("org/cached:latest", stream=True)])
            assert lines[0] == "pulling manifest" and lines[-1] == "success"
            assert any("add `- name: <name>` with `path: org/cached`" in (x or "") for x in lines)
            async with s.client() as h:
                r = await h.post("/api/pull", json={"model": "org/served", "stream": False})
        assert r.status_code == 200 and r.json()["status"] == "success"
        assert r.json()["mlxd"] == {"repo": "org/served", "models": ["served"], "next": None}
