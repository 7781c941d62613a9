"""What every route handler can reach: the manager, the journal, metrics, settings."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import trio
from quart import current_app

from mlxd.config import Config, Overrides
from mlxd.config.origins import BrowserRules
from mlxd.http import access_log
from mlxd.http.access_log import Entry, LogFormat
from mlxd.http.auth import Auth
from mlxd.http.metrics import Metrics
from mlxd.http.server import Connections
from mlxd.http.structured import SCHEMA_CHECKS_AT_ONCE
from mlxd.residency.manager import Manager

if TYPE_CHECKING:
    from mlxd.journal.journal import Journal


#: large request bodies read in child processes at once (:mod:`mlxd.http.openai_api`)
LARGE_BODY_READS_AT_ONCE = 2


@dataclass
class AppState:
    manager: Manager
    config: Config
    metrics: Metrics
    journal: Journal | None = None
    #: the API keys and their scopes (none: every route open)
    auth: Auth = field(default_factory=Auth)
    #: the access log's line format
    log_format: LogFormat = "logfmt"
    #: where /admin/reload re-reads the config from (None: the built-in demo config)
    config_path: Path | None = None
    #: what the command line set over the file (applied again to each reloaded file)
    overrides: Overrides = field(default_factory=Overrides)
    #: reloads (POST /admin/reload, SIGHUP) run one at a time
    reload_lock: trio.Lock = field(default_factory=trio.Lock)
    #: set on the first SIGTERM/SIGINT: new requests get 503 shutting_down
    draining: bool = False
    started_at: float = field(default_factory=time.time)
    #: restores and preloads still in flight at start-up
    restoring: set[str] = field(default_factory=set)
    #: set once the manager has shut down: event streams flush and end
    closing: bool = False
    #: the live waits of /admin/events streams, cancelled at shutdown
    event_waits: set[trio.CancelScope] = field(default_factory=set)
    #: the open HTTP connections (to close one whose lease the manager ended)
    connections: Connections = field(default_factory=Connections)
    #: the worker threads of meta-schema checks (:mod:`mlxd.http.structured`), this app's
    schema_checkers: trio.CapacityLimiter = field(
        default_factory=lambda: trio.CapacityLimiter(SCHEMA_CHECKS_AT_ONCE))
    #: the child processes reading large bodies at once (each holds a copy of its body)
    large_body_readers: trio.CapacityLimiter = field(
        default_factory=lambda: trio.CapacityLimiter(LARGE_BODY_READS_AT_ONCE))

    def __post_init__(self) -> None:
        self._write_access = access_log.writer(self.log_format)
        server = self.config.server
        #: Host and Origin rules (the server section does not change while it runs)
        self.browser = BrowserRules.of(server.host, server.allowed_hosts, server.allowed_origins)

    def request_ended(self, entry: Entry, seconds: float) -> None:
        """A request's response has ended: its access log line and per-client counters."""
        self._write_access(entry, seconds)
        if entry.client is not None:
            lease = entry.lease
            self.metrics.observe_client(
                entry.client,
                entry.status,
                lease.prompt_tokens if lease is not None else None,
                lease.completion_tokens if lease is not None else None,
            )

    def close_event_streams(self) -> None:
        self.closing = True
        for wait in list(self.event_waits):
            wait.cancel()


def state() -> AppState:
    st: AppState = current_app.extensions["mlxd"]
    return st
