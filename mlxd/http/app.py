"""The Quart-Trio application: routes, the one error handler, auth, limits.

Errors: every :class:`mlxd.errors.MlxdError` is rendered by one handler in
its route family's envelope (:mod:`mlxd.http.envelopes`; OpenAI's by default)
with its status and ``Retry-After``; Quart's own HTTP
errors (unknown route, wrong method, body too large) get the same envelope;
anything unexpected becomes a 500 whose message is only an opaque id, logged
with its traceback. No route answers with a traceback.
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any

import trio
from quart import Response, g, has_request_context, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from mlxd.errors import (
    BodyTooLarge,
    ClientError,
    InternalError,
    InvalidRequest,
    MethodNotAllowed,
    MlxdError,
    NotFound,
    ShuttingDown,
)
from mlxd.http import (
    access_log,
    admin_api,
    anthropic_api,
    auth,
    dashboard,
    embeddings_api,
    envelopes,
    ollama_api,
    openai_api,
    origins,
    responses_api,
)
from mlxd.http.access_log import AccessLog
from mlxd.http.bodies_admin import OpenAPIDocument
from mlxd.http.context import AppState, state
from mlxd.http.openapi import openapi_document

log = logging.getLogger("mlxd.http")

#: paths a draining daemon still answers (so operators can watch it go)
OPEN_WHILE_DRAINING = ("/health", "/metrics", "/admin/status", "/admin/events", "/admin/history")


def error_response(err: MlxdError) -> Response:
    """The one rendering of an error: its route family's body (:mod:`mlxd.http.envelopes`),
    with the same status and ``Retry-After`` on every route."""
    headers = err.headers()
    if err.http_status == 400 and err.code == "model_exceeds_budget":
        headers["x-should-retry"] = "false"  # retrying can never help
    body = envelopes.error_body(err, request.path if has_request_context() else None)
    return Response(
        json.dumps(body), status=err.http_status, headers=headers, mimetype="application/json"
    )


def _translate_http(e: HTTPException) -> MlxdError:
    code = e.code or 500
    if code == 404:
        return NotFound(f"no route {request.method} {request.path}")
    if code == 405:
        return MethodNotAllowed(f"{request.method} is not allowed on {request.path}")
    if code == 413:
        limit = state().config.server.max_body_mb
        return BodyTooLarge(f"the request body is larger than server.max_body_mb ({limit:g} MB)")
    if 400 <= code < 500:
        return ClientError(e.description or "bad request", code)
    return InternalError(f"internal error ({code})")


def create_app(app_state: AppState) -> QuartTrio:
    app = QuartTrio("mlxd")
    app.extensions["mlxd"] = app_state
    app.config["RESPONSE_TIMEOUT"] = None  # streams may run long; Quart's 60 s default cuts them
    app.config["BODY_TIMEOUT"] = 60
    app.config["MAX_CONTENT_LENGTH"] = app_state.config.server.max_body_bytes
    app.config["PROVIDE_AUTOMATIC_OPTIONS"] = True
    app.register_blueprint(openai_api.bp)
    app.register_blueprint(anthropic_api.bp)
    app.register_blueprint(responses_api.bp)
    app.register_blueprint(embeddings_api.bp)
    app.register_blueprint(ollama_api.bp)
    app.register_blueprint(admin_api.bp)
    app.register_blueprint(dashboard.bp)
    app.asgi_app = AccessLog(  # type: ignore[method-assign]
        origins.UnroutableHosts(CompleteRequestBodies(app.asgi_app)), app_state.request_ended
    )

    app.before_request(guard)

    @app.after_request
    async def count(response: Response) -> Response:
        rule = request.url_rule.rule if request.url_rule is not None else "unmatched"
        state().metrics.requests.labels(rule, str(response.status_code)).inc()
        return response

    @app.get("/openapi.json")
    async def openapi() -> OpenAPIDocument:
        return openapi_document(state().config)

    @app.errorhandler(MlxdError)
    async def handle_mlxd(err: MlxdError) -> Response:
        if err.http_status >= 500 and err.http_status != 503:
            log.warning("%s %s -> %s %s", request.method, request.path, err.http_status, err.message)
        return error_response(err)

    @app.errorhandler(HTTPException)
    async def handle_http(e: HTTPException) -> Response:
        response = error_response(_translate_http(e))
        allowed = getattr(e, "valid_methods", None)
        if e.code == 405 and allowed:
            response.headers["Allow"] = ", ".join(allowed)  # RFC 9110: a 405 names the methods
        return response

    @app.errorhandler(Exception)
    async def handle_unexpected(e: Exception) -> Response:
        if isinstance(e, MlxdError):
            return error_response(e)
        if isinstance(e, BaseExceptionGroup):
            match = e.subgroup(MlxdError)
            if match is not None:
                return error_response(_first(match))
        ref = uuid.uuid4().hex[:12]
        log.error("unexpected error on %s %s (error id %s)", request.method, request.path, ref,
                  exc_info=e)
        return error_response(InternalError(f"internal error (error id {ref}; see the daemon log)"))

    return app


async def guard() -> Response | None:
    """Before every route: Host and Origin (:mod:`mlxd.http.origins`), the key and its scope,
    shutdown, repeated query parameters."""
    st = state()
    path = request.path
    entry = access_log.current()
    if entry is not None and request.url_rule is not None:
        entry.route = request.url_rule.rule
    refused = origins.refusal(st.browser, request.method, request.headers)
    if refused is not None:
        return error_response(refused)
    scope = st.auth.required(request.method, path)
    if scope is not None:
        token = auth.presented_key(
            request.headers.get("Authorization", ""), request.headers.get("x-api-key", "")
        )
        try:
            key = st.auth.authenticate(token)
            if entry is not None:
                entry.client = key.name  # logged even when refused for its scope
            st.auth.authorize(key, scope, request.method, path)
        except MlxdError as e:  # 401 or 403
            return error_response(e)
        g.mlxd_key = key
    if st.draining and not path.startswith(OPEN_WHILE_DRAINING):
        return error_response(ShuttingDown("mlxd is shutting down; retry in a moment"))
    repeated = next((k for k in request.args if len(request.args.getlist(k)) > 1), None)
    if repeated is not None:  # routes read one value; the others would be ignored silently
        return error_response(
            InvalidRequest(f"{repeated}: give this query parameter once", param=repeated)
        )
    return None


class CompleteRequestBodies:
    """ASGI wrapper: an answer sent before the request body was read leaves the connection sane.

    A route may answer without reading the body (413 from the Content-Length,
    415, 404, 405, or a route that takes none). hypercorn 0.18 + quart-trio
    then wedge that keep-alive connection: the rest of the body fills the app
    queue of a finished app, or the close that hypercorn starts is cancelled
    half-way by quart-trio, and the next request on it hangs forever. So the
    answer waits (briefly) for Quart to finish swallowing the body, which keeps
    the connection reusable; a body still arriving after that gets
    ``Connection: close`` and an uncancellable send, so the connection is closed.

    And every response's last send is shielded (bounded): without it an idle
    keep-alive connection that had served a request was never closed (see
    :meth:`_last_send`), and idle clients could use up the daemon's descriptors.
    """

    #: how long an early answer waits for the rest of the request body
    BODY_WAIT_S = 5.0
    #: bound on a send that must not be cancelled (it closes the connection)
    CLOSE_SEND_S = 5.0

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        body_done = trio.Event()
        closing = False
        # a client that expects 100-continue sends no body before it gets the 100: an
        # early answer (413) cannot wait for the body, it closes the connection instead
        expects_100 = any(
            k.lower() == b"expect" and v.lower() == b"100-continue" for k, v in scope["headers"]
        )

        async def watched_receive() -> Any:
            message = await receive()
            if message["type"] == "http.disconnect" or not message.get("more_body", False):
                body_done.set()
            return message

        async def careful_send(message: Any) -> None:
            nonlocal closing
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                await self._last_send(send, message)
                return
            if message["type"] == "http.response.start" and not body_done.is_set():
                with trio.move_on_after(0 if expects_100 else self.BODY_WAIT_S):
                    await body_done.wait()  # Quart's receive loop swallows it meanwhile
                if not body_done.is_set():
                    closing = True
                    headers = [*message.get("headers", []), (b"connection", b"close")]
                    message = {**message, "headers": headers}
            if not closing:
                await send(message)
                return
            with trio.move_on_after(self.CLOSE_SEND_S) as bounded:
                bounded.shield = True
                await send(message)

        await self.app(scope, watched_receive, careful_send)

    async def _last_send(self, send: Any, message: Any) -> None:
        """The response's last send, shielded (bounded) so that the keep-alive timer starts.

        In that send hypercorn 0.18 closes the stream (quart-trio then sees
        ``http.disconnect`` and cancels this very task), recycles the
        connection and starts its keep-alive timer with ``nursery.start`` from
        this task: the cancellation killed the timer before it started, so a
        connection that had served a request was never closed when idle.
        """
        with trio.move_on_after(self.CLOSE_SEND_S) as bounded:
            bounded.shield = True
            await send(message)


def _first(group: BaseExceptionGroup[MlxdError]) -> MlxdError:
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            return _first(exc)
        return exc
    raise AssertionError("empty exception group")
