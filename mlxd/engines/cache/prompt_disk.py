"""The disk tier of a model's prompt cache: entries that outlive the residency.

Theory of operation. A batched model's :class:`~mlxd.engines.cache.prompt_cache.PromptCache`
writes its entries here when its residency ends (eviction, idle unload, admin
unload, a preemption's drain, shutdown: every end goes through the engine's
unload) and, for long prefixes (:data:`LONG_PREFIX_TOKENS` tokens beyond what the
disk holds of them), once the model has been idle a moment after making them
(:data:`mlxd.engines.scheduling.disk_writes.PERSIST_IDLE_S`). The next
load of the same weights finds them: a prompt whose longest cached prefix is on
disk, and a block (:data:`BLOCK`) or more longer than what memory holds, reads it
from here instead of prefilling it.

Layout: ``<tier>/<identity>/<tokens-key>.<checksum>.safetensors``, one file an
entry, in mlx-lm's prompt-cache format (``save_prompt_cache``: the per-layer
cache states and classes) with mlxd's metadata: the format, the identity and
the entry's tokens. The *identity* (:func:`identity`) is the weights'
fingerprint (:func:`mlxd.config.weights_fingerprint`, not the model's name),
the model's ``config.json``, its cache classes and the mlx-lm version: anything
that changes what a KV entry means changes the directory.

Writes are atomic: the MLX thread serializes an entry into memory (it holds
MLX arrays); the tier's writer thread writes a ``.tmp-`` file, fsyncs it,
renames it to its final name and fsyncs the directory. A crash mid-write
leaves at most a temporary file, removed by the next scan once the process
named in it is gone. The checksum in the name (BLAKE2b of the whole file) is
checked before an entry is loaded: a torn, truncated or garbled file, or one of
another identity or format, is skipped and removed, never loaded.

The index is in memory, built at load from the files' headers (no array is
read): per entry its token count and the chained hashes of its first
:data:`BLOCK`, 2 x :data:`BLOCK`, ... tokens, one 64-bit hash a block, so the
index of a tier of ``D`` bytes holds at most ``D / (BLOCK x KV bytes per token)``
hashes. A lookup hashes the prompt the same way and takes the entry sharing
the most blocks; the exact shared prefix comes from the entry's own tokens once
it is read. An entry that is a prefix of a newer one is removed (the newer one,
trimmed, serves it). The bound (``prompt_cache_disk_gb``) holds over the whole
tier, every identity together: after each write the least recently used
entries (file mtime, touched on each read) are removed until it fits.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import logging
import os
import queue
import stat
import threading
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxd.config import DiskTier, ModelConfig, weights_fingerprint
from mlxd.crash_points import crash_point

log = logging.getLogger(__name__)

#: the file format; a file of another format is removed
FORMAT = "1"
#: an entry holding this many tokens beyond what the disk has of it is written as soon as the
#: model is idle (a crash loses less than this of a conversation); the rest when the residency ends
LONG_PREFIX_TOKENS = 1024
#: tokens per hashed block of the index
BLOCK = 128
SUFFIX = ".safetensors"
TMP_PREFIX = ".tmp-"
#: a safetensors header longer than this is not one of ours
_MAX_HEADER = 64 * 1024 * 1024
#: serialized entries waiting for the writer thread (the MLX thread waits beyond this)
_QUEUE = 4


@dataclass(frozen=True, slots=True)
class Entry:
    """One entry of the index: a file and what its tokens hash to."""

    path: Path
    key: str
    n_tokens: int
    #: chained hashes of the first BLOCK, 2 x BLOCK, ... tokens
    blocks: tuple[int, ...]


def tokens_key(tokens: Sequence[int]) -> str:
    return hashlib.blake2b(_pack(tokens), digest_size=16).hexdigest()


def block_hashes(tokens: Sequence[int]) -> list[int]:
    """The chained hash of each whole block of ``tokens`` (module docstring)."""
    h = hashlib.blake2b(digest_size=8)
    out = []
    data = _pack(tokens)
    step = 4 * BLOCK
    for end in range(step, len(data) + 1, step):
        h.update(data[end - step:end])
        out.append(int.from_bytes(h.copy().digest(), "little"))
    return out


def _pack(tokens: Sequence[int]) -> bytes:
    import array

    return array.array("I", tokens).tobytes()


def identity(model: ModelConfig, path: Path, cache_classes: Sequence[str]) -> str:
    """What a KV entry is valid for (module docstring); a directory name."""
    import mlx_lm

    h = hashlib.sha256()
    h.update(f"mlxd-prompt-cache\0{FORMAT}\0{mlx_lm.__version__}\0".encode())
    h.update(weights_fingerprint(model).encode())
    try:
        h.update((path / "config.json").read_bytes())
    except OSError:
        h.update(b"\0no config.json")
    h.update("\0".join(cache_classes).encode())
    return h.hexdigest()[:24]


def tier_usage(root: Path) -> tuple[int, int]:
    """``(bytes, entries)`` of the whole tier (every identity): a stat walk, off the event loop."""
    total = n = 0
    for _path, size, _mtime in _files(root):
        total += size
        n += 1
    return total, n


def _files(root: Path) -> Iterator[tuple[Path, int, float]]:
    try:
        dirs = list(os.scandir(root))
    except OSError:
        return
    for d in dirs:
        if not d.is_dir(follow_symlinks=False):
            continue
        try:
            files = list(os.scandir(d.path))
        except OSError:
            continue
        for f in files:
            if f.name.endswith(SUFFIX) and not f.name.startswith(TMP_PREFIX):
                try:
                    st = f.stat(follow_symlinks=False)
                except OSError:
                    continue
                yield Path(f.path), st.st_size, st.st_mtime


class PromptDisk:
    """The disk tier as one residency sees it (module docstring). The index is shared by the
    MLX thread (lookups, reads, serializing) and the writer thread (renames, removals)."""

    def __init__(self, tier: DiskTier, ident: str) -> None:
        self.root = tier.path
        self.max_bytes = tier.max_bytes
        self.identity = ident
        self.dir = tier.path / ident
        self._lock = threading.Lock()
        self._entries: dict[str, Entry] = {}  # by tokens key
        self._blocks: dict[int, str] = {}  # block hash -> the key of an entry holding it
        self._queued: set[str] = set()  # keys serialized, not yet renamed
        self._queue: queue.Queue[tuple[str, list[int], bytes, bool] | None] = queue.Queue(_QUEUE)
        self._writer: threading.Thread | None = None
        #: what this residency did with the tier (for tests and the log)
        self.loaded = 0
        self.written = 0
        self.removed = 0

    # ---- the index ------------------------------------------------------------------------

    def scan(self) -> None:
        """Build the index from this identity's files; remove temporary, torn and foreign ones."""
        self.dir.mkdir(parents=True, exist_ok=True)
        for f in sorted(self.dir.iterdir()):
            if f.name.startswith(TMP_PREFIX):
                if not _writer_alive(f.name):
                    self._remove(f, "left by a write that never ended")
                continue
            if not f.name.endswith(SUFFIX):
                self._remove(f, "not an entry")
                continue
            if not _regular(f):  # opening a FIFO blocks for ever; a link may lead anywhere
                self._remove(f, "not a regular file")
                continue
            meta = self._header(f)
            tokens = self._tokens(meta) if meta is not None else None
            if tokens is None or f.name.split(".")[0] != tokens_key(tokens):
                self._remove(f, "torn, truncated or foreign")
                continue
            self._add(Entry(f, tokens_key(tokens), len(tokens), tuple(block_hashes(tokens))))
        self._enforce_bound()

    def __len__(self) -> int:
        return len(self._entries)

    def best(self, ids: Sequence[int]) -> tuple[Entry, int] | None:
        """The entry sharing the most whole blocks with ``ids``, and those blocks' tokens."""
        if not self._blocks:
            return None
        hashes = block_hashes(ids)
        with self._lock:
            for depth in range(len(hashes), 0, -1):
                key = self._blocks.get(hashes[depth - 1])
                if key is not None and key in self._entries:
                    return self._entries[key], depth * BLOCK
        return None

    def read(self, entry: Entry) -> tuple[list[int], list[Any]] | None:
        """``(tokens, per-layer caches)`` of ``entry``, checked (module docstring); None, and
        the file removed, if it is not whole or not ours. MLX thread."""
        import mlx.core as mx

        try:
            data = entry.path.read_bytes()
        except OSError:
            self._drop(entry.key)
            return None
        checksum = entry.path.name.split(".")[1] if entry.path.name.count(".") == 2 else ""
        if _checksum(data) != checksum:
            self._remove(entry.path, "its checksum does not match")
            return None
        try:
            loaded: Any = mx.load(io.BytesIO(data), format="safetensors", return_metadata=True)
            cache, meta = _from_arrays(*loaded)
            mx.eval([c.state for c in cache])
            tokens = self._tokens(meta)
        except Exception as e:  # a file that passed its checksum but is not a cache of ours
            log.warning("prompt cache: %s: cannot be read (%s); removed", entry.path.name, e)
            tokens = None
        if tokens is None or len(tokens) != entry.n_tokens:
            self._remove(entry.path, "not a prompt cache of this model")
            return None
        try:
            os.utime(entry.path)  # its last use, for the LRU bound
        except OSError:
            pass
        self.loaded += 1
        return tokens, cache

    def _tokens(self, meta: dict[str, Any]) -> list[int] | None:
        if meta.get("mlxd_format") != FORMAT or meta.get("mlxd_identity") != self.identity:
            return None
        import array

        try:
            out = array.array("I")
            out.frombytes(base64.b64decode(meta["mlxd_tokens"], validate=True))
        except (KeyError, ValueError, TypeError):
            return None
        return out.tolist() if out else None

    def _header(self, path: Path) -> dict[str, Any] | None:
        """The mlxd metadata of a whole safetensors file, or None (unreadable, torn, truncated)."""
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                n = int.from_bytes(f.read(8), "little")
                if n <= 0 or n > _MAX_HEADER or 8 + n > size:
                    return None
                header = json.loads(f.read(n))
            ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
            if 8 + n + max(ends, default=0) != size:
                return None
            meta = header.get("__metadata__") or {}
            return {k.removeprefix("0."): v for k, v in meta.items() if k.startswith("0.")}
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            return None

    def _add(self, entry: Entry) -> None:
        with self._lock:
            self._entries[entry.key] = entry
            for h in entry.blocks:
                self._blocks[h] = entry.key

    def _drop(self, key: str) -> None:
        with self._lock:
            gone = self._entries.pop(key, None)
            if gone is None:
                return
            orphans = {h for h in gone.blocks if self._blocks.get(h) == key}
            for h in orphans:
                del self._blocks[h]
            for other in self._entries.values():  # blocks it shared with others stay findable
                for h in other.blocks:
                    if h in orphans:
                        self._blocks[h] = other.key

    def _remove(self, path: Path, why: str) -> None:
        log.warning("prompt cache: %s: %s; removed", path.name, why)
        self._unlink(path)

    def _unlink(self, path: Path) -> None:
        try:
            path.unlink()
            self.removed += 1
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("prompt cache: cannot remove %s: %s", path, e)
        if path.parent == self.dir:
            self._drop(path.name.split(".")[0])

    # ---- writing ------------------------------------------------------------------------

    def has(self, tokens: Sequence[int]) -> bool:
        key = tokens_key(tokens)
        with self._lock:
            return key in self._entries or key in self._queued

    def save(self, tokens: Sequence[int], cache: list[Any]) -> bool:
        """Serialize an entry (MLX thread) and queue it for the writer; False if skipped."""
        from mlx_lm.models.cache import can_trim_prompt_cache, save_prompt_cache

        tokens = list(tokens)
        if not tokens or self.has(tokens):
            return False
        layers = _exact(cache, len(tokens))
        if layers is None or sum(int(c.nbytes) for c in layers) > self.max_bytes:
            return False
        buf = io.BytesIO()
        meta = {"mlxd_format": FORMAT, "mlxd_identity": self.identity,
                "mlxd_tokens": base64.b64encode(_pack(tokens)).decode()}
        try:
            save_prompt_cache(buf, layers, meta)  # type: ignore[arg-type]
        except Exception as e:
            log.warning("prompt cache: cannot serialize an entry of %d tokens: %s", len(tokens), e)
            return False
        key = tokens_key(tokens)
        with self._lock:
            self._queued.add(key)
        self._start_writer()
        self._queue.put((key, tokens, buf.getvalue(), bool(can_trim_prompt_cache(layers))))
        return True

    def flush(self) -> None:
        """Wait until every queued entry is on disk (or failed)."""
        if self._writer is not None:
            self._queue.join()

    def close(self) -> None:
        """Flush, then end the writer thread."""
        if self._writer is not None:
            self._queue.put(None)
            self._writer.join()
            self._writer = None

    def _start_writer(self) -> None:
        if self._writer is None:
            self._writer = threading.Thread(
                target=self._write_loop, name=f"prompt-cache-{self.identity[:8]}", daemon=True
            )
            self._writer.start()

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._write(*item)
            except Exception:
                log.exception("prompt cache: writing an entry failed")
            finally:
                if item is not None:
                    with self._lock:
                        self._queued.discard(item[0])
                self._queue.task_done()

    def _write(self, key: str, tokens: list[int], data: bytes, trimmable: bool) -> None:
        """Temp file, fsync, rename, fsync the directory (module docstring)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.dir / f"{TMP_PREFIX}{os.getpid()}-{uuid.uuid4().hex}{SUFFIX}"
        final = self.dir / f"{key}.{_checksum(data)}{SUFFIX}"
        try:
            with open(tmp, "wb") as f:
                f.write(data[: len(data) // 2])
                crash_point("prompt_cache.mid_write")  # half an entry written (crash tests)
                f.write(data[len(data) // 2:])
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
        except OSError as e:
            log.warning("prompt cache: cannot write %s: %s", final.name, e)
            self._unlink(tmp)
            return
        _fsync_dir(self.dir)
        blocks = tuple(block_hashes(tokens))
        if trimmable:
            self._drop_prefixes(tokens, blocks)
        self._add(Entry(final, key, len(tokens), blocks))
        self.written += 1
        self._enforce_bound()

    def _drop_prefixes(self, tokens: list[int], blocks: tuple[int, ...]) -> None:
        """Remove the entries that are prefixes of ``tokens`` (the new entry serves them)."""
        with self._lock:
            shorter = [e for e in self._entries.values()
                       if e.n_tokens < len(tokens) and e.blocks == blocks[: len(e.blocks)]]
        for e in shorter:
            if tokens_key(tokens[: e.n_tokens]) == e.key:
                self._unlink(e.path)

    def _enforce_bound(self) -> None:
        """Remove the least recently used entries of the whole tier until it fits its bound;
        first any file larger than the whole bound (it can never stay, and removing the others
        first would empty the tier for nothing)."""
        files = sorted(_files(self.root), key=lambda f: (f[1] <= self.max_bytes, f[2]))
        total = sum(size for _p, size, _m in files)
        for path, size, _mtime in files:
            if total <= self.max_bytes:
                break
            self._unlink(path)
            total -= size


def _regular(path: Path) -> bool:
    """Whether ``path`` is a regular file itself (not a link, FIFO, device or directory)."""
    try:
        return stat.S_ISREG(path.lstat().st_mode)
    except OSError:
        return False


def _writer_alive(name: str) -> bool:
    """Whether the process that is writing temporary file ``name`` (its pid is in the name) is
    alive: another residency of the same weights may be writing it now."""
    pid = name.removeprefix(TMP_PREFIX).split("-")[0]
    if not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except OSError:  # alive, another user's
        return True
    return True


def _checksum(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=8).hexdigest()


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _exact(cache: list[Any], n_tokens: int) -> list[Any] | None:
    """The per-layer caches of an entry of ``n_tokens`` tokens, plain KV caches cut to them;
    None when a layer does not hold exactly that many (never write what we cannot vouch for)."""
    from mlx_lm.models.cache import KVCache

    out = []
    for c in cache:
        offset = getattr(c, "offset", None)
        if isinstance(offset, int) and offset != n_tokens:
            return None
        keys, values = getattr(c, "keys", None), getattr(c, "values", None)
        if type(c) is KVCache and keys is not None and values is not None:
            cut: Any = KVCache()  # type: ignore[no-untyped-call]
            cut.keys, cut.values = keys[..., :n_tokens, :], values[..., :n_tokens, :]
            cut.offset = n_tokens
            c = cut
        out.append(c)
    return out


def _from_arrays(arrays: dict[str, Any], flat: dict[str, str]) -> tuple[list[Any], dict[str, Any]]:
    """mlx-lm's ``load_prompt_cache`` on arrays already read (it takes only a file name)."""
    from mlx.utils import tree_unflatten
    from mlx_lm.models import cache as cache_module

    metadata, classes, scalars = tree_unflatten(list(flat.items()))
    for pos, kind in scalars[1:]:
        array = arrays[pos]
        if kind == "scalar":
            arrays[pos] = array.item()
        elif kind == "string":
            arrays[pos] = "".join(chr(i) for i in array.tolist())
        elif kind == "none":
            arrays[pos] = None
        else:
            raise ValueError(f"unknown scalar kind {kind!r}")
    states = tree_unflatten(list(arrays.items()))
    cache = []
    for name, state in zip(classes, states, strict=True):
        cls = getattr(cache_module, str(name), None)
        if not (isinstance(cls, type) and issubclass(cls, cache_module._BaseCache)):
            raise ValueError(f"{name!r} is not an mlx-lm cache class")
        cache.append(cls.from_state(state))  # type: ignore[no-untyped-call]
    return cache, metadata


def open_tier(
    model: ModelConfig, path: Path, loaded: Any, batched: bool, memory_bytes: int
) -> PromptDisk | None:
    """The disk tier of a residency of ``model`` (loaded from ``path``), its index read: on the
    MLX thread, at load. None when off (no tier, a model that does not batch, no prompt cache in
    memory) or when the tier cannot be used (logged: the load goes on without it)."""
    from mlx_lm.models.cache import make_prompt_cache

    tier = model.prompt_cache_disk  # set only for a model that keeps a prompt cache (config)
    if tier is None or not batched or memory_bytes <= 0:
        return None
    try:
        classes = [type(c).__name__ for c in make_prompt_cache(loaded)]
        disk = PromptDisk(tier, identity(model, path, classes))
        disk.scan()
    except Exception as e:
        log.warning("%s: the prompt cache's disk tier is off for this residency: %s", model.name, e)
        return None
    return disk
