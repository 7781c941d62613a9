"""The official SDK clients (openai, anthropic) pointed at a served daemon, for the real-client tests.

They are blocking clients: :func:`run` calls one in a worker thread so the
daemon (same Trio loop) keeps serving. ``max_retries=0``: a refusal is seen
as it is, not retried.
"""

from __future__ import annotations

from typing import Any

import anthropic
import openai
import trio

from tests.support.daemon import Served


def openai_client(served: Served, **kw: Any) -> openai.OpenAI:
    c = openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, **kw)
    served.on_close(c.close)
    return c


def anthropic_client(served: Served, **kw: Any) -> anthropic.Anthropic:
    c = anthropic.Anthropic(base_url=served.url, api_key=kw.pop("api_key", "unused"), max_retries=0, **kw)
    served.on_close(c.close)
    return c


async def run(fn: Any) -> Any:
    """``fn()`` (a blocking client call) in a worker thread."""
    return await trio.to_thread.run_sync(fn)
