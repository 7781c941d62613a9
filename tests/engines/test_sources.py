"""Model sources: local paths, and Hugging Face repo ids that fail readably and in bounded time without a network."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from mlxd.config import ModelConfig
from mlxd.engines.base import LoadProgress
from mlxd.engines.mlx_text import MlxTextEngine
from mlxd.engines.model_files import sources
from mlxd.errors import LoadFailed

#: a repo id no test machine has in its cache
MISSING_REPO = "mlxd-tests/no-such-model-7f3a9c"


@pytest.fixture
def hf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty Hugging Face cache, so nothing is found locally."""
    cache = tmp_path / "hf-cache"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache


@pytest.fixture
def black_hole() -> Iterator[str]:
    """A TCP endpoint that accepts connections and never answers (a hung Hub)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
                held.append(conn)
            except OSError:
                continue

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{srv.getsockname()[1]}"
    finally:
        stop.set()
        t.join()
        for c in held:
            c.close()
        srv.close()


def test_local_paths_and_repo_ids_are_told_apart(tmp_path: Path) -> None:
    """An existing directory is local, org/name is a repo id, and anything else fails at once."""
    assert sources.local_path(str(tmp_path)) == tmp_path
    assert sources.local_path("mlx-community/Qwen2.5-0.5B-Instruct-4bit") is None
    for bad in ["/no/such/dir", "./relative/missing", "~/missing-model"]:
        with pytest.raises(LoadFailed, match="no such directory"):
            sources.local_path(bad)
    for bad in ["just-a-name", "a/b/c"]:
        with pytest.raises(LoadFailed, match="neither an existing local path"):
            sources.local_path(bad)
    f = tmp_path / "file.bin"
    f.write_bytes(b"x")
    with pytest.raises(LoadFailed, match="is a file"):
        sources.local_path(str(f))


def test_hub_timeout_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """MLXD_HUB_TIMEOUT_S sets the stall timeout; a bad value is a readable LoadFailed."""
    monkeypatch.delenv(sources.HUB_TIMEOUT_ENV, raising=False)
    assert sources.hub_timeout() == sources.DEFAULT_HUB_TIMEOUT_S
    monkeypatch.setenv(sources.HUB_TIMEOUT_ENV, "2.5")
    assert sources.hub_timeout() == 2.5
    monkeypatch.setenv(sources.HUB_TIMEOUT_ENV, "soon")
    with pytest.raises(LoadFailed, match="MLXD_HUB_TIMEOUT_S"):
        sources.hub_timeout()


async def test_offline_hub_fails_the_load_readably_and_fast(
    hf_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With HF_HUB_OFFLINE=1 a repo that is not cached fails the load at once, saying why."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    eng = MlxTextEngine(ModelConfig(name="remote", source=MISSING_REPO))
    t0 = time.monotonic()
    with pytest.raises(LoadFailed) as err:
        await eng.load(lambda _p: None)
    assert time.monotonic() - t0 < 5
    assert MISSING_REPO in err.value.message and "HF_HUB_OFFLINE" in err.value.message
    assert err.value.code == "model_load_failed"
    await eng.stop()


async def test_unreachable_hub_fails_the_load_within_a_bound(
    hf_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without a network (here: the real Hub address, unresolvable or refused) a load fails readably in bounded time."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv(sources.HUB_TIMEOUT_ENV, "3")
    eng = MlxTextEngine(ModelConfig(name="remote", source=MISSING_REPO))
    t0 = time.monotonic()
    with pytest.raises(LoadFailed) as err:
        await eng.load(lambda _p: None)
    elapsed = time.monotonic() - t0
    assert elapsed < 3 + 2, elapsed
    assert err.value.message.startswith(MISSING_REPO)
    await eng.stop()


async def test_a_hub_that_never_answers_is_cut_by_the_stall_watchdog(
    hf_cache: Path, black_hole: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Hub that accepts the connection and never answers fails after the stall timeout, not later."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    seen: list[LoadProgress] = []
    t0 = time.monotonic()
    with pytest.raises(LoadFailed, match=r"no answer from the Hugging Face Hub for 1s"):
        await sources.resolve_source(
            MISSING_REPO, seen.append, stall_timeout_s=1.0, endpoint=black_hole
        )
    elapsed = time.monotonic() - t0
    assert 0.9 < elapsed < 3, elapsed
    assert seen and seen[0].phase == "downloading"


async def test_progress_bar_reports_bytes_into_trio_and_honours_cancel() -> None:
    """The tqdm subclass forwards byte counts from a worker thread and stops on the cancel flag."""
    reports: list[tuple[int, int | None]] = []
    cancel = threading.Event()
    bar_cls = sources.progress_bar_class(lambda d, t: reports.append((d, t)), cancel)

    def download() -> None:
        bar = bar_cls(total=0, unit="B", name="huggingface_hub.snapshot_download", disable=True)
        files = bar_cls(total=2, unit="it", disable=True)  # the file counter is not reported
        bar.total = 3000
        for _ in range(3):
            bar.update(1000)
            files.update(1)
        cancel.set()
        with pytest.raises(sources.DownloadCancelled):
            bar.update(1)

    await trio.to_thread.run_sync(download)
    assert reports[0] == (0, None)  # the bar opened: the Hub answered
    assert reports[-1] == (3000, 3000)
    assert all(t in (None, 3000) for _, t in reports)
