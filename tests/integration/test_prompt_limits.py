"""Prompts against a model's limits, sampling edges and invalid text, through the real daemon.

The daemon runs in-process (real journal, manager, hypercorn on loopback) with
real mlx-lm on tiny demo models; one copy has ``max_position_embeddings: 64``
in its config.json.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.integration.conftest import config_of, fake
from tests.support.daemon import serving


@pytest.fixture(scope="module")
def short_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny demo model with a 64-token context in its config.json."""
    path = tmp_path_factory.mktemp("short") / "tiny64"
    shutil.copytree(tiny_model, path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["max_position_embeddings"] = 64
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def limits_config(tiny: Path, short: Path, tmp: Path, *, capped: bool = False) -> Any:
    models: list[dict[str, Any]] = [
        {"name": "tiny", "path": str(tiny), "estimated_memory_gb": 0.01},
        {"name": "short", "path": str(short), "estimated_memory_gb": 0.01},
    ]
    if capped:
        models += [
            {"name": "capped", "path": str(tiny), "estimated_memory_gb": 0.01,
             "max_prompt_tokens": 20},
            {**fake("fake-a", 0.5), "max_prompt_tokens": 5},
        ]
    return config_of({"manager": {"memory_budget_gb": 2}, "models": models}, tmp)


def error_of(r: httpx.Response) -> dict[str, Any]:
    err: dict[str, Any] = r.json()["error"]
    return err


async def test_context_length_is_enforced(
    tiny_model: Path, short_model: Path, tmp_path: Path
) -> None:
    """A prompt filling the context in the model's config.json is a 400 context_length_exceeded, streamed or not; a max_tokens past the room left is lowered to it; a request that fits is served."""
    async with serving(limits_config(tiny_model, short_model, tmp_path), tmp_path) as s, s.client() as c:
        long_prompt = "hello world this is a tiny model " * 150  # ~900 tokens
        for stream in (False, True):
            r = await c.post("/v1/completions", json={
                "model": "short", "prompt": long_prompt, "max_tokens": 5, "stream": stream})
            assert r.status_code == 400, r.text
            err = error_of(r)
            assert err["code"] == "context_length_exceeded" and err["param"] == "prompt"
            assert "64" in err["message"]
        # fits alone, but not with max_tokens: max_tokens is lowered to the room left
        r = await c.post("/v1/completions", json={
            "model": "short", "prompt": "hello world", "max_tokens": 200, "temperature": 0})
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        assert usage["prompt_tokens"] + usage["completion_tokens"] <= 64
        assert r.json()["choices"][0]["finish_reason"] in ("length", "stop")
        r = await c.post("/v1/completions", json={
            "model": "short", "prompt": "hello world", "max_tokens": 20, "temperature": 0})
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        assert usage["prompt_tokens"] + 20 <= 64 and usage["completion_tokens"] == 20
        # every refusal released its lease as an error; none is left open
        await s.journal.wait_committed()
        leases = s.journal.leases(None, None, 100)
        assert leases and all(row["outcome"] in ("error", "completed") for row in leases)


async def test_max_prompt_tokens_caps_the_prompt(
    tiny_model: Path, short_model: Path, tmp_path: Path
) -> None:
    """A prompt over the model's max_prompt_tokens is a 400 context_length_exceeded (real and fake engines)."""
    config = limits_config(tiny_model, short_model, tmp_path, capped=True)
    async with serving(config, tmp_path) as s, s.client() as c:
        r = await c.post("/v1/chat/completions", json={
            "model": "capped", "max_tokens": 2,
            "messages": [{"role": "user", "content": "one two three four five " * 10}]})
        assert r.status_code == 400 and error_of(r)["code"] == "context_length_exceeded"
        assert error_of(r)["param"] == "messages"
        r = await c.post("/v1/chat/completions", json={
            "model": "fake-a", "max_tokens": 2,
            "messages": [{"role": "user", "content": "one two three four five six"}]})
        assert r.status_code == 400 and error_of(r)["code"] == "context_length_exceeded"
        r = await c.post("/v1/chat/completions", json={
            "model": "fake-a", "max_tokens": 2,
            "messages": [{"role": "user", "content": "one two three"}]})
        assert r.status_code == 200, r.text


async def test_a_prompt_too_long_by_its_length_is_refused_before_any_load(
    tiny_model: Path, short_model: Path, tmp_path: Path
) -> None:
    """A prompt longer than the model could ever take (by characters) is a 400 before the lease: the model is not even loaded."""
    async with serving(limits_config(tiny_model, short_model, tmp_path), tmp_path) as s, s.client() as c:
        r = await c.post("/v1/completions", json={
            "model": "short", "prompt": "x" * 64 * 16 + "x", "max_tokens": 1})
        assert r.status_code == 400 and error_of(r)["code"] == "context_length_exceeded"
        assert s.manager.model_status("short")["state"] == "unloaded"
        await s.journal.wait_committed()
        assert s.journal.leases(None, None, 10) == []


async def test_top_p_zero_is_greedy(tiny_model: Path, short_model: Path, tmp_path: Path) -> None:
    """top_p 0 keeps only the most likely token: the output is the greedy one whatever the seed and temperature."""
    async with serving(limits_config(tiny_model, short_model, tmp_path), tmp_path) as s, s.client() as c:
        body = {"model": "tiny", "prompt": "hello world", "max_tokens": 24}

        async def text(**kw: Any) -> str:
            r = await c.post("/v1/completions", json={**body, **kw})
            assert r.status_code == 200, r.text
            out: str = r.json()["choices"][0]["text"]
            return out

        greedy = await text(temperature=0)
        for seed in (1, 2, 3):
            assert await text(top_p=0, temperature=1.5, seed=seed) == greedy
        # sampling at temperature 1.5 with the whole distribution differs from greedy
        sampled = {await text(top_p=1, temperature=1.5, seed=seed) for seed in (1, 2, 3)}
        assert sampled != {greedy}


SURROGATE_BODIES = [
    ("/v1/chat/completions",
     '{"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi \\ud800 there"}]}',
     "messages[0].content"),
    ("/v1/chat/completions",
     '{"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": '
     '[{"type": "text", "text": "\\udfff"}]}]}',
     "messages[0].content[0].text"),
    ("/v1/completions", '{"model": "tiny", "max_tokens": 2, "prompt": "a\\udc80b"}', "prompt"),
    ("/v1/completions", '{"model": "tiny", "max_tokens": 2, "prompt": "ok", "stop": ["\\ud83d"]}',
     "stop[0]"),
]


async def test_lone_surrogates_are_a_400_naming_the_field(
    tiny_model: Path, short_model: Path, tmp_path: Path
) -> None:
    """A lone UTF-16 surrogate in any text field is a 400 naming that field (never a retryable 502); a valid pair is served."""
    async with serving(limits_config(tiny_model, short_model, tmp_path), tmp_path) as s, s.client() as c:
        for route, raw, param in SURROGATE_BODIES:
            r = await c.post(route, content=raw, headers={"Content-Type": "application/json"})
            assert r.status_code == 400, (raw, r.text)
            err = error_of(r)
            assert err["param"] == param and "surrogate" in err["message"], err
            pair = "\\ud83d\\ude00"
            ok = raw.replace("\\ud800", pair).replace("\\udfff", pair).replace("\\udc80", pair)
            if ok != raw:
                r = await c.post(route, content=ok, headers={"Content-Type": "application/json"})
                assert r.status_code == 200, (ok, r.text)
