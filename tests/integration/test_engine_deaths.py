"""Engine worker processes that die, seen through HTTP with the real journal.

A worker killed with SIGKILL, or one that calls ``abort()``, mid-stream: the
daemon keeps serving its other models, the client gets an ``engine_died``
error event, the lease is journaled ``error``, the model goes ``failed``
(``engine_died``), ``/health`` says so, and the next request loads it again.
A load that ignores cancellation is ended within 2 s of being abandoned, and
its worker (and its memory) with it.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import sqlite3
import time
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import trio

from mlxd.config import ModelConfig
from mlxd.engines import DefaultEngines
from mlxd.engines.base import Engine, LoadProgress, ProgressCallback
from mlxd.journal.replay import check_journal
from tests.integration.conftest import config_of, fake
from tests.integration.test_http_residency import CHAT, body, rows, stream_lines, transitions
from tests.support.daemon import DaemonProcess, Served, serving, write_config
from tests.support.tasks import worker_tasks


class LoadsWatched(DefaultEngines):
    """The daemon's engines, with an event set when a load reports its ``done`` phase (the
    progress callback the manager gives each load: the event a test waits on instead of polling)."""

    def __init__(self) -> None:
        super().__init__()
        self.loaded = trio.Event()

    def __call__(self, model: ModelConfig) -> Engine:
        engine = super().__call__(model)
        load = engine.load

        async def watched(progress: ProgressCallback) -> None:
            def report(p: LoadProgress) -> None:
                progress(p)
                if p.phase == "done":
                    self.loaded.set()

            await load(report)

        engine.load = watched  # type: ignore[method-assign]
        return engine


def worker_pids(served: Served, model: str) -> list[int]:
    engine = served.manager.model_status(model)["engine"]
    return [w["pid"] for w in engine["workers"]] if engine and "workers" in engine else []


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def config(tmp: Path, **p: Any) -> Any:
    return config_of(
        {"manager": {"memory_budget_gb": 4},
         "models": [{**fake("p", 1, tokens_per_second=50), "isolation": "process", **p},
                    fake("q", 1)]},
        tmp,
    )


@pytest.mark.parametrize("how", ["sigkill", "abort"])
async def test_a_worker_dying_mid_stream_fails_one_model_and_the_next_request_reloads_it(
    tmp_path: Path, how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if how == "abort":  # the worker's 4th token calls abort(); only the first worker inherits it
        monkeypatch.setenv("MLXD_CRASH_AT", "worker.token:4=abort")
    async with serving(config(tmp_path), tmp_path) as s, s.client() as c:
        lines: list[str] = []
        first = trio.Event()
        async with trio.open_nursery() as n:
            n.start_soon(stream_lines, c, body("p", stream=True, max_tokens=10_000), lines, first)
            await first.wait()
            [pid] = worker_pids(s, "p")
            monkeypatch.delenv("MLXD_CRASH_AT", raising=False)
            if how == "sigkill":
                os.kill(pid, signal.SIGKILL)
        error = json.loads(lines[-1])["error"]
        assert error["code"] == "engine_died" and "[DONE]" not in lines
        assert gone(pid)
        model = (await c.get("/v1/models/p")).json()
        assert model["status"] == "failed"
        assert ("SIGKILL" if how == "sigkill" else "SIGABRT") in model["last_error"]
        health = (await c.get("/health")).json()
        assert health["status"] == "degraded"
        assert any("engine of 'p' died" in r for r in health["reasons"])
        # the daemon and its other model never noticed
        assert (await c.post(CHAT, json=body("q"))).status_code == 200
        # the next request loads p again, in a new worker
        r = await c.post(CHAT, json=body("p"))
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
        assert worker_pids(s, "p") != [pid]
        assert (await c.get("/health")).json()["status"] == "ok"
        await s.journal.wait_committed()
        assert [t for t in transitions(s, "p") if t[1] in ("failed", "loaded")] == [
            ("loading", "loaded", "request"),
            ("loaded", "failed", "engine_died"),
            ("loading", "loaded", "request"),
        ]
        outcomes = rows(s, "SELECT outcome FROM leases WHERE model = 'p' ORDER BY acquired_at")
        assert outcomes == [("error",), ("completed",)]
        assert rows(s, "SELECT count(*) FROM leases WHERE released_at IS NULL") == [(0,)]


async def test_a_load_that_ignores_cancellation_is_ended_within_2s(
    tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real MLX engine loads in its worker, which then hangs (deaf to cancellation)
    with the weights in memory; the client leaves: the worker is gone within 2 s."""
    monkeypatch.setenv("MLXD_CRASH_AT", "worker.loaded=stall")
    cfg = config_of({"manager": {"memory_budget_gb": 4},
                     "models": [{"name": "t", "path": str(tiny_model), "isolation": "process"}]},
                    tmp_path)
    engines = LoadsWatched()
    async with serving(cfg, tmp_path, engines=engines) as s, s.client() as c:
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as n:
                n.start_soon(partial(c.post, CHAT, json=body("t")))
                with trio.fail_after(120):
                    await engines.loaded.wait()  # the worker's last progress report
                assert (s.manager.model_status("t")["loading"] or {}).get("phase") == "done"
                [worker] = worker_children(os.getpid())
                rss = worker.memory_info().rss
                scope.cancel()  # the client leaves: the load is abandoned
        left = time.monotonic()
        with trio.fail_after(10):
            await s.until(lambda: s.manager.state_of("t").value == "unloaded")
        assert gone(worker.pid)
        took = time.monotonic() - left
        assert took < 2.0, took
        assert rss > 50 << 20  # it held the weights and MLX (its RSS left with it)
        print(f"abandoned load: its worker ({rss >> 20} MiB RSS) gone {took:.2f} s after the client left")
        await s.journal.wait_committed()
        assert transitions(s, "t")[-1] == ("loading", "unloaded", "abandoned")


async def test_a_daemon_shutdown_leaves_no_worker_process_and_no_task(
    tmp_path: Path, tiny_model: Path
) -> None:
    """The daemon owns its engine workers: a loaded model's worker and the warm spare (kept
    for the MLX model) are killed with its shutdown, and no task of theirs is left behind."""
    cfg = config_of({"manager": {"memory_budget_gb": 4},
                     "models": [{**fake("p", 1), "isolation": "process"},
                                {"name": "t", "path": str(tiny_model), "isolation": "process"}]},
                    tmp_path)
    async with serving(cfg, tmp_path) as s, s.client() as c:
        assert (await c.post(CHAT, json=body("p"))).status_code == 200
        workers = worker_children(os.getpid())
        assert len(workers) == 2  # p's, and the spare started for t
        assert worker_tasks() == ["mlxd worker p the engine process",
                                          "mlxd worker spare the engine process"]
    assert all(gone(w.pid) for w in workers)
    assert worker_tasks() == []


# ---- random kills under traffic (a subprocess daemon: a death there would be seen) ----------


def worker_children(daemon_pid: int) -> list[psutil.Process]:
    try:
        children = psutil.Process(daemon_pid).children()
    except psutil.NoSuchProcess:
        return []
    out = []
    for p in children:
        try:
            if "mlxd.engines.workers.worker" in " ".join(p.cmdline()):
                out.append(p)
        except psutil.Error:
            continue
    return out


class Tally:
    def __init__(self) -> None:
        self.ok = 0
        self.typed = 0  # an error the client can read: an error event or a typed HTTP error
        self.codes: dict[str, int] = {}
        self.bad: list[str] = []

    def error(self, code: str | None) -> None:
        if code is None:
            self.bad.append("an error without a code")
        self.typed += 1
        self.codes[str(code)] = self.codes.get(str(code), 0) + 1


async def client_loop(url: str, models: list[str], rng: random.Random, tally: Tally, stop: trio.Event) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        while not stop.is_set():
            model = rng.choice(models)
            payload = body(model, stream=rng.random() < 0.7, max_tokens=rng.randint(5, 150))
            try:
                if payload["stream"]:
                    async with c.stream("POST", CHAT, json=payload) as r:
                        if r.status_code != 200:
                            await r.aread()
                            tally.error(r.json()["error"]["code"])
                            continue
                        last = ""
                        async for line in r.aiter_lines():
                            if line.startswith("data: "):
                                last = line[6:]
                        if last == "[DONE]":
                            tally.ok += 1
                        else:
                            tally.error(json.loads(last)["error"]["code"])
                else:
                    r = await c.post(CHAT, json=payload)
                    if r.status_code == 200:
                        tally.ok += 1
                    else:
                        tally.error(r.json()["error"]["code"])
            except (httpx.HTTPError, ValueError, KeyError) as e:
                tally.bad.append(f"{type(e).__name__}: {e}")


@pytest.mark.stress
@pytest.mark.parametrize("kills", [100, 6])
async def test_random_worker_kills_under_traffic(
    tmp_path: Path, kills: int, request: pytest.FixtureRequest
) -> None:
    """Kill random engine workers (SIGKILL or SIGABRT, loaded or loading) under traffic:
    the daemon never dies, every request ends completed or with a typed error, the
    journal stays legal and no lease is left open. The long run adds a real MLX model."""
    models = [
        {**fake(name, 1, tokens_per_second=60, load_seconds=0.05), "isolation": "process"}
        for name in ("p1", "p2", "p3")
    ] + [fake("q", 1, tokens_per_second=200)]
    if kills >= 100:
        tiny = request.getfixturevalue("tiny_model")
        models.append({"name": "t", "path": str(tiny), "isolation": "process"})
    names = [m["name"] for m in models]
    raw: dict[str, Any] = {
        "manager": {"memory_budget_gb": 8, "contention_policy": {"strategy": "wait_then_fail"}},
        "models": models,
    }
    state = tmp_path / "state"
    state.mkdir()
    journal = tmp_path / "journal.db"
    raw["journal"] = {"path": str(journal), "synchronous": "normal"}
    rng = random.Random(kills)
    with DaemonProcess(write_config(tmp_path / "models.yaml", raw), state) as d:
        assert d.proc is not None
        tally, stop, done = Tally(), trio.Event(), 0
        async with trio.open_nursery() as n:
            for i in range(4):
                n.start_soon(client_loop, d.url, names, random.Random(i), tally, stop)
            async with httpx.AsyncClient(base_url=d.url, timeout=30) as admin:
                while done < kills:
                    await trio.sleep(rng.uniform(0.3, 0.9))  # the subject: kills at random moments
                    assert d.proc.poll() is None, "the daemon died"
                    status = (await admin.get("/admin/status")).json()
                    serving_pids = [  # workers of loaded models: most kills land mid-stream
                        w["pid"] for m in status["models"].values() if m["state"] == "loaded"
                        for w in (m["engine"] or {}).get("workers", [])
                    ]
                    every = [p.pid for p in worker_children(d.proc.pid)]  # loading, spares too
                    pool = serving_pids if serving_pids and rng.random() < 0.7 else every
                    if not pool:
                        continue
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(rng.choice(pool), rng.choice([signal.SIGKILL, signal.SIGABRT]))
                        done += 1
            stop.set()
        assert d.proc.poll() is None, "the daemon died"
        async with httpx.AsyncClient(base_url=d.url, timeout=30) as c:
            with trio.fail_after(30):
                while (await c.get("/admin/status")).json()["leases"]:  # noqa: ASYNC110 (another process)
                    await trio.sleep(0.1)
            for model in names:  # every model serves again
                r = await c.post(CHAT, json=body(model))
                assert r.status_code == 200, r.text
        assert d.terminate() == 0
    assert tally.bad == [], tally.bad[:5]
    assert tally.ok > 0 and set(tally.codes) <= {"engine_died", "model_load_failed", "capacity_timeout"}, tally.codes
    conn = sqlite3.connect(journal)
    try:
        assert check_journal(conn) == []
        assert conn.execute("SELECT count(*) FROM leases WHERE released_at IS NULL").fetchone() == (0,)
        died = conn.execute("SELECT count(*) FROM transitions WHERE reason = 'engine_died'").fetchone()[0]
    finally:
        conn.close()
    assert died > 0
    print(f"{kills} kills: {tally.ok} requests completed, typed errors {tally.codes}, "
          f"{died} engine_died transitions, daemon alive throughout")
