"""Engine stops as the manager runs them: shielded, bounded, and abandoned only at shutdown.

A stop frees an engine's memory; a request that leaves (or a cancelled load)
must not cut it short, so it runs shielded. Two things end the wait early: the
stop timeout (the stop then counts as failed, and the core retries it later)
and :meth:`EngineStops.abandon_all`, when shutdown gives up at its hard limit.
"""

from __future__ import annotations

import logging

import trio

from mlxd.engines.base import Engine
from mlxd.errors import MlxdError

log = logging.getLogger("mlxd.residency.manager")


def describe(exc: BaseException) -> str:
    """A one-line description of an engine error for ``last_error``."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    if isinstance(exc, MlxdError):
        return exc.message
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class EngineStops:
    """Runs engine stops; see the module docstring."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        #: the shielded scopes of the stops in flight
        self._scopes: set[trio.CancelScope] = set()
        self._abandoned = False

    async def stop(self, model: str, engine: Engine) -> str | None:
        """Stop ``engine``; return why it failed (an error text), or None if it stopped."""
        with trio.CancelScope(shield=True) as cs:
            cs.deadline = trio.current_time() + self.timeout_s
            self._scopes.add(cs)
            try:
                await engine.stop()
            except Exception as e:
                log.warning("stopping %s failed: %s", model, describe(e))
                return describe(e)
            finally:
                self._scopes.discard(cs)
        if cs.cancelled_caught:
            if self._abandoned:
                return "stopping the engine was abandoned at shutdown"
            return f"stopping the engine took longer than {self.timeout_s:g} s"
        return None

    def abandon_all(self) -> None:
        """Stop waiting for every stop in flight (shutdown gave up)."""
        self._abandoned = True
        for scope in list(self._scopes):
            scope.cancel()
