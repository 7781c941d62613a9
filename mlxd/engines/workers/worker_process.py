"""The daemon's end of one engine worker process, the owner of them all, and the spare.

:class:`WorkerProcess` starts a worker (:mod:`mlxd.engines.workers.launch` says how),
writes its messages and reads its answers with one Trio task, and tells its
engine (a :class:`~mlxd.engines.workers.process.ProcessEngine`) each message and, once
the process is reaped, its end.

:class:`Workers` owns those tasks: each runs in its nursery, started with
``nursery.start`` (the process is open when ``start`` returns), and
:meth:`Workers.run` is started by whoever owns the engines' lifetime (the
daemon's :class:`~mlxd.engines.DefaultEngines`). When it exits, every
worker's task is cancelled, kills its process and reaps it (within
:data:`REAP_LIMIT_S`): no worker outlives its owner.

A worker's first cost is Python starting and importing mlx-lm: seconds, more
than loading a small model. :class:`Workers` keeps one spare started ahead of
need, its imports done, for the next load of an MLX model
(``isolation: process``, one machine); taking it starts the next spare once
that load is over.
"""

from __future__ import annotations

import logging
import signal
import subprocess
from typing import Any, Protocol

import trio

from mlxd.engines.workers import launch, worker
from mlxd.engines.workers.worker import OUT_OF_STEP
from mlxd.errors import EngineError
from mlxd.framing import Frames, frame

log = logging.getLogger("mlxd.engines.workers.process")

#: seconds an ending worker gets to exit once its output has ended, before SIGKILL
EXIT_GRACE_S = 2.0
#: the bound of a worker's shielded reap (its exit grace, then SIGKILL, which no process can
#: ignore: reaping it then takes milliseconds); past it (a process stuck in the kernel) the
#: worker is given up on, so that its owner's exit never waits on it for longer
REAP_LIMIT_S = EXIT_GRACE_S + 3.0


class Owner(Protocol):
    name: str

    def on_worker_message(self, w: WorkerProcess, message: tuple[Any, ...]) -> None: ...

    def on_worker_exit(self, w: WorkerProcess) -> None: ...


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

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Start the process (started: it is open), then carry its pipe until its output ends
        or this task is cancelled (its owner exits: the process is killed); then reap it."""
        self.process = await trio.lowlevel.open_process(
            self.spec.argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=self.spec.env,
            start_new_session=True,  # a terminal's Ctrl-C is the daemon's to handle
        )
        ended = False
        try:
            task_status.started()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._write)
                await self._read()
                ended = True
                nursery.cancel_scope.cancel()
        except* Exception:  # its engine's bug must not end every other worker with it (the
            # owner's cancellation, even when it comes with such a bug, goes on up)
            log.exception("the pipe of a worker (%s) failed", self.label)
        finally:
            if not ended:
                self.kill()
            with trio.move_on_after(REAP_LIMIT_S) as reaping:
                reaping.shield = True
                await self._reap()
            if reaping.cancelled_caught:
                log.error("%s: not reaped %g s after SIGKILL; giving up on it",
                          self.label, REAP_LIMIT_S - EXIT_GRACE_S)
            self.exited.set()
            if self.owner is not None:
                try:
                    self.owner.on_worker_exit(self)
                except Exception:
                    log.exception("%s: handling the end of %s failed", self.owner.name, self.label)

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

    async def _reap(self) -> None:
        if self.process is None:
            return
        with trio.move_on_after(EXIT_GRACE_S):  # its output ended: it is exiting
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
                    self.owner.on_worker_message(self, message)


class Workers:
    """The owner of the worker processes and of the spare (see the module docstring).

    :meth:`run` is started in the nursery of whoever owns the engines' lifetime;
    until then, and once it has exited, no worker can start.
    """

    def __init__(self) -> None:
        self._nursery: trio.Nursery | None = None
        #: at most one warm worker (mlx-lm imported), for the next MLX load
        self._spare: WorkerProcess | None = None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Host the workers until cancelled; then every one is killed and reaped."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                task_status.started()
                await trio.sleep_forever()
        finally:
            self._nursery = self._spare = None

    async def start(self, owner: Owner | None, spec: launch.RankLaunch) -> WorkerProcess:
        """A new worker for ``owner`` (None: a spare), its process started (OSError if it cannot be)."""
        if self._nursery is None:
            raise EngineError("cannot start an engine worker: the daemon is not running them "
                              "(it is stopping)")
        w = WorkerProcess(owner, spec)
        name = owner.name if owner is not None else "spare"
        await self._nursery.start(w.run, name=f"mlxd worker {name} {w.label}")
        return w

    def _ready_spare(self) -> WorkerProcess | None:
        w = self._spare
        return w if w is not None and not w.exited.is_set() else None

    def take(self, owner: Owner) -> WorkerProcess | None:
        """The spare, now ``owner``'s, or None if there is none ready."""
        w = self._ready_spare()
        self._spare = None
        if w is not None:
            w.adopt(owner)
        return w

    async def refill(self) -> None:
        """Start a spare unless one is ready (its imports run in the background)."""
        if self._ready_spare() is not None:
            return
        try:
            self._spare = await self.start(None, launch.RankLaunch(None, worker.command(warm=True)))
        except (OSError, EngineError) as e:
            log.warning("cannot start a spare engine worker: %s", e)

    def spare_pid(self) -> int | None:
        w = self._ready_spare()
        return w.pid if w is not None else None

    async def spare_ready(self) -> None:
        """Wait until the spare (if any) has done its imports."""
        w = self._ready_spare()
        if w is not None:
            await w.greeted.wait()
