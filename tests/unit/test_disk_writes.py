"""The idle write's timer against the batch loop's turns: a superseded timer, a residency that ended."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest

from mlxd.engines.runtime import memory
from mlxd.engines.runtime.jobs import Outbox
from mlxd.engines.scheduling.batch_loop import BatchLoop
from mlxd.errors import EngineError


def _loop(submit: Callable[[Callable[[], None]], None]) -> BatchLoop:
    """A batch loop whose MLX thread is ``submit`` (no model: these tests never reach one)."""

    def no_model() -> tuple[Any, Any]:
        raise AssertionError("the loop reached for the model")

    def no_output(request: Any) -> Any:
        raise AssertionError("the loop made an output")

    return BatchLoop(submit, model=no_model, max_batch=2, prefill_step=64, prompt_cache_bytes=0,
                     on_done=lambda job, error: None, outbox=Outbox(), output=no_output)


def _fire(loop: BatchLoop, timer: threading.Timer) -> list[BaseException]:
    """Run ``timer`` (its function: the loop's idle write) now, on its own thread; what it raised."""
    raised: list[BaseException] = []
    hook = threading.excepthook

    def record(args: Any) -> None:
        raised.append(args.exc_value)

    threading.excepthook = record
    try:
        timer.start()
        timer.join(10)
    finally:
        threading.excepthook = hook
    return raised


async def test_a_superseded_timer_neither_writes_nor_forgets_the_newer_one() -> None:
    """A timer that fired while a job came and went does not start the write early, and the
    newer timer the loop armed since stays the one the next job disarms."""
    queued: list[Callable[[], None]] = []
    loop = _loop(queued.append)
    stale = threading.Timer(0, loop._persist_when_idle)
    newer = threading.Timer(3600, loop._persist_when_idle)
    loop._persist_timer = newer  # the loop went idle again after the job: the newer one is armed
    assert _fire(loop, stale) == []
    assert queued == []
    assert loop._persist_timer is newer and not loop._running
    loop._disarm_persist()  # a job arrives: the newer timer is cancelled, not left to fire
    assert newer.finished.is_set()


async def test_the_timer_of_a_residency_that_ended_leaves_the_loop_stopped() -> None:
    """A timer that passed its checks as the residency ended (its MLX thread closed) raises
    nothing on its thread and leaves the loop not running."""

    def closed(fn: Callable[[], None]) -> None:
        raise EngineError("model: the MLX thread is closed")

    loop = _loop(closed)
    timer = threading.Timer(0, loop._persist_when_idle)
    loop._persist_timer = timer
    assert _fire(loop, timer) == []
    assert loop._persist_timer is None and not loop._running


async def test_an_idle_write_queued_behind_the_residency_end_runs_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The write's turn, queued on the MLX thread behind the residency's end, neither writes nor
    runs the loop (that thread may be the next residency's by then)."""
    calls: list[int] = []
    monkeypatch.setattr(memory, "after_generation", lambda tokens: calls.append(tokens) or False)
    queued: list[Callable[[], None]] = []
    loop = _loop(queued.append)
    timer = threading.Timer(0, loop._persist_when_idle)
    loop._persist_timer = timer
    assert _fire(loop, timer) == []
    assert len(queued) == 1 and loop._running
    loop.close()  # the residency ends before the queued turn runs
    queued[0]()
    assert calls == [] and not loop._running
