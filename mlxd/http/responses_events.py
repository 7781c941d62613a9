"""The Responses API's shapes of one generation: the response object, and its streamed events.

A :class:`ResponsesRenderer` is the :class:`~mlxd.http.generation.Renderer`
of ``POST /v1/responses``. Streamed, every event is an SSE frame ``event:
<type>`` / ``data: {...}`` with a ``sequence_number`` counting from 0:

- ``response.created``, ``response.in_progress`` (the response, ``in_progress``,
  no output yet);
- per text message: ``response.output_item.added``,
  ``response.content_part.added``, ``response.output_text.delta``...,
  ``response.output_text.done``, ``response.content_part.done``,
  ``response.output_item.done``;
- per function call: ``response.output_item.added``,
  ``response.function_call_arguments.delta`` (the whole arguments: the
  engine parses a call once it is complete), ``.done``,
  ``response.output_item.done``;
- last: ``response.completed``, or ``response.incomplete`` when
  ``max_output_tokens`` cut the output, each carrying the whole response with
  its ``usage``; an error once the stream has begun (preemption, shutdown, an
  engine failure) ends it with ``response.failed`` whose ``error.code`` is
  mlxd's (``preempted``, ...).

Whole, the response object is the one ``response.completed`` carries. A reply
with no text and no call still has its (empty) message, as OpenAI's does.
``on_done(response)`` is called with every finished response (the route
stores it there), before its last event is written.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

from mlxd.engines.base import Finished, TextDelta, TokenLogprob, ToolCall, ToolCallDelta
from mlxd.errors import MlxdError
from mlxd.http import sse
from mlxd.http.bodies_responses import (
    FunctionCallItem,
    ItemEventKind,
    ItemStatus,
    Lifecycle,
    OutputItem,
    OutputMessage,
    OutputText,
    PartEventKind,
    ResponseError,
    ResponseEvent,
    ResponseObject,
    ResponsesLogprob,
    ResponsesUsage,
    Status,
)
from mlxd.http.generation import Collected
from mlxd.http.responses_fields import ParsedResponses


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _logprob(e: TokenLogprob) -> ResponsesLogprob:
    return {"token": e.token, "bytes": list(e.bytes), "logprob": e.logprob,
            "top_logprobs": [{"token": t.token, "bytes": list(t.bytes), "logprob": t.logprob}
                             for t in e.top]}


def usage(fin: Finished) -> ResponsesUsage:
    return {
        "input_tokens": fin.prompt_tokens,
        # prompt tokens whose KV came from the model's prompt cache
        "input_tokens_details": {"cached_tokens": fin.cached_tokens},
        "output_tokens": fin.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": fin.prompt_tokens + fin.completion_tokens,
    }


def _call_item(item_id: str, call: ToolCall, status: ItemStatus) -> FunctionCallItem:
    arguments = call.arguments if status == "completed" else ""
    return {"id": item_id, "type": "function_call", "status": status, "call_id": call.id,
            "name": call.name, "arguments": arguments}


class ResponsesRenderer:
    """One response's object and events (see the module docstring)."""

    def __init__(
        self, parsed: ParsedResponses, on_done: Callable[[ResponseObject], None] | None = None
    ) -> None:
        self.model = parsed.model
        self.id = new_id("resp")
        self.created_at = time.time()
        self._echo = parsed.echo
        #: called with each finished response, before its last event (the route stores it)
        self.on_done = on_done
        self._seq = 0
        #: output items finished so far, in order
        self._items: list[OutputItem] = []
        #: the message being streamed: its id, text and logprobs so far
        self._open: tuple[str, list[str], list[ResponsesLogprob]] | None = None

    # ---- the response object -----------------------------------------------------------------

    def response(
        self,
        status: Status,
        output: list[OutputItem],
        *,
        fin: Finished | None = None,
        error: ResponseError | None = None,
    ) -> ResponseObject:
        done = status in ("completed", "incomplete")
        return {
            "id": self.id,
            "object": "response",
            "created_at": int(self.created_at),
            "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "model": self.model,
            "output": output,
            "usage": usage(fin) if fin is not None and done else None,
            **self._echo,
        }

    def _finished(self, fin: Finished, output: list[OutputItem]) -> ResponseObject:
        status: Status = "incomplete" if fin.finish_reason == "length" else "completed"
        response = self.response(status, output, fin=fin)
        if self.on_done is not None:
            self.on_done(response)
        return response

    # ---- events ---------------------------------------------------------------------------------

    def _next(self) -> int:
        """The next event's ``sequence_number``."""
        self._seq += 1
        return self._seq - 1

    def _event(self, event: ResponseEvent) -> bytes:
        return sse.event(event, name=event["type"])

    def _lifecycle(self, kind: Lifecycle, response: ResponseObject) -> bytes:
        return self._event({"type": kind, "response": response, "sequence_number": self._next()})

    def _item(self, kind: ItemEventKind, index: int, item: OutputItem) -> bytes:
        return self._event({"type": kind, "output_index": index, "item": item,
                            "sequence_number": self._next()})

    def _part(self, kind: PartEventKind, item_id: str, index: int, part: OutputText) -> bytes:
        return self._event({"type": kind, "item_id": item_id, "output_index": index,
                            "content_index": 0, "part": part, "sequence_number": self._next()})

    def first(self) -> bytes:
        snapshot = self.response("in_progress", [])
        return (self._lifecycle("response.created", snapshot)
                + self._lifecycle("response.in_progress", snapshot))

    def _open_message(self) -> list[bytes]:
        item_id = new_id("msg")
        self._open = (item_id, [], [])
        index = len(self._items)
        item: OutputMessage = {"id": item_id, "type": "message", "status": "in_progress",
                               "role": "assistant", "content": []}
        part: OutputText = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [self._item("response.output_item.added", index, item),
                self._part("response.content_part.added", item_id, index, part)]

    def _take_message(self, status: ItemStatus) -> OutputMessage | None:
        """The message being streamed, finished with ``status`` and added to the output."""
        if self._open is None:
            return None
        item_id, text, logprobs = self._open
        self._open = None
        part: OutputText = {"type": "output_text", "text": "".join(text), "annotations": [],
                            "logprobs": logprobs}
        item: OutputMessage = {"id": item_id, "type": "message", "status": status,
                               "role": "assistant", "content": [part]}
        self._items.append(item)
        return item

    def _close_message(self, status: ItemStatus = "completed") -> list[bytes]:
        item = self._take_message(status)
        if item is None:
            return []
        part, index = item["content"][0], len(self._items) - 1
        return [self._event({"type": "response.output_text.done", "item_id": item["id"],
                             "output_index": index, "content_index": 0, "text": part["text"],
                             "logprobs": part["logprobs"], "sequence_number": self._next()}),
                self._part("response.content_part.done", item["id"], index, part),
                self._item("response.output_item.done", index, item)]

    def text(self, ev: TextDelta) -> list[bytes]:
        if not ev.text and not ev.logprobs:
            return []
        out = self._open_message() if self._open is None else []
        assert self._open is not None
        item_id, text, logprobs = self._open
        lp = [_logprob(e) for e in ev.logprobs]
        text.append(ev.text)
        logprobs.extend(lp)
        out.append(self._event({"type": "response.output_text.delta", "item_id": item_id,
                                "output_index": len(self._items), "content_index": 0,
                                "delta": ev.text, "logprobs": lp, "sequence_number": self._next()}))
        return out

    def call(self, ev: ToolCallDelta) -> list[bytes]:
        out = self._close_message()
        item_id, index = new_id("fc"), len(self._items)
        done = _call_item(item_id, ev.call, "completed")
        self._items.append(done)
        return [*out,
                self._item("response.output_item.added", index,
                           _call_item(item_id, ev.call, "in_progress")),
                self._event({"type": "response.function_call_arguments.delta", "item_id": item_id,
                             "output_index": index, "delta": ev.call.arguments,
                             "sequence_number": self._next()}),
                self._event({"type": "response.function_call_arguments.done", "item_id": item_id,
                             "output_index": index, "name": ev.call.name,
                             "arguments": ev.call.arguments, "sequence_number": self._next()}),
                self._item("response.output_item.done", index, done)]

    def finish(self, fin: Finished) -> list[bytes]:
        status: ItemStatus = "incomplete" if fin.finish_reason == "length" else "completed"
        out = [] if self._open is not None or self._items else self._open_message()
        out += self._close_message(status)
        response = self._finished(fin, list(self._items))
        last: Lifecycle = ("response.incomplete" if response["status"] == "incomplete"
                           else "response.completed")
        return [*out, self._lifecycle(last, response)]

    def error(self, err: MlxdError) -> bytes:
        self._take_message("incomplete")  # in the failed response's output, with no events of its own
        failed = self.response("failed", list(self._items),
                               error={"code": err.code, "message": err.message})
        return self._lifecycle("response.failed", failed)

    # ---- whole ----------------------------------------------------------------------------------

    def whole(self, out: Collected, fin: Finished) -> ResponseObject:
        text = "".join(out.text)
        output: list[OutputItem] = []
        if text or not out.calls:
            status: ItemStatus = "incomplete" if fin.finish_reason == "length" else "completed"
            part: OutputText = {"type": "output_text", "text": text, "annotations": [],
                                "logprobs": [_logprob(e) for e in out.logprobs]}
            output.append({"id": new_id("msg"), "type": "message", "status": status,
                           "role": "assistant", "content": [part]})
        output += [_call_item(new_id("fc"), c.call, "completed") for c in out.calls]
        return self._finished(fin, output)
