"""What residency management costs per request, measured on the real Manager with FakeEngine.

1. acquire+release of a resident model, one task in a loop (ops/s), and with
   many concurrent tasks;
2. the time to resolve 1,000 concurrent acquires of one cold model (one shared
   load with a zero-second fake load: the figure is the manager's own work);
What the journal adds to acquire+release is measured by ``bench/journal.py``.

Run: ``.venv/bin/python bench/manager_overhead.py [--seconds 3]``.
Results are printed as a Markdown table and written to bench/results/manager_overhead.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as a script, bench/ is sys.path[0], and a script there named like a standard
# library module would shadow it: import from the repository instead.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse
import datetime as dt
import platform
import time

import trio

from mlxd.engines.fake import FakeFleet, FakeModel
from mlxd.residency.manager import Manager
from mlxd.units import GIB
from tests.support.harness import make_config


def _manager() -> Manager:
    fleet = FakeFleet()
    fleet.add(FakeModel("a", GIB, load_seconds=0.0))
    return Manager(make_config({"a": 1}, 4, load_seconds=0.0), fleet)


async def acquire_release(manager: Manager, seconds: float, tasks: int) -> tuple[int, float]:
    """``tasks`` tasks acquire and release model ``a`` for ``seconds``: (ops, elapsed)."""
    count = 0
    deadline = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal count
        while time.perf_counter() < deadline:
            lease = await manager.acquire("a")
            lease.release()
            count += 1
            await trio.lowlevel.checkpoint()

    t0 = time.perf_counter()
    async with trio.open_nursery() as workers:
        for _ in range(tasks):
            workers.start_soon(worker)
    return count, time.perf_counter() - t0


async def acquire_release_ops(seconds: float, tasks: int) -> float:
    manager = _manager()
    async with trio.open_nursery() as nursery:
        await nursery.start(manager.run)
        await manager.load("a")
        count, elapsed = await acquire_release(manager, seconds, tasks)
        nursery.cancel_scope.cancel()
    return count / elapsed


async def cold_burst_seconds(n: int) -> float:
    manager = _manager()
    async with trio.open_nursery() as nursery:
        await nursery.start(manager.run)
        got = 0
        t0 = time.perf_counter()

        async def one() -> None:
            nonlocal got
            lease = await manager.acquire("a")
            got += 1
            lease.release()

        async with trio.open_nursery() as burst:
            for _ in range(n):
                burst.start_soon(one)
        elapsed = time.perf_counter() - t0
        assert got == n and manager.counters["loads"] == 1
        nursery.cancel_scope.cancel()
    return elapsed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=3.0, help="duration of each throughput run")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "manager_overhead.md"))
    args = ap.parse_args()

    rows: list[tuple[str, str]] = []
    one = trio.run(acquire_release_ops, args.seconds, 1)
    rows.append(("acquire+release, resident model, 1 task", f"{one:,.0f} ops/s"))
    many = trio.run(acquire_release_ops, args.seconds, 8)
    rows.append(("acquire+release, resident model, 8 tasks", f"{many:,.0f} ops/s"))
    burst = trio.run(cold_burst_seconds, 1000)
    rows.append(("1,000 concurrent acquires of a cold model (one load)", f"{burst * 1000:.1f} ms"))
    header = (
        f"# Manager overhead\n\nMachine: {platform.machine()}, {platform.processor() or 'cpu'}, "
        f"Python {platform.python_version()}, {platform.system()}; "
        f"date {dt.date.today().isoformat()}; command: `python bench/manager_overhead.py"
        f" --seconds {args.seconds:g}`\n\n"
    )
    table = "| measurement | result |\n|---|---|\n" + "".join(f"| {a} | {b} |\n" for a, b in rows)
    print(header + table)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(header + table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
