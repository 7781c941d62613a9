"""A batched mlx-lm model's KV peak reaches the journal's ``kv_peaks`` when its residency ends."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import trio

from mlxd.config import Config, ManagerConfig
from mlxd.engines import DefaultEngines
from mlxd.engines.base import Finished
from mlxd.engines.mlx_text import MlxTextEngine
from mlxd.journal.journal import Journal
from mlxd.journal.migrate import open_readonly
from mlxd.residency.manager import Manager
from tests.engines.mlx_helpers import completion, no_eos, tiny_config

pytestmark = pytest.mark.mlx

PROMPTS = ("the quick brown fox", "hello world", "once upon a time in a land far away")


async def _generate(manager: Manager, prompt: str, tokens: list[int]) -> None:
    """One completion of 24 tokens on a lease (the random model never ends on its own first)."""
    request = completion(prompt, max_tokens=24, logits_processors=(no_eos,))
    async with manager.lease("tiny") as lease:
        with lease.scope():
            async for event in lease.engine.generate(request):
                if isinstance(event, Finished):
                    tokens.append(event.completion_tokens)


async def test_generations_then_unload_and_shutdown_journal_one_peak_per_residency(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Tokens generated on a batched model, then an unload (and, on a second residency, a
    shutdown), journal one kv_peaks row each: 0 < peak <= the kv_cache its load committed."""
    model = tiny_config(tiny_model_dir, max_batch_size=4, estimated_memory_bytes=1 << 20)
    manager = Manager(Config(manager=ManagerConfig(1 << 30), models=(model,)), DefaultEngines())
    journal = Journal(tmp_path / "journal.db")
    tokens: list[int] = []
    bytes_per_token: list[int] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(journal.run)
        await journal.begin_run(os.getpid(), "test", None)
        manager.subscribe(journal.record)
        await nursery.start(manager.run)
        for prompts in (PROMPTS, PROMPTS[:1]):
            async with trio.open_nursery() as generations:
                for prompt in prompts:
                    generations.start_soon(_generate, manager, prompt, tokens)
            engine = manager.engine_of("tiny")
            assert isinstance(engine, MlxTextEngine) and engine.batch is not None
            bytes_per_token.append(engine.kv_bytes_per_token or 0)
            if prompts is PROMPTS:
                await manager.unload("tiny")
        assert await manager.shutdown(10.0)
        await journal.wait_committed()
        parts = manager.estimates.memory_parts("tiny")
        conn = open_readonly(journal.path)
        try:
            rows = conn.execute(
                "SELECT run_id, loaded_at, at, kv_peak_bytes, kv_budget_bytes, prompt_cache_bytes,"
                " prompt_cache_budget_bytes FROM kv_peaks WHERE model = 'tiny' ORDER BY at"
            ).fetchall()
            ends = conn.execute(
                "SELECT reason FROM transitions WHERE model = 'tiny' AND to_state = 'unloading'"
                " ORDER BY seq"
            ).fetchall()
        finally:
            conn.close()
        nursery.cancel_scope.cancel()
    assert tokens == [24] * 4
    assert [r[0] for r in ends] == ["admin", "shutdown"]
    assert len(rows) == 2
    assert parts["kv_cache"] > 0 and parts["prompt_cache"] > 0
    for (run_id, loaded_at, at, peak, budget, cached, cache_budget), per_token in zip(
        rows, bytes_per_token, strict=True
    ):
        assert run_id == journal.run_id and loaded_at <= at
        # at least one sequence's KV (mlx-lm allocates 256 tokens at a time), within the budget
        assert per_token > 0 and 256 * per_token <= peak <= budget
        assert budget == parts["kv_cache"] and cache_budget == parts["prompt_cache"]
        assert 0 < cached <= cache_budget  # the finished generations were kept for reuse


async def test_a_model_generating_one_at_a_time_reports_no_kv_usage(tiny_model_dir: Path) -> None:
    """With max_batch_size 1 the engine does not measure its KV: no usage, so no peak to journal."""
    eng = MlxTextEngine(tiny_config(tiny_model_dir, max_batch_size=1), prefill_step=8)
    await eng.load(lambda _p: None)
    try:
        assert eng.batch is None and eng.memory_usage() is None
    finally:
        await eng.stop()
