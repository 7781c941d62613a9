"""The fleet router's choice from the daemons' routing facts, and its fleet file (pure, no I/O)."""

from __future__ import annotations

from typing import Any

import pytest

from mlxd.errors import ConfigError
from mlxd.fleet.config import parse_fleet
from mlxd.fleet.facts import FREE, DaemonFacts, load_cost, rank, with_request, without_model

GB = 1 << 30


def model(state: str = "unloaded", gb: float = 0.6, *, busy: int = 0, load_s: float | None = 1.0,
          used: float | None = None, pinned: bool = False) -> dict[str, Any]:
    size = int(gb * GB)
    return {"state": state, "committed_bytes": 0 if state in ("unloaded", "failed") else size,
            "estimated_bytes": size, "queued": 0, "running": busy, "kv_in_use": 0,
            "expected_load_seconds": load_s, "last_used_at": used, "pinned": pinned}


def daemon(name: str, budget_gb: float = 1.0, **models: dict[str, Any]) -> DaemonFacts:
    committed = sum(m["committed_bytes"] for m in models.values())
    return DaemonFacts.from_status(name, {"budget_bytes": int(budget_gb * GB),
                                          "free_bytes": int(budget_gb * GB) - committed,
                                          "models": models})


def test_resident_and_least_queued_first_with_the_header() -> None:
    """A daemon where the model is loaded wins, the least queued of them first, and the choice says to send the require-resident header."""
    busy = daemon("d0", a=model("loaded", busy=3))
    idle = daemon("d1", a=model("loaded", busy=1))
    empty = daemon("d2", a=model())
    choices = rank("a", [empty, busy, idle])
    assert [(c.daemon, c.resident) for c in choices] == [("d1", True), ("d0", True), ("d2", False)]


def test_a_load_in_flight_is_joined_before_loading_elsewhere() -> None:
    """Where the model is loading, a request joins that load rather than start another."""
    choices = rank("a", [daemon("d0", a=model()), daemon("d1", a=model("loading"))])
    assert [(c.daemon, c.resident) for c in choices] == [("d1", False), ("d0", False)]


def test_else_the_load_that_evicts_the_least() -> None:
    """Free room beats evicting; evicting a quick-to-reload idle model beats a slow one; waiting for a busy model comes last."""
    free = daemon("free", a=model(), b=model(gb=0.3, state="loaded"))
    quick = daemon("quick", a=model(), b=model("loaded", load_s=0.5))
    slow = daemon("slow", a=model(), b=model("loaded", load_s=20.0))
    busy = daemon("busy", a=model(), b=model("loaded", busy=1, load_s=0.1))
    assert load_cost(free, "a") == FREE
    assert load_cost(busy, "a").busy_bytes > 0
    assert [c.daemon for c in rank("a", [busy, slow, quick, free])] == ["free", "quick", "slow", "busy"]


def test_pinned_models_are_never_counted_as_victims() -> None:
    """A pinned idle model is not room: loading next to it must wait (the daemon never evicts it)."""
    pinned = daemon("d0", a=model(), b=model("loaded", pinned=True))
    assert load_cost(pinned, "a").busy_bytes > 0


def test_equal_costs_spread_over_the_emptier_daemon_then_fleet_order() -> None:
    """Between free daemons, the emptier one wins, then the first listed (so concurrent picks agree)."""
    half = daemon("d0", 2.0, a=model(), b=model("loaded"))
    empty1, empty2 = daemon("d1", 2.0, a=model(), b=model()), daemon("d2", 2.0, a=model(), b=model())
    assert [c.daemon for c in rank("a", [half, empty1, empty2])] == ["d1", "d2", "d0"]


def test_a_routed_load_is_seen_by_the_next_choice() -> None:
    """Once a load of a is routed to d0, the next choice for b sees d0 full and picks the other daemon; a refusal (model_not_resident) clears a resident model."""
    d0, d1 = daemon("d0", a=model(), b=model()), daemon("d1", a=model(), b=model())
    d0 = with_request(d0, "a", resident=False)
    assert d0.models["a"].state == "loading" and d0.free_bytes == GB - int(0.6 * GB)
    assert rank("b", [d0, d1])[0].daemon == "d1"
    loaded = daemon("d0", a=model("loaded"))
    assert without_model(loaded, "a").models["a"].state == "unloaded"
    assert without_model(loaded, "a").free_bytes == GB


def test_with_request_evicts_the_idle_victims_it_needs() -> None:
    """A routed load of a into a full daemon takes the room of its least recently used idle model."""
    d = daemon("d0", a=model(), b=model("loaded", used=5.0), c=model("loaded", gb=0.3, used=1.0))
    after = with_request(d, "a", resident=False)
    assert (after.models["c"].state, after.models["b"].state) == ("unloaded", "unloaded")
    assert after.models["a"].state == "loading"


def test_a_daemon_that_does_not_know_the_model_is_not_ranked() -> None:
    """A daemon without the model in its status is left out."""
    assert rank("a", [daemon("d0", b=model())]) == []


@pytest.mark.parametrize(("raw", "message"), [
    ({}, "daemons: must be a non-empty list"),
    ({"daemons": [{"url": "mac-a:8080", "models": ["a"]}]}, "daemons[0].url: must be a daemon base URL"),
    ({"daemons": [{"url": "http://a:1", "models": []}]}, "daemons[0].models: must be a non-empty list"),
    ({"daemons": [{"url": "http://a:1", "models": ["a"], "key": "x"}]}, "daemons[0].key: unknown key"),
    ({"daemons": [{"url": "http://a:1", "models": ["a"], "api_key_env": "not a var"}]},
     "daemons[0].api_key_env: must be an environment variable name"),
    ({"daemons": [{"name": "x", "url": "http://a:1", "models": ["a"]},
                  {"name": "x", "url": "http://b:1", "models": ["a"]}]}, "daemons[1].name: 'x' is also"),
    ({"daemons": [{"url": "http://a:1", "models": ["a"]}], "proxy": {"port": 70000}}, "proxy.port:"),
    ({"daemons": [{"url": "http://a:1", "models": ["a"]}], "proxy": {"retries": 2}}, "proxy.retries: unknown"),
])
def test_fleet_file_errors_name_the_key(raw: dict[str, Any], message: str) -> None:
    """Each mistake in a fleet file is one ConfigError naming the key path."""
    with pytest.raises(ConfigError) as e:
        parse_fleet(raw)
    assert e.value.message.startswith(message), e.value.message


def test_fleet_file_defaults() -> None:
    """A daemon is named after its host and port; the proxy listens on loopback port 4000."""
    fleet = parse_fleet({"daemons": [{"url": "http://mac-a.local:8080/", "models": ["a", "b", "a"]}]})
    d = fleet.daemons[0]
    assert (d.name, d.url, d.models) == ("mac-a.local:8080", "http://mac-a.local:8080", ("a", "b"))
    assert (fleet.proxy.host, fleet.proxy.port, fleet.proxy.num_retries) == ("127.0.0.1", 4000, 3)


@pytest.mark.parametrize("body", [
    [1], {"models": [1, 2]}, {"models": {"m": "x"}}, {"budget_bytes": "lots", "models": {}},
    {"budget_bytes": float("inf")}, {"models": {"m": {"expected_load_seconds": "soon"}}},
])
def test_a_body_that_is_not_an_mlxd_status_is_a_value_error(body: Any) -> None:
    """Another service's JSON at a daemon's URL is a ValueError saying so (the watch and the CLI report it), never an AttributeError or TypeError later."""
    with pytest.raises(ValueError, match="not an mlxd /admin/status"):
        DaemonFacts.from_status("d", body)


def test_route_check_reports_a_daemon_that_answers_something_else() -> None:
    """`ask` (route --check, status --fleet) reports a daemon whose /admin/status is not mlxd's as an error line, not a traceback."""
    import http.server
    import threading

    from mlxd.cli.route import ask

    class Other(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b'{"models": [1, 2]}'
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: Any) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Other)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        (seen,) = ask(parse_fleet({"daemons": [{"name": "d", "url": url, "models": ["m"]}]}))
    finally:
        server.shutdown()
    assert seen.status is None and seen.facts is None
    assert seen.error is not None and "not an mlxd /admin/status" in seen.error
