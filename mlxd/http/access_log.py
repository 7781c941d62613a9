"""The access log: one line per HTTP request, written when its response has ended.

:class:`AccessLog` wraps the ASGI app, outermost, so a line is written when
the whole response is sent, a stream included (or when the client left):
``time`` (when the request arrived, UTC), ``method``, ``route`` (the matched
route pattern, ``-`` if none), ``path``, ``model``, ``status``,
``duration_ms``, ``ttft_ms`` (arrival to the first token handed to the
response), ``queue_ms`` (arrival to the engine taking the generation off its
queue: reading and checking the request, its prompt's tokens, waiting for the
model, a lease and a place in the batch), ``lease``
(its id), ``request_id`` (the client's ``X-Request-Id``, or the one mlxd
made and sent back), ``outcome`` (the lease's), ``client`` (the API key's
name), ``prompt_tokens`` and ``completion_tokens``. Fields a request does not
have are left out.

Routes fill in what they know through :func:`note` (the model, the lease);
the auth guard sets the route and the client. The entry of the request in
flight lives in a context variable set before the app runs, which the
request's tasks inherit, so no route passes it around.

Formats: ``logfmt`` (default; values quoted when they need it) or ``json``
(``mlxd serve --log-format json``), to the ``mlxd.access`` logger, which
``mlxd serve`` sends to stdout (the daemon's own log goes to stderr), where
launchd's ``StandardOutPath`` and systemd's journal pick it up.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

from mlxd.residency.lease import Lease

log = logging.getLogger("mlxd.access")

LogFormat = Literal["logfmt", "json"]
FORMATS: tuple[LogFormat, ...] = ("logfmt", "json")


@dataclass
class Entry:
    """What is known about one request so far."""

    method: str
    path: str
    at: float
    started: float
    #: ``time.monotonic()`` at arrival, the clock of the engines' timestamps
    arrived: float = 0.0
    #: ``time.monotonic()`` when the first token reached the response, and when the engine
    #: took the generation off its queue (mlxd.engines.base.Finished.started_at)
    first_token: float | None = None
    engine_started: float | None = None
    route: str = "-"
    model: str | None = None
    status: int | None = None
    client: str | None = None
    lease: Lease | None = None

    def fields(self, duration_s: float) -> dict[str, Any]:
        """The line's fields in order; absent ones left out."""
        lease = self.lease
        out: dict[str, Any] = {
            "time": datetime.fromtimestamp(self.at, UTC).isoformat(timespec="milliseconds")
            .replace("+00:00", "Z"),
            "method": self.method,
            "route": self.route,
            "path": self.path,
            "model": self.model or (lease.model if lease is not None else None),
            "status": self.status,
            "duration_ms": round(duration_s * 1000, 1),
            "ttft_ms": self._since_arrival(self.first_token),
            "queue_ms": self._since_arrival(self.engine_started),
            "lease": lease.id if lease is not None else None,
            "request_id": lease.request_id if lease is not None else None,
            "outcome": lease.outcome.value if lease is not None and lease.outcome else None,
            "client": self.client,
            "prompt_tokens": lease.prompt_tokens if lease is not None else None,
            "completion_tokens": lease.completion_tokens if lease is not None else None,
        }
        return {k: v for k, v in out.items() if v is not None}

    def _since_arrival(self, t: float | None) -> float | None:
        return None if t is None else round(max(0.0, t - self.arrived) * 1000, 1)


_current: ContextVar[Entry | None] = ContextVar("mlxd_access_entry", default=None)


def current() -> Entry | None:
    """The entry of the request being handled (None outside a request)."""
    return _current.get()


def note(
    *,
    model: str | None = None,
    lease: Lease | None = None,
    first_token: bool = False,
    engine_started: float | None = None,
) -> None:
    """Tell the access log the request's model or lease (its id, outcome and tokens are read at
    the end), that its first token is going out now, or when the engine started it."""
    entry = _current.get()
    if entry is None:
        return
    if model is not None:
        entry.model = model
    if lease is not None:
        entry.lease = lease
    if first_token and entry.first_token is None:
        entry.first_token = time.monotonic()
    if engine_started is not None:
        entry.engine_started = engine_started


def logfmt(fields: dict[str, Any]) -> str:
    """``key=value`` pairs; a value with a space, quote, ``=`` or control character is quoted."""
    parts = []
    for key, value in fields.items():
        text = str(value)
        if not text or any(c in text for c in ' "=\\') or not text.isprintable():
            text = json.dumps(text)
        parts.append(f"{key}={text}")
    return " ".join(parts)


def formatter(fmt: LogFormat) -> Callable[[dict[str, Any]], str]:
    return logfmt if fmt == "logfmt" else lambda f: json.dumps(f, separators=(",", ":"))


class AccessLog:
    """ASGI wrapper: an :class:`Entry` per HTTP request; ``on_end(entry, seconds)`` when it ends."""

    def __init__(self, app: Any, on_end: Callable[[Entry, float], None]) -> None:
        self.app = app
        self.on_end = on_end

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        entry = Entry(
            scope["method"], scope["path"], time.time(), time.perf_counter(), time.monotonic()
        )

        async def send_status(message: Any) -> None:
            if message["type"] == "http.response.start":
                entry.status = message["status"]
            await send(message)

        token = _current.set(entry)
        try:
            await self.app(scope, receive, send_status)
        finally:
            _current.reset(token)
            self.on_end(entry, time.perf_counter() - entry.started)


def writer(fmt: LogFormat) -> Callable[[Entry, float], None]:
    """``on_end`` that writes the entry's line to the ``mlxd.access`` logger."""
    render = formatter(fmt)

    def write(entry: Entry, seconds: float) -> None:
        if log.isEnabledFor(logging.INFO):
            log.info("%s", render(entry.fields(seconds)))

    return write
