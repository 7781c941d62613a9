"""One step of the residency core at a time: the shell's side of the sans-IO loop.

:class:`Steps` steps the :class:`~mlxd.residency.core.Core` with an event and
hands each command the step returns to the shell's ``execute``, in order.
Carrying out a command may raise an event of its own: a lease granted to a
waiter that has gone meanwhile is given straight back (a ``Release``), a
subscriber cancels a waiter (a ``CancelWaiter``). Such a *follow-up* is
queued and stepped once the commands before it are carried out, never
inside their loop (httpcore's pool never re-enters its plan): the commands
of one step are carried out together and in the order the core made them,
and the core is never stepped while they are.

Pure: no Trio, no clock; the manager (:mod:`mlxd.residency.manager`) owns
one and resets its timer after each :meth:`Steps.run` that stepped.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from mlxd.residency.core import Core
from mlxd.residency.messages import Command, Event


class Steps:
    """Steps the core one event at a time and carries out the commands (see the module doc)."""

    def __init__(self, core: Core, execute: Callable[[Command], None]) -> None:
        self.core = core
        #: the shell's side: carry out one command (may call :meth:`run` again)
        self.execute = execute
        #: events waiting for their step: the one being run and its follow-ups
        self._queue: deque[Event] = deque()
        #: a step is being taken or its commands carried out
        self._running = False

    def run(self, event: Event) -> bool:
        """Step ``event``, carry out its commands, then do the same for its follow-ups:
        True once done. While commands are being carried out, ``event`` is only queued
        as a follow-up: False.

        An error raised by the step (an admin request the core refuses: it changed
        nothing) goes to the caller; nothing is left queued for a later step.
        """
        self._queue.append(event)
        if self._running:
            return False
        self._running = True
        try:
            while self._queue:
                for cmd in self.core.step(self._queue.popleft()):
                    self.execute(cmd)
        finally:
            self._running = False
            self._queue.clear()  # only after an error
        return True
