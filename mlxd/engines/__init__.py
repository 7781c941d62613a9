"""Engines: one residency of one model behind the :class:`~mlxd.engines.base.Engine` protocol.

``engine: fake`` selects :class:`~mlxd.engines.fake.FakeEngine`; ``engine: mlx``
(the default) selects the mlx-lm text engine, or the mlx-vlm vision engine for
``mllm: true`` models. The real engines are imported lazily so that the fake
path never imports MLX. With ``isolation: process`` (or ``distributed:``) the
daemon gets a :class:`~mlxd.engines.workers.process.ProcessEngine`, which runs that same
engine class in a worker process (:mod:`.workers.worker`).

This package holds the protocol (:mod:`.base`), the engines (:mod:`.fake`,
:mod:`.mlx_text` with its requests in :mod:`.mlx_generation`,
:mod:`.mlx_vision`, :mod:`.mlx_embed`), a model's injected
faults (:mod:`.injected_faults`), the engine class of a model (:mod:`.in_process`,
which worker processes host too) and the factory (here); its subpackages hold what the
MLX engines are made of, each saying what it may import: the MLX thread and
memory (:mod:`.runtime`), prompts and streamed output (:mod:`.text`),
constrained decoding (:mod:`.grammar`), the prompt cache (:mod:`.cache`), a
model's files (:mod:`.model_files`), the queues in front of the MLX thread
(:mod:`.scheduling`) and worker processes (:mod:`.workers`).
May import: :mod:`mlxd.config` (a model's settings), :mod:`mlxd.errors`,
:mod:`mlxd.crash_points`; never the residency manager, the journal or HTTP.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import trio

from mlxd.engines.base import Engine
from mlxd.engines.fake import FakeFleet
from mlxd.engines.in_process import in_process_engine
from mlxd.engines.injected_faults import Faults

if TYPE_CHECKING:
    from mlxd.config import ModelConfig
    from mlxd.engines.workers.worker_process import Workers

EngineFactory = Callable[["ModelConfig"], Engine]


class DefaultEngines:
    """The daemon's engine factory: fakes for ``engine: fake``, MLX engines otherwise,
    in a worker process for ``isolation: process`` and ``distributed:`` models.

    It owns those worker processes: :meth:`run`, started in the daemon's nursery
    before the manager, hosts them, and they end when it does.
    """

    def __init__(self, fleet: FakeFleet | None = None) -> None:
        from mlxd.engines.workers.worker_process import Workers

        self.fleet = fleet or FakeFleet()
        #: the ``faults:`` scripts of MLX models, kept across their residencies
        self.faults: dict[str, Faults] = {}
        #: the owner of the worker processes (and of the spare)
        self.workers: Workers = Workers()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Host the engines' worker processes until cancelled; then every one is killed."""
        await self.workers.run(task_status=task_status)

    async def warm(self, models: Iterable[ModelConfig]) -> None:
        """Start the spare worker now if an MLX model of ``models`` runs in worker processes,
        so that even its first load finds Python started and mlx-lm imported."""
        if any(m.engine == "mlx" and m.isolation == "process" and m.distributed is None for m in models):
            await self.workers.refill()

    def import_soon(self, models: Iterable[ModelConfig]) -> None:
        """Import mlx-lm on a background thread now if an MLX model of ``models`` runs in this
        process, so that its first load does not start with it (about 1.5 s on 2 cores, most of
        it transformers; see :mod:`mlxd.engines.runtime.imports_ahead`)."""
        if any(m.engine == "mlx" and m.isolation == "thread" and m.distributed is None for m in models):
            from mlxd.engines.runtime import imports_ahead

            imports_ahead.start()

    def __call__(self, model: ModelConfig) -> Engine:
        if model.isolation == "process" or model.distributed is not None:
            from mlxd.engines.workers.process import ProcessEngine

            return ProcessEngine(model, self.workers)
        faults = None
        if model.faults is not None:  # kept across residencies (raise_once: once per model)
            faults = self.faults.setdefault(model.name, Faults(model.name, model.faults))
        return in_process_engine(model, self.fleet, faults)


__all__ = [
    "DefaultEngines",
    "Engine",
    "EngineFactory",
    "FakeFleet",
]
