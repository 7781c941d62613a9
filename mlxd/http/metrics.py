"""Prometheus metrics for ``GET /metrics``, read from the manager at scrape time.

One :class:`Metrics` per daemon. Nothing residency-related is copied into
gauges between scrapes: each scrape reads the manager (budget, committed bytes,
waiters, every model's state and leases, and the per-model counts of
:class:`mlxd.residency.stats.ModelStats`, where an eviction has its one
definition). A model that ``/admin/reload`` removed is not in the manager any
more, so its series vanish from the next scrape, histograms included.

The residency families and the histograms are written in the Prometheus text
format (0.0.4) here, not through ``prometheus_client``'s collector objects:
those build one Python object per sample, which took about a second for
10,000 configured models on the 2-core dev box, against a few tens of
milliseconds for these string templates. The HTTP request counters and the
per-client request and token counters stay ``prometheus_client`` metrics in
:attr:`Metrics.registry` (their cardinality is routes x statuses and API key
names, not models), and are appended to the same reply.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Container, Iterable
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, generate_latest

from mlxd.residency.events import LeaseReleased, ManagerEvent
from mlxd.residency.manager import Manager
from mlxd.residency.states import State

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

LEASE_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600)
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
TOKENS_PER_SECOND_BUCKETS = (1, 5, 10, 20, 50, 100, 200, 500, 1000, 5000)


def label(value: str) -> str:
    """A label value escaped for the text format (backslash, double quote, newline)."""
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    return repr(float(value))


def _head(out: list[str], name: str, kind: str, doc: str) -> None:
    out.append(f"# HELP {name} {doc}\n# TYPE {name} {kind}\n")


@dataclass
class _Series:
    counts: list[int]
    total: float = 0.0


@dataclass
class Histogram:
    """One histogram family whose first label is the model (so removed models can vanish)."""

    name: str
    doc: str
    labelnames: tuple[str, ...]
    buckets: tuple[float, ...]
    series: dict[tuple[str, ...], _Series] = field(default_factory=dict)

    def observe(self, labels: tuple[str, ...], value: float) -> None:
        s = self.series.get(labels)
        if s is None:
            s = self.series[labels] = _Series([0] * (len(self.buckets) + 1))
        s.counts[bisect.bisect_left(self.buckets, value)] += 1
        s.total += value

    def render(self, out: list[str], models: Container[str]) -> None:
        """Write the series of models still configured; forget the others."""
        for labels in [k for k in self.series if k[0] not in models]:
            del self.series[labels]
        if not self.series:
            return
        _head(out, self.name, "histogram", self.doc)
        bounds = [*(_number(b) for b in self.buckets), "+Inf"]
        for labels, s in self.series.items():
            pairs = ",".join(f'{n}="{label(v)}"' for n, v in zip(self.labelnames, labels, strict=True))
            cumulative = 0
            for bound, count in zip(bounds, s.counts, strict=True):
                cumulative += count
                out.append(f'{self.name}_bucket{{{pairs},le="{bound}"}} {_number(cumulative)}\n')
            out.append(f"{self.name}_count{{{pairs}}} {_number(cumulative)}\n")
            out.append(f"{self.name}_sum{{{pairs}}} {_number(s.total)}\n")


class Metrics:
    """The daemon's metrics: residency read from ``manager`` at scrape time, plus histograms."""

    def __init__(
        self, manager: Manager, journal: Callable[[], tuple[int, int]] | None = None
    ) -> None:
        self.manager = manager
        #: the journal's (records committed, transactions committed), read at scrape time
        self.journal = journal
        #: each configured model's escaped label value, kept until the config changes
        self._names: dict[str, str] = {}
        #: prometheus_client metrics whose labels are not models (HTTP requests)
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "mlxd_http_requests", "HTTP requests by route and status", ["route", "status"],
            registry=self.registry,
        )
        # Per client (the API key's name: a handful, fixed by the config, so no cardinality risk).
        self.client_requests = Counter(
            "mlxd_client_requests", "HTTP requests by client (API key name) and status",
            ["client", "status"], registry=self.registry,
        )
        self.client_tokens = Counter(
            "mlxd_client_tokens", "Tokens by client (API key name): prompt or completion",
            ["client", "kind"], registry=self.registry,
        )
        self.lease_seconds = Histogram(
            "mlxd_lease_seconds", "How long leases were held", ("model", "outcome"), LEASE_BUCKETS
        )
        self.ttft = Histogram(
            "mlxd_time_to_first_token_seconds", "Time from request to first token", ("model",),
            TTFT_BUCKETS,
        )
        self.tokens_per_second = Histogram(
            "mlxd_decode_tokens_per_second", "Decode speed of finished generations", ("model",),
            TOKENS_PER_SECOND_BUCKETS,
        )

    def on_event(self, event: ManagerEvent) -> None:
        """Manager subscriber: lease durations (everything else is read at scrape time)."""
        if isinstance(event, LeaseReleased):
            self.lease_seconds.observe((event.model, event.outcome.value), event.held_seconds)

    def observe_client(
        self, client: str, status: int | None, prompt_tokens: int | None, completion_tokens: int | None
    ) -> None:
        """One finished request of ``client``, with the tokens its lease used."""
        self.client_requests.labels(client, str(status or 0)).inc()
        if prompt_tokens:
            self.client_tokens.labels(client, "prompt").inc(prompt_tokens)
        if completion_tokens:
            self.client_tokens.labels(client, "completion").inc(completion_tokens)

    def observe_generation(
        self, model: str, ttft_s: float | None, tokens: int, decode_s: float
    ) -> None:
        if ttft_s is not None:
            self.ttft.observe((model,), ttft_s)
        if tokens > 1 and decode_s > 0:
            self.tokens_per_second.observe((model,), tokens / decode_s)

    def render(self) -> bytes:
        """The whole ``/metrics`` reply in the Prometheus text format."""
        out: list[str] = []
        models = self.manager.model_names()
        if list(self._names) != models:  # the config changed: escape the names again
            self._names = {name: self._names.get(name) or label(name) for name in models}
        residency(out, self.manager, self._names)
        for histogram in (self.lease_seconds, self.ttft, self.tokens_per_second):
            histogram.render(out, self._names)
        if self.journal is not None:
            records, commits = self.journal()
            _head(out, "mlxd_journal_records_total", "counter", "Records the journal has written")
            out.append(f"mlxd_journal_records_total {_number(records)}\n")
            _head(out, "mlxd_journal_commits_total", "counter",
                  "SQLite transactions that wrote them (group commit: far fewer than records)")
            out.append(f"mlxd_journal_commits_total {_number(commits)}\n")
        return "".join(out).encode() + generate_latest(self.registry)


#: the tail of a model's ``mlxd_model_state`` line, by its state
_STATE_TAIL: dict[State, str] = {st: f'",state="{st.value}"}} 1.0\n' for st in State}


def residency(out: list[str], manager: Manager, names: dict[str, str]) -> None:
    """Budget, committed bytes, waiters, and every model's state, leases and counts.

    ``names`` maps each configured model to its escaped label value.
    """
    res = manager.snapshot()
    _head(out, "mlxd_budget_bytes", "gauge", "The memory budget in bytes")
    out.append(f"mlxd_budget_bytes {_number(res.budget_bytes)}\n")
    _head(out, "mlxd_committed_bytes", "gauge", "Bytes committed to models")
    out.append(f"mlxd_committed_bytes {_number(res.committed_bytes)}\n")
    _head(out, "mlxd_waiters", "gauge", "Requests waiting for a model")
    out.append(f"mlxd_waiters {_number(len(res.waiters))}\n")
    # One series per model, labelled with its current state (value 1): six series a
    # model with 0s would make a 10,000-model scrape six times the size, for nothing
    # that `mlxd_model_state{state="loaded"}` or `count by (state)` cannot answer.
    _head(out, "mlxd_model_state", "gauge", "Each model's residency state (the state label; always 1)")
    out.extend(
        f'mlxd_model_state{{model="{names[name]}{_STATE_TAIL[state]}'
        for name, state, _, _ in res.models
    )
    _head(out, "mlxd_active_leases", "gauge", "Leases held now, by model")
    out.extend(
        f'mlxd_active_leases{{model="{names[name]}"}} {leases}.0\n'
        for name, _, leases, _ in res.models
    )
    _counts(out, manager, names)


def _counts(out: list[str], manager: Manager, names: dict[str, str]) -> None:
    """The per-model counters; models with nothing to count yet are left out."""
    active = [(names[n], s) for n, s in manager.stats.items() if n in names and s.transitions]
    families: Iterable[tuple[str, str, str]] = (
        ("mlxd_loads_total", "loads", "Loads started"),
        ("mlxd_load_failures_total", "load_failures", "Loads that failed"),
        ("mlxd_evictions_total", "evictions",
         "Models sent out of memory to make room (-> unloading, reason evicted or preempted)"),
        ("mlxd_preemptions_total", "preemptions", "Leases preempted to make room or by an admin unload"),
    )
    for metric, attr, doc in families:
        _head(out, metric, "counter", doc)
        out.extend(
            f'{metric}{{model="{quoted}"}} {_number(getattr(stats, attr))}\n'
            for quoted, stats in active
        )
    _head(out, "mlxd_transitions_total", "counter", "Residency transitions")
    for quoted, stats in active:
        out.extend(
            f'mlxd_transitions_total{{model="{quoted}",to_state="{to_state.value}",'
            f'reason="{reason.value}"}} {_number(n)}\n'
            for (to_state, reason), n in stats.transitions.items()
        )
