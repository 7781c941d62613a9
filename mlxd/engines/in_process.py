"""The engine class of a model, run in this process: what the factory and a worker both host.

The daemon's factory (:class:`mlxd.engines.DefaultEngines`) uses it for ``isolation:
thread`` models, and an engine worker process (:mod:`mlxd.engines.workers.worker`)
for the model it hosts, so both run the very same class. It lives apart from the
factory so that dependencies point one way: the factory imports the workers
(:class:`~mlxd.engines.workers.process.ProcessEngine`), the workers import this
module, and this module imports neither. The MLX engines are imported lazily so
that the fake path never imports MLX.

May import: the engine modules of :mod:`mlxd.engines` (:mod:`.fake`, :mod:`.mlx_text`,
:mod:`.mlx_vision`, :mod:`.mlx_embed`), :mod:`.base`, :mod:`.injected_faults`,
:mod:`mlxd.config`; never the factory or the workers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mlxd.engines.base import Engine
from mlxd.engines.fake import FakeFleet
from mlxd.engines.injected_faults import Faults

if TYPE_CHECKING:
    from mlxd.config import ModelConfig


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
