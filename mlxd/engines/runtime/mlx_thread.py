"""The dedicated MLX thread of an engine, and the scheduler that feeds it generations.

Theory of operation (the facts behind it are in docs/platform-facts.md: "MLX streams
belong to a thread", "An MLX thread must clear its streams before it ends", "Prefill is
interruptible only between chunks"):

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
* Results go into Trio with ``trio_token.run_sync_soon(...)`` into unbounded
  memory channels (:class:`Sink`), so the MLX thread never blocks on a slow
  consumer and the Trio side awaits a channel, which is cancellable at once.
* A job cannot be interrupted from outside; it polls its ``cancel`` flag
  (between tokens, and between prefill chunks).

:class:`SerialScheduler` is the request path of models that generate one at
a time (``max_batch_size: 1``, ``mllm`` models, models whose KV cache cannot
be batched): arrival order, ``max_queue`` admission. Batched models use
:class:`mlxd.engines.scheduling.batching.BatchScheduler`, which takes the same
:class:`Job` objects (request, sink, cancel flag, stats) and runs many of them
per decode step on the same thread, without changing how ``generate`` or the
manager see the engine.
"""

from __future__ import annotations

import atexit
import collections
import logging
import math
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import outcome
import trio

from mlxd.engines.base import GenerationRequest, TextDelta
from mlxd.errors import EngineError, Overloaded

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


class Outbox:
    """Items from an MLX thread into Trio, with one wake-up of the Trio thread for all that waits.

    ``put`` appends; the first item put while no wake-up is pending schedules one
    (``run_sync_soon``); the items put before it runs, and while it runs (a job's
    completion, see :meth:`call`), ride along. While :meth:`holding` (over a decode
    step's deliveries) nothing is scheduled: one wake-up carries every stream's token."""

    def __init__(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._lock = threading.Lock()
        self._items: list[tuple[Callable[..., object], tuple[Any, ...]]] = []  # calls, in order
        # invariant: True from the scheduling of a drain until the drain has found nothing left
        self._scheduled = False
        self._holds = 0

    def put(self, sink: Sink, item: object) -> None:
        """Thread-safe: queue ``item`` for ``sink``."""
        self.call(sink._deliver, item)

    def call(self, fn: Callable[..., object], *args: Any) -> None:
        """Thread-safe: run ``fn(*args)`` on the Trio thread after what was put before."""
        with self._lock:
            self._items.append((fn, args))
            if self._scheduled or self._holds:
                return
            self._scheduled = True
        call_soon(self._token, self._drain)

    @contextmanager
    def holding(self) -> Iterator[None]:
        """Hold the wake-up until the block ends (then one carries everything put in it)."""
        with self._lock:
            self._holds += 1
        try:
            yield
        finally:
            with self._lock:
                self._holds -= 1
                wake = not self._holds and bool(self._items) and not self._scheduled
                if wake:
                    self._scheduled = True
            if wake:
                call_soon(self._token, self._drain)

    def _drain(self) -> None:
        for n in range(3):  # two passes (the second takes what came meanwhile: a completion)
            with self._lock:
                if not self._items:  # nothing left: no wake-up (each costs two syscalls)
                    self._scheduled = False
                    return
                if n == 2:
                    break  # a third pass waits its turn: the event loop runs in between
                items, self._items = self._items, []
            for fn, args in items:
                fn(*args)
        call_soon(self._token, self._drain)  # still scheduled


_CLOSE = object()


class Sink:
    """An unbounded channel from an MLX thread into Trio; ``put`` never blocks the thread."""

    def __init__(self, outbox: Outbox | None = None) -> None:
        self._outbox = outbox if outbox is not None else Outbox()
        self.send, self.receive = trio.open_memory_channel[object](math.inf)

    def put(self, item: object) -> None:
        """Thread-safe: deliver ``item`` to the receiving side (dropped if it has gone)."""
        self._outbox.put(self, item)

    def _deliver(self, item: object) -> None:
        if item is _CLOSE:
            self.send.close()
            return
        try:
            self.send.send_nowait(item)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the consumer left; the job is being cancelled

    def close_soon(self) -> None:
        """Thread-safe: close the sending side after the items already put."""
        self._outbox.put(self, _CLOSE)


@dataclass(frozen=True, slots=True)
class PrefillProgress:
    """Internal event: ``done`` of ``total`` prompt tokens processed (per prefill chunk)."""

    done: int
    total: int


@dataclass(frozen=True, slots=True)
class TokenTick:
    """Internal event: a token was generated that produced no text to send yet."""


TOKEN_TICK = TokenTick()

#: a stream's text reaches its consumer at most this often (its first token at once): a model
#: faster than 1 / interval tokens per second sends a few tokens per event, which saves
#: the Trio thread a wake-up, a relay and an HTTP write per token
STREAM_INTERVAL_S = 0.010


@dataclass(slots=True)
class GenerationStats:
    """What happened to one generation; times are ``time.monotonic()`` (comparable across threads).

    Written by the MLX thread while the job runs (plain ints and floats only),
    except ``enqueued_at`` and ``cancel_requested_at``, which the Trio side
    writes. Read them after the job has ended.
    """

    request_id: str | None = None
    enqueued_at: float = 0.0
    started_at: float | None = None
    first_token_at: float | None = None
    ended_at: float | None = None
    prompt_tokens: int = 0
    prefill_done: int = 0
    prefill_chunks: int = 0
    completion_tokens: int = 0
    cancel_requested_at: float | None = None
    #: tokens the MLX thread produced after the cancel was requested (at most one in flight)
    tokens_after_cancel: int = 0
    #: stop | length | cancelled | withdrawn (left the queue unstarted) | error
    outcome: str | None = None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.enqueued_at

    @property
    def cancel_latency_s(self) -> float | None:
        """Seconds from the cancel request until the MLX thread was free again."""
        if self.cancel_requested_at is None or self.ended_at is None:
            return None
        return max(0.0, self.ended_at - self.cancel_requested_at)

    @property
    def decode_tps(self) -> float | None:
        if self.first_token_at is None or self.ended_at is None or self.completion_tokens < 2:
            return None
        span = self.ended_at - self.first_token_at
        return (self.completion_tokens - 1) / span if span > 0 else None


@dataclass(eq=False)
class Job:
    """One generation request as a scheduler sees it."""

    request: GenerationRequest
    sink: Sink
    cancel: threading.Event = field(default_factory=threading.Event)
    stats: GenerationStats = field(default_factory=GenerationStats)
    #: engine-specific prepared input (decoded images, ...)
    data: Any = None
    #: KV tokens this job may grow to (prompt + max_tokens): what batch admission reserves
    kv_tokens: int = 0

    #: text events not sent yet, and when text was last sent (MLX thread only; see emit)
    _held: list[TextDelta | TokenTick] = field(default_factory=list, init=False, repr=False)
    _sent_at: float | None = field(default=None, init=False, repr=False)

    def emit(self, item: object) -> None:
        """Send an event to the consumer (from the thread that runs the job).

        Text (``TextDelta``, ``TokenTick``) is held while the last text went out less
        than :data:`STREAM_INTERVAL_S` ago, then sent as one delta; any other event
        sends the held text first, so the order never changes.
        """
        if isinstance(item, (TextDelta, TokenTick)):
            self._held.append(item)
            if self._sent_at is not None and time.monotonic() - self._sent_at < STREAM_INTERVAL_S:
                return
            self.flush()
            return
        self.flush()
        self.sink.put(item)

    def flush(self) -> None:
        """Send the held text now (one ``TextDelta``, or one ``TokenTick`` if it has none)."""
        held = self._held
        if not held:
            return
        self._held = []
        deltas = [h for h in held if isinstance(h, TextDelta)]
        if not deltas:
            self.sink.put(TOKEN_TICK)
            return
        delta = deltas[0] if len(deltas) == 1 else TextDelta(
            "".join(d.text for d in deltas), tuple(lp for d in deltas for lp in d.logprobs)
        )
        if delta.text:
            self._sent_at = time.monotonic()
        self.sink.put(delta)

    def request_cancel(self) -> None:
        """Ask the MLX thread to stop this job (within one token / one prefill chunk)."""
        if not self.cancel.is_set():
            if self.stats.ended_at is None:
                self.stats.cancel_requested_at = time.monotonic()
            self.cancel.set()


class SerialScheduler:
    """Runs an engine's generations one at a time, in arrival order, on its MLX thread.

    All methods run on the Trio thread. ``run_one(job)`` runs on the MLX thread;
    when it returns (or raises) the job's sink is closed (after an exception
    item, if it raised) and the next waiting job is started.

    Subclasses (:class:`mlxd.engines.scheduling.batching.BatchScheduler`) admit more than
    one job at a time by overriding :meth:`_admissible` and :meth:`_start`; the
    queue, ``max_queue``, withdrawal and closing rules stay here.
    """

    def __init__(
        self, thread: MlxThread, run_one: Callable[[Job], None] | None, *, max_queue: int, name: str
    ) -> None:
        self._thread = thread
        self._run_one = run_one
        self.max_queue = max_queue
        self.name = name
        self._token = trio.lowlevel.current_trio_token()
        self._waiting: collections.deque[Job] = collections.deque()
        # invariant: a job is in _active from its start until its completion has been
        # handled on the Trio side (_done); only active jobs are on the MLX thread
        self._active: list[Job] = []
        self._closed = False
        self._idle = trio.Event()
        self._idle.set()

    def depth(self) -> int:
        """Requests waiting for or in generation (what ``max_queue`` limits)."""
        return len(self._waiting) + len(self._active)

    def check_capacity(self) -> None:
        """Raise :class:`Overloaded` (or :class:`EngineError` once closed) if a new job would be refused."""
        if self._closed:
            raise EngineError(f"{self.name}: the model is being unloaded", retry_after=1.0)
        if self.depth() >= self.max_queue:
            raise Overloaded(
                f"{self.name}: {self.depth()} requests are already queued (max_queue={self.max_queue})"
            )

    def submit(self, job: Job) -> None:
        """Queue ``job`` behind the ones already there, or refuse it."""
        self.check_capacity()
        job.stats.enqueued_at = time.monotonic()
        self._waiting.append(job)
        self._dispatch()

    def withdraw(self, job: Job) -> None:
        """The consumer has gone (finished, cancelled, closed): stop or unqueue ``job``."""
        if job in self._active:
            job.request_cancel()
        elif job in self._waiting:
            self._waiting.remove(job)
            job.stats.outcome = "withdrawn"
            job.stats.ended_at = time.monotonic()
            self._dispatch()  # the head may have been what blocked the others

    def _admissible(self, job: Job) -> bool:
        """Whether ``job`` (the head of the queue) may start now."""
        return not self._active

    def _start(self, job: Job) -> None:
        """Hand ``job`` to the MLX thread; :meth:`_done` must follow exactly once."""
        token = self._token
        assert self._run_one is not None

        def done(result: outcome.Outcome[None]) -> None:  # on the MLX thread
            error = result.error if isinstance(result, outcome.Error) else None
            call_soon(token, self._done, job, error)

        self._thread.submit(self._run_one, job, done=done)

    def _dispatch(self) -> None:
        while not self._closed and self._waiting and self._admissible(self._waiting[0]):
            job = self._waiting.popleft()
            self._active.append(job)
            self._idle = trio.Event()
            self._start(job)

    def _done(self, job: Job, error: BaseException | None) -> None:
        """On the Trio thread: ``job`` has left the MLX thread (finished, cancelled or failed)."""
        if error is not None:
            job.stats.outcome = job.stats.outcome or "error"
            job.sink.put(error)
        job.sink.close_soon()
        if job in self._active:
            self._active.remove(job)
        if not self._active:
            self._idle.set()
        self._dispatch()

    async def wait_idle(self) -> None:
        """Wait until no job is on the MLX thread."""
        while self._active:
            await self._idle.wait()

    def close(self, reason: BaseException) -> None:
        """Refuse new jobs, fail the waiting ones with ``reason``, cancel the running ones."""
        self._closed = True
        while self._waiting:
            job = self._waiting.popleft()
            job.stats.outcome = "withdrawn"
            job.sink.put(reason)
            job.sink.close_soon()
        for job in self._active:
            job.request_cancel()
