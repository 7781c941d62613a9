"""Server-sent events: the one encoder of the SSE wire format, and the one way a route streams.

Every streaming route (``/v1/chat/completions`` and ``/v1/completions`` with
``stream: true``, ``/admin/events``) writes its frames with these helpers, so
the framing rules live here once:

- a frame is ``field: value`` lines ended by a blank line; JSON payloads are
  compact (no spaces), on one line (``json.dumps`` escapes newlines);
- a comment (``: text``) is a frame that clients ignore: used for the first
  byte of a stream that has nothing to say yet and for keepalives;
- a streaming response is never cut by Quart's ``RESPONSE_TIMEOUT``, is not
  cached, and is not buffered by a proxy (``X-Accel-Buffering: no``).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, Mapping
from typing import Any

from quart import Response

#: the last frame of an OpenAI stream
DONE = b"data: [DONE]\n\n"


def _compact(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))


def data(obj: Any) -> bytes:
    """One ``data:`` frame carrying ``obj`` as compact JSON (OpenAI's stream chunks)."""
    return f"data: {_compact(obj)}\n\n".encode()


def event(obj: Any, *, id: int | str | None = None, name: str | None = None) -> bytes:
    """A frame with an optional ``id:`` (for ``Last-Event-ID`` resumption) and ``event:`` name."""
    head = "" if id is None else f"id: {id}\n"
    if name is not None:
        head += f"event: {name}\n"
    return f"{head}data: {_compact(obj)}\n\n".encode()


def comment(text: str) -> bytes:
    """A comment frame (``: text``), which SSE clients ignore."""
    return f": {text}\n\n".encode()


def response(body: AsyncIterable[bytes], headers: Mapping[str, str] | None = None) -> Response:
    """A ``text/event-stream`` response that no timeout, cache or proxy buffer cuts short."""
    resp = Response(body, mimetype="text/event-stream")
    resp.headers["Cache-Control"] = "no-cache"
    resp.headers["X-Accel-Buffering"] = "no"
    for key, value in (headers or {}).items():
        resp.headers[key] = value
    resp.timeout = None  # Quart's RESPONSE_TIMEOUT (60 s) would cut a long stream
    return resp
