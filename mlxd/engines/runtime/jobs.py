"""What an MLX thread sends into Trio: one wake-up for many items, sinks, a generation's job.

Theory of operation (the facts behind it are in docs/platform-facts.md: "Prefill is
interruptible only between chunks"):

* Results go into Trio with ``trio_token.run_sync_soon(...)`` into unbounded
  memory channels (:class:`Sink`), so the MLX thread never blocks on a slow
  consumer and the Trio side awaits a channel, which is cancellable at once;
  an :class:`Outbox` wakes the Trio thread once for everything put meanwhile.
* A :class:`Job` is one generation as a scheduler sees it (request, sink,
  cancel flag, :class:`GenerationStats`). It cannot be interrupted from
  outside; it polls its ``cancel`` flag (between tokens, and between prefill
  chunks).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import trio

from mlxd.engines.base import GenerationRequest, TextDelta
from mlxd.engines.runtime.mlx_thread import call_soon


class Outbox:
    """Items from an MLX thread into Trio, with one wake-up of the Trio thread for all that waits.

    ``put`` appends; the first item put while no wake-up is pending schedules one
    (``run_sync_soon``); the items put before it runs, and while it runs (a job's
    completion, see :meth:`call`), ride along. While :meth:`holding` (over a decode
    step's deliveries) nothing is scheduled: one wake-up carries every stream's token."""

    def __init__(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._lock = threading.Lock()
        self._items: list[tuple[Callable[..., object], tuple[Any, ...]]] = []  # calls, in order
        # invariant: True from the scheduling of a drain until the drain has found nothing left
        self._scheduled = False
        self._holds = 0

    def put(self, sink: Sink, item: object) -> None:
        """Thread-safe: queue ``item`` for ``sink``."""
        self.call(sink._deliver, item)

    def call(self, fn: Callable[..., object], *args: Any) -> None:
        """Thread-safe: run ``fn(*args)`` on the Trio thread after what was put before."""
        with self._lock:
            self._items.append((fn, args))
            if self._scheduled or self._holds:
                return
            self._scheduled = True
        call_soon(self._token, self._drain)

    @contextmanager
    def holding(self) -> Iterator[None]:
        """Hold the wake-up until the block ends (then one carries everything put in it)."""
        with self._lock:
            self._holds += 1
        try:
            yield
        finally:
            with self._lock:
                self._holds -= 1
                wake = not self._holds and bool(self._items) and not self._scheduled
                if wake:
                    self._scheduled = True
            if wake:
                call_soon(self._token, self._drain)

    def _drain(self) -> None:
        for n in range(3):  # two passes (the second takes what came meanwhile: a completion)
            with self._lock:
                if not self._items:  # nothing left: no wake-up (each costs two syscalls)
                    self._scheduled = False
                    return
                if n == 2:
                    break  # a third pass waits its turn: the event loop runs in between
                items, self._items = self._items, []
            for fn, args in items:
                fn(*args)
        call_soon(self._token, self._drain)  # still scheduled


_CLOSE = object()


class Sink:
    """An unbounded channel from an MLX thread into Trio; ``put`` never blocks the thread."""

    def __init__(self, outbox: Outbox | None = None) -> None:
        self._outbox = outbox if outbox is not None else Outbox()
        self.send, self.receive = trio.open_memory_channel[object](math.inf)

    def put(self, item: object) -> None:
        """Thread-safe: deliver ``item`` to the receiving side (dropped if it has gone)."""
        self._outbox.put(self, item)

    def _deliver(self, item: object) -> None:
        if item is _CLOSE:
            self.send.close()
            return
        try:
            self.send.send_nowait(item)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the consumer left; the job is being cancelled

    def close_soon(self) -> None:
        """Thread-safe: close the sending side after the items already put."""
        self._outbox.put(self, _CLOSE)


@dataclass(frozen=True, slots=True)
class PrefillProgress:
    """Internal event: ``done`` of ``total`` prompt tokens processed (per prefill chunk)."""

    done: int
    total: int


@dataclass(frozen=True, slots=True)
class TokenTick:
    """Internal event: a token was generated that produced no text to send yet."""


TOKEN_TICK = TokenTick()

#: a stream's text reaches its consumer at most this often (its first token at once): a model
#: faster than 1 / interval tokens per second sends a few tokens per event, which saves
#: the Trio thread a wake-up, a relay and an HTTP write per token
STREAM_INTERVAL_S = 0.010


@dataclass(slots=True)
class GenerationStats:
    """What happened to one generation; times are ``time.monotonic()`` (comparable across threads).

    Written by the MLX thread while the job runs (plain ints and floats only),
    except ``enqueued_at`` and ``cancel_requested_at``, which the Trio side
    writes. Read them after the job has ended.
    """

    request_id: str | None = None
    enqueued_at: float = 0.0
    started_at: float | None = None
    first_token_at: float | None = None
    ended_at: float | None = None
    prompt_tokens: int = 0
    prefill_done: int = 0
    prefill_chunks: int = 0
    completion_tokens: int = 0
    cancel_requested_at: float | None = None
    #: tokens the MLX thread produced after the cancel was requested (at most one in flight)
    tokens_after_cancel: int = 0
    #: stop | length | cancelled | withdrawn (left the queue unstarted) | error
    outcome: str | None = None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.enqueued_at

    @property
    def cancel_latency_s(self) -> float | None:
        """Seconds from the cancel request until the MLX thread was free again."""
        if self.cancel_requested_at is None or self.ended_at is None:
            return None
        return max(0.0, self.ended_at - self.cancel_requested_at)

    @property
    def decode_tps(self) -> float | None:
        if self.first_token_at is None or self.ended_at is None or self.completion_tokens < 2:
            return None
        span = self.ended_at - self.first_token_at
        return (self.completion_tokens - 1) / span if span > 0 else None


@dataclass(eq=False)
class Job:
    """One generation request as a scheduler sees it."""

    request: GenerationRequest
    sink: Sink
    cancel: threading.Event = field(default_factory=threading.Event)
    stats: GenerationStats = field(default_factory=GenerationStats)
    #: engine-specific prepared input (decoded images, ...)
    data: Any = None
    #: KV tokens this job may grow to (prompt + max_tokens): what batch admission reserves
    kv_tokens: int = 0

    #: text events not sent yet, and when text was last sent (MLX thread only; see emit)
    _held: list[TextDelta | TokenTick] = field(default_factory=list, init=False, repr=False)
    _sent_at: float | None = field(default=None, init=False, repr=False)

    def emit(self, item: object) -> None:
        """Send an event to the consumer (from the thread that runs the job).

        Text (``TextDelta``, ``TokenTick``) is held while the last text went out less
        than :data:`STREAM_INTERVAL_S` ago, then sent as one delta; any other event
        sends the held text first, so the order never changes.
        """
        if isinstance(item, (TextDelta, TokenTick)):
            self._held.append(item)
            if self._sent_at is not None and time.monotonic() - self._sent_at < STREAM_INTERVAL_S:
                return
            self.flush()
            return
        self.flush()
        self.sink.put(item)

    def flush(self) -> None:
        """Send the held text now (one ``TextDelta``, or one ``TokenTick`` if it has none)."""
        held = self._held
        if not held:
            return
        self._held = []
        deltas = [h for h in held if isinstance(h, TextDelta)]
        if not deltas:
            self.sink.put(TOKEN_TICK)
            return
        delta = deltas[0] if len(deltas) == 1 else TextDelta(
            "".join(d.text for d in deltas), tuple(lp for d in deltas for lp in d.logprobs)
        )
        if delta.text:
            self._sent_at = time.monotonic()
        self.sink.put(delta)

    def request_cancel(self) -> None:
        """Ask the MLX thread to stop this job (within one token / one prefill chunk)."""
        if not self.cancel.is_set():
            if self.stats.ended_at is None:
                self.stats.cancel_requested_at = time.monotonic()
            self.cancel.set()
