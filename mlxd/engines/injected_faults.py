"""Injected engine faults: a model's ``faults:`` script, as its engines carry it out.

The fault-injection tests (and anyone trying mlxd the hostile way) configure
a model with ``faults:`` (:class:`mlxd.config.FaultSettings`); every engine of
that model asks its :class:`Faults` at its real points what to do:

=====================  =====================================================
point                  what can happen
=====================  =====================================================
load                   ``raise`` (every load) / ``raise_once`` (the first);
                       ``hang`` (never ends; cancellable from Trio, the MLX
                       thread stays busy); ``ignore_cancel`` (keeps loading
                       ``delay_s`` more, whatever cancels it)
stop                   ``raise`` / ``raise_once``; ``hang`` (never returns;
                       the manager's stop timeout ends the wait)
generate               ``raise`` mid-stream or ``hang`` between two tokens,
                       after ``after_tokens`` tokens
=====================  =====================================================

A batched model's requests can also be poisoned one by one
(:meth:`Faults.poison`, from tests: no config key sets it): the request
with that ``request_id`` raises :class:`InjectedFault` at one of its own
points (:data:`POISON_POINTS`: its logits processor, its sampler, its
detokenizer, its stop matching) when its ``at_token``-th token is being
made, as a bug or a hostile input there would. The batch isolation suite
(``tests/faults/test_batch_isolation.py``) checks that it ends that request
alone (:mod:`mlxd.engines.scheduling.guard`).

One :class:`Faults` per model, shared by all its residencies (``raise_once``
means once per model, across reloads). The fake engine injects them in Trio
(``hang`` = ``trio.sleep_forever``); the MLX engines on their MLX thread
(``hang`` = the thread blocks, as a wedged kernel would).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Literal

from mlxd.config import FaultSettings

PoisonPoint = Literal["logits", "sampler", "detokenizer", "stop"]
POISON_POINTS: tuple[PoisonPoint, ...] = ("logits", "sampler", "detokenizer", "stop")


class InjectedFault(RuntimeError):
    """Raised where a ``faults:`` script says so."""


#: how long a thread "hangs": past any test, short of forever (daemon threads die with the process)
THREAD_HANG_S = 3600.0


@dataclass(frozen=True, slots=True)
class Poison:
    """Where one request fails: at ``point`` while its ``at_token``-th token (from 1) is made."""

    point: PoisonPoint
    at_token: int = 1

    def strike(self, point: PoisonPoint, n: int) -> None:
        """Raise :class:`InjectedFault` if this is the point and the token."""
        if point == self.point and n == self.at_token:
            raise InjectedFault(f"injected failure of the {point} at token {n}")


class Faults:
    """The fault script of one model and its counters (see the module docstring)."""

    def __init__(self, model: str, settings: FaultSettings | None) -> None:
        self.model = model
        self.settings = settings or FaultSettings()
        self.loads = 0
        self.stops = 0
        #: set to end every thread hang of this model (tests call it when they are done)
        self.release = threading.Event()
        #: poisoned requests, by request_id (:meth:`poison`)
        self._poisons: dict[str, Poison] = {}

    def poison(self, request_id: str, point: PoisonPoint, at_token: int = 1) -> None:
        """Make the request ``request_id`` fail at ``point`` (module docstring)."""
        self._poisons[request_id] = Poison(point, at_token)

    def poison_of(self, request_id: str | None) -> Poison | None:
        return self._poisons.get(request_id) if request_id is not None else None

    def on_load(self) -> str | None:
        """Called at the start of each load: None, ``hang`` or ``ignore_cancel``; raises for ``raise``."""
        self.loads += 1
        fault = self.settings.load
        if fault == "raise" or (fault == "raise_once" and self.loads == 1):
            raise InjectedFault(f"injected failure of load {self.loads} of {self.model}")
        return fault if fault in ("hang", "ignore_cancel") else None

    def on_stop(self) -> str | None:
        """Called at each stop attempt: None or ``hang``; raises for ``raise``/``raise_once``."""
        self.stops += 1
        fault = self.settings.stop
        if fault == "raise" or (fault == "raise_once" and self.stops == 1):
            raise InjectedFault(f"injected failure of stop {self.stops} of {self.model}")
        return "hang" if fault == "hang" else None

    def on_token(self, produced: int) -> str | None:
        """Called before each token after the first ``produced``: None or ``hang``; raises for ``raise``."""
        fault = self.settings.generate
        if fault is None or produced < self.settings.after_tokens:
            return None
        if fault == "raise":
            raise InjectedFault(f"injected failure of {self.model}'s generation after {produced} tokens")
        return "hang"

    def hang_thread(self) -> None:
        """Block the calling (MLX) thread, as a wedged call would."""
        self.release.wait(THREAD_HANG_S)
