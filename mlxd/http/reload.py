"""Re-reading the config while the daemon runs: ``POST /admin/reload`` and SIGHUP do the same.

The file is read and checked off the event loop (a 10,000-model file takes
seconds), the command line's overrides (``--host``, ``--port``,
``--journal``) are applied to it as at start, then the manager adopts the
models and the manager settings: dormant models are added, removed or
replaced; a live model is not replaced (409). The ``server`` and ``journal``
sections keep running as they started; what the file changes there is
reported under ``restart_needed`` (``server.max_body_mb: 1.0 -> 8.0``: the
running value, then the one the next start with the same command line would
use). Reloads run one at a time.
"""

from __future__ import annotations

import logging
from dataclasses import fields, replace

import trio

from mlxd.config import Config
from mlxd.errors import ConfigError, InvalidRequest
from mlxd.http.bodies_admin import Reloaded
from mlxd.http.context import AppState

log = logging.getLogger("mlxd.http")


async def reload_config(st: AppState) -> Reloaded:
    """Re-read ``st``'s config file and apply it; the report ``POST /admin/reload`` answers.

    A file that does not load is a 400 :class:`~mlxd.errors.InvalidRequest`
    (``the config was not reloaded: <key path>: ...``); nothing changes then.
    """
    from mlxd.config import builtin_demo_config, load_config

    async with st.reload_lock:
        measured = st.manager.estimates.measured()
        path = st.config_path
        try:  # reading and checking a large file takes seconds: never on the event loop
            new = await trio.to_thread.run_sync(
                lambda: builtin_demo_config(measured) if path is None
                else load_config(path, measured=measured, missing_ok=True)
            )
        except ConfigError as e:
            raise InvalidRequest(f"the config was not reloaded: {e.message}") from None
        new = st.overrides.apply(new)
        restart = restart_needed(st.config, new)
        # the server and journal keep running as they started: report, and keep their settings
        new = replace(new, server=st.config.server, journal=st.config.journal)
        report = await st.manager.reload(new)
        st.config = new
        if st.journal is not None:
            await st.journal.wait_committed()
    log.info("config reloaded from %s: %s", path or "the built-in demo config", report)
    for change in restart:
        log.warning("config reload: %s: takes effect at the next start", change)
    return {"reloaded": True, "added": report["added"], "removed": report["removed"],
            "replaced": report["replaced"], "unchanged": report["unchanged"],
            "restart_needed": restart, "warnings": list(new.warnings)}


def restart_needed(running: Config, new: Config) -> list[str]:
    """The ``server`` and ``journal`` settings that differ (``server.port: 8080 -> 8081``)."""
    changes: list[str] = []
    for section in ("server", "journal"):
        before, after = getattr(running, section), getattr(new, section)
        for f in fields(before):
            a, b = getattr(before, f.name), getattr(after, f.name)
            if a != b:
                changes.append(f"{section}.{f.name}: {a} -> {b}")
    return changes
