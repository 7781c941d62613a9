"""One rule for every string a JSON request body carries: it must be valid Unicode.

JSON lets a body carry a lone UTF-16 surrogate (``"\\ud800"``, or the bytes
``ED A0 80`` that Python's decoder lets through): no tokenizer, template,
grammar or UTF-8 writer can take one, and each used to fail in its own way (a
500 from nine fields). So every JSON body is walked once, where it is read
(:func:`mlxd.http.openai_api.read_json_body`, which every route that takes a
body uses), before any route looks at it: a string, key or value, with a lone
surrogate is a 400 :class:`~mlxd.errors.InvalidRequest` whose ``param`` is its
JSON path (``messages[1].content[0].text``; a key is shown quoted,
``tools[0].function.parameters.properties["a\\ud800"]``), rendered in the
route family's own error envelope (:mod:`mlxd.http.envelopes`).

NUL (``\\u0000``) is valid Unicode and is accepted: tokenizers encode it like
any other character (byte-level vocabularies have a token for it), and fields
that name things (``model``, tool names) refuse what they do not know anyway.

A body whose raw bytes hold no escape or UTF-8 sequence of a surrogate cannot
carry one, so most bodies are not walked at all.
"""

from __future__ import annotations

import json
import re

from mlxd.errors import InvalidRequest

#: a ``\\u`` escape of a surrogate (D800-DFFF), or a UTF-8 encoded surrogate
_MAY_HOLD_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")
_SURROGATE = re.compile("[\ud800-\udfff]")
_PLAIN_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_\-]*")

Part = str | int


def json_path(parts: list[Part] | tuple[Part, ...]) -> str:
    """``["messages", 1, "content"]`` -> ``messages[1].content``; other keys quoted as JSON."""
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        elif _PLAIN_KEY.fullmatch(part):
            out += f".{part}" if out else part
        else:
            out += f"[{json.dumps(part)}]"
    return out


def check_text(raw: bytes | str, body: object) -> None:
    """Refuse (400) a string of ``body`` (parsed from ``raw``), key or value, that is not valid Unicode."""
    data = raw if isinstance(raw, bytes) else raw.encode("utf-8", "surrogatepass")
    if _MAY_HOLD_SURROGATE.search(data) is None:
        return
    stack: list[tuple[tuple[Part, ...], object]] = [((), body)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            _check(value, path, key=False)
        elif isinstance(value, dict):
            items = list(value.items())
            for key, item in reversed(items):  # the stack pops them in document order
                stack.append(((*path, key), item))
            for key, _ in items:
                _check(key, (*path, key), key=True)
        elif isinstance(value, list):
            stack.extend(((*path, i), item) for i, item in reversed(list(enumerate(value))))


def _check(text: str, path: tuple[Part, ...], *, key: bool) -> None:
    found = _SURROGATE.search(text)
    if found is None:
        return
    where = json_path(path) or "the body"
    what = "this key" if key else "this string"
    raise InvalidRequest(
        f"{where}: {what} is not valid Unicode: a lone surrogate "
        f"(\\u{ord(found.group()):04x}) at character {found.start()}",
        param=where,
    )
