"""The dedicated MLX thread of an engine, kept in a small pool from one residency to the next.

Theory of operation (the facts behind it are in docs/platform-facts.md: "MLX streams
belong to a thread", "An MLX thread must clear its streams before it ends"):

* MLX streams belong to the thread that made them, and an array still lazy
  on one thread fails on another. So every MLX call of one engine (demo write,
  load, every generation, unload) runs on **one** OS thread,
  :class:`MlxThread`, and only plain Python values (strings, ints, exceptions)
  leave it. Nothing MLX ever runs on the Trio thread.
* A thread that ran compiled MLX functions must end with
  ``mx.synchronize(); mx.clear_streams()`` or the process may abort at exit;
  every worker thread does, and an ``atexit`` hook ends the ones still running.
* MLX never frees the native threads behind a thread's streams, so threads are
  not made per load: a residency's thread goes back to a small pool when the
  residency ends (:meth:`MlxThread.finish`) and serves the next one.

What the thread's jobs send back into Trio (the outbox, sinks, a generation's
:class:`~mlxd.engines.runtime.jobs.Job`) is in :mod:`mlxd.engines.runtime.jobs`; the
schedulers that feed it generations are in :mod:`mlxd.engines.scheduling`.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import outcome
import trio

from mlxd.errors import EngineError

log = logging.getLogger(__name__)
T = TypeVar("T")

#: every worker thread still running (the atexit hook ends them)
_LIVE: weakref.WeakSet[_Worker] = weakref.WeakSet()
#: workers whose last residency has ended, waiting for the next (newest last)
_IDLE: list[_Worker] = []
#: at most this many idle workers are kept; more are ended
IDLE_WORKERS_MAX = 4


def call_soon(token: trio.lowlevel.TrioToken, fn: Callable[..., object], *args: Any) -> bool:
    """``token.run_sync_soon`` that tolerates a finished Trio run (returns False then)."""
    try:
        token.run_sync_soon(fn, *args)
        return True
    except trio.RunFinishedError:
        return False


class _Worker:
    """One OS thread that runs MLX jobs in submission order, for one residency after another."""

    def __init__(self, name: str) -> None:
        from mlxd.engines.runtime.memory import limit_malloc_arenas

        limit_malloc_arenas()  # one arena per short-lived thread fragments RSS (see mlxd.engines.runtime.memory)
        self.name = name
        self.jobs: queue.SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...], Any] | None] = (
            queue.SimpleQueue()
        )
        self.closing = False
        self.exited = threading.Event()
        self.thread = threading.Thread(target=self._main, name=name, daemon=True)
        _LIVE.add(self)
        self.thread.start()

    def _main(self) -> None:
        try:
            while (job := self.jobs.get()) is not None:
                fn, args, done = job
                result = outcome.capture(fn, *args)
                del job, fn, args  # drop references (maybe to arrays) before the next wait
                if done is not None:
                    try:
                        done(result)
                    except BaseException:  # a callback must not kill the thread
                        log.exception("%s: job completion callback failed", self.name)
                del result, done
        finally:
            try:
                import mlx.core as mx

                mx.synchronize()
                mx.clear_streams()  # else the process can abort at exit (docs/platform-facts.md)
            finally:
                self.exited.set()

    def close_nowait(self) -> None:
        if not self.closing:
            self.closing = True
            self.jobs.put(None)

    def join(self, timeout: float | None = None) -> bool:
        self.close_nowait()
        self.thread.join(timeout)
        return not self.thread.is_alive()


def _take_worker(name: str) -> _Worker:
    while _IDLE:
        worker = _IDLE.pop()
        if not worker.closing and worker.thread.is_alive():
            worker.name = worker.thread.name = name
            return worker
    return _Worker(name)


def _give_back(worker: _Worker) -> None:
    if len(_IDLE) < IDLE_WORKERS_MAX and not worker.closing:
        _IDLE.append(worker)
    else:
        worker.close_nowait()


def spare_thread(name: str, job: Callable[[], None]) -> None:
    """Start a worker now running ``job``, pooled for the next residency (queued behind it)."""
    worker = _Worker(name)
    worker.jobs.put((job, (), None))
    _give_back(worker)


class MlxThread:
    """The MLX thread of one engine (one residency): every MLX call it makes, in order.

    The OS thread behind it is a worker kept for the next residency once this
    one is over (:meth:`finish`): MLX keeps native threads for the streams of
    every thread that ran MLX work, even after ``mx.clear_streams()``, so a new
    thread per load would leak about two threads a load.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._worker = _take_worker(name)
        # invariant: the only references to MLX objects these jobs create live in the
        # engine (written and read on this thread) or in the job's local variables
        self._closing = False
        #: the last job (see :meth:`finish`), and whether it succeeded
        self._final: Pending[None] | None = None
        self.finished = False
        #: set once this residency is done with the thread (it went back to the pool)
        self.exited = threading.Event()

    @property
    def ident(self) -> int | None:
        return self._worker.thread.ident

    def is_alive(self) -> bool:
        """Whether this residency still has its thread."""
        return not self.exited.is_set() and self._worker.thread.is_alive()

    def submit(
        self,
        fn: Callable[..., Any],
        *args: Any,
        done: Callable[[outcome.Outcome[Any]], None] | None = None,
    ) -> None:
        """Queue ``fn(*args)``; ``done(outcome)`` runs on this thread when it ends. Thread-safe."""
        if self._closing:
            raise EngineError(f"{self.name}: the MLX thread is closed")
        self._worker.jobs.put((fn, args, done))

    def start(self, fn: Callable[..., T], *args: Any) -> Pending[T]:
        """Queue ``fn(*args)`` and return a handle to await its result (from any task, again and again)."""
        pending: Pending[T] = Pending()
        self.submit(fn, *args, done=pending._finish)
        return pending

    async def run(
        self, fn: Callable[..., T], *args: Any, cancel: threading.Event | None = None
    ) -> T:
        """Run ``fn(*args)`` on this thread and return its result (or raise its exception).

        If the awaiting task is cancelled, ``cancel`` is set and ``trio.Cancelled``
        propagates at once; the job itself runs on until it notices the flag, and
        the jobs queued after it (an unload) run after it, in order.
        """
        token = trio.lowlevel.current_trio_token()
        finished = trio.Event()
        box: list[outcome.Outcome[T]] = []

        def done(result: outcome.Outcome[T]) -> None:
            box.append(result)
            call_soon(token, finished.set)

        self.submit(fn, *args, done=done)
        try:
            await finished.wait()
        except trio.Cancelled:
            if cancel is not None:
                cancel.set()
            raise
        return box[0].unwrap()

    async def finish(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` (an unload) as this residency's last job, then give the thread back.

        Safe to call again: a call cut short (cancelled) leaves the job queued
        and the next call waits for that same job; a job that raised is queued
        again by the next call; once one has succeeded the thread goes back to
        the pool (or ends, if enough are idle) and :attr:`finished` is true.
        """
        if self._final is None:
            self._final = self.start(fn)
        try:
            await self._final.result()
        except Exception:
            self._final = None
            raise
        self._closing = True
        self.exited.set()
        self.finished = True
        _give_back(self._worker)

    def close_nowait(self) -> None:
        """End the thread after the jobs already queued (not kept for another residency)."""
        self._closing = True
        self.exited.set()
        self._worker.close_nowait()


class Pending(Generic[T]):
    """The result of a job queued with :meth:`MlxThread.start`, awaited on the Trio side."""

    def __init__(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._done = trio.Event()
        self._result: outcome.Outcome[T] | None = None

    def _finish(self, result: outcome.Outcome[T]) -> None:  # on the MLX thread
        self._result = result
        call_soon(self._token, self._done.set)

    @property
    def finished(self) -> bool:
        return self._done.is_set()

    async def result(self) -> T:
        """Wait for the job (cancellable: the job goes on) and return or raise what it did."""
        await self._done.wait()
        result = self._result
        if isinstance(result, outcome.Error):
            raise result.error  # not unwrap(): an outcome unwraps once, this may be awaited again
        assert isinstance(result, outcome.Value)
        return result.value  # type: ignore[no-any-return]


#: at exit, threads still running get this long in all to finish (a hung one is left behind)
EXIT_JOIN_S = 2.0


@atexit.register
def _close_live_threads() -> None:  # pragma: no cover - exercised by the cycle test's clean exit
    workers = list(_LIVE)
    for w in workers:
        w.close_nowait()
    deadline = time.monotonic() + EXIT_JOIN_S
    for w in workers:
        w.join(timeout=max(0.0, deadline - time.monotonic()))
