"""``Expect: 100-continue`` with a body over the limit: answer 413, never ``100 Continue``.

hypercorn 0.18 (h11) sends ``100 Continue`` to every request that expects it,
before the application has seen the request, so a client that declares a body
larger than ``server.max_body_mb`` is told to send it and only then gets its
413. RFC 9110 (section 10.1.1) lets a server answer the final status instead,
which is the point of the header. :func:`install` makes hypercorn's HTTP/1.1
protocol skip the ``100`` when the declared ``Content-Length`` is over the
limit the daemon puts in its hypercorn config (:data:`LIMIT_ATTR`); the app
then answers 413 at once and closes the connection (see
:class:`mlxd.http.app.CompleteRequestBodies`).
"""

from __future__ import annotations

from typing import Any

import hypercorn.protocol
from hypercorn.protocol.h11 import H11Protocol

#: the hypercorn ``Config`` attribute holding the body limit in bytes (absent: no check)
LIMIT_ATTR = "mlxd_max_body_bytes"


def declared_length(headers: Any) -> int | None:
    """The request's ``Content-Length`` (None if absent or not a number)."""
    for name, value in headers:
        if name.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


class _H11Protocol(H11Protocol):
    async def _check_protocol(self, event: Any) -> None:
        await super()._check_protocol(event)
        limit = getattr(self.config, LIMIT_ATTR, None)
        length = declared_length(event.headers)
        connection: Any = self.connection
        if (
            limit is not None
            and length is not None
            and length > limit
            and getattr(connection, "client_is_waiting_for_100_continue", False)
        ):
            connection.client_is_waiting_for_100_continue = False  # the final answer comes first


def install() -> None:
    """Use the protocol above for hypercorn's HTTP/1.1 connections (idempotent)."""
    setattr(hypercorn.protocol, "H11Protocol", _H11Protocol)  # noqa: B010 - patching a module
