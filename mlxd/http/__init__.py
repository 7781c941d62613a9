"""The HTTP surface: a quart-trio app with the OpenAI routes and the admin routes.

Owns the app and its one error handler (:mod:`.app`), request validation
(:mod:`.validation`; the scalar fields of every body described once in
:mod:`.fields`, which the OpenAPI document is built from), server-sent events (:mod:`.sse`), the OpenAI routes (:mod:`.openai_api`), Ollama's
API (:mod:`.ollama_api`, on the same generation path; docs/ollama.md), the admin and
operations routes (:mod:`.admin_api`), the OpenAPI document (:mod:`.openapi`;
every response body a ``TypedDict`` in a ``bodies_*`` module, which its builder
returns and :mod:`.body_schemas` generates the document's schemas from) and the
Prometheus metrics (:mod:`.metrics`).

May import: the residency manager and leases, the journal (reads and
subscriptions), engines' request types, config, errors and pydantic (only
to describe bodies); never the daemon
or the CLI. Route handlers raise :class:`mlxd.errors.MlxdError`; they never
build error bodies or start tasks in the app's nursery.
"""
