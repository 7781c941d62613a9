"""How an error's body looks on each family of routes: one table, so a new family says it once.

The app's one error handler (:func:`mlxd.http.app.error_response`) renders
every :class:`~mlxd.errors.MlxdError` (the same status and ``Retry-After``
everywhere) with the body of the family its path belongs to: OpenAI's
envelope ``{"error": {"message", "type", "param", "code"}}`` unless a prefix
below claims the path (Anthropic's ``{"type": "error", "error": {"type",
"message"}}`` on ``/v1/messages``). Errors raised before any route runs (the
browser guard, the body's text check) get their family's shape too. A family
with its own shape (Ollama's ``{"error": "..."}`` on ``/api/``) adds one row.
"""

from __future__ import annotations

from collections.abc import Callable

from mlxd.errors import ErrorEnvelope, MlxdError
from mlxd.http.anthropic_shapes import error_body as anthropic_error_body
from mlxd.http.bodies_anthropic import AnthropicError
from mlxd.http.bodies_ollama import OllamaError

#: an error's body, in one of the families' envelopes (their ``TypedDict``s)
ErrorBody = ErrorEnvelope | AnthropicError | OllamaError
Render = Callable[[MlxdError], ErrorBody]


def _ollama_error_body(err: MlxdError) -> OllamaError:
    return {"error": err.message}


#: path prefix -> the error body of its routes; a prefix ending in "/" claims what is
#: under it, another one itself and what is under it; the longest matching prefix wins
FAMILIES: dict[str, Render] = {
    "/v1/messages": anthropic_error_body,
    "/api/": _ollama_error_body,
}


def family_of(path: str) -> Render | None:
    """The error body of ``path``'s family (None: OpenAI's envelope)."""
    best: tuple[int, Render] | None = None
    for prefix, render in FAMILIES.items():
        claimed = path.startswith(prefix) if prefix.endswith("/") else (
            path == prefix or path.startswith(prefix + "/"))
        if claimed and (best is None or len(prefix) > best[0]):
            best = (len(prefix), render)
    return best[1] if best is not None else None


def error_body(err: MlxdError, path: str | None) -> ErrorBody:
    """``err``'s body on ``path`` (no path, outside a request: OpenAI's envelope)."""
    render = family_of(path) if path is not None else None
    return render(err) if render is not None else err.body()
