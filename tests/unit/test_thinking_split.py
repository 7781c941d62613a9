"""The thinking splitter: reasoning and answer told apart across deltas, markers never leaked."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from mlxd.engines.base import ThinkMarkers
from mlxd.http.thinking import ThinkingSplitter, split_whole

OPEN = ThinkMarkers("<think>", "</think>", open=True)
CLOSED = ThinkMarkers("<think>", "</think>", open=False)


def test_an_open_block_ends_at_its_marker_split_across_deltas() -> None:
    """Text before '</think>' is thinking, after it the answer, with the marker cut across deltas."""
    s = ThinkingSplitter(OPEN)
    out = s.feed("plan a") + s.feed("nd b</th") + s.feed("ink>the answer") + s.flush()
    assert "".join(t for k, t in out if k) == "plan and b"
    assert "".join(t for k, t in out if not k) == "the answer"
    assert all("<" not in t for _, t in out)


def test_a_closed_prompt_starts_in_the_answer_and_a_block_may_open_later() -> None:
    """Without an open block, text is the answer until '<think>' opens one."""
    assert split_whole(CLOSED, "hi <think>hmm</think> bye") == [(False, "hi "), (True, "hmm"), (False, " bye")]
    assert split_whole(None, "hi <think>") == [(False, "hi <think>")]


def test_a_held_prefix_that_is_no_marker_comes_out() -> None:
    """A tail like '</th' is held back and released as text when it turns out not to be a marker."""
    s = ThinkingSplitter(OPEN)
    assert s.feed("a</th") == [(True, "a")]
    assert s.feed("x") == [(True, "</thx")]
    assert s.feed("</t") == [] and s.flush() == [(True, "</t")]


@given(st.lists(st.sampled_from(["a", "<", "/", "think", ">", "</think>", "<think>", "b c"]), max_size=30),
       st.integers(1, 7))
def test_any_split_into_deltas_gives_the_whole_splits_pieces(parts: list[str], width: int) -> None:
    """However the text is cut into deltas, the pieces joined by kind equal the whole text's split."""
    text = "".join(parts)
    s = ThinkingSplitter(OPEN)
    pieces = [p for i in range(0, len(text), width) for p in s.feed(text[i:i + width])] + s.flush()
    joined: list[tuple[bool, str]] = []
    for kind, t in pieces:
        if joined and joined[-1][0] == kind:
            joined[-1] = (kind, joined[-1][1] + t)
        else:
            joined.append((kind, t))
    assert joined == split_whole(OPEN, text)
