"""Tool calls in a model's output: split the text stream at the markers, parse each call.

The markers and the parser come from mlx-lm's tokenizer wrapper, which infers
the model family's tool-call format from its chat template or vocabulary
(``tool_call_start``, ``tool_call_end``, ``tool_parser``). :class:`ToolCallSplitter`
takes the text as it is generated and returns plain text to send at once
and the raw text of each complete call; a tail that could still become a
start marker is held back, so no part of a marker is ever sent as text.
:func:`parse_calls` turns a call's text into :class:`~mlxd.engines.base.ToolCall`
objects; text that does not parse as a call of a declared function is given
back as plain text rather than lost.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mlxd.engines.base import Tool, ToolCall

log = logging.getLogger(__name__)

Parser = Callable[[str, Any], Any]


@dataclass(frozen=True, slots=True)
class Piece:
    """A piece of output: plain text, or the raw text of one tool call (``call`` is True)."""

    text: str
    call: bool = False


class ToolCallSplitter:
    """Separates tool calls (between ``start`` and ``end``) from plain text, incrementally."""

    def __init__(self, start: str, end: str) -> None:
        self.start = start
        self.end = end
        self._buf = ""
        self._in_call = False

    def feed(self, text: str) -> list[Piece]:
        self._buf += text
        out: list[Piece] = []
        while True:
            if self._in_call:
                i = self._buf.find(self.end)
                if i < 0:
                    return out
                out.append(Piece(self._buf[:i], call=True))
                self._buf = self._buf[i + len(self.end) :]
                self._in_call = False
                continue
            i = self._buf.find(self.start)
            if i >= 0:
                if i:
                    out.append(Piece(self._buf[:i]))
                self._buf = self._buf[i + len(self.start) :]
                self._in_call = True
                continue
            keep = _held(self._buf, self.start)
            if len(self._buf) > keep:
                out.append(Piece(self._buf[: len(self._buf) - keep]))
                self._buf = self._buf[len(self._buf) - keep :]
            return out

    def flush(self) -> list[Piece]:
        """What is left once the output has ended (an unfinished call counts as a call)."""
        rest, self._buf = self._buf, ""
        if not rest:
            return []
        return [Piece(rest, call=self._in_call)]


def _held(text: str, marker: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


@dataclass(frozen=True, slots=True)
class ToolFormat:
    """A model's tool-call format, as mlx-lm's tokenizer wrapper knows it."""

    start: str
    end: str
    parser: Parser
    #: the mlx-lm parser module (``json_tools``, ``qwen3_coder``, ...)
    name: str


def tool_format(tokenizer: Any) -> ToolFormat | None:
    """The tool-call format of an mlx-lm ``TokenizerWrapper`` (None: no tool support)."""
    if not getattr(tokenizer, "has_tool_calling", False):
        return None
    parser = tokenizer.tool_parser
    name = str(getattr(parser, "__module__", "")).rsplit(".", 1)[-1]
    return ToolFormat(tokenizer.tool_call_start, tokenizer.tool_call_end, parser, name)


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def parse_calls(raw: str, parser: Parser, tools: tuple[Tool, ...]) -> list[ToolCall] | None:
    """The calls in ``raw`` (one call's text), or None if it is not a call of a declared function."""
    declared = {t.name for t in tools}
    try:
        parsed = parser(raw, [t.as_openai() for t in tools])
    except Exception as e:  # each family's parser raises its own errors on malformed text
        log.debug("tool call text did not parse (%s: %s)", type(e).__name__, e)
        return None
    items = parsed if isinstance(parsed, list) else [parsed]
    calls: list[ToolCall] = []
    for item in items:
        if not isinstance(item, dict):
            return None
        name, args = item.get("name"), item.get("arguments", {})
        if not isinstance(name, str) or name not in declared:
            return None
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                return None
        if not isinstance(args, dict):
            return None
        calls.append(ToolCall(str(item.get("id") or new_call_id()), name, json.dumps(args)))
    return calls or None
