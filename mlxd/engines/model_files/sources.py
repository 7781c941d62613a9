"""Where a model's files come from: a local directory, or a Hugging Face repo id.

Theory of operation. :func:`resolve_source` turns a config ``source`` into a
local directory. Whether a source is a path or a repo id is decided by one rule,
:func:`mlxd.config.classify_source` (the config reader applies it; this module
only when a config was built in code). A path is used as it is; a repo id
(``org/name``) is fetched with ``huggingface_hub.snapshot_download``
into the normal Hugging Face cache (``HF_HOME``/``HF_HUB_CACHE``), so a model
downloaded once is found again offline.

The download runs on a worker thread (it does no MLX work, so it does not need
the engine's MLX thread) and reports its bytes through a tqdm subclass: the bar
draws on stderr like every Hugging Face download, and each update is forwarded
into Trio as a :class:`~mlxd.engines.base.LoadProgress` (``downloading``,
``bytes_done``/``bytes_total``) for the model's status.

Bounded time. A stall watchdog cancels the download when the Hub has given no
sign of life (no answer, no new bytes) for ``MLXD_HUB_TIMEOUT_S`` seconds
(default 30); every progress update pushes the deadline back, so a large but
moving download is never cut. Offline (``HF_HUB_OFFLINE=1``), a name that does
not resolve, a refused connection or a black-holed one all end in
:class:`~mlxd.errors.LoadFailed` with a readable reason, never in a hang. The
abandoned worker thread stops at its next progress update (a cancel flag), and
its socket is bounded by the same timeout.
"""

from __future__ import annotations

import importlib
import os
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import trio

from mlxd.config import SourceKind, classify_source
from mlxd.engines.base import LoadProgress, ProgressCallback
from mlxd.engines.runtime.mlx_thread import call_soon
from mlxd.errors import LoadFailed, describe_error

HUB_TIMEOUT_ENV = "MLXD_HUB_TIMEOUT_S"
DEFAULT_HUB_TIMEOUT_S = 30.0

#: what mlx-lm's own loader downloads (``mlx_lm.utils.DEFAULT_ALLOW_PATTERNS``)
TEXT_PATTERNS = (
    "*.json",
    "model*.safetensors",
    "*.py",
    "tokenizer.model",
    "*.tiktoken",
    "tiktoken.model",
    "*.txt",
    "*.jsonl",
    "*.jinja",
)
#: what mlx-vlm's loader downloads (``mlx_vlm.utils.get_model_path``)
VISION_PATTERNS = (
    "*.json",
    "*.jsonl",
    "*.safetensors",
    "*.py",
    "*.model",
    "*.tiktoken",
    "*.txt",
    "*.jinja",
)

#: seconds between two progress reports forwarded into Trio (the bar itself draws as tqdm does)
_REPORT_EVERY_S = 0.1


class DownloadCancelled(Exception):
    """Raised inside the download thread when the load was cancelled or timed out."""


def hub_timeout() -> float:
    """Seconds without any sign of life from the Hub before a download fails (``MLXD_HUB_TIMEOUT_S``)."""
    raw = os.environ.get(HUB_TIMEOUT_ENV)
    if not raw:
        return DEFAULT_HUB_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        raise LoadFailed(f"{HUB_TIMEOUT_ENV}={raw!r} is not a number of seconds") from None
    if value <= 0:
        raise LoadFailed(f"{HUB_TIMEOUT_ENV}={raw!r} must be positive")
    return value


def hub_offline() -> bool:
    """True when ``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) is set, read now (not at import)."""
    raw = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    if raw.strip().upper() in {"1", "ON", "YES", "TRUE"}:
        return True
    try:
        from huggingface_hub import constants

        return bool(constants.HF_HUB_OFFLINE)
    except ImportError:
        return False


def local_path(source: str, kind: SourceKind | None = None) -> Path | None:
    """The local directory a source names, or None if it is to be fetched from the Hub.

    ``kind`` is what the config decided (:func:`mlxd.config.classify_source`, the
    one rule); a config built in code leaves it None and the rule is applied here,
    relative to the working directory. Raises :class:`LoadFailed` for a source
    that is neither (a typo in a path must not become a download), and for a
    local path that is missing or is a file.
    """
    if kind is None:
        try:
            kind = classify_source(source, Path.cwd())
        except ValueError as e:
            raise LoadFailed(str(e)) from None
    if kind == "hub":
        return None
    path = Path(source).expanduser()
    if not path.exists():
        raise LoadFailed(f"{source}: no such directory")
    if not path.is_dir():
        raise LoadFailed(f"{source}: is a file; a model source is a directory or a Hugging Face repo id")
    return path


async def resolve_source(
    source: str,
    progress: ProgressCallback,
    *,
    kind: SourceKind | None = None,
    allow_patterns: tuple[str, ...] = TEXT_PATTERNS,
    stall_timeout_s: float | None = None,
    endpoint: str | None = None,
) -> Path:
    """The local directory of ``source``, downloading it into the Hugging Face cache if needed."""
    path = local_path(source, kind)
    if path is not None:
        return path
    return await download(
        source,
        progress,
        allow_patterns=allow_patterns,
        stall_timeout_s=stall_timeout_s,
        endpoint=endpoint,
    )


async def download(
    repo_id: str,
    progress: ProgressCallback,
    *,
    allow_patterns: tuple[str, ...] = TEXT_PATTERNS,
    stall_timeout_s: float | None = None,
    endpoint: str | None = None,
) -> Path:
    """Fetch ``repo_id`` into the Hugging Face cache; cancellable, and bounded by a stall watchdog."""
    limit = hub_timeout() if stall_timeout_s is None else stall_timeout_s
    token = trio.lowlevel.current_trio_token()
    cancel = threading.Event()
    watchdog = trio.CancelScope(deadline=trio.current_time() + limit)

    def on_bytes(done: int, total: int | None) -> None:  # on the Trio thread
        if cancel.is_set():
            return  # a late report of an abandoned download
        watchdog.deadline = trio.current_time() + limit
        progress(
            LoadProgress(phase="downloading", bytes_done=done, bytes_total=total, detail=repo_id)
        )

    def report(done: int, total: int | None) -> None:  # on a download thread
        try:
            token.run_sync_soon(on_bytes, done, total)
        except trio.RunFinishedError:
            cancel.set()

    progress(
        LoadProgress(phase="downloading", detail=f"{repo_id}: contacting the Hugging Face Hub")
    )
    fetch = partial(
        fetch_snapshot,
        repo_id,
        allow_patterns=allow_patterns,
        report=report,
        cancel=cancel,
        etag_timeout=limit,
        endpoint=endpoint,
    )
    result: str | None = None
    try:
        with watchdog:
            result = await trio.to_thread.run_sync(fetch, abandon_on_cancel=True)
    finally:
        if result is None:
            cancel.set()
    if result is None:  # only the watchdog's own cancel gets here
        raise LoadFailed(
            f"{repo_id}: no answer from the Hugging Face Hub for {limit:g}s "
            f"(offline or unreachable?); set HF_HUB_OFFLINE=1 to use the local cache only, "
            f"or {HUB_TIMEOUT_ENV} to wait longer"
        )
    return Path(result)


def fetch_snapshot(
    repo_id: str,
    *,
    allow_patterns: tuple[str, ...],
    report: Callable[[int, int | None], None],
    cancel: threading.Event,
    etag_timeout: float,
    endpoint: str | None = None,
) -> str:
    """Blocking ``snapshot_download`` with progress and cancel; errors become :class:`LoadFailed`."""
    from huggingface_hub import snapshot_download

    bar = progress_bar_class(report, cancel)
    offline = hub_offline()
    try:
        return str(
            snapshot_download(
                repo_id,
                allow_patterns=list(allow_patterns),
                tqdm_class=bar,
                etag_timeout=etag_timeout,
                endpoint=endpoint,
                local_files_only=offline,
            )
        )
    except DownloadCancelled:
        raise
    except Exception as e:
        raise LoadFailed(describe_hub_error(repo_id, e, offline=offline)) from e


def describe_hub_error(repo_id: str, error: BaseException, *, offline: bool) -> str:
    """One readable line for a failed Hub fetch."""
    from huggingface_hub import errors as hf

    name = type(error).__name__
    if isinstance(error, hf.GatedRepoError):
        return f"{repo_id}: the repository is gated; accept its terms on huggingface.co and set HF_TOKEN"
    if isinstance(error, hf.RepositoryNotFoundError):
        return f"{repo_id}: no such repository on the Hugging Face Hub (or it is private: set HF_TOKEN)"
    if isinstance(error, hf.RevisionNotFoundError):
        return f"{repo_id}: the requested revision does not exist"
    if isinstance(error, hf.LocalEntryNotFoundError | hf.OfflineModeIsEnabled):
        if offline:
            return f"{repo_id}: not in the local Hugging Face cache, and HF_HUB_OFFLINE is set"
        cause = error.__cause__ or error.__context__
        reason = (
            f"{type(cause).__name__}: {cause}" if cause is not None else str(error).splitlines()[0]
        )
        return (
            f"{repo_id}: the Hugging Face Hub is unreachable ({reason}) "
            "and the model is not in the local cache"
        )
    if isinstance(error, hf.HfHubHTTPError):
        first = str(error).splitlines()[0] if str(error) else name
        return f"{repo_id}: the Hugging Face Hub answered with an error: {first}"
    if isinstance(error, OSError) and error.strerror:
        return f"{repo_id}: download failed: {error.strerror}"
    return f"{repo_id}: download failed: {name}: {error}"


def progress_bar_class(report: Callable[[int, int | None], None], cancel: threading.Event) -> type:
    """A ``tqdm_class`` for ``snapshot_download`` that draws on stderr and reports bytes.

    ``snapshot_download`` opens two byte bars (``huggingface_hub.snapshot_download``,
    fed by every file as it is written, and ``...snapshot_download.transfer``)
    and one bar counting files. Only the first is reported: its ``total`` grows
    as file downloads start, and cached files count as done at once.
    """
    base: Any = importlib.import_module("huggingface_hub.utils").tqdm

    class ProgressBar(base):  # type: ignore[misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            name = kwargs.get("name")
            self._mlxd_reports = kwargs.get("unit") == "B" and not str(name or "").endswith(
                ".transfer"
            )
            self._mlxd_done = int(kwargs.get("initial") or 0)
            self._mlxd_last = 0.0
            super().__init__(*args, **kwargs)
            if self._mlxd_reports:  # the Hub answered: the bars open after the file listing
                report(self._mlxd_done, int(self.total) if self.total else None)

        def update(self, n: float | None = 1) -> bool | None:
            if cancel.is_set():
                raise DownloadCancelled("download cancelled")
            out: bool | None = super().update(n)
            if self._mlxd_reports:
                self._mlxd_done += int(n or 0)
                total = int(self.total) if self.total else None
                now = time.monotonic()
                if now - self._mlxd_last >= _REPORT_EVERY_S or (total and self._mlxd_done >= total):
                    self._mlxd_last = now
                    report(self._mlxd_done, total)
            return out

    return ProgressBar


def demo_path(source: str) -> Path:
    """Where a demo model's source is (its files are written on the MLX thread if missing)."""
    return Path(source).expanduser()


def progress_sink(progress: ProgressCallback) -> Callable[[LoadProgress], None]:
    """A thread-safe wrapper that delivers ``progress`` calls on the Trio thread."""
    token = trio.lowlevel.current_trio_token()

    def report(p: LoadProgress) -> None:
        call_soon(token, progress, p)

    return report


def describe_load_error(e: BaseException) -> str:
    """One readable line for an exception raised by a model loader."""
    if isinstance(e, FileNotFoundError):
        return f"missing file: {e.filename or e}"
    if isinstance(e, ImportError):
        return f"a required package is missing: {e}"
    return describe_error(e)
