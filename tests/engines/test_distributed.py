"""``distributed:``: one model tensor-sharded over two ranks on 127.0.0.1 (mlx.distributed ring).

Each rank is a worker process running mlx-lm's sharded load; the daemon side
is one :class:`ProcessEngine`. The ranks' output equals one process's at
temperature 0; a generation left midway stops on both ranks (they agree, so
the next one runs); one rank killed ends the residency cleanly.
"""

from __future__ import annotations

import json
import os
import signal
import stat
from pathlib import Path

import psutil
import pytest
import trio

from mlxd.config import parse_config
from mlxd.config.model import ModelConfig
from mlxd.engines.base import TextDelta
from mlxd.engines.mlx_text import MlxTextEngine
from mlxd.engines.model_files.demo_model import write_demo_model
from mlxd.engines.workers.launch import SSH_ENV
from mlxd.engines.workers.process import ProcessEngine
from mlxd.engines.workers.worker_process import Workers
from mlxd.errors import EngineDied
from tests.engines.mlx_helpers import collect, completion, tiny_config

pytestmark = pytest.mark.mlx

PROMPTS = [
    "once upon a time", "the cat sat on the", "hello world", "a b c d", "one two three",
    "in the beginning", "it was a dark and", "to be or not to", "the quick brown fox",
    "lorem ipsum dolor", "call me", "all happy families", "it is a truth", "we the people",
    "the sky above the port", "many years later", "happy families are", "mother died today",
    "a screaming comes", "the man in black",
]


def distributed(path: Path, tmp: Path, **dist: object) -> ModelConfig:
    raw = {"name": "d", "path": str(path), "distributed": {"hosts": ["127.0.0.1", "127.0.0.1"], **dist}}
    return parse_config({"manager": {"memory_budget_gb": 4}, "models": [raw]}, path=tmp / "c.yaml").models[0]


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


async def greedy(engine: MlxTextEngine | ProcessEngine, prompts: list[str], n: int) -> list[str]:
    out = []
    for p in prompts:
        text, fin, _ = await collect(engine, completion(p, max_tokens=n, temperature=0.0))  # type: ignore[arg-type]
        assert fin.completion_tokens == n or fin.finish_reason == "stop"
        out.append(text)
    return out


async def two_ranks_equal_one_process(path: Path, tmp: Path, prompts: list[str], workers: Workers) -> None:
    single = MlxTextEngine(tiny_config(path))
    await single.load(lambda p: None)
    try:
        expected = await greedy(single, prompts, 16)
    finally:
        await single.stop()
    engine = ProcessEngine(distributed(path, tmp), workers)
    await engine.load(lambda p: None)
    try:
        assert len(engine.pids()) == 2
        share = engine.measured_bytes()
        assert share is not None and share < (single.measured_bytes() or 0)
        assert await greedy(engine, prompts, 16) == expected
        # left after two tokens: both ranks stop at the same token, the next runs
        with trio.CancelScope() as scope:
            seen = 0
            async for ev in engine.generate(completion("x y", max_tokens=10_000, temperature=0.7)):
                seen += isinstance(ev, TextDelta)
                if seen == 2:
                    scope.cancel()
        assert await greedy(engine, prompts[:2], 16) == expected[:2]
    finally:
        await engine.stop()
    assert engine.pids() == []


async def test_two_ranks_serve_the_tiny_model_like_one_process(
    tiny_model_dir: Path, tmp_path: Path, workers: Workers
) -> None:
    await two_ranks_equal_one_process(tiny_model_dir, tmp_path, PROMPTS[:3], workers)


@pytest.mark.stress
async def test_two_ranks_serve_the_small_model_like_one_process(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path, workers: Workers
) -> None:
    path = tmp_path_factory.mktemp("models") / "small"
    write_demo_model(path, "small")
    await two_ranks_equal_one_process(path, tmp_path, PROMPTS, workers)


async def test_a_remote_rank_runs_through_ssh_and_its_death_ends_the_residency(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, workers: Workers
) -> None:
    """The ssh path end to end, with an ``ssh`` that runs the remote script here; then rank 1
    is killed mid-stream: the stream fails, rank 0 is killed too, the death is reported."""
    shim = tmp_path / "ssh"
    shim.write_text('#!/bin/bash\nwhile [ "$1" = "-o" ]; do shift 2; done\nshift\nexec bash -c "$1"\n')
    shim.chmod(shim.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv(SSH_ENV, str(shim))
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([{"ssh": "127.0.0.1", "ips": ["127.0.0.1"]},
                                    {"ssh": "far-away", "ips": ["127.0.0.1"]}]))
    raw = {"name": "d", "path": str(tiny_model_dir),
           "distributed": {"hostfile": str(hostfile), "port": 41000 + os.getpid() % 2000}}
    model = parse_config({"manager": {"memory_budget_gb": 4}, "models": [raw]}, path=tmp_path / "c.yaml").models[0]
    engine = ProcessEngine(model, workers)
    await engine.load(lambda p: None)
    try:
        assert [w["where"] for w in engine.describe()["workers"]] == ["local", "far-away"]
        _, fin, _ = await collect(engine, completion("hello", max_tokens=4, temperature=0.0))  # type: ignore[arg-type]
        assert fin.completion_tokens == 4
        rank0, rank1 = engine.pids()  # rank 1's is the "ssh" client's (the shim execs the worker)
        seen = 0
        with pytest.raises(EngineDied):
            async for ev in engine.generate(completion("x", max_tokens=60_000)):
                seen += isinstance(ev, TextDelta)
                if seen == 3:
                    os.kill(rank1, signal.SIGKILL)
        with trio.fail_after(10):
            assert await engine.wait_died() == "rank 1 (far-away) killed by SIGKILL"
        assert gone(rank0) and gone(rank1)
    finally:
        await engine.stop()
    assert engine.pids() == []
