"""``POST /api/pull``: a Hugging Face repo into the local cache, with Ollama's NDJSON progress.

The model is a repo id (``org/name``, a ``:latest`` tag dropped), fetched by
the same download code as a model's load (:func:`mlxd.engines.model_files.sources.fetch_snapshot`:
the normal Hugging Face cache, offline mode, readable errors), with the
same stall rule: no sign of life from the Hub for ``MLXD_HUB_TIMEOUT_S``
seconds ends it. Lines: ``{"status": "pulling manifest"}``, then
``{"status": "pulling <repo>", "digest", "total", "completed"}`` as bytes
arrive, then ``{"status": "success"}``. mlxd serves the models its config
names: when no configured model has this source, a line before ``success``
says how to add it. An error is a last line ``{"error": "..."}`` (streamed),
or the error status with ``{"error": "..."}`` (``stream: false``).

The fetch runs on a thread started without awaiting it
(``trio.lowlevel.start_thread_soon``), so the response body, which must not
hold a nursery across ``yield``, can stream its progress: the thread reports
through Trio's token into a channel the body reads, and a body that ends
(the client left) sets the fetch's cancel flag, which the thread sees at its
next progress update.
"""

from __future__ import annotations

import hashlib
import math
import re
import threading
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

import outcome
import trio

from mlxd.config import Config
from mlxd.engines.model_files.sources import (
    TEXT_PATTERNS,
    VISION_PATTERNS,
    fetch_snapshot,
    hub_timeout,
)
from mlxd.errors import LoadFailed, MlxdError
from mlxd.http.bodies_ollama import PullProgress
from mlxd.http.fields import bad
from mlxd.http.structured import is_model_name

Message = tuple[str, Any, Any]


#: one part of a Hugging Face repo id (huggingface_hub's rule, in ASCII): word characters, '.'
#: and '-', starting and ending with a word character, at most 96
_PART = r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?"
#: a repo id as /api/pull takes it (a ``:latest`` tag is dropped); also the OpenAPI pattern
REPO_PATTERN = rf"^{_PART}/{_PART}(?::latest)?$"
#: what the Hub also refuses in a repo id (the OpenAPI document says ``not`` this)
REPO_REFUSED = r"--|\.\.|\.git(?::latest)?$"


def repo_of(raw: object) -> str:
    """The repo id a pull names (``org/name``; ``:latest`` dropped), or a 400 saying what mlxd pulls."""
    if not is_model_name(raw):
        raise bad("model", "is required: a Hugging Face repo id such as mlx-community/Qwen2.5-0.5B-Instruct-4bit")
    if not re.fullmatch(REPO_PATTERN, raw) or re.search(REPO_REFUSED, raw):
        raise bad("model", f"mlxd pulls Hugging Face repo ids (org/name), not Ollama library names (got {raw[:80]!r})")
    return raw.removesuffix(":latest")


def _configured(config: Config, repo: str) -> list[str]:
    return [m.name for m in config.models if m.source == repo]


def advice(config: Config, repo: str) -> str | None:
    """What to do for mlxd to serve ``repo`` (None: a configured model uses it already)."""
    if _configured(config, repo):
        return None
    return (f"mlxd serves the models its config names: add `- name: <name>` with `path: {repo}` "
            "under models: in the config, then POST /admin/reload (or send SIGHUP)")


async def pull_events(config: Config, repo: str) -> AsyncIterator[PullProgress]:
    """Ollama's progress objects for a pull of ``repo``; raises :class:`MlxdError` when it fails."""
    token = trio.lowlevel.current_trio_token()
    send, receive = trio.open_memory_channel[Message](math.inf)
    cancel = threading.Event()

    def post(kind: str, a: Any, b: Any) -> None:  # on the Trio thread
        try:
            send.send_nowait((kind, a, b))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            cancel.set()  # the body has gone

    def from_thread(kind: str, a: Any, b: Any = None) -> None:
        try:
            token.run_sync_soon(post, kind, a, b)
        except trio.RunFinishedError:
            cancel.set()

    mllm = any(m.mllm for m in config.models if m.source == repo)
    limit = hub_timeout()
    fetch = partial(fetch_snapshot, repo, allow_patterns=VISION_PATTERNS if mllm else TEXT_PATTERNS,
                    report=partial(from_thread, "bytes"), cancel=cancel, etag_timeout=limit)
    digest = "sha256:" + hashlib.sha256(repo.encode()).hexdigest()
    yield {"status": "pulling manifest"}
    trio.lowlevel.start_thread_soon(fetch, lambda result: from_thread("done", result))
    try:
        with receive:
            while True:
                message: Message | None = None
                with trio.move_on_after(limit):  # never across a yield
                    message = await receive.receive()
                if message is None:
                    raise LoadFailed(f"{repo}: no answer from the Hugging Face Hub for {limit:g}s "
                                     "(offline or unreachable?)")
                kind, a, b = message
                if kind == "done":
                    break
                yield {"status": f"pulling {repo}", "digest": digest, "total": b, "completed": a}
    finally:
        cancel.set()
    _unwrap(a)
    yield {"status": "verifying sha256 digest"}
    note = advice(config, repo)
    if note is not None:
        yield {"status": note}
    yield {"status": "success", "mlxd": {"repo": repo, "models": _configured(config, repo), "next": note}}


def _unwrap(result: outcome.Outcome[Any]) -> None:
    try:
        result.unwrap()
    except MlxdError:
        raise
    except Exception as e:  # fetch_snapshot translates the Hub's errors; anything else is named
        raise LoadFailed(f"download failed: {type(e).__name__}: {e}") from e
