"""Each daemon's routing facts, cached at most a second and refreshed in the background (asyncio).

:class:`Watch` polls every daemon's ``GET /admin/status`` (which never loads
anything) every :data:`EVERY_S` from :meth:`Watch.run`, a task owned by whoever
runs the router (``mlxd route``'s proxy, a test, the bench). A choice that finds
a daemon's facts older than :data:`MAX_AGE_S` fetches them first, so they are
never staler than that even without the task.

A daemon that does not answer (refused, timed out, an error status) is
``down``: choices skip it, and only the background poll asks it again, until
it answers. A request the router sends is written into the cached facts at once
(:func:`~mlxd.fleet.facts.with_request`) and stays written over fetched facts
until they can show it (:func:`_pending`), so a burst of requests agrees on
where a model goes before any status shows it.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import httpx

from mlxd.fleet.config import Daemon, Fleet
from mlxd.fleet.facts import DaemonFacts, with_request, without_model

#: background refresh period of every daemon's status
EVERY_S = 0.25
#: a choice never uses facts older than this (it fetches them first)
MAX_AGE_S = 1.0
#: a status fetch that takes longer marks the daemon down
FETCH_TIMEOUT_S = 1.0
#: how long after a pick its request may still be on its way to the daemon (LiteLLM's own
#: work comes between the pick and the request): a fetch sent earlier may not count it
DISPATCH_S = 0.5
#: a load the router asked for is assumed under way this long even if no status shows it yet
LOAD_TTL_S = 5.0


@dataclass
class _Seen:
    """What is known of one daemon."""

    daemon: Daemon
    facts: DaemonFacts | None = None
    fetched_at: float = -1e9  # when the last fetch (answered or not) was sent
    up: bool = False
    error: str | None = "not asked yet"
    #: requests routed here and not yet in fetched facts: (sent at, model, resident)
    routed: list[tuple[float, str, bool]] = field(default_factory=list)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


def _pending(routed: tuple[float, str, bool], facts: DaemonFacts, sent: float) -> bool:
    """Whether a routed request may be missing from ``facts`` (fetched at ``sent``): a request
    for a resident model until fetches sent after it got there; a load until the facts show it
    (or for LOAD_TTL_S at most: it may have failed)."""
    at, model, resident = routed
    m = facts.models.get(model)
    if resident or (m is not None and m.state != "unloaded" and m.state != "failed"):
        return sent < at + DISPATCH_S
    return sent < at + LOAD_TTL_S


class Watch:
    """The fleet's facts, fresh within :data:`MAX_AGE_S`; see the module doc."""

    def __init__(self, fleet: Fleet, *, client: httpx.AsyncClient | None = None) -> None:
        self.fleet = fleet
        self._seen = {d.name: _Seen(d) for d in fleet.daemons}
        self._client = client or httpx.AsyncClient(timeout=FETCH_TIMEOUT_S)
        #: status fetches sent (tests and the bench read it)
        self.fetches = 0

    async def aclose(self) -> None:
        await self._client.aclose()

    async def run(self, *, every_s: float = EVERY_S) -> None:
        """Refresh every daemon's facts every ``every_s`` until cancelled."""
        while True:
            await asyncio.gather(*(self._refresh(s) for s in self._seen.values()))
            await asyncio.sleep(every_s)

    async def _refresh(self, seen: _Seen) -> None:
        async with seen.lock:
            sent = time.monotonic()
            seen.fetched_at = sent
            self.fetches += 1
            try:
                r = await self._client.get(f"{seen.daemon.url}/admin/status",
                                           headers=seen.daemon.headers(), timeout=FETCH_TIMEOUT_S)
                r.raise_for_status()
                facts = DaemonFacts.from_status(seen.daemon.name, r.json())
            except (httpx.HTTPError, ValueError) as e:
                seen.up, seen.error = False, f"{type(e).__name__}: {e}"
                return
            seen.routed = [r for r in seen.routed if _pending(r, facts, sent)]
            for _t, model, resident in seen.routed:
                facts = with_request(facts, model, resident=resident)
            seen.facts, seen.up, seen.error = facts, True, None

    async def fresh(self) -> list[DaemonFacts]:
        """The facts of every daemon that answers, in fleet order, none older than MAX_AGE_S."""
        now = time.monotonic()
        # a daemon that does not answer is asked again by the background poll (run), never
        # while a pick waits, unless it was never asked at all
        stale = [s for s in self._seen.values()
                 if (s.up and now - s.fetched_at > MAX_AGE_S) or s.fetched_at < 0]
        if stale:
            await asyncio.gather(*(self._refresh_if_stale(s) for s in stale))
        return self.known()

    async def _refresh_if_stale(self, seen: _Seen) -> None:
        if seen.lock.locked():  # a fetch is under way: wait for it rather than send another
            async with seen.lock:
                return
        await self._refresh(seen)

    def known(self) -> list[DaemonFacts]:
        """The cached facts of every daemon that answers, as they are (no fetch)."""
        return [s.facts for s in self._seen.values() if s.up and s.facts is not None]

    def routed(self, daemon: str, model: str, *, resident: bool) -> None:
        """A request for ``model`` went to ``daemon`` (resident: with X-Mlxd-Require-Resident)."""
        seen = self._seen[daemon]
        seen.routed.append((time.monotonic(), model, resident))
        if seen.facts is not None:
            seen.facts = with_request(seen.facts, model, resident=resident)

    def not_resident(self, daemon: str, model: str) -> None:
        """``daemon`` answered ``model_not_resident``: it does not hold ``model`` after all."""
        seen = self._seen[daemon]
        seen.routed = [r for r in seen.routed if r[1] != model]
        if seen.facts is not None:
            seen.facts = without_model(seen.facts, model)

    def lost(self, daemon: str, error: str) -> None:
        """A request to ``daemon`` could not reach it: skip it until it answers a status poll."""
        seen = self._seen[daemon]
        seen.up, seen.error = False, error

    def status(self) -> dict[str, dict[str, object]]:
        """Each daemon's view for ``/health`` of the proxy: up, last error, its models' states."""
        return {
            name: {
                "up": s.up,
                "error": s.error,
                "models": {m: f.state for m, f in s.facts.models.items()
                           if m in s.daemon.models} if s.facts is not None else {},
                "free_bytes": s.facts.free_bytes if s.facts is not None else None,
            }
            for name, s in self._seen.items()
        }
