"""Stop strings: the streamed text is the output cut at the first stop string, and no part of one leaks."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from mlxd.engines.text.streaming import StopText

alphabet = st.sampled_from("ab\n ")
texts = st.text(alphabet, max_size=40)
stops = st.lists(st.text(alphabet, min_size=1, max_size=4), max_size=3)


@st.composite
def chunked(draw: st.DrawFn) -> tuple[str, list[str]]:
    text = draw(texts)
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=10)))
    bounds = [0, *cuts, len(text)]
    return text, [text[a:b] for a, b in itertools.pairwise(bounds)]


def reference(pieces: list[str], stop_strings: list[str]) -> tuple[str, bool]:
    """Generation stops after the first token that completes a stop string; the text is cut at
    the earliest stop string present then (a longer one still incomplete does not count)."""
    text = ""
    for piece in pieces:
        text += piece
        hits = [i for s in stop_strings if (i := text.find(s)) >= 0]
        if hits:
            return text[: min(hits)], True
    return text, False


@given(chunked(), stops)
def test_streamed_text_equals_the_text_cut_at_the_first_stop(
    case: tuple[str, list[str]], stop_strings: list[str]
) -> None:
    """However the text is split into tokens, the sent pieces join to the text cut at the first stop string."""
    _text, pieces = case
    matcher = StopText(tuple(stop_strings))
    sent: list[str] = []
    hit = False
    for piece in pieces:
        out, hit = matcher.feed(piece)
        sent.append(out)
        # nothing sent so far may contain a stop string
        assert not any(s in "".join(sent) for s in stop_strings)
        if hit:
            break
    if not hit:
        sent.append(matcher.flush())
    assert ("".join(sent), hit) == reference(pieces, stop_strings)


@given(chunked(), stops)
def test_a_prefix_of_a_stop_string_is_held_until_resolved(
    case: tuple[str, list[str]], stop_strings: list[str]
) -> None:
    """Before the end, the unsent tail is exactly the longest suffix that could still start a stop string."""
    _text, pieces = case
    matcher = StopText(tuple(stop_strings))
    for piece in pieces:
        _, hit = matcher.feed(piece)
        if hit:
            return
        held = matcher.text[matcher.emitted :]
        assert held == "" or any(s.startswith(held) for s in stop_strings)
        longest = max((len(s) for s in stop_strings), default=0)
        for k in range(len(held) + 1, min(longest, len(matcher.text) + 1)):
            assert not any(s.startswith(matcher.text[-k:]) for s in stop_strings)


def test_without_stop_strings_everything_is_sent_at_once() -> None:
    """With no stop strings each piece is sent as it comes."""
    m = StopText(())
    assert m.feed("hello") == ("hello", False)
    assert m.feed(" world") == (" world", False)
    assert m.flush() == ""
