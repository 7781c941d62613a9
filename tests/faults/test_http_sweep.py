"""The fault sweep through the real daemon: engine faults from YAML, HTTP clients, the journal file.

Each run serves the four models of :mod:`tests.faults.test_sweep` (tight
budget, one pinned, ``x`` faulty through its ``faults:`` config key) on
loopback with the real journal, and drives a fixed mix of requests: streams
and plain ones to every model (one needing an eviction), a client that leaves
while waiting, an admin unload. Throughout, ``/health`` must answer within
1 s and every engine that may hold memory must be counted; every response is
a 200 or a typed error (never a 500); after shutdown the journal must be
legal, with no open lease, and ``clean_stop`` only if every model ended
``unloaded`` or ``failed``.

The default run takes each fault once (with a rotating strategy); ``--stress``
takes every fault under every strategy.
"""

from __future__ import annotations

import sqlite3
from collections import Counter
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from mlxd.config import parse_config
from mlxd.engines import DefaultEngines
from mlxd.journal.replay import check_journal
from mlxd.residency.events import LeaseAcquired, TransitionEvent
from mlxd.residency.policy import STRATEGIES
from mlxd.residency.states import COMMITTED
from tests.faults.test_sweep import BUDGET_GB, SCENARIOS, SIZES
from tests.support.daemon import Served, serving

HEALTH_BOUND_S = 1.0
CLIENT_TIMEOUT_S = 4.0


def config(tmp: Path, scenario: str, strategy: str) -> Any:
    f = SCENARIOS[scenario]
    faults = {k: v for k, v in (("load", f.load), ("stop", f.stop), ("generate", f.generate))
              if v is not None}
    faults |= {"after_tokens": f.after_tokens, "delay_s": 1.0}
    models = []
    for name, gb in SIZES.items():
        model: dict[str, Any] = {
            "name": name, "engine": "fake", "estimated_memory_gb": gb, "pin": name == "p",
            "fake": {"load_seconds": 0.1, "unload_seconds": 0.05, "tokens_per_second": 50},
        }
        if name == "x":
            model["faults"] = faults
        models.append(model)
    raw = {
        "server": {"shutdown_grace_s": 1},
        "manager": {
            "memory_budget_gb": BUDGET_GB,
            "stop_timeout_s": 1.0,
            "contention_policy": {"strategy": strategy, "wait_timeout_s": 2.0}
            | ({"preempt_after_s": 0.5} if strategy == "wait_then_preempt" else {}),
        },
        "models": models,
    }
    return parse_config(raw, path=tmp / "models.yaml")


class Watch:
    """What the run saw: response kinds, /health latencies, violations."""

    def __init__(self) -> None:
        self.responses: Counter[str] = Counter()
        self.violations: list[str] = []
        self.worst_health = 0.0


async def client_request(c: httpx.AsyncClient, w: Watch, model: str, *, stream: bool,
                         leave_after: float | None = None) -> None:
    body = {"model": model, "max_tokens": 20, "stream": stream,
            "messages": [{"role": "user", "content": "go"}]}
    with trio.move_on_after(leave_after if leave_after is not None else CLIENT_TIMEOUT_S) as cs:
        async with c.stream("POST", "/v1/chat/completions", json=body) as r:
            text = (await r.aread()).decode()
        if r.status_code >= 500 and r.status_code not in (502, 503):
            w.violations.append(f"{model}: HTTP {r.status_code}: {text[:200]}")
        if r.status_code == 200 and stream and "data: [DONE]" not in text and '"error"' not in text:
            w.violations.append(f"{model}: a stream ended with neither [DONE] nor an error event")
        w.responses[str(r.status_code)] += 1
    if cs.cancelled_caught:
        w.responses["client left" if leave_after is not None else "client timeout"] += 1


class Arrivals:
    """What the manager did since it was watched: the models it leased, the states models
    entered; :meth:`until` waits for a condition on them at the manager's own events."""

    def __init__(self, s: Served) -> None:
        self.served = s
        self.leased: set[str] = set()
        self.entered: dict[str, set[str]] = {}
        s.manager.subscribe(self._on)

    def _on(self, event: object) -> None:
        if isinstance(event, LeaseAcquired):
            self.leased.add(event.model)
        elif isinstance(event, TransitionEvent):
            self.entered.setdefault(event.model, set()).add(event.to_state.value)

    async def until(self, ok: Callable[[], bool]) -> None:
        with trio.fail_after(30):
            await self.served.until(ok)


async def ending(event: trio.Event, request: Callable[[], Awaitable[None]]) -> None:
    """Run a client's ``request``, then set ``event`` (whether it was answered or left)."""
    try:
        await request()
    finally:
        event.set()


async def watch_health(s: Served, w: Watch, fleet: Any) -> None:
    async with s.client(timeout=HEALTH_BOUND_S * 5) as c:
        while True:
            t0 = trio.current_time()
            r = await c.get("/health")
            took = trio.current_time() - t0
            w.worst_health = max(w.worst_health, took)
            if took > HEALTH_BOUND_S or r.status_code not in (200, 503):
                w.violations.append(f"/health took {took:.2f} s (HTTP {r.status_code})")
            for name in s.manager.model_names():
                fake, state = fleet.models.get(name), s.manager.state_of(name)  # fake: at its first load
                if fake is not None and fake.resident and state not in COMMITTED:
                    w.violations.append(f"{name}: an engine holds memory while {state}")
            res = s.manager.snapshot()
            if res.committed_bytes > res.budget_bytes:
                w.violations.append(f"committed {res.committed_bytes} > budget {res.budget_bytes}")
            await trio.sleep(0.2)  # the subject: a probe five times a second, whatever happens


async def run_once(tmp: Path, scenario: str, strategy: str) -> Watch:
    w = Watch()
    engines = DefaultEngines()
    async with serving(config(tmp, scenario, strategy), tmp, engines=engines) as s, \
            s.client(timeout=30) as c, trio.open_nursery() as nursery:
        nursery.start_soon(watch_health, s, w, engines.fleet)
        seen, left = Arrivals(s), trio.Event()
        async with trio.open_nursery() as clients:
            for model, stream in (("x", True), ("y", False), ("p", True)):
                clients.start_soon(lambda m=model, st=stream: client_request(c, w, m, stream=st))
            # all three reached the manager (x's load began, whatever its fault does next), so
            # that z needs an eviction
            await seen.until(lambda: {"y", "p"} <= seen.leased and "loading" in seen.entered.get("x", ()))
            clients.start_soon(lambda: client_request(c, w, "z", stream=True))
            clients.start_soon(ending, left, partial(client_request, c, w, "x", stream=False,
                                                      leave_after=0.2))
            await left.wait()  # the client that gives up after 0.2 s has left (or was answered)
            r = await c.post("/admin/models/x/unload")
            w.responses[f"unload {r.status_code}"] += 1
            clients.start_soon(lambda: client_request(c, w, "x", stream=True))
            clients.start_soon(lambda: client_request(c, w, "y", stream=True))
        nursery.cancel_scope.cancel()
    check_journal_file(tmp / "journal.db", w)
    return w


def check_journal_file(path: Path, w: Watch) -> None:
    """Legal history, no lease left open, and ``clean_stop`` only if every model came to rest."""
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as conn:
        w.violations += check_journal(conn)
        open_leases = conn.execute("SELECT count(*) FROM leases WHERE released_at IS NULL").fetchone()[0]
        if open_leases:
            w.violations.append(f"{open_leases} lease(s) left open")
        (clean,) = conn.execute("SELECT clean_stop FROM runs").fetchone()
        last = dict(conn.execute("SELECT model, to_state FROM transitions t WHERE seq ="
                                 " (SELECT max(seq) FROM transitions WHERE model = t.model)"))
        resting = all(state in ("unloaded", "failed") for state in last.values())
        if clean != int(resting):
            w.violations.append(f"clean_stop = {clean}, but the models ended {last}")


def combos(stress: bool) -> list[tuple[str, str]]:
    names = list(SCENARIOS)
    if stress:
        return [(n, s) for n in names for s in STRATEGIES]
    return [(n, STRATEGIES[i % len(STRATEGIES)]) for i, n in enumerate(names)]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "combo" in metafunc.fixturenames:
        runs = combos(bool(metafunc.config.getoption("--stress")))
        metafunc.parametrize("combo", runs, ids=[f"{n}-{s}" for n, s in runs])


async def test_http_fault_sweep(combo: tuple[str, str], tmp_path: Path) -> None:
    """Under one engine fault and one strategy, through HTTP: /health within 1 s, typed errors only, a legal journal without open leases, an honest clean_stop."""
    scenario, strategy = combo
    w = await run_once(tmp_path, scenario, strategy)
    assert w.violations == [], (scenario, strategy, w.violations[:5], dict(w.responses))
    assert sum(w.responses.values()) >= 8, dict(w.responses)
