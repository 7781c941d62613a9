"""Operational edges of the admin routes and the CLI, against the real daemon and the real CLI."""

from __future__ import annotations

import os
import subprocess
import time
from functools import partial
from pathlib import Path

import pytest
import trio

import mlxd.daemon
from mlxd.journal.journal import Journal
from mlxd.residency.events import TransitionEvent
from tests.integration.conftest import config_of, fake
from tests.support.daemon import MLXD, REPO, serving


@pytest.mark.parametrize("key", ["clé-secrète", "line\nbreak", "tab\there"])
def test_cli_refuses_an_unsendable_api_key_in_one_line(key: str) -> None:
    """`mlxd status` with an API key that cannot go in an HTTP header exits 2 with one line naming where the key came from, no traceback."""
    env = {**os.environ, "MLXD_API_KEY": key}
    done = subprocess.run([*MLXD, "status", "--url", "http://127.0.0.1:9"], capture_output=True,
                          text=True, env=env, cwd=REPO, timeout=60, check=False)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "MLXD_API_KEY" in lines[0] and "printable ASCII" in lines[0], lines


async def test_history_errors_name_query_parameters(tmp_path: Path) -> None:
    """A bad `since` on /admin/history is a 400 that names the query parameter, not the CLI flag."""
    config = config_of({"manager": {"memory_budget_gb": 1}, "models": [fake("a", 0.1)]}, tmp_path)
    async with serving(config, tmp_path) as s, s.client() as c:
        r = await c.get("/admin/history", params={"since": "yesterday-ish"})
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["param"] == "since" and err["message"].startswith("since:"), err
        assert "--" not in err["message"]


async def test_history_shows_the_load_a_request_just_waited_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """/admin/history read right after a request that loaded its model holds that load, though the journal writes its rows in batches (here 30 s apart: the read has them written at once)."""
    monkeypatch.setattr(mlxd.daemon, "Journal", partial(Journal, flush_interval=30.0))
    config = config_of({"manager": {"memory_budget_gb": 1}, "models": [fake("a", 0.1)]}, tmp_path)
    async with serving(config, tmp_path) as s, s.client() as c:
        chat = {"model": "a", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
        assert (await c.post("/v1/chat/completions", json=chat)).status_code == 200
        t0 = time.monotonic()
        rows = (await c.get("/admin/history", params={"model": "a"})).json()
        assert time.monotonic() - t0 < 5  # written on demand, not at the next batch
        assert [(r["from_state"], r["to_state"], r["reason"]) for r in rows][-2:] == [
            ("unloaded", "loading", "request"),
            ("loading", "loaded", "request"),
        ], rows
        leases = (await c.get("/admin/history", params={"model": "a", "kind": "leases"})).json()
        assert len(leases) == 1, leases


async def test_admin_load_answers_with_the_state_it_reached(tmp_path: Path) -> None:
    """An unload that slips in while an admin load's reply waits for the journal does not turn the reply into 200 with loaded: false."""
    config = config_of({"manager": {"memory_budget_gb": 1},
                        "models": [fake("a", 0.1, load_seconds=0.05)]}, tmp_path)
    async with serving(config, tmp_path) as s, s.client() as c:
        loaded = trio.Event()

        def watch(event: object) -> None:
            if isinstance(event, TransitionEvent) and event.to_state.value == "loaded":
                loaded.set()

        s.manager.subscribe(watch)

        async def unload_at_once() -> None:
            await loaded.wait()
            await s.manager.unload("a")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(unload_at_once)
            r = await c.post("/admin/models/a/load")
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["loaded"] is True and body["status"] == "loaded", body
        assert s.manager.model_status("a")["state"] == "unloaded"
