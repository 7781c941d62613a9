"""The outbox that carries MLX-thread events into Trio never starves the event loop."""

from __future__ import annotations

import trio

from mlxd.engines.mlx_thread import Outbox


async def test_calls_that_keep_coming_let_other_tasks_run_between_drains() -> None:
    """A drain takes at most two passes; what keeps arriving waits for the next turn."""
    outbox = Outbox()
    count = 0

    def again() -> None:
        nonlocal count
        count += 1
        if count < 1000:
            outbox.call(again)  # each call queues the next, as a busy MLX thread would

    outbox.call(again)
    await trio.lowlevel.checkpoint()
    seen = count
    while count < 1000:
        await trio.lowlevel.checkpoint()
    assert 0 < seen < 1000
    assert count == 1000
