"""The mlx-lm text engine: one residency of one text model on its own MLX thread.

Theory of operation. ``load`` resolves the source (local directory, demo
model made on first use, or a Hugging Face download; :mod:`mlxd.engines.model_files.sources`),
then starts the engine's :class:`~mlxd.engines.runtime.mlx_thread.MlxThread`, which
loads the weights with ``mlx_lm.load`` and measures the footprint. Every later
MLX call runs on that thread: each generation (``mlx_lm.stream_generate``) and
the unload. ``stop`` cancels what runs, unloads, releases the memory and gives
the thread back for the next residency (:meth:`~mlxd.engines.runtime.mlx_thread.MlxThread.finish`).

Requests (``prepare``, ``generate``, the serial decode on the MLX thread) are
:class:`~mlxd.engines.mlx_generation.TextGeneration`, a part of this class in
:mod:`mlxd.engines.mlx_generation`; this module holds the engine's state and a
residency's life: the load (source, weights, footprint, the caches' sizes, the
scheduler: serial or batched) and the stop.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

from mlxd.config import ModelConfig
from mlxd.engines.base import (
    KvBook,
    KvBroker,
    LoadProgress,
    ProgressCallback,
)
from mlxd.engines.cache import prompt_disk
from mlxd.engines.grammar.constrained import GrammarCache
from mlxd.engines.injected_faults import Faults
from mlxd.engines.mlx_generation import Observer, TextGeneration
from mlxd.engines.model_files import sources
from mlxd.engines.model_files.sources import describe_load_error, progress_sink
from mlxd.engines.runtime import imports_ahead, memory
from mlxd.engines.runtime.jobs import Outbox
from mlxd.engines.runtime.mlx_thread import MlxThread
from mlxd.engines.scheduling.batch_loop import BatchLoop
from mlxd.engines.scheduling.batching import BatchScheduler
from mlxd.engines.scheduling.kv_gate import GatedScheduler
from mlxd.engines.scheduling.serial import SerialScheduler
from mlxd.engines.text import prompt_limits
from mlxd.engines.text.streaming import TokenTexts
from mlxd.engines.text.tool_calls import ToolFormat, tool_format
from mlxd.errors import EngineError, LoadFailed, MlxdError

PREFILL_STEP_ENV = "MLXD_PREFILL_STEP"
#: prompt tokens per prefill chunk; a cancel during prefill waits at most one chunk.
#: mlx-lm's default (2048) is tens of seconds of uninterruptible work on CPU, where
#: small chunks are no slower (measured on the small demo model: 32-token chunks
#: prefill at 45-50 tok/s, 2048-token chunks at 37); on Metal larger chunks pay.
DEFAULT_PREFILL_STEP_GPU = 512
DEFAULT_PREFILL_STEP_CPU = 64

def prefill_step_size(on_gpu: bool) -> int:
    """``MLXD_PREFILL_STEP`` if set, else the default for the device."""
    default = DEFAULT_PREFILL_STEP_GPU if on_gpu else DEFAULT_PREFILL_STEP_CPU
    raw = os.environ.get(PREFILL_STEP_ENV)
    try:
        return max(1, int(raw)) if raw else default
    except ValueError:
        return default


class MlxTextEngine(TextGeneration):
    """One residency of an mlx-lm text model (see the module docstring)."""

    kind = "text"

    def __init__(
        self,
        model: ModelConfig,
        *,
        prefill_step: int | None = None,
        observer: Observer | None = None,
        faults: Faults | None = None,
    ) -> None:
        self.name = model.name
        self.config = model
        #: injected faults (``faults:`` in the config; testing only)
        self.faults = faults
        #: None until the load picks the device's default (unless given)
        self.prefill_step: int | None = prefill_step
        self._prefill_adapts = False
        self.observer = observer
        self.path: Path | None = None
        self.load_seconds: float | None = None
        self.memory_source: str | None = None
        self._measured: int | None = None
        #: the model's context and prompt cap (known once the load found its config.json)
        self.limits = prompt_limits.limits_of(model, None)
        self._thread: MlxThread | None = None
        #: every generation's events reach Trio through this one outbox (few wake-ups)
        self._outbox: Outbox | None = None
        self._scheduler: SerialScheduler | None = None
        #: the decode loop of a batched model (None: generations run one at a time)
        self.batch: BatchLoop | None = None
        #: set by the load: whether mlx-lm can batch this model's KV cache
        self.can_batch = False
        #: KV bytes per token and the cache sizes this residency may use (set by the load)
        self.kv_bytes_per_token: int | None = None
        self.kv_cache_bytes = 0
        self.prompt_cache_bytes = 0
        self.disk: prompt_disk.PromptDisk | None = None  # the prompt cache's disk tier (the load's)
        #: the residency's side of this model's KV (set by the manager; None: not drawn)
        self.kv_broker: KvBroker | None = None
        #: the model's running KV: its floor, what the budget granted (set by the load)
        self.kv = KvBook(0, None)
        self._ready = False
        #: stop() was called: no new generation, no new load
        self._stopped = False
        self._has_chat_template = False
        #: the model family's tool-call format (None: the template has no tool support)
        self._tools: ToolFormat | None = None
        self._vocab_size = 0
        #: the tokenizer as constrained decoding and logprobs need it (built lazily)
        self._grammar = GrammarCache()
        self._texts: TokenTexts | None = None
        # owned by the MLX thread: written and read only there
        self._model: Any = None
        self._tokenizer: Any = None

    # ---- protocol: load / stop ---------------------------------------------------------

    async def load(self, progress: ProgressCallback) -> None:
        if self._thread is not None or self._stopped:
            raise LoadFailed(f"{self.name}: an engine loads once; make a new one")
        t0 = time.monotonic()
        progress(LoadProgress(phase="starting", detail=self.config.source))
        memory.limit_malloc_arenas()  # before this load's threads (see mlxd.engines.runtime.memory)
        # mlx-lm may still be importing on start-up's thread: never import it from two at once
        if imports_ahead.busy():
            await trio.to_thread.run_sync(imports_ahead.wait, abandon_on_cancel=True)
        else:
            imports_ahead.wait()  # returns at once: no thread hop
        try:
            path = await self._resolve(progress)
        except (LoadFailed, trio.Cancelled):
            raise
        except Exception as e:
            raise LoadFailed(f"{self.name}: {describe_load_error(e)}") from e
        self.path = path
        self._thread = MlxThread(name=f"mlx-{self.name}")
        self.limits = prompt_limits.limits_of(self.config, prompt_limits.context_length(path))
        progress(LoadProgress(phase="loading", detail=str(path)))
        cancel = threading.Event()
        try:
            await self._thread.run(
                self._load_on_thread, path, progress_sink(progress), cancel, cancel=cancel
            )
        except (LoadFailed, trio.Cancelled):
            raise
        except MlxdError as e:
            raise LoadFailed(f"{self.name}: {e.message}") from e
        except Exception as e:
            raise LoadFailed(f"{self.name}: cannot load {path}: {describe_load_error(e)}") from e
        # again: a demo model's config.json is written by the load itself
        self.limits = prompt_limits.limits_of(self.config, prompt_limits.context_length(path))
        self._outbox = outbox = Outbox()
        self._scheduler = self._make_scheduler(self._thread, outbox)
        self.load_seconds = time.monotonic() - t0
        self._ready = True
        size = self._measured or 0
        progress(
            LoadProgress(phase="done", bytes_done=size, bytes_total=size, detail=self.memory_source)
        )

    async def _resolve(self, progress: ProgressCallback) -> Path:
        missing = self.config.missing
        if missing is not None:  # the local directory was missing when the config was read
            if not await trio.Path(self.config.source).exists():
                raise LoadFailed(f"{self.name}: {missing}")
            if self.config.estimated_memory_bytes is None:
                raise LoadFailed(
                    f"{self.name}: '{self.config.source}' appeared after the config was read, so "
                    "the model has no memory estimate yet: reload the config (POST /admin/reload)"
                )
        if self.config.demo:
            return sources.demo_path(self.config.source)  # written on the MLX thread if missing
        path = await sources.resolve_source(
            self.config.source,
            progress,
            kind=self.config.source_kind,
            allow_patterns=self._allow_patterns(),
        )
        if not (path / "config.json").is_file():
            raise LoadFailed(f"{self.name}: {path} holds no config.json (not a model directory)")
        return path

    def _allow_patterns(self) -> tuple[str, ...]:
        return sources.TEXT_PATTERNS

    def _load_on_thread(
        self, path: Path, report: Callable[[LoadProgress], None], cancel: threading.Event
    ) -> None:
        import mlx.core as mx

        fault = self.faults.on_load() if self.faults is not None else None
        if fault == "hang" and self.faults is not None:
            self.faults.hang_thread()
        if fault == "ignore_cancel" and self.faults is not None:
            time.sleep(self.faults.settings.delay_s)  # an uninterruptible load, as mlx-lm's is
        if self.config.demo:
            self._write_demo(path, report)
        if cancel.is_set():
            return
        if self.prefill_step is None:  # the default step grows for a fast model (batch_loop)
            self.prefill_step = prefill_step_size(mx.default_device() == mx.gpu)
            self._prefill_adapts = not os.environ.get(PREFILL_STEP_ENV)
        # this thread's random state (16 bytes, made by its first draw: a model's init draws)
        # is made here, so a load on a fresh thread measures what one on a used thread does
        mx.eval(mx.random.uniform(shape=(1,)))
        before = int(mx.get_active_memory())
        self._model, self._tokenizer = self._load_weights(path)
        after = int(mx.get_active_memory())
        self._size_caches(path)
        # active memory is process-global: loads are serialized per engine, but another
        # engine's load or unload at the same moment skews the delta (footprint() checks it)
        self._measured, self.memory_source = memory.footprint(before, after, self._model)
        memory.settle_heap()  # the model's objects last as long as it does: out of full collections
        report(
            LoadProgress(phase="measuring", bytes_done=self._measured, bytes_total=self._measured)
        )

    def _size_caches(self, path: Path) -> None:
        """Whether this model can batch, and the KV sizes it may use (what its load committed)."""
        from mlxd.config.kv import eligibility, residency_cache_sizes

        # the rule first: the cache type is looked at only where the kind allows a batch
        self.can_batch = eligibility(self.config).batches and (
            eligibility(self.config, self._cache_batchable()).batches
        )
        self.kv_bytes_per_token, self.kv_cache_bytes, self.prompt_cache_bytes = (
            residency_cache_sizes(self.config, path)
        )
        self.disk = prompt_disk.open_tier(self.config, path, self._model, self.can_batch,
                                          self.prompt_cache_bytes)
        self.kv = KvBook.of(self.config, self.kv_bytes_per_token, self.kv_cache_bytes, self.kv_broker)

    def _cache_batchable(self) -> bool:
        """mlx-lm batches a model whose every per-layer KV cache can be merged into a batch."""
        from mlx_lm.models.cache import make_prompt_cache

        try:
            return all(hasattr(c, "merge") for c in make_prompt_cache(self._model))
        except Exception:
            return False

    def use_kv_broker(self, broker: KvBroker) -> None:
        """Draw this residency's KV beyond its floor from the budget (before the load)."""
        self.kv_broker = broker

    def _make_scheduler(self, thread: MlxThread, outbox: Outbox) -> SerialScheduler:
        """Batched (continuous batching) where the eligibility rule says so; else serial."""
        mc = self.config
        if not self.can_batch:
            return GatedScheduler(
                thread, self._run_one, max_queue=mc.max_queue, name=self.name, kv=self.kv
            )
        assert self.prefill_step is not None
        scheduler = BatchScheduler.start(
            thread,
            lambda: (self._model, self._tokenizer),
            name=self.name,
            max_queue=mc.max_queue,
            max_batch=mc.max_batch_size,
            prefill_step=self.prefill_step,
            kv=self.kv,
            prompt_cache_bytes=self.prompt_cache_bytes,
            outbox=outbox,
            output=self._output,
            prefill_adapts=self._prefill_adapts,
            disk=self.disk, faults=self.faults,
        )
        self.batch = scheduler.loop
        return scheduler

    def memory_usage(self) -> dict[str, int] | None:
        """KV bytes held now by running generations and the prompt cache, and the KV peak
        since the load; None when the model is not batched (one at a time: not measured)."""
        return None if self.batch is None else self.batch.usage()

    def _write_demo(self, path: Path, report: Callable[[LoadProgress], None]) -> None:
        from mlxd.engines.model_files.demo_model import (
            DemoModelError,
            is_model_dir,
            write_demo_model,
        )

        if is_model_dir(path):
            return
        kind = self.config.demo or "tiny"

        def say(msg: str) -> None:
            report(LoadProgress(phase="loading", detail=f"demo model: {msg}"))

        try:
            write_demo_model(path, kind, report=say)
        except DemoModelError as e:
            raise LoadFailed(f"{self.name}: cannot make the demo model: {e}") from e

    def _load_weights(self, path: Path) -> tuple[Any, Any]:
        from mlx_lm import load

        # imports mlx-lm, so not at the daemon's start-up
        from mlxd.engines.text.detokenizer import stream_bytes_promptly

        loaded: Any = load(str(path))
        imports_ahead.save_scans()  # if this load was the first to import transformers
        model, tokenizer = loaded[0], loaded[1]
        stream_bytes_promptly(tokenizer)
        self._learn_tokenizer(model, tokenizer)
        return model, tokenizer

    def _learn_tokenizer(self, model: Any, tokenizer: Any) -> None:
        """What requests are checked against: chat template, tool-call format, vocabulary."""
        self._has_chat_template = bool(getattr(tokenizer, "has_chat_template", False))
        self._tools = tool_format(tokenizer) if self._has_chat_template else None
        args = getattr(model, "args", None)
        self._vocab_size = int(getattr(args, "vocab_size", 0) or len(tokenizer.vocab))
        self._texts = TokenTexts(tokenizer)

    async def stop(self) -> None:
        """Free the model; safe to call again after it raised or was cut short.

        The unload is the MLX thread's last job, queued behind the running job
        (which stops within one token) or a load that cannot be interrupted;
        see :meth:`~mlxd.engines.runtime.mlx_thread.MlxThread.finish` for the retries.
        """
        self._stopped = True
        self._ready = False
        if self._scheduler is not None:
            self._scheduler.close(
                EngineError(f"{self.name}: the model was unloaded", retry_after=1.0)
            )
        thread = self._thread
        if thread is not None and not thread.finished:
            await thread.finish(self._unload_on_thread)
            memory.malloc_trim()  # again, now that the last job's references are gone

    def _unload_on_thread(self) -> None:
        fault = self.faults.on_stop() if self.faults is not None else None
        if fault == "hang" and self.faults is not None:
            self.faults.hang_thread()
        if self.batch is not None:
            self.batch.close()  # the generator and the prompt cache hold MLX arrays
        self._model = None
        self._tokenizer = None
        self._unload_extra()
        memory.release_memory()

    def _unload_extra(self) -> None:
        """Drop engine-specific MLX references (the vision engine's processor)."""

    def measured_bytes(self) -> int | None:
        return self._measured

    def queue_depth(self) -> int:
        return self._scheduler.depth() if self._scheduler is not None else 0

    async def wait_died(self) -> str:
        await trio.sleep_forever()  # it runs in the daemon: it cannot die without it
        raise AssertionError("unreachable")
