"""The browser guard: a request's ``Host``, ``Origin`` and body type, checked before routing.

The rule (:class:`mlxd.config.origins.BrowserRules`) and why it exists are in
:mod:`mlxd.config.origins` and ``docs/security.md``. Here it is applied to a
request, in this order, before the key check and before any route runs:

1. a ``Host`` that is not allowed: 421 ``host_not_allowed`` (a DNS-rebinding
   page reads nothing, not even ``/health``);
2. a state-changing method (anything but GET, HEAD, OPTIONS):

   * a foreign ``Origin``: 403 ``origin_not_allowed``;
   * a body type that any page may send without a CORS preflight
     (``text/plain``, ``application/x-www-form-urlencoded``,
     ``multipart/form-data``), whatever its ``Origin``: 403
     ``json_body_required``. mlxd's bodies are JSON; a route that takes none
     needs no ``Content-Type`` at all.
"""

from __future__ import annotations

import json
from typing import Any

from werkzeug.sansio.utils import get_host

from mlxd.config.origins import SAFE_METHODS, BrowserRules
from mlxd.errors import FormBodyRefused, HostNotAllowed, MlxdError, OriginNotAllowed
from mlxd.http import envelopes
from mlxd.http.bodies_admin import OpenAPIDocument
from mlxd.http.preferences import Headers

#: the body types of a CORS "simple request": a page sends them without asking first
SIMPLE_BODY_TYPES = frozenset(
    {"text/plain", "application/x-www-form-urlencoded", "multipart/form-data"}
)


def refusal(rules: BrowserRules, method: str, headers: Headers) -> MlxdError | None:
    """Why this request is refused (None: it may go on); ``headers`` is case-insensitive."""
    host = headers.get("Host")
    if not rules.host_allowed(host):
        return _host_refused(host)
    if method.upper() in SAFE_METHODS:
        return None
    origin = headers.get("Origin")
    if origin is not None and not rules.origin_allowed(origin, host):
        return OriginNotAllowed(
            f"a {method} from a web page of origin {origin[:100]!r} is refused: only the "
            "server's own pages and the origins in server.allowed_origins may change its state"
        )
    mimetype = (headers.get("Content-Type") or "").split(";", 1)[0].strip().lower()
    if mimetype in SIMPLE_BODY_TYPES:
        return FormBodyRefused(
            f"a {method} with Content-Type {mimetype} is refused (any web page can send one "
            "unasked): send JSON with 'Content-Type: application/json', or no body at all"
        )
    return None


def _host_refused(host: str | None) -> HostNotAllowed:
    shown = (host or "")[:100]
    return HostNotAllowed(
        f"Host {shown!r} is not a name of this server: mlxd answers to loopback names and "
        "addresses (localhost, 127.0.0.1, [::1]) and those in server.allowed_hosts"
    )


def _routable(host: str) -> bool:
    """Whether Quart can build a request on this ``Host`` (werkzeug IDNA-encodes its name and
    raises, a 500, on an empty or overlong label such as ``localhost..``)."""
    try:
        get_host("http", host).partition(":")[0].encode("idna")
    except UnicodeError:
        return False
    return True


class UnroutableHosts:
    """ASGI wrapper: a ``Host`` that Quart cannot build a request on gets the guard's 421
    (``host_not_allowed``) here, before Quart, instead of a 500 and a traceback."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        host = next((v for k, v in scope.get("headers", ()) if k.lower() == b"host"), None)
        if scope["type"] != "http" or host is None or _routable(host.decode("latin-1")):
            await self.app(scope, receive, send)
            return
        err = _host_refused(host.decode("latin-1"))
        body = json.dumps(envelopes.error_body(err, scope.get("path"))).encode()
        await send({"type": "http.response.start", "status": err.http_status, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),  # its body, if any, is not read
        ]})
        await send({"type": "http.response.body", "body": body})


_HOST_REFUSED = ("host_not_allowed: the Host header is neither a loopback name nor in "
                 "server.allowed_hosts (every route, before routing)")
_ORIGIN_REFUSED = ("origin_not_allowed (a foreign Origin) or json_body_required (a text or form "
                   "body): what a web page may send unasked (every state-changing route)")


def describe(document: OpenAPIDocument) -> OpenAPIDocument:
    """The OpenAPI document with this guard's answers: 421 on every operation, 403 on every
    state-changing one; written here once, so routes added later are described too."""
    for operations in document["paths"].values():
        for method, op in operations.items():
            responses = op.setdefault("responses", {})
            responses.setdefault("421", {"description": _HOST_REFUSED})
            if method not in ("get", "head", "options"):
                responses.setdefault("403", {"description": _ORIGIN_REFUSED})
    return document
