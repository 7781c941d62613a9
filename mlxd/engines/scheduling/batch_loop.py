"""The decode loop of a batched model, on its MLX thread, built on mlx-lm's ``BatchGenerator``.

Theory of operation. :class:`BatchLoop` owns one ``BatchGenerator`` and the
model's :class:`~mlxd.engines.cache.prompt_cache.PromptCache`; both hold MLX arrays,
so both live and die on the engine's MLX thread. The Trio side
(:class:`mlxd.engines.scheduling.batching.BatchScheduler`) hands it admitted jobs through
:meth:`BatchLoop.add` (thread-safe). While it has work, :meth:`BatchLoop.run`
runs as one job on the MLX thread and repeats one *step*:

1. take the newly added jobs into the generator: longest cached prefix from
   the prompt cache, the request's own sampler (temperature, top_p and a
   private random key when it has a seed, so its tokens do not depend on its
   neighbours), its logits processors and ``max_tokens``;
2. take out every job whose cancel flag is set (client gone, preemption,
   shutdown): at most one step after the flag, and the others go on;
3. ``BatchGenerator.next()``: one decode step for every generating sequence
   plus one prefill chunk (``prefill_step`` tokens) of each newcomer, so a
   long prompt never freezes the running streams;
4. deliver each new token (:func:`~mlxd.engines.text.streaming.deliver_token`:
   stop strings, tool calls, logprobs, ``Finished``, through the job's
   :class:`~mlxd.engines.text.streaming.Output`, made by the engine); a finished
   sequence's KV goes to the prompt cache and its job is reported done to the
   Trio side.
5. a newcomer whose prompt ended in this step gets its first token at once
   (:meth:`StepDeliveries._deliver_first`): the generator has already sampled it,
   but would hand it out only one step later, after building and starting the
   next forward pass. A sequence that ends at its first token (``max_tokens``
   1, or end of sequence) leaves the generator there, so that forward pass is
   never run for it; its prompt's KV goes to the prompt cache.

Steps 4 and 5 and the ends of sequences live in :mod:`mlxd.engines.scheduling.deliveries`
(:class:`~mlxd.engines.scheduling.deliveries.StepDeliveries`, a part of this class).

A busy period starts with the requests that are already on their way: the
Trio side says when a request has its lease and is being checked and
tokenized (:meth:`BatchLoop.expecting`), and the loop, finding its first job
with others on their way, waits for them (:data:`GATHER_S` at most) so that
they all prefill in one step, instead of the first prefilling alone and the
others one step later, after it (a burst of clients gets its first tokens
together, sooner for all but the first).

A job that arrives while the loop has nothing else to do, and that has no
logits processors, runs alone (:mod:`mlxd.engines.scheduling.solo`): plain per-layer KV
caches and one forward pass per token, without the generator's batch
bookkeeping, until a second job arrives; it then goes into the generator with
its KV, its sampler and its remaining ``max_tokens`` and carries on there.

When no job is left and none is waiting in the inbox, :meth:`run` returns, so
jobs queued behind it on the thread (an unload) run. A request's own failure
(its logits processor, sampler, detokenizer or stop matching raised) ends
that request alone, with its error, and the batch goes on
(:mod:`mlxd.engines.scheduling.guard`); only a failure of the step itself (the forward
pass, out of memory) fails every job in the batch with it and drops the
generator; the next job starts a fresh one.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from mlxd.engines.base import GenerationRequest
from mlxd.engines.cache.prompt_cache import PromptCache
from mlxd.engines.injected_faults import Faults
from mlxd.engines.runtime import memory
from mlxd.engines.runtime.jobs import Job, Outbox
from mlxd.engines.scheduling.deliveries import BatchSeq, DoneCallback, StepDeliveries
from mlxd.engines.scheduling.disk_writes import DiskWrites
from mlxd.engines.scheduling.guard import Guard
from mlxd.engines.scheduling.prefill_pace import PrefillPacing, solo_chunk
from mlxd.engines.scheduling.sampling import make_sampler
from mlxd.engines.scheduling.solo import Resume, SoloRun, runs_alone
from mlxd.engines.text.streaming import Output

if TYPE_CHECKING:
    from mlxd.engines.cache.prompt_disk import PromptDisk

log = logging.getLogger(__name__)

#: the longest the loop waits, at the start of a busy period, for requests on their way
#: (BatchLoop.expecting): about what checking and tokenizing a few requests takes
GATHER_S = 0.005

#: the engine's Output for a request (its tokenizer's texts, its tool-call format)
OutputFactory = Callable[[GenerationRequest], Output]


class BatchLoop(PrefillPacing, StepDeliveries, DiskWrites):
    """See the module docstring. Constructed on the Trio side; everything MLX runs on ``thread``."""

    def __init__(
        self,
        submit: Callable[[Callable[[], None]], None],
        *,
        model: Callable[[], tuple[Any, Any]],
        max_batch: int,
        prefill_step: int,
        prompt_cache_bytes: int,
        on_done: DoneCallback,
        outbox: Outbox,
        output: OutputFactory,
        prefill_adapts: bool = False,
        disk: PromptDisk | None = None, faults: Faults | None = None,
    ) -> None:
        self._submit = submit  # runs a callable on the engine's MLX thread
        self._model = model  # () -> (model, tokenizer), read on the MLX thread
        self.max_batch = max_batch
        self.prefill_step = prefill_step
        #: the chunk in use: ``prefill_step``, or larger for a fast model (PREFILL_CHUNK_S) when
        #: the step is the default one; and the prefill rate measured (tokens/s, MLX thread)
        self.prefill_chunk, self.solo_chunk = prefill_step, solo_chunk(prefill_step, prefill_adapts)
        self._prefill_adapts = prefill_adapts
        self.prefill_rate: float | None = None
        self.prompt_cache_bytes = prompt_cache_bytes
        #: the prompt cache's disk tier (mlxd.engines.cache.prompt_disk), None when off
        self.disk = disk
        self._on_done = on_done
        self._outbox = outbox
        self._output = output
        self._faults = faults  # requests poisoned on purpose (tests), see mlxd.engines.injected_faults
        self._lock = threading.Lock()
        self._persist_timer: threading.Timer | None = None  # DiskWrites, under _lock
        self._closed = False
        self._arrival = threading.Condition(self._lock)  # a job added, or one on its way less
        self._expected = 0  # requests on their way (expecting), under _lock
        # invariant: _running is True exactly while run() is queued on or running on the thread
        self._inbox: collections.deque[Job] = collections.deque()
        self._running = False
        # owned by the MLX thread
        self._gen: Any = None
        self._seqs: dict[int, BatchSeq] = {}
        self._cache: PromptCache | None = None
        self._solo = False  # a job is running alone (mlxd.engines.scheduling.solo)
        #: jobs that started alone, and those of them handed to the generator
        self.alone = 0
        self.handed_over = 0
        self.steps = 0
        #: the KV bytes the running batch holds, and the most it has held (sampled after each step;
        #: the manager journals the peak when the residency ends, see mlxd.residency.views.kv_peak)
        self.kv_bytes = 0
        self.kv_peak_bytes = 0
        #: the largest generation (prompt + completion tokens) finished since the loop was idle
        self._largest = 0

    # ---- any thread ----------------------------------------------------------------------

    def add(self, job: Job) -> None:
        """Hand an admitted job to the loop (starts the loop on the MLX thread if idle)."""
        with self._lock:
            self._inbox.append(job)
            self._arrival.notify_all()
            self._disarm_persist()
            if self._running:
                return
            self._running = True
        self._submit(self.run)

    @contextlib.contextmanager
    def expecting(self) -> Iterator[None]:
        """While this runs, a request is on its way to :meth:`add` (module docstring)."""
        with self._arrival:
            self._expected += 1
        try:
            yield
        finally:
            with self._arrival:
                self._expected -= 1
                self._arrival.notify_all()

    @property
    def busy(self) -> bool:
        """Whether :meth:`run` is queued on or running on the MLX thread (it may still be
        filing a finished job's KV in the prompt cache after the job's last event)."""
        return self._running

    def usage(self) -> dict[str, int]:
        """Bytes held: the running batch's KV (sampled after each step on the MLX thread), its
        peak, and the prompt cache. Plain ints written by the MLX thread: safe to read anywhere."""
        cache = self._cache
        return {
            "kv_cache": self.kv_bytes if self._seqs or self._solo else 0,
            "kv_cache_peak": self.kv_peak_bytes,
            "prompt_cache": cache.nbytes if cache is not None else 0,
        }

    # ---- the MLX thread --------------------------------------------------------------------

    def run(self) -> None:
        """Step until no job is left (see the module docstring).

        Whatever goes wrong, no job is left hanging: an unexpected error fails
        every job in the batch and in the inbox, and the loop can start again.
        """
        try:
            self._run()
        except BaseException as e:
            log.exception("the batch loop failed")
            with self._lock:
                pending = list(self._inbox)
                self._inbox.clear()
                self._running = False
            self._fail_all(e)
            for job in pending:
                job.stats.outcome, job.stats.ended_at = "error", time.monotonic()
                self._on_done(job, e)

    def _run(self) -> None:
        while True:
            lone = self._lone_job()
            if lone is not None:
                self._run_alone(lone)
                continue
            self._take_new()
            self._drop_cancelled()
            if not self._seqs:
                # idle: drop the generator (a fresh one per busy period holds nothing stale) and
                # give back a large generation's freed buffers (the prompt cache's stay counted)
                if self._gen is not None:
                    self._gen.close()
                    self._gen = None
                memory.after_generation(self._largest)
                self._largest = 0
                with self._lock:
                    if not self._inbox:
                        self._running = False
                        self._idle_with_pending()
                        return
                continue
            self._step()

    def _step(self) -> None:
        """One ``BatchGenerator.next()`` and its deliveries (its arrays die with this frame)."""
        if any(s.n_tokens == 0 for s in self._seqs.values()):
            # a newcomer's prefill chunk may make this step long: the text held back
            # (Job.emit) goes out now rather than after it
            for s in self._seqs.values():
                s.job.flush()
        t0 = time.perf_counter()
        try:
            prompt_responses, gen_responses = self._gen.next()
        except Exception as e:
            log.exception("a batched decode step failed")
            self._fail_all(e)
            return
        self.steps += 1
        self._end_failed([s for s in self._seqs.values() if s.guard.error is not None])
        if prompt_responses:
            self._measure_prefill(prompt_responses, time.perf_counter() - t0)
        with self._outbox.holding():  # one wake-up of the Trio thread for the whole step
            self._progress(prompt_responses)
            self._deliver(gen_responses)
        newcomers = [r.uid for r in prompt_responses if r.end_of_prompt]
        if newcomers and self._gen is not None:
            with self._outbox.holding():  # after the running streams' tokens have gone out
                self._deliver_first(newcomers)
        if self._gen is not None:  # array sizes only (no evaluation): a few us per layer
            self.kv_bytes = int(self._gen.prompt_cache_nbytes)
            self.kv_peak_bytes = max(self.kv_peak_bytes, self.kv_bytes)

    def close(self) -> None:
        """Write the prompt cache to its disk tier, then drop the generator and the prompt cache
        (on the MLX thread, before the unload: a residency's end, whatever ends it)."""
        if self._gen is not None:
            self._gen.close()
        self._gen = None
        self._seqs.clear()
        self._end_writes()

    def note_step(self, kv: list[Any]) -> None:
        """A lone job's step is done; ``kv`` is its KV (see mlxd.engines.scheduling.solo)."""
        self.steps += 1
        self.kv_bytes = sum(int(c.nbytes) for c in kv)
        self.kv_peak_bytes = max(self.kv_peak_bytes, self.kv_bytes)

    def model_and_tokenizer(self) -> tuple[Any, Any]:
        return self._model()

    def prompt_cache(self) -> PromptCache:
        if self._cache is None:
            self._cache = PromptCache(self.prompt_cache_bytes, self.disk)
        return self._cache

    def _start(self, job: Job) -> bool:
        """A job leaves the inbox: False (and it is done) when it was cancelled meanwhile."""
        job.stats.started_at = time.monotonic()
        if not job.cancel.is_set():
            return True
        job.stats.outcome, job.stats.ended_at = "cancelled", time.monotonic()
        self._on_done(job, None)
        return False

    def _lone_job(self) -> Job | None:
        """The inbox's only job when nothing else runs and it can start alone, taken out
        (once the requests on their way have had their wait, :meth:`_gather`)."""
        if self._seqs:
            return None
        self._gather()
        with self._lock:
            if len(self._inbox) != 1 or not runs_alone(self._inbox[0].request):
                return None
            return self._inbox.popleft()

    def _gather(self) -> None:
        """Before the first job of a busy period starts: wait for the requests on their way
        (:meth:`expecting`), :data:`GATHER_S` at most, while the batch has room for them."""
        deadline = time.monotonic() + GATHER_S
        with self._arrival:
            while self._inbox and self._expected > 0 and len(self._inbox) < self.max_batch:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self._arrival.wait(left)

    def _run_alone(self, job: Job) -> None:
        """Run ``job`` alone until it ends or another job arrives (then it joins the generator)."""
        st, req = job.stats, job.request
        if not self._start(job):
            return
        self._solo = True
        self.alone += 1
        guard = self._guard(req)
        try:
            run = SoloRun(self, job,
                          guard.sampler(make_sampler(req.temperature, req.top_p, req.seed, req.top_k)),
                          self._output(req), guard)
            resume = run.run(lambda: bool(self._inbox))
            if resume is not None:
                self._resume(job, resume)
                return
        except Exception as e:
            log.exception("a lone generation failed")
            st.outcome, st.ended_at = "error", time.monotonic()
            self._on_done(job, e)
            return
        finally:
            self._solo = False
        st.ended_at = time.monotonic()
        self._on_done(job, None)
        self._largest = max(self._largest, st.prompt_tokens + st.completion_tokens)

    def _resume(self, job: Job, r: Resume) -> None:
        """A lone job goes on in the generator from where it stopped (mlxd.engines.scheduling.solo)."""
        from mlx_lm.generate import StopSequences

        _model, tok = self._model()
        self.handed_over += 1
        (uid,) = self._generator().insert(
            [r.prompt],
            max_tokens=[job.request.max_tokens - r.n_tokens],
            caches=[r.cache],
            all_tokens=[r.tokens_in_kv],
            samplers=[r.sampler],
            logits_processors=[[]],
            stop_sequences=[StopSequences([(t,) for t in tok.eos_token_ids])],  # == BatchSeq.eos
        )
        eos = frozenset(int(t) for t in tok.eos_token_ids)
        self._seqs[uid] = BatchSeq(job, uid, r.detok, r.out, r.cached, eos, r.guard,
                               n_tokens=r.n_tokens,
                               offset=len(r.tokens_in_kv) if r.n_tokens == 0 else 0,
                               from_disk=r.from_disk)

    def _generator(self) -> Any:
        if self._gen is None:
            from mlx_lm.generate import BatchGenerator

            model, _tok = self._model()
            self._gen = BatchGenerator(
                model,
                completion_batch_size=self.max_batch,
                prefill_batch_size=self.max_batch,
                prefill_step_size=self.prefill_chunk,
            )
        if self._cache is None:
            self._cache = PromptCache(self.prompt_cache_bytes, self.disk)
        return self._gen

    def _take_new(self) -> None:
        while True:
            with self._lock:
                if not self._inbox:
                    return
                job = self._inbox.popleft()
            try:
                self._insert(job)
            except Exception as e:
                job.stats.ended_at = time.monotonic()
                self._on_done(job, e)

    def _insert(self, job: Job) -> None:
        from mlx_lm.generate import StopSequences

        st, req = job.stats, job.request
        if not self._start(job):
            return
        gen = self._generator()
        assert self._cache is not None
        _model, tok = self._model()
        ids: list[int] = list(req.prompt_ids or ())  # the engine's prepare() tokenized it
        st.prompt_tokens = len(ids)
        cache, rest, from_disk = self._cache.fetch(ids)
        cached = len(ids) - len(rest)
        guard = self._guard(req)
        (uid,) = gen.insert(
            [rest],
            max_tokens=[req.max_tokens],
            caches=[cache] if cache is not None else None,
            all_tokens=[ids[:cached]],
            samplers=[guard.sampler(make_sampler(req.temperature, req.top_p, req.seed, req.top_k))],
            logits_processors=[guard.processors(req.logits_processors)],
            stop_sequences=[StopSequences([(t,) for t in tok.eos_token_ids])],  # == BatchSeq.eos
        )
        eos = frozenset(int(t) for t in tok.eos_token_ids)
        self._seqs[uid] = BatchSeq(job, uid, tok.detokenizer, self._output(req), cached, eos, guard,
                               offset=cached, from_disk=from_disk)

    def _guard(self, request: GenerationRequest) -> Guard:
        poison = self._faults.poison_of(request.request_id) if self._faults is not None else None
        return Guard(poison)
