"""Schemathesis against ``/openapi.json`` of a live ``mlxd serve`` on loopback, fake models only.

The daemon runs as a subprocess (:class:`DaemonProcess`) and schemathesis' own
engine -- the one behind ``st run`` -- drives it over real TCP through all its
phases (coverage, fuzzing with positive and negative data, stateful chains of
load/get/unload) for every operation except the endless ``/admin/events``
stream, which test_malformed.py covers, and Ollama's routes that mlxd does not
serve (501 by design), which test_malformed_ollama.py covers. Every answer must pass the checks in
:data:`CHECKS`: no server error, a documented status, content type, headers
and body, invalid data refused and valid data accepted.

(The ``schemathesis.pytest.from_fixture`` integration cannot run here: it sets
``Item._nodeid``, which pytest 9 no longer has.)

Generations are kept cheap: a valid ``max_tokens`` is capped at a few tokens
(so it stays valid), and a body without one gets one, since the fakes stream
one event per token and 131072 of them take a minute.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import pytest
import schemathesis
from schemathesis.engine import events, from_schema

from mlxd.http.validation import MAX_TOKENS_LIMIT
from tests.support.daemon import DaemonProcess, fake_models_config, write_config

#: every answer must pass these (the rest of schemathesis' checks are about
#: authentication and resources created by POST and removed by DELETE: not this API)
CHECKS = (
    "not_a_server_error",
    "status_code_conformance",
    "content_type_conformance",
    "response_headers_conformance",
    "response_schema_conformance",
    "negative_data_rejection",
    "positive_data_acceptance",
    "missing_required_header",
    "unsupported_method",
    "allow_header_conformance",
)
#: the normal suite's seed: the same cases on every run, so a gate is not a lottery (random
#: seeds found the mismatches fixed in 9a23000 in one run out of several); the --stress test
#: draws a new seed each run, and MLXD_SCHEMATHESIS_SEED (a number, or "random") overrides this
NORMAL_SEED = 20261202
GENERATION_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses")
OLLAMA_GENERATION_ROUTES = ("/api/chat", "/api/generate")
FEW_TOKENS = 4


@pytest.fixture(scope="module")
def live_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A ``mlxd serve`` subprocess with three fake models that all fit, on 127.0.0.1 port 0."""
    state = tmp_path_factory.mktemp("schemathesis-daemon")
    raw = fake_models_config({"alpha": 0.5, "beta": 0.5, "gamma": 1.0}, budget_gb=8,
                             strategy="fail", load_seconds=0.01, tokens_per_second=100_000)
    # /api/pull reaches no Hub: offline, with an empty cache, every pull ends at once
    offline = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(state / "hf")}
    with DaemonProcess(write_config(state / "models.yaml", raw), state, env=offline) as daemon:
        yield daemon.url


def _valid_tokens(value: object) -> bool:
    numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
    return numeric and value == value and abs(value) != float("inf") and value == int(value)  # type: ignore[operator, arg-type]


def ollama_case(case: schemathesis.Case) -> schemathesis.Case:
    """Ollama's routes, kept cheap and inside what the document can promise, validity unchanged:
    a valid ``options.num_predict`` is capped at a few tokens (one is added where there is none),
    a valid ``options.num_ctx`` is dropped (a longer prompt is a 400 no schema can foresee), and a
    whole pull (``stream: false``, whose offline failure is a 502) is streamed (a 200 ending in an
    error line)."""
    body = case.body
    if not isinstance(body, dict):
        return case
    if case.path == "/api/pull" and body.get("stream") is False:
        body["stream"] = True
    if case.path not in OLLAMA_GENERATION_ROUTES:
        return case
    options = body.get("options")
    if options is None:
        body["options"] = {"num_predict": FEW_TOKENS}
        return case
    if not isinstance(options, dict):
        return case
    predict = options.get("num_predict")
    if predict is None or (_valid_tokens(predict) and -(2**63) <= predict <= MAX_TOKENS_LIMIT):  # type: ignore[operator]
        options["num_predict"] = FEW_TOKENS
    ctx = options.get("num_ctx")
    if ctx is not None and _valid_tokens(ctx) and 1 <= ctx < 2**63:  # type: ignore[operator]
        del options["num_ctx"]
    return case


def few_tokens(case: schemathesis.Case) -> schemathesis.Case:
    """Cap a valid max_tokens at a few tokens; an invalid one is left as generated."""
    if case.path.startswith("/api/"):
        return ollama_case(case)
    if case.path not in GENERATION_ROUTES or not isinstance(case.body, dict):
        return case
    present = False
    keys = ("max_output_tokens",) if case.path == "/v1/responses" else ("max_tokens", "max_completion_tokens")
    for key in keys:
        value = case.body.get(key)
        if value is None:
            continue
        present = True
        numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
        if numeric and value == value and abs(value) != float("inf") and value == int(value) \
                and 1 <= value <= MAX_TOKENS_LIMIT:
            case.body[key] = min(int(value), FEW_TOKENS)
    if not present and case.path != "/v1/messages":  # required there: its absence is the test
        case.body[keys[0]] = FEW_TOKENS
    return case


def never_refused_for_residency(case: schemathesis.Case) -> schemathesis.Case:
    """Drop ``X-Mlxd-Require-Resident`` when it asks for residency: on a model that is not
    loaded its documented answer is a 503 (``model_not_resident``), which the
    ``not_a_server_error`` check would count as a failure; tests/integration/test_fleet_facts.py
    pins that answer."""
    if case.headers:
        for name in [h for h in case.headers if h.lower() == "x-mlxd-require-resident"]:
            if case.headers[name] in ("1", "true"):
                del case.headers[name]
    return case


@dataclass
class Report:
    seed: int
    cases: int = 0
    seconds: float = 0.0
    statuses: Counter[int] = field(default_factory=Counter)
    phases: Counter[str] = field(default_factory=Counter)
    checks_run: Counter[str] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def summary(self) -> str:
        return (f"{self.cases} cases in {self.seconds:.1f} s (seed {self.seed}), "
                f"phases {dict(self.phases)}, statuses {dict(sorted(self.statuses.items()))}")


def normal_seed() -> int | None:
    given = os.environ.get("MLXD_SCHEMATHESIS_SEED", "")
    if given == "random":
        return None
    if given and not given.isdigit():
        pytest.fail(f"MLXD_SCHEMATHESIS_SEED={given!r}: expected a number or 'random'", pytrace=False)
    return int(given) if given else NORMAL_SEED


def run_schemathesis(url: str, max_examples: int, seed: int | None = None) -> Report:
    """``seed``: None draws a new one (printed with the report, to replay a failure)."""
    config = schemathesis.Config.from_dict({
        **({"seed": seed} if seed is not None else {}),
        "cache": {"enabled": False},  # no .schemathesis/ folder in the repository
        "request-timeout": 30,
        "generation": {"mode": "all", "max-examples": max_examples},
        "phases": {"examples": {"enabled": True}, "coverage": {"enabled": True},
                   "fuzzing": {"enabled": True}, "stateful": {"enabled": True}},
        "checks": {"enabled": False, **{name: {"enabled": True} for name in CHECKS}},
    })
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json", config=config)
    schema = schema.exclude(path="/admin/events")
    # Ollama's routes mlxd does not serve answer 501 by design (test_malformed_ollama.py checks them)
    schema = schema.exclude(path_regex=r"^/api/(delete|copy|create|push|blobs/)")

    @schema.hook
    def map_case(context: schemathesis.HookContext, case: schemathesis.Case) -> schemathesis.Case:
        return never_refused_for_residency(few_tokens(case))

    report = Report(seed=config.seed)
    started = time.monotonic()
    for event in from_schema(schema).execute():
        if isinstance(event, events.ScenarioFinished):
            record(report, event)
        elif isinstance(event, events.NonFatalError):
            report.errors.append(f"{event.label}: {event.value!r}")
        elif isinstance(event, events.FatalError):
            report.errors.append(f"fatal: {event.exception!r}")
    report.seconds = time.monotonic() - started
    return report


def record(report: Report, event: events.ScenarioFinished) -> None:
    recorder = event.recorder
    report.cases += len(recorder.interactions)
    report.phases[event.phase.name.lower()] += len(recorder.interactions)
    for interaction in recorder.interactions.values():
        if interaction.response is not None:
            report.statuses[interaction.response.status_code] += 1
    for case_id, results in recorder.checks.items():
        for result in results:
            report.checks_run[result.name] += 1
            if result.status.name != "FAILURE" or result.failure_info is None:
                continue
            failure = result.failure_info.failure
            case = recorder.cases[case_id].value
            answer = recorder.interactions.get(case_id)
            got = "" if answer is None or answer.response is None else \
                f"\n    answer {answer.response.status_code}: {answer.response.content[:500]!r}"
            report.failures.append(f"{recorder.label} [{result.name}] {failure.title}: "
                                   f"{failure.message}{got}\n    {case.as_curl_command()[:2000]}")


def check(report: Report, url: str, *, minimum_cases: int) -> None:
    print("schemathesis:", report.summary())
    assert report.errors == [], "\n".join(report.errors)
    assert report.failures == [], f"{report.summary()}\n" + "\n".join(report.failures[:20])
    assert report.cases >= minimum_cases, report.summary()
    assert set(report.checks_run) == set(CHECKS), report.checks_run
    assert not any(status >= 500 for status in report.statuses), report.summary()
    assert any(200 <= s < 300 for s in report.statuses), report.summary()
    assert any(400 <= s < 500 for s in report.statuses), report.summary()
    health = httpx.get(f"{url}/health", timeout=10)
    assert health.status_code == 200 and health.json()["status"] == "ok", health.text


def test_openapi_document_holds_against_the_live_daemon(live_url: str) -> None:
    """Every generated request, valid or not, gets a documented non-5xx answer that matches the document."""
    check(run_schemathesis(live_url, max_examples=50, seed=normal_seed()), live_url,
          minimum_cases=500)


@pytest.mark.stress
def test_openapi_document_holds_under_many_examples(live_url: str) -> None:
    """With many more examples per operation, still no server error and no mismatch with the document."""
    check(run_schemathesis(live_url, max_examples=1000), live_url, minimum_cases=5000)


def test_fixture_keeps_generation_cheap_without_changing_validity() -> None:
    """The token cap leaves invalid max_tokens alone and only lowers valid ones."""
    schema = schemathesis.openapi.from_dict({
        "openapi": "3.1.0", "info": {"title": "t", "version": "1"},
        "paths": {"/v1/completions": {"post": {"requestBody": {"required": True, "content": {
            "application/json": {"schema": {"type": "object"}}}}, "responses": {"200": {
                "description": "ok"}}}}},
    })
    operation = schema["/v1/completions"]["POST"]
    for given, expected in [(10**5, FEW_TOKENS), (2, 2), (16.0, FEW_TOKENS), (0, 0), (-3, -3),
                            (True, True), ("9", "9"), (10**9, 10**9), (None, FEW_TOKENS)]:
        case = operation.Case(body={"max_tokens": given})
        assert few_tokens(case).body["max_tokens"] == expected, given
    case = operation.Case(body={"prompt": "x"})
    assert few_tokens(case).body["max_tokens"] == FEW_TOKENS
    case = operation.Case(body=[1, 2])
    assert few_tokens(case).body == [1, 2]
