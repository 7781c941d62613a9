"""How engines end: stops as the manager runs them (shielded, bounded, abandoned only
at shutdown), and deaths of their own (:class:`DeathWatch`).

A stop frees an engine's memory; a request that leaves (or a cancelled load)
must not cut it short, so it runs shielded. Two things end the wait early: the
stop timeout (the stop then counts as failed, and the core retries it later)
and :meth:`EngineStops.abandon_all`, when shutdown gives up at its hard limit.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import trio

from mlxd.engines.base import Engine
from mlxd.errors import describe_error as describe

log = logging.getLogger("mlxd.residency.manager")


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


class DeathWatch:
    """Watches each resident engine for a death of its own (its worker process killed).

    One task per resident model, in the manager's nursery, waits on
    :meth:`Engine.wait_died` and hands the error to ``on_death``; :meth:`forget`
    ends it first when the manager stops the engine (a stopping engine is not dying).
    """

    def __init__(self, on_death: Callable[[str, Engine, str], Awaitable[None]]) -> None:
        self._on_death = on_death
        self._scopes: dict[str, trio.CancelScope] = {}

    def watch(self, nursery: trio.Nursery, model: str, engine: Engine) -> None:
        self.forget(model)
        scope = self._scopes[model] = trio.CancelScope()
        nursery.start_soon(self._watch, model, engine, scope)

    def forget(self, model: str) -> None:
        scope = self._scopes.pop(model, None)
        if scope is not None:
            scope.cancel()

    async def _watch(self, model: str, engine: Engine, scope: trio.CancelScope) -> None:
        with scope:
            error = await engine.wait_died()
        if scope.cancelled_caught:
            return
        if self._scopes.get(model) is scope:
            del self._scopes[model]
        await self._on_death(model, engine, error)
