"""One rule for every string a JSON request body carries: it must be valid Unicode.

JSON lets a body carry a lone UTF-16 surrogate (``"\\ud800"``, or the bytes
``ED A0 80`` that Python's decoder lets through): no tokenizer, template,
grammar or UTF-8 writer can take one, and each used to fail in its own way (a
500 from nine fields). So every JSON body is checked once, where it is read
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
carry one, so most bodies are not looked at again; the others are encoded
whole at C speed, and only a body that fails is walked, to name the string.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

from mlxd.errors import InvalidRequest

#: a ``\\u`` escape of a surrogate (D800-DFFF), or a UTF-8 encoded surrogate
_MAY_HOLD_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")
_SURROGATE = re.compile("[\ud800-\udfff]")
_PLAIN_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_\-]*")

Part = str | int
#: characters of a key shown in a path
MAX_KEY_SHOWN = 64


def json_path(parts: list[Part] | tuple[Part, ...]) -> str:
    """``["messages", 1, "content"]`` -> ``messages[1].content``; other keys quoted as JSON."""
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        elif len(part) <= MAX_KEY_SHOWN and _PLAIN_KEY.fullmatch(part):
            out += f".{part}" if out else part
        else:  # quoted, and cut: a key may be megabytes long
            shown = json.dumps(part[:MAX_KEY_SHOWN])
            out += f"[{shown[:-1]}...\"]" if len(part) > MAX_KEY_SHOWN else f"[{shown}]"
    return out


def check_text(raw: bytes | str, body: object) -> None:
    """Refuse (400) a string of ``body`` (parsed from ``raw``), key or value, that is not valid Unicode."""
    data = raw if isinstance(raw, bytes) else raw.encode("utf-8", "surrogatepass")
    if _MAY_HOLD_SURROGATE.search(data) is None:
        return
    try:  # the whole body at C speed (a body of a million strings: 0.3 s, not 4 s of walking)
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        pass
    else:
        return  # escapes of valid pairs only
    found = _find(body)
    if found is not None:
        path, text, is_key = found
        where = json_path(path) or "the body"
        at = _SURROGATE.search(text)
        assert at is not None
        raise InvalidRequest(
            f"{where}: {'this key' if is_key else 'this string'} is not valid Unicode: a lone "
            f"surrogate (\\u{ord(at.group()):04x}) at character {at.start()}",
            param=where,
        )


def _bad(text: str) -> bool:
    return not text.isascii() and _SURROGATE.search(text) is not None


def _find(body: object) -> tuple[list[Part], str, bool] | None:
    """The path of the first string (in document order) with a surrogate, the string, and
    whether it is a key; None if there is none. Iterative: bodies nest as deep as JSON allows."""
    if isinstance(body, str):
        return ([], body, False) if _bad(body) else None
    if not isinstance(body, dict | list):
        return None
    # each frame: the container's items (an iterator of (key or index, value)), and the key
    # of the child being walked (None until one is)
    frames: list[tuple[Iterator[tuple[Part, object]], list[Part]]] = []

    def push(container: dict[str, object] | list[object]) -> None:
        items = iter(container.items()) if isinstance(container, dict) else enumerate(container)
        frames.append((items, []))

    def path(last: Part) -> list[Part]:
        return [*(frame[1][0] for frame in frames[:-1]), last]

    push(body)
    while frames:
        items, current = frames[-1]
        for key, item in items:
            if isinstance(key, str) and _bad(key):
                return path(key), key, True
            if isinstance(item, str):
                if _bad(item):
                    return path(key), item, False
            elif isinstance(item, dict | list):
                current[:] = [key]
                push(item)
                break
        else:
            frames.pop()
    return None
