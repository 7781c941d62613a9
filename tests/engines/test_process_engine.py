"""``isolation: process``: the engine in a worker process, behind the same Engine protocol.

Most tests host the fake engine in the worker (a real process and pipe, no MLX
import: fast); one hosts the real mlx-lm engine and compares its output with
the same engine on a thread. Real time throughout (a process, like a thread,
lets Trio's virtual clock jump).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import psutil
import pytest
import trio

from mlxd.config import FakeSettings, ModelConfig
from mlxd.engines.base import Finished, LoadProgress, TextDelta
from mlxd.engines.mlx_text import MlxTextEngine
from mlxd.engines.workers.process import CANCEL_GRACE_S, ProcessEngine
from mlxd.engines.workers.wire import error_from_wire, error_to_wire
from mlxd.engines.workers.worker_process import Workers, describe_exit
from mlxd.errors import (
    EngineDied,
    EngineError,
    InvalidRequest,
    LoadFailed,
    ModelNotFound,
    Overloaded,
)
from tests.engines.mlx_helpers import collect, completion, tiny_config
from tests.support.tasks import worker_tasks

LONG = completion("hello", max_tokens=100_000)


def fake(name: str = "p", **settings: object) -> ModelConfig:
    fs = FakeSettings(**{"load_seconds": 0.0, "tokens_per_second": 200.0, **settings})  # type: ignore[arg-type]
    return ModelConfig(
        name=name, source=f"fake:{name}", engine="fake", isolation="process",
        estimated_memory_bytes=1 << 20, fake=fs,
    )


async def loaded(model: ModelConfig, workers: Workers) -> ProcessEngine:
    engine = ProcessEngine(model, workers)
    phases: list[str] = []
    await engine.load(lambda p: phases.append(p.phase))
    assert "done" in phases
    return engine


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


async def test_the_engine_runs_in_a_worker_and_stops_with_it(workers: Workers) -> None:
    engine = await loaded(fake(), workers)
    [pid] = engine.pids()
    assert pid != os.getpid() and not gone(pid)
    assert engine.measured_bytes() == 1 << 20
    text, fin, _ = await collect(engine, completion("a b c", max_tokens=5))  # type: ignore[arg-type]
    assert fin == Finished("length", 3, 5) and text.startswith("This is mlxd")
    await engine.stop()
    assert engine.pids() == [] and gone(pid)


async def test_a_stream_left_midway_is_cancelled_and_the_next_one_runs(workers: Workers) -> None:
    engine = await loaded(fake(), workers)
    try:
        with trio.CancelScope() as scope:
            async for ev in engine.generate(LONG):
                if isinstance(ev, TextDelta):
                    scope.cancel()
        assert engine.queue_depth() == 0
        _, fin, _ = await collect(engine, completion("x", max_tokens=3))  # type: ignore[arg-type]
        assert fin.completion_tokens == 3
    finally:
        await engine.stop()


def test_errors_cross_the_pipe_as_their_own_class() -> None:
    for error in (
        InvalidRequest("bad", param="messages"),
        Overloaded("busy", retry_after=3.0),
        ModelNotFound("m"),
    ):
        back = error_from_wire(error_to_wire(error, "ctx"))
        assert type(back) is type(error)
        assert (back.message, back.param, back.retry_after) == (
            error.message, error.param, error.retry_after
        )
    other = error_from_wire(error_to_wire(ValueError("boom\nmore"), "m: generation failed"))
    assert type(other) is EngineError and other.message == "m: generation failed: ValueError: boom"


async def test_a_load_that_fails_in_the_worker_is_a_load_failure(workers: Workers) -> None:
    engine = ProcessEngine(fake(fail_loads=(1,)), workers)
    with pytest.raises(LoadFailed, match="scripted failure of load 1"):
        await engine.load(lambda p: None)
    await engine.stop()
    assert engine.pids() == []


@pytest.mark.parametrize(
    ("how", "death"),
    [("kill", "killed by SIGKILL"), ("abort", "killed by SIGABRT (abort)")],
)
async def test_a_worker_that_dies_mid_stream_fails_the_stream_and_reports_its_death(
    how: str, death: str, monkeypatch: pytest.MonkeyPatch, workers: Workers
) -> None:
    if how == "abort":
        monkeypatch.setenv("MLXD_CRASH_AT", "worker.token:3=abort")
    engine = await loaded(fake(), workers)
    [pid] = engine.pids()
    seen = 0
    with pytest.raises(EngineDied) as exc:
        async for ev in engine.generate(LONG):
            seen += isinstance(ev, TextDelta)
            if how == "kill" and seen == 2:
                os.kill(pid, signal.SIGKILL)
    assert exc.value.code == "engine_died" and exc.value.retry_after
    with trio.fail_after(10):
        assert await engine.wait_died() == f"the engine process {death}"
    assert gone(pid)
    with pytest.raises(EngineDied):
        await collect(engine, LONG)
    await engine.stop()  # a dead engine stops at once


async def test_a_load_that_ignores_cancellation_is_killed_after_the_grace(
    monkeypatch: pytest.MonkeyPatch, workers: Workers
) -> None:
    """The worker stalls after loading (its memory held), deaf to cancel_load: stop() kills it."""
    monkeypatch.setenv("MLXD_CRASH_AT", "worker.loaded=stall")
    engine = ProcessEngine(fake(), workers)
    phases: list[LoadProgress] = []
    done = trio.Event()

    def progress(p: LoadProgress) -> None:
        phases.append(p)
        if p.phase == "done":
            done.set()

    with trio.CancelScope() as scope:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(engine.load, progress)
            await done.wait()  # the engine has loaded in the worker; the reply never comes
            [pid] = engine.pids()
            scope.cancel()
    t0 = time.monotonic()
    await engine.stop()
    took = time.monotonic() - t0
    assert gone(pid)
    assert CANCEL_GRACE_S <= took < CANCEL_GRACE_S + 1.0


async def test_the_owners_exit_kills_every_worker_and_leaves_no_task() -> None:
    """Workers still running when their owner exits (a loaded engine never stopped, and the
    spare) are killed and reaped with it: no process alive, no task left in the run."""
    owner = Workers()
    async with trio.open_nursery() as nursery:
        await nursery.start(owner.run)
        engine = await loaded(fake(), owner)
        await owner.refill()
        pids = [*engine.pids(), owner.spare_pid()]
        assert None not in pids and not any(gone(p) for p in pids if p is not None)
        assert worker_tasks() == ["mlxd worker p the engine process",
                                          "mlxd worker spare the engine process"]
        nursery.cancel_scope.cancel()
    assert all(gone(p) for p in pids if p is not None)
    assert worker_tasks() == [] and engine.pids() == []
    with pytest.raises(LoadFailed, match="not running them"):  # its owner has exited
        await loaded(fake("late"), owner)


def test_exit_descriptions() -> None:
    assert describe_exit(-9) == "killed by SIGKILL"
    assert describe_exit(-6) == "killed by SIGABRT (abort)"
    assert describe_exit(3) == "exited with status 3"


@pytest.mark.mlx
async def test_the_mlx_engine_in_a_worker_answers_as_on_a_thread(
    tiny_model_dir: Path, workers: Workers
) -> None:
    """The same engine class, hosted unchanged: identical greedy output, measured in the worker."""
    requests = [completion(p, max_tokens=12, temperature=0.0) for p in ("once upon", "the cat", "a b c")]
    thread = MlxTextEngine(tiny_config(tiny_model_dir))
    await thread.load(lambda p: None)
    try:
        expected = [await collect(thread, r) for r in requests]
    finally:
        await thread.stop()
    engine = await loaded(tiny_config(tiny_model_dir, isolation="process"), workers)
    try:
        assert engine.memory_source == "active_delta"
        # within 1 KiB: the first load on a (pooled) MLX thread also makes its 8-byte random key
        assert abs((engine.measured_bytes() or 0) - (thread.measured_bytes() or 0)) <= 1024
        for r, (text, fin, _) in zip(requests, expected, strict=True):
            got_text, got_fin, _ = await collect(engine, r)  # type: ignore[arg-type]
            assert (got_text, got_fin) == (text, fin)
        with pytest.raises(InvalidRequest, match="max_tokens"):  # raised in the worker
            await collect(engine, completion("x", max_tokens=0))  # type: ignore[arg-type]
        # the load left a spare worker (mlx-lm imported): the next load takes it
        spare = workers.spare_pid()
        assert spare is not None and spare not in engine.pids()
        second = await loaded(tiny_config(tiny_model_dir, name="again", isolation="process"), workers)
        assert second.pids() == [spare]
        await second.stop()
    finally:
        await engine.stop()
