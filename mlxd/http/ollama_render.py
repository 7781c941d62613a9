"""Ollama's response shapes: NDJSON stream lines and whole replies of ``/api/chat`` and ``/api/generate``.

One :class:`OllamaRenderer` per generation implements the renderer protocol of
:mod:`mlxd.http.generation`. A stream is ``application/x-ndjson``: one JSON
object per line, ``"done": false`` while text comes, then a last line with
``"done": true``, ``done_reason`` (``stop`` or ``length``) and the counters;
an error after the stream started is a line ``{"error": "..."}`` (which the
official clients raise). Ollama streams show nothing while a model loads, so
the stream starts once the lease is had (:attr:`OllamaRenderer.progress_comments`).

Counters, in nanoseconds as Ollama gives them, from this request's own clock
(``time.monotonic``): ``load_duration`` from arrival to the lease (loading the
model, making room, or queueing for it), ``prompt_eval_duration`` from the
engine taking the job to the first token, ``eval_duration`` from the first
token to the end, ``total_duration`` from arrival to the end;
``prompt_eval_count`` and ``eval_count`` are the prompt and output tokens.

With ``think``, text between the model's thinking markers goes to
``thinking`` instead of ``content`` / ``response`` (:class:`ThinkingSplit`).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterable, Mapping
from datetime import UTC, datetime
from typing import Any, Literal

from quart import Response

from mlxd.engines.base import Finished, TextDelta, TokenLogprob, ToolCallDelta
from mlxd.errors import MlxdError
from mlxd.http.bodies_ollama import (
    OllamaCounters,
    OllamaError,
    OllamaLogprob,
    OllamaMessage,
    OllamaReply,
    OllamaToolCall,
)
from mlxd.http.generation import Collected

NDJSON = "application/x-ndjson"


def timestamp(at: float | None = None) -> str:
    """An RFC 3339 UTC time as Ollama writes ``created_at`` (now, or the epoch seconds ``at``)."""
    t = datetime.now(UTC) if at is None else datetime.fromtimestamp(at, UTC)
    return t.isoformat().replace("+00:00", "Z")


def line(obj: Mapping[str, Any]) -> bytes:
    """One NDJSON line (compact JSON, ``\\n``-terminated)."""
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


def ndjson_response(body: AsyncIterable[bytes], headers: Mapping[str, str] | None = None) -> Response:
    """An NDJSON stream that no timeout, cache or proxy buffer cuts short."""
    resp = Response(body, mimetype=NDJSON)
    resp.headers["Cache-Control"] = "no-cache"
    resp.headers["X-Accel-Buffering"] = "no"
    for key, value in (headers or {}).items():
        resp.headers[key] = value
    resp.timeout = None
    return resp


def ns(seconds: float) -> int:
    return max(0, int(seconds * 1e9))


class ThinkingSplit:
    """Sends the text between ``start`` and ``end`` markers to thinking, the rest to content.

    Markers may arrive split across deltas: a tail that could begin a marker
    is held back until the next delta (or the end) decides.
    """

    def __init__(self, start: str, end: str) -> None:
        self.markers = {False: start, True: end}
        self.inside = False
        self._held = ""

    def feed(self, text: str) -> tuple[str, str]:
        """``(thinking, content)`` of the text so far that is decided."""
        text = self._held + text
        self._held = ""
        thinking: list[str] = []
        content: list[str] = []
        while text:
            marker = self.markers[self.inside]
            at = text.find(marker)
            if at >= 0:
                (thinking if self.inside else content).append(text[:at])
                text = text[at + len(marker):]
                self.inside = not self.inside
                continue
            keep = next((k for k in range(min(len(marker) - 1, len(text)), 0, -1)
                         if marker.startswith(text[-k:])), 0)
            self._held = text[len(text) - keep:]
            (thinking if self.inside else content).append(text[:len(text) - keep])
            break
        return "".join(thinking), "".join(content)

    def flush(self) -> tuple[str, str]:
        held, self._held = self._held, ""
        return (held, "") if self.inside else ("", held)


def tool_call(index: int, ev: ToolCallDelta) -> OllamaToolCall:
    """A call in Ollama's shape: ``arguments`` as an object."""
    return {"id": ev.call.id,
            "function": {"index": index, "name": ev.call.name, "arguments": json.loads(ev.call.arguments)}}


def logprob(e: TokenLogprob) -> OllamaLogprob:
    return {"token": e.token, "logprob": e.logprob, "bytes": list(e.bytes),
            "top_logprobs": [{"token": t.token, "logprob": t.logprob, "bytes": list(t.bytes)} for t in e.top]}


class OllamaRenderer:
    """Ollama's shapes of one chat (``kind="chat"``) or generate generation."""

    #: no progress comments while the model loads: the stream starts with the lease
    progress_comments = False

    def __init__(self, model: str, kind: Literal["chat", "generate"], *,
                 split: ThinkingSplit | None = None, t0: float | None = None) -> None:
        self.model = model
        self.kind = kind
        self.split = split
        self.t0 = time.monotonic() if t0 is None else t0
        #: when the lease came (set by the route's prepare hook)
        self.lease_at: float | None = None
        self.first_at: float | None = None
        self._calls = 0

    respond = staticmethod(ndjson_response)

    def _part(self, thinking: str, text: str, calls: list[OllamaToolCall] | None = None,
              logprobs: list[OllamaLogprob] | None = None) -> OllamaReply:
        obj: OllamaReply = {"model": self.model, "created_at": timestamp(), "done": False}
        if self.kind == "chat":
            msg: OllamaMessage = {"role": "assistant", "content": text}
            if thinking:
                msg["thinking"] = thinking
            if calls:
                msg["tool_calls"] = calls
            obj["message"] = msg
        else:
            obj["response"] = text
            if thinking:
                obj["thinking"] = thinking
        if logprobs:
            obj["logprobs"] = logprobs
        return obj

    def _text(self, text: str) -> tuple[str, str]:
        return self.split.feed(text) if self.split is not None else ("", text)

    def counters(self, fin: Finished, end: float) -> OllamaCounters:
        lease_at = self.lease_at if self.lease_at is not None else self.t0
        started = max(fin.started_at or lease_at, lease_at)
        first = self.first_at if self.first_at is not None else end
        return {
            "total_duration": ns(end - self.t0),
            "load_duration": ns(lease_at - self.t0),
            "prompt_eval_count": fin.prompt_tokens,
            "prompt_eval_duration": ns(first - started),
            "eval_count": fin.completion_tokens,
            "eval_duration": ns(end - first),
        }

    def _last(self, fin: Finished, thinking: str = "", text: str = "",
              calls: list[OllamaToolCall] | None = None) -> OllamaReply:
        obj = self._part(thinking, text, calls)
        obj["done"] = True
        obj["done_reason"] = "length" if fin.finish_reason == "length" else "stop"
        done: OllamaReply = {**obj, **self.counters(fin, time.monotonic())}
        return done

    # ---- the Renderer protocol (mlxd.http.generation) ------------------------------------

    def first(self) -> bytes:
        return line(self._part("", ""))

    def text(self, ev: TextDelta) -> list[bytes]:
        if self.first_at is None:
            self.first_at = time.monotonic()
        thinking, text = self._text(ev.text)
        lp = [logprob(e) for e in ev.logprobs]
        if not (thinking or text or lp):
            return []
        return [line(self._part(thinking, text, logprobs=lp))]

    def call(self, ev: ToolCallDelta) -> list[bytes]:
        if self.first_at is None:
            self.first_at = time.monotonic()
        self._calls += 1
        return [line(self._part("", "", [tool_call(self._calls - 1, ev)]))]

    def finish(self, fin: Finished) -> list[bytes]:
        thinking, text = self.split.flush() if self.split is not None else ("", "")
        return [line(self._last(fin, thinking, text))]

    def error(self, err: MlxdError) -> bytes:
        body: OllamaError = {"error": err.message}
        return line(body)

    def whole(self, out: Collected, fin: Finished) -> OllamaReply:
        if out.first_token_at is not None:
            self.first_at = out.first_token_at
        thinking, text = self._text("".join(out.text))
        if self.split is not None:
            t, c = self.split.flush()
            thinking, text = thinking + t, text + c
        calls = [tool_call(i, c) for i, c in enumerate(out.calls)]
        obj = self._last(fin, thinking, text, calls)
        if out.wants_logprobs:
            obj["logprobs"] = [logprob(e) for e in out.logprobs]
        return obj


def load_reply(model: str, *, chat: bool, unloaded: bool) -> OllamaReply:
    """The reply to Ollama's load call (or unload call: ``done_reason: "unload"``)."""
    obj: OllamaReply = {"model": model, "created_at": timestamp(), "done": True,
                        "done_reason": "unload" if unloaded else "load"}
    if chat:
        obj["message"] = {"role": "assistant", "content": ""}
    else:
        obj["response"] = ""
    return obj
