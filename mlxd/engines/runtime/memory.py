"""Memory: what MLX holds, what the device offers, and giving memory back.

Theory of operation. MLX counts the bytes of its arrays itself
(``mx.get_active_memory()``), on every backend; that is the number residency
decisions use. The counters are **process-global** (over all threads and all
engines), so a footprint taken as an active-memory delta around a load is only
right if no other load or unload runs at the same time; the engines take it on
their own MLX thread and fall back to the summed parameter bytes when the delta
is implausible (see :func:`footprint`). RSS (psutil) is a sanity metric only:
on Apple silicon the weights live in unified memory that RSS does not show.

Unloading on Linux needs one more step than ``del`` + ``gc.collect()`` +
``mx.clear_cache()``: glibc keeps the freed model memory in its arenas, so RSS
stays high from the second load/unload cycle on. ``malloc_trim(0)`` gives it
back (docs/platform-facts.md, "glibc keeps freed model memory").
:func:`release_memory` does all of it.

Each residency has its own MLX thread (a pooled OS thread since the MLX thread
pool, see :mod:`mlxd.engines.runtime.mlx_thread`; the figures below were measured with
a new thread per load), and glibc gives every new thread its
own malloc arena (up to 8 per core); memory a finished thread left in its arena
stays fragmented there, so RSS crept up by ~1 MB per load/unload cycle
(+19.5 MB over 20 cycles of a 96 MB model, measured), with ``malloc_trim``.
:func:`limit_malloc_arenas` caps the arenas at ``MLXD_MALLOC_ARENA_MAX``
(default 1; 0 keeps glibc's default), after which 20 cycles grow RSS by under
2 MB. It is called before the process's first extra thread (``mlxd serve``
before Trio starts, the import ahead, each load, each MLX thread): a thread
started earlier keeps an arena of its own, and a later thread may be handed
that one, fresh and small, instead of the main heap (a load of the ``small``
demo model on a thread with a fresh arena: 1.06 of a main-thread load, against
1.01 with the cap, 16 paired runs in fresh processes; single loads vary by as
much, so this is one reading, not a law).

Python's full (generation 2) garbage collections traverse every object the
collector tracks, and with mlx-lm, transformers and a model in the heap there
are about 100,000: one took 25-60 ms, holding the GIL, so every stream of
every model stopped meanwhile (the slow first tokens of a burst of requests
that bench/timeline.py took apart were one). Those objects live as long as the
daemon or the model does. :func:`settle_heap`, after the import of mlx-lm and
after each load, collects once and moves what is alive into the collector's
permanent generation (``gc.freeze``); later collections traverse only what
was made since (0.5 ms instead of 25 ms, measured with the tiny model). Frozen
objects are still freed when nothing refers to them; only a cycle among them
would wait, so :func:`release_memory` unfreezes first and its collection frees
the unloaded model's cycles too, then freezes what is left.

A large generation leaves memory behind too: MLX keeps the freed buffers of
its prompt's activations and KV cache in its buffer cache, and glibc the
freed heap, until the model unloads (RSS 99 MB, 156 MB after a 20k-token
request, still 160 MB later, on the tiny demo model). :func:`after_generation`
(called on the MLX thread when a generation ends) clears both after a large
one, which the budget does not count.

Everything here that touches MLX must run on the thread that owns the arrays
(an engine's MLX thread); :func:`malloc_trim` and :func:`rss_bytes` may run
anywhere.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
import sys
from dataclasses import dataclass
from functools import cache
from typing import Any


@dataclass(frozen=True, slots=True)
class MemorySnapshot:
    """MLX's counters at one moment (bytes)."""

    active: int
    cache: int
    peak: int

    def as_dict(self) -> dict[str, int]:
        return {"active": self.active, "cache": self.cache, "peak": self.peak}


def active_bytes() -> int:
    """Bytes held by live MLX arrays, over the whole process."""
    import mlx.core as mx

    return int(mx.get_active_memory())


def snapshot() -> MemorySnapshot:
    """MLX's active, cache and peak counters (process-global)."""
    import mlx.core as mx

    return MemorySnapshot(
        active=int(mx.get_active_memory()),
        cache=int(mx.get_cache_memory()),
        peak=int(mx.get_peak_memory()),
    )


def device_info() -> dict[str, Any]:
    """``mx.device_info()`` plus the memory limit and total RAM, for status pages.

    On the CPU backend ``device_info()`` has only the architecture and the
    device name; on Metal it also has ``memory_size`` and
    ``max_recommended_working_set_size``.
    """
    import mlx.core as mx

    info: dict[str, Any] = {}
    try:
        info.update(mx.device_info())
    except Exception as e:  # older mlx, or no device
        info["error"] = str(e)
    try:
        info["memory_limit"] = int(mx.get_memory_limit())
    except Exception:
        pass
    info["default_device"] = str(mx.default_device())
    info["system_memory"] = system_memory_bytes()
    return info


def system_memory_bytes() -> int | None:
    """Total physical memory of the machine, or None if unknown."""
    try:
        import psutil

        return int(psutil.virtual_memory().total)
    except Exception:
        return None


def rss_bytes() -> int:
    """Resident set size of this process (a sanity metric, not a residency number)."""
    import psutil

    return int(psutil.Process().memory_info().rss)


def parameter_bytes(model: Any) -> int:
    """Summed ``nbytes`` of every array in ``model`` (what mlx-lm's ``wired_limit`` uses)."""
    from mlx.utils import tree_flatten

    params = model.parameters() if hasattr(model, "parameters") else model
    flat: Any = tree_flatten(params)
    return int(sum(int(getattr(leaf[1], "nbytes", 0)) for leaf in flat))


def footprint(active_before: int, active_after: int, model: Any) -> tuple[int, str]:
    """The measured size of a load: the active-memory delta, or the parameter bytes.

    The delta is process-global, so a concurrent unload elsewhere can make it
    small or negative, and a concurrent load can inflate it. The delta wins when
    it is at least the parameter bytes (a model also holds buffers that are not
    parameters) and not absurdly larger; otherwise the parameter bytes are used.
    Returns ``(bytes, "active_delta" | "parameters")``.
    """
    delta = active_after - active_before
    params = parameter_bytes(model)
    if params <= delta <= 2 * params + (64 << 20):
        return delta, "active_delta"
    return params, "parameters"


@cache
def _libc() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    # "libc.so.6" first: ctypes.util.find_library runs ldconfig/gcc (~8 ms, measured)
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        pass
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


def malloc_trim() -> bool:
    """Return freed heap memory to the OS (glibc ``malloc_trim(0)``); False where unavailable."""
    libc = _libc()
    if libc is None or not hasattr(libc, "malloc_trim"):
        return False
    try:
        return bool(libc.malloc_trim(0))
    except Exception:
        return False


_M_ARENA_MAX = -8  # glibc's mallopt parameter number
ARENA_MAX_ENV = "MLXD_MALLOC_ARENA_MAX"
_arenas_limited = False


def limit_malloc_arenas() -> bool:
    """Cap glibc's malloc arenas (``MLXD_MALLOC_ARENA_MAX``, default 1) once per process.

    Applies to threads created afterwards; a no-op (False) off glibc, when the
    variable is 0, or when ``MALLOC_ARENA_MAX`` is already set in the environment.
    """
    global _arenas_limited
    if _arenas_limited:
        return True
    _arenas_limited = True
    if "MALLOC_ARENA_MAX" in os.environ:
        return False
    try:
        n = int(os.environ.get(ARENA_MAX_ENV, "1"))
    except ValueError:
        n = 1
    libc = _libc()
    if n <= 0 or libc is None or not hasattr(libc, "mallopt"):
        return False
    try:
        return bool(libc.mallopt(_M_ARENA_MAX, n))
    except Exception:
        return False


def release_memory() -> None:
    """After dropping the last reference to a model: collect, empty MLX's cache, trim the heap.

    Run it on the MLX thread that owned the model (``mx.clear_cache`` frees
    that thread's buffers); the caller must already have dropped every
    reference (model, tokenizer, caches, responses holding arrays).
    """
    import mlx.core as mx

    gc.unfreeze()  # the model's own cycles may be among the frozen objects (settle_heap)
    settle_heap()
    mx.clear_cache()
    malloc_trim()


def settle_heap() -> None:
    """Collect once, then exempt everything alive from later collections (``gc.freeze``).

    Call it when the heap has just grown with objects that will last (an
    import, a model's load): full collections then skip them (see the module
    docstring). Any thread: the collector is the process's.
    """
    gc.collect()
    gc.freeze()


#: a generation of at least this many tokens (prompt + completion) gives its memory back
LARGE_GENERATION_TOKENS = 2048
#: ... and so does any generation after which MLX's buffer cache holds more than this
CACHE_KEEP_BYTES = 1 << 30


def after_generation(tokens: int) -> bool:
    """After a generation, on its MLX thread: give back what a large one left cached.

    Empties MLX's buffer cache and trims the heap when the generation had
    :data:`LARGE_GENERATION_TOKENS` or more, or the cache grew past
    :data:`CACHE_KEEP_BYTES`. Small generations keep the cache (reusing its
    buffers is what makes the next one fast). Returns True if it cleared.
    """
    import mlx.core as mx

    if tokens < LARGE_GENERATION_TOKENS and int(mx.get_cache_memory()) <= CACHE_KEEP_BYTES:
        return False
    mx.clear_cache()
    malloc_trim()
    return True
