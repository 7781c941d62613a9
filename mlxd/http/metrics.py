"""Prometheus metrics for ``GET /metrics``.

One :class:`Metrics` per daemon, with its own registry (so tests can run many
daemons in one process). It subscribes to the manager's events for the
residency counters and lease durations, and the HTTP layer reports time to
first token and decode speed.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from mlxd.residency.events import LeaseReleased, ManagerEvent, TransitionEvent
from mlxd.residency.states import Reason, State

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Metrics:
    def __init__(self, status: Callable[[], dict[str, object]]) -> None:
        """``status`` returns the manager's status dict; gauges are read from it at scrape time."""
        self.registry = CollectorRegistry()
        self._status = status
        r = self.registry
        self.state = Gauge(
            "mlxd_model_state",
            "Residency state of each model (1 for its current state, 0 otherwise)",
            ["model", "state"],
            registry=r,
        )
        self.committed = Gauge("mlxd_committed_bytes", "Bytes committed to models", registry=r)
        self.budget = Gauge("mlxd_budget_bytes", "The memory budget in bytes", registry=r)
        self.active_leases = Gauge(
            "mlxd_active_leases", "Leases held now, by model", ["model"], registry=r
        )
        self.waiters = Gauge("mlxd_waiters", "Requests waiting for a model", registry=r)
        self.transitions = Counter(
            "mlxd_transitions", "Residency transitions", ["model", "to_state", "reason"], registry=r
        )
        self.loads = Counter("mlxd_loads", "Loads started", ["model"], registry=r)
        self.load_failures = Counter("mlxd_load_failures", "Loads that failed", ["model"], registry=r)
        self.evictions = Counter(
            "mlxd_evictions", "Models evicted to make room", ["model"], registry=r
        )
        self.preemptions = Counter(
            "mlxd_preemptions", "Leases ended by preemption", ["model"], registry=r
        )
        self.lease_seconds = Histogram(
            "mlxd_lease_seconds",
            "How long leases were held",
            ["model", "outcome"],
            buckets=(0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600),
            registry=r,
        )
        self.ttft = Histogram(
            "mlxd_time_to_first_token_seconds",
            "Time from request to first token",
            ["model"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=r,
        )
        self.tokens_per_second = Histogram(
            "mlxd_decode_tokens_per_second",
            "Decode speed of finished generations",
            ["model"],
            buckets=(1, 5, 10, 20, 50, 100, 200, 500, 1000, 5000),
            registry=r,
        )
        self.requests = Counter(
            "mlxd_http_requests", "HTTP requests by route and status", ["route", "status"], registry=r
        )

    def on_event(self, event: ManagerEvent) -> None:
        if isinstance(event, TransitionEvent):
            self.transitions.labels(event.model, event.to_state.value, event.reason.value).inc()
            if event.to_state is State.LOADING:
                self.loads.labels(event.model).inc()
            elif event.to_state is State.FAILED:
                self.load_failures.labels(event.model).inc()
            elif event.to_state in (State.UNLOADING, State.DRAINING) and event.reason in (
                Reason.EVICTED,
                Reason.PREEMPTED,
            ) and event.from_state is State.LOADED:
                self.evictions.labels(event.model).inc()
        elif isinstance(event, LeaseReleased):
            self.lease_seconds.labels(event.model, event.outcome.value).observe(event.held_seconds)
            if event.outcome.value == "preempted":
                self.preemptions.labels(event.model).inc()

    def observe_generation(
        self, model: str, ttft_s: float | None, tokens: int, decode_s: float
    ) -> None:
        if ttft_s is not None:
            self.ttft.labels(model).observe(ttft_s)
        if tokens > 1 and decode_s > 0:
            self.tokens_per_second.labels(model).observe(tokens / decode_s)

    def render(self) -> bytes:
        status = self._status()
        self.committed.set(float(status["committed_bytes"]))  # type: ignore[arg-type]
        self.budget.set(float(status["budget_bytes"]))  # type: ignore[arg-type]
        self.waiters.set(len(status["waiters"]))  # type: ignore[arg-type]
        models: dict[str, dict[str, object]] = status["models"]  # type: ignore[assignment]
        for name, m in models.items():
            for st in State:
                self.state.labels(name, st.value).set(1 if m["state"] == st.value else 0)
            self.active_leases.labels(name).set(float(m["active_leases"]))  # type: ignore[arg-type]
        return generate_latest(self.registry)
