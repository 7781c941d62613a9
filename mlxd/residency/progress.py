"""Load progress: how far a load is, estimated from the model's measured load time.

Pure (no clock, no I/O): the shell supplies the seconds elapsed, the seconds
the model's last load took (this run's, else the journal's ``measurements``)
and what the engine reports (phase, bytes). Shown three ways, worded here:
``/admin/status`` (``loading``), SSE comment lines on streamed requests
waiting for the load (``: loading demo 40% eta 1.2s``, which OpenAI and
Anthropic clients ignore), and live ``load_progress`` events on ``/admin/events``.

The percent comes from the bytes while the engine downloads (it knows the
total), else from the time elapsed over the measured load time, capped at 99
until the load is done. With neither, only the elapsed time is known.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class LoadEstimate:
    model: str
    elapsed_s: float
    #: how long the model's last measured load took (None: never measured)
    expected_s: float | None
    phase: str = "loading"
    bytes_done: int = 0
    bytes_total: int | None = None

    @property
    def percent(self) -> int | None:
        if self.phase == "done":
            return 100
        if self.phase == "downloading" and self.bytes_total:
            return min(99, int(100 * self.bytes_done / self.bytes_total))
        if self.expected_s:
            return min(99, int(100 * self.elapsed_s / self.expected_s))
        return None

    @property
    def eta_s(self) -> float | None:
        """Seconds left by the measured load time; None if unknown or already overdue."""
        if self.phase == "done":
            return 0.0
        if self.expected_s is None or self.elapsed_s > self.expected_s:
            return None
        return self.expected_s - self.elapsed_s

    def describe(self) -> str:
        """``loading demo 40% eta 1.2s`` (or the seconds elapsed): the text of an SSE comment."""
        pct, eta = self.percent, self.eta_s
        if pct is None:
            return f"loading {self.model} {self.elapsed_s:.1f}s"
        if eta is None:
            return f"loading {self.model} {pct}% {self.elapsed_s:.1f}s (longer than measured)"
        return f"loading {self.model} {pct}% eta {eta:.1f}s"

    def as_dict(self) -> dict[str, Any]:
        """The payload of a ``load_progress`` event (and the ``loading`` part of a status)."""
        eta = self.eta_s
        return {
            "kind": "load_progress",
            "model": self.model,
            "phase": self.phase,
            "percent": self.percent,
            "eta_s": None if eta is None else round(eta, 3),
            "elapsed_s": round(self.elapsed_s, 3),
            "expected_s": None if self.expected_s is None else round(self.expected_s, 3),
            "bytes_done": self.bytes_done,
            "bytes_total": self.bytes_total,
        }
