"""The one error tree of mlxd.

Every error a user can see is an :class:`MlxdError`. Each class declares its
HTTP status, its OpenAI error ``type`` and ``code``, and whether it is
retryable (``retry_after`` seconds, sent as ``Retry-After``). Route handlers
raise these; one handler renders them in the OpenAI envelope
``{"error": {"message", "type", "param", "code"}}``. Foreign exceptions are
translated at the boundary (engine errors become :class:`LoadFailed`, sqlite
errors become :class:`JournalError`).
"""

from __future__ import annotations

from typing import ClassVar

from typing_extensions import TypedDict


class ErrorDetail(TypedDict):
    """What went wrong: ``param`` names the request field at fault, ``code`` the error's kind."""

    message: str
    type: str
    param: str | None
    code: str | None


class ErrorEnvelope(TypedDict):
    """OpenAI's error body (every route outside the Anthropic and Ollama families)."""

    error: ErrorDetail


class MlxdError(Exception):
    """Base of every error mlxd reports to a user."""

    http_status: ClassVar[int] = 500
    type: ClassVar[str] = "server_error"
    code: ClassVar[str | None] = None
    #: Seconds a client should wait before retrying; None means not retryable.
    default_retry_after: ClassVar[float | None] = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.retry_after = retry_after if retry_after is not None else self.default_retry_after

    def body(self) -> ErrorEnvelope:
        """The OpenAI error envelope for this error."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def headers(self) -> dict[str, str]:
        if self.retry_after is None:
            return {}
        return {"Retry-After": str(max(1, round(self.retry_after)))}


#: the most characters of a foreign error's text an error message quotes (a grammar
#: library's error can carry its whole grammar, a tokenizer's the whole prompt)
MAX_QUOTED = 300


def quote(text: str) -> str:
    """The first line of a foreign error's ``text``, at most :data:`MAX_QUOTED` characters."""
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line[:MAX_QUOTED] + "..." if len(line) > MAX_QUOTED else line


def describe_error(exc: BaseException) -> str:
    """One line for any error: an MlxdError's message, else ``Type: first line`` (quoted)."""
    if isinstance(exc, MlxdError):
        return exc.message
    text = quote(str(exc))
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


# ---- 4xx: the request is wrong ---------------------------------------------------------


class InvalidRequest(MlxdError):
    http_status = 400
    type = "invalid_request_error"
    code = "invalid_request"


class ModelExceedsBudget(InvalidRequest):
    code = "model_exceeds_budget"


class ContextLengthExceeded(InvalidRequest):
    """The prompt (plus ``max_tokens``) does not fit the model's context or prompt limit."""

    code = "context_length_exceeded"


class ToolsNotSupported(InvalidRequest):
    """The model's chat template has no tool support (tools are never silently ignored)."""

    code = "tools_not_supported"


class AuthenticationFailed(MlxdError):
    http_status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class InsufficientScope(MlxdError):
    """A known key without the scope the route needs (``server.keys[].scopes``)."""

    http_status = 403
    type = "permission_error"
    code = "insufficient_scope"


class OriginNotAllowed(MlxdError):
    """A state-changing request from a web page of another origin (``server.allowed_origins``)."""

    http_status = 403
    type = "permission_error"
    code = "origin_not_allowed"


class FormBodyRefused(MlxdError):
    """A state-changing request with a body type any web page may send unasked (a form, text)."""

    http_status = 403
    type = "permission_error"
    code = "json_body_required"


class NotFound(MlxdError):
    http_status = 404
    type = "invalid_request_error"
    code = "not_found"


class ModelNotFound(NotFound):
    code = "model_not_found"

    def __init__(self, model: str) -> None:
        super().__init__(f"The model '{model}' does not exist", param="model")
        self.model = model


class ResponseNotFound(NotFound):
    """A stored response (``/v1/responses/{id}``, ``previous_response_id``) that is not there:
    never stored, ``store: false``, deleted, or pruned by the journal's retention."""

    code = "response_not_found"

    def __init__(self, response_id: str, *, param: str | None = None, why: str = "") -> None:
        shown = response_id if len(response_id) <= 80 else response_id[:80] + "..."
        super().__init__(f"Response with id '{shown}' not found{why}", param=param)
        self.response_id = response_id


class MethodNotAllowed(MlxdError):
    http_status = 405
    type = "invalid_request_error"
    code = "method_not_allowed"


class Conflict(MlxdError):
    http_status = 409
    type = "invalid_request_error"
    code = "conflict"


class BodyTooLarge(MlxdError):
    http_status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class ClientError(MlxdError):
    """Another 4xx raised by the HTTP stack (malformed request line, headers too large, ...)."""

    type = "invalid_request_error"
    code = "invalid_request"

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.http_status = status  # type: ignore[misc]


class HostNotAllowed(MlxdError):
    """A ``Host`` that is neither loopback nor in ``server.allowed_hosts`` (DNS rebinding)."""

    http_status = 421
    type = "invalid_request_error"
    code = "host_not_allowed"


class UnsupportedMediaType(MlxdError):
    http_status = 415
    type = "invalid_request_error"
    code = "unsupported_media_type"


# ---- 5xx: the server cannot do it now ---------------------------------------------------


class NotImplementedHere(MlxdError):
    """A route of another server's API that mlxd does not serve by design (Ollama's
    ``/api/delete``, ``/api/copy``, ``/api/create``, ``/api/push``: mlxd reads models from its config)."""

    http_status = 501
    type = "invalid_request_error"
    code = "not_implemented"


class LoadFailed(MlxdError):
    """The engine raised while loading; the model is ``failed`` with ``last_error``."""

    http_status = 502
    type = "server_error"
    code = "model_load_failed"


class EngineError(MlxdError):
    """The engine raised while generating."""

    http_status = 502
    type = "server_error"
    code = "engine_error"


class EngineDied(EngineError):
    """The model's engine process died (crash, abort, kill); the model is ``failed``.

    The next request loads it again, so the error is retryable.
    """

    code = "engine_died"
    default_retry_after = 1.0


class Unavailable(MlxdError):
    """Base of the typed, retryable 503s."""

    http_status = 503
    type = "service_unavailable_error"
    code = "unavailable"
    default_retry_after = 1.0


class ModelCapacity(Unavailable):
    """The model does not fit now and the policy says not to wait."""

    code = "model_capacity"


class CapacityTimeout(Unavailable):
    """Waited ``wait_timeout_s`` for room and none came."""

    code = "capacity_timeout"


class Preempted(Unavailable):
    """The lease was preempted so that another model could have the memory."""

    code = "preempted"


class ModelNotResident(Unavailable):
    """The request asked ``X-Mlxd-Require-Resident: 1`` and the model is not loaded.

    Nothing was loaded, queued or leased. ``Retry-After: 0``: a router tries
    another daemon at once (mlxd's LiteLLM strategy, :mod:`mlxd.fleet`).
    """

    code = "model_not_resident"
    default_retry_after = 0.0

    def __init__(self, model: str, state: str) -> None:
        super().__init__(
            f"'{model}' is not resident here ({state}) and X-Mlxd-Require-Resident asked not to load it",
            param="model",
        )

    def headers(self) -> dict[str, str]:
        return {"Retry-After": "0"}


class ShuttingDown(Unavailable):
    code = "shutting_down"
    default_retry_after = 5.0


class Overloaded(Unavailable):
    """More requests wait for this model than its ``max_queue`` allows."""

    code = "overloaded"


class JournalError(Unavailable):
    """The journal cannot write; new loads are refused until it can."""

    code = "journal_unavailable"
    default_retry_after = 5.0


class InternalError(MlxdError):
    """An unexpected error; the message carries only an opaque id that is in the log."""

    http_status = 500
    type = "server_error"
    code = "internal_error"


# ---- not HTTP ---------------------------------------------------------------------------


class ConfigError(MlxdError):
    """A configuration error; the message names the key path. The CLI exits 2."""

    http_status = 400
    type = "invalid_request_error"
    code = "invalid_config"
