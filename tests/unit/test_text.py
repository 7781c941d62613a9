"""The one text rule of request bodies (mlxd.http.text): where a lone surrogate is, named by its JSON path."""

from __future__ import annotations

import json

import pytest

from mlxd.errors import InvalidRequest
from mlxd.http.text import MAX_KEY_SHOWN, check_text, json_path


def refused(raw: bytes) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as exc:
        check_text(raw, json.loads(raw))
    return exc.value


@pytest.mark.parametrize(("raw", "param"), [
    (rb'{"messages": [{"content": "ok"}, {"content": [{"text": "a\ud800"}]}]}', "messages[1].content[0].text"),
    (rb'{"a": {"k\udc00": 1}}', 'a["k\\udc00"]'),
    (rb'{"a": [1, [2, [3, "\udbff"]]]}', "a[1][1][1]"),
    (rb'"\udfff"', "the body"),
    (b'{"model": "\xed\xa0\x80"}', "model"),  # a UTF-8 encoded surrogate, not an escape
    (rb'{"first": "\ud800", "second": "\udc00"}', "first"),  # document order
    (rb'{"tools": [{"x": 1}], "z": "\ud83d"}', "z"),  # a high surrogate with no low one
])
def test_a_lone_surrogate_is_named_by_its_json_path(raw: bytes, param: str) -> None:
    """A lone surrogate anywhere, key or value, escaped or raw UTF-8, is a 400 whose param is its path."""
    err = refused(raw)
    assert err.http_status == 400 and err.param == param
    assert err.message.startswith(f"{param}: ") and "lone surrogate" in err.message


@pytest.mark.parametrize("raw", [
    rb'{"text": "\ud83d\ude00 and \u00e9 and \u0000"}',  # a valid pair, an accent, a NUL
    '{"text": "😀"}'.encode(),
    rb'{"text": "\\ud800"}',  # an escaped backslash, then the letters ud800
    b'{"a": [1, 2.5, null, true, {}]}',
])
def test_valid_text_passes(raw: bytes) -> None:
    """Valid pairs, NUL, non-ASCII text and a backslash followed by "ud800" are accepted."""
    check_text(raw, json.loads(raw))


def test_a_body_nested_as_deep_as_json_allows_is_walked() -> None:
    """The walk is iterative: a surrogate 900 levels down is found and named, with no RecursionError."""
    raw = b"[" * 900 + rb'"\ud800"' + b"]" * 900
    assert refused(raw).param == "[0]" * 900


def test_a_long_key_is_cut_in_the_path() -> None:
    """A megabyte key with a surrogate is named by its first characters, so the error stays small."""
    key = "k" * 1_000_000 + "\ud800"
    raw = json.dumps({"a": {key: 1}}).encode()
    err = refused(raw)
    assert err.param == json_path(["a", key]) and len(err.message) < 300
    assert err.param.endswith('..."]') and "k" * MAX_KEY_SHOWN in err.param
