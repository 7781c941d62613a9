"""Residency policies: what an acquire does when its model does not fit, how victims
are chosen, and when a failed engine stop is retried.

Plain data, read by the residency core (:mod:`mlxd.residency.core`) and built
by the config loader (:mod:`mlxd.config`). It imports nothing of mlxd.

* :class:`ContentionPolicy` (``manager.contention_policy``): wait, fail or
  preempt when idle eviction is not enough. A request may ask for a policy of
  its own (``X-Mlxd-Contention``); :meth:`ContentionPolicy.at_most` keeps only
  what the model's policy allows, so a request can ask for less waiting or less
  preemption, never more.
* :class:`ResidencyRules` (``manager.eviction``, ``min_resident_s``,
  ``max_swap_delay_s``, ``max_keep_alive_s``): which idle victim goes first,
  anti-thrash, and the cap on a request's ``keep_alive``.
* :func:`stop_retry_delay`: the backoff between attempts to stop an engine whose stop failed.
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

    def at_most(self, asked: ContentionPolicy) -> ContentionPolicy:
        """What a request that asked for ``asked`` gets under this (its model's) policy.

        Never more than either: it waits only if both wait, no longer than the
        shorter bound; it preempts only if both preempt, no sooner than the later delay.
        """
        if not (self.waits and asked.waits):
            return ContentionPolicy.of("fail")
        timeout = _shorter(self.wait_timeout_s, asked.wait_timeout_s)
        mine, theirs = self.preempt_delay_s, asked.preempt_delay_s
        if mine is None or theirs is None:
            return ContentionPolicy("wait" if timeout is None else "wait_then_fail", timeout)
        if "wait_then_preempt" in (self.strategy, asked.strategy):
            return ContentionPolicy("wait_then_preempt", timeout, max(mine, theirs))
        return ContentionPolicy("preempt", timeout)


def _shorter(a: float | None, b: float | None) -> float | None:
    """The shorter of two bounds, None meaning unbounded."""
    if a is None:
        return b
    return a if b is None else min(a, b)


Eviction = Literal["lru", "cost"]
EVICTIONS: tuple[Eviction, ...] = ("lru", "cost")


@dataclass(frozen=True, slots=True)
class ResidencyRules:
    """How victims are chosen and how long models stay (the ``manager`` keys of the same names).

    * ``eviction``: ``lru`` evicts the least recently used idle model first;
      ``cost`` the one with the fewest measured reload seconds per byte freed
      (a model never measured counts as the dearest), LRU breaking ties.
    * ``min_resident_s``: a model loaded less than this long ago is not an idle victim.
    * ``max_swap_delay_s``: a busy model keeps serving (new requests included) for
      up to this long after a waiter asked for its room (or after it loaded, if
      later) before it is drained: A B A B traffic runs as A A B B.
    * ``max_keep_alive_s``: the cap on a request's ``keep_alive`` (None: no cap).
    """

    eviction: Eviction = "lru"
    min_resident_s: float = 0.0
    max_swap_delay_s: float = 0.0
    max_keep_alive_s: float | None = None

    def keep_alive(self, asked: float) -> float:
        """A request's ``keep_alive`` within the cap: seconds, 0 = unload at once, -1 = no idle unload."""
        cap = self.max_keep_alive_s
        if cap is None:
            return asked
        return cap if asked < 0 or asked > cap else asked


#: a failed engine stop is retried this long after the first failure ...
STOP_RETRY_FIRST_S = 1.0
#: ... doubling with each failure in a row, up to this
STOP_RETRY_MAX_S = 300.0


def stop_retry_delay(failures: int) -> float:
    """Seconds until the next stop attempt after ``failures`` failed ones in a row (>= 1)."""
    return min(STOP_RETRY_MAX_S, STOP_RETRY_FIRST_S * 2.0 ** max(0, failures - 1))
