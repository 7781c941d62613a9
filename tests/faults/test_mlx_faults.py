"""Engine faults in the real MLX engine (tiny demo model), through the daemon (``--stress``).

The same faults as the fake engine's sweep, injected on the MLX thread where a
real engine would misbehave: the load raises, hangs (the thread stays busy) or
cannot be cancelled; the unload raises or hangs; generation raises or wedges
between tokens. Each run checks what the HTTP sweep checks: ``/health``
within 1 s, typed errors only, a legal journal without open leases, an honest
``clean_stop``. (The scenario that broke the MLX engine before, a stop that
fails once, runs by default in ``tests/integration/test_hostile_mlx.py``.)
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio

from mlxd.engines import DefaultEngines
from tests.faults.test_http_sweep import (
    Arrivals,
    Watch,
    check_journal_file,
    client_request,
    ending,
    watch_health,
)
from tests.integration.conftest import config_of, fake
from tests.support.daemon import serving

FAULTS: dict[str, dict[str, Any]] = {
    "load raises": {"load": "raise"},
    "load hangs": {"load": "hang"},
    "load ignores cancel": {"load": "ignore_cancel", "delay_s": 3.0},
    "stop raises once": {"stop": "raise_once"},
    "stop always raises": {"stop": "raise"},
    "stop hangs": {"stop": "hang"},
    "generate raises": {"generate": "raise", "after_tokens": 2},
    "generate hangs": {"generate": "hang", "after_tokens": 2},
}


@pytest.mark.stress
@pytest.mark.parametrize("fault", list(FAULTS))
async def test_mlx_engine_fault(fault: str, tiny_model: Path, tmp_path: Path) -> None:
    """Under this MLX engine fault, with preemption in play: /health within 1 s, typed errors only, a legal journal without open leases, an honest clean_stop."""
    cfg = config_of(
        {
            "server": {"shutdown_grace_s": 1},
            "manager": {"memory_budget_gb": 1.0, "stop_timeout_s": 3.0,
                        "contention_policy": {"strategy": "wait_then_preempt",
                                              "wait_timeout_s": 5, "preempt_after_s": 1}},
            "models": [
                {"name": "tiny", "path": str(tiny_model), "estimated_memory_gb": 0.6,
                 "faults": FAULTS[fault]},
                fake("f", 0.6),
            ],
        },
        tmp_path,
    )
    w = Watch()
    engines = DefaultEngines()
    try:
        async with serving(cfg, tmp_path, engines=engines) as s, s.client(timeout=60) as c, \
                trio.open_nursery() as nursery:
            nursery.start_soon(watch_health, s, w, engines.fleet)
            seen, left = Arrivals(s), trio.Event()
            hangs = FAULTS[fault].get("load") == "hang"
            async with trio.open_nursery() as clients:
                clients.start_soon(lambda: client_request(c, w, "tiny", stream=True))
                clients.start_soon(lambda: client_request(c, w, "tiny", stream=False))
                # tiny serves, or its load failed, or (a hanging load) began
                await seen.until(lambda: "tiny" in seen.leased
                                 or "failed" in seen.entered.get("tiny", ())
                                 or (hangs and "loading" in seen.entered.get("tiny", ())))
                clients.start_soon(lambda: client_request(c, w, "f", stream=True))  # preempts tiny
                clients.start_soon(ending, left, partial(client_request, c, w, "tiny",
                                                          stream=False, leave_after=0.5))
                await left.wait()  # the client that gives up after 0.5 s has left (or was answered)
                r = await c.post("/admin/models/tiny/unload")
                w.responses[f"unload {r.status_code}"] += 1
                clients.start_soon(lambda: client_request(c, w, "tiny", stream=True))
            nursery.cancel_scope.cancel()
    finally:
        for faults in engines.faults.values():
            faults.release.set()  # free MLX threads left hanging
    check_journal_file(tmp_path / "journal.db", w)
    assert w.violations == [], (fault, w.violations[:5], dict(w.responses))
