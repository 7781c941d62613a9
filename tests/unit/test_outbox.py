"""The outbox that carries MLX-thread events into Trio never starves the event loop."""

from __future__ import annotations

import trio

from mlxd.engines.runtime.jobs import Outbox


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
    seen: set[int] = set()
    with trio.fail_after(10):
        while count < 1000:  # this task runs between drains, so it sees counts in between
            seen.add(count)
            await trio.lowlevel.checkpoint()
    assert count == 1000
    assert len({n for n in seen if 0 < n < 1000}) > 100  # ~500 drains of 2 calls each
