"""One text model tensor-sharded over the ranks of an ``mlx.distributed`` group.

Theory of operation
-------------------
Every rank runs in a worker process (:mod:`mlxd.engines.workers.worker`) and holds a
:class:`DistributedTextEngine`: the ordinary mlx-lm text engine, whose weights
come from mlx-lm's ``sharded_load`` (tensor parallel where the model has
``shard()``, as llama, qwen2 and qwen3 do; pipeline otherwise). In a sharded
forward pass every rank must run the same computation at the same time: the
ranks meet in the ``all_sum`` of each layer. So the ranks must agree on every
decision that changes what runs next. There are two kinds, and rank 0 makes
both:

* which generation runs next: rank 0's engine takes requests from the daemon
  as usual; when its scheduler starts one on the MLX thread, it first shares
  the request with the others (:meth:`Lockstep.share`), who run the same
  generation (with the same seed: a request without one gets one here, before
  it is shared), and discard its output;
* when a generation stops early: at each point where the engine asks whether
  to stop (:meth:`MlxTextEngine._stop_now`: a generation's start, each prefill
  chunk, each token), the ranks take rank 0's answer (:meth:`Lockstep.agree`).

Everything else (tokenizing, sampling, stop strings, ``max_tokens``, the
grammar of a constrained request, which each rank builds from the shared
request's constraint) is deterministic given the same request and the same
logits, so the ranks stay in step. Rank 0's unload tells the others to stop following (``("stop",)``).
Anything unexpected on a follower ends its process: the daemon then fails the
model cleanly (a rank out of step would wait forever in an ``all_sum``).

Generations run one at a time on a distributed model (the serial scheduler).
"""

from __future__ import annotations

import os
import pickle
from dataclasses import replace
from pathlib import Path
from typing import Any

from mlxd.config import ModelConfig
from mlxd.engines.grammar.constrained import logits_processors
from mlxd.engines.mlx_text import MlxTextEngine
from mlxd.engines.runtime.jobs import Job
from mlxd.engines.workers.wire import Rank
from mlxd.errors import LoadFailed, MlxdError


class Lockstep:
    """Collectives over the group, on the MLX thread: rank 0 decides, everyone learns."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.rank = int(group.rank())

    def share(self, obj: object) -> Any:
        """Rank 0's ``obj`` on every rank (the others pass anything)."""
        import mlx.core as mx

        g, cpu = self.group, mx.cpu
        if self.rank == 0:
            data = mx.array(pickle.dumps(obj))  # type: ignore[arg-type]  # a buffer: uint8
            mx.eval(mx.distributed.all_sum(mx.array(data.size), group=g, stream=cpu))
            mx.eval(mx.distributed.all_sum(data, group=g, stream=cpu))
            return obj
        size: Any = mx.distributed.all_sum(mx.array(0), group=g, stream=cpu).item()
        data = mx.distributed.all_sum(mx.zeros(size, dtype=mx.uint8), group=g, stream=cpu)
        return pickle.loads(bytes(data))

    def agree(self, flag: bool) -> bool:
        """Rank 0's ``flag`` on every rank."""
        import mlx.core as mx

        mine = 1 if (self.rank == 0 and flag) else 0
        total = mx.distributed.all_sum(mx.array(mine), group=self.group, stream=mx.cpu).item()
        return bool(total)


class _Discard:
    """A follower's generation sink: its output is rank 0's to send."""

    def put(self, item: object) -> None:
        pass

    def close_soon(self) -> None:
        pass


class DistributedTextEngine(MlxTextEngine):
    """One rank of a sharded text model (see the module docstring)."""

    def __init__(self, model: ModelConfig, *, rank: Rank) -> None:
        super().__init__(model)
        self.rank = rank
        self._lockstep: Lockstep | None = None

    def _load_weights(self, path: Path) -> tuple[Any, Any]:
        import mlx.core as mx
        from mlx_lm.utils import sharded_load

        group = mx.distributed.init(strict=True, backend=self.rank.backend)
        if group.size() != self.rank.size or group.rank() != self.rank.rank:
            raise LoadFailed(
                f"{self.name}: the {self.rank.backend} group is rank {group.rank()} of "
                f"{group.size()}, expected {self.rank.rank} of {self.rank.size}"
            )
        loaded: Any = sharded_load(str(path))
        model, tokenizer = loaded[0], loaded[1]
        self._learn_tokenizer(model, tokenizer)
        self._lockstep = Lockstep(group)
        return model, tokenizer

    # ---- on the MLX thread -----------------------------------------------------------------

    def _run_one(self, job: Job) -> None:
        if self.rank.rank == 0 and self._lockstep is not None:
            if job.request.seed is None:  # every rank must sample alike
                job.request = replace(job.request, seed=int.from_bytes(os.urandom(4), "little"))
            # the processors are callables: each rank builds its own from the constraint
            self._lockstep.share(("job", replace(job.request, logits_processors=())))
        super()._run_one(job)

    def _stop_now(self, job: Job) -> bool:
        if self._lockstep is None:
            return job.cancel.is_set()
        return self._lockstep.agree(job.cancel.is_set())

    def _unload_on_thread(self) -> None:
        if self.rank.rank == 0 and self._lockstep is not None:
            self._lockstep.share(("stop",))  # the followers leave follow() and unload too
        self._lockstep = None
        super()._unload_on_thread()

    # ---- a follower -------------------------------------------------------------------------

    async def follow(self) -> None:
        """Ranks other than 0: run what rank 0 runs, until rank 0 stops."""
        if self._thread is None or self.rank.rank == 0:
            raise LoadFailed(f"{self.name}: only a loaded follower rank follows")
        await self._thread.run(self._follow_on_thread)

    def _follow_on_thread(self) -> None:
        lockstep = self._lockstep
        assert lockstep is not None
        while True:
            message = lockstep.share(None)
            if message[0] == "stop":
                return
            request = message[1]
            made = logits_processors(request, self._tokenizer, self._vocab_size, self._grammar)
            request = replace(request, logits_processors=tuple(made))
            job = Job(request=request, sink=_Discard())  # type: ignore[arg-type]
            try:
                self._run_one(job)
            except MlxdError:
                pass  # rank 0 met the same error (an invalid prompt) and reports it
