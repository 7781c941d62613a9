"""Run N load -> generate -> unload cycles of one model in this process; print RSS and thread figures as JSON.

Used by ``test_load_unload_cycles.py`` in a subprocess, so that the exit code
(no abort at exit from a finished MLX thread) and the RSS are this process's own.
Usage: ``python -m tests.engines.cycles_main MODEL_DIR CYCLES``.
"""

from __future__ import annotations

import json
import sys

import psutil
import trio

from mlxd.config import ModelConfig
from mlxd.engines.base import GenerationRequest
from mlxd.engines.mlx_text import MlxTextEngine
from mlxd.engines.runtime.memory import active_bytes, rss_bytes


async def main(model_dir: str, cycles: int) -> dict[str, object]:
    rss_after_unload: list[int] = []
    rss_after_load: list[int] = []
    active_after_unload: list[int] = []
    measured: list[int | None] = []
    threads_after_unload: list[int] = []
    for i in range(cycles):
        eng = MlxTextEngine(ModelConfig(name="cycle", source=model_dir))
        await eng.load(lambda _p: None)
        rss_after_load.append(rss_bytes())
        measured.append(eng.measured_bytes())
        req = GenerationRequest(
            kind="completion", prompt=f"cycle {i}", max_tokens=8, temperature=0.0
        )
        async for _ev in eng.generate(req):
            pass
        await eng.stop()
        rss_after_unload.append(rss_bytes())
        active_after_unload.append(active_bytes())
        threads_after_unload.append(psutil.Process().num_threads())
    return {
        "rss_after_unload": rss_after_unload,
        "rss_after_load": rss_after_load,
        "active_after_unload": active_after_unload,
        "measured": measured,
        "threads_after_unload": threads_after_unload,
    }


if __name__ == "__main__":
    result = trio.run(main, sys.argv[1], int(sys.argv[2]))
    print(json.dumps(result))
