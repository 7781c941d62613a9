"""Scoped API keys: every route x {no key, unknown key, each scope} gives the documented status.

The documented rule (README "Scoped keys"), written out here on its own so the
test does not trust the code's table: ``/v1/*`` and Ollama's ``/api/*`` need ``inference``
(``/api/pull`` needs ``admin``); under
``/admin/``, a ``GET`` needs ``read`` and a ``POST`` needs ``admin``, except
``/admin/whoami``, which any known key may call; ``/metrics`` needs ``read``
when ``server.keys`` is configured; everything else is open.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import yaml

from mlxd.config import load_config
from mlxd.config.keys import ResolvedKey
from mlxd.http.app import create_app
from mlxd.http.context import AppState
from tests.integration.conftest import fake
from tests.support.daemon import serving

KEYS = {
    "laptop": ("k-laptop", frozenset({"inference"})),
    "watch": ("k-watch", frozenset({"read"})),
    "ops": ("k-ops", frozenset({"admin"})),
}
#: who calls: None (no key), "unknown" (a key nobody has), or a key name
CALLERS: tuple[str | None, ...] = (None, "unknown", *KEYS)


def documented_scope(method: str, path: str) -> str | None:
    """README's rule: the scope a route needs ('' for any known key), None when open."""
    if path.startswith("/v1/"):
        return "inference"
    if path.startswith("/api/"):
        return "admin" if path == "/api/pull" else "inference"
    if path == "/admin/whoami":
        return ""
    if path.startswith("/admin/"):
        return "read" if method == "GET" else "admin"
    if path == "/metrics":
        return "read"
    return None


def expected(method: str, path: str, caller: str | None) -> str:
    """'401', '403' or 'pass' (any other status: the route itself answered)."""
    scope = documented_scope(method, path)
    if scope is None:
        return "pass"
    if caller is None or caller == "unknown":
        return "401"
    if scope and scope not in KEYS[caller][1]:
        return "403"
    return "pass"


def routes(st: AppState) -> list[tuple[str, str]]:
    """Every (method, concrete path) the app serves, from its own URL map."""
    app = create_app(st)  # a second app on the same state: only its URL map is read
    out = []
    for rule in app.url_map.iter_rules():
        if rule.endpoint == "static":
            continue
        path = re.sub(r"<path:\w+>", "a", rule.rule)
        path = re.sub(r"<\w+>", "app.js", path)
        for method in sorted((rule.methods or set()) - {"HEAD", "OPTIONS"}):
            out.append((method, path))
    return sorted(set(out))


def _config(tmp_path: Path) -> Path:
    raw: dict[str, Any] = {
        "server": {"keys": [
            {"name": name, "env": f"MLXD_TEST_KEY_{name.upper()}", "scopes": sorted(scopes)}
            for name, (_, scopes) in KEYS.items()
        ]},
        "manager": {"memory_budget_gb": 2},
        "models": [fake("a", 0.5, load_seconds=0.0)],
    }  # fmt: skip
    path = tmp_path / "models.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


async def _status(c: httpx.AsyncClient, method: str, path: str, headers: dict[str, str]) -> int:
    body = {"model": "a", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    kw: dict[str, Any] = {"headers": headers}
    if method == "POST" and path.startswith("/v1/"):
        kw["json"] = body if "completions" in path else {"model": "a", "input": "hi",
                                                          "max_output_tokens": 2}
        if path.endswith("/completions") and "chat" not in path:
            kw["json"] = {"model": "a", "prompt": "hi", "max_tokens": 2}
    async with c.stream(method, path, **kw) as r:  # /admin/events never ends: headers suffice
        return r.status_code


async def test_every_route_by_every_caller_gives_the_documented_status(tmp_path: Path) -> None:
    """No key or an unknown key: 401 where a scope is needed; a key without it: 403; with it: the route answers."""
    cfg_path = _config(tmp_path)
    keys = [ResolvedKey(name, secret, scopes) for name, (secret, scopes) in KEYS.items()]
    seen: list[tuple[str, str, str | None, int]] = []
    async with serving(load_config(cfg_path), tmp_path, config_path=cfg_path, keys=keys) as s:
        assert s.daemon.state is not None
        table = routes(s.daemon.state)
        assert ("POST", "/admin/reload") in table and ("GET", "/v1/models") in table
        async with s.client() as c:
            for method, path in table:
                for caller in CALLERS:
                    headers = {}
                    if caller == "unknown":
                        headers["Authorization"] = "Bearer not-a-key"
                    elif caller is not None:
                        headers["Authorization"] = f"Bearer {KEYS[caller][0]}"
                    with trio.fail_after(30):
                        status = await _status(c, method, path, headers)
                    seen.append((method, path, caller, status))
    wrong = []
    for method, path, caller, status in seen:
        want = expected(method, path, caller)
        got = str(status) if status in (401, 403) else "pass"
        if got != want:
            wrong.append(f"{method} {path} as {caller}: {status}, documented {want}")
    assert wrong == []
    assert len(seen) == len(table) * len(CALLERS) and len(table) >= 12


async def test_403_names_the_missing_scope_and_x_api_key_works(tmp_path: Path) -> None:
    """A 403 is insufficient_scope in the envelope; Anthropic's x-api-key header is a key too."""
    cfg_path = _config(tmp_path)
    keys = [ResolvedKey(name, secret, scopes) for name, (secret, scopes) in KEYS.items()]
    served = serving(load_config(cfg_path), tmp_path, config_path=cfg_path, keys=keys)
    async with served as s, s.client() as c:
            r = await c.post("/admin/models/a/load", headers={"Authorization": "Bearer k-watch"})
            assert r.status_code == 403
            err = r.json()["error"]
            assert (err["type"], err["code"]) == ("permission_error", "insufficient_scope")
            assert "'watch'" in err["message"] and "'admin'" in err["message"]
            assert (await c.get("/admin/status", headers={"x-api-key": "k-watch"})).status_code == 200
            who = (await c.get("/admin/whoami", headers={"x-api-key": "k-laptop"})).json()
            assert who == {"client": "laptop", "scopes": ["inference"], "auth_required": True}


def _serve(cfg: Path, tmp: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mlxd", "serve", "--config", str(cfg), "--port", "0"],
        capture_output=True, text=True, timeout=60,
        env={"PATH": "/usr/bin:/bin", "MLXD_STATE_DIR": str(tmp), **env},
    )  # fmt: skip


@pytest.mark.parametrize("mode", [0o644, 0o660])
def test_a_key_file_others_can_read_refuses_to_start(tmp_path: Path, mode: int) -> None:
    """A key file its group or others may read or write: `mlxd serve` exits 2 with one line."""
    key = tmp_path / "ops.key"
    key.write_text("k-ops\n")
    key.chmod(mode)
    cfg = tmp_path / "models.yaml"
    cfg.write_text(yaml.safe_dump({
        "server": {"keys": [{"name": "ops", "file": str(key), "scopes": ["admin"]}]},
        "manager": {"memory_budget_gb": 1}, "models": [fake("a", 0.5)],
    }))  # fmt: skip
    r = _serve(cfg, tmp_path)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and "server.keys[0].file" in r.stderr
    assert "chmod 600" in r.stderr and "k-ops" not in r.stderr


def test_an_unset_key_variable_refuses_to_start(tmp_path: Path) -> None:
    """A key whose variable is unset: exit 2, one line naming the variable (never a key)."""
    cfg = _config(tmp_path)
    r = _serve(cfg, tmp_path, MLXD_TEST_KEY_LAPTOP="k-laptop")
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert "server.keys[1].env" in r.stderr and "MLXD_TEST_KEY_WATCH" in r.stderr


async def test_every_route_the_app_serves_is_in_the_openapi_document(tmp_path: Path) -> None:
    """The URL map and /openapi.json agree: a route added without its documentation fails here."""
    cfg_path = _config(tmp_path)
    async with serving(load_config(cfg_path), tmp_path, config_path=cfg_path) as s:
        assert s.daemon.state is not None
        app = create_app(s.daemon.state)
        async with s.client() as c:
            paths = (await c.get("/openapi.json")).json()["paths"]
    missing = []
    for rule in app.url_map.iter_rules():
        if rule.endpoint == "static":
            continue
        path = re.sub(r"<(?:\w+:)?(\w+)>", r"{\1}", rule.rule)
        for method in sorted((rule.methods or set()) - {"HEAD", "OPTIONS"}):
            if method.lower() not in paths.get(path, {}):
                missing.append(f"{method} {path}")
    assert missing == []
