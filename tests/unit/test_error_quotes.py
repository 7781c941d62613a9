"""Error messages quote a foreign error's first line only, bounded: never a whole grammar or prompt."""

from __future__ import annotations

from mlxd.errors import MAX_QUOTED, InvalidRequest, describe_error, quote


def test_a_long_multiline_foreign_error_is_quoted_as_one_bounded_line() -> None:
    """A parser error carrying its 60 KB state dump becomes ``Type: first line...`` of at most MAX_QUOTED characters."""
    dump = "parser error: Too many items " + "x" * 1000 + "\n<state>\n" + "{\"rows\": 1}\n" * 5000
    text = describe_error(RuntimeError(dump))
    assert text.startswith("RuntimeError: parser error: Too many items")
    assert "\n" not in text and text.endswith("...")
    assert len(text) == len("RuntimeError: ") + MAX_QUOTED + 3


def test_short_errors_and_mlxd_errors_are_kept_whole() -> None:
    """A short first line is quoted as it is; an MlxdError's own message is never cut."""
    assert quote("  short\nsecond line") == "short"
    assert describe_error(ValueError("")) == "ValueError"
    own = InvalidRequest("x" * 1000)
    assert describe_error(own) == own.message
