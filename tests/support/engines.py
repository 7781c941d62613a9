"""What the engine tests observe of an MLX engine beyond its protocol, kept in the tests.

:class:`Recorded` keeps the stats of every generation an engine starts (the
package keeps none); :func:`mlx_thread_drained` waits until the jobs already on
an engine's MLX thread have left it.
"""

from __future__ import annotations

import collections
from typing import Any

from mlxd.engines.base import GenerationRequest
from mlxd.engines.mlx_text import MlxTextEngine
from mlxd.engines.runtime.jobs import GenerationStats
from mlxd.engines.text.streaming import JobEvents


class Recorded:
    """Mixin for an MLX engine class: ``history``, the stats of every generation it started,
    newest last (each is its job's own, updated until the job ends: withdrawn ones too)."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.history: collections.deque[GenerationStats] = collections.deque(maxlen=64)

    async def start_generation(self, request: GenerationRequest) -> JobEvents:
        events: JobEvents = await super().start_generation(request)  # type: ignore[misc]
        self.history.append(events._job.stats)
        return events


class RecordedTextEngine(Recorded, MlxTextEngine):
    """The mlx-lm text engine, with its generations' stats in ``history``."""


async def mlx_thread_drained(engine: MlxTextEngine) -> None:
    """Return once every job already on ``engine``'s MLX thread has left it and its end has
    reached the Trio side: a no-op queued behind them (the thread runs its jobs in order,
    and their ends reach Trio in that order)."""
    assert engine._thread is not None
    await engine._thread.run(lambda: None)
