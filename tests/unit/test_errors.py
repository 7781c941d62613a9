"""Every error class renders as one row of this table: HTTP status, OpenAI type and code, Retry-After."""

from __future__ import annotations

import json

import pytest

from mlxd import errors
from mlxd.errors import MlxdError
from mlxd.http.app import error_response

#: class -> (status, type, code, Retry-After header or None)
TABLE: dict[type[MlxdError], tuple[int, str, str | None, str | None]] = {
    errors.MlxdError: (500, "server_error", None, None),
    errors.InvalidRequest: (400, "invalid_request_error", "invalid_request", None),
    errors.ModelExceedsBudget: (400, "invalid_request_error", "model_exceeds_budget", None),
    errors.ContextLengthExceeded: (400, "invalid_request_error", "context_length_exceeded", None),
    errors.ToolsNotSupported: (400, "invalid_request_error", "tools_not_supported", None),
    errors.ConfigError: (400, "invalid_request_error", "invalid_config", None),
    errors.AuthenticationFailed: (401, "authentication_error", "invalid_api_key", None),
    errors.InsufficientScope: (403, "permission_error", "insufficient_scope", None),
    errors.OriginNotAllowed: (403, "permission_error", "origin_not_allowed", None),
    errors.FormBodyRefused: (403, "permission_error", "json_body_required", None),
    errors.NotFound: (404, "invalid_request_error", "not_found", None),
    errors.ModelNotFound: (404, "invalid_request_error", "model_not_found", None),
    errors.ResponseNotFound: (404, "invalid_request_error", "response_not_found", None),
    errors.MethodNotAllowed: (405, "invalid_request_error", "method_not_allowed", None),
    errors.Conflict: (409, "invalid_request_error", "conflict", None),
    errors.BodyTooLarge: (413, "invalid_request_error", "request_too_large", None),
    errors.HostNotAllowed: (421, "invalid_request_error", "host_not_allowed", None),
    errors.UnsupportedMediaType: (415, "invalid_request_error", "unsupported_media_type", None),
    errors.ClientError: (431, "invalid_request_error", "invalid_request", None),
    errors.InternalError: (500, "server_error", "internal_error", None),
    errors.NotImplementedHere: (501, "invalid_request_error", "not_implemented", None),
    errors.LoadFailed: (502, "server_error", "model_load_failed", None),
    errors.EngineError: (502, "server_error", "engine_error", None),
    errors.EngineDied: (502, "server_error", "engine_died", "1"),
    errors.Unavailable: (503, "service_unavailable_error", "unavailable", "1"),
    errors.ModelCapacity: (503, "service_unavailable_error", "model_capacity", "1"),
    errors.CapacityTimeout: (503, "service_unavailable_error", "capacity_timeout", "1"),
    errors.Preempted: (503, "service_unavailable_error", "preempted", "1"),
    errors.Overloaded: (503, "service_unavailable_error", "overloaded", "1"),
    errors.ModelNotResident: (503, "service_unavailable_error", "model_not_resident", "0"),
    errors.ShuttingDown: (503, "service_unavailable_error", "shutting_down", "5"),
    errors.JournalError: (503, "service_unavailable_error", "journal_unavailable", "5"),
}


def make(cls: type[MlxdError]) -> MlxdError:
    """One instance of ``cls`` (three classes take other arguments than a message)."""
    if cls is errors.ModelNotFound:
        return errors.ModelNotFound("qwen")
    if cls is errors.ResponseNotFound:
        return errors.ResponseNotFound("resp_0")
    if cls is errors.ModelNotResident:
        return errors.ModelNotResident("qwen", "unloaded")
    if cls is errors.ClientError:
        return errors.ClientError("request header fields too large", 431)
    return cls("something went wrong")


def test_the_table_covers_every_error_class() -> None:
    """Each MlxdError class in mlxd.errors has its row: a new class cannot go unpinned."""
    classes = {
        obj for obj in vars(errors).values()
        if isinstance(obj, type) and issubclass(obj, MlxdError)
    }
    assert classes == set(TABLE)


@pytest.mark.parametrize("cls", list(TABLE), ids=lambda c: c.__name__)
async def test_each_error_renders_as_its_row(cls: type[MlxdError]) -> None:
    """The one handler renders the class with its status, type, code and Retry-After, in the OpenAI envelope."""
    status, type_, code, retry_after = TABLE[cls]
    err = make(cls)
    response = error_response(err)
    body = json.loads(await response.get_data())
    assert (response.status_code, body["error"]["type"], body["error"]["code"]) == (status, type_, code)
    assert response.headers.get("Retry-After") == retry_after
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"] == err.message


async def test_model_exceeds_budget_tells_clients_not_to_retry() -> None:
    """A model larger than the whole budget can never fit: the reply says x-should-retry: false."""
    assert error_response(errors.ModelExceedsBudget("too big")).headers["x-should-retry"] == "false"
    assert "x-should-retry" not in error_response(errors.InvalidRequest("bad")).headers


def test_retry_after_is_whole_seconds_at_least_one() -> None:
    """A computed Retry-After is rounded to whole seconds, and never below 1."""
    assert errors.ModelCapacity("x", retry_after=2.4).headers() == {"Retry-After": "2"}
    assert errors.ModelCapacity("x", retry_after=0.2).headers() == {"Retry-After": "1"}
    assert errors.InvalidRequest("x").headers() == {}
