"""A huge prompt against the real `mlxd serve` process: refused fast, and harmless to others."""

from __future__ import annotations

import json
import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.daemon import DaemonProcess, write_config

SMALL = {"model": "tiny", "prompt": "hello world", "max_tokens": 4, "temperature": 0}


def huge_body() -> bytes:
    body = json.dumps({"model": "tiny", "prompt": "hello world this is a tiny model, " * 900_000,
                       "max_tokens": 4}).encode()
    assert 30_000_000 < len(body) < 64 * 1024 * 1024
    return body


def small_latency(c: httpx.Client) -> float:
    t0 = time.perf_counter()
    r = c.post("/v1/completions", json=SMALL)
    assert r.status_code == 200, r.text
    return time.perf_counter() - t0


@pytest.fixture(scope="module")
def daemon(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    tmp = tmp_path_factory.mktemp("large")
    cfg = write_config(tmp / "models.yaml", {
        "server": {"max_body_mb": 64},
        "manager": {"memory_budget_gb": 1},
        "models": [{"name": "tiny", "path": str(tiny_model), "estimated_memory_gb": 0.01}],
    })
    with DaemonProcess(cfg, tmp) as d:
        yield d


def test_a_30mb_prompt_is_refused_unparsed_and_untokenized(daemon: DaemonProcess) -> None:
    """A 30 MB prompt (under max_body_mb) is a 400 context_length_exceeded; the model is not even loaded for it."""
    with httpx.Client(base_url=daemon.url, timeout=60) as c:
        r = c.post("/v1/completions", content=huge_body(),
                   headers={"Content-Type": "application/json"})
        assert r.status_code == 400, r.text[:300]
        assert r.json()["error"]["code"] == "context_length_exceeded"
        assert r.json()["error"]["param"] == "prompt"
        status = c.get("/admin/status").json()
        assert status["models"]["tiny"]["state"] == "unloaded", status["models"]["tiny"]


@pytest.mark.stress  # timing figures: run alone on a quiet machine
def test_a_30mb_prompt_is_refused_in_under_a_second_without_delaying_others(
    daemon: DaemonProcess,
) -> None:
    """A 30 MB prompt (under max_body_mb) is a 400 context_length_exceeded in under 1 s, and a small request to the same model meanwhile is not delayed by more than 100 ms."""
    d = daemon
    body = huge_body()
    with httpx.Client(base_url=d.url, timeout=60) as c:
        small_latency(c)  # loads the model
        baseline = sorted(small_latency(c) for _ in range(15))
        typical = statistics.median(baseline)
        big: dict[str, object] = {}

        def send_big() -> None:
            with httpx.Client(base_url=d.url, timeout=60) as bc:
                t0 = time.perf_counter()
                r = bc.post("/v1/completions", content=body,
                            headers={"Content-Type": "application/json"})
                big["seconds"] = time.perf_counter() - t0
                big["response"] = r

        sender = threading.Thread(target=send_big)
        sender.start()
        during = []
        while sender.is_alive() or not during:
            during.append(small_latency(c))
        sender.join()
        r = big["response"]
        assert isinstance(r, httpx.Response)
        assert r.status_code == 400, r.text[:300]
        assert r.json()["error"]["code"] == "context_length_exceeded"
        print(f"refused in {big['seconds']:.3f} s; small requests {typical * 1000:.0f} ms typical, "
              f"{max(during) * 1000:.0f} ms at most meanwhile ({len(during)} sent)")
        assert big["seconds"] < 1.0, big
        assert max(during) - typical <= 0.1, (during, baseline)
