"""What happened to each model in this run, counted once: the numbers ``/metrics`` reads.

:class:`ModelStats` counts the transitions of one model as the manager carries
them out, and the leases preempted to make room. ``/metrics`` reads these at
scrape time (it copies nothing), and a model removed by a config reload takes
its counts with it. Pure data: no Trio, no I/O.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from mlxd.residency.states import Reason, State, is_eviction


@dataclass
class ModelStats:
    #: transitions into each state, by reason
    transitions: Counter[tuple[State, Reason]] = field(default_factory=Counter)
    #: loads started (``-> loading``)
    loads: int = 0
    #: loads that failed (reason ``load_failed``)
    load_failures: int = 0
    #: evictions, as :func:`mlxd.residency.states.is_eviction` defines them
    evictions: int = 0
    #: leases preempted (to make room, or by an admin unload with ``preempt``)
    preemptions: int = 0

    def count_transition(self, to_state: State, reason: Reason) -> None:
        self.transitions[to_state, reason] += 1
        if to_state is State.LOADING:
            self.loads += 1
        if reason is Reason.LOAD_FAILED:
            self.load_failures += 1
        if is_eviction(to_state, reason):
            self.evictions += 1


def totals(stats: dict[str, ModelStats]) -> dict[str, int]:
    """Run-wide sums of the per-model counts."""
    return {
        "loads": sum(s.loads for s in stats.values()),
        "load_failures": sum(s.load_failures for s in stats.values()),
        "evictions": sum(s.evictions for s in stats.values()),
        "preemptions": sum(s.preemptions for s in stats.values()),
    }
