"""`mlxd serve`: read the config, check the bind address, run the daemon until a signal."""

from __future__ import annotations

import argparse
import logging
import logging.handlers
import signal
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import trio

from mlxd.cli.common import checked_api_key
from mlxd.config import Config, JournalConfig, Overrides, ServerConfig
from mlxd.config.keys import ResolvedKey, resolve_keys
from mlxd.config.origins import WILDCARDS
from mlxd.daemon import LOOPBACK, Daemon
from mlxd.engines import EngineFactory
from mlxd.errors import ConfigError, MlxdError

log = logging.getLogger("mlxd")


def _setup_logging(level: str, access_log: str = "-") -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    logging.getLogger("hypercorn.access").setLevel(logging.WARNING)
    # The access log (mlxd.http.access_log): its own lines, whatever --log-level says, on
    # stdout or in --access-log FILE, reopened when a log rotator moves it (newsyslog, logrotate).
    access = logging.getLogger("mlxd.access")
    handler: logging.Handler
    if access_log == "-":
        handler = logging.StreamHandler(sys.stdout)
    else:
        path = Path(access_log).expanduser()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            handler = logging.handlers.WatchedFileHandler(path, encoding="utf-8")
        except OSError as e:
            raise ConfigError(f"--access-log: cannot write {path}: {e.strerror or e}") from None
    handler.setFormatter(logging.Formatter("%(message)s"))
    access.handlers = [handler]
    access.setLevel(logging.INFO)
    access.propagate = False


def load_serve_config(args: argparse.Namespace) -> tuple[Config, Path | None, Overrides]:
    """The config of ``mlxd serve`` with the CLI overrides applied, and those overrides."""
    from mlxd.config import builtin_demo_config, load_config
    from mlxd.journal.reads import Measurements, journal_measurements

    if args.port is not None and not 0 <= args.port <= 65535:
        raise ConfigError(f"--port: must be between 0 and 65535 (got {args.port})")
    ollama_port = getattr(args, "ollama_port", None)
    if ollama_port is not None:
        if not 0 <= ollama_port <= 65535:
            raise ConfigError(f"--ollama-port: must be between 0 and 65535 (got {ollama_port})")
        if ollama_port == args.port != 0:
            raise ConfigError(f"--ollama-port: must differ from the main port ({args.port})")
    overrides = Overrides(
        host=args.host or None,
        port=args.port,
        journal_path=Path(args.journal).expanduser() if args.journal else None,
        ollama_port=ollama_port,
    )

    def measured(jc: JournalConfig) -> Measurements:
        return journal_measurements(replace(jc, path=overrides.journal_path or jc.path))

    if args.config:
        path = Path(args.config).expanduser()
        config = load_config(path, measured=measured, missing_ok=True)  # check-config is strict
    else:
        path = None
        config = builtin_demo_config(measured)
    return overrides.apply(config), path, overrides


def check_bind(server: ServerConfig, keys: Sequence[ResolvedKey], insecure: bool) -> None:
    if server.host not in LOOPBACK and not keys and not insecure:
        raise ConfigError(
            f"server.host: refusing to listen on {server.host} without an API key; set "
            f"{server.api_key_env}, configure server.keys or pass --insecure"
        )


def cmd_serve(args: argparse.Namespace, *, engines: EngineFactory | None = None) -> int:
    # SIGHUP reloads the config once the daemon runs; until then it must not kill the start
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    _setup_logging(args.log_level, args.access_log)
    config, path, overrides = load_serve_config(args)
    keys = resolve_keys(config.server)
    for key in keys:  # each must travel in a header; the message names the key, never its value
        checked_api_key(key.secret, f"the API key '{key.name}'")
    check_bind(config.server, keys, args.insecure)
    if config.server.host in WILDCARDS and not config.server.allowed_hosts:
        log.warning(
            "listening on every interface, but requests must name this server by a loopback "
            "name or a name in server.allowed_hosts (others get 421): list the names and "
            "addresses clients use (see docs/security.md)"
        )
    from mlxd.config.budget import log_memory_budget_report

    log_memory_budget_report(config, logger=log)  # budget findings and config warnings
    _log_blas()
    config.journal.path.parent.mkdir(parents=True, exist_ok=True)
    daemon = Daemon(
        config,
        config_path=path,
        overrides=overrides,
        engines=engines,
        keys=keys,
        log_format=args.log_format,
        ready_file=Path(args.ready_file) if args.ready_file else None,
    )
    from mlxd.engines.runtime.memory import limit_malloc_arenas

    limit_malloc_arenas()  # before any thread of the daemon's (see mlxd.engines.runtime.memory)
    try:
        trio.run(daemon.run)
    except BaseExceptionGroup as group:
        raise _first_cause(group, config.server) from None
    except OSError as e:
        log.error("cannot serve: %s", e)
        return 1
    return 0


def _log_blas() -> None:
    """Say once at start-up what MLX's CPU backend runs on (Linux; see :mod:`mlxd.blas`)."""
    from mlxd.blas import startup_report

    warning, sentence = startup_report()
    (log.warning if warning else log.info)("%s", sentence)


def _first_cause(group: BaseExceptionGroup[BaseException], server: ServerConfig) -> BaseException:
    """The error a user should see from a start-up failure inside the root nursery."""
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            return _first_cause(exc, server)
        if isinstance(exc, OSError):
            return MlxdError(f"cannot serve on {server.host}:{server.port}: {exc}")
        return exc
    return group
