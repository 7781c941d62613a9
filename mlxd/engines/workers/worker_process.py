"""The daemon's end of one engine worker process, and the spare worker kept ready.

:class:`WorkerProcess` starts a worker (:mod:`mlxd.engines.workers.launch` says how),
writes its messages and reads its answers with one Trio system task (so its
owner, a :class:`~mlxd.engines.workers.process.ProcessEngine`, needs no nursery), and
tells its owner each message and, once the process is reaped, its end. When
the Trio run ends (the daemon exits) the task kills the process.

A worker's first cost is Python starting and importing mlx-lm: seconds, more
than loading a small model. :data:`SPARES` keeps one worker started ahead of
need, its imports done, for the next load of an MLX model
(``isolation: process``, one machine); taking it starts the next spare once
that load is over. It belongs to one Trio run, and it is killed with that run.
"""

from __future__ import annotations

import logging
import signal
import subprocess
from typing import Any, Protocol

import trio

from mlxd.engines.workers import launch, worker
from mlxd.engines.workers.worker import OUT_OF_STEP
from mlxd.framing import Frames, frame

log = logging.getLogger("mlxd.engines.workers.process")


class Owner(Protocol):
    name: str

    def _on_message(self, w: WorkerProcess, message: tuple[Any, ...]) -> None: ...

    def _on_exit(self, w: WorkerProcess) -> None: ...


def describe_exit(returncode: int | None) -> str:
    """``killed by SIGKILL``, ``exited with status 1``, ..."""
    if returncode is None:
        return "stopped answering"
    if returncode == OUT_OF_STEP:
        return "stopped: it lost step with the other ranks"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"killed by {name}" + (" (abort)" if name == "SIGABRT" else "")
    return f"exited with status {returncode}"


def _not_just_cancelled(e: BaseException) -> bool:
    if isinstance(e, BaseExceptionGroup):
        return e.split(trio.Cancelled)[1] is not None
    return not isinstance(e, trio.Cancelled)


class WorkerProcess:
    """One worker: its process, its pipe in both directions, its end."""

    def __init__(self, owner: Owner | None, spec: launch.RankLaunch) -> None:
        self.owner = owner
        self.spec = spec
        self.rank = spec.rank.rank if spec.rank is not None else 0
        self.label = (
            "the engine process"
            if spec.rank is None
            else f"rank {self.rank}" + ("" if spec.where == "local" else f" ({spec.where})")
        )
        self.process: trio.Process | None = None
        self.remote_pid: int | None = None
        self.loaded = False
        #: mlxd killed it (it did not die on its own)
        self.killed = False
        self.exited = trio.Event()
        #: its first message came: Python is up (and a spare's imports are done)
        self.greeted = trio.Event()
        self._outbox: list[bytes] = []
        self._wake = trio.Event()

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    async def start(self) -> None:
        self.process = await trio.lowlevel.open_process(
            self.spec.argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=self.spec.env,
            start_new_session=True,  # a terminal's Ctrl-C is the daemon's to handle
        )
        name = self.owner.name if self.owner is not None else "spare"
        trio.lowlevel.spawn_system_task(self._run, name=f"mlxd worker {name} {self.label}")

    def adopt(self, owner: Owner) -> None:
        """A spare becomes ``owner``'s worker."""
        self.owner = owner

    def post(self, message: tuple[Any, ...]) -> None:
        if not self.exited.is_set():
            self._outbox.append(frame(message))
            self._wake.set()

    def kill(self) -> None:
        if self.process is not None and self.process.returncode is None:
            self.killed = True
            self.process.kill()

    def describe_exit(self) -> str:
        return f"{self.label} {describe_exit(self.process.returncode if self.process else None)}"

    async def _run(self) -> None:
        ended = False
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._write)
                await self._read()
                ended = True
                nursery.cancel_scope.cancel()
        except BaseException as e:  # a system task must never raise
            if _not_just_cancelled(e):  # (cancelled: the Trio run is ending)
                log.exception("the pipe of a worker (%s) failed", self.label)
        finally:
            if not ended:
                self.kill()
            with trio.CancelScope(shield=True):
                await self._reap()
            self.exited.set()
            if self.owner is not None:
                try:
                    self.owner._on_exit(self)
                except Exception:
                    log.exception("%s: handling the end of %s failed", self.owner.name, self.label)

    async def _reap(self) -> None:
        if self.process is None:
            return
        with trio.move_on_after(2.0):  # its output ended: it is exiting
            await self.process.wait()
        self.kill()
        await self.process.wait()

    async def _write(self) -> None:
        assert self.process is not None and self.process.stdin is not None
        stream = self.process.stdin
        try:
            while True:
                await self._wake.wait()
                self._wake = trio.Event()
                data, self._outbox = b"".join(self._outbox), []
                await stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass  # the reader sees the end too

    async def _read(self) -> None:
        assert self.process is not None and self.process.stdout is not None
        frames = Frames()
        while True:
            try:
                data = await self.process.stdout.receive_some(1 << 16)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                return
            if not data:
                return
            for message in frames.feed(data):
                if message[0] == "hello":
                    self.remote_pid = message[1]
                    self.greeted.set()
                elif self.owner is not None:
                    self.owner._on_message(self, message)


class Spares:
    """At most one warm worker (mlx-lm imported) of the current Trio run, for the next MLX load."""

    def __init__(self) -> None:
        self._spare: WorkerProcess | None = None
        self._run: object = None

    def _current(self) -> WorkerProcess | None:
        w = self._spare
        if w is None or self._run is not trio.lowlevel.current_root_task() or w.exited.is_set():
            return None
        return w

    def take(self, owner: Owner) -> WorkerProcess | None:
        """The spare, now ``owner``'s, or None if there is none ready."""
        w = self._current()
        self._spare = None
        if w is not None:
            w.adopt(owner)
        return w

    async def refill(self) -> None:
        """Start a spare unless one is ready (its imports run in the background)."""
        if self._current() is not None:
            return
        w = WorkerProcess(None, launch.RankLaunch(None, worker.command(warm=True)))
        try:
            await w.start()
        except OSError as e:
            log.warning("cannot start a spare engine worker: %s", e)
            return
        self._spare, self._run = w, trio.lowlevel.current_root_task()

    def pid(self) -> int | None:
        w = self._current()
        return w.pid if w is not None else None

    async def ready(self) -> None:
        """Wait until the spare (if any) has done its imports."""
        w = self._current()
        if w is not None:
            await w.greeted.wait()


#: the daemon's spare worker
SPARES = Spares()
