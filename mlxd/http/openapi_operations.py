"""OpenAPI pieces of the operations routes that carry no model: health, metrics, this
document, whoami and the dashboard (assembled by :mod:`mlxd.http.openapi`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mlxd.http.bodies_admin import Health, OpenAPIDocument, Whoami
from mlxd.http.body_schemas import ref
from mlxd.http.openapi_clients import json_response


def operations_paths(_errors: Callable[..., dict[str, Any]]) -> dict[str, Any]:
    """``/health``, ``/metrics``, this document, ``/admin/whoami`` and the dashboard's pages
    (``_errors``: :mod:`mlxd.http.openapi`'s error responses)."""
    return {
        "/health": {
            "get": {
                "summary": "Liveness and readiness (ok / degraded with reasons)",
                "responses": {
                    "200": json_response(ref(Health)),
                    "503": json_response(ref(Health), "shutting down"),
                },
            }
        },
        "/metrics": {
            "get": {
                "summary": "Prometheus metrics (needs the read scope when server.keys is set)",
                "responses": {"200": {"description": "Prometheus text format",
                                      "content": {"text/plain": {"schema": {"type": "string"}}}},
                              **_errors(401, 403)},
            }
        },
        "/openapi.json": {
            "get": {"summary": "This document", "responses": {"200": json_response(ref(OpenAPIDocument))}}
        },
        "/admin/whoami": {
            "get": {
                "summary": "The key this request presented: its name (client) and scopes; any "
                "known key may ask (the dashboard shows only what the scopes allow)",
                "responses": {"200": json_response(ref(Whoami)), **_errors(401)},
            }
        },
        "/": {"get": {"summary": "Redirects to the dashboard (/ui)",
                      "responses": {"302": {"description": "Location: /ui"}}}},
        "/ui": {"get": {"summary": "The dashboard page (no key needed; its data routes keep "
                        "their auth)", "responses": {"200": _HTML}}},
        "/ui/": {"get": {"summary": "The dashboard page", "responses": {"200": _HTML}}},
        "/ui/{name}": {
            "get": {
                "summary": "The dashboard's static files (index.html, app.js, app.css)",
                "parameters": [{"name": "name", "in": "path", "required": True,
                                "schema": {"type": "string", "minLength": 1}}],
                "responses": {"200": {"description": "the file"}, **_errors(404)},
            }
        },
    }


_HTML = {"description": "HTML", "content": {"text/html": {"schema": {"type": "string"}}}}
