"""A scriptable engine with no weights and no threads, for tests and demos.

It starts no threads, so tests can run it under ``autojump_clock`` (a thread
would let virtual time jump, trio#456). Everything about a model's fake lives
in a :class:`FakeModel` shared by all residencies of that model: its size, its
virtual load/unload time, its token rate, a failure script ("fail the 2nd
load"), gates that park it at a phase until the test releases them, counters
and a call log. Each load makes a fresh :class:`FakeEngine` (one residency).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field, replace

import trio

from mlxd.config import (
    FakeSettings,
    Measurement,
    ModelConfig,
    resolve_estimate,
    weights_fingerprint,
)
from mlxd.crash_points import crash_point
from mlxd.engines.base import (
    Finished,
    GenerationEvent,
    GenerationRequest,
    LoadProgress,
    ProgressCallback,
    TextDelta,
    TokenLogprob,
)
from mlxd.engines.injected_faults import Faults, InjectedFault
from mlxd.engines.text import prompt_limits
from mlxd.engines.text.prompts import uses_tools
from mlxd.errors import EngineDied, InvalidRequest, Overloaded, ToolsNotSupported


class ScriptedFailure(RuntimeError):
    """Raised by a fake engine where its failure script says so."""


@dataclass
class Gate:
    """Parks an engine at a phase: ``reached`` is set when it arrives, ``release()`` lets it go."""

    phase: str
    reached: trio.Event = field(default_factory=trio.Event)
    _open: trio.Event = field(default_factory=trio.Event)
    #: how many engines passed through (after release)
    passed: int = 0

    def release(self) -> None:
        self._open.set()

    async def _pass(self) -> None:
        self.reached.set()
        await self._open.wait()
        self.passed += 1


@dataclass
class FakeModel:
    """The script and the counters of one fake model, across its residencies."""

    name: str
    memory_bytes: int
    load_seconds: float = 0.0
    unload_seconds: float = 0.0
    tokens_per_second: float = 1000.0
    reply: str = "This is mlxd's fake engine speaking. "
    max_queue: int = 64
    #: prompts of more words than this are refused (None: no limit)
    max_prompt_tokens: int | None = None
    #: 1-based indices of load / unload attempts that raise ScriptedFailure
    fail_loads: set[int] = field(default_factory=set)
    fail_unloads: set[int] = field(default_factory=set)

    loads_started: int = 0
    loads_ok: int = 0
    loads_cancelled: int = 0
    stops: int = 0
    stops_failed: int = 0
    generations: int = 0
    tokens: int = 0
    #: engines currently holding memory (loaded, or partially loaded and not stopped)
    resident: int = 0
    log: list[tuple[float, str]] = field(default_factory=list)
    gates: dict[str, Gate] = field(default_factory=dict)
    #: the residency loaded last (what :meth:`FakeEngine.die` is called on in tests)
    current: FakeEngine | None = None
    #: the ``faults:`` script (raise, hang, ignore cancellation; see mlxd.engines.injected_faults)
    faults: Faults | None = None

    def gate(self, phase: str) -> Gate:
        """Park the next engines of this model at ``phase`` (load, unload, generate)."""
        g = Gate(phase)
        self.gates[phase] = g
        return g

    def record(self, what: str) -> None:
        self.log.append((trio.current_time(), what))

    async def _at(self, phase: str) -> None:
        g = self.gates.get(phase)
        if g is not None:
            await g._pass()

    @classmethod
    def from_config(cls, model: ModelConfig, memory_bytes: int) -> FakeModel:
        s = model.fake or FakeSettings()
        return cls(
            name=model.name,
            memory_bytes=memory_bytes,
            load_seconds=s.load_seconds,
            unload_seconds=s.unload_seconds,
            tokens_per_second=s.tokens_per_second,
            reply=s.reply,
            max_queue=model.max_queue,
            max_prompt_tokens=model.max_prompt_tokens,
            fail_loads=set(s.fail_loads),
            fail_unloads=set(s.fail_unloads),
            faults=Faults(model.name, model.faults) if model.faults is not None else None,
        )


#: the FakeModel fields a config sets (the rest are counters, the log and gates)
SETTINGS = (
    "memory_bytes", "load_seconds", "unload_seconds", "tokens_per_second", "reply", "max_queue",
    "max_prompt_tokens", "fail_loads", "fail_unloads",
)


def _count_words(request: GenerationRequest) -> int:
    if request.kind == "completion":
        return len((request.prompt or "").split())
    n = 0
    for m in request.messages:
        if isinstance(m.content, str):
            n += len(m.content.split())
        else:
            n += sum(len(str(p.get("text", "")).split()) for p in m.content)
    return n


class FakeEngine:
    """One residency of a :class:`FakeModel`."""

    def __init__(self, model: FakeModel) -> None:
        self.name = model.name
        self.model = model
        self._holding = False
        self._stopped = False
        #: a stop of this engine failed (it must never serve a request again)
        self.stop_failed = False
        self._lock = trio.Lock()  # FIFO: requests are served in arrival order
        self._queued = 0
        #: set by :meth:`die`: the residency ended on its own, as a killed worker process does
        self.death: str | None = None
        self._died = trio.Event()

    async def load(self, progress: ProgressCallback) -> None:
        m = self.model
        m.loads_started += 1
        attempt = m.loads_started
        m.current = self
        m.record(f"load {attempt} start")
        self._holding = True
        m.resident += 1
        try:
            progress(LoadProgress(phase="loading", bytes_done=0, bytes_total=m.memory_bytes))
            fault = m.faults.on_load() if m.faults is not None else None
            if fault == "hang":
                await trio.sleep_forever()
            if fault == "ignore_cancel" and m.faults is not None:
                with trio.move_on_after(m.faults.settings.delay_s) as deaf:  # its fault's bound
                    deaf.shield = True
                    await trio.sleep_forever()
            await m._at("load")
            await trio.sleep(m.load_seconds)
            crash_point("manager.mid_load")  # loaded, the manager not told: still `loading`
            if attempt in m.fail_loads:
                m.record(f"load {attempt} failed")
                raise ScriptedFailure(f"scripted failure of load {attempt} of {m.name}")
        except trio.Cancelled:
            m.loads_cancelled += 1
            m.record(f"load {attempt} cancelled")
            raise
        m.loads_ok += 1
        progress(LoadProgress(phase="done", bytes_done=m.memory_bytes, bytes_total=m.memory_bytes))
        m.record(f"load {attempt} done")

    async def stop(self) -> None:
        m = self.model
        if self._stopped:
            return
        m.stops += 1
        attempt = m.stops
        m.record(f"stop {attempt} start")
        await m._at("unload")
        await trio.sleep(m.unload_seconds)
        crash_point("manager.mid_unload")  # stopped, the manager not told: still `unloading`
        try:
            if attempt in m.fail_unloads:
                raise ScriptedFailure(f"scripted failure of unload {attempt} of {m.name}")
            if m.faults is not None and m.faults.on_stop() == "hang":
                await trio.sleep_forever()
        except (ScriptedFailure, InjectedFault):
            self.stop_failed = True
            m.stops_failed += 1
            m.record(f"stop {attempt} failed")
            raise
        self._stopped = True
        if self._holding:
            self._holding = False
            m.resident -= 1
        m.record(f"stop {attempt} done")

    def die(self, why: str = "the engine process killed by SIGKILL") -> None:
        """End this residency on its own: its memory is gone, its streams fail, it stays dead."""
        if self.death is not None:
            return
        self.death = why
        self.model.record("died")
        if self._holding:
            self._holding = False
            self.model.resident -= 1
        self._died.set()

    async def wait_died(self) -> str:
        await self._died.wait()
        assert self.death is not None
        return self.death

    def _check_alive(self) -> None:
        if self.death is not None:
            raise EngineDied(f"'{self.name}': its engine process died ({self.death})")

    def measured_bytes(self) -> int | None:
        return self.model.memory_bytes

    def queue_depth(self) -> int:
        return self._queued

    async def prepare(self, request: GenerationRequest) -> GenerationRequest:
        """Check the prompt (a word is a token) against the model's prompt cap; the fake has
        no chat template and no grammar, so tools and constraints are refused."""
        cap = self.model.max_prompt_tokens or prompt_limits.DEFAULT_MAX_PROMPT_TOKENS
        limits = prompt_limits.PromptLimits(context=None, max_prompt_tokens=cap)
        prompt_limits.check_prompt_chars(self.name, request, limits)
        prompt_limits.fit_prompt_tokens(self.name, request, _count_words(request), limits)
        self._refuse_unsupported(request)
        return request

    def _refuse_unsupported(self, request: GenerationRequest) -> None:
        if uses_tools(request):
            raise ToolsNotSupported(f"model '{self.name}' (a fake engine) takes no tools", param="tools")
        if request.constraint is not None:
            raise InvalidRequest(
                f"response_format: model '{self.name}' (a fake engine) only writes its canned text",
                param="response_format",
            )

    async def count_tokens(self, request: GenerationRequest) -> int:
        """The fake's "tokens" are words; like its generations, it takes no tools and no grammar."""
        self._refuse_unsupported(request)
        return _count_words(request)

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[GenerationEvent, None]:
        m = self.model
        self._check_alive()
        request = await self.prepare(request)
        if self._queued >= m.max_queue:
            raise Overloaded(
                f"{m.name}: {self._queued} requests are already queued (max_queue={m.max_queue})"
            )
        self._queued += 1
        try:
            async with self._lock:
                self._check_alive()
                m.generations += 1
                started = time.monotonic()  # one at a time: it leaves the queue here
                m.record("generate start")
                await m._at("generate")
                words = itertools.cycle(m.reply.split(" ") if m.reply else ["x"])
                text = ""
                produced = 0
                finish: str = "length"
                matched: str | None = None
                delay = 1.0 / m.tokens_per_second if m.tokens_per_second > 0 else 0.0
                while produced < request.max_tokens:
                    if m.faults is not None and m.faults.on_token(produced) == "hang":
                        await trio.sleep_forever()
                    await trio.sleep(delay)
                    self._check_alive()
                    piece = next(words) + " "
                    produced += 1
                    m.tokens += 1
                    hit = _first_stop(text + piece, request.stop)
                    if hit is not None:
                        matched = next(s for s in request.stop if s and (text + piece).find(s) == hit)
                        keep = hit - len(text)
                        if keep > 0:
                            yield TextDelta(piece[:keep], _certain(piece[:keep], request))
                        finish = "stop"
                        break
                    text += piece
                    yield TextDelta(piece, _certain(piece, request))
                m.record("generate done")
                yield Finished(
                    finish_reason="stop" if finish == "stop" else "length",
                    prompt_tokens=_count_words(request),
                    completion_tokens=produced,
                    stop_sequence=matched,
                    started_at=started,
                )
        finally:
            self._queued -= 1


def _certain(piece: str, request: GenerationRequest) -> tuple[TokenLogprob, ...]:
    """The fake's text is certain: each "token" (word) has log probability 0 and no rival."""
    if request.logprobs is None:
        return ()
    certain = TokenLogprob(0, piece, 0.0, tuple(piece.encode()))  # the fake has no token ids
    return (replace(certain, top=(certain,)) if request.logprobs > 0 else certain,)


def _first_stop(text: str, stops: tuple[str, ...]) -> int | None:
    positions = [i for s in stops if s and (i := text.find(s)) >= 0]
    return min(positions) if positions else None


class FakeFleet:
    """The fakes of a whole config, by model name; use as the manager's engine factory.

    ``fleet["a"]`` is the :class:`FakeModel` of model ``a`` (made on first use
    from the config's ``fake:`` settings and the model's memory estimate).
    """

    def __init__(self, sizes: dict[str, int] | None = None) -> None:
        self.models: dict[str, FakeModel] = {}
        self._sizes = dict(sizes or {})
        #: the config each fake was made from (fakes added by a test have none)
        self._configs: dict[str, ModelConfig] = {}

    def add(self, model: FakeModel) -> FakeModel:
        self.models[model.name] = model
        return model

    def __getitem__(self, name: str) -> FakeModel:
        return self.models[name]

    def for_config(self, model: ModelConfig) -> FakeModel:
        """The fake of ``model``; made from its config, and its settings renewed when that changed.

        A renewed fake keeps its counters, log and gates (a reload replaces a
        model's settings, not its history).
        """
        known = self._configs.get(model.name)
        if model.name not in self.models or (known is not None and known != model):
            size = self._sizes.get(model.name)  # as if measured on its current settings
            sizes = {} if size is None else {model.name: Measurement(size, weights_fingerprint(model))}
            est = resolve_estimate(model, sizes)
            fresh = FakeModel.from_config(model, est.weights if est else 0)
            old = self.models.get(model.name)
            if old is not None:
                for f in SETTINGS:
                    setattr(old, f, getattr(fresh, f))
                fresh = old
            self.models[model.name] = fresh
            self._configs[model.name] = model
        return self.models[model.name]

    def __call__(self, model: ModelConfig) -> FakeEngine:
        return FakeEngine(self.for_config(model))
