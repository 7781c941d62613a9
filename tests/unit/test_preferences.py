"""What a request may ask (keep_alive, X-Mlxd-Contention), what it gets (at most its
model's policy), and the config keys of the residency policy."""

from __future__ import annotations

import math

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from mlxd.config import parse_config
from mlxd.errors import ConfigError, InvalidRequest
from mlxd.http.preferences import parse_contention, parse_keep_alive, preferences
from mlxd.residency.policy import STRATEGIES, ContentionPolicy, ResidencyRules
from mlxd.residency.progress import LoadEstimate


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        (300, 300.0), (2.5, 2.5), (0, 0.0), (-1, -1.0), (-30, -1.0), ("5m", 300.0),
        ("1h30m", 5400.0), ("90s", 90.0), ("500ms", 0.5), ("1.5h", 5400.0), ("0", 0.0),
        ("300", 300.0), ("-1", -1.0), ("-1m", -1.0), ("+2s", 2.0), (".5s", 0.5), (None, None),
    ],
)
def test_keep_alive_takes_ollamas_forms(value: object, seconds: float | None) -> None:
    """keep_alive is seconds, a Go duration string, 0 (unload at once) or negative (-1: until evicted)."""
    assert parse_keep_alive(value) == seconds


@pytest.mark.parametrize("value", ["", " 5m", "5 m", "soon", "5x", "1e3", "5m\n", True, [], {}, math.inf])
def test_keep_alive_refuses_anything_else(value: object) -> None:
    """Any other keep_alive is a 400 naming the field."""
    with pytest.raises(InvalidRequest) as exc:
        parse_keep_alive(value)
    assert exc.value.param == "keep_alive"


def test_the_body_keep_alive_wins_over_the_header() -> None:
    """keep_alive in the body is used when both are given; the header otherwise."""
    headers = {"X-Mlxd-Keep-Alive": "10m", "X-Mlxd-Contention": "fail"}
    assert preferences({"keep_alive": 0}, headers).keep_alive_s == 0
    prefs = preferences({}, headers)
    assert prefs.keep_alive_s == 600 and prefs.contention == ContentionPolicy.of("fail")
    assert preferences({}, {}).keep_alive_s is None and preferences({}, {}).contention is None
    with pytest.raises(InvalidRequest) as exc:  # a bad header is refused even when the body wins
        preferences({"keep_alive": 0}, {"X-Mlxd-Keep-Alive": "Ko|fB"})
    assert exc.value.param == "X-Mlxd-Keep-Alive"


@pytest.mark.parametrize("value", ["", "FAIL", "later", " fail"])
def test_contention_header_is_a_strategy_name(value: str) -> None:
    """X-Mlxd-Contention must be one of the strategy names, exactly."""
    with pytest.raises(InvalidRequest) as exc:
        parse_contention(value)
    assert exc.value.param == "X-Mlxd-Contention"


policies = st.builds(
    ContentionPolicy,
    strategy=st.sampled_from(STRATEGIES),
    wait_timeout_s=st.sampled_from([None, 1.0, 5.0, 30.0]),
    preempt_after_s=st.sampled_from([None, 0.0, 2.0, 7.0]),
)


def _bound(p: ContentionPolicy) -> float:
    return math.inf if p.wait_timeout_s is None else p.wait_timeout_s


@given(model=policies, asked=policies)
def test_a_request_gets_at_most_its_models_policy(model: ContentionPolicy, asked: ContentionPolicy) -> None:
    """The policy a request gets never waits longer, nor preempts sooner or more, than either its model's or its own."""
    got = model.at_most(asked)
    for p in (model, asked):
        assert got.waits <= p.waits
        if got.waits:
            assert _bound(got) <= _bound(p)
        if got.preempt_delay_s is not None:
            assert p.preempt_delay_s is not None and got.preempt_delay_s >= p.preempt_delay_s
    assert model.at_most(model).waits == model.waits
    assert (model.at_most(model).preempt_delay_s is None) == (model.preempt_delay_s is None)


def test_keep_alive_cap() -> None:
    """max_keep_alive_s caps a keep_alive (-1 included) and leaves shorter ones alone."""
    rules = ResidencyRules(max_keep_alive_s=60)
    assert [rules.keep_alive(k) for k in (0, 30, 60, 3600, -1)] == [0, 30, 60, 60, 60]
    assert ResidencyRules().keep_alive(-1) == -1


def test_residency_policy_keys_are_read() -> None:
    """manager.eviction/min_resident_s/max_swap_delay_s/max_keep_alive_s and models[].priority."""
    raw = yaml.safe_load(
        "manager:\n  memory_budget_gb: 8\n  eviction: cost\n  min_resident_s: 30\n"
        "  max_swap_delay_s: 2\n  max_keep_alive_s: 3600\n"
        "models:\n  - {name: a, engine: fake, estimated_memory_gb: 1, priority: 10}\n"
        "  - {name: b, engine: fake, estimated_memory_gb: 1}\n"
    )
    config = parse_config(raw)
    assert config.manager.rules == ResidencyRules("cost", 30, 2, 3600)
    assert [m.priority for m in config.models] == [10, 0]
    assert parse_config({**raw, "manager": {"memory_budget_gb": 8}}).manager.rules == ResidencyRules()


@pytest.mark.parametrize(
    ("manager", "model", "path"),
    [
        ({"eviction": "fifo"}, {}, "manager.eviction"),
        ({"min_resident_s": -1}, {}, "manager.min_resident_s"),
        ({"max_swap_delay_s": "2s"}, {}, "manager.max_swap_delay_s"),
        ({"max_keep_alive_s": -5}, {}, "manager.max_keep_alive_s"),
        ({}, {"priority": "high"}, "models[0].priority"),
        ({}, {"priority": 1.5}, "models[0].priority"),
    ],
)
def test_residency_policy_key_errors_name_the_key(manager: dict[str, object], model: dict[str, object], path: str) -> None:
    """A bad value of a policy key is a config error that names its key path."""
    raw = {"manager": {"memory_budget_gb": 8, **manager},
           "models": [{"name": "a", "engine": "fake", "estimated_memory_gb": 1, **model}]}
    with pytest.raises(ConfigError) as exc:
        parse_config(raw)
    assert exc.value.message.startswith(path), exc.value.message


def test_progress_comment_shows_percent_and_eta() -> None:
    """A load 0.8 s into a measured 2 s load shows 40% and 1.2 s left; unmeasured, the seconds elapsed."""
    assert LoadEstimate("demo", 0.8, 2.0).describe() == "loading demo 40% eta 1.2s"
    assert LoadEstimate("demo", 3.0, None).describe() == "loading demo 3.0s"
    late = LoadEstimate("demo", 3.0, 2.0)
    assert late.percent == 99 and late.eta_s is None
    assert LoadEstimate("d", 1, None, "downloading", 50, 200).percent == 25
