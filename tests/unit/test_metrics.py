"""/metrics reads the manager at scrape time: valid text, one eviction rule, removed models vanish."""

from __future__ import annotations

import trio
from prometheus_client.parser import text_string_to_metric_families

from mlxd.config import parse_config
from mlxd.engines.fake import FakeFleet
from mlxd.http.metrics import Metrics
from mlxd.residency.manager import Manager
from mlxd.residency.states import Reason, State, is_eviction
from tests.support.harness import make_config, running


def samples(metrics: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a scrape, parsed by prometheus_client's own text parser."""
    text = metrics.render().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(got: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float | None:
    return got.get((name, tuple(sorted(labels.items()))))


async def test_scrape_reads_the_manager_now(autojump_clock: trio.abc.Clock) -> None:
    """Each scrape shows the manager's current states, leases, committed bytes and budget, as valid text."""
    async with running(make_config({"a": 2, "b": 3}, 8)) as h:
        metrics = Metrics(h.manager)
        got = samples(metrics)
        assert value(got, "mlxd_model_state", model="a", state="unloaded") == 1.0
        assert value(got, "mlxd_model_state", model="a", state="loaded") is None  # one series a model
        async with h.manager.lease("a"):
            got = samples(metrics)
            assert value(got, "mlxd_model_state", model="a", state="loaded") == 1.0
            assert value(got, "mlxd_model_state", model="a", state="unloaded") is None
            assert value(got, "mlxd_active_leases", model="a") == 1.0
            assert value(got, "mlxd_committed_bytes") == h.manager.snapshot().committed_bytes > 0
            assert value(got, "mlxd_budget_bytes") == h.manager.snapshot().budget_bytes
            assert value(got, "mlxd_loads_total", model="a") == 1.0
        got = samples(metrics)
        assert value(got, "mlxd_active_leases", model="a") == 0.0
        assert value(got, "mlxd_loads_total", model="b") is None  # nothing happened to b yet


async def test_evictions_are_counted_by_the_one_rule(autojump_clock: trio.abc.Clock) -> None:
    """An idle eviction and a drained busy victim count; a drain called off does not; metrics equal the manager's count."""
    async with running(make_config({"a": 4, "b": 4, "c": 4}, 8, wait_timeout_s=5)) as h:
        metrics = Metrics(h.manager)
        async with h.manager.lease("a"):
            pass
        async with h.manager.lease("b"):
            pass
        async with h.manager.lease("c"):  # a (least recently used, idle) is evicted at once
            pass
        held = await h.hold("b")
        held_c = await h.hold("c")
        with trio.move_on_after(1):  # a wait for room that gives up: the drain is called off
            await h.manager.acquire("a")
        assert ("b", "draining", "loaded", "abandoned") in h.transitions("b") or (
            "c", "draining", "loaded", "abandoned") in h.transitions("c")
        held.release.set()
        held_c.release.set()
        await held.finished.wait()
        await held_c.finished.wait()
        rule = [t for t in h.transitions() if is_eviction(State(t[2]), Reason(t[3]))]
        assert [t[0] for t in rule] == ["a"]
        got = samples(metrics)
        assert value(got, "mlxd_evictions_total", model="a") == 1.0
        assert value(got, "mlxd_evictions_total", model="b") == 0.0
        assert value(got, "mlxd_evictions_total", model="c") == 0.0
        assert h.manager.counters["evictions"] == 1


async def test_models_removed_by_reload_vanish(autojump_clock: trio.abc.Clock) -> None:
    """After a reload removes a model, no series of it is left, histograms and counters included."""
    async with running(make_config({"a": 1, "b": 1}, 8)) as h:
        metrics = Metrics(h.manager)
        h.manager.subscribe(metrics.on_event)
        async with h.manager.lease("b"):
            pass
        await h.manager.unload("b")
        metrics.observe_generation("b", 0.1, 10, 1.0)
        assert 'model="b"' in metrics.render().decode()
        await h.manager.reload(make_config({"a": 1}, 8))
        text = metrics.render().decode()
        assert 'model="b"' not in text
        assert 'mlxd_model_state{model="a",state="unloaded"} 1.0' in text
        await h.manager.reload(make_config({"a": 1, "b": 1}, 8))
        got = samples(metrics)
        assert value(got, "mlxd_model_state", model="b", state="unloaded") == 1.0
        assert value(got, "mlxd_loads_total", model="b") is None  # a new model starts from nothing


def test_label_values_are_escaped() -> None:
    """A model name with a quote and a backslash still gives parseable text with that name."""
    name = 'we"ird\\name'
    config = parse_config({"manager": {"memory_budget_gb": 8},
                           "models": [{"name": name, "engine": "fake", "estimated_memory_gb": 1}]})
    metrics = Metrics(Manager(config, FakeFleet()))
    got = samples(metrics)
    assert value(got, "mlxd_model_state", model=name, state="unloaded") == 1.0

