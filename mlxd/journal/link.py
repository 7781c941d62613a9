"""The daemon's end of ONE journal writer process: start it, write to it, read it, end it.

:class:`mlxd.journal.journal.Journal` owns the records, the sequence numbers
and the watermark; it talks to its writer process (:mod:`mlxd.journal.writer`)
through a :class:`WriterLink`, and makes a new link when a writer process dies
or hangs. Everything here concerns one process: its pipes, the messages cut
from its output, whether it said ``ready`` and when it last said anything.
"""

from __future__ import annotations

import contextlib
import logging
import math
import subprocess
from collections.abc import Callable
from typing import Any

import trio

from mlxd.errors import JournalError
from mlxd.framing import Frames, frame
from mlxd.journal.writer import ERROR_KINDS, Settings
from mlxd.journal.writer import command as writer_command

log = logging.getLogger("mlxd.journal.journal")

#: the bound of one message's shielded write. A writer reads its pipe between commits, so a
#: write waits at most for one commit (milliseconds; seconds on a slow disk); one that waits
#: this long is writing to a hung writer (the journal's watchdog kills one silent for
#: ``kill_s``, 10 s, first): the link is cut and the process killed, and the journal starts
#: a new writer, which is sent every unconfirmed row again
SEND_LIMIT_S = 30.0
#: the bound of the shielded reap of a writer already killed (SIGKILL cannot be ignored:
#: milliseconds; past it, a process stuck in the kernel is left to the OS)
REAP_LIMIT_S = 2.0


class WriterLink:
    """One writer process and the two pipes to it."""

    def __init__(self, process: trio.Process) -> None:
        self.process = process
        self.ready = trio.Event()
        #: the process has gone (it said ``exit``, or its output ended)
        self.exited = trio.Event()
        #: why it could not open the file, if it could not
        self.open_error: Exception | None = None
        #: why it ended, when it did so by itself
        self.exit_error: str | None = None
        #: the highest seq in the file, as the process reported when ready
        self.ready_seq = 0
        #: when it last said anything (trio time)
        self.last_report = trio.current_time()
        #: a write was cut mid-message: nothing more can be sent on this link
        self.cut = False
        #: the shielded scope of the message being written, if any
        self.send_scope: trio.CancelScope | None = None
        self._frames = Frames()

    @classmethod
    async def start(cls, settings: Settings, replay_until: int | None) -> WriterLink:
        """Start a writer process and send it ``open`` (and ``replay_until`` after a restart)."""
        try:
            process = await trio.lowlevel.open_process(
                writer_command(), stdin=subprocess.PIPE, stdout=subprocess.PIPE
            )
        except OSError as e:
            raise JournalError(f"journal: cannot start the writer process: {e}") from e
        link = cls(process)
        with contextlib.suppress(trio.BrokenResourceError):  # died at once: the reader says so
            await link.send(("open", settings))
            if replay_until is not None:
                await link.send(("replay_until", replay_until))
        return link

    @property
    def pid(self) -> int:
        return self.process.pid

    async def send(self, message: tuple[Any, ...], *, until: float = math.inf) -> None:
        """Write one message whole: a cancelled write would cut the stream mid-message.

        So it is shielded, within :data:`SEND_LIMIT_S` or until ``until`` if that is sooner (at
        shutdown, the journal's ``flush_timeout``), after which the link is unusable and the
        process is killed.
        """
        assert self.process.stdin is not None
        deadline = min(trio.current_time() + SEND_LIMIT_S, until)
        with trio.CancelScope(shield=True, deadline=deadline) as scope:
            self.send_scope = scope
            try:
                await self.process.stdin.send_all(frame(message))
            finally:
                self.send_scope = None
        if scope.cancelled_caught:
            self.cut = True
            self.kill()  # its output ends: the journal replaces it (or, at shutdown, ends)
            raise trio.BrokenResourceError("journal: the writer stopped reading")

    async def read(self, dispatch: Callable[[tuple[Any, ...]], None]) -> None:
        """Hand each message the process writes to ``dispatch``, until its output ends."""
        assert self.process.stdout is not None
        stdout = self.process.stdout
        while not self.exited.is_set():
            try:
                data = await stdout.receive_some(1 << 16)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                data = b""
            if not data:
                if self.exit_error is None:
                    self.exit_error = self.death() + (" mid-message" if self._frames.partial else "")
                self.gone()
                return
            self.last_report = trio.current_time()
            for message in self._frames.feed(data):
                if message[0] == "ready":
                    self.ready_seq = message[1]
                    for level, line in message[2]:  # what the writer has to say (lock waits...)
                        log.log(level, "%s", line)
                    self.ready.set()
                elif message[0] == "open_error":
                    _, error_kind, text = message
                    self.open_error = ERROR_KINDS.get(error_kind, JournalError)(text)
                    self.ready.set()
                elif message[0] == "exit":
                    self.exit_error = message[1] or self.exit_error or "it exited"
                    self.gone()
                else:
                    dispatch(message)

    def gone(self) -> None:
        self.ready.set()
        self.exited.set()

    def death(self) -> str:
        """How the process ended, as far as can be told now."""
        rc = self.process.poll()
        if rc is not None and rc < 0:
            return f"killed by signal {-rc}"
        return "it died" if rc is None else f"it exited with {rc}"

    def kill(self) -> None:
        with contextlib.suppress(OSError):
            self.process.kill()

    async def close(
        self,
        last: list[tuple[Any, ...]],
        within: float,
        dispatch: Callable[[tuple[Any, ...]], None],
    ) -> bool:
        """Send ``last`` messages and ``stop``, then read the reports until the process
        exits; ``within`` seconds at most (shielded), then it is killed. True if it exited by itself."""
        process = self.process
        assert process.stdin is not None
        with trio.move_on_after(within) as scope:
            scope.shield = True
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                if not self.cut and not self.exited.is_set():
                    for message in last:
                        await self.send(message, until=scope.deadline)
                    await self.send(("stop",), until=scope.deadline)
            await process.stdin.aclose()  # end of input: the writer exits even if it said nothing
            await self.read(dispatch)
            await process.wait()
        exited = process.returncode is not None
        if not exited:
            process.kill()
        with trio.move_on_after(REAP_LIMIT_S) as reaping:
            reaping.shield = True
            await process.wait()
            if process.stdout is not None:
                await process.stdout.aclose()
        if reaping.cancelled_caught:
            log.error("journal: the writer process was not reaped %g s after SIGKILL", REAP_LIMIT_S)
        self.gone()
        return exited
