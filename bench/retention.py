"""Journal retention under load: the file stays under max_mb, and pruning barely delays live commits.

Two runs of the same workload, one after the other, each on a fresh journal
(``synchronous=FULL``, on the repository's disk): the real
:class:`~mlxd.residency.manager.Manager` with a resident fake model, and a real
:class:`~mlxd.journal.journal.Journal` subscribed, takes ``--leases``
acquire+release pairs (two records each) at a steady ``--rate`` per second;

* ``pruning``: ``journal.max_mb = --max-mb`` (``retain_days`` 0): once the file
  reaches its target, the writer prunes in slices for the rest of the run;
* ``no pruning``: no limit, the file grows.

Measured per run: the largest size of the database file and of its WAL
(sampled every 0.25 s), and the time from a record (``Journal.record``, at a
lease's release) to the moment the event loop learns that it is committed,
for every 10th lease. The latency is compared over the same leases (those
after pruning first ran in the pruning run): the acceptance is ``p99(pruning)
<= 1.2 x p99(no pruning)`` and a database file under ``1.1 x max_mb``.

Run (the full one, on a quiet machine; about 7 minutes at 5,000 leases/s):

    .venv/bin/python bench/retention.py --leases 1000000 --max-mb 50 --rate 5000

writes ``bench/results/retention.md``. ``tests/unit/test_retention_bench.py``
runs a small version; with ``--stress`` it runs the full one and asserts.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse
import bisect
import datetime as dt
import os
import shutil
import sqlite3
import time
from dataclasses import dataclass, field
from typing import Any

import trio

from bench.journal import machine
from bench.manager_overhead import _manager
from mlxd.journal.journal import Journal
from mlxd.units import MIB

RESULTS = Path(__file__).resolve().parent / "results"
WORKDIR = RESULTS / "retention-bench.tmp"
SAMPLE_EVERY = 10
TICK_S = 0.005
#: how many times a run looks whether pruning has begun (spread evenly over its leases)
PRUNING_CHECKS = 200


@dataclass
class Run:
    name: str
    leases: int
    seconds: float
    max_db_bytes: int = 0
    max_wal_bytes: int = 0
    max_total_bytes: int = 0
    #: (lease index, record-to-commit seconds), every SAMPLE_EVERY-th lease
    latencies: list[tuple[int, float]] = field(default_factory=list)
    #: the lease index at which pruning first ran (None: never)
    pruning_from: int | None = None
    events_pruned: int = 0
    commits: int = 0

    def latency(self, q: float, since: int = 0) -> float:
        values = sorted(s for i, s in self.latencies if i >= since)
        if not values:
            return float("nan")
        return values[min(len(values) - 1, int(q / 100 * len(values)))]


def _sizes(path: Path) -> tuple[int, int]:
    def size(p: Path) -> int:
        try:
            return p.stat().st_size
        except FileNotFoundError:
            return 0

    return size(path), size(Path(str(path) + "-wal"))


def _events_pruned(path: Path) -> int:
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return int(conn.execute("SELECT events_pruned FROM retention").fetchone()[0])
    except sqlite3.Error:
        return 0
    finally:
        conn.close()


async def _run(name: str, path: Path, leases: int, rate: float, max_mb: float) -> Run:
    journal = Journal(path, synchronous="full", max_mb=max_mb, retain_days=0)
    commits: list[tuple[float, int]] = []  # (time the loop heard, last seq committed)
    on_batch = journal._on_batch

    def heard(last: int, rejected: list[tuple[int, str]], n: int) -> None:
        commits.append((time.perf_counter(), last))
        on_batch(last, rejected, n)

    journal._on_batch = heard  # type: ignore[method-assign]
    run = Run(name, leases, 0.0)
    recorded: list[tuple[int, float, int]] = []  # (lease index, time, seq)
    done = trio.Event()

    async def watch_sizes() -> None:
        while not done.is_set():
            db, wal = _sizes(path)
            run.max_db_bytes = max(run.max_db_bytes, db)
            run.max_wal_bytes = max(run.max_wal_bytes, wal)
            run.max_total_bytes = max(run.max_total_bytes, db + wal)
            with trio.move_on_after(0.25):
                await done.wait()

    async with trio.open_nursery() as nursery:
        await nursery.start(journal.run)
        await journal.begin_run(os.getpid(), "bench", None)
        manager = _manager()
        manager.subscribe(journal.record)
        await nursery.start(manager.run)
        await manager.load("a")
        await journal.wait_committed()
        nursery.start_soon(watch_sizes)
        per_tick = max(1, round(rate * TICK_S))
        # When pruning first ran, found by lease count (not by a timer a loaded machine delays)
        check_every = max(1, leases // PRUNING_CHECKS) if max_mb > 0 else 0
        t0 = time.perf_counter()
        for i in range(leases):
            if i % per_tick == 0:
                await trio.sleep_until(trio.current_time() + max(0.0, t0 + i / rate - time.perf_counter()))
            lease = await manager.acquire("a")
            lease.release()
            if i % SAMPLE_EVERY == 0:
                recorded.append((i, time.perf_counter(), journal.last_seq))
            checks = check_every and i % check_every == 0 and run.pruning_from is None
            if checks and _events_pruned(path) > 0:
                run.pruning_from = i
        await journal.wait_committed()
        if check_every and run.pruning_from is None and _events_pruned(path) > 0:
            # a busy machine's writer pruned only after the last check: from the last lease on
            run.pruning_from = leases - 1
        run.seconds = time.perf_counter() - t0
        done.set()
        run.commits = journal.commit_count
        nursery.cancel_scope.cancel()
    heard_at = [t for t, _ in commits]
    heard_seq = [s for _, s in commits]
    for i, t, seq in recorded:
        k = bisect.bisect_left(heard_seq, seq)
        if k < len(heard_at):
            run.latencies.append((i, max(0.0, heard_at[k] - t)))
    db, wal = _sizes(path)
    run.max_db_bytes = max(run.max_db_bytes, db)
    run.max_total_bytes = max(run.max_total_bytes, db + wal)
    run.events_pruned = _events_pruned(path)
    return run


def measure(leases: int, rate: float, max_mb: float, directory: Path) -> tuple[Run, Run]:
    """(pruning, no pruning) over the same workload; each on a fresh file in ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    out = []
    for name, limit in (("pruning", max_mb), ("no pruning", 0.0)):
        path = directory / f"{name.replace(' ', '-')}.db"
        for suffix in ("", "-wal", "-shm", ".lock"):
            Path(str(path) + suffix).unlink(missing_ok=True)
        out.append(trio.run(_run, name, path, leases, rate, limit))
    return out[0], out[1]


def compare(pruning: Run, plain: Run) -> dict[str, Any]:
    since = pruning.pruning_from if pruning.pruning_from is not None else 0
    p99_on, p99_off = pruning.latency(99, since), plain.latency(99, since)
    return {"since": since, "p99_on": p99_on, "p99_off": p99_off, "ratio": p99_on / p99_off}


def report(pruning: Run, plain: Run, rate: float, max_mb: float) -> str:
    c = compare(pruning, plain)
    ms = 1000.0
    rows = [
        "| run | leases | seconds | max db file | max WAL | max db+WAL | events pruned | commits "
        "| record->commit p50 / p99 / max (all) | p99 from lease {since:,} |".format(since=c["since"]),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in (pruning, plain):
        rows.append(
            f"| {r.name} | {r.leases:,} | {r.seconds:.0f} | {r.max_db_bytes / MIB:.1f} MiB "
            f"| {r.max_wal_bytes / MIB:.1f} MiB | {r.max_total_bytes / MIB:.1f} MiB "
            f"| {r.events_pruned:,} | {r.commits:,} "
            f"| {r.latency(50) * ms:.1f} / {r.latency(99) * ms:.1f} / {max(s for _, s in r.latencies) * ms:.1f} ms "
            f"| {r.latency(99, c['since']) * ms:.1f} ms |"
        )
    verdict = (
        f"p99 while pruning / without: **{c['ratio']:.2f}** (acceptance: <= 1.20); "
        f"largest database file **{pruning.max_db_bytes / MIB:.1f} MiB** with max_mb {max_mb:g} "
        f"(acceptance: under {max_mb * 1.1:g} MiB)."
    )
    return "\n".join(rows) + "\n\n" + verdict


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--leases", type=int, default=1_000_000)
    ap.add_argument("--rate", type=float, default=5000.0, help="leases per second")
    ap.add_argument("--max-mb", type=float, default=50.0)
    args = ap.parse_args()
    try:
        pruning, plain = measure(args.leases, args.rate, args.max_mb, WORKDIR)
    finally:
        shutil.rmtree(WORKDIR, ignore_errors=True)
    text = report(pruning, plain, args.rate, args.max_mb)
    print(text)
    (RESULTS / "retention.md").write_text(
        "# Journal retention under load\n\n"
        f"Machine: {machine()}; date {dt.date.today()}; command: "
        f"`python bench/retention.py --leases {args.leases} --max-mb {args.max_mb:g} --rate {args.rate:g}`\n\n"
        f"{args.leases:,} acquire+release pairs of a resident fake model through the real manager "
        f"and journal (synchronous=FULL), {args.rate:,.0f} a second; the same workload with "
        f"journal.max_mb {args.max_mb:g} and without a limit. Latency: from a lease's release "
        "record to the event loop hearing it is committed, every 10th lease.\n\n" + text + "\n"
    )


if __name__ == "__main__":
    main()
