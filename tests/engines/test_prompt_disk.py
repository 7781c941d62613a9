"""The prompt cache's disk tier on the tiny model: written when a residency ends and for long
prefixes as they are made, read by the next load of the same weights, damaged and foreign files
removed, never loaded, and the tier's size bound (LRU by last use)."""

from __future__ import annotations

import os
import shutil
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
import trio

from mlxd.config import DiskTier
from mlxd.engines.cache.prompt_disk import SUFFIX, TMP_PREFIX, PromptDisk, tier_usage, tokens_key
from mlxd.engines.mlx_text import MlxTextEngine
from mlxd.engines.scheduling import disk_writes
from tests.engines.mlx_helpers import collect, completion, tiny_config

#: about 160 tokens of the tiny tokenizer (short: written only when the residency ends)
SHORT = "hello world this is a tiny model " * 20
#: about 1,300 tokens (long: written once the model has been idle PERSIST_IDLE_S)
LONG = "hello world this is a tiny model " * 160


@asynccontextmanager
async def loaded(model_dir: Path, tier: DiskTier | None) -> AsyncIterator[MlxTextEngine]:
    eng = MlxTextEngine(tiny_config(model_dir, prompt_cache_disk=tier), prefill_step=64)
    await eng.load(lambda _p: None)
    try:
        yield eng
    finally:
        await eng.stop()


async def turn(model_dir: Path, tier: DiskTier | None, prompt: str) -> tuple[str, Any]:
    """One generation of 8 greedy tokens in a fresh residency."""
    async with loaded(model_dir, tier) as eng:
        text, fin, _ = await collect(eng, completion(prompt, max_tokens=8))
    return text, fin


def entries(tier: DiskTier) -> list[Path]:
    return sorted(p for p in tier.path.rglob("*") if p.is_file())


async def idle(eng: MlxTextEngine) -> None:
    """Wait until the batch loop is off the MLX thread, its idle write of long entries has run
    (PERSIST_IDLE_S after it went idle) and the disk writer has caught up."""
    assert eng.batch is not None and eng.disk is not None
    with trio.fail_after(30):
        while eng.batch.busy or eng.batch._persist_timer is not None:  # noqa: ASYNC110
            await trio.sleep(0.001)
    await trio.to_thread.run_sync(eng.disk.flush)


@pytest.fixture(autouse=True)
def quick_idle(monkeypatch: pytest.MonkeyPatch) -> None:
    """The idle moment before long entries are written, shortened for these tests."""
    monkeypatch.setattr(disk_writes, "PERSIST_IDLE_S", 0.2)


async def test_entry_written_when_residency_ends_and_read_by_next_load(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A short prompt's entry reaches the disk when the residency ends (not before), and the next
    load of the same weights reads it: its prefix counts as cached from disk, its tokens as cold."""
    tier = DiskTier(tmp_path / "tier", 1 << 30)
    async with loaded(tiny_model_dir, tier) as eng:
        first, fin1, _ = await collect(eng, completion(SHORT, max_tokens=8))
        await idle(eng)
        assert entries(tier) == [] and fin1.cached_tokens == 0
    assert len(entries(tier)) == 1
    follow = SHORT + first + " and the quick brown fox"
    text, fin = await turn(tiny_model_dir, tier, follow)
    cold_text, cold = await turn(tiny_model_dir, None, follow)
    assert fin.cached_from_disk == fin.cached_tokens >= 0.9 * fin1.prompt_tokens
    assert cold.cached_tokens == 0 and text == cold_text


async def test_long_prefix_written_as_made_once(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A prompt of 1,024 tokens or more is on disk once the model has been idle a moment, while it stays loaded;
    the next turn, which adds fewer than 1,024 tokens to it, waits for the residency's end."""
    tier = DiskTier(tmp_path / "tier", 1 << 30)
    async with loaded(tiny_model_dir, tier) as eng:
        first, fin, _ = await collect(eng, completion(LONG, max_tokens=4))
        await idle(eng)
        assert fin.prompt_tokens >= 1024
        assert eng.disk is not None and eng.disk.written == 1
        (path,) = entries(tier)
        assert path.name.endswith(SUFFIX) and not path.name.startswith(TMP_PREFIX)
        follow = LONG + first + " and the quick brown fox"
        _, fin2, _ = await collect(eng, completion(follow, max_tokens=4))
        await idle(eng)
        assert eng.disk.written == 1
    _, fin3 = await turn(tiny_model_dir, tier, follow)  # written when the residency ended
    assert fin3.cached_from_disk == fin2.prompt_tokens - 1


async def test_a_turn_sent_at_once_does_not_wait_for_the_disk_write(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An agent's next turn, sent as soon as the last one ends, runs before the long prefix is
    serialized for the disk (nothing is written meanwhile); the write comes once the model has
    been idle for PERSIST_IDLE_S, once for both turns."""
    monkeypatch.setattr(disk_writes, "PERSIST_IDLE_S", 30.0)
    tier = DiskTier(tmp_path / "tier", 1 << 30)
    async with loaded(tiny_model_dir, tier) as eng:
        assert eng.disk is not None and eng.batch is not None
        first, fin, _ = await collect(eng, completion(LONG, max_tokens=4))
        follow = LONG + first + " and the quick brown fox"
        _, fin2, _ = await collect(eng, completion(follow, max_tokens=4))
        assert fin.prompt_tokens >= 1024 and fin2.cached_tokens >= fin.prompt_tokens - 1
        with trio.fail_after(30):
            while eng.batch.busy:  # noqa: ASYNC110 (an MLX-thread flag)
                await trio.sleep(0.001)
        await trio.to_thread.run_sync(eng.disk.flush)
        assert eng.disk.written == 0 and entries(tier) == []
        timer = eng.batch._persist_timer
        assert timer is not None  # armed at the last idle moment
        monkeypatch.setattr(disk_writes, "PERSIST_IDLE_S", 0.2)
        timer.cancel()
        eng.batch._persist_timer = None
        with eng.batch._lock:
            eng.batch._idle_with_pending()
        await idle(eng)
        assert eng.disk.written == 1 and len(entries(tier)) == 1


async def test_damaged_and_foreign_files_are_removed_never_loaded(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Truncated, foreign (another identity, another format) and stray files, and those of writes
    whose process is gone, go at load; a garbled entry goes when it is looked up; the prompt is
    then prefilled, with the tokens of a cold run."""
    tier = DiskTier(tmp_path / "tier", 1 << 30)
    first, _ = await turn(tiny_model_dir, tier, SHORT)
    (entry,) = entries(tier)
    ident = entry.parent
    data = bytearray(entry.read_bytes())
    (ident / f"{'0' * 32}.{'1' * 16}{SUFFIX}").write_bytes(data[: len(data) // 2])  # truncated
    gone = await trio.lowlevel.open_process(["true"])
    await gone.wait()
    (ident / f"{TMP_PREFIX}{gone.pid}-1{SUFFIX}").write_bytes(data[:100])  # cut by a crash
    writing = ident / f"{TMP_PREFIX}{os.getpid()}-2{SUFFIX}"  # another residency's, in progress
    writing.write_bytes(data[:100])
    (ident / "notes.txt").write_text("not an entry")
    mx.save_safetensors(str(ident / f"{'2' * 32}.{'3' * 16}{SUFFIX}"), {"a": mx.zeros(3)})  # not ours
    foreign = PromptDisk(DiskTier(tmp_path / "other", 1 << 30), "another-model")
    assert foreign.save([5, 6, 7, 8], kv(4))  # an entry of the same shape but another identity
    foreign.close()
    (moved,) = entries(DiskTier(tmp_path / "other", 1))
    shutil.move(moved, ident / moved.name)
    data[-64:] = bytes(64)  # the garbled entry: same name and size, different bytes
    entry.write_bytes(bytes(data))

    follow = SHORT + first + " and the quick brown fox"
    async with loaded(tiny_model_dir, tier) as eng:
        assert entries(tier) == sorted([entry, writing])  # the scan removed all the others
        text, fin, _ = await collect(eng, completion(follow, max_tokens=8))
        assert eng.disk is not None and eng.disk.loaded == 0
    cold_text, _ = await turn(tiny_model_dir, None, follow)
    assert fin.cached_from_disk == 0 and text == cold_text
    assert entry not in entries(tier)  # removed when its checksum failed


def kv(n: int) -> list[Any]:
    """Two layers of plain KV for ``n`` tokens (4 heads of 16, fp32): 1 KiB a token."""
    from mlx_lm.models.cache import KVCache

    out = []
    for _ in range(2):
        c = KVCache()
        c.update_and_fetch(mx.random.normal((1, 4, n, 16)), mx.random.normal((1, 4, n, 16)))
        out.append(c)
    return out


def test_size_bound_evicts_least_recently_used(tmp_path: Path) -> None:
    """The tier never holds more than its bound: the least recently used entries go first (a read
    counts as a use), and an entry that is a prefix of a newer one is replaced by it."""
    one = 200 * 1024 + 4096  # an entry of 200 tokens, with its header
    disk = PromptDisk(DiskTier(tmp_path, 3 * one), "model")
    disk.scan()
    streams = [[i] * 200 for i in range(1, 6)]

    def write(tokens: list[int], stamp: float) -> Path:
        assert disk.save(tokens, kv(len(tokens)))
        disk.flush()
        (path,) = (e.path for e in disk._entries.values() if e.key == tokens_key(tokens))
        os.utime(path, (stamp, stamp))  # the filesystem clock may not tell quick writes apart
        return path

    paths = [write(s, 1000 + i) for i, s in enumerate(streams[:3])]
    best = disk.best(streams[0] + [9])
    assert best is not None and disk.read(best[0]) is not None  # a use: now the most recent
    for i, s in enumerate(streams[3:]):
        paths.append(write(s, 2000 + i))
    assert tier_usage(tmp_path)[0] <= 3 * one
    assert [p.exists() for p in paths] == [True, False, False, True, True]

    longer = write(streams[4] + [7] * 50, 3000)  # extends the newest: it replaces it
    assert longer.exists() and not paths[4].exists()
    disk.close()


def test_entries_waiting_for_an_idle_moment_are_bounded(tmp_path: Path) -> None:
    """A model that is never idle holds at most its prompt cache's bound in long entries waiting
    for the disk: the oldest are left to the residency's end."""
    from mlxd.engines.cache.prompt_cache import PromptCache

    one = 1100 * 1024  # KV bytes of an entry of 1,100 tokens
    disk = PromptDisk(DiskTier(tmp_path, 1 << 30), "model")
    disk.scan()
    cache = PromptCache(int(2.5 * one), disk)
    streams = [[i] * 1100 for i in range(1, 5)]
    for tokens in streams:
        cache.insert(tokens, kv(len(tokens)))
    cache.persist_pending()
    disk.flush()
    assert [disk.has(t) for t in streams] == [False, False, True, True]
    disk.close()


def test_scan_skips_what_is_not_a_regular_file(tmp_path: Path) -> None:
    """A FIFO, a link or a directory named like an entry is removed (or left) unopened: the
    scan, which runs in the model's load, does not block on it."""
    import threading

    disk = PromptDisk(DiskTier(tmp_path, 1 << 30), "model")
    disk.dir.mkdir(parents=True)
    fifo = disk.dir / f"{'a' * 32}.{'1' * 16}{SUFFIX}"
    os.mkfifo(fifo)
    (disk.dir / f"{'b' * 32}.{'2' * 16}{SUFFIX}").symlink_to("/dev/zero")
    (disk.dir / f"{'c' * 32}.{'3' * 16}{SUFFIX}").mkdir()
    scan = threading.Thread(target=disk.scan, daemon=True)
    scan.start()
    scan.join(10)
    try:
        assert not scan.is_alive(), "the scan blocked opening a FIFO"
    finally:
        if scan.is_alive():  # let the blocked open return so the thread ends
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    assert not fifo.exists() and len(disk) == 0
    disk.close()


def test_a_file_larger_than_the_bound_goes_first(tmp_path: Path) -> None:
    """A file larger than the whole bound (here a 20 GB sparse one in another identity's
    directory) is removed before any entry, instead of the bound emptying the tier first."""
    disk = PromptDisk(DiskTier(tmp_path, 1 << 30), "model")
    disk.scan()
    streams = [[i] * 200 for i in range(1, 4)]
    for tokens in streams:
        assert disk.save(tokens, kv(len(tokens)))
    disk.flush()
    disk.close()
    (tmp_path / "other").mkdir()
    huge = tmp_path / "other" / f"{'d' * 32}.{'4' * 16}{SUFFIX}"
    with open(huge, "wb") as f:
        f.truncate(20 << 30)
    disk = PromptDisk(DiskTier(tmp_path, 1 << 30), "model")
    disk.scan()
    assert not huge.exists()
    assert [disk.has(t) for t in streams] == [True, True, True]
    disk.close()
