"""``mlxd route``: LiteLLM's own proxy server, with mlxd's strategy, in front of the fleet.

:func:`proxy_config` writes the LiteLLM proxy config: one deployment per daemon
and model (``openai/<model>`` at ``<daemon>/v1`` with the daemon's key from its
variable), the retries of the fleet file, and no background health checks (a
LiteLLM health check sends a real completion, which would load models).
:func:`serve` runs LiteLLM's proxy app (``litellm.proxy.proxy_server.app``)
under uvicorn, as LiteLLM's own CLI does, and once its start-up has built the
router registers :class:`~mlxd.fleet.strategy.MlxdRouting` on it
(``register_plugin``), its :class:`~mlxd.fleet.strategy.Feedback` callback, and
the task that keeps the daemons' status fresh. The proxy's ``GET /health``
(which in LiteLLM runs a completion on every deployment) answers instead with
what the watch knows of each daemon, from their ``/admin/status``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import yaml

from mlxd.errors import ConfigError
from mlxd.fleet.config import Fleet

#: LiteLLM's strategies the bench compares with mlxd's ("mlxd": the custom strategy)
STRATEGIES = ("mlxd", "simple-shuffle", "least-busy")


def deployments(fleet: Fleet) -> list[dict[str, Any]]:
    """One LiteLLM deployment per daemon and model it may serve."""
    out = []
    for d in fleet.daemons:
        key = f"os.environ/{d.api_key_env}" if d.api_key_env and d.api_key() else "none"
        for model in d.models:
            out.append({
                "model_name": model,
                "litellm_params": {"model": f"openai/{model}", "api_base": f"{d.url}/v1",
                                   "api_key": key, "timeout": fleet.proxy.timeout_s},
                "model_info": {"id": f"{d.name}/{model}"},
            })
    return out


def router_settings(fleet: Fleet, strategy: str) -> dict[str, Any]:
    """The LiteLLM router settings of ``strategy`` (mlxd's keeps its own view of failures,
    so LiteLLM's cooldowns are off for it; LiteLLM's strategies keep theirs)."""
    settings: dict[str, Any] = {
        "routing_strategy": "simple-shuffle" if strategy == "mlxd" else strategy,
        "num_retries": fleet.proxy.num_retries,
        "timeout": fleet.proxy.timeout_s,
    }
    if strategy == "mlxd":
        settings["disable_cooldowns"] = True
    return settings


def proxy_config(fleet: Fleet, strategy: str = "mlxd", *, host: str = "127.0.0.1") -> dict[str, Any]:
    """LiteLLM's proxy config. Without a master key the proxy is open, which LiteLLM allows
    only when asked: mlxd asks for it on a loopback address only (see :func:`check_exposure`)."""
    general: dict[str, Any] = {"background_health_checks": False}
    if fleet.proxy.master_key_env and os.environ.get(fleet.proxy.master_key_env):
        general["master_key"] = f"os.environ/{fleet.proxy.master_key_env}"
    else:
        check_exposure(fleet, host)
        general["dangerously_permit_weak_or_unset_master_key"] = True
    return {
        "model_list": deployments(fleet),
        "router_settings": router_settings(fleet, strategy),
        "general_settings": general,
        "litellm_settings": {"drop_params": True},
    }


def check_exposure(fleet: Fleet, host: str) -> None:
    """A proxy without a master key listens on loopback only (a ConfigError otherwise)."""
    if host in ("127.0.0.1", "::1", "localhost"):
        return
    if not fleet.proxy.master_key_env:
        raise ConfigError(f"proxy.master_key_env: required to listen on {host} (not loopback): "
                          "name a variable holding the key clients must send")
    raise ConfigError(f"proxy.master_key_env: the variable {fleet.proxy.master_key_env} is not set "
                      f"(required to listen on {host}, which is not loopback)")


def serve(fleet: Fleet, *, host: str, port: int, strategy: str = "mlxd",
          log_level: str = "warning") -> None:
    """Run LiteLLM's proxy with ``strategy`` until interrupted (blocks)."""
    with tempfile.TemporaryDirectory(prefix="mlxd-route-") as tmp:
        path = Path(tmp) / "litellm.yaml"
        path.write_text(yaml.safe_dump(proxy_config(fleet, strategy, host=host), sort_keys=False))
        os.environ["CONFIG_FILE_PATH"] = str(path)
        import litellm.proxy.proxy_server as proxy_server
        import uvicorn

        import mlxd.fleet.strategy  # noqa: F401 - sets LiteLLM's environment before its import

        app = proxy_server.app
        if strategy == "mlxd":
            _with_mlxd_strategy(app, proxy_server, fleet)
        uvicorn.run(app, host=host, port=port, log_level=log_level, lifespan="on")


def _with_mlxd_strategy(app: Any, proxy_server: Any, fleet: Fleet) -> None:
    """Register mlxd's strategy once LiteLLM's start-up has built its router."""
    import litellm
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from mlxd.fleet.strategy import MlxdRouting
    from mlxd.fleet.watch import Watch

    started = app.router.lifespan_context
    holder: dict[str, Any] = {}

    @contextlib.asynccontextmanager
    async def lifespan(a: Any) -> AsyncIterator[Any]:
        async with started(a) as state:
            router = proxy_server.llm_router
            if router is None:
                raise RuntimeError("LiteLLM's proxy started without a router (no model_list?)")
            watch = Watch(fleet)
            routing = MlxdRouting(router, watch)
            router.register_plugin(routing)
            litellm.callbacks.append(routing.feedback)
            holder["watch"] = watch
            task = asyncio.create_task(watch.run())
            try:
                yield state
            finally:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                await watch.aclose()

    async def health(_request: Any) -> JSONResponse:
        """The daemons as the router sees them (never a completion: that would load models)."""
        watch = holder.get("watch")
        daemons = watch.status() if watch is not None else {}
        up = sum(1 for d in daemons.values() if d["up"])
        return JSONResponse({"healthy_count": up, "unhealthy_count": len(daemons) - up,
                             "daemons": daemons}, status_code=200 if up else 503)

    app.router.lifespan_context = lifespan
    app.router.routes.insert(0, Route("/health", health, methods=["GET"]))
