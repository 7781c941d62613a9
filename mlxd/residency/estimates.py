"""What each model is expected to cost: its memory estimate and its measured load time.

An :class:`Estimates` belongs to one :class:`~mlxd.residency.manager.Manager`
(``manager.estimates``). It keeps, per configured model, the memory estimate the
core's :class:`~mlxd.residency.messages.ModelSpec` carries (from the config, a
measurement or the weights on disk, with its parts: weights, kv_cache,
prompt_cache), where that estimate came from, and the latest measured size and
load seconds (journaled, so they survive restarts). The manager reads it to
build specs and records what a load measured; HTTP and the status views read it.
"""

from __future__ import annotations

from collections.abc import Mapping

from mlxd.config import Config, Measurement, MemoryEstimate, ModelConfig
from mlxd.residency.messages import ModelSpec


class Estimates:
    """Each model's memory estimate and measured load time; see the module docstring."""

    def __init__(
        self,
        measured: Mapping[str, Measurement] | None = None,
        load_times: Mapping[str, float] | None = None,
    ) -> None:
        self._measured: dict[str, Measurement] = dict(measured or {})
        self._load_seconds: dict[str, float] = dict(load_times or {})
        #: where each model's memory estimate comes from (config, measured, weights, fake)
        self._source: dict[str, str | None] = {}
        #: each model's estimate with its parts (weights, kv_cache, prompt_cache)
        self._estimates: dict[str, MemoryEstimate] = {}

    def spec(self, model: ModelConfig, config: Config) -> ModelSpec:
        """The core's view of a model: the config's own estimate and idle rule, nothing re-derived."""
        est = self._estimate(model.name, config)  # may walk a model dir: not per request
        return ModelSpec(
            name=model.name,
            size_bytes=est.bytes,
            pinned=model.pin,
            idle_unload_s=config.idle_unload_for(model.name),
            priority=model.priority,
            load_s=self._load_seconds.get(model.name),
        )

    def _estimate(self, name: str, config: Config) -> MemoryEstimate:
        est = config.estimate(name, self._measured)
        self._source[name] = est.source
        self._estimates[name] = est
        return est

    def loaded(self, model: str, seconds: float, measurement: Measurement | None,
               config: Config) -> int | None:
        """``model`` loaded in ``seconds``, measuring ``measurement`` (None: its engine does not
        measure). Returns its new size in bytes when the estimate came from that measurement
        (the weights measured plus the caches, known now that the files exist), else None."""
        self._load_seconds[model] = seconds
        if measurement is None:
            return None
        self._measured[model] = measurement
        mc = config.model(model)
        if mc is None or mc.estimated_memory_bytes is not None:
            return None
        return self._estimate(model, config).bytes

    def get(self, name: str) -> MemoryEstimate | None:
        """``name``'s estimate, once its spec was built."""
        return self._estimates.get(name)

    def memory_parts(self, name: str) -> dict[str, int]:
        """``{weights, kv_cache, prompt_cache}`` of the model's estimate (what a load commits)."""
        est = self._estimates.get(name)
        return est.parts() if est is not None else {"weights": 0, "kv_cache": 0, "prompt_cache": 0}

    def source(self, name: str) -> str | None:
        """Where ``name``'s memory estimate comes from (config, measured, weights, fake)."""
        return self._source.get(name)

    def measured(self) -> dict[str, Measurement]:
        """Each model's latest measurement (bytes and weights), as known to this run."""
        return dict(self._measured)

    def load_seconds(self, model: str) -> float | None:
        """How long the last successful load of ``model`` took, if it was ever measured."""
        return self._load_seconds.get(model)
