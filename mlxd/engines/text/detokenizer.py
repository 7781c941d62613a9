"""Streaming detokenization that holds back only what can still become a character.

mlx-lm's ``BPEStreamingDetokenizer`` (byte-level BPE: Llama 3, Qwen, GPT-2 and
the demo models) keeps every byte since its last flush until the decoded text
no longer *ends* with U+FFFD. A token that is an invalid UTF-8 byte on its own
(a lone continuation byte, which no later byte can complete) therefore holds
the stream back until some later token happens to end on a whole character,
possibly until the end of the generation: the client sees nothing, and each
token re-decodes everything held (quadratic in the hold). A model sampled at a
high temperature, a fine-tune with a broken vocabulary or a random-weight demo
model emit such bytes.

:class:`Utf8BPEDetokenizer` feeds the token bytes through Python's incremental
UTF-8 decoder with ``errors="replace"``: bytes that can never form a character
come out at once as U+FFFD, and only a valid but incomplete prefix (at most 3
bytes of one multi-byte character) waits for the next token. The final text is
exactly mlx-lm's (both equal one decode of all the bytes with ``replace``, with
the same leading-space trim and the same wait after a lone space token);
only the timing differs, and byte 0x00, which is NUL here as in the tokenizer's
own decode (mlx-lm's ``add_token`` tests each byte for truth and sends its
stand-in character). :func:`stream_bytes_promptly` puts it into an
``mlx_lm`` ``TokenizerWrapper`` after a load, so both decode paths (serial
``stream_generate`` and the batch loop) use it.
"""

from __future__ import annotations

import codecs
import copy
from typing import Any

from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, _byte_decoder

_SPACE = 32


class Utf8BPEDetokenizer(BPEStreamingDetokenizer):
    """A byte-level BPE detokenizer that never waits on bytes that cannot become text."""

    def reset(self) -> None:
        super().reset()  # type: ignore[no-untyped-call]
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._pending = ""  # decoded text not yet in self.text (after a lone space token)

    def _token_bytes(self, piece: str) -> bytes:
        table = _byte_decoder()
        out = bytearray()
        for c in piece:
            b = table.get(c)
            if b is None:  # not a byte-level character (an added token's text)
                out.extend(c.encode("utf-8"))
            else:
                out.append(b)
        return bytes(out)

    def add_token(self, token: int) -> None:
        self.tokens.append(token)
        piece = self.tokenmap[token] if token < len(self.tokenmap) else "!"  # as mlx-lm does
        self._pending += self._decoder.decode(self._token_bytes(piece))
        # as mlx-lm: a lone space waits for the next token (the leading space is trimmed)
        if len(piece) == 1 and _byte_decoder().get(piece) == _SPACE:
            return
        if self._pending:
            self.text += self._maybe_trim_space(self._pending)  # type: ignore[no-untyped-call]
            self._pending = ""

    def finalize(self) -> None:
        self._pending += self._decoder.decode(b"", final=True)
        self.text += self._maybe_trim_space(self._pending)  # type: ignore[no-untyped-call]
        self._pending = ""


def stream_bytes_promptly(tokenizer: Any) -> None:
    """Give a loaded ``TokenizerWrapper`` the prompt byte-level detokenizer (module docstring).

    A tokenizer that mlx-lm does not detokenize as byte-level BPE keeps its own.
    """
    current = getattr(tokenizer, "_detokenizer", None)
    if type(current) is not BPEStreamingDetokenizer:
        return
    mine = copy.copy(current)  # shares the token map; reset() gives it its own state
    mine.__class__ = Utf8BPEDetokenizer
    mine.reset()  # type: ignore[no-untyped-call]
    tokenizer._detokenizer = mine
