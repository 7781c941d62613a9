"""Facts about a large JSON request body, read in a child process: the event loop never parses it.

Parsing JSON holds the GIL for the whole document (about 6 ms a megabyte
here), in any thread; a 30 MB prompt parsed in the daemon stalls every other
request for 0.2-0.5 s. So a generation body over :data:`INLINE_BYTES` is first
read by this module run as a script (``python -I -S bodyscan.py``, stdlib only,
about 20 ms to start) in a child process, which reports the model it names
and how many characters of prompt text it carries. A prompt longer than the
model could take is refused from those facts (400 ``context_length_exceeded``);
only a body that passes is parsed in the daemon.

The prompt characters counted here are those of
:func:`mlxd.engines.text.prompt_limits.prompt_chars` (which counts a validated
request): a completion's ``prompt`` (a string, or a list of one), a chat's
string ``content`` and ``text`` parts.
"""

from __future__ import annotations

import json
import sys
from typing import Any

#: generation bodies up to this size are parsed on the event loop (a few milliseconds)
INLINE_BYTES = 1 << 20


def body_prompt_chars(body: dict[str, Any]) -> int:
    """Characters of prompt text in a raw (not yet validated) generation body."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    total = len(prompt) if isinstance(prompt, str) else 0
    messages = body.get("messages")
    for m in messages if isinstance(messages, list) else ():
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(
                len(p["text"])
                for p in content
                if isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            )
    return total


def facts(raw: bytes) -> dict[str, Any]:
    """``{"model", "prompt_chars"}`` of a body, or ``{"error"}`` if it is not valid JSON."""
    try:
        body = json.loads(raw)
    except ValueError as e:
        return {"error": f"the request body is not valid JSON: {e}"}
    except RecursionError:
        return {"error": "the request body is nested too deeply"}
    if not isinstance(body, dict):
        return {"model": None, "prompt_chars": 0}
    model = body.get("model")
    return {
        "model": model if isinstance(model, str) else None,
        "prompt_chars": body_prompt_chars(body),
    }


def main() -> None:
    sys.stdout.write(json.dumps(facts(sys.stdin.buffer.read())))


if __name__ == "__main__":
    main()
