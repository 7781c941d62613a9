"""An engine worker process: one residency of one model, away from the daemon.

Theory of operation
-------------------
The daemon (:class:`mlxd.engines.workers.process.ProcessEngine`) starts this module as a
child process, or over ``ssh`` for a remote rank of a distributed model, and
talks to it over the child's stdin and stdout in framed messages
(:mod:`mlxd.framing`; the messages are listed in :mod:`mlxd.engines.workers.wire`).
The worker runs its own Trio loop and hosts the very engine class the daemon
would run on a thread (:func:`mlxd.engines.in_process.in_process_engine`): the same load,
the same MLX thread, the same scheduler; this module only relays. So whatever
the engine does (batching, prompt caches, memory measurement) happens here
unchanged, and its memory is this process's: when the process ends, for any
reason, the operating system takes all of it back.

* Generations run as one task each; ``("cancel", rid)`` cancels that task,
  which closes the engine's iterator (its stop flag is set as on a thread).
* Outgoing messages are queued and written by one task, so the events of every
  stream that arrived meanwhile go out in one write.
* A distributed rank other than 0 (a *follower*) loads its shard, then follows
  rank 0 (:meth:`mlxd.engines.workers.lockstep.DistributedTextEngine.follow`) until rank 0
  stops; it takes no requests from the daemon.

Lifetime. The worker ignores SIGINT, SIGTERM and SIGHUP (a terminal's Ctrl-C or
a service manager's signal to the whole group must not end a residency behind
the daemon's back: the daemon stops its workers itself); it ends after
``stop``, at once (``os._exit``) at the end of its input, and by itself when
its parent changes (the daemon died; a thread checks twice a second, since a
stuck engine may keep the event loop from ever reading the end of input). It
writes no core file: an ``abort()`` here is an expected way to die.
"""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import signal
import sys
import threading
import time
from contextlib import aclosing
from dataclasses import replace
from functools import partial
from typing import Any

import trio

from mlxd.config import ModelConfig
from mlxd.crash_points import crash_point
from mlxd.engines.base import Engine, GenerationRequest, LoadProgress, TextDelta
from mlxd.engines.runtime import imports_ahead
from mlxd.engines.workers.wire import Rank, error_to_wire
from mlxd.errors import EngineError, MlxdError
from mlxd.framing import Frames, child_command, frame

log = logging.getLogger("mlxd.worker")

#: exit status when the parent (the daemon, or the ssh session of a remote rank) is gone
ORPHANED = 70
#: exit status of a distributed rank that can no longer keep in step (a peer is gone, or
#: its generation failed unexpectedly): only ending the whole residency is safe
OUT_OF_STEP = 75


class Worker:
    """The worker's Trio side: reads the daemon's messages, hosts one engine, relays."""

    def __init__(self, receive: trio.abc.ReceiveStream, send: trio.abc.SendStream) -> None:
        self._receive = receive
        self._send = send
        self._outbox: list[bytes] = []
        self._wake = trio.Event()
        self._posted = 0
        self._written = 0
        self._progress = trio.Event()
        self._engine: Engine | None = None
        self._config: ModelConfig | None = None
        self._rank: Rank | None = None
        self._load_scope: trio.CancelScope | None = None
        self._generations: dict[int, trio.CancelScope] = {}
        self._done = trio.Event()
        self._nursery: trio.Nursery | None = None

    # ---- plumbing -----------------------------------------------------------------------

    def post(self, message: tuple[Any, ...]) -> None:
        """Queue a message to the daemon (written by :meth:`_writer`)."""
        self._outbox.append(frame(message))
        self._posted += 1
        self._wake.set()

    async def _writer(self) -> None:
        while True:
            await self._wake.wait()
            self._wake = trio.Event()
            posted, data, self._outbox = self._posted, b"".join(self._outbox), []
            try:
                await self._send.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                os._exit(0)  # the daemon is gone: nothing here is worth keeping
            self._written = posted
            self._progress.set()
            self._progress = trio.Event()

    async def _flush(self) -> None:
        """Wait until everything posted so far is written."""
        target = self._posted
        while self._written < target:
            await self._progress.wait()

    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._writer)
            self.post(("hello", os.getpid()))
            nursery.start_soon(self._reader)
            await self._done.wait()
            with trio.move_on_after(5):
                await self._flush()
            nursery.cancel_scope.cancel()

    async def _reader(self) -> None:
        frames = Frames()
        while True:
            try:
                data = await self._receive.receive_some(1 << 16)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                data = b""
            if not data:
                os._exit(0)  # end of input: the daemon is gone, or wants this process gone now
            for message in frames.feed(data):
                self._handle(message)

    def _handle(self, message: tuple[Any, ...]) -> None:
        assert self._nursery is not None
        kind = message[0]
        if kind == "load" and self._engine is None and self._config is None:
            self._config, self._rank = message[1], message[2]
            self._nursery.start_soon(self._load)
        elif kind in ("generate", "prepare", "count"):
            scope = trio.CancelScope()
            self._generations[message[1]] = scope
            if kind == "generate":
                self._nursery.start_soon(self._generate, message[1], message[2], scope)
            else:
                task = partial(self._prepare, counting=kind == "count")
                self._nursery.start_soon(task, message[1], message[2], scope)
        elif kind == "cancel":
            if (running := self._generations.get(message[1])) is not None:
                running.cancel()
        elif kind in ("stop", "cancel_load"):
            if self._load_scope is not None:
                self._load_scope.cancel()
            self._nursery.start_soon(self._stop)

    # ---- the engine -----------------------------------------------------------------------

    def _make_engine(self, config: ModelConfig, rank: Rank | None) -> Engine:
        if rank is not None:
            from mlxd.engines.workers.lockstep import DistributedTextEngine

            return DistributedTextEngine(config, rank=rank)
        from mlxd.engines.in_process import in_process_engine

        return in_process_engine(config)

    async def _load(self) -> None:
        config, rank = self._config, self._rank
        assert config is not None
        crash_point("worker.load")

        def progress(p: LoadProgress) -> None:
            self.post(("progress", p))

        with trio.CancelScope() as scope:
            self._load_scope = scope
            try:
                engine = self._make_engine(config, rank)
                self._engine = engine
                await engine.load(progress)
            except Exception as e:
                self.post(("load_failed", error_to_wire(e, f"{config.name}: cannot load")))
                await self._stop()
                return
        self._load_scope = None
        if scope.cancelled_caught:
            return  # _stop runs (it cancelled us)
        await self._flush()  # its progress reports are out, whatever happens next
        crash_point("worker.loaded")  # the memory is held; the daemon has not been told
        self.post(("loaded", engine.measured_bytes(), getattr(engine, "memory_source", None)))
        self._post_usage()
        follow = getattr(engine, "follow", None)
        if rank is not None and rank.rank > 0 and follow is not None:
            try:
                await follow()
            except Exception as e:
                log.error("%s rank %d: following rank 0 failed: %s", config.name, rank.rank, e)
                os._exit(OUT_OF_STEP)
            await self._stop()

    async def _generate(self, rid: int, request: GenerationRequest, scope: trio.CancelScope) -> None:
        engine = self._engine
        try:
            with scope:
                if engine is None:
                    raise MlxdError("the model is not loaded")
                async with aclosing(engine.generate(request)) as events:
                    async for event in events:
                        if isinstance(event, TextDelta):
                            crash_point("worker.token")
                        self.post(("event", rid, event))
        except Exception as e:
            name = self._config.name if self._config is not None else "engine"
            if self._rank is not None and (not isinstance(e, MlxdError) or type(e) is EngineError):
                # not a refusal both ranks made alike (an invalid prompt): the MLX work failed,
                # a peer is gone or this rank is out of step; only ending the residency is safe
                log.error("%s rank 0: generation failed, out of step: %s", name, e)
                os._exit(OUT_OF_STEP)
            self.post(("error", rid, error_to_wire(e, f"{name}: generation failed")))
        finally:
            self._generations.pop(rid, None)
            self._post_usage()

    def _post_usage(self) -> None:
        """Tell the daemon what a batched engine holds (its /admin/status and kv_peaks row)."""
        usage = getattr(self._engine, "memory_usage", None)
        held = usage() if callable(usage) else None
        if held is not None:
            self.post(("usage", dict(held)))

    async def _prepare(
        self, rid: int, request: GenerationRequest, scope: trio.CancelScope, *, counting: bool = False
    ) -> None:
        engine = self._engine
        try:
            with scope:
                if engine is None:
                    raise MlxdError("the model is not loaded")
                if counting:
                    self.post(("event", rid, await engine.count_tokens(request)))
                    return
                prepared = await engine.prepare(request)
                # logits processors are callables bound to this process's model: they stay
                # here (this engine's prepare builds them again for the generate)
                self.post(("event", rid, replace(prepared, logits_processors=())))
        except Exception as e:
            name = self._config.name if self._config is not None else "engine"
            self.post(("error", rid, error_to_wire(e, f"{name}: preparing the request failed")))
        finally:
            self._generations.pop(rid, None)

    async def _stop(self) -> None:
        """Stop the engine (whatever it was doing), tell the daemon, and end the process."""
        if self._done.is_set():
            return
        for scope in list(self._generations.values()):
            scope.cancel()
        error: str | None = None
        if self._engine is not None:
            try:
                await self._engine.stop()
            except Exception as e:
                error = f"{type(e).__name__}: {e}"
        self.post(("stopped", error))
        self._done.set()


def _watch_parent() -> None:
    """End this process when its parent is gone (checked twice a second, off the event loop)."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                os._exit(ORPHANED)

    threading.Thread(target=watch, name="orphan-watch", daemon=True).start()


def main() -> None:
    """The worker process (see the module docstring)."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    receive_fd, send_fd = os.dup(0), os.dup(1)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(2, 1)  # a stray print (a library's progress bar) must not corrupt the protocol
    logging.basicConfig(
        level=os.environ.get("MLXD_WORKER_LOG_LEVEL", "WARNING"),
        format=f"%(asctime)s mlxd-worker[{os.getpid()}] %(levelname)s %(name)s: %(message)s",
    )
    _watch_parent()
    imports_ahead.scan_once()  # before anything imports transformers
    if "--warm" in sys.argv[2:]:
        import mlx_lm  # noqa: F401

        import mlxd.engines.mlx_text  # noqa: F401

        imports_ahead.save_scans()
    worker = Worker(trio.lowlevel.FdStream(receive_fd), trio.lowlevel.FdStream(send_fd))
    trio.run(worker.run)
    sys.stderr.flush()
    os._exit(0)  # the engine is stopped; skip the interpreter's teardown of MLX's statics


def command(*, warm: bool = False) -> list[str]:
    """This interpreter running :func:`main`, this ``mlxd`` importable; ``warm``: it imports
    mlx-lm before it reads anything (a spare's work done ahead of its load)."""
    return [*child_command("mlxd.engines.workers.worker"), *(["--warm"] if warm else [])]


if __name__ == "__main__":
    main()
