"""Operations on a served daemon: access log lines, the client on leases and in metrics, reloads in metrics."""

from __future__ import annotations

import json
import logging
import re
import sqlite3
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import yaml

from mlxd.config import load_config
from mlxd.config.keys import ResolvedKey
from mlxd.http.access_log import logfmt
from tests.integration.conftest import fake
from tests.support.daemon import DaemonProcess, serving, write_config
from tests.support.logs import logged

CHAT = "/v1/chat/completions"
LAPTOP = {"Authorization": "Bearer k-laptop"}
KEYS = [
    ResolvedKey("laptop", "k-laptop", frozenset({"inference"})),
    ResolvedKey("ops", "k-ops", frozenset({"read", "admin"})),
]
_PAIR = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|\S+)')


def parse_logfmt(line: str) -> dict[str, Any]:
    return {k: json.loads(v) if v.startswith('"') else v for k, v in _PAIR.findall(line)}


def _config(tmp_path: Path, models: list[dict[str, Any]]) -> Path:
    raw = {
        "server": {"keys": [
            {"name": "laptop", "env": "MLXD_TEST_LAPTOP", "scopes": ["inference"]},
            {"name": "ops", "env": "MLXD_TEST_OPS", "scopes": ["read", "admin"]},
        ]},
        "manager": {"memory_budget_gb": 2},
        "models": models,
    }  # fmt: skip
    return write_config(tmp_path / "models.yaml", raw)


def body(model: str, *, stream: bool = False) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "stream": stream}  # fmt: skip


def access_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "mlxd.access"]


async def test_one_access_line_per_request_with_its_lease_client_and_tokens(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Each request ends in one logfmt line: time, method, route, model, status, duration, TTFT,
    queue time, lease, request id, client, tokens."""
    caplog.set_level(logging.INFO, logger="mlxd.access")
    cfg = _config(tmp_path, [fake("a", 0.5, load_seconds=0.0)])
    with logged("mlxd.access", count=4) as four_lines:
        async with serving(load_config(cfg), tmp_path, config_path=cfg, keys=KEYS) as s, s.client() as c:
            assert (await c.post(CHAT, json=body("a"), headers=LAPTOP)).status_code == 200
            traced = {**LAPTOP, "X-Request-Id": "trace-7"}
            async with c.stream("POST", CHAT, json=body("a", stream=True), headers=traced) as r:
                assert r.status_code == 200
                async for _ in r.aiter_bytes():
                    pass
            assert (await c.get("/admin/status")).status_code == 401
            assert (await c.get("/admin/status", headers=LAPTOP)).status_code == 403
            with trio.fail_after(10):
                await four_lines.wait()  # the last line follows the reply
    whole, streamed, no_key, no_scope = (parse_logfmt(line) for line in access_lines(caplog)[:4])
    for line in (whole, streamed):
        assert line["method"] == "POST" and line["route"] == CHAT and line["status"] == "200"
        assert line["model"] == "a" and line["client"] == "laptop"
        assert line["outcome"] == "completed" and line["completion_tokens"] == "4"
        assert int(line["prompt_tokens"]) > 0 and float(line["duration_ms"]) > 0
        # arrival -> engine start -> first token -> end, in that order
        queue, ttft = float(line["queue_ms"]), float(line["ttft_ms"])
        assert 0 <= queue <= ttft <= float(line["duration_ms"])
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", line["time"])
    assert whole["lease"] != streamed["lease"]
    assert whole["request_id"].startswith("req-") and streamed["request_id"] == "trace-7"
    assert (no_key["status"], no_key["route"]) == ("401", "/admin/status") and "client" not in no_key
    assert (no_scope["status"], no_scope["client"]) == ("403", "laptop")
    conn = sqlite3.connect(tmp_path / "journal.db")
    try:  # the lease rows carry the key's name, never the key
        rows = conn.execute("SELECT id, client FROM leases ORDER BY acquired_at").fetchall()
    finally:
        conn.close()
    assert rows == [(whole["lease"], "laptop"), (streamed["lease"], "laptop")]


def test_logfmt_quotes_what_needs_it() -> None:
    """Values with spaces, quotes, '=' or control characters are quoted; plain ones are not."""
    line = logfmt({"a": "x", "b": "two words", "c": 'q"uote', "d": "k=v", "e": "new\nline", "f": 3})
    assert line == 'a=x b="two words" c="q\\"uote" d="k=v" e="new\\nline" f=3'
    assert parse_logfmt(line)["e"] == "new\nline"


async def test_per_client_metrics_and_a_reload_that_removes_a_model(tmp_path: Path) -> None:
    """/metrics counts requests and tokens per client; after /admin/reload removes a model, no series names it."""
    cfg = _config(tmp_path, [fake("a", 0.5, load_seconds=0.0), fake("b", 0.5, load_seconds=0.0)])
    ops = {"Authorization": "Bearer k-ops"}
    async with serving(load_config(cfg), tmp_path, config_path=cfg, keys=KEYS) as s, s.client() as c:
        for model in ("a", "b", "b"):
            assert (await c.post(CHAT, json=body(model), headers=LAPTOP)).status_code == 200
        assert (await c.get("/metrics")).status_code == 401  # server.keys: /metrics needs read
        text = (await c.get("/metrics", headers=ops)).text
        assert 'mlxd_client_requests_total{client="laptop",status="200"} 3.0' in text
        assert 'mlxd_client_tokens_total{client="laptop",kind="completion"} 12.0' in text
        assert 'model="b"' in text
        raw = yaml.safe_load(cfg.read_text())
        raw["models"] = [m for m in raw["models"] if m["name"] != "b"]
        cfg.write_text(yaml.safe_dump(raw))
        assert (await c.post("/admin/models/b/unload", headers=ops)).status_code == 200
        r = await c.post("/admin/reload", headers=ops)
        assert r.status_code == 200 and r.json()["removed"] == ["b"]
        text = (await c.get("/metrics", headers=ops)).text
        assert 'model="b"' not in text and 'model="a"' in text
        assert 'mlxd_client_requests_total{client="laptop",status="200"} 3.0' in text


def test_serve_writes_json_access_lines_to_stdout(tmp_path: Path) -> None:
    """`mlxd serve --log-format json` writes one JSON object per request on stdout."""
    raw = {"manager": {"memory_budget_gb": 1}, "models": [fake("a", 0.2)]}
    cfg = write_config(tmp_path / "models.yaml", raw)
    with DaemonProcess(cfg, tmp_path, env={"MLXD_API_KEY": ""}, args=("--log-format", "json")) as d:
        assert httpx.get(d.url + "/v1/models", timeout=10).status_code == 200
        assert httpx.get(d.url + "/v1/models/nope", timeout=10).status_code == 404
    lines = [json.loads(line) for line in d.log().splitlines() if line.startswith("{")]
    routes = [(x["method"], x["route"], x["status"]) for x in lines]
    assert ("GET", "/v1/models", 200) in routes
    assert ("GET", "/v1/models/<path:model_id>", 404) in routes
    assert all(isinstance(x["duration_ms"], float) for x in lines)


def _wait_for_lines(path: Path, n: int, timeout: float = 10.0) -> None:
    """Until ``path`` holds ``n`` whole lines (the daemon writes them on its own schedule)."""
    deadline = time.monotonic() + timeout
    while path.read_text().count("\n") < n:
        assert time.monotonic() < deadline, f"{path} has not got {n} lines in {timeout} s"
        time.sleep(0.01)


def test_access_log_file_is_reopened_after_a_rotation(tmp_path: Path) -> None:
    """`--access-log FILE`: lines go to FILE; once a rotator moves it, the next line starts a new FILE."""
    raw = {"manager": {"memory_budget_gb": 1}, "models": [fake("a", 0.2)]}
    cfg = write_config(tmp_path / "models.yaml", raw)
    log = tmp_path / "logs" / "access.log"
    with DaemonProcess(cfg, tmp_path, env={"MLXD_API_KEY": ""}, args=("--access-log", str(log))) as d:
        assert httpx.get(d.url + "/v1/models", timeout=10).status_code == 200
        # The line is written once the response has ended, which may be just after the client
        # read it: rotate only once it is in the file (a line written later goes to the new one).
        _wait_for_lines(log, 1)
        log.rename(log.with_name("access.log.0"))  # what newsyslog and logrotate do
        assert httpx.get(d.url + "/health", timeout=10).status_code == 200
    rotated = log.with_name("access.log.0").read_text().splitlines()
    assert len(rotated) == 1 and parse_logfmt(rotated[0])["route"] == "/v1/models"
    (line,) = log.read_text().splitlines()
    assert parse_logfmt(line)["route"] == "/health"
    assert "route=" not in d.log()  # not on stdout as well
