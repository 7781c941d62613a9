"""The request path of models that generate one at a time: arrival order, ``max_queue`` admission.

:class:`SerialScheduler` serves models that generate one at a time
(``max_batch_size: 1``, ``mllm`` models, models whose KV cache cannot be
batched) on the engine's MLX thread (:class:`~mlxd.engines.runtime.mlx_thread.MlxThread`).
Batched models use :class:`mlxd.engines.scheduling.batching.BatchScheduler`, which
takes the same :class:`~mlxd.engines.runtime.jobs.Job` objects (request, sink,
cancel flag, stats) and runs many of them per decode step on the same thread,
without changing how ``generate`` or the manager see the engine; the KV gate
(:class:`mlxd.engines.scheduling.kv_gate.GatedScheduler`) sits between them.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable

import outcome
import trio

from mlxd.engines.runtime.jobs import Job
from mlxd.engines.runtime.mlx_thread import MlxThread, call_soon
from mlxd.errors import EngineError, Overloaded


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
            self._start(job)

    def _done(self, job: Job, error: BaseException | None) -> None:
        """On the Trio thread: ``job`` has left the MLX thread (finished, cancelled or failed)."""
        if error is not None:
            job.stats.outcome = job.stats.outcome or "error"
            job.sink.put(error)
        job.sink.close_soon()
        if job in self._active:
            self._active.remove(job)
        self._dispatch()

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
