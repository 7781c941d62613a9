"""Engines: one residency of one model behind the :class:`~mlxd.engines.base.Engine` protocol.

``engine: fake`` selects :class:`~mlxd.engines.fake.FakeEngine`; ``engine: mlx``
(the default) selects the mlx-lm text engine, or the mlx-vlm vision engine for
``mllm: true`` models. The real engines are imported lazily so that the fake
path never imports MLX. With ``isolation: process`` (or ``distributed:``) the
daemon gets a :class:`~mlxd.engines.process.ProcessEngine`, which runs that same
engine class in a worker process (:mod:`.worker`).

Also owns what only engines need: model sources and downloads (:mod:`.sources`),
images (:mod:`.images`), memory measurement and release (:mod:`.memory`), the
random-weight demo models (:mod:`.demo_model`) and the MLX thread (:mod:`.mlx_thread`).
May import: :mod:`mlxd.config` (a model's settings), :mod:`mlxd.errors`,
:mod:`mlxd.faults`; never the residency manager, the journal or HTTP.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import trio

from mlxd.config import weights_fingerprint
from mlxd.engines.base import Engine
from mlxd.engines.fake import FakeFleet
from mlxd.engines.faults import Faults

if TYPE_CHECKING:
    from mlxd.config import ModelConfig
    from mlxd.engines.worker_process import Workers

EngineFactory = Callable[["ModelConfig"], Engine]


def in_process_engine(
    model: ModelConfig, fleet: FakeFleet | None = None, faults: Faults | None = None
) -> Engine:
    """The engine class of ``model``, to run in this process (on its own MLX thread).

    ``faults``: the model's injected faults (made from its ``faults:`` key if not given).
    """
    if model.engine == "fake":
        return (fleet or FakeFleet())(model)
    if faults is None and model.faults is not None:
        faults = Faults(model.name, model.faults)
    if model.embedding:
        from mlxd.engines.mlx_embed import MlxEmbeddingEngine

        return MlxEmbeddingEngine(model)
    if model.mllm:
        from mlxd.engines.mlx_vision import MlxVisionEngine

        return MlxVisionEngine(model, faults=faults)
    from mlxd.engines.mlx_text import MlxTextEngine

    return MlxTextEngine(model, faults=faults)


async def loaded_weights(model: ModelConfig) -> str:
    """What a load of ``model`` has just measured (:func:`mlxd.config.weights_fingerprint`; its
    measurement applies while that is unchanged): a stat walk of the model's files, on a thread;
    a fake's is its settings (no thread: fakes run in virtual-time tests)."""
    if model.engine == "fake":
        return weights_fingerprint(model)
    return await trio.to_thread.run_sync(weights_fingerprint, model, abandon_on_cancel=True)


class DefaultEngines:
    """The daemon's engine factory: fakes for ``engine: fake``, MLX engines otherwise,
    in a worker process for ``isolation: process`` and ``distributed:`` models.

    It owns those worker processes: :meth:`run`, started in the daemon's nursery
    before the manager, hosts them, and they end when it does.
    """

    def __init__(self, fleet: FakeFleet | None = None) -> None:
        from mlxd.engines.worker_process import Workers  # (it imports the worker: a circle)

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
        it transformers; see :mod:`mlxd.engines.imports_ahead`)."""
        if any(m.engine == "mlx" and m.isolation == "thread" and m.distributed is None for m in models):
            from mlxd.engines import imports_ahead

            imports_ahead.start()

    def __call__(self, model: ModelConfig) -> Engine:
        if model.isolation == "process" or model.distributed is not None:
            from mlxd.engines.process import ProcessEngine

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
    "in_process_engine",
    "loaded_weights",
]
