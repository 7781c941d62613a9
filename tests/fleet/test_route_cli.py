"""``mlxd route`` (LiteLLM's real proxy with mlxd's strategy), ``route --check`` and ``status --fleet``."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("litellm", reason="the fleet extra (litellm) is not installed")

import openai

from tests.support.daemon import REPO
from tests.support.fleet import Rig, routing_proxy, running_fleet

SIZES, BUDGET = {"a": 0.6, "b": 0.6}, 1.0


def _mlxd(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, "-m", "mlxd", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env=env)


def _transitions(rig: Rig) -> int:
    return len(rig.loads())


def test_route_streams_through_litellms_proxy_and_never_loads_for_health(tmp_path: Path) -> None:
    """Through `mlxd route`, streamed chats for two models go to two daemons (each fits one); the proxy's /health, route --check and status --fleet load nothing."""
    with running_fleet(tmp_path, 2, SIZES, BUDGET) as rig, routing_proxy(rig, tmp_path) as (url, fleet):
        for _ in range(100):  # the router's first status poll
            if httpx.get(f"{url}/health", timeout=5).json()["healthy_count"] == 2:
                break
            time.sleep(0.1)
        for _ in range(20):
            assert httpx.get(f"{url}/health", timeout=5).json()["healthy_count"] == 2
        check = _mlxd("route", "--config", str(fleet), "--check")
        assert check.returncode == 0, check.stderr
        assert "a: next request goes to d0" in check.stdout, check.stdout
        assert _transitions(rig) == 0  # health, check: nothing loaded

        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        for model in ("a", "b", "a"):
            stream = client.chat.completions.create(
                model=model, stream=True, max_tokens=8,
                messages=[{"role": "user", "content": "hello"}])
            text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
            assert text.strip(), model
        assert sorted(rig.loads()) == [("d0", "a"), ("d1", "b")]

        status = _mlxd("status", "--fleet", str(fleet))
        assert status.returncode == 0, status.stderr
        rows = {line.split()[0]: line.split()[1:] for line in status.stdout.splitlines() if line}
        assert rows["a"] == ["loaded", "unloaded"] and rows["b"] == ["unloaded", "loaded"], status.stdout
        rig.processes[1].kill()
        down = _mlxd("status", "--fleet", str(fleet))
        assert down.returncode == 3 and "d1" in down.stderr, (down.stdout, down.stderr)


def test_route_refuses_bad_fleet_files_and_an_open_proxy_off_loopback(tmp_path: Path) -> None:
    """A bad fleet file, or a non-loopback address without a master key, exits 2 with one line naming the key."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("daemons:\n  - {url: 'mac-a:8080', models: [a]}\n")
    r = _mlxd("route", "--config", str(bad), "--check")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "daemons[0].url" in r.stderr, r.stderr
    ok = tmp_path / "fleet.yaml"
    ok.write_text("daemons:\n  - {url: 'http://127.0.0.1:9', models: [a]}\n")
    r = _mlxd("route", "--config", str(ok), "--host", "0.0.0.0")
    assert r.returncode == 2 and "proxy.master_key_env" in r.stderr, r.stderr
    r = _mlxd("route", "--config", str(ok), "--check")
    assert r.returncode == 3 and "unreachable" in r.stderr, r.stderr
