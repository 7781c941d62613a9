"""A fleet on loopback for tests and bench/fleet.py: mlxd daemons (subprocesses) and LiteLLM's router.

:func:`running_fleet` starts N ``mlxd serve`` processes of fake models, each
with its own journal; :func:`make_router` builds LiteLLM's ``Router`` over them
with mlxd's strategy (``"mlxd"``) or one of LiteLLM's; :func:`run_clients`
sends a workload through it (asyncio), one task per client, each request with
its own ``X-Request-Id`` so the journals show which daemon served it;
:func:`routing_proxy` runs ``mlxd route`` (LiteLLM's proxy) over them.
"""

from __future__ import annotations

import asyncio
import os
import socket
import sqlite3
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
import yaml

from mlxd.fleet.config import Fleet, parse_fleet
from tests.support.daemon import REPO, DaemonProcess, fake_models_config, write_config

T = TypeVar("T")

@dataclass
class Rig:
    """The daemons of a fleet on loopback."""

    processes: list[DaemonProcess]
    journals: list[Path]
    fleet: Fleet

    def loads(self, since: float = 0.0) -> list[tuple[str, str]]:
        """(daemon, model) of every load begun after ``since`` (unix time), from the journals."""
        out = []
        for d, journal in zip(self.fleet.daemons, self.journals, strict=True):
            for (model,) in _query(journal, "SELECT model FROM transitions WHERE to_state = 'loading'"
                                   " AND at > ? ORDER BY seq", (since,)):
                out.append((d.name, model))
        return out

    def leases(self) -> dict[str, list[str]]:
        """Request id -> the daemons whose journal has a lease for it."""
        out: dict[str, list[str]] = {}
        for d, journal in zip(self.fleet.daemons, self.journals, strict=True):
            for (rid,) in _query(journal, "SELECT request_id FROM leases", ()):
                out.setdefault(rid, []).append(d.name)
        return out


def _query(journal: Path, sql: str, args: tuple[Any, ...]) -> list[tuple[Any, ...]]:
    conn = sqlite3.connect(f"file:{journal}?mode=ro", uri=True, timeout=10)
    try:
        return conn.execute(sql, args).fetchall()
    finally:
        conn.close()


@contextmanager
def running_fleet(tmp: Path, n: int, sizes_gb: dict[str, float], budget_gb: float, *,
                  load_seconds: float = 0.05, tokens_per_second: float = 500.0,
                  strategy: str = "wait_then_fail") -> Iterator[Rig]:
    """``n`` daemons of the fake models ``sizes_gb``, each with ``budget_gb``, on loopback."""
    processes, journals = [], []
    for i in range(n):
        state = tmp / f"daemon{i}"
        state.mkdir(parents=True)
        raw = fake_models_config(sizes_gb, budget_gb, strategy=strategy, load_seconds=load_seconds,
                                 tokens_per_second=tokens_per_second)
        raw["journal"] = {"path": str(state / "journal.db"), "synchronous": "normal"}
        raw["manager"]["restore_on_start"] = False
        processes.append(DaemonProcess(write_config(state / "mlxd.yaml", raw), state))
        journals.append(state / "journal.db")
    try:
        with ThreadPoolExecutor(n) as pool:
            urls = list(pool.map(lambda p: p.start(120), processes))
        fleet = parse_fleet({"daemons": [
            {"name": f"d{i}", "url": url, "models": list(sizes_gb)} for i, url in enumerate(urls)]})
        yield Rig(processes, journals, fleet)
    finally:
        for p in processes:
            p.kill()


def make_router(fleet: Fleet, strategy: str, *, num_retries: int = 3) -> tuple[Any, Any]:
    """LiteLLM's Router over ``fleet`` and, for ``"mlxd"``, mlxd's strategy registered on it."""
    from litellm import Router

    from mlxd.fleet import strategy as mlxd_strategy  # LiteLLM's environment before its import
    from mlxd.fleet.proxy import deployments, router_settings
    from mlxd.fleet.watch import Watch

    settings = router_settings(fleet, strategy)
    settings["num_retries"] = num_retries
    router = Router(model_list=deployments(fleet), **settings)
    if strategy != "mlxd":
        return router, None
    import litellm

    routing = mlxd_strategy.MlxdRouting(router, Watch(fleet))
    router.register_plugin(routing)
    litellm.callbacks.append(routing.feedback)
    return router, routing


@dataclass
class Outcome:
    """One request of a workload."""

    client: int
    model: str
    request_id: str
    daemon: str | None
    latency_s: float
    error: str | None = None


@dataclass
class Workload:
    outcomes: list[Outcome] = field(default_factory=list)

    def errors(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.error is not None]


async def one_request(router: Any, client: int, model: str, *, stream: bool,
                      max_tokens: int) -> Outcome:
    rid = f"fleet-{uuid.uuid4().hex[:16]}"
    t0 = time.monotonic()
    try:
        r = await router.acompletion(
            model=model, messages=[{"role": "user", "content": "hello fleet"}],
            max_tokens=max_tokens, stream=stream, extra_headers={"X-Request-Id": rid})
        if stream:
            text = ""
            async for chunk in r:
                text += chunk.choices[0].delta.content or "" if chunk.choices else ""
        model_id = r._hidden_params.get("model_id")
    except Exception as e:
        return Outcome(client, model, rid, None, time.monotonic() - t0, f"{type(e).__name__}: {e}"[:300])
    daemon = str(model_id).split("/")[0] if model_id else None
    return Outcome(client, model, rid, daemon, time.monotonic() - t0)


async def run_clients(router: Any, plans: Sequence[Sequence[str]], *, stream: bool = False,
                      max_tokens: int = 4,
                      after: tuple[int, Callable[[], Awaitable[None] | None]] | None = None) -> Workload:
    """Each plan is one client's models, sent one after another; ``after = (n, hook)`` runs
    ``hook`` once ``n`` requests are done (a daemon killed mid-run)."""
    work = Workload()
    fired = asyncio.Event()

    async def client(i: int, models: Sequence[str]) -> None:
        for model in models:
            work.outcomes.append(await one_request(router, i, model, stream=stream,
                                                   max_tokens=max_tokens))
            if after is not None and len(work.outcomes) >= after[0] and not fired.is_set():
                fired.set()
                result = after[1]()
                if result is not None:
                    await result

    await asyncio.gather(*(client(i, p) for i, p in enumerate(plans)))
    return work


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def fleet_file(tmp: Path, rig: Rig, port: int) -> Path:
    """A fleet file for ``mlxd route`` over ``rig``'s daemons, the proxy on ``port``."""
    path = tmp / "fleet.yaml"
    path.write_text(yaml.safe_dump({
        "proxy": {"port": port, "num_retries": 3},
        "daemons": [{"name": d.name, "url": d.url, "models": list(d.models)} for d in rig.fleet.daemons],
    }))
    return path


@contextmanager
def routing_proxy(rig: Rig, tmp: Path, strategy: str = "mlxd",
                  timeout: float = 300) -> Iterator[tuple[str, Path]]:
    """``mlxd route --strategy S`` (LiteLLM's real proxy) over ``rig``: its URL and fleet file."""
    port = free_port()
    fleet = fleet_file(tmp, rig, port)
    log_path = tmp / "route.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "mlxd", "route", "--config", str(fleet), "--strategy", strategy],
            stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
            env={**os.environ, "PYTHONWARNINGS": "ignore"})
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"mlxd route exited:\n{log_path.read_text()[-3000:]}")
            try:
                if httpx.get(f"{url}/health/liveliness", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"mlxd route not ready after {timeout} s")
            time.sleep(0.5)
        yield url, fleet
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def run_asyncio(main: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """``asyncio.run(main())`` on a thread of its own: LiteLLM is asyncio, and a test process
    may have an event loop left running on its main thread (Playwright's sync API keeps one
    for the session's browser), where ``asyncio.run`` refuses to start."""
    result: list[T] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            result.append(asyncio.run(main()))
        except BaseException as e:  # re-raised on the test's thread
            errors.append(e)

    thread = threading.Thread(target=run, name="asyncio-test")
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return result[0]

