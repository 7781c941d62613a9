"""Who may call which route: API keys, their scopes, and the client name each request carries.

The routes need one scope each (:func:`required_scope`): ``inference`` for
``/v1/*`` and Ollama's ``/api/*`` (but ``admin`` for ``/api/pull``); under ``/admin/``, ``read`` for what only reads (``GET``: status,
history, events, plan) and ``admin`` for what changes residency or the config
(``POST``: load, unload, reload); ``read`` for ``/metrics`` when
``server.keys`` is configured (with only ``server.api_key_env`` it stays open,
as before, for scrapers). ``/health`` and ``/openapi.json`` are always open.

A request presents its key as ``Authorization: Bearer <key>`` or ``x-api-key:
<key>`` (what Anthropic clients send). :meth:`Auth.identify` compares it with
*every* configured key in constant time (SHA-256 digests of equal length, no
early exit), so the answer's timing says nothing about any key. No known key:
401 ``invalid_api_key``; a known key without the scope: 403
``insufficient_scope``. ``/admin/whoami`` takes any known key (the dashboard
asks it which scopes its key has). The key's *name* (never the key) becomes the
request's client: journaled on its lease (``leases.client``), in the access
log and in the per-client metrics.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable
from dataclasses import dataclass

from quart import g

from mlxd.config.keys import ResolvedKey
from mlxd.errors import AuthenticationFailed, InsufficientScope


@dataclass(frozen=True, slots=True)
class Key:
    """A configured key as the guard knows it: its name, the digest of its value, its scopes."""

    name: str
    digest: bytes
    scopes: frozenset[str]


def _digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode("utf-8", "surrogatepass")).digest()


#: what :func:`required_scope` says of a route that any known key may call
ANY_KEY = ""


def required_scope(method: str, path: str, *, scoped_keys: bool) -> str | None:
    """The scope ``method path`` needs (:data:`ANY_KEY`: just a known key), or None when open."""
    if path.startswith("/v1/"):
        return "inference"
    if path.startswith("/api/"):  # Ollama's API: a pull downloads weights, so it is an admin's
        return "admin" if path == "/api/pull" else "inference"
    if path == "/admin/whoami":
        return ANY_KEY  # the dashboard asks which scopes its key has: any key may
    if path.startswith("/admin/"):
        return "read" if method in ("GET", "HEAD", "OPTIONS") else "admin"
    if path == "/metrics" and scoped_keys:
        return "read"
    return None


class Auth:
    """The configured keys; no keys means every route is open."""

    def __init__(self, keys: Iterable[ResolvedKey] = (), *, scoped: bool = False) -> None:
        self._keys = tuple(Key(k.name, _digest(k.secret), k.scopes) for k in keys)
        #: ``server.keys`` is configured (not only ``api_key_env``): /metrics needs ``read``
        self.scoped = scoped

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def identify(self, token: str) -> Key | None:
        """The key ``token`` is, compared with every key in constant time; None if none."""
        digest = _digest(token)
        found: Key | None = None
        for key in self._keys:
            if hmac.compare_digest(digest, key.digest):
                found = key  # no break: the time spent does not depend on which key matched
        return found

    def required(self, method: str, path: str) -> str | None:
        """The scope ``method path`` needs here (:data:`ANY_KEY`: just a known key); None: open."""
        if not self._keys:
            return None
        return required_scope(method, path, scoped_keys=self.scoped)

    def authenticate(self, token: str) -> Key:
        """The key ``token`` is; :class:`AuthenticationFailed` (401) if none."""
        key = self.identify(token)
        if key is None:
            raise AuthenticationFailed("missing or wrong API key: send 'Authorization: Bearer <key>'")
        return key

    @staticmethod
    def authorize(key: Key, scope: str, method: str, path: str) -> None:
        """:class:`InsufficientScope` (403) unless ``key`` has ``scope``."""
        if scope != ANY_KEY and scope not in key.scopes:
            raise InsufficientScope(
                f"the key '{key.name}' lacks the '{scope}' scope that {method} {path} needs"
            )


def client() -> str | None:
    """The name of the key the current request presented (None without keys or on open routes)."""
    key: Key | None = g.get("mlxd_key")
    return key.name if key is not None else None


def presented_key(authorization: str, x_api_key: str) -> str:
    """The key a request carries: ``Authorization: Bearer``, else ``x-api-key``; '' if none."""
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return x_api_key.strip()
