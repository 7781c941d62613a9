"""``mlxd serve``: the daemon that wires the journal, the manager and the HTTP server.

One root nursery, started in order: the listening sockets (a port in use
fails the start before the journal is touched; connections wait in the
backlog until the HTTP server serves), the journal (recovery of the previous
run), the manager (then restore and preload), the HTTP server. SIGHUP
reloads the config as ``POST /admin/reload`` does (:mod:`mlxd.http.reload`).
The first SIGTERM/SIGINT starts a graceful shutdown: new requests get 503
``shutting_down``; running streams finish or end with an error event within
``server.shutdown_grace_s``; the manager unloads everything; the run row gets
``clean_stop = 1``; exit 0. A second signal exits at once (the next start
then recovers from the journal).

Shutdown has a hard limit, ``shutdown_grace_s + HARD_LIMIT_S`` after the
signal, whatever clients and engines do: the manager ends the leases still
open (their connections are closed) and gives up on engine stops
``MANAGER_LIMIT_S`` after the grace; the journal commits the run's last rows
and its end; hypercorn gets ``HTTP_GRACE_S``, then the connections still open
are closed; at the limit the writer is stopped. ``clean_stop = 1`` is written
only when the run is *whole*: every lease ended by its request or by
preemption before the limit, every model ``unloaded`` or ``failed``, and every
earlier row committed.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import socket
from collections.abc import Sequence
from pathlib import Path

import trio
from hypercorn.config import Config as HypercornConfig

from mlxd import __version__
from mlxd.config import Config, Overrides, ServerConfig
from mlxd.config.keys import DEFAULT_KEY_NAME, ResolvedKey
from mlxd.config.model import SCOPES
from mlxd.engines import DefaultEngines, EngineFactory
from mlxd.errors import JournalError, MlxdError
from mlxd.http import expect
from mlxd.http.access_log import LogFormat
from mlxd.http.app import create_app
from mlxd.http.auth import Auth
from mlxd.http.context import AppState
from mlxd.http.metrics import Metrics
from mlxd.http.reload import reload_config
from mlxd.http.server import Connections, listen, serve
from mlxd.journal.journal import Journal, RecoveryReport
from mlxd.residency.manager import Manager
from mlxd.residency.states import Reason
from mlxd.units import format_bytes

log = logging.getLogger("mlxd")

#: the whole shutdown ends this long after the grace, whatever clients and engines do
HARD_LIMIT_S = 5.0
#: the manager gives up on leases and engine stops this long after the grace
MANAGER_LIMIT_S = 2.5
#: hypercorn's graceful timeout once the manager has shut down (every lease has
#: ended by then); connections still open after it are closed
HTTP_GRACE_S = 1.0
#: at the end, the journal's writer gets this long to finish and exit
JOURNAL_CLOSE_S = 0.5
#: a journal writer that does not answer this long makes /health degraded ...
JOURNAL_STALL_S = 2.0
#: ... and this long, is killed and replaced (its unconfirmed rows are written again)
JOURNAL_KILL_S = 10.0

LOOPBACK = {"127.0.0.1", "::1", "localhost"}


class Daemon:
    """The whole daemon; ``await daemon.run()`` serves until :meth:`request_shutdown`."""

    def __init__(
        self,
        config: Config,
        *,
        config_path: Path | None = None,
        overrides: Overrides | None = None,
        engines: EngineFactory | None = None,
        api_key: str | None = None,
        keys: Sequence[ResolvedKey] = (),
        log_format: LogFormat = "logfmt",
        ready_file: Path | None = None,
        install_signal_handlers: bool = True,
    ) -> None:
        """``keys``: the API keys (:func:`mlxd.config.keys.resolve_keys`); ``api_key`` is a
        shorthand for one key named ``default`` with every scope."""
        self.config = config
        self.config_path = config_path
        self.overrides = overrides or Overrides()
        self.engines = engines or DefaultEngines()
        if api_key is not None:
            keys = (ResolvedKey(DEFAULT_KEY_NAME, api_key, frozenset(SCOPES)), *keys)
        self.auth = Auth(keys, scoped=bool(config.server.keys))
        self.log_format = log_format
        self.ready_file = ready_file
        self.install_signal_handlers = install_signal_handlers
        self.journal = Journal(
            config.journal.path,
            synchronous=config.journal.synchronous,
            flush_timeout=JOURNAL_CLOSE_S,
            stall_s=JOURNAL_STALL_S,
            kill_s=JOURNAL_KILL_S,
            retain_days=config.journal.retain_days,
            max_mb=config.journal.max_mb,
        )
        self.connections = Connections()
        self.manager: Manager | None = None
        self.state: AppState | None = None
        self.urls: list[str] = []
        self.recovery: RecoveryReport | None = None
        self._shutdown = trio.Event()
        self._reload_wanted = trio.Event()
        self._http_stop = trio.Event()
        self._http_done = trio.Event()

    def request_shutdown(self) -> None:
        self._shutdown.set()

    async def run(self, *, task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
        clean = False
        try:
            sockets = listen(hypercorn_config(self.config.server))
        except OSError as e:  # a port in use: before the journal is touched
            server = self.config.server
            if e.errno == errno.EADDRINUSE:
                raise MlxdError(
                    f"cannot serve: {server.host}:{server.port} is already in use (another mlxd, "
                    "or another server); stop it, or choose another port with --port or server.port"
                ) from None
            raise MlxdError(f"cannot serve on {server.host}:{server.port}: {e}") from None
        try:
            async with trio.open_nursery() as root:
                clean = await self._run(root, sockets, task_status)
        finally:
            for sock in sockets:  # if serving never began (serve closes them itself)
                sock.close()
        if clean:
            log.info("mlxd stopped cleanly")
        else:
            log.warning("mlxd stopped, but not cleanly (see above); the next start recovers")

    async def _run(
        self,
        root: trio.Nursery,
        sockets: list[socket.socket],
        task_status: trio.TaskStatus[list[str]],
    ) -> bool:
        """Start everything in ``root``, serve until shutdown, stop; True if the stop was clean."""
        if self.install_signal_handlers:
            await root.start(self._signals)
        import_soon = getattr(self.engines, "import_soon", None)
        if import_soon is not None:  # overlaps the writer process's start and the recovery
            import_soon(self.config.models)
        await root.start(self.journal.run)
        self.recovery = await self.journal.begin_run(
            os.getpid(), __version__, str(self.config_path) if self.config_path else None
        )
        self._log_recovery(self.recovery)
        measured = self.journal.latest_measurements()
        manager = Manager(
            self.config,
            self.engines,
            measured=measured,
            load_times=self.journal.latest_load_seconds(),
        )
        self.manager = manager
        journal = self.journal
        metrics = Metrics(manager, lambda: (journal.committed_seq, journal.commit_count))
        manager.subscribe(self.journal.record)
        manager.subscribe(metrics.on_event)
        run_engines = getattr(self.engines, "run", None)  # the owner of engine worker processes
        if run_engines is not None:  # (before the manager, whose loads start workers in it)
            await root.start(run_engines)
        await root.start(manager.run)
        warm = getattr(self.engines, "warm", None)  # the spare engine worker, if one will be needed
        if warm is not None:
            await warm(self.config.models)
        self.state = AppState(
            manager=manager,
            config=self.config,
            metrics=metrics,
            journal=self.journal,
            auth=self.auth,
            log_format=self.log_format,
            config_path=self.config_path,
            overrides=self.overrides,
            connections=self.connections,
        )
        # the load gate follows the journal's health, pushed the moment it changes
        self.journal.on_health(lambda: manager.set_load_gate(self._journal_gate()))
        manager.set_load_gate(self._journal_gate())
        root.start_soon(self._reloads, self.state)
        await self._fail_missing(manager)
        for name, done in self._restore(manager, self.recovery):
            root.start_soon(self._await_restore, name, done)
        self.urls = await root.start(self._serve_http, create_app(self.state), sockets)
        self._announce()
        task_status.started(self.urls)
        await self._shutdown.wait()
        clean = await self._stop(manager)
        root.cancel_scope.cancel()
        return clean

    async def _stop(self, manager: Manager) -> bool:
        """The graceful shutdown, within its hard limit; True if a clean stop was recorded.

        The run's record is complete once the manager has shut down (no lease
        can start after that), so it is written before the HTTP server closes
        its connections: a slow teardown of many clients cannot cost the clean stop.
        """
        assert self.state is not None
        grace = self.config.server.shutdown_grace_s
        t0 = trio.current_time()
        until = t0 + grace + HARD_LIMIT_S - JOURNAL_CLOSE_S
        log.info("shutting down: new requests get 503; running ones have %g s", grace)
        self.state.draining = True
        whole = await manager.shutdown(grace, limit_s=grace + MANAGER_LIMIT_S)
        committed = await self._flush_journal(until)
        clean = whole and committed and not self.journal.rejected
        recorded = False
        try:
            self.journal.end_run(clean=clean)
            recorded = await self._flush_journal(until)
        except JournalError as e:
            log.error("journal: cannot record the end of the run: %s", e.message)
        self.state.close_event_streams()  # after the flush: they send the last rows, then end
        self._http_stop.set()
        with trio.move_on_at(until):
            await self._http_done.wait()
        return recorded and clean

    async def _flush_journal(self, until: float) -> bool:
        """Wait (until ``until`` at most) for every journal row to commit; False if not."""
        with trio.move_on_at(until):
            try:
                await self.journal.wait_committed()
            except JournalError as e:
                log.error("journal: %s", e.message)
                return False
            return True
        log.error("journal: rows still unwritten at the shutdown limit (%s)",
                  self.journal.last_error)
        return False

    # -- parts -----------------------------------------------------------------------

    async def _signals(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
            task_status.started()
            async for signum in signals:
                if signum == signal.SIGHUP:
                    if self._shutdown.is_set():
                        log.info("received SIGHUP while shutting down: not reloading")
                    else:
                        log.info("received SIGHUP: reloading the config")
                        self._reload_wanted.set()
                elif not self._shutdown.is_set():
                    log.info("received %s: graceful shutdown (again to exit at once)",
                             signal.Signals(signum).name)
                    self._shutdown.set()
                else:
                    log.warning("second signal: exiting at once")
                    os._exit(1)

    async def _reloads(self, st: AppState) -> None:
        """Reload the config after each SIGHUP (as ``POST /admin/reload``); signals that come
        while a reload runs make one more reload after it."""
        while True:
            await self._reload_wanted.wait()
            self._reload_wanted = trio.Event()
            if self._shutdown.is_set():
                continue
            try:
                await reload_config(st)
            except MlxdError as e:  # a bad file: the daemon keeps its config
                log.error("SIGHUP: %s", e.message)

    async def _serve_http(
        self,
        app: object,
        sockets: list[socket.socket],
        task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        expect.install()  # 413 before "100 Continue" (mlxd.http.expect)
        try:
            await serve(
                app, hypercorn_config(self.config.server), self.connections,
                shutdown_trigger=self._http_stop.wait, sockets=sockets, task_status=task_status,
            )
        finally:
            self._http_done.set()

    def _journal_gate(self) -> str | None:
        if self.journal.healthy:
            return None
        return f"the journal cannot write ({self.journal.last_error})"

    def _restore(self, manager: Manager, recovery: RecoveryReport) -> list[tuple[str, trio.Event]]:
        """Preload, then restore the previous working set: pinned and preload first, within budget."""
        cfg = self.config
        wanted: list[tuple[str, Reason]] = []
        for m in cfg.models:
            if m.preload:
                wanted.append((m.name, Reason.PRELOAD))
        if cfg.manager.restore_on_start:
            for name in recovery.resident:
                if cfg.model(name) is None:
                    log.info("restore: '%s' was resident but is no longer configured; skipped", name)
                elif all(name != w for w, _ in wanted):
                    wanted.append((name, Reason.RESTORE))
        pinned_first = sorted(
            wanted, key=lambda nr: (not (cfg.model(nr[0]).pin or cfg.model(nr[0]).preload))  # type: ignore[union-attr]
        )
        room = manager.snapshot().budget_bytes
        assert self.state is not None
        started: list[tuple[str, trio.Event]] = []
        for name, reason in pinned_first:
            size = manager.model_snapshot(name).spec.size_bytes
            if size > room:
                log.info("%s: '%s' skipped, it does not fit in what is left of the budget",
                         reason.value, name)
                continue
            room -= size
            waiter = manager.request_residency(name, reason=reason)
            self.state.restoring.add(name)
            started.append((name, waiter.done))
        return started

    async def _fail_missing(self, manager: Manager) -> None:
        """Models whose local directory is missing (a volume not mounted yet) start ``failed``.

        One load attempt each (reason ``preload``), before anything else loads:
        the engine refuses at once, so the model shows as ``failed`` with that
        ``last_error``, and the next request to it tries again.
        """
        for m in self.config.models:
            if m.missing is not None:
                log.warning("'%s': %s; it is failed until the directory exists", m.name, m.missing)
                with contextlib.suppress(MlxdError):
                    await manager.load(m.name, reason=Reason.PRELOAD)

    async def _await_restore(self, name: str, done: trio.Event) -> None:
        """Readiness waits for restores; a failed one is logged by the manager."""
        await done.wait()
        assert self.state is not None
        self.state.restoring.discard(name)

    def _log_recovery(self, r: RecoveryReport) -> None:
        if r.previous_run_id is None:
            log.info("journal: first run (%s)", self.journal.path)
        elif r.crashed:
            log.warning(
                "journal: run %s did not stop cleanly; closed %d open lease(s) as interrupted, "
                "recovered %d model(s)", r.previous_run_id, len(r.interrupted_leases), len(r.recovered)
            )
        if r.resident:
            log.info("previously resident: %s", ", ".join(r.resident))

    def _announce(self) -> None:
        assert self.manager is not None
        log.info("mlxd %s listening on %s", __version__, ", ".join(self.urls))
        if self.config.server.ollama_port is not None and len(self.urls) > 1:
            log.info("Ollama clients: %s (the same API on a second port)", self.urls[-1])
        log.info("budget %s, policy %s; models: %s",
                 format_bytes((res := self.manager.snapshot()).budget_bytes), res.policy.strategy,
                 ", ".join(f"{m.name} ({m.engine})" for m in self.config.models))
        if self.ready_file is not None:
            self.ready_file.write_text(self.urls[0] + "\n")


def hypercorn_config(server: ServerConfig) -> HypercornConfig:
    """hypercorn's settings for ``server``: where to listen, timeouts, the body limit."""
    hc = HypercornConfig()
    host = server.host if ":" not in server.host else f"[{server.host}]"
    hc.bind = [f"{host}:{server.port}"]
    if server.ollama_port is not None:  # the same app, for clients that hard-code Ollama's port
        hc.bind.append(f"{host}:{server.ollama_port}")
    hc.graceful_timeout = HTTP_GRACE_S
    hc.accesslog = None
    hc.errorlog = logging.getLogger("hypercorn.error")
    hc.keep_alive_timeout = 5
    setattr(hc, expect.LIMIT_ATTR, server.max_body_bytes)
    return hc


# ---- the command ----------------------------------------------------------------------










