"""Web pages cannot drive or read a daemon without keys (issue 32, finding 3).

A hostile page can make the browser POST to ``http://127.0.0.1:PORT`` (with
``Content-Type: text/plain``, no CORS preflight) or rebind its own name to
127.0.0.1 and read the answers (``Host: evil.example``). Both are refused
before any route runs; clients that are not browsers (no ``Origin``) and the
dashboard's own page (same origin) go on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from mlxd.config.origins import BrowserRules, host_entry, origin_entry
from tests.integration.conftest import config_of, fake
from tests.support.daemon import serving

EVIL = "http://evil.example"


def _config(tmp: Path, **server: Any) -> Any:
    raw = {"server": server, "manager": {"memory_budget_gb": 4},
           "models": [fake("f", 0.1, tokens_per_second=20)]}
    return config_of(raw, tmp)


async def _state(c: httpx.AsyncClient, model: str) -> str:
    r = await c.get(f"/v1/models/{model}")
    return str(r.json()["status"])


async def test_a_foreign_page_cannot_load_or_preempt(tmp_path: Path) -> None:
    """The finding's requests: a load with a foreign Origin and a text/plain body is refused (403) and loads nothing; a preempting unload with a foreign Origin is refused and the running stream goes on to [DONE]."""
    async with serving(_config(tmp_path), tmp_path) as s, s.client() as c:
        r = await c.post("/admin/models/f/load", content=b"",
                         headers={"Origin": EVIL, "Content-Type": "text/plain"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed", r.text
        assert await _state(c, "f") == "unloaded"
        for headers, code in [({"Content-Type": "text/plain"}, "json_body_required"),
                              ({"Content-Type": "application/x-www-form-urlencoded"}, "json_body_required"),
                              ({"Origin": EVIL}, "origin_not_allowed"),
                              ({"Origin": "null"}, "origin_not_allowed")]:
            r = await c.post("/admin/models/f/load", headers=headers)
            assert (r.status_code, r.json()["error"]["code"]) == (403, code), (headers, r.text)
        assert await _state(c, "f") == "unloaded"

        body = {"model": "f", "messages": [{"role": "user", "content": "go"}],
                "max_tokens": 40, "stream": True}
        async with c.stream("POST", "/v1/chat/completions", json=body) as stream:
            lines = stream.aiter_lines()
            async for line in lines:  # skip the ": loading" comments: once data comes, f is busy
                if line.startswith("data: "):
                    break
            r = await c.post("/admin/models/f/unload", params={"preempt": "true"},
                             headers={"Origin": EVIL})
            assert r.status_code == 403, r.text
            rest = [line async for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"


async def test_a_rebinding_page_reads_nothing(tmp_path: Path) -> None:
    """With `Host: evil.example` every path answers 421 host_not_allowed, /health and the dashboard included, and nothing else is in the answer."""
    async with serving(_config(tmp_path), tmp_path) as s, s.client() as c:
        for path in ("/admin/history", "/admin/status", "/health", "/metrics", "/ui", "/v1/models",
                     "/openapi.json", "/no/such/route"):
            r = await c.get(path, headers={"Host": "evil.example:8080"})
            assert r.status_code == 421, (path, r.text)
            assert r.json()["error"]["code"] == "host_not_allowed"
            assert set(r.json()) == {"error"}
        r = await c.post("/v1/messages", headers={"Host": "evil.example"}, json={})
        assert r.status_code == 421 and r.json()["type"] == "error", r.text  # Anthropic's envelope


@pytest.mark.parametrize("host", ["localhost", "127.0.0.1", "127.1.2.3", "[::1]", "LOCALHOST."])
async def test_loopback_names_and_the_pages_own_origin_are_accepted(tmp_path: Path, host: str) -> None:
    """A loopback Host with any port passes, and a POST whose Origin is the request's own (the dashboard's) loads the model."""
    async with serving(_config(tmp_path), tmp_path) as s, s.client() as c:
        port = s.url.rsplit(":", 1)[1]
        headers = {"Host": f"{host}:{port}", "Origin": f"http://{host.lower().rstrip('.')}:{port}"}
        r = await c.get("/health", headers={"Host": f"{host}:9"})
        assert r.status_code == 200, r.text
        r = await c.post("/admin/models/f/load", headers=headers)
        assert r.status_code == 200, r.text
        r = await c.post("/admin/models/f/unload", headers={**headers, "Origin": f"http://{host}:1"})
        assert r.status_code == 403, "the same host on another port is another origin"


async def test_clients_without_origin_and_listed_names_go_on(tmp_path: Path) -> None:
    """Requests without Origin (curl, SDKs, the CLI) pass; a Host in server.allowed_hosts and an Origin in server.allowed_origins pass; others are refused."""
    cfg = _config(tmp_path, allowed_hosts=["mac.local", "192.168.1.20"],
                  allowed_origins=["https://app.example.com"])
    async with serving(cfg, tmp_path) as s, s.client() as c:
        assert (await c.post("/admin/models/f/load")).status_code == 200
        r = await c.post("/v1/chat/completions", json={
            "model": "f", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert r.status_code == 200, r.text
        for host in ("mac.local:8080", "MAC.LOCAL", "192.168.1.20:1"):
            assert (await c.get("/health", headers={"Host": host})).status_code == 200, host
        assert (await c.get("/health", headers={"Host": "192.168.1.21"})).status_code == 421
        ok = await c.post("/admin/models/f/unload", headers={"Origin": "https://app.example.com:443"})
        assert ok.status_code == 200, ok.text
        no = await c.post("/admin/models/f/load", headers={"Origin": "http://app.example.com"})
        assert no.status_code == 403, "http is another origin than https"


def test_a_daemon_bound_to_an_address_accepts_it_and_a_wildcard_accepts_only_loopback() -> None:
    """`server.host: 192.168.1.5` makes that address a Host of the server; `0.0.0.0` adds nothing, so remote clients need server.allowed_hosts."""
    named = BrowserRules.of("192.168.1.5", (), ())
    assert named.host_allowed("192.168.1.5:8080") and named.host_allowed("localhost")
    assert not named.host_allowed("evil.example")
    wildcard = BrowserRules.of("0.0.0.0", (), ())
    assert not wildcard.host_allowed("192.168.1.5:8080")
    assert BrowserRules.of("0.0.0.0", ("192.168.1.5",), ()).host_allowed("192.168.1.5:8080")
    assert BrowserRules.of("::", (host_entry("[fe80::1]"),), ()).host_allowed("[fe80::1]:8080")
    assert wildcard.host_allowed(None) and wildcard.host_allowed("")  # HTTP/1.0: not a browser


@pytest.mark.parametrize(("key", "value", "message"), [
    ("allowed_hosts", ["http://mac.local"], "server.allowed_hosts[0]: must be a host name or address, not a URL"),
    ("allowed_hosts", ["mac.local:8080"], "server.allowed_hosts[0]: give the name without a port"),
    ("allowed_hosts", "mac.local", "server.allowed_hosts: must be a list of strings"),
    ("allowed_hosts", ["*"], "server.allowed_hosts[0]: wildcards are not supported"),
    ("allowed_origins", ["*"], "server.allowed_origins[0]: must be an origin such as"),
    ("allowed_origins", ["app.example.com"], "server.allowed_origins[0]: must be an origin such as"),
    ("allowed_origins", ["https://app.example.com/path"], "server.allowed_origins[0]: must be an origin"),
    ("allowed_origins", [3], "server.allowed_origins[0]: must be a string"),
])
def test_bad_entries_are_config_errors_naming_the_key(tmp_path: Path, key: str, value: Any,
                                                      message: str) -> None:
    """Each wrong entry of allowed_hosts or allowed_origins is a config error naming its key path."""
    from mlxd.errors import ConfigError

    with pytest.raises(ConfigError) as exc:
        _config(tmp_path, **{key: value})
    assert message in exc.value.message


def test_entries_are_normalized() -> None:
    """Entries compare as the headers do: case, a trailing dot, brackets and the default port do not matter."""
    assert host_entry("Mac.Local.") == "mac.local"
    assert host_entry("[::1]") == "::1"
    assert origin_entry("HTTPS://App.Example.com:443/") == "https://app.example.com"
    assert origin_entry("http://localhost:3000") == "http://localhost:3000"


async def test_an_http_1_0_request_without_host_is_served(tmp_path: Path) -> None:
    """A bare `GET /health HTTP/1.0` (no Host: curl --http1.0, probes) is answered 200, not 421."""
    async with serving(_config(tmp_path), tmp_path) as s:
        host, port = s.url.removeprefix("http://").rsplit(":", 1)
        stream = await trio.open_tcp_stream(host, int(port))
        async with stream:
            await stream.send_all(b"GET /health HTTP/1.0\r\n\r\n")
            head = await stream.receive_some(100)
    assert head.startswith(b"HTTP/1.1 200"), head


async def test_the_guard_runs_before_the_body_is_read(tmp_path: Path) -> None:
    """A refused POST with a large text/plain body gets its 403 and the keep-alive connection serves the next request."""
    async with serving(_config(tmp_path), tmp_path) as s, s.client() as c:
        with trio.fail_after(10):
            r = await c.post("/v1/chat/completions", content=b"x" * 500_000,
                             headers={"Content-Type": "text/plain"})
            assert r.status_code == 403
            assert (await c.get("/health")).status_code == 200


@pytest.mark.parametrize("host", ["localhost..", "a..b", "x" * 64 + ".example:8080"])
async def test_a_host_quart_cannot_route_is_refused_not_a_500(tmp_path: Path, host: str) -> None:
    """A Host with an empty or overlong label (werkzeug cannot IDNA-encode it) gets 421 host_not_allowed in the route's envelope, with or without a body, not a 500 with a traceback."""
    async with serving(_config(tmp_path), tmp_path) as s, s.client() as c:
        with trio.fail_after(10):
            r = await c.get("/health", headers={"Host": host})
            assert r.status_code == 421 and r.json()["error"]["code"] == "host_not_allowed", r.text
            r = await c.post("/v1/messages", headers={"Host": host}, json={"model": "f"})
            assert r.status_code == 421 and r.json()["type"] == "error", r.text
            assert (await c.get("/health")).status_code == 200
