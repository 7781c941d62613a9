"""/metrics at scale, against the real daemon."""

from __future__ import annotations

import time
from pathlib import Path

from tests.integration.conftest import config_of, fake
from tests.support.daemon import serving


async def test_metrics_of_10000_models_render_in_under_200_ms(tmp_path: Path) -> None:
    """With 10,000 configured models (some of them used), GET /metrics answers in under 200 ms."""
    models = [fake(f"m{i}", 0.001, load_seconds=0.0) for i in range(10_000)]
    config = config_of({"manager": {"memory_budget_gb": 64}, "models": models}, tmp_path)
    async with serving(config, tmp_path) as s, s.client() as c:
        for i in range(20):  # some history: loads, leases, generations
            r = await c.post("/v1/completions", json={"model": f"m{i}", "prompt": "x", "max_tokens": 2})
            assert r.status_code == 200
        timings = []
        for _ in range(5):
            t0 = time.perf_counter()
            r = await c.get("/metrics")
            timings.append(time.perf_counter() - t0)
            assert r.status_code == 200
        assert 'model="m9999"' in r.text
        print(f"/metrics with 10,000 models: {min(timings) * 1000:.0f} ms best, "
              f"{sorted(timings)[2] * 1000:.0f} ms median, {len(r.content) / 1e6:.1f} MB")
        assert sorted(timings)[2] < 0.2, timings
