"""mlxd's residency-aware routing strategy, through LiteLLM's own custom-strategy hook.

``router.register_plugin(strategy)`` (``set_custom_routing_strategy`` in older
releases) makes :class:`MlxdRouting` pick every deployment of the router
(one deployment per daemon and model, its ``api_base`` the daemon's ``/v1``).
For a request for model X it asks the :class:`~mlxd.fleet.watch.Watch` for
each daemon's facts and :func:`~mlxd.fleet.facts.rank` for the best daemon
(X resident and least queued; else joining X's load; else where loading X
evicts the least). A pick of a daemon where X is resident carries
``X-Mlxd-Require-Resident: 1``, so a daemon that lost X since its last status
answers 503 ``model_not_resident`` before any byte instead of loading it.

LiteLLM retries a failed attempt (``num_retries``) and calls the strategy
again for the same request; the attempts of one request are kept in its
``metadata`` (:data:`TRIED`), so a retry goes to the next daemon. What an
attempt taught is fed back by :class:`Feedback` (a LiteLLM callback):
``model_not_resident`` corrects the cached facts; ``model_capacity`` and
``capacity_timeout`` keep that daemon out of that model's picks for the
``Retry-After`` it sent (when every daemon is held off, the pick waits for
the first to be allowed again); a daemon that cannot be reached is skipped
until its status answers again. A response that has started is never
retried elsewhere: mlxd refuses before the first byte, and LiteLLM does not
retry a stream once it is under way.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

# Before LiteLLM is imported (it reads them then): its bundled model prices, not a fetch over
# the network; and no back-off sleep before a retry, which goes to another daemon (a
# Retry-After a daemon sends is still honoured, by LiteLLM and by the strategy's holds).
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("INITIAL_RETRY_DELAY", "0")
os.environ.setdefault("JITTER", "0")

from litellm.exceptions import (
    APIConnectionError,
    InternalServerError,
    ServiceUnavailableError,
    Timeout,
)
from litellm.integrations.custom_logger import CustomLogger
from litellm.types.router import CustomRoutingStrategyBase

from mlxd.fleet.facts import Choice, DaemonFacts, rank, without_model
from mlxd.fleet.watch import Watch

REQUIRE_RESIDENT = "X-Mlxd-Require-Resident"
#: where a request's attempts are kept across LiteLLM's retries (in its metadata)
TRIED = "mlxd_tried"
#: a pick waits at most this long for a daemon held off by Retry-After
MAX_HOLD_S = 30.0
#: mlxd's refusals that send the next attempt elsewhere
REFUSALS = ("model_not_resident", "model_capacity", "capacity_timeout")


def daemon_url(api_base: str) -> str:
    """A deployment's daemon: its ``api_base`` without the ``/v1`` suffix or a trailing slash."""
    return api_base.rstrip("/").removesuffix("/v1")


class MlxdRouting(CustomRoutingStrategyBase):
    """Picks the daemon for each request; see the module doc."""

    def __init__(self, router: Any, watch: Watch) -> None:
        self.router = router
        self.watch = watch
        self._by_url = {d.url: d.name for d in watch.fleet.daemons}
        #: (daemon, model) -> monotonic time before which it gets no pick (Retry-After)
        self.held: dict[tuple[str, str], float] = {}
        #: deployment id -> (daemon, model) of every deployment picked
        self._picks: dict[str, tuple[str, str]] = {}
        self.feedback = Feedback(self)

    # -- LiteLLM's hook ----------------------------------------------------------------------

    # LiteLLM's base class declares None; the router takes the deployment a strategy returns
    async def async_get_available_deployment(  # type: ignore[override]
        self,
        model: str,
        messages: list[dict[str, str]] | None = None,
        input: str | list[object] | None = None,
        specific_deployment: bool | None = False,
        request_kwargs: dict[str, object] | None = None,
    ) -> dict[str, Any]:
        facts = await self.watch.fresh()
        tried = _tried(request_kwargs)
        while True:
            choice, deployment, wait = self._choose(model, facts, tried)
            if choice is not None or wait is None:
                break
            await asyncio.sleep(wait)  # every daemon for it is held off: honour Retry-After
            facts = await self.watch.fresh()
        return self._picked(model, choice, deployment, tried, request_kwargs)

    def get_available_deployment(  # type: ignore[override]
        self,
        model: str,
        messages: list[dict[str, str]] | None = None,
        input: str | list[object] | None = None,
        specific_deployment: bool | None = False,
        request_kwargs: dict[str, object] | None = None,
    ) -> dict[str, Any]:
        """The synchronous pick (``router.completion``): from the cached facts, never waiting."""
        tried = _tried(request_kwargs)
        choice, deployment, _wait = self._choose(model, self.watch.known(), tried)
        return self._picked(model, choice, deployment, tried, request_kwargs)

    # -- the choice --------------------------------------------------------------------------

    def _deployments(self, model: str) -> dict[str, dict[str, Any]]:
        """Daemon name -> the model's deployment on it."""
        out = {}
        for d in self.router.registry().deployments(model) or []:
            api_base = (d.get("litellm_params") or {}).get("api_base") or ""
            name = self._by_url.get(daemon_url(str(api_base)))
            if name is not None:
                out[name] = d
        return out

    def _choose(
        self, model: str, facts: Sequence[DaemonFacts], tried: list[str]
    ) -> tuple[Choice | None, dict[str, Any] | None, float | None]:
        """The best daemon not yet tried by this request and not held off; else how long to wait
        for one to be allowed again (None: there is none to wait for)."""
        deployments = self._deployments(model)
        # a daemon that refused this request's resident attempt does not hold the model (the
        # feedback may not have said so yet): it may still be the best place to load it
        mine = [without_model(f, model) if _key(f.name, True) in tried else f
                for f in facts if f.name in deployments]
        ranked = rank(model, mine)
        now = time.monotonic()
        fresh = [c for c in ranked if _key(c.daemon, c.resident) not in tried] or ranked
        for c in fresh:
            if self.held.get((c.daemon, model), 0.0) <= now:
                return c, deployments[c.daemon], None
        holds = [self.held[(c.daemon, model)] - now for c in fresh]
        return None, None, min(min(holds), MAX_HOLD_S) if holds else None

    def _picked(
        self,
        model: str,
        choice: Choice | None,
        deployment: dict[str, Any] | None,
        tried: list[str],
        request_kwargs: dict[str, object] | None,
    ) -> dict[str, Any]:
        if choice is None or deployment is None:
            raise ServiceUnavailableError(
                message=f"no mlxd daemon that serves '{model}' answers its status now",
                llm_provider="openai",
                model=model,
            )
        tried.append(_key(choice.daemon, choice.resident))
        self.watch.routed(choice.daemon, model, resident=choice.resident)
        deployment_id = (deployment.get("model_info") or {}).get("id")
        if deployment_id:
            self._picks[str(deployment_id)] = (choice.daemon, model)
        # the header goes with the deployment's params, and with the request's own extra_headers
        # when it has some (LiteLLM sends the request's in place of the deployment's)
        params = dict(deployment.get("litellm_params") or {})
        params["extra_headers"] = _with_header(params.get("extra_headers"), choice.resident)
        if request_kwargs is not None and isinstance(request_kwargs.get("extra_headers"), dict):
            request_kwargs["extra_headers"] = _with_header(request_kwargs["extra_headers"], choice.resident)
        return {**deployment, "litellm_params": params}

    def attempt_of(self, kwargs: Mapping[str, Any]) -> tuple[str, str] | None:
        """The daemon and model an attempt went to, from a LiteLLM callback's kwargs."""
        params = kwargs.get("litellm_params") or {}
        deployment_id = kwargs.get("model_id") or (params.get("model_info") or {}).get("id")
        return self._picks.get(str(deployment_id)) if deployment_id else None


def _with_header(headers: object, resident: bool) -> dict[str, object]:
    """``headers`` with X-Mlxd-Require-Resident: 1 when ``resident``, without it otherwise."""
    out = {k: v for k, v in dict(headers or {}).items()  # type: ignore[call-overload]
           if str(k).lower() != REQUIRE_RESIDENT.lower()}
    if resident:
        out[REQUIRE_RESIDENT] = "1"
    return out


def _key(daemon: str, resident: bool) -> str:
    """An attempt as :data:`TRIED` keeps it: a refused resident attempt does not rule out loading there."""
    return f"{daemon} resident" if resident else daemon


def _tried(request_kwargs: dict[str, object] | None) -> list[str]:
    """The daemons this request was already sent to (kept in its metadata across retries)."""
    if request_kwargs is None:
        return []
    metadata = request_kwargs.setdefault("metadata", {})
    if not isinstance(metadata, dict):
        return []
    tried = metadata.setdefault(TRIED, [])
    return tried if isinstance(tried, list) else []


def refusal_of(exc: BaseException | None) -> tuple[str | None, float | None]:
    """mlxd's error code in a failed attempt (one of :data:`REFUSALS`, else None) and its Retry-After."""
    if exc is None:
        return None, None
    response = getattr(exc, "response", None)
    try:  # the daemon's reply, which LiteLLM's exception keeps; its message alone lacks the code
        error = json.loads(getattr(response, "text", "") or "{}").get("error") or {}
        code = error.get("code") if isinstance(error, dict) else None
    except (ValueError, AttributeError, TypeError):
        code = None
    if code not in REFUSALS:
        text = str(exc)
        code = next((c for c in REFUSALS if c in text), None)
    headers = getattr(response, "headers", None) or {}
    raw = headers.get("retry-after")
    try:
        retry_after = float(raw) if raw else None
    except (TypeError, ValueError):
        retry_after = None
    return code, retry_after


def _unreachable(exc: BaseException | None) -> bool:
    """A failure that means the daemon is not there (refused, reset, timed out), not a refusal."""
    return isinstance(exc, APIConnectionError | Timeout) or (
        isinstance(exc, InternalServerError) and getattr(exc, "status_code", 500) >= 500
        and "Connection" in str(exc)
    )


class Feedback(CustomLogger):
    """What each failed attempt teaches the strategy (registered in ``litellm.callbacks``)."""

    def __init__(self, routing: MlxdRouting) -> None:
        super().__init__()
        self.routing = routing
        #: refusals seen by code, and daemons lost (tests and the bench read them)
        self.refusals: dict[str, int] = {}
        self.lost = 0

    async def async_log_failure_event(
        self, kwargs: dict[str, Any], response_obj: Any, start_time: Any, end_time: Any
    ) -> None:
        self.learn(kwargs)

    def log_failure_event(self, kwargs: dict[str, Any], response_obj: Any, start_time: Any,
                          end_time: Any) -> None:
        self.learn(kwargs)

    def learn(self, kwargs: Mapping[str, Any]) -> None:
        attempt = self.routing.attempt_of(kwargs)
        if attempt is None:
            return
        daemon, model = attempt
        exc = kwargs.get("exception")
        code, retry_after = refusal_of(exc)
        if code is not None:
            self.refusals[code] = self.refusals.get(code, 0) + 1
        if code == "model_not_resident":
            self.routing.watch.not_resident(daemon, model)
        elif code in ("model_capacity", "capacity_timeout"):
            self.routing.held[(daemon, model)] = time.monotonic() + (retry_after or 1.0)
        elif _unreachable(exc):
            self.lost += 1
            self.routing.watch.lost(daemon, f"{type(exc).__name__}: {exc}"[:200])
