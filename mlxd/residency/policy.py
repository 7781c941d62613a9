"""Contention policies (what an acquire does when its model does not fit) and stop retries.

Plain data, read by the residency core (:mod:`mlxd.residency.core`) and built
by the config loader (:mod:`mlxd.config`). It imports nothing of mlxd.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import EllipsisType
from typing import Literal

Strategy = Literal["fail", "wait", "preempt", "wait_then_fail", "wait_then_preempt"]
STRATEGIES: tuple[Strategy, ...] = (
    "fail",
    "wait",
    "preempt",
    "wait_then_fail",
    "wait_then_preempt",
)
#: ``wait_timeout_s`` of every strategy but ``wait`` when the config does not set it
DEFAULT_WAIT_TIMEOUT_S = 30.0


@dataclass(frozen=True, slots=True)
class ContentionPolicy:
    """What an acquire does when its model does not fit after idle eviction.

    ``wait_timeout_s`` is the bound on waiting for room. It defaults to 30 s for
    every strategy except ``wait``, which waits without bound unless it is set
    (build policies with :meth:`of` to get that default). ``preempt_after_s``
    (``wait_then_preempt`` only) defaults to 0.
    """

    strategy: Strategy = "wait_then_fail"
    wait_timeout_s: float | None = DEFAULT_WAIT_TIMEOUT_S
    preempt_after_s: float | None = None

    @classmethod
    def of(
        cls,
        strategy: Strategy,
        *,
        wait_timeout_s: float | EllipsisType | None = ...,
        preempt_after_s: float | None = None,
    ) -> ContentionPolicy:
        """The policy for ``strategy``; ``wait_timeout_s`` omitted means the strategy's default."""
        if isinstance(wait_timeout_s, EllipsisType):
            wait_timeout_s = None if strategy == "wait" else DEFAULT_WAIT_TIMEOUT_S
        return cls(strategy, wait_timeout_s, preempt_after_s)

    @property
    def preempt_delay_s(self) -> float | None:
        """Seconds a waiter waits before preempting, or None if this policy never preempts."""
        if self.strategy == "preempt":
            return 0.0
        if self.strategy == "wait_then_preempt":
            return self.preempt_after_s if self.preempt_after_s is not None else 0.0
        return None

    @property
    def waits(self) -> bool:
        return self.strategy != "fail"


#: a failed engine stop is retried this long after the first failure ...
STOP_RETRY_FIRST_S = 1.0
#: ... doubling with each failure in a row, up to this
STOP_RETRY_MAX_S = 300.0


def stop_retry_delay(failures: int) -> float:
    """Seconds until the next stop attempt after ``failures`` failed ones in a row (>= 1)."""
    return min(STOP_RETRY_MAX_S, STOP_RETRY_FIRST_S * 2.0 ** max(0, failures - 1))
