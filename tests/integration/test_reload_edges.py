"""`POST /admin/reload` against the real daemon: what it applies, what it reports, what it never blocks."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import trio

from tests.integration.conftest import config_of, fake
from tests.support.daemon import serving, write_config


def fake_config(reply: str, **server: Any) -> dict[str, Any]:
    """A config file whose server and journal are those that `serving` runs with."""
    return {
        "server": {"host": "127.0.0.1", "port": 0, **server},
        "journal": {"path": "journal.db", "synchronous": "normal"},
        "manager": {"memory_budget_gb": 4},
        "models": [fake("a", 0.1, reply=reply, tokens_per_second=200)],
    }


async def test_reload_applies_a_dormant_fake_models_new_settings(tmp_path: Path) -> None:
    """A dormant fake model reported as replaced serves with its new settings."""
    path = write_config(tmp_path / "models.yaml", fake_config("old words"))
    async with serving(config_of(fake_config("old words"), tmp_path), tmp_path,
                       config_path=path) as s, s.client() as c:
        r = await c.post("/v1/completions", json={"model": "a", "prompt": "x", "max_tokens": 2})
        assert r.json()["choices"][0]["text"].split() == ["old", "words"]
        assert (await c.post("/admin/models/a/unload")).status_code == 200
        write_config(path, fake_config("new words"))
        r = await c.post("/admin/reload")
        assert r.status_code == 200 and r.json()["replaced"] == ["a"], r.text
        r = await c.post("/v1/completions", json={"model": "a", "prompt": "x", "max_tokens": 4})
        assert r.status_code == 200
        assert r.json()["choices"][0]["text"].split() == ["new", "words", "new", "words"]


async def test_server_changes_on_reload_are_reported_as_needing_a_restart(tmp_path: Path) -> None:
    """A changed server: section is reported under restart_needed and the running settings stay, so the 413 message quotes the limit in force."""
    path = write_config(tmp_path / "models.yaml", fake_config("w", max_body_mb=1))
    async with serving(config_of(fake_config("w", max_body_mb=1), tmp_path), tmp_path,
                       config_path=path, max_body_mb=1.0) as s, s.client() as c:
        write_config(path, fake_config("w", max_body_mb=8))
        r = await c.post("/admin/reload")
        assert r.status_code == 200, r.text
        assert r.json()["restart_needed"] == ["server.max_body_mb: 1.0 -> 8.0"]
        big = b'{"model": "a", "prompt": "' + b"x" * (2 * 1024 * 1024) + b'"}'
        r = await c.post("/v1/completions", content=big,
                         headers={"Content-Type": "application/json"})
        assert r.status_code == 413 and "(1 MB)" in r.json()["error"]["message"], r.text


async def test_reloading_a_10000_model_config_does_not_stall_a_stream(tmp_path: Path) -> None:
    """While /admin/reload reads and applies a 10,000-model file, a live stream is never stalled for the reading (it was 5.7 s)."""
    small = fake_config("tick")
    path = write_config(tmp_path / "models.yaml", small)
    many = {**small, "models": small["models"] + [
        {"name": f"m{i}", "engine": "fake", "estimated_memory_gb": 0.1} for i in range(10_000)]}
    async with serving(config_of(small, tmp_path), tmp_path, config_path=path) as s, \
            s.client(timeout=120) as c:
        write_config(path, many)
        gaps: list[float] = []
        reloaded = trio.Event()

        async def stream() -> None:
            body = {"model": "a", "prompt": "x", "max_tokens": 100_000, "stream": True}
            async with c.stream("POST", "/v1/completions", json=body) as r:
                last = time.monotonic()
                async for _line in r.aiter_lines():
                    now = time.monotonic()
                    gaps.append(now - last)
                    last = now
                    if reloaded.is_set():
                        return

        async with trio.open_nursery() as nursery:
            nursery.start_soon(stream)
            await s.until(lambda: s.manager.model_status("a")["state"] == "loaded")
            t0 = time.monotonic()
            r = await c.post("/admin/reload")
            took = time.monotonic() - t0
            assert r.status_code == 200, r.text[:300]
            assert len(r.json()["added"]) == 10_000
            reloaded.set()
        print(f"reload took {took:.2f} s; longest gap between stream chunks {max(gaps):.3f} s")
        # what remains is the manager applying 10,000 models on the loop: 0.3-0.7 s on an
        # idle machine, up to 1.7 s on a loaded one (reading on the loop stalled 5.7-10 s)
        assert max(gaps) < 3.0, sorted(gaps)[-5:]
