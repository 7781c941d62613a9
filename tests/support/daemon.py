"""Run the real daemon for tests: in-process on loopback, or as a `mlxd serve` subprocess.

In-process (:func:`serving`): the real journal, manager and hypercorn on
127.0.0.1 port 0 inside the test's Trio run; it shuts down by itself when the
block ends. Subprocess (:class:`DaemonProcess`): the real CLI, for signals,
kills and exit codes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import trio
import yaml

from mlxd.config import Config, JournalConfig, ServerConfig
from mlxd.config.keys import ResolvedKey
from mlxd.daemon import Daemon
from mlxd.engines import DefaultEngines, EngineFactory

REPO = Path(__file__).resolve().parents[2]
MLXD = [sys.executable, "-m", "mlxd"]


@dataclass
class Served:
    url: str
    daemon: Daemon
    closers: list[Any] = field(default_factory=list)

    def on_close(self, fn: Any) -> None:
        """Call ``fn`` (e.g. a client's close) before the daemon shuts down."""
        self.closers.append(fn)

    @property
    def manager(self) -> Any:
        return self.daemon.manager

    @property
    def journal(self) -> Any:
        return self.daemon.journal

    async def until(self, predicate: Any) -> None:
        """Wait until ``predicate()`` holds, re-checking at every manager event (no polling).

        Callers bound it with ``trio.fail_after``.
        """
        changed = trio.Event()

        def wake(_event: object) -> None:
            changed.set()

        self.manager.subscribe(wake)
        while not predicate():
            await changed.wait()
            changed = trio.Event()

    def client(self, **kw: Any) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, timeout=kw.pop("timeout", 30), **kw)


def local_config(config: Config, tmp: Path, **server: Any) -> Config:
    """``config`` bound to 127.0.0.1 port 0 with its journal and its prompt cache disk tier in
    ``tmp`` (a test's daemon never reads another test's entries)."""
    return replace(
        config,
        server=replace(config.server or ServerConfig(), host="127.0.0.1", port=0, **server),
        journal=JournalConfig(path=tmp / "journal.db", synchronous="normal"),
    ).with_prompt_cache_disk(tmp / "prompt-cache")


@asynccontextmanager
async def serving(
    config: Config,
    tmp: Path,
    *,
    engines: EngineFactory | None = None,
    api_key: str | None = None,
    keys: Sequence[ResolvedKey] = (),
    config_path: Path | None = None,
    **server: Any,
) -> AsyncIterator[Served]:
    daemon = Daemon(
        local_config(config, tmp, **server),
        config_path=config_path,
        engines=engines or DefaultEngines(),
        api_key=api_key,
        keys=keys,
        install_signal_handlers=False,
    )
    async with trio.open_nursery() as nursery:
        urls = await nursery.start(daemon.run)
        served = Served(urls[0], daemon)
        try:
            yield served
        finally:
            for close in served.closers:
                close()
            daemon.request_shutdown()


def write_config(path: Path, raw: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


class DaemonProcess:
    """``mlxd serve`` as a child process on 127.0.0.1 port 0."""

    def __init__(self, config_path: Path, state_dir: Path, *, env: dict[str, str] | None = None,
                 args: tuple[str, ...] = (), wrapper: tuple[str, ...] = ()) -> None:
        """``wrapper``: a command to run ``mlxd serve`` under (e.g. ``setpriv ... --``)."""
        self.config_path = config_path
        self.state_dir = state_dir
        self.ready_file = state_dir / f"ready-{time.monotonic_ns()}"
        self.log_path = state_dir / "daemon.log"
        self.env = {**os.environ, "MLXD_STATE_DIR": str(state_dir), **(env or {})}
        self.args = args
        self.wrapper = wrapper
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""

    def start(self, timeout: float = 60.0) -> str:
        self.ready_file.unlink(missing_ok=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the process
        self.proc = subprocess.Popen(
            [*self.wrapper, *MLXD, "serve", "--config", str(self.config_path), "--port", "0",
             "--ready-file", str(self.ready_file), *self.args],
            stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=REPO,
        )
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.ready_file.exists() and self.ready_file.read_text().strip():
                self.url = self.ready_file.read_text().strip()
                return self.url
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlxd serve exited with {self.proc.returncode}:\n{self.log()}")
            time.sleep(0.02)
        self.kill()
        raise RuntimeError(f"mlxd serve not ready after {timeout} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def terminate(self, timeout: float = 30.0) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def __enter__(self) -> DaemonProcess:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.terminate(30)
            except subprocess.TimeoutExpired:
                self.kill()


def fake_models_config(sizes_gb: dict[str, float], budget_gb: float, *, strategy: str = "wait_then_fail",
                       load_seconds: float = 0.2, tokens_per_second: float = 200.0,
                       **manager: Any) -> dict[str, Any]:
    """A YAML-able config of fake models (for subprocess daemons)."""
    return {
        "manager": {
            "memory_budget_gb": budget_gb,
            "contention_policy": {"strategy": strategy, **manager.pop("policy", {})},
            **manager,
        },
        "models": [
            {"name": name, "engine": "fake", "estimated_memory_gb": gb,
             "fake": {"load_seconds": load_seconds, "tokens_per_second": tokens_per_second}}
            for name, gb in sizes_gb.items()
        ],
    }
