"""When a batched model's prompt-cache entries go to the disk tier: after an idle moment, and
when the residency ends.

A prompt-cache entry of a long prefix is written to the disk tier while the
model stays loaded (:meth:`mlxd.engines.cache.prompt_cache.PromptCache.persist_pending`),
so a crash loses little of a long conversation. Writing it costs: the MLX
thread serializes the entry (about 150 MB and 0.35 s for 5,000 tokens of the
small demo model) and the tier's writer thread checksums and writes it (0.5 s
more of one core). An agent sends its next turn the moment the last one ends;
written at once, every second or third turn would wait behind its own prefix's
serialization and share the cores with its write.

So :class:`DiskWrites`, a part of :class:`~mlxd.engines.scheduling.batch_loop.BatchLoop`,
arms a timer when the loop goes idle with long entries pending: after
:data:`PERSIST_IDLE_S` with no job added, the write runs on the MLX thread as a
turn of the loop (``_running`` set, so a job added meanwhile is queued behind
it, and the write stops before its next entry). A job added before the timer
fires disarms it; the next idle moment arms it again. The residency's end
(:meth:`DiskWrites._end_writes`, from
:meth:`~mlxd.engines.scheduling.batch_loop.BatchLoop.close`) disarms it for good, writes
every entry not on disk yet and closes the tier.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from mlxd.errors import EngineError

if TYPE_CHECKING:
    from mlxd.engines.cache.prompt_cache import PromptCache
    from mlxd.engines.cache.prompt_disk import PromptDisk

log = logging.getLogger(__name__)

#: a long entry is written once the model has been idle this long (module docstring)
PERSIST_IDLE_S = 2.0


class DiskWrites:
    """The disk writes of a batch loop's prompt cache (module docstring)."""

    # set by BatchLoop.__init__
    _lock: threading.Lock
    _persist_timer: threading.Timer | None
    _closed: bool
    _running: bool
    _inbox: collections.deque[Any]
    _cache: PromptCache | None
    disk: PromptDisk | None
    _submit: Callable[[Callable[[], None]], None]
    run: Callable[[], None]  # BatchLoop's

    def _idle_with_pending(self) -> None:
        """(MLX thread, under ``_lock``, the loop going idle.) Arm the timer if entries wait."""
        if self._cache is not None and self._cache.has_pending and not self._closed:
            self._disarm_persist()
            timer = threading.Timer(PERSIST_IDLE_S, self._persist_when_idle)
            timer.daemon, timer.name = True, "prompt-cache-idle"
            self._persist_timer = timer
            timer.start()

    def _disarm_persist(self) -> None:
        """(Under ``_lock``.) A job arrived, or the residency ends: no idle write now."""
        if self._persist_timer is not None:
            self._persist_timer.cancel()
            self._persist_timer = None

    def _persist_when_idle(self) -> None:
        """(Timer thread.) Still idle: the write goes to the MLX thread as a turn of the loop.

        A timer that fired while a job was being added waits here for the lock; by then
        it may be superseded (the job ran, the loop went idle again and armed a newer
        timer): it does nothing, so the write still waits for a whole idle moment and
        the newer timer stays the one a job disarms."""
        with self._lock:
            if self._persist_timer is not threading.current_thread():
                return
            self._persist_timer = None
            if self._running or self._inbox or self._closed:
                return
            self._running = True
        try:
            self._submit(self._persist_then_run)
        except EngineError:  # the residency ended meanwhile: its thread takes no more jobs
            with self._lock:
                self._running = False

    def _persist_then_run(self) -> None:
        """(MLX thread.) The pending long entries to disk, stopping at a job's arrival; then the
        loop as usual (it takes that job, or goes idle again). Nothing once the residency has
        ended (its end ran between the timer and this turn): the thread may be the next
        residency's by now."""
        with self._lock:
            if self._closed:
                self._running = False
                return
        try:
            if self._cache is not None:
                self._cache.persist_pending(stop=lambda: bool(self._inbox))
        except Exception:
            log.exception("prompt cache: writing to the disk tier failed")
        self.run()

    def _end_writes(self) -> None:
        """(MLX thread, the residency ends.) No idle write any more; every entry not on disk yet
        written (waited for), the memory cache dropped and the tier closed."""
        with self._lock:
            self._closed = True
            self._disarm_persist()
        if self._cache is not None:
            self._cache.persist_all()
            self._cache.clear()
        self._cache = None
        if self.disk is not None:
            self.disk.close()
