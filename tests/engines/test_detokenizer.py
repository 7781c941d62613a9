"""The byte-level detokenizer streams text as soon as it is text, and ends with mlx-lm's text."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, _byte_decoder
from mlx_lm.utils import load_tokenizer

from mlxd.engines.text.detokenizer import Utf8BPEDetokenizer, stream_bytes_promptly


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    tok = load_tokenizer(tiny_model_dir)
    stream_bytes_promptly(tok)
    return tok


def byte_token(tok: Any, b: int) -> int:
    """The demo vocabulary's token for the single byte ``b``."""
    char = {v: k for k, v in _byte_decoder().items()}[b]
    return int(tok.vocab[char])


def pieces(detok: Any, tokens: list[int]) -> list[str]:
    out = []
    for t in tokens:
        detok.add_token(t)
        out.append(detok.last_segment)
    detok.finalize()
    out.append(detok.last_segment)
    return out


def test_the_loaded_tokenizer_gets_it_and_each_caller_its_own_state(tokenizer: Any) -> None:
    """A byte-level tokenizer's detokenizer is replaced, and each copy starts empty."""
    a, b = tokenizer.detokenizer, tokenizer.detokenizer
    assert type(a) is Utf8BPEDetokenizer and a is not b
    a.add_token(byte_token(tokenizer, 0x41))
    assert a.text == "A" and b.text == ""


def test_an_impossible_byte_comes_out_at_once(tokenizer: Any) -> None:
    """A lone continuation byte is U+FFFD at its own token, not at the end of the stream."""
    lone = byte_token(tokenizer, 0xB2)
    assert pieces(tokenizer.detokenizer, [lone] * 4) == ["\ufffd"] * 4 + [""]
    # mlx-lm's own detokenizer holds all four until the end
    theirs = BPEStreamingDetokenizer(tokenizer._tokenizer)
    assert pieces(theirs, [lone] * 4) == ["", "", "", "", "\ufffd" * 4]


def test_a_split_character_waits_for_its_last_byte(tokenizer: Any) -> None:
    """'é' sent as two byte tokens appears whole with the second; nothing broken is sent."""
    first, second = byte_token(tokenizer, 0xC3), byte_token(tokenizer, 0xA9)
    a = byte_token(tokenizer, 0x41)
    assert pieces(tokenizer.detokenizer, [a, first, second, a]) == ["A", "", "é", "A", ""]


def test_a_cut_off_prefix_is_replaced_when_it_cannot_be_completed(tokenizer: Any) -> None:
    """A lead byte followed by a plain letter: U+FFFD then the letter, at the letter's token."""
    lead, a = byte_token(tokenizer, 0xC3), byte_token(tokenizer, 0x41)
    assert pieces(tokenizer.detokenizer, [lead, a]) == ["", "\ufffdA", ""]
    assert pieces(tokenizer.detokenizer, [a, lead]) == ["A", "", "\ufffd"]


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_the_final_text_is_mlx_lms(tokenizer: Any, data: st.DataObject) -> None:
    """For any token sequence, the streamed pieces add up to mlx-lm's final text."""
    theirs = BPEStreamingDetokenizer(tokenizer._tokenizer)
    table = _byte_decoder()
    # tokens made of byte-level characters (mlx-lm's finalize cannot decode others), and
    # none with byte 0x00, which mlx-lm's add_token streams as 'Ā' (see the test below)
    usable = [
        i
        for i, p in enumerate(theirs.tokenmap)
        if p and all(c in table for c in p) and all(table[c] for c in p)
    ]
    space = byte_token(tokenizer, 0x20)
    bytes_ = [byte_token(tokenizer, b) for b in (0x20, 0x41, 0xB2, 0xC3, 0xA9, 0xE2, 0x82, 0xAC)]
    token = st.one_of(st.sampled_from(usable), st.sampled_from(bytes_), st.just(space))
    tokens = data.draw(st.lists(token, max_size=24))
    mine = pieces(tokenizer.detokenizer, tokens)
    assert "".join(mine) == "".join(pieces(theirs, tokens)) == theirs.text


def test_byte_zero_is_the_nul_character_as_the_tokenizer_decodes_it(tokenizer: Any) -> None:
    """mlx-lm's add_token tests each byte for truth, so byte 0x00 streams as its stand-in
    character 'Ā' (its finalize decodes it right); ours is the tokenizer's own decode."""
    nul = byte_token(tokenizer, 0x00)
    assert tokenizer._tokenizer.decode([nul]) == "\x00"
    assert pieces(tokenizer.detokenizer, [nul]) == ["\x00", ""]
    assert "".join(pieces(BPEStreamingDetokenizer(tokenizer._tokenizer), [nul])) == "\u0100"
