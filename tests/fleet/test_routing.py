"""mlxd's strategy on LiteLLM's real router in front of three daemons on loopback (fake engines).

The default suite runs each workload at a fifth of its size with the same
assertions scaled; ``--stress`` runs the full 300 requests.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("litellm", reason="the fleet extra (litellm) is not installed")

from tests.support.fleet import Rig, make_router, run_asyncio, run_clients, running_fleet

MODELS = ("a", "b", "c")
#: each daemon's budget fits one of the three models (the bench's setting)
ONE_EACH = ({"a": 0.6, "b": 0.6, "c": 0.6}, 1.0)
#: each daemon's budget fits two: after a daemon dies, its model has room elsewhere
TWO_EACH = ({"a": 0.4, "b": 0.4, "c": 0.4}, 1.0)


def _requests(stress: bool) -> int:
    return 300 if stress else 60


def _pinned(total: int, per_model: int = 2) -> list[list[str]]:
    """Clients that each keep to one model: ``per_model`` per model, ``total`` requests in all."""
    clients = [m for m in MODELS for _ in range(per_model)]
    return [[m] * (total // len(clients)) for m in clients]


async def _warm(router: Any, rig: Rig) -> float:
    """One request per model, one after another; returns the time after which loads count."""
    for m in MODELS:
        r = await router.acompletion(model=m, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert r.choices[0].message.content
    await asyncio.sleep(1.1)  # the status cache catches up with the warm-up's loads
    return time.time()


def _run(rig: Rig, strategy: str, plans: list[list[str]], **kw: Any) -> tuple[Any, float, Any]:
    async def main() -> tuple[Any, float, Any]:
        router, routing = make_router(rig.fleet, strategy)
        watch = asyncio.create_task(routing.watch.run()) if routing is not None else None
        try:
            since = await _warm(router, rig)
            work = await run_clients(router, plans, **kw)
        finally:
            if watch is not None:
                watch.cancel()
        return work, since, routing

    return run_asyncio(main)


def _one_daemon_per_request(rig: Rig) -> None:
    doubled = {rid: daemons for rid, daemons in rig.leases().items() if len(daemons) > 1}
    assert not doubled, f"requests served by more than one daemon: {doubled}"


@pytest.mark.parametrize("size", [pytest.param(False, id="60"),
                                  pytest.param(True, id="300", marks=pytest.mark.stress)])
def test_pinned_clients_settle_each_model_on_one_daemon(tmp_path: Path, size: bool) -> None:
    """With clients pinned to models, mlxd's strategy loads at most 3 times after warm-up (each model settles on one daemon) where simple-shuffle loads at least once per 10 requests."""
    n = _requests(size)
    with running_fleet(tmp_path / "mlxd", 3, *ONE_EACH) as rig:
        work, since, routing = _run(rig, "mlxd", _pinned(n))
        assert not work.errors(), work.errors()[:3]
        assert len(rig.loads(since)) <= 3, rig.loads(since)
        homes = {m: {o.daemon for o in work.outcomes if o.model == m} for m in MODELS}
        assert all(len(d) == 1 for d in homes.values()), homes
        assert len({d for ds in homes.values() for d in ds}) == 3  # one model per daemon
        assert routing.feedback.lost == 0
        _one_daemon_per_request(rig)
    with running_fleet(tmp_path / "shuffle", 3, *ONE_EACH) as rig:
        work, since, _ = _run(rig, "simple-shuffle", _pinned(n))
        assert len(rig.loads(since)) >= n // 10, (len(rig.loads(since)), n)
        _one_daemon_per_request(rig)


@pytest.mark.parametrize("size", [pytest.param(False, id="60"),
                                  pytest.param(True, id="300", marks=pytest.mark.stress)])
def test_a_killed_daemon_loses_only_its_in_flight_requests(tmp_path: Path, size: bool) -> None:
    """Killing the daemon that holds a model mid-run fails at most the streams it was serving; its model settles on one other daemon, and no request is served by two daemons."""
    n = _requests(size)
    plans = _pinned(n)
    shuffled = list(MODELS) * (n // 10 // 3)
    random.Random(7).shuffle(shuffled)
    plans.append(shuffled)  # and a client that asks for any model
    with running_fleet(tmp_path, 3, *TWO_EACH, tokens_per_second=200.0) as rig:
        killed: dict[str, Any] = {}

        def kill() -> None:
            killed["at"] = time.time()
            rig.processes[0].kill()

        work, _since, routing = _run(rig, "mlxd", plans, stream=True, max_tokens=16,
                                    after=(n // 2, kill))
        home_a = {o.daemon for o in work.outcomes if o.model == "a" and o.error is None
                  and o.daemon is not None}
        assert "d0" in home_a  # a lived on d0 before the kill
        failed = work.errors()
        # one request in flight per client at most, and only d0's were lost
        assert len(failed) <= 3, [f.error for f in failed]
        homes = {(o.model, o.daemon) for o in work.outcomes if o.daemon}
        assert {f.model for f in failed} <= {"a"}, ([(f.model, f.client, f.error) for f in failed],
                                                    homes, rig.loads(0))
        after = [o for o in work.outcomes[n // 2 + len(plans):] if o.model == "a"]
        assert after and all(o.error is None for o in after)
        assert len({o.daemon for o in after}) == 1 and after[0].daemon != "d0"
        late_loads = [ld for ld in rig.loads(killed["at"]) if ld[0] != "d0"]
        assert Counter(m for _d, m in late_loads) == Counter({"a": 1}), late_loads
        assert routing.watch.status()["d0"]["up"] is False  # skipped until it answers again
        _one_daemon_per_request(rig)
