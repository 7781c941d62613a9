"""Grammar-constrained decoding: a per-request logits processor built with llguidance.

Theory of operation. A request's :class:`~mlxd.engines.base.Constraint`
(``response_format`` json_object / json_schema, or ``tool_choice`` required /
named) becomes an llguidance grammar (:func:`grammar_for`). The engine's
``prepare`` (:func:`with_grammar`, on a worker thread) turns it into a
:class:`GrammarProcessor` in the request's ``logits_processors``: mlx-lm
calls it on the MLX thread before each sampling step with the token context
and the logits; it commits the token sampled at the previous step to its
``LLMatcher``, asks the matcher for the bitmask of allowed next tokens, and
sets every other logit to ``-inf``. When the grammar is complete only
end-of-sequence is allowed, so the generation stops there.

The processor follows mlx-lm's ``LogitsProcessor`` contract
(``(tokens, logits) -> logits``), which both ``generate_step`` (one request at
a time) and ``BatchGenerator`` (per-request processors inside a batch) call
once per generated token; one processor serves one request and keeps its own
matcher, so requests with different grammars share a batch. The constraint is
plain data and crosses process boundaries; the processor (a callable holding
the matcher) does not: it is built where the model is.

Why llguidance (README "Structured output"; ``bench/constrained.py``): all
three maintained libraries cost far less than a decode step per token
(llguidance is the slowest of them per token, tens of microseconds), so the
choice is by fit: no per-schema index over the vocabulary (outlines-core), no
PyTorch (xgrammar), Lark grammars with inline JSON schemas for the tool-call
format, one matcher per request for per-request processors in a batch, and
it already ships with mlx-vlm.

Budget guard. A model -- the random-weight demo model most of all -- can
write a JSON string until ``max_tokens`` runs out, leaving JSON that does not
parse. So the processor measures what closing the output needs from the
grammar's current state (:meth:`GrammarProcessor.closing_need`: the tokens of
the shortest way to an accepting state it finds, walking a copy of the matcher
the way the guard would: forced tokens, then the allowed token that brings the
end closest by :class:`JsonCloser`'s count). When the tokens left come down to
that need (plus :data:`SLACK` and the end-of-sequence token), it keeps only
the allowed tokens that bring the end closest, and once the output may end,
only the end of sequence. The grammar still decides what is valid; the guard
only chooses among valid tokens, as late as it can, and records that it acted
(``GrammarProcessor.guard_used``). Output the guard closed in time is complete
(finish_reason ``stop``); only output ``max_tokens`` cut before the grammar
accepted it ends ``length``.

The need is measured every :data:`MEASURE_EVERY` tokens, and once the tokens
left are within twice the last need (plus :data:`NEAR_END`), at every token
that changes the JSON's structure (:meth:`JsonCloser.shape`: more bytes of the
same string or number leave the need as it was, give or take a character's
remaining bytes, which :data:`SLACK` covers). A measurement walks the need's
tokens (about 1 ms for 40 tokens on the demo model's vocabulary); it ranks the
allowed short closing tokens first (:data:`SHORT_BYTES`), a short list on any
vocabulary.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import trio

from mlxd.engines.base import Constraint, GenerationRequest
from mlxd.engines.grammar.schema_bounds import check_enforceable
from mlxd.errors import InvalidRequest, describe_error, quote

#: compact JSON: no whitespace between tokens (fewer tokens, and a random model
#: cannot fill its budget with blanks)
_COMPACT = {"whitespace_flexible": False}
#: bytes that may end a string, a container or a value; the guard only looks at these tokens
_CLOSERS = frozenset(b'",]}0123456789eul')
#: candidate tokens of at most this many bytes are ranked first (a short list on any vocabulary)
SHORT_BYTES = 2
#: the budget guard: measure the closing need every this many tokens while far from the end ...
MEASURE_EVERY = 32
#: ... and at every token once the tokens left are within 2 x need + this
NEAR_END = 32
#: the guard acts with this many tokens to spare over the need (a token the model chose
#: just before may have added to it: a character's first byte, a new key)
SLACK = 4
#: a measurement walks at most this many tokens (a larger need: the guard acts now)
MAX_NEED = 256
#: the markers of the tool-call format mlxd enforces (mlxd.engines.text.prompts.ENFORCEABLE_TOOL_FORMATS)
TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"


class ConstraintError(Exception):
    """The matcher refused a token the sampler chose (cannot happen unless masking failed)."""


def _with_compact(schema: dict[str, Any]) -> dict[str, Any]:
    out = dict(schema)
    guidance = dict(out.get("x-guidance") or {})
    guidance.update(_COMPACT)
    out["x-guidance"] = guidance
    return out


def tool_call_schema(request: GenerationRequest) -> dict[str, Any]:
    """The JSON of one call: ``{"name": <a declared function>, "arguments": <its parameters>}``."""
    tools = request.tools
    if request.tool_choice == "function":
        tools = tuple(t for t in tools if t.name == request.tool_name)
    variants = [
        {
            "type": "object",
            "properties": {"name": {"const": t.name}, "arguments": t.parameters},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    return variants[0] if len(variants) == 1 else {"anyOf": variants}


def _marker(text: str, special: frozenset[str]) -> str:
    """A marker in Lark: a special-token reference when the tokenizer has it as one token."""
    return text if text in special else json.dumps(text)


def grammar_for(
    constraint: Constraint, request: GenerationRequest, special: frozenset[str] = frozenset()
) -> str:
    """The llguidance grammar (JSON text) of ``constraint``; raises :class:`InvalidRequest`.

    ``special``: the tool-call markers the tokenizer holds as single added
    tokens, which llguidance matches as tokens (``<tool_call>``), not as text.
    """
    from llguidance import LLMatcher

    check_schemas(constraint, request)
    try:
        if constraint.kind == "json_object":
            return str(LLMatcher.grammar_from_json_schema(_with_compact({"type": "object"})))
        if constraint.kind == "json_schema":
            schema = json.loads(constraint.schema)
            return str(LLMatcher.grammar_from_json_schema(_with_compact(schema)))
        call = json.dumps(_with_compact(tool_call_schema(request)))
        start, end = _marker(TOOL_CALL_START, special), _marker(TOOL_CALL_END, special)
        return str(LLMatcher.grammar_from_lark(f"start: {start} call {end}\ncall: %json {call}\n"))
    except (ValueError, TypeError, RuntimeError) as e:
        raise InvalidRequest(
            f"{_param(constraint)}: cannot be enforced: {describe_error(e)}", param=_param(constraint)
        ) from e


def check_schemas(constraint: Constraint, request: GenerationRequest) -> None:
    """Refuse the schemas of ``constraint`` that the grammar cannot enforce (400, before any
    token: :mod:`mlxd.engines.grammar.schema_bounds`)."""
    if constraint.kind == "json_schema":
        check_enforceable(json.loads(constraint.schema), _param(constraint))
    elif constraint.kind == "tool_call":
        for t in request.tools:
            if request.tool_choice != "function" or t.name == request.tool_name:
                check_enforceable(t.parameters, "tools", f"the parameters of '{t.name}'")


def _param(constraint: Constraint) -> str:
    if constraint.kind == "tool_call":
        return "tools"
    if constraint.param:
        return constraint.param
    if constraint.kind == "json_schema":
        return "response_format.json_schema.schema"
    return "response_format"


@dataclass
class GrammarTokens:
    """What constrained decoding needs of one tokenizer; built once per engine (~1 s on big vocabularies)."""

    ll: Any  # llguidance.LLTokenizer
    vocab_size: int
    #: ids of tokens holding a byte in _CLOSERS, with their bytes (the guard's candidates)
    closer_ids: Any  # numpy int array
    closer_bytes: list[bytes]
    #: positions in closer_ids of the candidates of at most SHORT_BYTES bytes
    short: Any = None  # numpy int array
    #: tool-call markers that are single special tokens for llguidance
    special: frozenset[str] = frozenset()
    _bytes: dict[int, bytes] = field(default_factory=dict)

    def token_bytes(self, token: int) -> bytes:
        b = self._bytes.get(token)
        if b is None:
            b = bytes(self.ll.decode_bytes([token]))
            self._bytes[token] = b
        return b


def grammar_tokens(tokenizer: Any, vocab_size: int) -> GrammarTokens:
    """Wrap an mlx-lm ``TokenizerWrapper`` (or a Hugging Face fast tokenizer) for llguidance."""
    import llguidance.hf
    import numpy as np

    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    eos = sorted(getattr(tokenizer, "eos_token_ids", None) or [hf.eos_token_id])
    ll = llguidance.hf.from_tokenizer(hf, n_vocab=vocab_size, eos_token=eos)
    ids: list[int] = []
    blobs: list[bytes] = []
    for i in range(vocab_size):
        if ll.is_special_token(i):
            continue
        b = bytes(ll.decode_bytes([i]))
        if any(c in _CLOSERS for c in b):
            ids.append(i)
            blobs.append(b)
    special = frozenset(
        m for m in (TOOL_CALL_START, TOOL_CALL_END)
        if len(t := ll.tokenize_str(m)) == 1 and ll.is_special_token(t[0])
    )
    short = np.array([i for i, b in enumerate(blobs) if len(b) <= SHORT_BYTES], dtype=np.int64)
    return GrammarTokens(ll, vocab_size, np.array(ids, dtype=np.int64), blobs, short, special)


class JsonCloser:
    """Follows JSON text byte by byte and estimates the bytes still needed to close it.

    Text before the first ``{`` or ``[`` is skipped (a tool call's opening
    marker), and so is text after the JSON ends (its closing marker).
    """

    __slots__ = ("escape", "is_key", "left", "lexemes", "mode", "stack")

    #: bytes to finish from each mode, before closing the open containers
    _BASE = {"pre": 2, "key_or_end": 0, "key": 4, "colon": 2, "value": 1, "value_or_end": 0,
             "number": 0, "after": 0, "done": 0}

    def __init__(self) -> None:
        self.stack: list[int] = []
        self.mode = "pre"
        self.is_key = False
        self.escape = 0
        self.left = 0
        #: strings and numbers started so far
        self.lexemes = 0

    def copy(self) -> JsonCloser:
        c = JsonCloser.__new__(JsonCloser)
        c.stack = self.stack.copy()
        c.mode, c.is_key, c.escape, c.left = self.mode, self.is_key, self.escape, self.left
        c.lexemes = self.lexemes
        return c

    def shape(self) -> tuple[str, int, int, int]:
        """What the closing need depends on: the mode, the open containers, the strings and
        numbers started (the bytes inside one string or number do not change it)."""
        return self.mode, len(self.stack), self.lexemes, self.escape

    def lengthens(self, before: JsonCloser) -> bool:
        """True if, since ``before``, the string or number being written only grew."""
        return (
            before.mode in ("string", "number")
            and self.mode == before.mode
            and self.lexemes == before.lexemes
        )

    def distance(self) -> int:
        if self.mode == "string":
            base = 1 + abs(self.escape) + (2 if self.is_key else 0)
        elif self.mode == "literal":
            base = self.left
        else:
            base = self._BASE[self.mode]
        return base + len(self.stack)

    def feed(self, data: bytes) -> None:
        for b in data:
            self._byte(b)

    def _after_value(self) -> None:
        self.mode = "after" if self.stack else "done"

    def _byte(self, b: int) -> None:
        mode = self.mode
        if mode == "string":
            if self.escape == -1:  # the byte after a backslash
                self.escape = 4 if b == ord("u") else 0
            elif self.escape > 0:  # hex digits of \uXXXX
                self.escape -= 1
            elif b == ord("\\"):
                self.escape = -1
            elif b == ord('"'):
                if self.is_key:
                    self.mode = "colon"
                else:
                    self._after_value()
            return
        if mode == "literal":
            self.left -= 1
            if self.left <= 0:
                self._after_value()
            return
        if mode == "number":
            if b in b"0123456789.eE+-":
                return
            self._after_value()
            mode = self.mode
        if b in b" \t\r\n" or mode == "done":
            return
        if mode == "pre":
            if b in b"{[":
                self._open(b)
            return
        if mode in ("key_or_end", "key"):
            if b == ord('"'):
                self.mode, self.is_key = "string", True
                self.lexemes += 1
            elif b == ord("}") and mode == "key_or_end":
                self._close()
        elif mode == "colon":
            if b == ord(":"):
                self.mode = "value"
        elif mode in ("value", "value_or_end"):
            self._value_byte(b, mode)
        elif mode == "after":
            if b == ord(","):
                self.mode = "key" if self.stack[-1] == ord("{") else "value"
            elif b in b"}]":
                self._close()

    def _value_byte(self, b: int, mode: str) -> None:
        if b == ord('"'):
            self.mode, self.is_key = "string", False
            self.lexemes += 1
        elif b in b"{[":
            self._open(b)
        elif b in b"-0123456789":
            self.mode = "number"
            self.lexemes += 1
        elif b in b"tfn":
            self.mode, self.left = "literal", 4 if b == ord("f") else 3
        elif b == ord("]") and mode == "value_or_end":
            self._close()

    def _open(self, b: int) -> None:
        self.stack.append(b)
        self.mode = "key_or_end" if b == ord("{") else "value_or_end"

    def _close(self) -> None:
        if self.stack:
            self.stack.pop()
        self._after_value()


class GrammarProcessor:
    """mlx-lm logits processor for one request: the grammar's mask, plus the budget guard."""

    def __init__(
        self, tokens: GrammarTokens, grammar: str, max_tokens: int, *, param: str | None = None,
    ) -> None:
        import llguidance
        import llguidance.numpy
        import numpy as np

        self._np = np
        self._fill = llguidance.numpy.fill_next_token_bitmask
        self.tokens = tokens
        self.matcher = llguidance.LLMatcher(tokens.ll, grammar)
        self.param = param
        if self.matcher.is_error():
            raise self._refused()
        self.bitmask = llguidance.numpy.allocate_token_bitmask(1, tokens.vocab_size)
        self._scratch = llguidance.numpy.allocate_token_bitmask(1, tokens.vocab_size)
        self.max_tokens = max_tokens
        self.closer = JsonCloser()
        self.consumed = 0
        self._started = False
        #: tokens the output needs to be closed, as last measured (closing_need), and when
        self.need: int | None = None
        self._measured_at = 0
        self._measured_shape: tuple[str, int, int, int] | None = None
        #: True once the budget guard chose among the allowed tokens
        self.guard_used = False

    def __call__(self, context: Any, logits: Any) -> Any:
        import mlx.core as mx

        if self._started:
            token = int(context.reshape(-1)[-1].item())
            if not self.matcher.consume_token(token):
                raise self._refused(token)
            self.closer.feed(self.tokens.token_bytes(token))
            self.consumed += 1
        self._started = True
        allowed = self._allowed(self.matcher, self.bitmask, logits.shape[-1])
        self._guard(allowed)
        return mx.where(mx.array(allowed), logits, mx.array(-mx.inf, dtype=logits.dtype))

    def _refused(self, token: int | None = None) -> Exception:
        """The matcher's error, one bounded line: the request's fault (400) when the grammar
        proved too complex for the parser; a :class:`ConstraintError` when a masked token broke it."""
        error = quote(self.matcher.get_error())
        too_complex = self.matcher.stop_reason() == "ParserTooComplex" or "Too many items" in error
        if token is None or too_complex:
            return InvalidRequest(f"{self.param or 'the grammar'}: cannot be enforced: {error}",
                                  param=self.param)
        return ConstraintError(f"token {token} broke the grammar: {error}")

    def _allowed(self, matcher: Any, bitmask: Any, width: int) -> Any:
        """The tokens ``matcher`` allows next, as a boolean array of ``width``."""
        np = self._np
        self._fill(matcher, bitmask)
        bits = np.unpackbits(bitmask.view(np.uint8), bitorder="little")
        allowed = np.zeros(width, dtype=bool)
        n = min(width, bits.shape[0])
        allowed[:n] = bits[:n].astype(bool)
        return allowed

    def _guard(self, allowed: Any) -> None:
        """When the tokens left come down to the closing need, keep only the allowed tokens
        that bring the end closest (:meth:`_closest`)."""
        left = self.max_tokens - self.consumed - 1  # tokens after this one (the last is the stop)
        need = self.need
        stale = self.consumed - self._measured_at >= MEASURE_EVERY
        near = need is not None and left <= 2 * need + NEAR_END
        if need is None or stale or (near and self.closer.shape() != self._measured_shape):
            need = self.need = self.closing_need(min(MAX_NEED, left + 1))
            self._measured_at, self._measured_shape = self.consumed, self.closer.shape()
        if left > need + SLACK:  # room for the need after this token: the model chooses
            return
        if self.matcher.is_accepting():  # complete: end it (a number could go on growing)
            chosen = [t for t in self.tokens.ll.eos_tokens if t < len(allowed) and allowed[t]]
        else:
            chosen = self._step(allowed, self.closer)
        if not chosen:
            return
        allowed[:] = False
        allowed[chosen] = True
        self.guard_used = True

    def _step(self, allowed: Any, closer: JsonCloser) -> list[int]:
        """The guard's choice: the closest tokens, or when no closing token is allowed yet (a
        character's remaining bytes, a key's name, a minLength), the first allowed one."""
        return self._closest(allowed, closer) or [int(t) for t in self._np.nonzero(allowed)[0][:1]]

    def _closest(self, allowed: Any, closer: JsonCloser) -> list[int]:
        """The allowed tokens that bring the end closest; empty when none ends the string or
        number being written.

        Candidates are the allowed tokens holding a closing byte, the short ones
        first. Ranked by, in order: not merely lengthening the string or number
        being written; fewest containers left open; fewest bytes still needed.
        The grammar has already removed every token that would make the JSON
        invalid, so required keys and enum values still get written.
        """
        ids = self.tokens.closer_ids
        if not len(ids):
            return []
        np = self._np
        candidates = np.nonzero(allowed[ids])[0]
        short = self.tokens.short
        if short is not None and len(short):
            first = short[allowed[ids[short]]]
            if len(first):
                chosen = self._rank(first, closer)
                if chosen:
                    return chosen
        return self._rank(candidates, closer)

    def _rank(self, positions: Any, closer: JsonCloser) -> list[int]:
        ids = self.tokens.closer_ids
        best: tuple[bool, int, int] | None = None
        chosen: list[int] = []
        for pos in positions:
            c = closer.copy()
            c.feed(self.tokens.closer_bytes[pos])
            rank = (c.lengthens(closer), len(c.stack), c.distance())
            if best is None or rank < best:
                best, chosen = rank, [int(ids[pos])]
            elif rank == best:
                chosen.append(int(ids[pos]))
        return [] if best is None or best[0] else chosen

    def closing_need(self, limit: int) -> int:
        """Tokens the output needs, from the grammar's current state, to reach a state where
        it may end (at most ``limit``): a copy of the matcher walked the guard's way."""
        matcher = self.matcher.deep_copy()
        closer = self.closer.copy()
        width = self.tokens.vocab_size
        n = 0
        while n < limit:
            if matcher.is_accepting() or matcher.is_stopped():
                return n
            forced = list(matcher.compute_ff_tokens())
            if not forced:
                chosen = self._step(self._allowed(matcher, self._scratch, width), closer)
                if not chosen:
                    return limit
                forced = chosen[:1]
            for token in forced:
                if not matcher.consume_token(token):
                    return limit
                closer.feed(self.tokens.token_bytes(token))
                n += 1
        return limit


class GrammarCache:
    """Per-engine, built lazily on the MLX thread: the tokenizer wrapped for llguidance."""

    def __init__(self) -> None:
        self._tokens: GrammarTokens | None = None
        self._lock = threading.Lock()

    def tokens(self, tokenizer: Any, vocab_size: int) -> GrammarTokens:
        with self._lock:
            if self._tokens is None or self._tokens.vocab_size != vocab_size:
                self._tokens = grammar_tokens(tokenizer, vocab_size)
            return self._tokens


def logits_processors(
    request: GenerationRequest, tokenizer: Any, vocab_size: int, cache: GrammarCache
) -> list[GrammarProcessor]:
    """The processors of one request (empty without a constraint). Pure CPU work, no MLX."""
    if request.constraint is None:
        return []
    tokens = cache.tokens(tokenizer, vocab_size)
    grammar = grammar_for(request.constraint, request, tokens.special)
    param = _param(request.constraint)
    return [GrammarProcessor(tokens, grammar, request.max_tokens, param=param)]


def has_grammar(request: GenerationRequest) -> bool:
    return any(isinstance(p, GrammarProcessor) for p in request.logits_processors)


async def with_grammar(
    request: GenerationRequest, tokenizer: Any, vocab_size: int, cache: GrammarCache
) -> GenerationRequest:
    """``request`` with its constraint's processor added to ``logits_processors``.

    Once: a request prepared again (the engine's ``generate`` prepares what the
    HTTP layer prepared) keeps the processor it has. On a worker thread: the
    first one wraps the vocabulary for llguidance (about a second for 150k
    tokens), and a grammar compiles in milliseconds.
    """
    if request.constraint is None or has_grammar(request):
        return request
    made = await trio.to_thread.run_sync(
        partial(logits_processors, request, tokenizer, vocab_size, cache), abandon_on_cancel=True
    )
    return replace(request, logits_processors=(*request.logits_processors, *made))
