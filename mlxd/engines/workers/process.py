"""``isolation: process``: one residency in worker processes, behind the Engine protocol.

Theory of operation
-------------------
:class:`ProcessEngine` is what the manager holds for a model whose engine runs
out of the daemon: each load starts fresh workers (:mod:`mlxd.engines.workers.launch`:
one, or one per rank of a ``distributed:`` model), each hosting the model's
ordinary engine class (:mod:`mlxd.engines.workers.worker`). The daemon side only
relays: requests go down the pipe, tokens come up. Each worker has a
:class:`~mlxd.engines.workers.worker_process.WorkerProcess` whose one Trio task
reads and writes its frames, in the nursery of the
:class:`~mlxd.engines.workers.worker_process.Workers` the engine is given (its
owner: the engine needs no nursery of its own, and no worker outlives the
owner). A load of an MLX model on one machine takes the owner's spare
worker if one is ready (Python started, mlx-lm imported: see
:mod:`mlxd.engines.workers.worker_process`) and leaves a new spare behind.

Cancellation. A generation whose consumer leaves sends ``cancel`` and returns
at once (the worker's engine stops within a token, as on a thread). A load
that is cancelled sends ``cancel_load``; :meth:`ProcessEngine.stop` then gives
the workers :data:`CANCEL_GRACE_S` to exit and kills them: a load that does not
answer cancellation (``mlx_lm.load`` cannot be interrupted) ends with its
process, and so does its memory. A normal stop asks rank 0 to stop (it tells
the other ranks) and kills whatever has not exited after :data:`STOP_GRACE_S`.
A stop never fails: a killed process holds nothing.

Death. When any worker's pipe ends without a ``stop`` (SIGKILL, ``abort()``,
the OOM killer, a remote host gone), every other worker of the residency is
killed, every stream in flight gets :class:`~mlxd.errors.EngineDied`, a load in
flight fails, and :meth:`ProcessEngine.wait_died` returns the description
(``rank 1 (mac-b.local): killed by SIGKILL``) for the manager, which fails
the model (reason ``engine_died``). The daemon itself is never touched.
"""

from __future__ import annotations

import itertools
import logging
import math
import shutil
from collections.abc import AsyncGenerator
from dataclasses import replace
from typing import Any

import trio

from mlxd.config import ModelConfig
from mlxd.engines.base import (
    Finished,
    GenerationEvent,
    GenerationRequest,
    KvBook,
    KvBroker,
    LoadProgress,
    ProgressCallback,
)
from mlxd.engines.scheduling.kv_gate import KvLedger
from mlxd.engines.workers import launch
from mlxd.engines.workers.wire import error_from_wire
from mlxd.engines.workers.worker import OUT_OF_STEP
from mlxd.engines.workers.worker_process import REAP_LIMIT_S, WorkerProcess, Workers
from mlxd.errors import EngineDied, EngineError, LoadFailed, MlxdError, Overloaded

log = logging.getLogger("mlxd.engines.workers.process")

#: seconds a worker gets to exit after a cancelled load before it is killed
CANCEL_GRACE_S = 1.0
#: seconds a loaded worker gets to stop its engine and exit before it is killed
STOP_GRACE_S = 5.0


def _deliver(stream: trio.MemorySendChannel[object], item: object) -> None:
    try:
        stream.send_nowait(item)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass  # its consumer has just left


class ProcessEngine:
    """One residency of a model in worker processes (see the module docstring)."""

    kind = "process"

    def __init__(self, model: ModelConfig, workers: Workers) -> None:
        """``workers``: the owner its worker processes run under (and the spare it may take)."""
        self.name = model.name
        self.config = model
        self.workers = workers
        self.memory_source: str | None = None
        #: every rank's measured share (bytes), by rank, once loaded
        self.shares: dict[int, int | None] = {}
        self.death: str | None = None
        self._workers: list[WorkerProcess] = []
        self._progress: ProgressCallback | None = None
        self._measured: int | None = None
        self._load_error: MlxdError | None = None
        self._load_done = trio.Event()
        self._all_exited = trio.Event()
        self._died = trio.Event()
        self._streams: dict[int, trio.MemorySendChannel[object]] = {}
        self._ids = itertools.count(1)
        self._started = False
        self._ready = False
        self._stopping = False
        self._stopped = False
        #: the residency's side of this model's KV; the worker's engine reserves nothing, so
        #: the daemon side does (:class:`~mlxd.engines.scheduling.kv_gate.KvLedger`)
        self.kv_broker: KvBroker | None = None
        self.kv = KvLedger(KvBook(0, None))
        #: what the worker's engine last said it holds (``memory_usage``; batched models)
        self._usage: dict[str, int] | None = None

    # ---- status ---------------------------------------------------------------------------

    def pids(self) -> list[int]:
        """The local pids of this residency's workers (rank order; ssh clients for remote ranks)."""
        return [w.pid for w in self._workers if w.pid is not None and not w.exited.is_set()]

    def describe(self) -> dict[str, Any]:
        """What ``/admin/status`` shows of the engine."""
        return {
            "isolation": "process",
            "workers": [
                {"rank": w.rank, "where": w.spec.where, "pid": w.pid, "remote_pid": w.remote_pid,
                 "share_bytes": self.shares.get(w.rank)}
                for w in self._workers
            ],
        }

    def measured_bytes(self) -> int | None:
        return self._measured

    def memory_usage(self) -> dict[str, int] | None:
        """KV and prompt cache bytes the worker's batched engine holds, and its KV peak, as of
        its last report (at load and after each generation); None when it is not batched."""
        return self._usage

    def use_kv_broker(self, broker: KvBroker) -> None:
        """Draw this residency's KV beyond its floor from the budget (before the load)."""
        self.kv_broker = broker

    def queue_depth(self) -> int:
        return len(self._streams)

    # ---- load / stop ----------------------------------------------------------------------

    async def load(self, progress: ProgressCallback) -> None:
        if self._started:
            raise LoadFailed(f"{self.name}: an engine loads once; make a new one")
        self._started = True
        self._progress = progress
        progress(LoadProgress(phase="starting", detail="starting the engine process"))
        warm = self.config.engine == "mlx" and self.config.distributed is None
        try:
            specs = await trio.to_thread.run_sync(launch.plan, self.config)
            for spec in specs:
                w = (self.workers.take(self) if warm else None) or await self.workers.start(self, spec)
                self._workers.append(w)
        except MlxdError as e:
            raise LoadFailed(e.message) from e
        except OSError as e:
            raise LoadFailed(f"{self.name}: cannot start the engine process: {e}") from e
        for w in self._workers:
            w.post(("load", self.config, w.spec.rank))
        try:
            await self._load_done.wait()
        except trio.Cancelled:
            for w in self._workers:
                w.post(("cancel_load",))
            raise
        if warm:
            await self.workers.refill()  # for the next load, while this model serves
        if self._load_error is not None:
            raise self._load_error
        self._size_kv()
        self._ready = True

    def _size_kv(self) -> None:
        """The floor and KV bytes per token its load committed, by the one rule (mlxd.config.kv)."""
        from mlxd.config.kv import eligibility, resolve_cache_sizes

        if not eligibility(self.config).per_request:
            return  # a distributed model's ranks reserve nothing per request
        sizes = resolve_cache_sizes(self.config)  # config.json is on disk now: one small read
        book = KvBook.of(self.config, sizes.kv_bytes_per_token, sizes.kv_cache, self.kv_broker)
        self.kv = KvLedger(book)

    async def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        self._stopping = True
        self._ready = False
        self._fail_streams(EngineError(f"{self.name}: the model was unloaded", retry_after=1.0))
        if self._workers and not self._all_exited.is_set():
            loaded = all(w.loaded for w in self._workers)
            if loaded:
                self._workers[0].post(("stop",))  # rank 0 tells the others
            else:
                for w in self._workers:
                    w.post(("cancel_load",))
            with trio.move_on_after(STOP_GRACE_S if loaded else CANCEL_GRACE_S):
                await self._all_exited.wait()
            for w in self._workers:
                w.kill()
            # killed: each worker's task reaps it within REAP_LIMIT_S (then it is given up on)
            with trio.move_on_after(REAP_LIMIT_S + 1.0) as reaping:
                reaping.shield = True
                await self._all_exited.wait()
        self._cleanup_files()

    async def wait_died(self) -> str:
        await self._died.wait()
        assert self.death is not None
        return self.death

    # ---- prepare / generate ----------------------------------------------------------------

    def _check_ready(self) -> None:
        if self.death is not None:
            raise self._died_error()
        if not self._ready:
            raise EngineError(f"{self.name}: the model is not loaded", retry_after=1.0)

    async def prepare(self, request: GenerationRequest) -> GenerationRequest:
        """The worker's engine prepares it (validation, tokenizing, prompt limits); its KV
        must fit the budget with every other model evicted (400 otherwise)."""
        prepared = await self._ask("prepare", request)
        assert isinstance(prepared, GenerationRequest)
        if prepared.prompt_ids is None:
            return prepared
        fit = self.kv.book.fit(self.name, len(prepared.prompt_ids), prepared.max_tokens)
        return replace(prepared, max_tokens=fit) if fit != prepared.max_tokens else prepared

    async def _ask(self, kind: str, request: GenerationRequest) -> object:
        """Post ``(kind, rid, request)`` to the first worker and return its one answer."""
        self._check_ready()
        rid = next(self._ids)
        send, receive = trio.open_memory_channel[object](1)
        self._streams[rid] = send
        rank0 = self._workers[0]
        rank0.post((kind, rid, request))
        answered = False
        try:
            async with receive:
                item = await receive.receive()
                answered = True
        finally:
            self._streams.pop(rid, None)
            if not answered:
                rank0.post(("cancel", rid))
        if isinstance(item, BaseException):
            raise item
        return item

    async def count_tokens(self, request: GenerationRequest) -> int:
        """The prompt's tokens, as the worker's engine counts them (never refused for KV)."""
        n = await self._ask("count", request)
        assert isinstance(n, int)
        return n

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[GenerationEvent, None]:
        self._check_ready()
        if len(self._streams) >= self.config.max_queue:
            raise Overloaded(
                f"{self.name}: {len(self._streams)} requests are already queued "
                f"(max_queue={self.config.max_queue})"
            )
        rid = next(self._ids)
        send, receive = trio.open_memory_channel[object](math.inf)
        self._streams[rid] = send
        rank0 = self._workers[0]
        finished = False
        try:
            tokens = len(request.prompt_ids or ()) + request.max_tokens
            await self.kv.hold(rid, tokens, request.lease_id)
            rank0.post(("generate", rid, request))
            async with receive:
                async for item in receive:
                    if isinstance(item, BaseException):
                        raise item
                    assert isinstance(item, GenerationEvent)
                    if isinstance(item, Finished):
                        finished = True
                    yield item
                    if finished:
                        return
            raise EngineError(f"{self.name}: generation ended without a result")
        finally:
            self._streams.pop(rid, None)
            self.kv.release(rid)
            if not finished:
                rank0.post(("cancel", rid))

    # ---- from the workers (called by their tasks) -----------------------------------------

    def on_worker_message(self, w: WorkerProcess, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind in ("event", "error"):
            stream = self._streams.get(message[1])
            if stream is not None:
                _deliver(stream, message[2] if kind == "event" else error_from_wire(message[2]))
        elif kind == "usage":
            self._usage = message[1]
        elif kind == "progress":
            if w.rank == 0 and self._progress is not None and not self._load_done.is_set():
                self._progress(message[1])
        elif kind == "loaded":
            w.loaded = True
            self.shares[w.rank] = message[1]
            if w.rank == 0:
                self._measured, self.memory_source = message[1], message[2]
            if all(x.loaded for x in self._workers):
                self._load_done.set()
        elif kind == "load_failed":
            if self._load_error is None:
                error = error_from_wire(message[1])
                prefix = "" if self.config.distributed is None else f"{w.label}: "
                self._load_error = LoadFailed(prefix + error.message)
            self._load_done.set()
        elif kind == "stopped" and message[1]:
            log.warning("%s: %s stopped with an error: %s", self.name, w.label, message[1])

    def on_worker_exit(self, w: WorkerProcess) -> None:
        if not self._stopping and self.death is None:
            self.death = w.describe_exit()
            log.error("%s: %s; ending this residency", self.name, self.death)
            for other in self._workers:
                other.kill()
            self._fail_streams(self._died_error())
            if not self._load_done.is_set():
                self._load_error = self._load_error or EngineDied(
                    f"{self.name}: {self.death} while loading"
                )
                self._load_done.set()
        if all(x.exited.is_set() for x in self._workers):
            self._all_exited.set()
            self._cleanup_files()
            if self.death is not None:
                # the cause: a rank that died on its own, rather than one that lost step after it
                causes = [
                    x for x in self._workers
                    if not x.killed and x.process is not None and x.process.returncode != OUT_OF_STEP
                ]
                if causes and len(self._workers) > 1:
                    self.death = causes[0].describe_exit()
                self._died.set()

    def _died_error(self) -> EngineDied:
        return EngineDied(
            f"'{self.name}': its engine process died ({self.death}); the next request loads it again"
        )

    def _fail_streams(self, error: MlxdError) -> None:
        for stream in list(self._streams.values()):
            _deliver(stream, error)

    def _cleanup_files(self) -> None:
        for w in self._workers:
            for path in w.spec.files:
                shutil.rmtree(path.parent, ignore_errors=True)
